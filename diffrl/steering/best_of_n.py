"""Best-of-N: draw N samples per prompt with the plain sampler and keep the one with the highest reward.

The baseline every other steering method has to beat at equal compute: N·T model evaluations and N reward
evaluations per prompt. If the reward of one draw has CDF F, the kept reward has CDF F^N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, rows_per_prompt, sample_chain


@dataclass
class BestOfNConfig:
    num_samples: int = 4  # N, samples drawn per prompt

    @property
    def latent_rows(self) -> int:
        """Latents held per prompt: every sample (bounded in `bounds.py`)."""
        return self.num_samples


def best_of_n_indices(objective: torch.Tensor) -> torch.Tensor:
    """`[B, N]` objective values -> `[B]` index of the best sample of each prompt (the first one on ties)."""
    return objective.argmax(dim=-1)


def best_of_n(ctx: SteerContext, cfg: BestOfNConfig, generator=None, *, keep_samples: bool = False) -> SteerOutput:
    """Draw `cfg.num_samples` samples per prompt and return the best of each.

    With `keep_samples=True` the info also holds every sample's raw reward (`sample_scores [B, N]`).
    """
    if cfg.num_samples < 1:
        raise UserError(f"num_samples must be at least 1, got {cfg.num_samples}")
    B, n = ctx.num_prompts, cfg.num_samples
    cond = rows_per_prompt(B, n)
    latents = ctx.initial_latents(cond, generator)
    cond = cond.to(latents.device)
    latents = sample_chain(ctx, latents, cond, generator)
    scored = ctx.score(latents, cond)
    best = best_of_n_indices(scored.objective.view(B, n))
    rows = best + torch.arange(B, device=best.device) * n
    info = ctx.accounting("best-of-n", num_samples=n)
    if keep_samples:
        info["sample_scores"] = scored.objective.view(B, n) * ctx.sign
    return SteerOutput(images=scored.samples[rows], scores=scored.objective[rows] * ctx.sign, info=info)
