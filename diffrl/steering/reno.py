"""ReNO: reward-based noise optimisation for one- and few-step models.

Eyring et al., "ReNO: Enhancing One-step Text-to-Image Models through Reward-based Noise Optimization" (2024).

The initial noise ε of a one/few-step generator G (an LCM, or a few ODE/SDE steps of a flow model such as SD3 or
FLUX from x_1 = ε) is a free variable: gradient ascent on the (weighted sum of) differentiable rewards of G(ε), kept
near the Gaussian shell by the negative log-likelihood of ‖ε‖ under the χ distribution of a d-dimensional standard
normal,

    L(ε) = −Σ_i w_i·r_i(G(ε)) + λ_reg·(½‖ε‖² − (d − 1)·log‖ε‖),

minimised with SGD (Nesterov momentum 0.9, lr 5) with the gradient norm clipped to 0.1, for 50 iterations (50
generations and reward evaluations, an optimiser step after each but the last, as the reference code counts them);
the image with the best reward seen so far is returned. Each prompt's noise is optimised independently (gradients are
clipped per sample), so batching prompts changes nothing but speed. The noise the sampler injects between steps of a
few-step model is fixed across iterations, so G is a deterministic function of ε.

Map from code to paper notation:
    `noise`            ε, the optimised initial latents (per prompt, d = its number of elements)
    `reg_weight`       λ_reg, the weight of the norm prior
    `norm_prior_nll`   ½‖ε‖² − (d − 1)·log‖ε‖, minimal at ‖ε‖ = √(d − 1)
    `grad_clip`        the maximal gradient norm per sample
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, rows_per_prompt


@dataclass
class ReNOConfig:
    iterations: int = 50  # evaluations of G(ε) and its reward; an optimiser step follows each but the last
    lr: float = 5.0  # SGD learning rate
    momentum: float = 0.9  # Nesterov momentum
    grad_clip: float = 0.1  # max L2 norm of each sample's gradient; 0 disables clipping
    reg_weight: float = 0.01  # λ_reg, weight of the noise-norm prior

    @property
    def latent_rows(self) -> int:
        """Latents held per prompt: the one noise being optimised (bounded in `bounds.py`)."""
        return 1


def norm_prior_nll(noise: torch.Tensor) -> torch.Tensor:
    """½‖ε‖² − (d − 1)·log‖ε‖ per sample (`[B, ...]` -> `[B]`), in fp32: −log of the χ_d density up to a constant."""
    flat = noise.reshape(len(noise), -1).float()
    d = flat.shape[1]
    norm = flat.norm(dim=1)
    return 0.5 * norm**2 - (d - 1) * torch.log(norm)


def clip_grad_norm_per_sample(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each sample's gradient down to L2 norm `max_norm` where it is larger (`max_norm` 0: unchanged)."""
    if max_norm <= 0:
        return grad
    norms = grad.reshape(len(grad), -1).norm(dim=1)
    factor = (max_norm / (norms + 1e-12)).clamp(max=1.0)
    return grad * factor.view(-1, *([1] * (grad.dim() - 1)))


def update_best(best_objective, best_samples, objective, samples):
    """Keep, per sample, whichever of (best so far, current) has the higher objective (the earlier on ties)."""
    if best_objective is None:
        return objective.clone(), samples.clone()
    better = objective > best_objective
    mask = better.view(-1, *([1] * (samples.dim() - 1)))
    return torch.where(better, objective, best_objective), torch.where(mask, samples, best_samples)


def _generate(ctx: SteerContext, noise: torch.Tensor, cond: torch.Tensor, noise_seed: int, grad: bool) -> torch.Tensor:
    # The same seed every iteration: the few-step sampler injects the same noise, so G depends on ε alone.
    generator = torch.Generator(device=noise.device).manual_seed(noise_seed)
    latents = noise
    with torch.set_grad_enabled(grad):
        for i in range(ctx.num_steps):
            model_output = ctx.predict(latents, i, cond, grad=grad)
            latents = ctx.step(model_output, i, latents, generator=generator).prev_sample
    return latents


def reno(ctx: SteerContext, cfg: ReNOConfig, generator=None) -> SteerOutput:
    """Optimise one initial noise per prompt and return each prompt's best image seen.

    The info holds `objective_per_iteration` (mean reward per prompt at each evaluation) and `best_iteration` (`[B]`).
    """
    ctx.require_differentiable("ReNO")
    if cfg.iterations < 1 or cfg.lr <= 0:
        raise UserError(f"ReNO needs iterations ≥ 1 and lr > 0, got iterations={cfg.iterations}, lr={cfg.lr}")
    cond = rows_per_prompt(ctx.num_prompts, 1)
    noise = ctx.initial_latents(cond, generator).detach().clone()
    cond = cond.to(noise.device)
    seed_device = generator.device if generator is not None else "cpu"
    noise_seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=seed_device))
    noise.requires_grad_(True)
    optimizer = torch.optim.SGD([noise], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    best_objective = best_samples = None
    best_iteration = torch.zeros(ctx.num_prompts, dtype=torch.long)
    history = []

    for iteration in range(cfg.iterations):
        stepping = iteration < cfg.iterations - 1
        latents = _generate(ctx, noise, cond, noise_seed, stepping)
        scored = ctx.score(latents, cond, grad=stepping)
        objective = scored.objective.detach()
        history.append(float(objective.mean()) * ctx.sign)
        improved = best_objective is None or objective > best_objective
        best_iteration = torch.where(torch.as_tensor(improved).cpu(), iteration, best_iteration)
        best_objective, best_samples = update_best(best_objective, best_samples, objective, scored.samples.detach())
        if not stepping:
            break
        loss = -scored.objective.sum() + cfg.reg_weight * norm_prior_nll(noise).sum()
        grad = ctx.grad(loss, noise)
        noise.grad = clip_grad_norm_per_sample(grad, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    info = ctx.accounting(
        "reno", iterations=cfg.iterations, lr=cfg.lr, grad_clip=cfg.grad_clip, reg_weight=cfg.reg_weight,
        objective_per_iteration=history, best_iteration=best_iteration.tolist(),
    )
    return SteerOutput(images=best_samples, scores=best_objective * ctx.sign, info=info)
