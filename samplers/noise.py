"""The samplers' randomness: one generator per sample, and the noise drawn from them.

A sample's noise depends only on its own seed, never on the batch it is in, so a rollout, a recomputation and a
steered chain of the same seed see the same draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.errors import UserError
from diffrl.models.base import step_dtype


def make_generators(
    batch: int, *, seeds: Sequence[int] | None, generator, device
) -> tuple[list[torch.Generator], list[int] | None]:
    """One `torch.Generator` per sample, so a sample's noise never depends on the batch it is in.

    `seeds` → generators on `device` seeded with them; a list of generators → used as is (seeds unknown);
    a single generator → per-sample seeds drawn from it; nothing → seeds drawn from torch's global RNG
    (reproducible under `torch.manual_seed`, and recorded in the trajectory).
    """
    if seeds is not None and generator is not None:
        raise UserError("pass either seeds or generator to the sampler, not both")
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise UserError(f"got {len(generator)} generators for a batch of {batch}; pass one per sample")
        return list(generator), None
    if seeds is None:
        drawn = torch.randint(0, 2**62, (batch,), generator=generator, device=getattr(generator, "device", "cpu"))
        seeds = drawn.tolist()
    seeds = [int(s) for s in seeds]
    if len(seeds) != batch:
        raise UserError(f"got {len(seeds)} seeds for a batch of {batch}; pass one per sample")
    return [torch.Generator(device=device).manual_seed(s) for s in seeds], seeds


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int], device,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal `[B, *shape]` in `dtype`, row i from `generators[i]` (as diffusers' `randn_tensor` with a
    list). A float64 run draws float64 noise: torch's CPU float32 `randn` has an AVX2-only kernel, so float32 noise
    depends on the CPU."""
    rows = [torch.randn((1, *shape), generator=g, device=g.device, dtype=dtype) for g in generators]
    return torch.cat(rows).to(device)


def noise_for_step(generator, x_t: torch.Tensor, *, prev_sample: torch.Tensor | None, noise: torch.Tensor | None,
                   draws: bool) -> torch.Tensor | None:
    """The z of one `step()` call: `noise` when given; a draw (`step_noise`) when the step `draws` noise and scores
    no given `prev_sample`; else None."""
    if prev_sample is None and noise is None and draws:
        return step_noise(generator, x_t)
    return noise


def step_noise(generator, x_t: torch.Tensor) -> torch.Tensor:
    """z `[B, C, h, w]` in `step_dtype(x_t.dtype)` for one `step()` call: row i from `generator[i]` given a list,
    else one batch draw."""
    dtype = step_dtype(x_t.dtype)
    if isinstance(generator, (list, tuple)):
        return draw_noise(generator, x_t.shape[1:], x_t.device, dtype)
    device = generator.device if generator is not None else x_t.device
    return torch.randn(x_t.shape, generator=generator, device=device, dtype=dtype).to(x_t.device)
