"""AWM, Advantage Weighted Matching: the flow-matching pre-training loss on the policy's own samples, weighted by
their advantages (Xue, Ge, Zhang, Li, Ma, ICML 2026).

Paper: "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models", https://arxiv.org/abs/2509.25050.
Reference code: github.com/scxue/advantage_weighted_matching at be51372 (`advantage_weighted_matching/scripts/
train_sd3_awm.py`: `compute_log_prob_awm` and the training loop; `config/dgx_awm.py`: the published runs), read, not
copied. Flow-Factory (github.com/X-GenGroup/Flow-Factory at a0b2bc5, `src/flow_factory/trainers/awm.py`) ships the
same loss. The paper's equation numbers could not be read offline; the objective below is the reference code's.

The paper's argument: DDPO's per-step likelihood on x_{t−Δt} is denoising score matching with a *noisy* target (x_t
conditioned on x_{t−Δt}), which adds variance; AWM keeps the pre-training objective, flow matching towards the
*clean* sample x0, and weights each sample by its advantage A, so high-reward samples are fitted and low-reward ones
pushed away. The policy's matching loss plays the part of −log π:

    x_t      = (1 − t)·x0 + t·ε,   v = ε − x0                 (flow matching's forward process and target, t = σ)
    ℓ_θ      = mean over latent dims of (v_θ(x_t, t, c) − v)²  (the pre-training loss on a rollout's clean x0)
    log p_θ  = −w(ℓ_θ, t)                                       (`matching_log_prob`; w below)
    ρ        = exp(log p_θ − log p_old)                         (1 until the epoch's first optimizer step)
    L_policy = E[ max(−A·ρ, −A·clip(ρ, 1 − c, 1 + c)) ]         (PPO's clipped surrogate on ρ)
    L        = L_policy + β_KL·E‖v_θ − v_ref‖² + β_EMA·E‖v_θ − v_ema‖²

At ρ = 1 the gradient is E[A·∇w(ℓ_θ, t)]: plain flow matching on the samples with A > 0, anti-matching on A < 0.
With one optimizer step per epoch (the published runs) ρ ≡ 1 and the clip never acts. The weighting w(ℓ, t)
(`WEIGHTINGS`; the reference's names in brackets):

    uniform ['Uniform']  ℓ                          t ['t']   t·ℓ             t2 ['t**2']   t²·ℓ
    huber   ['huber']    t·(√(ℓ + 1e-10) − 1e-5)    ghuber ['ghuber']  t·((ℓ + 1e-10)^p − 1e-10^p)/p  (published, p ¼)

Code names → paper / reference code (train_sd3_awm.py, config/dgx_awm.py):
    v_theta, v_ref, v_ema   v_θ; the adapter-off model; the "ema" adapter   model_output, model_output_ref, _ema
    x0, noise, sigma        x0 (a rollout's final latent), ε, t ∈ (0, 1]    clean_latents, train_random_noise, timesteps
    matching_log_prob       −w(ℓ, t)                                         log_prob of `compute_log_prob_awm`
    advantages              A = clip(A_raw, ±A_clip)·A_max/A_clip            advantages (adv_clip_max, advantage_max)
    ratio_clip              c                                                train.clip_range (1 in the published runs)
    kl_beta, ema_kl_beta    β_KL, β_EMA                                      train.beta, train.ema_beta
    ema_decay_rate/_max     d = min(rate·step, max) of the EMA's update      kl_ema_decay_type 'linear', kl_ema_decay
    train_timesteps         t values per sample per epoch                   train.train_timesteps (6)
    time_type, timestep_fraction   stratified schedule indices              config.time_type, train.timestep_fraction

How it differs from DiffusionNFT (`diffrl.trainers.diffusion_nft`), which also trains a flow-matching loss on the
forward process of the policy's own clean samples, with any solver for the rollouts:
- NFT maps each reward to an optimality probability r ∈ [0, 1] and fits two implicit policies built from the
  sampling policy v_old, v⁺ = (1 − β)v_old + βv_θ with weight r and v⁻ = (1 + β)v_old − βv_θ with weight 1 − r: its
  loss is bounded below for every sample and v_old is part of the regression target. AWM weights v_θ's own
  matching loss by the signed advantage: no implicit policies, no v_old in the target; a negative advantage pushes
  v_θ away from the sample's target, unbounded, so the update is held by the clip on ρ and the two KL terms.
- NFT samples its rollouts from a slowly updated old policy; AWM samples with the current θ and keeps its slowly
  updated copy (the EMA policy, d up to 0.3) only as a KL anchor.
- NFT's reference loss is measured in x0 space over its own mean |error| (`weighting: adaptive`); AWM's is the
  velocity error through w(ℓ, t) (generalised Huber with t-weighting in the published runs).
- AWM draws its t values stratified over the first 90 % of the rollout schedule, shared by a micro-batch; NFT draws
  a random subset of the schedule per sample.

Conventions, the reference code's at its published settings:
- Advantages: A_raw = (reward − its prompt's mean in the epoch) / (std of all the epoch's rewards + 1e-4) (the
  reference's `PerPromptStatTracker(global_std=True)`; `advantage:` defaults here), then clipped to ±`adv_clip_max`
  (5) and scaled by `advantage_max / adv_clip_max` (1/5): A ∈ [−1, 1] (`scaled_advantages`).
- t values (`timestep_indices`): `train_timesteps` T strata of the first int(N·`timestep_fraction`) indices of the
  N-step rollout schedule (`time_type: discrete`, the PickScore run; `discrete_wo_init` starts at index 1, skipping
  pure noise, the GenEval and OCR runs), one uniform index per stratum, shared by the micro-batch's samples; fresh
  noise per sample and t. Each (micro-batch, t) is one backward; their mean is the reference's mean over T·B.
- log p_old: the matching log-prob under the weights the epoch started with (the rollout's). Before the epoch's first
  optimizer step it is the current one, detached (ρ = 1 exactly, as the reference's `old_log_probs` of its first
  micro-batches); after it, recomputed with a copy of the epoch-start weights.
- KL: β_KL·mean (v_θ − v_ref)² to the pre-trained model (adapter off; `kl_weight: Uniform`), β_EMA·mean (v_θ −
  v_ema)² to the EMA policy (`kl_ema_weight: Uniform`); the EMA starts as θ and after every epoch's training is
  soft-updated ema ← d·ema + (1 − d)·θ with d = min(0.001·step, 0.3) of the optimizer steps so far.
- CFG-free: the matching loss uses the conditional velocity only (`train.cfg = False`), rollouts at CFG 1.

Differences on purpose: the rollouts use any flow sampler at `sample.eta` (0: Euler's ODE; the reference's published
runs use an SA-solver ODE); the EMA KL is added whenever β_EMA > 0 (the reference adds it only when β_KL > 0 as
well, which its published runs satisfy); the reference skips its first two epochs (a group-size workaround), here
every epoch trains. Not implemented: the continuous t samplers (`logit_normal`, `uniform`), `loss_type: sum_first`
(one ratio per sample over its mean log-prob), the ELBO KL weighting, `off_policy` sampling from the EMA policy,
inner epochs > 1, a constant EMA decay (set `ema_decay_rate` large for d = max from the first update on).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import Conditioning, module_dtype
from diffrl.training.advantages import check_advantage_config, make_stat_tracker
from diffrl.training.context import RunContext
from diffrl.training.old_policy import OldPolicy, old_policy_decay, velocity_kl
from diffrl.training.rollout import epoch_advantages, local_batch
from diffrl.training.setup import check_flow_sampler
from diffrl.training.weights import adapter_disabled

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
TIME_TYPES = ("discrete", "discrete_wo_init")
_EPS = 1e-10  # the reference's ε inside the (generalised) Huber weighting


# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group), defaults as the published SD3.5-M PickScore run (config/dgx_awm.py)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class AWMConfig:
    batch_size: int = 2  # clean samples per training micro-batch, per process (train.batch_size)
    train_timesteps: int = 6  # T: t values each sample is trained at per epoch (train.train_timesteps)
    timestep_fraction: float = 0.9  # the t values come from the first int(N·fraction) of the N rollout steps
    # "discrete": T strata of indices [0, int(N·fraction)); "discrete_wo_init": of [1, int(N·fraction)) (no t = 1)
    time_type: Literal["discrete", "discrete_wo_init"] = "discrete"
    weighting: str = "ghuber"  # w(ℓ, t): uniform, t, t2, huber or ghuber (the reference's 'Uniform', 't', 't**2', ...)
    ghuber_power: float = 0.25  # p of the generalised Huber weighting
    ratio_clip: float = 1.0  # c: ρ clipped to [1 − c, 1 + c] (train.clip_range)
    adv_clip_max: float = 5.0  # advantages clipped to ±adv_clip_max ...
    advantage_max: float = 1.0  # ... then scaled by advantage_max / adv_clip_max (0: no scaling)
    kl_beta: float = 1e-4  # β_KL: weight of mean (v_θ − v_ref)² to the pre-trained velocity (train.beta)
    ema_kl_beta: float = 1.0  # β_EMA: weight of mean (v_θ − v_ema)² to the EMA policy (train.ema_beta)
    # the EMA policy's update after each epoch, ema ← d·ema + (1 − d)·θ, d = min(rate·step, max) with step = optimizer
    # steps so far (the reference's kl_ema_decay_type 'linear' with its 0.001 and kl_ema_decay 0.3)
    ema_decay_rate: float = 0.001
    ema_decay_max: float = 0.3


TrainConfig = AWMConfig

# The shared `optim:` group: AdamW 3e-4, weight decay 1e-4, gradient clip 1.0 (config/base_awm.py, dgx_awm.py; its
# cosine schedule over decay_steps = 1e10 is constant in practice)
OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
# The `advantage:` group: group-relative rewards over the epoch's std plus 1e-4 (PerPromptStatTracker with
# sample.global_std = True), 24 images per prompt; clipped and scaled below (`scaled_advantages`), not here
ADVANTAGE_DEFAULTS = {"mode": "group", "group_size": 24, "group_std": "global", "clip_max": 0.0, "std_eps": 1e-4,
                      "group_by": "prompt"}


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------------


def scaled_advantages(advantages: torch.Tensor, clip_max: float, advantage_max: float) -> torch.Tensor:
    """A = clip(A_raw, −clip_max, clip_max)·advantage_max/clip_max (advantage_max 0: clipped only)."""
    clipped = advantages.clamp(-clip_max, clip_max)
    return clipped * (advantage_max / clip_max) if advantage_max > 0 else clipped


def matching_log_prob(v: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, *, weighting: str = "ghuber",
                      ghuber_power: float = 0.25) -> torch.Tensor:
    """The matching log-prob `[B]` in float64: −w(ℓ, t) with ℓ the mean over latent dims of (v − target)².

    Args:
        v (`torch.Tensor` `[B, ...]`): the velocity (carries the gradient); target: ε − x0, the same shape.
        sigma (`torch.Tensor` `[B]`): t of each sample (x_t = (1 − t)·x0 + t·ε).
        weighting (`str`): one of `WEIGHTINGS` (the module docstring's table).
        ghuber_power (`float`): p of `ghuber`.
    """
    err = ((v.double() - target.double()) ** 2).flatten(1).mean(1)
    t = sigma.double().reshape(-1)
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * t
    if weighting == "t2":
        return -err * t**2
    if weighting == "huber":
        return -(torch.sqrt(err + _EPS) - 1e-5) * t
    if weighting == "ghuber":
        return -(torch.pow(err + _EPS, ghuber_power) - _EPS**ghuber_power) * t / ghuber_power
    raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")


def awm_loss(
    v_theta: torch.Tensor,
    target: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_log_prob: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    v_ema: torch.Tensor | None = None,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    ratio_clip: float = 1.0,
    kl_beta: float = 0.0,
    ema_kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """AWM's loss on one noised batch (the module docstring's L), computed in float64 and returned in v_theta's dtype
    or float32, whichever is wider.

    Args:
        v_theta (`torch.Tensor` `[B, ...]`): the trained velocity at x_t (carries the gradient).
        target (`torch.Tensor` `[B, ...]`): v = ε − x0.
        sigma (`torch.Tensor` `[B]`): t of each sample.
        advantages (`torch.Tensor` `[B]`): A, already clipped and scaled (`scaled_advantages`).
        old_log_prob (`torch.Tensor` `[B]`, *optional*): log p_old, the sampling weights' `matching_log_prob`; None:
            the current one detached (ρ = 1, before the epoch's first optimizer step).
        v_ref, v_ema (`torch.Tensor` `[B, ...]`, *optional*): the pre-trained and the EMA velocity (no gradient);
            their KL terms are added when given, weighted by `kl_beta` and `ema_kl_beta`.
        weighting, ghuber_power: w(ℓ, t) (`matching_log_prob`).
        ratio_clip (`float`): c > 0.

    Returns:
        `(loss, stats)`: the scalar loss (mean over the batch) and detached `policy_loss`, `matching_loss` (mean ℓ),
        `ratio` (mean ρ), `clipfrac` (share of |ρ − 1| > c), and `kl` / `ema_kl` where given.
    """
    if ratio_clip <= 0:
        raise ValueError(f"ratio_clip must be > 0, got {ratio_clip}")
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    log_prob = matching_log_prob(v_theta, target, sigma, weighting=weighting, ghuber_power=ghuber_power)
    old = log_prob.detach() if old_log_prob is None else old_log_prob.detach().double()
    ratio = torch.exp(log_prob - old)
    a = advantages.detach().double().reshape(-1)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1.0 - ratio_clip, 1.0 + ratio_clip)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    loss = policy_loss
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "matching_loss": ((v_theta.detach().double() - target.double()) ** 2).mean(),
            "ratio": ratio.detach().mean(),
            "clipfrac": ((ratio.detach() - 1.0).abs() > ratio_clip).double().mean(),
        }
    if v_ref is not None:
        kl = velocity_kl(v_theta.double(), v_ref.double()).mean()
        loss = loss + kl_beta * kl
        stats["kl"] = kl.detach()
    if v_ema is not None:
        ema_kl = velocity_kl(v_theta.double(), v_ema.double()).mean()
        loss = loss + ema_kl_beta * ema_kl
        stats["ema_kl"] = ema_kl.detach()
    return loss.to(dtype), stats


def timestep_indices(num_sigmas: int, n: int, fraction: float, time_type: str, rng: np.random.Generator) -> np.ndarray:
    """`[n]` indices into the rollout schedule's `num_sigmas` σ values, one per stratum (the reference's `discrete`
    and `discrete_wo_init` `time_type`s):

        bounds = floor(linspace(start, int(num_sigmas·fraction), n + 1)),  start = 0 or 1 (wo_init)
        index_k = bounds_k + floor(u_k·(bounds_{k+1} − bounds_k)),  u_k ~ U[0, 1)

    A stratum of width 0 gives its lower bound (few steps, many t values: repeats). Capped at num_sigmas − 1."""
    if time_type not in TIME_TYPES:
        raise ValueError(f"time_type must be one of {TIME_TYPES}, got {time_type!r}")
    start = 0 if time_type == "discrete" else 1
    bounds = np.floor(np.linspace(start, int(num_sigmas * fraction), n + 1)).astype(np.int64)
    lower, upper = bounds[:-1], bounds[1:]
    index = lower + np.floor(rng.random(n) * (upper - lower)).astype(np.int64)
    return np.minimum(index, num_sigmas - 1)


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune the flow-matching pipeline `cfg.model.pipeline` with AWM against `cfg.reward`; write the run dir;
    return the final metrics. Arguments as `diffrl.trainers.ddpo.train`."""

    tc: AWMConfig = cfg.train
    check(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="awm", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=tc.train_timesteps * cfg.optim.gradient_accumulation_steps)
    check_flow_sampler(ctx.sampler, cfg, "AWM")
    ema = OldPolicy(ctx.params) if tc.ema_kl_beta > 0 else None  # the EMA policy: starts as θ
    state = ctx.load_state(stat_tracker=make_stat_tracker(cfg.advantage),
                           extra_modules={"ema_policy": ema} if ema is not None else None)
    adv = cfg.advantage

    for epoch, record in ctx.epochs():
        # ---- 1. clean samples from the current policy (any flow solver; no log-probs), scored
        rollout = ctx.rollout(group_size=adv.group_size, shared_start_noise=adv.shared_start_noise)

        # ---- 2. group-relative advantages over every process's samples, clipped and scaled
        advantages = epoch_advantages(rollout, adv, state.stat_tracker)
        traj, local_adv, local_ok = local_batch(rollout, advantages, ctx.accelerator)
        weights = scaled_advantages(local_adv, tc.adv_clip_max, tc.advantage_max)

        # ---- 3. the advantage-weighted flow-matching loss on the forward process of the clean samples
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = awm_update(ctx, ema, traj=traj, advantages=weights, valid=local_ok)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan()
        if ema is not None:  # the KL anchor follows θ, ever more slowly (d grows with the optimizer steps)
            ema.soft_update(ctx.params, old_policy_decay(ctx.state.global_step, tc.ema_decay_rate, tc.ema_decay_max))

        # ---- 4. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def awm_update(ctx, ema: OldPolicy | None, *, traj, advantages, valid) -> tuple[dict, bool]:
    """One pass over this process's clean samples. Returns (epoch diagnostics, stop).

    Micro-batches of `batch_size` shuffled samples, each noised at `train_timesteps` t values of the rollout's
    schedule (`timestep_indices`, shared by the micro-batch; fresh noise per t from the trainer's generator, so a
    resumed run draws the same); v_θ conditional only (CFG-free); the KL terms from the pre-trained model (adapter
    off) and the EMA copy; log p_old from a copy of the epoch-start weights once an optimizer step has moved θ.
    """

    tc: AWMConfig = ctx.cfg.train
    pipe, network, rng = ctx.pipe, ctx.unet, ctx.rng
    family = model_family(pipe)
    process = family.process
    scale = float(process.num_train_timesteps)  # model timestep per unit σ (1000)
    dtype, device = module_dtype(network), advantages.device
    sigmas = np.asarray(ctx.sampler.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:])).sigmas[:-1],
                        dtype=np.float64)
    x0_all = traj.latents[:, -1].to(device)
    # the rollout's weights, for log p_old after the epoch's first optimizer step (none when the epoch has one step)
    sampling = OldPolicy(ctx.params) if ctx.derived["optimizer_steps_per_epoch"] > 1 else None
    update = ctx.policy_update(losses_per_micro_batch=tc.train_timesteps)  # ρ is to the epoch-start weights
    order = rng.permutation(len(traj))
    minibatches = [order[i: i + tc.batch_size] for i in range(0, len(traj), tc.batch_size)]
    for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
        index = torch.as_tensor(idx)
        rows = index.to(device)
        cond = Conditioning.from_trajectory(traj.select(index)).conditional().to(device)
        x0, a, ok = x0_all[rows], advantages[rows], valid[rows]
        picked = timestep_indices(len(sigmas), tc.train_timesteps, tc.timestep_fraction, tc.time_type, rng)
        for k in range(tc.train_timesteps):
            # [b] model timesteps σ·1000, as the scheduler's; one σ for the micro-batch
            t = torch.full((len(idx),), sigmas[picked[k]] * scale, dtype=torch.float32, device=device)
            generator = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            noise = torch.randn(x0.shape, generator=generator).to(device)
            x_t, target = process.add_noise(x0, noise, t), process.target(x0, noise, t)
            sigma = t / scale
            # the copies' forwards before v_θ's, each in an autocast region of its own (`OldPolicy.active` swaps the
            # trainable tensors in place: after v_θ's forward that would change what its backward needs)
            old_log_prob = v_ema = v_ref = None
            if sampling is not None and update.updated:
                with ctx.accelerator.autocast(), sampling.active(ctx.params), torch.no_grad():
                    v_old = family.model_output(x_t, t, cond, 1.0, dtype)
                old_log_prob = matching_log_prob(v_old, target, sigma, weighting=tc.weighting,
                                                 ghuber_power=tc.ghuber_power)
            if ema is not None:
                with ctx.accelerator.autocast(), ema.active(ctx.params), torch.no_grad():
                    v_ema = family.model_output(x_t, t, cond, 1.0, dtype)
            with ctx.accelerator.autocast():
                v_theta = family.model_output(x_t, t, cond, 1.0, dtype)
                if tc.kl_beta > 0:
                    with torch.no_grad(), adapter_disabled(network):
                        v_ref = family.model_output(x_t, t, cond, 1.0, dtype)
            if bool(ok.any()):
                loss, stats = awm_loss(
                    v_theta[ok], target[ok], sigma[ok], a[ok],
                    old_log_prob=None if old_log_prob is None else old_log_prob[ok],
                    v_ref=None if v_ref is None else v_ref[ok], v_ema=None if v_ema is None else v_ema[ok],
                    weighting=tc.weighting, ghuber_power=tc.ghuber_power, ratio_clip=tc.ratio_clip,
                    kl_beta=tc.kl_beta, ema_kl_beta=tc.ema_kl_beta)
                update.backward(loss, stats)
            else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                update.backward(v_theta.sum() * 0.0)
    return update.stats(("loss", "policy_loss", "matching_loss", "kl", "ema_kl", "ratio", "clipfrac",
                         "grad_norm")), update.stopped


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time and again in `train`). Raises `UserError`."""
    tc: AWMConfig = cfg.train
    check_advantage_config(cfg)
    if tc.batch_size < 1:
        raise UserError("train.batch_size must be >= 1")
    if tc.train_timesteps < 1:
        raise UserError(f"train.train_timesteps must be >= 1, got {tc.train_timesteps}")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    if tc.time_type not in TIME_TYPES:
        raise UserError(f"train.time_type must be one of {', '.join(TIME_TYPES)}, got {tc.time_type!r}")
    if tc.time_type == "discrete_wo_init" and int(cfg.sample.num_steps * tc.timestep_fraction) < 1:
        raise UserError(f"train.time_type=discrete_wo_init skips the first step: int(sample.num_steps × "
                        f"train.timestep_fraction) must be >= 1, got {cfg.sample.num_steps} × {tc.timestep_fraction}")
    if tc.weighting not in WEIGHTINGS:
        raise UserError(f"train.weighting must be one of {', '.join(WEIGHTINGS)}, got {tc.weighting!r}")
    if not tc.ghuber_power > 0:
        raise UserError(f"train.ghuber_power must be > 0, got {tc.ghuber_power}")
    if not tc.ratio_clip > 0:
        raise UserError(f"train.ratio_clip must be > 0, got {tc.ratio_clip}")
    if not tc.adv_clip_max > 0:
        raise UserError(f"train.adv_clip_max must be > 0, got {tc.adv_clip_max}")
    if not tc.advantage_max >= 0:
        raise UserError(f"train.advantage_max must be >= 0 (0: no scaling), got {tc.advantage_max}")
    if not (tc.kl_beta >= 0 and tc.ema_kl_beta >= 0):
        raise UserError(f"train.kl_beta and train.ema_kl_beta must be >= 0, got {tc.kl_beta}, {tc.ema_kl_beta}")
    if not 0 <= tc.ema_decay_rate < float("inf"):
        raise UserError(f"train.ema_decay_rate must be a finite number >= 0, got {tc.ema_decay_rate}")
    if not 0 <= tc.ema_decay_max < 1:
        raise UserError(f"train.ema_decay_max must be in [0, 1) (1 would freeze the EMA policy), got "
                        f"{tc.ema_decay_max}")
    if cfg.model.full_finetune and tc.kl_beta > 0:
        raise UserError("AWM's KL reference is the pre-trained model with the LoRA switched off; with "
                        "model.full_finetune there is no adapter to turn off: set model.full_finetune=false or "
                        "train.kl_beta=0")
    if cfg.sample.sampler not in ("auto", "flow", "flow_cps"):
        raise UserError(f"AWM samples with a flow sampler (flow, flow_cps or auto), not "
                        f"sample.sampler={cfg.sample.sampler}")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch, and the t values each clean sample is trained at."""

    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size)
    out["train_timesteps_per_sample"] = cfg.train.train_timesteps
    return out


def epoch_passes(cfg) -> dict:
    """Network passes of one epoch's training per process: per trained (micro-batch, t) a forward + backward of v_θ,
    a forward of the pre-trained model (β_KL > 0) and of the EMA policy (β_EMA > 0), and of the epoch-start weights
    for the micro-batches after the epoch's first optimizer step; an AdamW step per optimizer step."""
    tc = cfg.train
    micro_batches = -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    accumulation = cfg.optim.gradient_accumulation_steps
    fwd_bwd = micro_batches * tc.train_timesteps
    after_first_step = max(micro_batches - accumulation, 0) * tc.train_timesteps
    reference = fwd_bwd * ((tc.kl_beta > 0) + (tc.ema_kl_beta > 0)) + after_first_step
    return {"train_batch": tc.batch_size, "fwd_bwd": fwd_bwd, "reference": reference,
            "adam": micro_batches // accumulation}
