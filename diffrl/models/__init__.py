"""Model families: what differs between diffusion model families, and nothing else.

A family is one file with one class, constructed around a loaded diffusers pipeline (`model_family(pipe)`). The
samplers' shared loop, every trainer and the steering processes talk to it instead of to `pipe.unet` or
`pipe.transformer`, so a sampler or a trainer is written once for all the families it can run on.

What a family provides (composition, not inheritance: the classes share no base):

    name, flow                         its name; whether it is a flow-matching family (the flow sampler steps it)
    matches(pipe)                      (static) whether a pipeline is of this family
    denoiser                           the network the trainers fine-tune (`pipe.unet`, `pipe.transformer`)
    latent_shape(height, width)        `(C, h, w)` of its (unpacked) latents and the image size, with defaults
    uses_cfg(guidance_scale)           whether guidance runs as an unconditional batch half
    encode(prompts, guidance_scale=, ...)  `(Conditioning, prompts)`: the text conditioning, without gradients
    model_output(x, t, cond, guidance_scale, dtype, detach_uncond=)  the guided denoiser output in fp32
    decode(latents)                    images `[B, 3, H, W]` in [0, 1], differentiable
    process                            the forward process: `train_timesteps`, `add_noise`, `target`
    schedule_kwargs(num_steps, (h, w)) (flow families) what the pipeline passes to `set_timesteps`
    default_guidance_scale             (flow families) the pipeline's default guidance
    denoiser_class, sampling_size      the denoiser class model_index.json names; (static) the size rule, a pure
                                       function of the pipeline's, the denoiser's and the VAE's configs and the size
                                       asked, that `latent_shape` and the check of a recipe's size before loading
                                       (`diffrl.pipelines.check_sampling_size`) both call

Families: `unet.UNetFamily` (SD 1.x/2.x/XL, LCM), `sd3.SD3Family` (SD3/3.5), `flux.FluxFamily` (FLUX.1),
`wan.WanFamily` (Wan 2.1 text-to-video: latents `[B, C, F, h, w]`, `decode` returns frames `[B, F, 3, H, W]`),
`qwen_image.QwenImageFamily` (Qwen-Image), `flux2.Flux2Family` (FLUX.2-dev).
"""

from __future__ import annotations

from diffrl.errors import UserError
from diffrl.models.base import SamplingSize, kl_vae_factor
from diffrl.models.flux import FluxFamily
from diffrl.models.flux2 import Flux2Family
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.sd3 import SD3Family
from diffrl.models.unet import UNetFamily
from diffrl.models.wan import WanFamily

FAMILIES = (UNetFamily, SD3Family, FluxFamily, WanFamily, QwenImageFamily, Flux2Family)
__all__ = ["FAMILIES", "SamplingSize", "kl_vae_factor", "model_family", "size_rule"]


def size_rule(denoiser_class: str):
    """The size rule (`<family>.sampling_size`) of the family whose denoiser is `denoiser_class` (as a folder's
    model_index.json names it), None for a class no family has."""
    return next((family.sampling_size for family in FAMILIES if family.denoiser_class == denoiser_class), None)


def model_family(pipe):
    """The family object of a loaded pipeline; a one-line error naming the supported families otherwise."""
    for family in FAMILIES:
        if family.matches(pipe):
            return family(pipe)
    raise UserError(f"{type(pipe).__name__} is not a supported model family; diffrl runs "
                    f"{', '.join(f.name for f in FAMILIES)} pipelines")
