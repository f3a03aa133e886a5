"""The pre-trained reference policy of a LoRA run, and the Gaussian KL to it.

The reference step policy is the policy's own UNet (or flow transformer) with its LoRA adapter switched off (no second copy in memory),
run on the same x_t, conditioning and guidance. DPOK's KL regulariser uses it today; D3PO's frozen reference,
Flow-GRPO's KL β and RAFT's regulariser toward the pre-trained model need the same two pieces.
"""

import torch

from diffrl.training.weights import adapter_disabled


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Per-sample KL(N(mean, std²I) ‖ N(mean_ref, std²I)), averaged over the non-batch dims.

    Both step policies share the variance (it comes from the noise schedule, not the network), so the KL is
    `(mean - mean_ref)² / (2 std²)` per dimension. Averaging over dims (rather than summing) matches the
    log-prob convention, so a KL weight keeps the same meaning across image sizes. The DPOK reference code
    penalises `mean((ε_θ - ε_ref)²)` instead; since a DDIM mean is affine in ε̂ (μ = a·x_t + c_t·ε̂), that is
    this KL times 2σ_t²/c_t², a per-timestep factor, so published `kl_weight` values do not carry over as is.

    Args:
        mean (`torch.Tensor` of shape `[B, ...]`): mean of the policy step (carries the gradient).
        mean_ref (`torch.Tensor` of shape `[B, ...]`): mean of the reference step.
        std (`torch.Tensor` broadcastable to `mean`, or `float`): the shared standard deviation σ_t (> 0).

    Returns:
        `torch.Tensor` of shape `[B]`.
    """
    per_dim = (mean - mean_ref) ** 2 / (2 * torch.as_tensor(std, dtype=mean.dtype, device=mean.device) ** 2)
    return per_dim.flatten(1).mean(dim=1)


def reference_step(pipe, sampler, traj, step_index: int):
    """Step `step_index` of `traj` recomputed by the pre-trained model (adapter off, no gradient): a `StepOutput`."""
    # deferred: diffrl.models imports diffusers (seconds); importing a trainer loads torch only
    from diffrl.models import model_family

    with torch.no_grad(), adapter_disabled(model_family(pipe).denoiser):
        return sampler.log_prob(pipe, traj, step_index, return_step=True)


def step_kl_to_reference(pipe, sampler, traj, step_index: int, *, kl_std: float | None = None):
    """Recompute step `step_index` of `traj` under the current weights and its per-step KL to the pre-trained model.

    The policy step keeps the caller's grad mode; the reference runs without gradient.

    Args:
        pipe: the pipeline whose `unet` carries the LoRA adapter.
        sampler: the step policy that sampled `traj` (`sampler.log_prob(..., return_step=True)`).
        traj (`Trajectory`): the trajectories (any number of samples).
        step_index (`int`): which denoising step (0-based, sampling order).
        kl_std (`float`, *optional*): the σ_t the KL divides by, in place of the step's std (Flow-GRPO's reference
            convention divides by the SDE's std per √|Δt|); defaults to the step's std, the exact KL.

    Returns:
        `(step, kl)`: the policy's `StepOutput` and `KL_t` `[B]` (`gaussian_kl`, per latent dim; zeros on a
        deterministic step, where there is no policy to regularise).
    """
    step = sampler.log_prob(pipe, traj, step_index, return_step=True)
    step_ref = reference_step(pipe, sampler, traj, step_index)
    if float(step.std) > 0:
        kl = gaussian_kl(step.mean, step_ref.mean, step.std if kl_std is None else kl_std)
    else:  # a deterministic step (σ = 0) is a point mass on its mean
        kl = 0.0 * step.mean.flatten(1).mean(dim=1)
    return step, kl
