"""DiffusionNFT: online RL on the forward (noising) process of a flow-matching model (Zheng et al. 2025).

Paper: Zheng, Chen, Ye, Wang, Zhang, Jiang, Su, Ermon, Zhu, Liu, "DiffusionNFT: Online Diffusion Reinforcement with
Forward Process", https://arxiv.org/abs/2509.16117. Reference code: github.com/NVlabs/DiffusionNFT
(`scripts/train_nft_sd3.py`, `config/nft.py`), read, not copied. The paper's equation numbers could not be read
offline; the objective below is the paper's training objective ("DiffusionNFT loss", its method section) as the
reference code and VeRL-Omni's documentation of it state it.

The sampling policy v_old draws clean samples x0 with any solver (no log-probs, CFG-free); each gets an optimality
probability r ∈ [0, 1] from its reward; then the trained velocity v_θ is fitted on the forward process of those x0
with two implicit policies, one pulled towards the positive samples and one pushed from the negative ones:

    r        = ½ + ½·clip((r_raw − E_c[r_raw]) / Z_c, −1, 1)         (optimality probability; Z_c a reward std)
    x_t      = (1 − t)·x0 + t·ε,   v = ε − x0                         (flow matching's forward process and target)
    v⁺_θ     = (1 − β)·v_old(x_t) + β·v_θ(x_t)                        (implicit positive policy)
    v⁻_θ     = (1 + β)·v_old(x_t) − β·v_θ(x_t)                        (implicit negative policy)
    L(θ)     = E[ r·‖v⁺_θ − v‖² + (1 − r)·‖v⁻_θ − v‖² ]

Its gradient in v_θ is 2β·[r·(v⁺ − v) − (1 − r)·(v⁻ − v)]; at v_θ = v_old that is 2β·(2r − 1)·(v_old − v): towards
the target for r > ½, away from it for r < ½, nothing at r = ½.

Code names → paper notation → the reference's config names (scripts/train_nft_sd3.py, config/nft.py):
    v_theta, v_old       v_θ(x_t, c, t), v_old(x_t, c, t)   forward_prediction, old_prediction (adapter "old")
    x0, noise, sigma     x0, ε, t (diffusers' σ: 1 = noise)  x0, noise, t = timestep / 1000
    optimality           r                                    r
    beta                 β, the guidance strength             config.beta (1.0; 0.1 for OCR and multi-reward)
    kl_beta              β_KL                                 config.train.beta (1e-4)
    adv_clip_max         A_max                                config.train.adv_clip_max (5)
    old_decay_*          d's schedule                         config.decay_type (0, 1, 2: `OLD_DECAY_TYPES`)

Conventions, the reference code's by default (`tests/trainers/test_diffusion_nft_parity.py` checks them against
numbers computed with github.com/NVlabs/DiffusionNFT at 24af555; `tests/trainers/data/diffusion_nft_reference.json`):

- Loss (`weighting="adaptive"`): the squared errors are taken in x0 space, x̂0^± = x_t − t·v^± (so ‖x̂0 − x0‖² =
  t²·‖v^± − v‖²), each sample's mean squared error divided by w^± = max(mean |x̂0^± − x0|, 1e-5) (no gradient
  through w), and the sum divided by β and multiplied by A_max:
      L = mean_b[ A_max/β · (r·mean((x̂0⁺ − x0)²)/w⁺ + (1 − r)·mean((x̂0⁻ − x0)²)/w⁻) ]
          + β_KL·mean_b mean((v_θ − v_ref)²)
  with v_ref the pre-trained velocity (adapter off; `velocity_kl`, added in `nft_update`). Values and the gradient in
  v_θ match the reference's. The reference divides by a float64 w; `nft_loss` computes in the inputs' dtype (at
  least float32), the same within float32 rounding.
- r from rewards: A = (reward − mean of its prompt's rewards in the epoch) / (std of all the epoch's rewards + 1e-4)
  (population std; the reference's stat tracker with `sample.global_std = True`), then r = ½ + ½·clip(A, ±A_max)/A_max.
  Here: `advantage.mode: group`, `group_std: global`, `std_eps: 1e-4`, `group_by: prompt` (the defaults: a group is
  every sample of the epoch with the prompt's text, as the tracker pools them).
- The σ values trained: each sample its own random int(T · `timestep_fraction`) of the rollout schedule's T, as the
  reference's per-sample permutation (`train.timestep_selection: per_sample`; `per_batch` shares one draw).
- v_old after every epoch's training: old ← d·old + (1 − d)·θ, with d = `old_policy_decay(step, ...)` of the optimizer
  steps so far; the reference's three `decay_type`s are three settings of `old_decay_flat/rate/max` (default: type 1).

Differences on purpose: `weighting="velocity"` is the paper's plain objective r·mean(v⁺ − v)² + (1 − r)·mean(v⁻ − v)²
(no x0 space, no w, no A_max/β), checked against the reference's v^±. Published settings (SD3.5-Medium, config/nft.py)
not reproduced: its rollouts use a 2nd-order DPM solver, here any flow sampler at `sample.eta` (0: Euler's ODE).

Here the sampling policy v_old is a copy of the trainable (LoRA) weights kept beside them (`OldPolicy`, saved in
checkpoints; `diffrl.training.old_policy`, shared with AWM's EMA policy), swapped in for the rollout and for v_old.
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
from diffrl.training import setup
from diffrl.training.advantages import check_advantage_config, make_stat_tracker
from diffrl.training.context import RunContext

# the sampling policy v_old (a soft-updated copy of the trainable weights), its decay and the velocity KL: shared with
# AWM's EMA policy (diffrl.training.old_policy)
from diffrl.training.old_policy import OldPolicy, old_policy_decay, velocity_kl
from diffrl.training.rollout import epoch_advantages, local_batch
from diffrl.training.setup import check_flow_sampler
from diffrl.training.weights import adapter_disabled

WEIGHTINGS = ("adaptive", "velocity")


# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group), defaults as the published SD3.5-M runs
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DiffusionNFTConfig:
    batch_size: int = 9  # clean samples per training micro-batch, per process
    beta: float = 1.0  # β of the implicit policies (0.1 for OCR / multi-reward in the published configs)
    kl_beta: float = 1e-4  # weight of ‖v_θ − v_ref‖² to the pre-trained velocity (adapter off)
    adv_clip_max: float = 5.0  # A_max: advantages clipped to ±A_max, then r = ½ + ½·A/A_max
    weighting: str = "adaptive"  # "adaptive" (reference code: x0-space error over its mean |error|) or "velocity"
    timestep_fraction: float = 0.99  # fraction of the rollout schedule's σ values each sample is trained at
    # which σ values: "per_sample" = each sample its own random int(T · timestep_fraction) of them (the reference's
    # per-sample permutation); "per_batch" = one random set shared by a micro-batch's samples
    timestep_selection: Literal["per_sample", "per_batch"] = "per_sample"
    # The sampling policy's soft update after each epoch, old ← d·old + (1 − d)·θ, with step = optimizer steps so far
    # (global): d = 0 while step < old_decay_flat, then min(old_decay_rate·(step − old_decay_flat), old_decay_max)
    # (`old_policy_decay`). The reference's `decay_type` in these numbers is `OLD_DECAY_TYPES`: the default here is
    # its default, type 1; its OCR run uses type 2 (flat 75, rate 0.0075, max 0.999); type 0 is all zeros (on-policy)
    old_decay_flat: int = 0  # optimizer steps (global) during which the sampling policy is a plain copy of θ
    old_decay_rate: float = 0.001  # growth of d per optimizer step after the flat part (unitless, >= 0)
    old_decay_max: float = 0.5  # cap of d, in [0, 1) (1 would freeze the sampling policy)


TrainConfig = DiffusionNFTConfig

# The shared `optim:` group: AdamW 3e-4, weight decay 1e-4, gradient clip 1.0 (the reference's config/base.py)
OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
# The `advantage:` group: group-relative rewards over the epoch's std plus ε = 1e-4 (the reference's stat tracker with
# its default `sample.global_std = True`), clipped to ±A_max below (not here: r needs A unclipped up to A_max, so the
# group's own clip is off); a group is every sample of the epoch with the same prompt text (the tracker, cleared
# each epoch)
ADVANTAGE_DEFAULTS = {"mode": "group", "group_size": 8, "group_std": "global", "clip_max": 0.0, "std_eps": 1e-4,
                      "group_by": "prompt"}

# The reference's `decay_type` (scripts/train_nft_sd3.py, `return_decay`) as this config's three numbers
OLD_DECAY_TYPES = {
    0: {"old_decay_flat": 0, "old_decay_rate": 0.0, "old_decay_max": 0.0},  # d = 0: old = θ after every epoch
    1: {"old_decay_flat": 0, "old_decay_rate": 0.001, "old_decay_max": 0.5},  # its default (config/nft.py)
    2: {"old_decay_flat": 75, "old_decay_rate": 0.0075, "old_decay_max": 0.999},  # its OCR run (sd3_ocr)
}


# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------------


def optimality_probability(advantages: torch.Tensor, clip_max: float) -> torch.Tensor:
    """r = ½ + ½·clip(A, −A_max, A_max)/A_max ∈ [0, 1]: a normalised reward as the probability of being optimal."""
    return 0.5 + 0.5 * advantages.clamp(-clip_max, clip_max) / clip_max


def implicit_policies(v_theta: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit positive and negative velocities `(v⁺, v⁻)`: v⁺ = (1 − β)·v_old + β·v_θ, v⁻ = (1 + β)·v_old −
    β·v_θ (gradient only through v_θ)."""
    v_old = v_old.detach()
    return (1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    optimality: torch.Tensor,
    *,
    beta: float,
    weighting: str = "adaptive",
    clip_max: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT's loss on one noised batch (see the module docstring for the math), computed in v_theta's dtype
    or float32, whichever is wider.

    Args:
        v_theta (`torch.Tensor` `[B, C, h, w]`): the trained velocity at x_t (carries the gradient).
        v_old (`torch.Tensor` `[B, C, h, w]`): the sampling policy's velocity at the same x_t (no gradient).
        x0 (`torch.Tensor` `[B, C, h, w]`): the clean samples; noise (`[B, C, h, w]`): the ε that made x_t.
        sigma (`torch.Tensor` `[B]`): t of each sample (x_t = (1 − t)·x0 + t·ε).
        optimality (`torch.Tensor` `[B]`): r ∈ [0, 1] (`optimality_probability`).
        beta (`float`): β > 0.
        weighting (`str`, defaults to `"adaptive"`): `"adaptive"` (the reference code's: x0-space errors over their
            per-sample mean |error|, the sum divided by β and times `clip_max`) or `"velocity"` (the paper's
            r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖², means over latent dims).
        clip_max (`float`, defaults to 1.0): A_max, the adaptive loss's scale.

    Returns:
        `(loss, stats)`: the scalar loss (mean over the batch) and detached `positive_loss`, `negative_loss`,
        `old_deviation` (mean ‖v_θ − v_old‖²).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    dtype = torch.promote_types(v_theta.dtype, torch.float32)  # at least float32 (float64 stays float64)
    v_theta, v_old, x0, noise = v_theta.to(dtype), v_old.detach().to(dtype), x0.to(dtype), noise.to(dtype)
    positive, negative = implicit_policies(v_theta, v_old, beta)
    dims = tuple(range(1, x0.ndim))
    if weighting == "velocity":
        target = noise - x0
        positive_loss = ((positive - target) ** 2).mean(dim=dims)
        negative_loss = ((negative - target) ** 2).mean(dim=dims)
        per_sample = optimality * positive_loss + (1 - optimality) * negative_loss
    else:
        t = sigma.to(dtype).view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - t) * x0 + t * noise
        positive_loss = _adaptive_x0_error(x_t - t * positive, x0, dims)
        negative_loss = _adaptive_x0_error(x_t - t * negative, x0, dims)
        per_sample = (optimality * positive_loss + (1 - optimality) * negative_loss) / beta * clip_max
    with torch.no_grad():
        stats = {
            "positive_loss": positive_loss.detach().double().mean(),
            "negative_loss": negative_loss.detach().double().mean(),
            "old_deviation": ((v_theta - v_old) ** 2).detach().double().mean(),
        }
    return per_sample.mean(), stats


def _adaptive_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor, dims: tuple) -> torch.Tensor:
    """Mean over `dims` of (x̂0 − x0)², divided by its own (detached) mean |x̂0 − x0| (floored at 1e-5) per sample."""
    with torch.no_grad():
        scale = (x0_pred.double() - x0.double()).abs().mean(dim=dims).clamp(min=1e-5).to(x0_pred.dtype)
    return ((x0_pred - x0) ** 2).mean(dim=dims) / scale


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune the flow-matching pipeline `cfg.model.pipeline` with DiffusionNFT against `cfg.reward`; write the
    run dir; return the final metrics. Arguments as `diffrl.trainers.ddpo.train`."""
    tc: DiffusionNFTConfig = cfg.train
    check(cfg)
    n_sigmas = trained_sigmas_per_sample(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="diffusion_nft", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=n_sigmas * cfg.optim.gradient_accumulation_steps)
    check_flow_sampler(ctx.sampler, cfg, "DiffusionNFT")
    old_policy = OldPolicy(ctx.params)
    state = ctx.load_state(stat_tracker=make_stat_tracker(cfg.advantage),  # advantage.mode=per_prompt's buffers
                           extra_modules={"old_policy": old_policy})
    adv = cfg.advantage

    for epoch, record in ctx.epochs():
        # ---- 1. clean samples from the sampling policy v_old (any solver; no log-probs needed), scored
        with old_policy.active(ctx.params):
            rollout = ctx.rollout(group_size=adv.group_size, shared_start_noise=adv.shared_start_noise)

        # ---- 2. optimality probabilities r from group-relative advantages over every process's samples
        advantages = epoch_advantages(rollout, adv, state.stat_tracker)
        traj, local_adv, local_ok = local_batch(rollout, advantages, ctx.accelerator)
        optimality = optimality_probability(local_adv, tc.adv_clip_max)

        # ---- 3. the positive/negative flow-matching loss on the forward process of the clean samples
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = nft_update(ctx, old_policy, traj=traj, optimality=optimality, valid=local_ok,
                                 n_sigmas=n_sigmas)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan()
        # the sampling policy follows the trained one: a plain copy at first, then ever more slowly (d grows with
        # the optimizer step count up to old_decay_max), once per epoch after training as the reference code
        decay = old_policy_decay(ctx.state.global_step, tc.old_decay_rate, tc.old_decay_max, tc.old_decay_flat)
        old_policy.soft_update(ctx.params, decay)

        # ---- 4. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def trained_sigmas_per_sample(cfg) -> int:
    """σ values of the rollout schedule each clean sample is trained at per epoch: `timestep_fraction` of T."""
    return setup.num_train_timesteps(cfg.sample.num_steps, cfg.train.timestep_fraction)


def nft_update(ctx, old_policy: OldPolicy, *, traj, optimality, valid, n_sigmas: int) -> tuple[dict, bool]:
    """One pass over this process's clean samples. Returns (epoch diagnostics, stop).

    Micro-batches of `batch_size` shuffled samples are each noised at `n_sigmas` σ values drawn from the rollout's
    schedule (fresh noise per σ from the trainer's generator, so a resumed run draws the same); v_old comes from the
    old weights, v_θ from the trained ones, both conditional only (CFG-free), and the KL term from the pre-trained
    model (adapter off).
    """
    tc: DiffusionNFTConfig = ctx.cfg.train
    pipe, network, rng = ctx.pipe, ctx.unet, ctx.rng
    family = model_family(pipe)
    dtype, device = module_dtype(network), optimality.device
    sigmas = ctx.sampler.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:])).sigmas[:-1]
    x0_all = traj.latents[:, -1].to(device)
    update = ctx.policy_update(losses_per_micro_batch=n_sigmas)  # likelihood-free: no ratio to the rollout
    order = rng.permutation(len(traj))
    minibatches = [order[i: i + tc.batch_size] for i in range(0, len(traj), tc.batch_size)]
    for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
        index = torch.as_tensor(idx)
        mb = traj.select(index)
        cond = Conditioning.from_trajectory(mb).conditional().to(device)
        x0, r, ok = x0_all[index.to(device)], optimality[index.to(device)], valid[index.to(device)]
        picked = sigma_indices(len(idx), len(sigmas), n_sigmas, tc.timestep_selection, rng)  # [b, n_sigmas]
        for k in range(n_sigmas):
            sigma_k = np.asarray(sigmas, dtype=np.float64)[picked[:, k]]
            sigma = torch.as_tensor(sigma_k, dtype=torch.float32, device=device)
            generator = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            noise = torch.randn(x0.shape, generator=generator).to(device)
            sigma_x = sigma.view(-1, *[1] * (x0.ndim - 1))  # [b, 1, 1, 1], or [b, 1, 1, 1, 1] for video latents
            x_t = (1 - sigma_x) * x0 + sigma_x * noise
            # [b] model timesteps, as the scheduler's
            t = torch.as_tensor(sigma_k * 1000.0, dtype=torch.float32, device=device)
            # v_old in an autocast region of its own: autocast caches its low-precision copy of each trainable
            # weight until the outermost region exits, keyed by the tensor and blind to `active`'s in-place swap,
            # so a shared region would give v_θ the old weights' copies (under bf16 v_θ would never move)
            with ctx.accelerator.autocast(), old_policy.active(ctx.params), torch.no_grad():
                v_old = family.model_output(x_t, t, cond, 1.0, dtype)
            with ctx.accelerator.autocast():
                v_theta = family.model_output(x_t, t, cond, 1.0, dtype)
                kl = None
                if tc.kl_beta > 0:
                    with torch.no_grad(), adapter_disabled(network):
                        v_ref = family.model_output(x_t, t, cond, 1.0, dtype)
                    kl = velocity_kl(v_theta, v_ref)
            if bool(ok.any()):
                loss, stats = nft_loss(v_theta[ok], v_old[ok], x0[ok], noise[ok], sigma[ok], r[ok], beta=tc.beta,
                                       weighting=tc.weighting, clip_max=tc.adv_clip_max)
                if kl is not None:
                    loss = loss + tc.kl_beta * kl[ok].mean()
                    stats["kl"] = kl[ok].detach().double().mean()
                update.backward(loss, stats)
            else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                update.backward(v_theta.sum() * 0.0)
    return update.stats(("loss", "kl", "positive_loss", "negative_loss", "old_deviation", "grad_norm")), update.stopped


def sigma_indices(batch: int, num_sigmas: int, n: int, selection: str, rng: np.random.Generator) -> np.ndarray:
    """`[batch, n]` indices into the schedule's σ values that a micro-batch trains, column k at its k-th pass:
    each row a random n of them without repeats, its own (`"per_sample"`, the reference's per-sample
    `randperm`) or one row shared (`"per_batch"`)."""
    if selection == "per_sample":
        return np.stack([rng.permutation(num_sigmas)[:n] for _ in range(batch)])
    if selection == "per_batch":
        return np.tile(rng.permutation(num_sigmas)[:n], (batch, 1))
    raise ValueError(f"timestep_selection must be 'per_sample' or 'per_batch', got {selection!r}")


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time and again in `train`). Raises `UserError`."""
    tc: DiffusionNFTConfig = cfg.train
    check_advantage_config(cfg)
    if tc.batch_size < 1:
        raise UserError("train.batch_size must be >= 1")
    if not tc.beta > 0:
        raise UserError(f"train.beta must be > 0, got {tc.beta}")
    if not tc.kl_beta >= 0:
        raise UserError(f"train.kl_beta must be >= 0, got {tc.kl_beta}")
    if not tc.adv_clip_max > 0:
        raise UserError(f"train.adv_clip_max must be > 0, got {tc.adv_clip_max}")
    if tc.weighting not in WEIGHTINGS:
        raise UserError(f"train.weighting must be one of {', '.join(WEIGHTINGS)}, got {tc.weighting!r}")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    if tc.old_decay_flat < 0:
        raise UserError(f"train.old_decay_flat must be >= 0 optimizer steps, got {tc.old_decay_flat}")
    if not 0 <= tc.old_decay_rate < float("inf"):
        raise UserError(f"train.old_decay_rate must be a finite number >= 0, got {tc.old_decay_rate}")
    if not 0 <= tc.old_decay_max < 1:
        raise UserError(f"train.old_decay_max must be in [0, 1) (1 freezes the sampling policy), got "
                        f"{tc.old_decay_max}")
    if cfg.sample.sampler not in ("auto", "flow", "flow_cps"):
        raise UserError(f"DiffusionNFT samples with a flow sampler (flow, flow_cps or auto), not "
                        f"sample.sampler={cfg.sample.sampler}")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch, and the σ values each clean sample is trained at."""
    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size)
    out["train_sigmas_per_sample"] = trained_sigmas_per_sample(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Network passes of one epoch's training per process: per trained (micro-batch, σ) a forward + backward of
    v_θ and a forward of v_old (and of the reference when β_KL > 0), an AdamW step per optimizer step."""
    tc = cfg.train
    micro_batches = -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    fwd_bwd = micro_batches * trained_sigmas_per_sample(cfg)
    return {"train_batch": tc.batch_size, "fwd_bwd": fwd_bwd, "reference": fwd_bwd * (2 if tc.kl_beta > 0 else 1),
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
