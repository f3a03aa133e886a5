"""The FLUX.1 family (`FluxPipeline`): a rectified-flow MMDiT over 2x2-packed latent tokens with rotary position ids,
CLIP-L (pooled) and T5 text, and guidance embedded in the transformer (guidance-distilled `dev`; `schnell` has none)
instead of a CFG batch.

Latents stay unpacked (`[B, C, h, w]`) everywhere else — hooks, rewards and trajectories see the same shapes as for
SD — and are packed into tokens only for the transformer call. The forward process and target are rectified flow's
(`flow.RectifiedFlowProcess`).
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
    component_config,
    decode_latents,
    kl_vae_factor,
    prompt_list,
    prompt_strings,
    run_denoiser,
    step_dtype,
)
from diffrl.models.flow import (
    encode_distinct,
    rectified_flow_process,
    sequence_length,
    shifted_schedule_kwargs,
    transformer_denoiser,
)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, h, w]` → FLUX tokens `[B, h/2·w/2, 4C]` (each token a 2x2 patch, channel-major)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack`."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """FLUX's position ids of the packed tokens `[h/2·w/2, 3]`: (0, row, column)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


# `default_sample_size` of `FluxPipeline`, `QwenImagePipeline` and `Flux2Pipeline` (diffusers 0.42: a class constant,
# in latent pixels before the VAE factor)
DEFAULT_SAMPLE_SIZE = 128


def packed_sampling_size(index: Mapping, factor: int, model: str, height: int | None, width: int | None,
                         num_frames: int | None, keys: Sequence[str]) -> SamplingSize:
    """The size rule of a pipeline that packs 2x2 latent patches into tokens (FLUX.1, Qwen-Image, FLUX.2) with VAE
    factor `factor`: each side the caller's, else the folder's `_diffrl_height` / `_diffrl_width`, else
    `DEFAULT_SAMPLE_SIZE` × `factor`; a multiple of 2 × `factor` (what their `check_inputs` asks, without the
    pipelines' rounding)."""
    default = DEFAULT_SAMPLE_SIZE * factor
    return checked_size(index, height, width, num_frames, model=f"{model} (VAE factor {factor} × 2x2 packing)",
                        default=(default, default), multiple=2 * factor, keys=keys)


def sampling_size(index: Mapping, transformer: Mapping, vae: Mapping, height: int | None = None,
                  width: int | None = None, num_frames: int | None = None, *,
                  keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The FLUX.1 family's size rule from the pipeline's (`index`: its config or model_index.json), the transformer's
    and the VAE's configs (`packed_sampling_size` with `AutoencoderKL`'s factor). `FluxFamily.latent_shape` calls it
    with the loaded pipeline's configs, `diffrl.pipelines.check_sampling_size` with the folder's."""
    return packed_sampling_size(index, kl_vae_factor(vae), "FLUX.1", height, width, num_frames, keys)


def packed_latent_shape(pipe, size: SamplingSize, factor: int) -> tuple[tuple[int, int, int], int, int]:
    """`(C, h, w)` of the unpacked latents of a pipeline that packs 2x2 patches into tokens (`FluxPipeline`,
    `QwenImagePipeline`) at `size` with VAE factor `factor`, and the image `(H, W)`."""
    height, width, _ = size
    return (pipe.transformer.config.in_channels // 4, height // factor, width // factor), height, width


def packed_schedule_kwargs(scheduler_config, num_steps: int, latent_hw: tuple[int, int]) -> dict:
    """What `FluxPipeline` passes to `set_timesteps` for latents `(h, w)`: its own σ and the μ of the h/2·w/2 packed
    tokens (diffusers 0.42). `QwenImagePipeline` passes the same."""
    seq_len = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    return shifted_schedule_kwargs(scheduler_config, num_steps, seq_len, flux_sigmas=True, max_shift=1.15)


class FluxFamily:
    name = "flux"
    flow = True
    denoiser_class = "FluxTransformer2DModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)
    default_guidance_scale = 3.5  # FluxPipeline's embedded guidance

    def __init__(self, pipe):
        self.pipe = pipe

    @staticmethod
    def matches(pipe) -> bool:
        return type(getattr(pipe, "transformer", None)).__name__ == "FluxTransformer2DModel"

    denoiser = property(transformer_denoiser)
    process = property(rectified_flow_process)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Never: `guidance_scale` is the guidance-distilled transformer's embedded guidance (ignored without
        `guidance_embeds`), as in diffusers."""
        return False

    def latent_shape(self, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
        """`(C, h, w)` of the unpacked latents and the image `(H, W)`. Defaults: the folder's `_diffrl_height` and
        `_diffrl_width` where its model_index.json has them (`diffrl.pipelines`), else `default_sample_size`'s;
        refused as `sampling_size` says."""
        pipe, vae = self.pipe, component_config(self.pipe, "vae")
        size = sampling_size(pipe.config, pipe.transformer.config, vae, height, width)
        return packed_latent_shape(pipe, size, kl_vae_factor(vae))

    def schedule_kwargs(self, num_steps: int, latent_hw: tuple[int, int]) -> dict:
        """What `FluxPipeline` passes to `set_timesteps`: its own σ and the resolution-dependent μ (diffusers 0.42)."""
        return packed_schedule_kwargs(self.pipe.scheduler.config, num_steps, latent_hw)

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
        max_sequence_length: int | None = None,
    ) -> tuple[Conditioning, list[str]]:
        """Encode prompts with the pipeline's own `encode_prompt` (CLIP pooled + T5), without gradients; each distinct
        prompt once (`flow.encode_distinct`)."""
        prompts, batch = prompt_list(prompts, prompt_embeds)
        if negative_prompt is not None or negative_prompt_embeds is not None:
            raise UserError("FLUX-class pipelines guide through the transformer's guidance embedding; "
                            "negative prompts (true CFG) are not supported by the flow sampler yet")  # fmt: skip
        # negative_prompt and negative_prompt_embeds are None here (refused above)
        embeds_given = prompt_embeds is not None
        repeated = encode_distinct(self.encode, prompts, negative_prompt, embeds_given, guidance_scale=guidance_scale,
                                   max_sequence_length=max_sequence_length)
        if repeated is not None:
            return repeated
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise UserError("a flow pipeline needs pooled_prompt_embeds along with prompt_embeds")
        device = self.pipe.transformer.device
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=None if prompt_embeds is not None else list(prompts), prompt_2=None, device=device,
            num_images_per_prompt=1, prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
            **sequence_length(self.pipe, max_sequence_length),
        )  # fmt: skip
        cond = Conditioning(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
        return cond.to(device), prompt_strings(prompts, batch)

    def model_output(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
        dtype: torch.dtype | None = None, *, detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The velocity for latents `x` (`[N, C, h, w]`) at model timestep `t` (σ·1000; a scalar or `[N]`), in fp32:
        `x` packed into tokens, the transformer fed σ, the guidance scale embedded. No CFG batch, so
        `detach_uncond` has nothing to detach."""
        transformer = self.pipe.transformer
        dtype = dtype or transformer.dtype
        text = cond.cached(("flux", dtype), lambda: {
            "encoder_hidden_states": cond.prompt_embeds.to(dtype),
            "pooled_projections": cond.pooled_prompt_embeds.to(dtype),
        })
        n, _, h, w = x.shape
        t = torch.as_tensor(t, device=x.device).expand(n)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_scale, device=x.device, dtype=torch.float32)
        tokens = run_denoiser(
            transformer,
            hidden_states=pack(x.to(dtype)),
            timestep=t.to(dtype) / 1000,
            guidance=guidance,
            txt_ids=torch.zeros(text["encoder_hidden_states"].shape[1], 3, device=x.device, dtype=dtype),
            img_ids=image_ids(h, w, x.device, dtype),
            return_dict=False,
            **text,
        )[0]
        return unpack(tokens.to(step_dtype(tokens.dtype)), h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.pipe, latents)
