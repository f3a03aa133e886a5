"""What every model family shares: the per-sample conditioning record, dtypes, and the VAE decode.

`Conditioning` is the text conditioning of a batch as a family's denoiser consumes it (one row per sample); the
families fill the fields their pipelines have and build the denoiser's keyword arguments from them. A sampler's
`Trajectory` carries the same fields, so a recorded batch can be scored again (`Conditioning.from_trajectory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from diffrl.errors import UserError


def step_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the step math (noise, latents, log-probs) for a model in `dtype`: float32 for fp32, fp16 and bf16
    models, float64 for a float64 one (`model.dtype: float64`, whose numbers then do not depend on which CPU kernels
    computed them)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def module_dtype(module) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (diffusers' `.dtype` property walks every module)."""
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


@dataclass
class Conditioning:
    """Per-sample conditioning of a batch (each tensor has B rows).

    Args:
        prompt_embeds (`[B, L, D]`): text encoder hidden states of the prompts.
        negative_prompt_embeds (`[B, L, D]`, *optional*): of the negative prompts; present iff CFG is used.
        pooled_prompt_embeds, negative_pooled_prompt_embeds (`[B, P]`): SDXL, SD3 and FLUX's pooled text embedding.
        add_time_ids (`[B, 6]`): SDXL's size micro-conditioning.
        timestep_cond (`[B, D]`, *optional*): guidance-scale embedding for UNets with `time_cond_proj_dim`.
        prompt_embeds_mask, negative_prompt_embeds_mask (`[B, L]` int64, *optional*): 1 on text tokens, 0 on padding
            (Qwen-Image pads each batch to its longest prompt).
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    add_time_ids: torch.Tensor | None = None
    timestep_cond: torch.Tensor | None = None
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance runs (an unconditional half in every denoiser call)."""
        return self.negative_prompt_embeds is not None

    def select(self, rows: torch.Tensor) -> Conditioning:
        return replace(self, **{f.name: _index(getattr(self, f.name), rows) for f in fields(self)})

    def to(self, device) -> Conditioning:
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})

    @classmethod
    def from_trajectory(cls, traj) -> Conditioning:
        return cls(**{f.name: getattr(traj, f.name) for f in fields(cls)})

    def conditional(self) -> Conditioning:
        """The conditional half alone (no CFG batch): what CFG-free training (DiffusionNFT) feeds the denoiser."""
        return replace(self, **{f.name: None for f in fields(self) if f.name.startswith("negative_")})

    def trajectory_fields(self) -> dict:
        """The same tensors as keyword arguments of `Trajectory` (its field names match)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def cached(self, key, build):
        """`build()` once per `key` on this object: a family's denoiser kwargs are concatenated once per batch,
        not once per step. `select` and `to` return new objects, so the cache never outlives its tensors."""
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]


def _index(value, rows):
    return None if value is None else value[rows.to(value.device)]


def _move(value, device):
    return None if value is None else value.to(device)


def prompt_list(prompts: Sequence[str] | str | None, prompt_embeds: torch.Tensor | None) -> tuple[list | None, int]:
    """A family's `encode` input: the prompts as a list (None with precomputed `prompt_embeds`) and the batch size."""
    if prompts is None and prompt_embeds is None:
        raise UserError("pass prompts or prompt_embeds to the sampler")
    if isinstance(prompts, str):
        prompts = [prompts]
    return prompts, len(prompts) if prompts is not None else prompt_embeds.shape[0]


def prompt_strings(prompts: Sequence[str] | None, batch: int) -> list[str]:
    """The prompt strings a family's `encode` returns beside its conditioning: `""` per row for embedding-only input."""
    return list(prompts) if prompts is not None else [""] * batch


def with_uncond(negative: torch.Tensor | None, positive: torch.Tensor | None, guided: bool, dtype) -> torch.Tensor:
    """One denoiser input: `[negative; positive]` rows when guided (one call for both CFG branches), else positive."""
    if positive is None:
        return None
    return (torch.cat([negative, positive]) if guided else positive).to(dtype)


def combine_guidance(output: torch.Tensor, guided: bool, guidance_scale: float, detach_uncond: bool) -> torch.Tensor:
    """Classifier-free guidance on one batched output `[uncond; cond]`: u + s·(c − u), upcast first so the step math
    is fp32 (`step_dtype`). `detach_uncond` stops the gradient through u (same value; flow_grpo's training step)."""
    output = output.to(step_dtype(output.dtype))
    if not guided:
        return output
    uncond, conditional = output.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance_scale * (conditional - uncond)


def decode_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """VAE-decode latents to images `[B, 3, H, W]` float32 (float64 from a float64 VAE) in [0, 1], differentiably
    (grad mode is the caller's).

    Undoes the latent normalisation the way the pipelines do: `latents_mean`/`latents_std` where the VAE
    config has them (SDXL-style), else division by `scaling_factor` and addition of `shift_factor` if set.
    """
    vae = pipe.vae
    config = vae.config
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is not None and std is not None:
        view = (1, -1) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(mean, device=latents.device).view(view)
        std = torch.tensor(std, device=latents.device).view(view)
        z = latents * std / config.scaling_factor + mean
    else:
        z = latents / config.scaling_factor
        if config.get("shift_factor") is not None:
            z = z + config.shift_factor
    image = vae.decode(z.to(module_dtype(vae)), return_dict=False)[0]
    return (image.to(step_dtype(image.dtype)) / 2 + 0.5).clamp(0, 1)
