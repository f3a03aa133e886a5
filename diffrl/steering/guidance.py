"""Reward-gradient guidance (DPS-style): push every step along the gradient of the reward of x̂0.

Chung et al., "Diffusion Posterior Sampling for General Noisy Inverse Problems" (2023), with a reward in place of a
measurement likelihood, as in universal / reward guidance (Bansal et al. 2023).

The noise prediction is a scaled score, ε̂ = −√(1−ᾱ_t)·∇ log p_t(x_t). Adding γ·∇ r to the score gives

    ε̃ = ε̂ − γ·√(1−ᾱ_t)·∇_{x_t} r(D(x̂0(x_t))),

where x̂0(x_t) = (x_t − √(1−ᾱ_t)·ε̂) / √ᾱ_t and D decodes latents to images. The gradient runs back through the
reward, the decoder and the model at x_t, so the reward must be differentiable.

Map from code to paper notation:
    `scale`             γ, the guidance strength
    `alpha_bar`         ᾱ_t
    `reward_grad`       ∇_{x_t} r(D(x̂0(x_t)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, rows_per_prompt, select_per_prompt


@dataclass
class GuidanceConfig:
    scale: float = 1.0  # γ
    start: int = 0  # first guided step index (0 = noisiest)
    end: int | None = None  # last guided step index (inclusive); None: every step to the end
    num_samples: int = 1  # guided samples per prompt; the best final one is returned


def guided_noise(noise_pred: torch.Tensor, reward_grad: torch.Tensor, alpha_bar: float, scale: float) -> torch.Tensor:
    """ε̃ = ε̂ − γ·√(1−ᾱ_t)·∇_{x_t} r."""
    return noise_pred - scale * math.sqrt(1.0 - alpha_bar) * reward_grad


def reward_guidance(ctx: SteerContext, cfg: GuidanceConfig, generator=None) -> SteerOutput:
    """Sample with the noise prediction shifted by the reward gradient at every step in `[start, end]`."""
    ctx.require_differentiable("reward guidance")
    if cfg.num_samples < 1:
        raise UserError(f"num_samples must be at least 1, got {cfg.num_samples}")
    last = ctx.num_steps - 1 if cfg.end is None else cfg.end
    cond = rows_per_prompt(ctx.num_prompts, cfg.num_samples)
    latents = ctx.initial_latents(cond, generator)
    cond = cond.to(latents.device)

    for i in range(ctx.num_steps):
        if cfg.start <= i <= last and cfg.scale != 0:
            # One chunk at a time, so the graph through model, decoder and reward never spans more rows than fit.
            model_output = torch.empty_like(latents)
            for rows in ctx.chunks(len(latents)):
                x_t = latents[rows].detach().requires_grad_(True)
                eps = ctx.predict(x_t, i, cond[rows], grad=True)
                objective = ctx.score(ctx.pred_x0(eps, i, x_t), cond[rows], grad=True).objective
                reward_grad = ctx.grad(objective.sum(), x_t)
                model_output[rows] = guided_noise(eps.detach(), reward_grad, ctx.process.alpha_bar(i), cfg.scale)
        else:
            model_output = ctx.predict(latents, i, cond)
        latents = ctx.step(model_output, i, latents, generator=generator).prev_sample.detach()

    final = ctx.score(latents, cond)
    best = select_per_prompt(final.objective, ctx.num_prompts)
    info = ctx.accounting("guidance", scale=cfg.scale, start=cfg.start, end=last, num_samples=cfg.num_samples)
    return SteerOutput(images=final.samples[best], scores=final.objective[best] * ctx.sign, info=info)
