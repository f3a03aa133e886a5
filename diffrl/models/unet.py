"""The DDPM-UNet family: Stable Diffusion 1.x/2.x/XL and latent consistency models (ε, v or x0 prediction).

What differs from the other families, and only that: the components (`pipe.unet`, `pipe.vae`, `encode_prompt`),
the latent shape from the UNet's `sample_size`, the text conditioning (SDXL's pooled embedding and size
micro-conditioning; LCM's guidance-scale embedding instead of a CFG batch), the guided UNet call, and the
variance-preserving forward process with the model's own training target (Ho et al. 2020, eq. 4; Salimans & Ho
2022, §4 for v), as diffusers' DDPM-family schedulers define them, with ᾱ_t = `alphas_cumprod[t]`:

    x_t = √ᾱ_t · x0 + √(1 − ᾱ_t) · ε                       (`DDPMScheduler.add_noise`)
    v   = √ᾱ_t · ε  − √(1 − ᾱ_t) · x0                      (`DDPMScheduler.get_velocity`)

The inverse map (x̂0 from a model output) is `samplers.base.pred_x0_and_eps`, the samplers' step math.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diffrl.errors import UserError
from diffrl.models.base import (
    SIZE_ARGUMENTS,
    Conditioning,
    SamplingSize,
    checked_size,
    combine_guidance,
    component_config,
    decode_latents,
    kl_vae_factor,
    module_dtype,
    prompt_list,
    prompt_strings,
    run_denoiser,
    with_uncond,
)

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


# ----------------------------------------------------------------------------------------------------------
# The forward process and the training target (pure math)


def _coefficients(alpha_bar: float | torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """√ᾱ and √(1 − ᾱ) shaped to broadcast against `like` `[B, ...]`: a number or 0-d tensor applies to every row,
    a `[B]` tensor gives one ᾱ per row."""
    alpha_bar = torch.as_tensor(alpha_bar, device=like.device).to(like.dtype)
    if alpha_bar.ndim == 1:
        alpha_bar = alpha_bar.reshape(-1, *([1] * (like.ndim - 1)))
    elif alpha_bar.ndim > 1:
        raise ValueError(f"alpha_bar must be a number, a 0-d tensor or one value per row [B]; got {alpha_bar.shape}")
    return alpha_bar.sqrt(), (1 - alpha_bar).sqrt()


def add_noise(x0: torch.Tensor, noise: torch.Tensor, alpha_bar: float | torch.Tensor) -> torch.Tensor:
    """Noise clean latents to level ᾱ: `x_t = √ᾱ · x0 + √(1 − ᾱ) · ε`.

    Args:
        x0 (`torch.Tensor` of shape `[B, C, h, w]`): clean latents (gradients flow through, if they carry any).
        noise (`torch.Tensor` of the same shape): ε ~ N(0, I).
        alpha_bar (`float` or `torch.Tensor` 0-d or `[B]`): ᾱ_t, e.g. `scheduler.alphas_cumprod[timesteps]`.

    Returns:
        `torch.Tensor` `[B, C, h, w]`: x_t, in `x0`'s dtype.
    """
    sqrt_alpha, sqrt_beta = _coefficients(alpha_bar, x0)
    return sqrt_alpha * x0 + sqrt_beta * noise


def denoising_target(
    x0: torch.Tensor, noise: torch.Tensor, alpha_bar: float | torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """What the model is trained to output at x_t = `add_noise(x0, noise, alpha_bar)`.

    `"epsilon"`: ε; `"v_prediction"`: v = √ᾱ · ε − √(1 − ᾱ) · x0; `"sample"`: x0 — the three
    `scheduler.config.prediction_type` values of diffusers.
    """
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        sqrt_alpha, sqrt_beta = _coefficients(alpha_bar, x0)
        return sqrt_alpha * noise - sqrt_beta * x0
    if prediction_type == "sample":
        return x0
    raise ValueError(f"prediction_type {prediction_type!r} is not one of {PREDICTION_TYPES}")


def _rows(tensor: torch.Tensor | None, batch: int, name: str) -> torch.Tensor | None:
    """Broadcast a one-row precomputed embedding (e.g. the cached empty prompt) to `batch` rows."""
    if tensor is None or tensor.shape[0] == batch:
        return tensor
    if tensor.shape[0] == 1:
        return tensor.expand(batch, *tensor.shape[1:])
    raise UserError(f"{name} has {tensor.shape[0]} rows but the batch has {batch}; pass one row or one per sample")


class DDPMProcess:
    """The forward process of a DDPM-family scheduler, for trainers that noise clean latents themselves (RAFT's
    denoising loss, DRaFT-LV's re-noising, Diffusion-DPO): model timesteps are integers t < num_train_timesteps."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.prediction_type = scheduler.config.get("prediction_type", "epsilon")

    def train_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`[batch]` model timesteps drawn uniformly from the scheduler's training steps (CPU, int64)."""
        return torch.randint(0, len(self.scheduler.alphas_cumprod), (batch,), generator=generator)

    def alpha_bar(self, t: torch.Tensor, device) -> torch.Tensor:
        return self.scheduler.alphas_cumprod.to(device=device, dtype=torch.float32)[torch.as_tensor(t).to(device)]

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t at model timesteps `t` (`[B]` or one for all): √ᾱ_t · x0 + √(1 − ᾱ_t) · ε."""
        return add_noise(x0, noise, self.alpha_bar(t, x0.device))

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The regression target at `add_noise(x0, noise, t)`: ε, v or x0 per the scheduler's `prediction_type`."""
        return denoising_target(x0, noise, self.alpha_bar(t, x0.device), self.prediction_type)


# ----------------------------------------------------------------------------------------------------------
# The family


def sampling_size(index: Mapping, unet: Mapping, vae: Mapping, height: int | None = None, width: int | None = None,
                  num_frames: int | None = None, *, keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The UNet family's size rule, from the pipeline's (`index`: its config or model_index.json), the UNet's and
    the VAE's configs: each side the caller's, else the folder's `_diffrl_height` / `_diffrl_width`, else the UNet's
    `sample_size` × the VAE factor; a multiple of the VAE factor (what `StableDiffusionPipeline.check_inputs` asks).
    `UNetFamily.latent_shape` calls it with the loaded pipeline's configs, `diffrl.pipelines.check_sampling_size`
    with the folder's, so a size is refused (`UserError`, one line naming `keys`) by both or by neither."""
    factor = kl_vae_factor(vae)
    size = unet["sample_size"]
    size_h, size_w = (size, size) if isinstance(size, int) else size
    return checked_size(index, height, width, num_frames, model=f"a UNet pipeline (VAE factor {factor})",
                        default=(size_h * factor, size_w * factor), multiple=factor, keys=keys)


class UNetFamily:
    """A DDPM-UNet pipeline (`StableDiffusionPipeline`, `StableDiffusionXLPipeline`, `LatentConsistencyModelPipeline`,
    or any pipeline with their `unet`, `vae`, `encode_prompt` and a DDPM-family scheduler)."""

    name = "ddpm_unet"
    flow = False  # the samplers DDIM and LCM step it; the flow sampler needs a flow family
    denoiser_class = "UNet2DConditionModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)

    def __init__(self, pipe):
        self.pipe = pipe

    @staticmethod
    def matches(pipe) -> bool:
        return getattr(pipe, "unet", None) is not None

    @property
    def denoiser(self):
        return self.pipe.unet

    def is_sdxl(self) -> bool:
        """SDXL-style UNets take pooled text embeddings and size micro-conditioning (`added_cond_kwargs`)."""
        return self.pipe.unet.config.get("addition_embed_type") == "text_time"

    def uses_cfg(self, guidance_scale: float) -> bool:
        """diffusers' rule: guidance runs as an unconditional batch half iff scale > 1 and the UNet has no
        w-embedding (LCM's `time_cond_proj_dim`)."""
        return guidance_scale > 1 and self.pipe.unet.config.time_cond_proj_dim is None

    def latent_shape(self, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
        """`(C, h, w)` of the latents and the image `(H, W)`. Defaults: the folder's `_diffrl_height` and
        `_diffrl_width` where its model_index.json has them (`diffrl.pipelines`; a recipe's size is registered the
        same way), else the UNet's `sample_size`'s; refused as `sampling_size` says."""
        pipe = self.pipe
        vae = component_config(pipe, "vae")
        # the tests' analytic stand-in pipelines have no config
        height, width, _ = sampling_size(getattr(pipe, "config", {}), pipe.unet.config, vae, height, width)
        factor = kl_vae_factor(vae)
        return (pipe.unet.config.in_channels, height // factor, width // factor), height, width

    @torch.no_grad()
    def encode(
        self,
        prompts: Sequence[str] | str | None,
        *,
        guidance_scale: float,
        height: int | None = None,
        width: int | None = None,
        negative_prompt: Sequence[str] | str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
    ) -> tuple[Conditioning, list[str]]:
        """Encode prompts with the pipeline's own `encode_prompt` (or take precomputed embeddings), without
        gradients: the trainers train the denoiser, not the text encoder. Returns the conditioning on the UNet's
        device and the prompt strings (`""` for embedding-only input). `height`/`width` (SDXL's size
        micro-conditioning) default to the UNet's."""
        pipe = self.pipe
        prompts, batch = prompt_list(prompts, prompt_embeds)
        if prompts is not None and prompt_embeds is not None and len(prompts) != prompt_embeds.shape[0]:
            raise UserError(f"got {len(prompts)} prompts but prompt_embeds has {prompt_embeds.shape[0]} rows")
        if isinstance(negative_prompt, str):
            negative_prompt = [negative_prompt] * batch
        if negative_prompt is not None and len(negative_prompt) != batch:
            raise UserError(f"got {len(negative_prompt)} negative prompts for {batch} prompts; pass one or one per "
                            f"prompt")
        _, height, width = self.latent_shape(height, width)
        device = pipe.unet.device
        guided = self.uses_cfg(guidance_scale)
        negative_prompt_embeds = _rows(negative_prompt_embeds, batch, "negative_prompt_embeds")
        negative_pooled_prompt_embeds = _rows(negative_pooled_prompt_embeds, batch, "negative_pooled_prompt_embeds")
        text = None if prompt_embeds is not None else list(prompts)
        common = {
            "device": device,
            "num_images_per_prompt": 1,
            "do_classifier_free_guidance": guided,
            "negative_prompt": negative_prompt,
            "prompt_embeds": prompt_embeds,
            "negative_prompt_embeds": negative_prompt_embeds,
        }
        if self.is_sdxl():
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
                prompt=text,
                pooled_prompt_embeds=pooled_prompt_embeds,
                negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
                **common,
            )
            # SDXL micro-conditioning at its defaults: original size = target size = (H, W), crop (0, 0)
            time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=embeds.dtype, device=device)
            cond = Conditioning(
                prompt_embeds=embeds,
                negative_prompt_embeds=negative if guided else None,
                pooled_prompt_embeds=pooled,
                negative_pooled_prompt_embeds=negative_pooled if guided else None,
                add_time_ids=time_ids.expand(batch, -1),
            )
        else:
            embeds, negative = pipe.encode_prompt(prompt=text, **common)
            cond = Conditioning(prompt_embeds=embeds, negative_prompt_embeds=negative if guided else None)
        cond = cond.to(device)
        if pipe.unet.config.time_cond_proj_dim is not None:
            # LCM-style UNets take the guidance scale as an embedding of w = scale - 1 instead of a CFG batch
            w = torch.full((batch,), guidance_scale - 1.0)
            embedding = pipe.get_guidance_scale_embedding(w, embedding_dim=pipe.unet.config.time_cond_proj_dim)
            cond.timestep_cond = embedding.to(device=device, dtype=torch.float32)
        return cond, prompt_strings(prompts, batch)

    def unet_kwargs(self, cond: Conditioning, dtype: torch.dtype) -> dict:
        """Keyword arguments of `unet(...)` for one guided call: [unconditional; conditional] rows when guided."""

        def build():
            guided = cond.guided
            kwargs = {"encoder_hidden_states": with_uncond(cond.negative_prompt_embeds, cond.prompt_embeds, guided,
                                                           dtype)}
            if cond.timestep_cond is not None:
                kwargs["timestep_cond"] = with_uncond(cond.timestep_cond, cond.timestep_cond, guided, dtype)
            if cond.add_time_ids is not None:
                kwargs["added_cond_kwargs"] = {
                    "text_embeds": with_uncond(cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds, guided,
                                               dtype),
                    "time_ids": with_uncond(cond.add_time_ids, cond.add_time_ids, guided, dtype),
                }
            return kwargs

        return cond.cached(("unet", dtype), build)

    def model_output(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: Conditioning,
        guidance_scale: float,
        dtype: torch.dtype | None = None,
        *,
        detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The model output for latents `x` (`[N, C, h, w]`) at model timestep `t` (a scalar or `[N]`) after
        classifier-free guidance, in fp32 (fp64 for a float64 model).

        One batched UNet call on [x; x] with [unconditional; conditional] embeddings when `cond.guided`;
        ε̂ = ε_u + s·(ε_c − ε_u). The UNet runs in `dtype` (default: its parameters' dtype).
        """
        unet = self.pipe.unet
        dtype = dtype or module_dtype(unet)
        model_input = x.to(dtype)
        t = torch.as_tensor(t, device=x.device)
        if cond.guided:
            model_input = torch.cat([model_input, model_input])
            if t.ndim == 1:
                t = torch.cat([t, t])
        output = run_denoiser(unet, model_input, t, return_dict=False, **self.unet_kwargs(cond, dtype))[0]
        return combine_guidance(output, cond.guided, guidance_scale, detach_uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.pipe, latents)

    @property
    def process(self) -> DDPMProcess:
        return DDPMProcess(self.pipe.scheduler)
