"""What every model family shares: the per-sample conditioning record, dtypes, the VAE decode, and the checks of
the sampling size that each family's size rule (`<family>.sampling_size`) makes.

`Conditioning` is the text conditioning of a batch as a family's denoiser consumes it (one row per sample); the
families fill the fields their pipelines have and build the denoiser's keyword arguments from them. A sampler's
`Trajectory` carries the same fields, so a recorded batch can be scored again (`Conditioning.from_trajectory`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

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


class SamplingSize(NamedTuple):
    """The size a family samples at: image (or frame) height and width in pixels, and frames (0 for an image
    model)."""

    height: int
    width: int
    num_frames: int


# the keys a size error names: the family's own arguments; a caller checking a recipe or flags passes its own
# (`sample.height`, ..., `sample.eval_height`, ..., `--height`, ...)
SIZE_ARGUMENTS = ("height", "width", "num_frames")
# a folder's (or a loaded pipeline's) default size: the model_index.json keys `diffrl.pipelines` registers
SIZE_INDEX_KEYS = ("_diffrl_height", "_diffrl_width", "_diffrl_num_frames")


def component_config(pipe, name: str) -> Mapping:
    """The config of a loaded pipeline's component `name`, `{}` where it has none (a stand-in pipeline in tests)."""
    component = getattr(pipe, name, None)
    return getattr(component, "config", None) or {}


def kl_vae_factor(vae: Mapping) -> int:
    """`vae_scale_factor` of SD, SDXL, LCM, SD3, FLUX.1 and FLUX.2 pipelines (diffusers 0.42): 2^(len(
    block_out_channels) − 1) of their `AutoencoderKL`, 8 without a VAE."""
    channels = vae.get("block_out_channels")
    return 2 ** (len(channels) - 1) if channels else 8


def checked_size(index: Mapping, height: int | None, width: int | None, num_frames: int | None, *, model: str,
                 default: tuple[int, int], multiple: int, temporal: int | None = None, default_frames: int = 0,
                 keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The one check behind every family's size rule: each side the caller's, else the pipeline's default (`index`:
    its config or model_index.json, `_diffrl_height`, ...), else `default`; refused unless a multiple of
    `multiple`. Frames likewise for a video model (`temporal`: its VAE's temporal factor; the count must be
    `temporal`·k + 1); an image model (`temporal` None) takes none. Errors are one line naming `keys` and `model`.

    Raises:
        `UserError`: a side that is not a multiple, frames an image model cannot take or a video VAE cannot encode.
    """
    height = height or index.get(SIZE_INDEX_KEYS[0]) or default[0]
    width = width or index.get(SIZE_INDEX_KEYS[1]) or default[1]
    num_frames = num_frames or index.get(SIZE_INDEX_KEYS[2]) or default_frames
    for key, value in zip(keys[:2], (height, width)):
        if value % multiple:
            raise UserError(f"{key}={value} is not a multiple of {multiple}, which {model} needs; use "
                            f"{-(-value // multiple) * multiple}, for example")
    if temporal is None and num_frames:
        raise UserError(f"{keys[2]}={num_frames}: {model} is an image model; leave {keys[2]} at 0")
    if temporal is not None and temporal > 1 and num_frames % temporal != 1:
        raise UserError(f"{keys[2]}={num_frames} is not {temporal}·k + 1, which {model} needs; use "
                        f"{num_frames // temporal * temporal + 1}")
    return SamplingSize(height, width, num_frames)


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


def run_denoiser(denoiser, *args, **kwargs):
    """Call a family's denoiser; every family calls it through here. A compiled denoiser (`model.compile`) runs in
    grad mode even where the caller turned gradients off, its outputs detached: torch.compile builds one graph for
    grad-mode calls and another for no-grad ones, and their kernels round differently (up to 1e-6 on tiny-shapes'
    UNet), while the rollout (no grad) must reproduce the training pass's outputs exactly for the PPO ratio to start
    at 1. One graph per call shape also means one compile instead of two. Eager calls are unchanged."""
    module = getattr(denoiser, "module", denoiser)  # a DDP wrapper's compiled module
    if torch.is_grad_enabled() or getattr(module, "_compiled_call_impl", None) is None:
        return denoiser(*args, **kwargs)
    with torch.enable_grad():
        output = denoiser(*args, **kwargs)
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in output)


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
