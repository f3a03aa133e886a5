"""The FLUX.2 family (`Flux2Pipeline`, FLUX.2-dev): a rectified-flow MMDiT (`Flux2Transformer2DModel`) over latent
tokens with 4-axis rotary position ids, a Mistral-3 text encoder, and guidance embedded in the transformer (no CFG
batch, no negative prompt).

Follows diffusers 0.42's `pipelines/flux2/pipeline_flux2.py`. What differs from the other flow families:
- latents: the VAE's latents are 2x2-patchified into channels (`[B, 4C, h/2, w/2]`, C = 32 on the real model, so
  128 channels at 1/16 of the image size) before anything else sees them; that patchified grid is this family's
  unpacked form — what trajectories, hooks and `latents=` hold, and exactly the pipeline's own `latents=` argument —
  and it is flattened into tokens (one per grid cell) only for the transformer call;
- text: hidden states 10, 20 and 30 of Mistral-3 on a chat template, concatenated per token (3·D features), padded
  to `max_sequence_length` (512) and attended whole: no mask reaches the transformer;
- guidance: the embedded scalar `guidance_scale` (default 4.0), never a CFG batch;
- schedule: σ = linspace(1, 1/T, T) and μ = `compute_empirical_mu(seq_len, T)`, which depends on the step count T as
  well as the token count: a trajectory's schedule is the one for its own step count (evaluation with other steps
  has another schedule);
- decode: the VAE's BatchNorm running statistics de-normalise the patchified channels (x·√(var + eps) + mean), then
  the grid is unpatchified and decoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from diffrl.errors import UserError
from diffrl.models.base import (
    SIZE_ARGUMENTS,
    Conditioning,
    SamplingSize,
    component_config,
    kl_vae_factor,
    module_dtype,
    prompt_list,
    prompt_strings,
    run_denoiser,
    step_dtype,
)
from diffrl.models.flow import (
    encode_distinct,
    rectified_flow_process,
    sequence_length,
    transformer_denoiser,
)
from diffrl.models.flux import packed_sampling_size


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """FLUX.2's position ids of the `h·w` latent tokens `[h·w, 4]` (int64): (t = 0, row, column, layer = 0)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(-1, 4).to(device)


def text_ids(length: int, device) -> torch.Tensor:
    """The text tokens' position ids `[L, 4]` (int64): (0, 0, 0, index)."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """`[B, 4C, h/2, w/2]` → the VAE's `[B, C, h, w]` (the inverse of the pipeline's `_patchify_latents`)."""
    b, c4, h, w = latents.shape
    return latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def sampling_size(index: Mapping, transformer: Mapping, vae: Mapping, height: int | None = None,
                  width: int | None = None, num_frames: int | None = None, *,
                  keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The FLUX.2 family's size rule from the pipeline's (`index`: its config or model_index.json), the
    transformer's and the VAE's configs (`flux.packed_sampling_size` with the VAE's 2^(len(block_out_channels) − 1):
    the latents are 2x2-patchified). `Flux2Family.latent_shape` calls it with the loaded pipeline's configs,
    `diffrl.pipelines.check_sampling_size` with the folder's."""
    return packed_sampling_size(index, kl_vae_factor(vae), "FLUX.2", height, width, num_frames, keys)


class Flux2Family:
    name = "flux2"
    flow = True
    denoiser_class = "Flux2Transformer2DModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)
    default_guidance_scale = 4.0  # Flux2Pipeline's embedded guidance

    def __init__(self, pipe):
        if type(pipe).__name__ != "Flux2Pipeline":
            raise UserError(f"{type(pipe).__name__} is not supported: diffrl runs FLUX.2-dev text-to-image "
                            "(Flux2Pipeline) only")  # fmt: skip
        self.pipe = pipe

    @staticmethod
    def matches(pipe) -> bool:
        return type(getattr(pipe, "transformer", None)).__name__ == "Flux2Transformer2DModel"

    denoiser = property(transformer_denoiser)
    process = property(rectified_flow_process)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Never: `guidance_scale` is the transformer's embedded guidance, as in diffusers."""
        return False

    def latent_shape(self, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
        """`(4C, h/2, w/2)` of the patchified latents and the image `(H, W)`. Defaults: the folder's `_diffrl_height`
        and `_diffrl_width` where its model_index.json has them (`diffrl.pipelines`), else `default_sample_size`'s;
        refused as `sampling_size` says."""
        pipe, vae = self.pipe, component_config(self.pipe, "vae")
        height, width, _ = sampling_size(pipe.config, pipe.transformer.config, vae, height, width)
        scale = kl_vae_factor(vae)
        grid = (height // (2 * scale), width // (2 * scale))
        return (pipe.transformer.config.in_channels, *grid), height, width

    def schedule_kwargs(self, num_steps: int, latent_hw: tuple[int, int]) -> dict:
        """What `Flux2Pipeline` passes to `set_timesteps`: σ = linspace(1, 1/T, T) (unless the config uses flow
        sigmas) and μ = compute_empirical_mu(tokens, T)."""
        kwargs: dict = {"num_inference_steps": num_steps}
        if not self.pipe.scheduler.config.get("use_flow_sigmas"):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        kwargs["mu"] = compute_empirical_mu(image_seq_len=latent_hw[0] * latent_hw[1], num_steps=num_steps)
        return kwargs

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
        """Encode prompts with the pipeline's own `encode_prompt` (Mistral-3, three layers), without gradients; each
        distinct prompt once (`flow.encode_distinct`)."""
        prompts, batch = prompt_list(prompts, prompt_embeds)
        if negative_prompt is not None or negative_prompt_embeds is not None:
            raise UserError("FLUX.2 guides through the transformer's guidance embedding; it takes no negative prompt")
        if pooled_prompt_embeds is not None or negative_pooled_prompt_embeds is not None:
            raise UserError("FLUX.2 has no pooled text embedding; pass prompt_embeds only")
        # negative_prompt and negative_prompt_embeds are None here (refused above)
        embeds_given = prompt_embeds is not None
        repeated = encode_distinct(self.encode, prompts, negative_prompt, embeds_given, guidance_scale=guidance_scale,
                                   max_sequence_length=max_sequence_length)
        if repeated is not None:
            return repeated
        device = self.pipe.transformer.device
        embeds, _ = self.pipe.encode_prompt(
            prompt=None if prompt_embeds is not None else list(prompts), device=device, num_images_per_prompt=1,
            prompt_embeds=prompt_embeds, **sequence_length(self.pipe, max_sequence_length),
        )  # fmt: skip
        return Conditioning(prompt_embeds=embeds).to(device), prompt_strings(prompts, batch)

    def model_output(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
        dtype: torch.dtype | None = None, *, detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The velocity for patchified latents `x` (`[N, 4C, h, w]`) at model timestep `t` (σ·1000; a scalar or
        `[N]`), in fp32: each grid cell one token, the transformer fed σ and the embedded guidance. No CFG batch, so
        `detach_uncond` has nothing to detach."""
        transformer = self.pipe.transformer
        dtype = dtype or transformer.dtype
        embeds = cond.cached(("flux2", dtype), lambda: cond.prompt_embeds.to(dtype))
        n, c, h, w = x.shape
        tokens = x.to(dtype).reshape(n, c, h * w).permute(0, 2, 1)  # the pipeline's _pack_latents
        timestep = torch.as_tensor(t, device=x.device).expand(n).to(dtype) / 1000
        guidance = torch.full((n,), guidance_scale, device=x.device, dtype=torch.float32)
        output = run_denoiser(
            transformer,
            hidden_states=tokens, timestep=timestep, guidance=guidance, encoder_hidden_states=embeds,
            txt_ids=text_ids(embeds.shape[1], x.device), img_ids=image_ids(h, w, x.device), return_dict=False,
        )[0]  # fmt: skip
        output = output.to(step_dtype(output.dtype))
        return output.permute(0, 2, 1).reshape(n, c, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images `[B, 3, H, W]` in [0, 1], differentiably: the BatchNorm statistics undone on the patchified
        channels, the grid unpatchified, decoded."""
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                                 latents.dtype)
        z = unpatchify(latents * std + mean)
        image = vae.decode(z.to(module_dtype(vae)), return_dict=False)[0]
        return (image.to(step_dtype(image.dtype)) / 2 + 0.5).clamp(0, 1)
