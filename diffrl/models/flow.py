"""What the rectified-flow families (SD3/3.5, FLUX.1, and the transformers after them) share: the forward process
and training target, the resolution-dependent schedule shift, and prompt deduplication.

Notation as diffusers' `FlowMatchEulerDiscreteScheduler`: x_σ = (1 − σ)·x0 + σ·ε, σ from 1 (noise) to 0 (data); the
transformer predicts the velocity v = ε − x0; the model timestep is σ·1000 (`num_train_timesteps`). The family
files (`sd3.py`, `flux.py`) hold what differs: text encoders, the transformer call, latent packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from diffrl.models.base import Conditioning


class RectifiedFlowProcess:
    """x_σ = (1 − σ)·x0 + σ·ε and its target v = ε − x0, for trainers that noise clean latents themselves.

    Training timesteps are drawn as diffusers' SD3/FLUX training scripts draw them with `weighting_scheme="none"`
    (`train_dreambooth_lora_sd3.py`): a uniform index into the scheduler's training timesteps, which carry the
    config's static `shift` (SD3: 3.0; FLUX's dynamic shift applies at sampling only)."""

    def __init__(self, scheduler_config):
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        self.num_train_timesteps = self.scheduler.config.num_train_timesteps

    def train_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`[batch]` model timesteps σ·1000 (CPU, float32)."""
        index = torch.randint(0, len(self.scheduler.timesteps), (batch,), generator=generator)
        return self.scheduler.timesteps[index].to(torch.float32)

    def sigma(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """σ = t / num_train_timesteps shaped to broadcast against `like` `[B, ...]`."""
        sigma = torch.as_tensor(t, device=like.device).to(like.dtype) / self.num_train_timesteps
        return sigma.reshape(-1, *([1] * (like.ndim - 1))) if sigma.ndim == 1 else sigma

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma(t, x0)
        return (1 - sigma) * x0 + sigma * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return noise - x0


def transformer_denoiser(family):
    """A transformer family's `denoiser` (`denoiser = property(transformer_denoiser)`): `pipe.transformer`."""
    return family.pipe.transformer


def rectified_flow_process(family) -> RectifiedFlowProcess:
    """A flow family's `process` (`process = property(rectified_flow_process)`), from its scheduler's config."""
    return RectifiedFlowProcess(family.pipe.scheduler.config)


def shifted_schedule_kwargs(scheduler_config, num_steps: int, seq_len: int, *, flux_sigmas: bool,
                            max_shift: float) -> dict:
    """The arguments a flow pipeline passes to `set_timesteps` for `seq_len` image tokens: FLUX-style pipelines pass
    their own σ = linspace(1, 1/T, T) (`flux_sigmas`) and always the resolution-dependent μ; SD3 passes μ only with
    `use_dynamic_shifting`. `max_shift` is the pipeline's default for a config without one (1.15 FLUX, 1.16 SD3)."""
    config = scheduler_config
    kwargs: dict = {"num_inference_steps": num_steps}
    if flux_sigmas:
        if not config.get("use_flow_sigmas"):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
    elif not config.get("use_dynamic_shifting"):
        return kwargs
    kwargs["mu"] = calculate_shift(
        seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )
    return kwargs


def sequence_length(pipe, max_sequence_length: int | None) -> dict:
    """`{"max_sequence_length": n}` for `encode_prompt`: the caller's, else the T5 length a model was trained with when
    its folder says (`_diffrl_max_sequence_length`, tiny-shapes-flow), else nothing (the pipeline's default)."""
    if max_sequence_length is None:
        max_sequence_length = pipe.config.get("_diffrl_max_sequence_length")
    return {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}


def encode_distinct(
    encode: Callable[..., tuple[Conditioning, list[str]]],
    prompts: Sequence[str] | None,
    negative_prompt: Sequence[str] | str | None,
    embeds_given: bool,
    **kwargs,
) -> tuple[Conditioning, list[str]] | None:
    """Encode each distinct (prompt, negative prompt) once and repeat its rows (a GRPO batch holds k copies of each
    prompt; the large text encoders of these families dominate a small batch's cost): `encode` is the family's own,
    called with the distinct prompts, their `negative_prompt` and `kwargs`. None when there is nothing to save
    (precomputed embeddings, a shared negative string, or all prompts distinct)."""
    if embeds_given or prompts is None or isinstance(negative_prompt, str):
        return None
    pairs = list(zip(prompts, negative_prompt or [None] * len(prompts)))
    distinct = list(dict.fromkeys(pairs))
    if len(distinct) == len(pairs):
        return None
    negatives = None if negative_prompt is None else [n for _, n in distinct]
    cond, _ = encode([p for p, _ in distinct], negative_prompt=negatives, **kwargs)
    position = {pair: i for i, pair in enumerate(distinct)}
    rows = torch.tensor([position[pair] for pair in pairs], device=cond.prompt_embeds.device)
    return cond.select(rows), list(prompts)
