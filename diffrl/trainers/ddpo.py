"""DDPO: Denoising Diffusion Policy Optimization (Black et al. 2023, "Training Diffusion Models with
Reinforcement Learning", https://arxiv.org/abs/2305.13301).

Each denoising step of a DDIM sampler with eta > 0 is a Gaussian policy π_θ(x_{t-1} | x_t, c). DDPO collects
trajectories with the current weights, scores the final images with a reward r(x_0, c), turns rewards into
advantages and runs PPO's clipped surrogate on every (sample, timestep) pair (DDPO_IS, Eq. 5 of the paper).

Code names -> paper notation:
    log_probs       log π_θ(x_{t-1} | x_t, c)   recomputed under the current weights (mean over latent dims)
    old_log_probs   log π_old(x_{t-1} | x_t, c) recorded at rollout time (the behaviour policy)
    ratio           ρ = π_θ / π_old = exp(log_probs - old_log_probs)
    advantages      Â = (r - μ_c) / σ_c, per-prompt statistics (or group / batch), clipped to ±adv_clip_max
    clip_range      ε of PPO's clip(ρ, 1 - ε, 1 + ε)

Log-probs are the MEAN over latent dimensions (as the reference code does), so ε = 1e-4 means what it means there.
"""

from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------------------------
# Pure loss
# ---------------------------------------------------------------------------------------------------------------


def ddpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate for one denoising step of a batch of trajectories.

    `loss = mean_i max(-Â_i ρ_i, -Â_i clip(ρ_i, 1 - ε, 1 + ε))` with `ρ_i = exp(log_probs_i - old_log_probs_i)`.
    The max of the two negated terms is the min of PPO's objective, so the update never profits from moving the
    ratio beyond the clip range in the direction the advantage favours.

    Args:
        log_probs (`torch.Tensor` of shape `[B]`): log-probs under the current weights (carry the gradient).
        old_log_probs (`torch.Tensor` of shape `[B]`): log-probs recorded when the trajectory was sampled.
        advantages (`torch.Tensor` of shape `[B]`): advantages, already clipped.
        clip_range (`float`): PPO's ε.

    Returns:
        `(loss, stats)`: the scalar loss and detached diagnostics `approx_kl` (½·mean((log ρ)²), the estimator of
        the reference code), `clipfrac` (fraction of |ρ - 1| > ε) and `ratio` (mean ρ).
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
            "ratio": ratio.double().mean(),
        }
    return loss, stats
