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
                      (`samplers/flow.py`, `eta=MEMORYLESS_ETA`) is the Euler–Maruyama step of this SDE (except
                      at σ = 1, below; tested in tests/trainers/test_adjoint_matching.py)
    base drift        b = −2·v(x, σ) − x/(1 − σ)          (per unit paper time; dt = −dσ)
    lean adjoint      dã/dσ = ãᵀ·∇_x b = −2·ãᵀ∇_x v − ã/(1 − σ),  ã(σ=0) = −λ·∇r(x0)   = `lean_adjoint_step`
    loss              ‖ −(2/g)·(v_ft − v_base) + g·ã ‖²    = `adjoint_matching_loss`
    optimum           v_ft − v_base = (g²/2)·ã = σ/(1 − σ)·ã

Code names → paper notation:
    sigma, sigma_next     1 − t, 1 − (t + h): one sampler step goes from sigma to sigma_next < sigma
    noise_std             σ(t) of the paper (g here, so as not to clash with diffusers' σ)
    adjoint               ã(t), the lean adjoint, one per trajectory state `[B, ...]`
    reward_scale          λ, the reward's multiplier (the paper's target p_base·exp(r) with r scaled by λ)
    v_finetuned, v_base   v^finetune, v^base (base = the LoRA adapter switched off)

Differences on purpose:
- At σ = 1, g and the drift are infinite; the rollout step there is the sampler's (Flow-GRPO's reference code
  divides by 1 − σ' instead, `samplers/flow.py`), and the loss uses that same finite g (`step_noise_std`). The
  lean adjoint is never evaluated at σ = 1: its explicit Euler step from σ_{k+1} to σ_k (backwards in paper
  time) uses ∇b at the lower σ_{k+1}, the state it starts from.
- At σ = 1 the sampler's v coefficient is −dt, not −2·dt (the factor 1 + g²(1 − σ)/(2σ) is 1 there), so the first
  step applies half the control the loss assumes; the lean adjoint there is O(Δσ)-small, so its control is too.
- The loss is the mean over trajectories and over the trained steps K of the squared norm (the paper's sum over K
  is |K| times this; a constant factor on the learning rate). K is every step of the rollout, or `train_timesteps`
  of them per micro-batch, drawn uniformly or stratified as the authors' code (`timestep_split`, `loss_steps`).
- Rollouts use the recipe's `sample.guidance_scale`; by default the lean adjoint's base drift and the control are the
  guided velocities too (the velocity the rollout actually follows), and `guidance_in_adjoint: false` /
  `guidance_in_control: false` use the conditional ones alone, as the authors' code does by default. The reward is
  the recipe's, on decoded images, differentiated through the VAE decoder for ∇r(x0).

Trainer, per epoch and process: sample `sample.batch_size × num_batches_per_epoch` trajectories with the
memoryless SDE (`sample.eta` must be √2) from the current weights; score them; per micro-batch of `batch_size`:
ã at σ_T = 0 from the reward's gradient, the lean adjoint back to σ_0 with VJPs of the base transformer (adapter
off), then the loss at the trained steps (one backward per step), an optimizer step every
`optim.gradient_accumulation_steps` micro-batches. The authors' public code (microsoft/soc-fine-tuning-sd@489f904)
fine-tunes SD 1.5 through DDIM; its settings, mapped to a flow model, are recipes/adjoint_matching/sd35m_imagereward.yaml
(its header lists what differs: the flow schedule instead of its DDIM one, SD3.5-M instead of SD 1.5, no prompt
dropout). Its per-(trajectory, step) loss clipping at the EMA of the 90 % quantile (`clip_quantile`, `LossClip`) and
its step-size weighting of the loss (`loss_step_weight: dt`) are settings, off by default.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import Conditioning, module_dtype
from diffrl.training.context import RunContext
from diffrl.training.distributed import gather_tensor
from diffrl.training.rollout import local_batch
from diffrl.training.weights import adapter_disabled
from rewards.registry import declared_differentiable, differentiable_rewards

MEMORYLESS_ETA = math.sqrt(2.0)  # Flow-GRPO's noise level a whose SDE is the memoryless one: a²·σ/(1−σ) = g²


# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class AdjointMatchingConfig:
    batch_size: int = 2  # trajectories per training micro-batch, per process
    reward_scale: float = 1.0  # λ: the target is p_base·exp(λ·r), so it sets how far the model moves from the base
    # steps of the rollout's T the loss is taken at, per micro-batch: 0 = all T (the paper's K is a subset; each
    # trained step is one forward + backward of the trained model and one forward of the base)
    train_timesteps: int = 0
    # how those steps are drawn (without replacement, per micro-batch): 0 = uniformly from all T; s in (0, 1) =
    # stratified, K // 2 from the first round(s·T) steps (high noise) and the rest from the later ones, as the authors'
    # code (microsoft/soc-fine-tuning-sd@489f904 am_trainer.py `sample_time_indices`, s = 0.6)
    timestep_split: float = 0.0
    # with guided rollouts (sample.guidance_scale > 1): whether the lean adjoint's base drift (`guidance_in_adjoint`)
    # and the control v_ft − v_base in the loss (`guidance_in_control`) use the guided velocities (true: the target
    # is the tilted CFG distribution, theory and sampler agree) or the conditional ones alone (false, the authors'
    # code's defaults `guidance_in_adjoint_computation` / `guidance_in_control_computation`: CFG rollouts, an
    # unguided adjoint and control; its README: not fully grounded, best empirically; both true: adjoints blow up)
    guidance_in_adjoint: bool = True
    guidance_in_control: bool = True
    # each trained step's loss weighted by its step size Δσ_k = σ_k − σ_{k+1} ("dt": the loss as a Riemann sum of the
    # paper's time integral, as the authors' code's √δ·u and √δ·σ(t) make it) or not ("none", diffrl's earlier loss).
    # On a uniform schedule the two differ by a constant; on a shifted flow schedule "dt" weights the long early steps
    # more than the short late ones
    loss_step_weight: str = "none"
    # per-(trajectory, step) loss clipping as the authors' code (`per_sample_threshold_quantile`, 0.9 there): a loss
    # whose square root is at or above the EMA (decay `clip_ema_decay`) of this quantile of the micro-batch's square
    # roots (over all processes and trained steps) is left out of the mean (counted as 0); 0 = off
    clip_quantile: float = 0.0
    clip_ema_decay: float = 0.9


TrainConfig = AdjointMatchingConfig

# The shared `optim:` group. No published values are reproduced here: AdamW 1e-4, gradient clip 1.0 (diffrl's usual
# LoRA defaults)
OPTIM_DEFAULTS = {"learning_rate": 1e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
ADVANTAGE_DEFAULTS = None  # no advantages: the reward enters through its gradient


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


def loss_steps(rng: np.random.Generator, num_steps: int, n: int, split: float = 0.0) -> np.ndarray:
    """The rollout steps (indices 0..T−1) the loss is taken at for one micro-batch, drawn without replacement.

    Args:
        rng (`np.random.Generator`): the trainer's generator.
        num_steps (`int`): T.
        n (`int`): K, how many (all T when n >= T).
        split (`float`, *optional*, defaults to 0): 0 = uniformly from all T; in (0, 1) = n // 2 from the first
            m = round(split·T) steps and n − n // 2 from the last T − m (the authors' stratified draw, sorted).
    """
    if n >= num_steps:
        return np.arange(num_steps)
    if not split:
        return rng.permutation(num_steps)[:n]
    m = round(num_steps * split)
    early = rng.choice(m, n // 2, replace=False)
    late = m + rng.choice(num_steps - m, n - n // 2, replace=False)
    return np.sort(np.concatenate([early, late]))


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


def ema_threshold(previous: float, value: float, updates: int, decay: float) -> float:
    """The clipping threshold's running average after one more value, as the authors' code's `EMA_update`
    (microsoft/soc-fine-tuning-sd@489f904 am_trainer.py): the first value as is, a plain running mean while fewer
    than 1/decay values were seen, then decay·previous + (1 − decay)·value.

    Args:
        previous (`float`): the threshold before this value (ignored when `updates` is 0).
        value (`float`): this micro-batch's quantile of the losses' square roots.
        updates (`int`): values seen before this one.
        decay (`float`): in (0, 1).
    """
    if updates == 0:
        return value
    if updates < 1 / decay:
        return value / (updates + 1) + (1 - 1 / (updates + 1)) * previous
    return decay * previous + (1 - decay) * value


class LossClip(torch.nn.Module):
    """The EMA clipping threshold (`clip_quantile`, `clip_ema_decay`) as buffers, so a checkpoint resumes it."""

    def __init__(self, quantile: float, decay: float):
        super().__init__()
        self.quantile, self.decay = quantile, decay
        self.register_buffer("threshold", torch.zeros((), dtype=torch.float64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def update(self, losses: torch.Tensor) -> float:
        """Fold in one micro-batch's losses (every process's, every trained step; NaNs ignored); the new threshold."""
        value = float(torch.nanquantile(losses.double().sqrt(), self.quantile))
        self.threshold.fill_(ema_threshold(float(self.threshold), value, int(self.updates), self.decay))
        self.updates += 1
        return float(self.threshold)


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


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune the flow-matching pipeline `cfg.model.pipeline` with Adjoint Matching against a differentiable
    `cfg.reward`; write the run dir; return the final metrics. Arguments as `diffrl.trainers.ddpo.train`."""
    tc: AdjointMatchingConfig = cfg.train
    check(cfg)
    n_steps = trained_steps(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="adjoint_matching", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=n_steps * cfg.optim.gradient_accumulation_steps)
    if not ctx.sampler.flow:
        raise UserError(f"Adjoint Matching trains flow-matching pipelines (SD3, FLUX class); {cfg.model.pipeline} is "
                        f"sampled by the '{ctx.sampler.name}' sampler: use draft for it")
    if not ctx.reward.differentiable:  # a user reward that declared nothing at load time
        raise UserError(f"Adjoint Matching needs the reward's gradient and '{cfg.reward.name}' is not "
                        f"differentiable; use one of {', '.join(differentiable_rewards())}")
    clip = LossClip(tc.clip_quantile, tc.clip_ema_decay).to(ctx.accelerator.device) if tc.clip_quantile else None
    ctx.load_state(extra_modules={"loss_clip": clip} if clip is not None else None)

    for epoch, record in ctx.epochs():
        # ---- 1. trajectories of the memoryless SDE from the current weights, scored (no gradient)
        rollout = ctx.rollout()
        traj, _, local_ok = local_batch(rollout, np.zeros(len(rollout.all_rewards)), ctx.accelerator)

        # ---- 2. per micro-batch: terminal adjoint, lean adjoint backwards, adjoint-matching loss
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = adjoint_matching_update(ctx, traj=traj, valid=local_ok, n_steps=n_steps, clip=clip)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan()

        # ---- 3. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def adjoint_matching_update(ctx, *, traj, valid, n_steps: int, clip: LossClip | None = None) -> tuple[dict, bool]:
    """One pass over this process's trajectories in shuffled micro-batches. Returns (epoch diagnostics, stop).
    With `clip`, each micro-batch's losses are first computed without a graph to set the threshold (one more forward
    of the trained model per trained step), then trained with the losses at or above it left out."""
    tc: AdjointMatchingConfig = ctx.cfg.train
    pipe, network, rng = ctx.pipe, ctx.unet, ctx.rng
    family = model_family(pipe)
    dtype, device = module_dtype(network), ctx.accelerator.device
    guidance = traj.guidance_scale
    sigmas = ctx.sampler.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:])).sigmas  # T + 1, last 0
    noise_std = [step_noise_std(s, n) for s, n in itertools.pairwise(sigmas)]
    update = ctx.policy_update(losses_per_micro_batch=n_steps)
    order = rng.permutation(len(traj))
    minibatches = [order[i: i + tc.batch_size] for i in range(0, len(traj), tc.batch_size)]
    for idx in update.micro_batches(minibatches):
        index = torch.as_tensor(idx)
        mb = traj.select(index)
        cond = Conditioning.from_trajectory(mb).to(device)
        latents, ok = mb.latents.to(device), valid[index.to(device)]
        prompts = list(mb.prompts)

        # the guided velocities (as the rollout's) or the conditional ones alone (`guidance_in_adjoint/_control`)
        adjoint_cond = cond if tc.guidance_in_adjoint else cond.conditional()
        control_cond = cond if tc.guidance_in_control else cond.conditional()

        def velocity(x, k, conditioning):  # the velocity at σ_k under the current adapter state, guided if CFG is in it
            t = torch.full((x.shape[0],), sigmas[k] * 1000.0, dtype=torch.float32, device=device)
            with ctx.accelerator.autocast():
                return family.model_output(x, t, conditioning, guidance, dtype).float()

        def reward_fn(x0, prompts=prompts):
            with ctx.accelerator.autocast():
                return ctx.reward(family.decode(x0), prompts, None).scores

        terminal, _ = terminal_adjoint(latents[:, -1], reward_fn, tc.reward_scale)
        with adapter_disabled(network):  # the lean adjoint follows the base drift only
            adjoints = lean_adjoints(latents, sigmas, terminal, lambda x, k, c=adjoint_cond: velocity(x, k, c))
        steps = loss_steps(rng, traj.num_steps, n_steps, tc.timestep_split)
        weight = {k: sigmas[k] - sigmas[k + 1] if tc.loss_step_weight == "dt" else 1.0 for k in steps}
        with torch.no_grad(), adapter_disabled(network):
            v_base = {k: velocity(latents[:, k], k, control_cond) for k in steps}
        kept = torch.ones(len(steps), int(ok.sum()), dtype=torch.bool, device=device)
        if clip is not None:  # the mask from these no-graph values, which set the threshold (exactly as compared)
            with torch.no_grad():
                pre = torch.stack([weight[k] * adjoint_matching_loss(velocity(latents[:, k], k, control_cond),
                                                                     v_base[k], adjoints[:, k], noise_std[k])
                                   for k in steps])
            pre[:, ~ok] = math.nan
            threshold = clip.update(gather_tensor(ctx.accelerator, pre.flatten()))
            kept = pre[:, ok].double().sqrt() < threshold  # in the precision the threshold was taken in
        for j, k in enumerate(steps):
            v_theta = velocity(latents[:, k], k, control_cond)
            if bool(ok.any()):
                per_sample = weight[k] * adjoint_matching_loss(v_theta[ok], v_base[k][ok], adjoints[ok, k],
                                                               noise_std[k])
                kept_k = kept[j]
                update.backward((per_sample * kept_k).mean(), {
                    "adjoint_norm": adjoints[ok, k].detach().flatten(1).norm(dim=1).mean().double(),
                    "loss_kept": kept_k.double().mean()})
            else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                update.backward(v_theta.sum() * 0.0)
    # no KL term: the memoryless KL to the base is what the loss controls, not a separate penalty
    keys = ("loss", "kl", "adjoint_norm", "grad_norm") + (("loss_kept",) if clip is not None else ())
    return update.stats(keys, kl=None), update.stopped


def trained_steps(cfg) -> int:
    """Steps of the rollout the loss is taken at per micro-batch: `train_timesteps`, or all T when 0."""
    n = cfg.train.train_timesteps
    return cfg.sample.num_steps if n == 0 else min(n, cfg.sample.num_steps)


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time and again in `train`). Raises `UserError`."""
    tc: AdjointMatchingConfig = cfg.train
    if tc.batch_size < 1:
        raise UserError("train.batch_size must be >= 1")
    if not 0 < tc.reward_scale < float("inf"):
        raise UserError(f"train.reward_scale must be a finite number > 0, got {tc.reward_scale}")
    if tc.train_timesteps < 0:
        raise UserError(f"train.train_timesteps must be >= 0 (0 = every step), got {tc.train_timesteps}")
    if not 0 <= tc.timestep_split < 1:
        raise UserError(f"train.timestep_split must be in [0, 1) (0 = uniform), got {tc.timestep_split}")
    n, steps = trained_steps(cfg), cfg.sample.num_steps
    if tc.timestep_split and n < steps:
        m = round(steps * tc.timestep_split)
        if m < n // 2 or steps - m < n - n // 2:
            raise UserError(f"train.timestep_split={tc.timestep_split} splits the {steps} steps {m} / {steps - m}: "
                            f"too few for {n // 2} / {n - n // 2} of train.train_timesteps={n}")
    if tc.loss_step_weight not in ("none", "dt"):
        raise UserError(f"train.loss_step_weight must be 'none' or 'dt' (each step's loss times Δσ), got "
                        f"{tc.loss_step_weight!r}")
    if not 0 <= tc.clip_quantile <= 1:
        raise UserError(f"train.clip_quantile must be in [0, 1] (0 = no loss clipping; the authors' code: 0.9), got "
                        f"{tc.clip_quantile}")
    if not 0 < tc.clip_ema_decay < 1:
        raise UserError(f"train.clip_ema_decay must be in (0, 1), got {tc.clip_ema_decay}")
    if cfg.sample.sampler not in ("auto", "flow"):
        raise UserError(f"Adjoint Matching samples with the flow sampler's SDE (flow or auto), not "
                        f"sample.sampler={cfg.sample.sampler}")
    etas = cfg.sample.eta if isinstance(cfg.sample.eta, (list, tuple)) else [cfg.sample.eta]
    if any(abs(float(e) - MEMORYLESS_ETA) > 1e-6 for e in etas):
        raise UserError(f"Adjoint Matching samples with the memoryless SDE: set sample.eta to √2 = "
                        f"{MEMORYLESS_ETA!r} (got {cfg.sample.eta})")
    terms = [(cfg.reward.name, cfg.reward.kwargs)] if cfg.reward.name else [
        (c.name, c.kwargs) for c in cfg.reward.components]
    for name, kwargs in terms:
        if declared_differentiable(name, kwargs) is False:
            raise UserError(f"Adjoint Matching needs the reward's gradient and '{name}' is not differentiable; use "
                            f"one of {', '.join(differentiable_rewards())} (or a trainer for any reward: flow_grpo, "
                            f"diffusion_nft)")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch, and the steps each trajectory's loss is taken at."""
    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size)
    out["train_steps_per_trajectory"] = trained_steps(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Per process and epoch: per micro-batch, T forward + backward (VJP) passes of the base for the lean adjoint
    and per trained step one forward + backward of v_θ and a forward of the base; an AdamW step per optimizer step.
    The reward's backward through the decoder is not counted."""
    tc = cfg.train
    micro_batches = -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    n = trained_steps(cfg)
    return {"train_batch": tc.batch_size, "fwd_bwd": micro_batches * (n + cfg.sample.num_steps),
            "reference": micro_batches * n, "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
