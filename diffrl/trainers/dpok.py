"""DPOK: Diffusion Policy Optimization with KL regularization (Fan et al. 2023, "DPOK: Reinforcement Learning
for Fine-tuning Text-to-Image Diffusion Models", https://arxiv.org/abs/2305.16381).

The denoising chain is an MDP whose step policy is Gaussian (DDIM, eta > 0). DPOK maximises
`E[r(x_0, c)] - β · KL(p_θ(x_{0:T} | c) ‖ p_pre(x_{0:T} | c))`, bounding the trajectory KL by the sum of per-step
KLs between the fine-tuned and pre-trained step policies (Lemma 4.1 / Eq. 7). With a shared step std σ_t the
per-step KL is closed form in the difference of the two means:

    KL_t = ‖μ_θ(x_t, c, t) - μ_pre(x_t, c, t)‖² / (2 σ_t²)

Code names -> paper notation:
    log_probs        log p_θ(x_{t-1} | x_t, c)       under the current weights, mean over latent dims
    old_log_probs    log p_θ_old(x_{t-1} | x_t, c)   recorded at sampling time
    ratio            p_θ / p_θ_old, clamped to [1 - ratio_clip, 1 + ratio_clip]   (Eq. 8's importance weight)
    advantages       r(x_0, c) - V(x_t, c, t)  with the learned value baseline, else the (normalised) reward
    kl               KL_t above, averaged over latent dims (the same convention as the log-probs)
    reward_weight    α (weight on the reward term);  kl_weight  β
    mean_ref         μ_pre: the same UNet with its LoRA adapter disabled (no second copy in memory)
"""

import torch

# ---------------------------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------------------------


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Per-sample KL(N(mean, std²I) ‖ N(mean_ref, std²I)), averaged over the non-batch dims.

    Both step policies share the variance (it comes from the noise schedule, not the network), so the KL is
    `(mean - mean_ref)² / (2 std²)` per dimension. Averaging over dims (rather than summing) matches the
    log-prob convention, so `kl_weight` keeps the same meaning across image sizes.

    Args:
        mean (`torch.Tensor` of shape `[B, ...]`): mean of the policy step (carries the gradient).
        mean_ref (`torch.Tensor` of shape `[B, ...]`): mean of the reference step.
        std (`torch.Tensor` broadcastable to `mean`, or `float`): the shared standard deviation σ_t (> 0).

    Returns:
        `torch.Tensor` of shape `[B]`.
    """
    per_dim = (mean - mean_ref) ** 2 / (2 * torch.as_tensor(std, dtype=mean.dtype, device=mean.device) ** 2)
    return per_dim.flatten(1).mean(dim=1)


def eps_mse_kl(noise_pred: torch.Tensor, noise_pred_ref: torch.Tensor) -> torch.Tensor:
    """`mean over dims of (ε_θ - ε_ref)²` per sample: the regulariser of the DPOK reference code.

    It equals `gaussian_kl` up to a per-timestep factor c_t² / (2σ_t²) with c_t = ∂μ/∂ε̂ of the DDIM step;
    kept so the published `kl_weight` values reproduce the reference scale.
    """
    return ((noise_pred - noise_pred_ref) ** 2).flatten(1).mean(dim=1)


def dpok_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    kl: torch.Tensor,
    *,
    reward_weight: float,
    kl_weight: float,
    ratio_clip: float,
) -> tuple[torch.Tensor, dict]:
    """DPOK's per-step loss: `mean(-α · A · clamp(ρ, 1 - ε, 1 + ε) + β · KL_t)`.

    Unlike PPO's min/max, DPOK clamps the importance ratio itself: once ρ leaves [1 - ε, 1 + ε] that sample's
    reward term stops contributing gradient, which bounds how far a batch can move the policy.

    Args:
        log_probs (`torch.Tensor` of shape `[B]`): log-probs under the current weights.
        old_log_probs (`torch.Tensor` of shape `[B]`): log-probs recorded at sampling time.
        advantages (`torch.Tensor` of shape `[B]`): `r - V` or the normalised reward.
        kl (`torch.Tensor` of shape `[B]`): per-step KL to the pre-trained policy (carries the gradient).
        reward_weight (`float`): α.
        kl_weight (`float`): β.
        ratio_clip (`float`): ε.

    Returns:
        `(loss, stats)` with detached `policy_loss`, `kl`, `ratio` (mean clamped ρ), `approx_kl`, `clipfrac`.
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clamped = torch.clamp(ratio, 1.0 - ratio_clip, 1.0 + ratio_clip)
    policy_term = -reward_weight * advantages * clamped
    loss = (policy_term + kl_weight * kl).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": policy_term.double().mean(),
            "kl": kl.double().mean(),
            "ratio": ratio.double().mean(),
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > ratio_clip).double().mean(),
        }
    return loss, stats


def value_loss(values: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the value baseline V(x_t, c, t) against the final reward."""
    return torch.nn.functional.mse_loss(values.float(), rewards.float())
