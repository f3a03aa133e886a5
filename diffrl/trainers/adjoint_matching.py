"""Adjoint Matching: reward fine-tuning of a flow-matching model as memoryless stochastic optimal control.

Paper: Domingo-Enrich, Drozdzal, Karrer, Chen, "Adjoint Matching: Fine-tuning Flow and Diffusion Generative Models
with Memoryless Stochastic Optimal Control", ICLR 2025, https://arxiv.org/abs/2409.08861 (read, not copied; no code
copied from any implementation). The goal is the tilted distribution p*(x) ∝ p_base(x)·exp(λ·r(x)). Sampling the
base flow with the *memoryless* noise schedule makes the terminal sample independent of the starting noise, so the
KL-regularised control problem's optimum has exactly that terminal law; its optimal control is u* = −gᵀ·a with a the
adjoint, and the "lean" adjoint (the adjoint ODE with the control's own terms dropped, whose expectation they do not
change at the optimum) is regressed onto the control:

    paper time t: 0 = noise → 1 = data, X_t = α_t·X̄_1 + β_t·X̄_0 (α_t = t, β_t = 1 − t for rectified flow)
    memoryless noise  σ(t) = √(2·β_t·(α̇_t·β_t/α_t − β̇_t)) = √(2(1 − t)/t)
    base SDE          dX = b(X, t)·dt + σ(t)·dB,   b = 2·v(X, t) − (α̇_t/α_t)·X = 2v − X/t
    fine-tuned SDE    dX = (b + σ·u)·dt + σ·dB,    u = (2/σ(t))·(v_ft − v_base)
    lean adjoint      dã/dt = −ãᵀ·∇_X b(X_t, t),   ã(1) = −λ·∇r(X_1)      (no u terms: "lean")
    loss              L(θ) = Σ_{t∈K} ‖ (2/σ(t))·(v_ft(X_t, t) − v_base(X_t, t)) + σ(t)·ã(t) ‖²
                      on trajectories of the current fine-tuned SDE, with no gradient through X or ã.

Here, in diffusers' convention (x_σ = (1 − σ)·x0 + σ·ε, σ from 1 = noise to 0 = data, the model predicts
v = ε − x0): t = 1 − σ and v_paper = −v, so

    memoryless noise  g(σ) = √(2σ/(1 − σ))   = `memoryless_noise_std`; Flow-GRPO's SDE step at noise level a = √2
                      (`samplers/flow.py`, `eta=MEMORYLESS_ETA`) is exactly the Euler–Maruyama step of this SDE
    base drift        b = −2·v(x, σ) − x/(1 − σ)          (per unit paper time; dt = −dσ)
    lean adjoint      dã/dσ = ãᵀ·∇_x b = −2·ãᵀ∇_x v − ã/(1 − σ),  ã(σ=0) = −λ·∇r(x0)   = `lean_adjoint_step`
    loss              ‖ −(2/g)·(v_ft − v_base) + g·ã ‖²    = `adjoint_matching_loss`
    optimum           v_ft − v_base = (g²/2)·ã = σ/(1 − σ)·ã

Code names → paper notation:
    sigma, sigma_next     1 − t, 1 − (t + h): one sampler step goes from sigma to sigma_next < sigma
    noise_std             σ(t) of the paper (g here, so as not to clash with diffusers' σ)
    adjoint               ã(t), the lean adjoint, one per trajectory state `[B, ...]`
    reward_scale          λ (the paper's reward multiplier; the target is p_base·exp(λ·r))
    v_finetuned, v_base   v^finetune, v^base (base = the LoRA adapter switched off)

Differences on purpose:
- At σ = 1, g and the drift are infinite; the rollout step there is the sampler's (Flow-GRPO's reference code
  divides by 1 − σ' instead, `samplers/flow.py`), and the loss uses that same finite g (`step_noise_std`). The
  lean adjoint is never evaluated at σ = 1: its Euler step from σ_{k+1} to σ_k uses ∇b at the lower σ_{k+1}
  (the paper's Euler scheme evaluates at t + h).
- The loss is the mean over trajectories and over the trained steps K of the squared norm (the paper's sum over K
  is |K| times this; a constant factor on the learning rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MEMORYLESS_ETA = math.sqrt(2.0)  # Flow-GRPO's noise level a whose SDE is the memoryless one: a²·σ/(1−σ) = g²


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------------


def memoryless_noise_std(sigma: float) -> float:
    """g(σ) = √(2σ/(1 − σ)), the memoryless diffusion coefficient of rectified flow in diffusers' σ (the paper's
    σ(t) = √(2(1 − t)/t) at t = 1 − σ). Infinite at σ = 1."""
    if sigma >= 1:
        return math.inf
    return math.sqrt(2 * sigma / (1 - sigma))


def step_noise_std(sigma: float, sigma_next: float) -> float:
    """The diffusion coefficient the memoryless rollout uses on the step σ → σ': g(σ), except at σ = 1 where the
    sampler divides by 1 − σ' (Flow-GRPO's convention, `samplers.flow.sde_constants`): √(2/(1 − σ'))."""
    return math.sqrt(2 * sigma / (1 - (sigma_next if sigma >= 1 else sigma)))


def terminal_adjoint(x0: torch.Tensor, reward_fn: Callable[[torch.Tensor], torch.Tensor],
                     reward_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ã(σ=0) = −λ·∇r(x0) for each sample, and the rewards `[B]` (detached).

    Args:
        x0 (`torch.Tensor` `[B, ...]`): the rollout's clean samples (detached here).
        reward_fn (`Callable`): `x0 -> rewards [B]`, differentiable in x0 (a sample's reward depends on it alone).
        reward_scale (`float`): λ.
    """
    x = x0.detach().requires_grad_(True)
    with torch.enable_grad():
        rewards = reward_fn(x)
        (grad,) = torch.autograd.grad(rewards.sum(), x)
    return -reward_scale * grad.detach(), rewards.detach()


def lean_adjoint_step(adjoint: torch.Tensor, x: torch.Tensor, sigma: float, sigma_prev: float,
                      velocity_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One Euler step of the lean adjoint ODE backwards in paper time, from σ (the later, less noisy state) to
    σ_prev > σ: ã(σ_prev) = ã(σ) + (σ_prev − σ)·[−2·ãᵀ∇_x v(x, σ) − ã/(1 − σ)].

    Args:
        adjoint (`torch.Tensor` `[B, ...]`): ã(σ).
        x (`torch.Tensor` `[B, ...]`): the trajectory's state at σ.
        sigma, sigma_prev (`float`): σ < σ_prev ≤ 1.
        velocity_fn (`Callable`): `x -> v_base(x, σ)` `[B, ...]`, the base velocity at this σ (each sample's
            output depends on its own input only, so one VJP gives every sample's ãᵀ∇_x v).
    """
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        v = velocity_fn(x)
        (vjp,) = torch.autograd.grad(v, x, grad_outputs=adjoint.to(v.dtype))
    drift_vjp = -2 * vjp.to(adjoint.dtype) - adjoint / (1 - sigma)  # ãᵀ∇_x b
    return (adjoint + (sigma_prev - sigma) * drift_vjp).detach()


def lean_adjoints(latents: torch.Tensor, sigmas, terminal: torch.Tensor,
                  velocity_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """The lean adjoint at every state of a trajectory, integrated from the clean end (σ_T = 0) to σ_0 = 1.

    Args:
        latents (`torch.Tensor` `[B, T + 1, ...]`): the states x_{σ_0}, ..., x_{σ_T} of the rollout.
        sigmas (`Sequence[float]`): σ_0 = 1 > ... > σ_T = 0 (T + 1 values).
        terminal (`torch.Tensor` `[B, ...]`): ã(σ_T) = −λ·∇r(x_{σ_T}) (`terminal_adjoint`).
        velocity_fn (`Callable`): `(x, k) -> v_base(x, σ_k)`.

    Returns:
        `torch.Tensor` `[B, T + 1, ...]`: ã(σ_k) for k = 0..T.
    """
    steps = len(sigmas) - 1
    out = [terminal]
    for k in range(steps - 1, -1, -1):  # ã(σ_k) from ã(σ_{k+1}) and ∇b at x_{σ_{k+1}}
        out.append(lean_adjoint_step(out[-1], latents[:, k + 1], sigmas[k + 1], sigmas[k],
                                     lambda x, k=k: velocity_fn(x, k + 1)))
    return torch.stack(out[::-1], dim=1)


def adjoint_matching_loss(v_finetuned: torch.Tensor, v_base: torch.Tensor, adjoint: torch.Tensor,
                          noise_std: torch.Tensor | float) -> torch.Tensor:
    """Per-sample adjoint-matching residual ‖ −(2/g)·(v_ft − v_base) + g·ã ‖² (sum over latent dims), in
    diffusers' v (= −the paper's velocity), computed in float32 or wider.

    Args:
        v_finetuned (`torch.Tensor` `[B, ...]`): the trained velocity at x_σ (carries the gradient).
        v_base (`torch.Tensor` `[B, ...]`): the base velocity at x_σ (no gradient).
        adjoint (`torch.Tensor` `[B, ...]`): ã(σ) (no gradient).
        noise_std (`float` or `torch.Tensor` `[B]`): g at this step (`step_noise_std`).

    Returns:
        `torch.Tensor` `[B]`.
    """
    dtype = torch.promote_types(v_finetuned.dtype, torch.float32)
    g = torch.as_tensor(noise_std, dtype=dtype, device=v_finetuned.device)
    g = g.reshape(-1, *([1] * (v_finetuned.ndim - 1))) if g.ndim == 1 else g
    control = -(2 / g) * (v_finetuned.to(dtype) - v_base.detach().to(dtype))  # u
    residual = control + g * adjoint.detach().to(dtype)
    return (residual**2).flatten(1).sum(dim=1)
