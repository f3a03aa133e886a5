"""Flow-GRPO: GRPO on the SDE steps of a flow-matching model against a black-box reward (Liu et al. 2025).

Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", https://arxiv.org/abs/2505.05470.
Reference code: github.com/yifan123/flow_grpo (`scripts/train_sd3.py`, `config/grpo.py`), read, not copied.

The ODE sampler of a flow model is turned into an SDE with the same marginals (paper eq. 9, `samplers.flow`), so
each denoising step is a Gaussian policy π_θ(x_{t+Δt} | x_t, c). For each prompt the policy draws a group of k
images; their rewards give group-relative advantages (GRPO); every (sample, step) pair is trained with PPO's
clipped surrogate on the per-step ratio plus a KL penalty to the pre-trained (reference) policy (the paper's
Flow-GRPO objective; its equation numbers were not checked offline, only eq. 9's, through the reference code):

    J(θ) = E[ 1/K Σ_i 1/T Σ_t ( min(ρ_t^i Â^i, clip(ρ_t^i, 1 − ε, 1 + ε) Â^i) − β · KL_t(π_θ ‖ π_ref) ) ]

Both step policies are Gaussians with the same std σ_t√|Δt| (SDE) or σ'·sin(aπ/2) (CPS). `train.kl_convention`
says what KL_t is, per latent dimension (mean over dims, then over the batch):
    reference   ‖μ_θ − μ_ref‖² / (2·std_dev_t²), flow_grpo's `kl_loss` in `scripts/train_sd3.py`, with the step's
                `std_dev_t`: the SDE's σ_t = a·√(σ/(1 − σ)), *without* the |Δt| of the step's variance; CPS's std.
                The published β (0.04 GenEval, 0.01 PickScore) is calibrated to it. The default.
    exact       ‖μ_θ − μ_ref‖² / (2·σ_t²·|Δt|), the KL between the two step Gaussians (the paper's, with its Δt):
                on SDE steps the reference value / |Δt| (3.7–25× larger on steps 0–8 of 10 at shift 3, 112× on the
                last), so β weighs the same divergence on every step whatever the schedule; pick it to regularise
                by the true KL (with a β about 1/|Δt| times smaller for the reference's strength). On CPS steps both
                are the same expression.
Both are tested against numbers from the reference code (`tests/trainers/test_flow_grpo_parity.py`).

Code names → paper notation:
    log_probs       log π_θ(x_{t+Δt} | x_t, c), recomputed under the current weights (mean over latent dims)
    old_log_probs   log π_old(x_{t+Δt} | x_t, c), recorded at rollout time
    ratio           ρ_t^i = exp(log_probs − old_log_probs)
    advantages      Â^i = (r^i − mean of its group) / (std of the group, or of the whole batch, + ε),
                    `diffrl.training.advantages.group_advantages`, clipped to ±adv_clip_max
    clip_range      ε
    kl              KL_t(π_θ ‖ π_ref) `[B]` per `kl_convention`, `diffrl.training.reference.gaussian_kl` (reference
                    policy = LoRA adapter off)
    std_dev_t       the reference code's σ_t (`samplers.flow.FlowConstants.std_dev_t`)
    kl_beta         β (0.04 for GenEval, 0.01 for PickScore in the published SD3.5-M configs)

Published defaults (SD3.5-Medium, `config/grpo.py`): 10 sampling steps for training and 40 for evaluation, noise
level a = 0.7, CFG 4.5 at 512 px, 24 images per prompt, clip range 1e-4, advantages clipped to ±5 with the
global std (`sample.global_std = True`) plus ε = 1e-4 (`advantage.std_eps`), trained on 99 % of the steps
(`timestep_fraction = 0.99`), LoRA r 32 / α 64, AdamW 3e-4, EMA.

The training loop follows `scripts/train_sd3.py` (ac4c86e) by default, each choice a setting with diffrl's earlier
behaviour one value away (tested in `tests/trainers/test_flow_grpo_parity.py`):
    advantage.group_by: prompt        a group is every sample of the epoch with the same prompt text, on every
                                      process (the reference's tracker, cleared each epoch); `draw` = the k samples
                                      drawn together
    train.drop_zero_advantage: true   samples with advantage exactly 0 are not trained, random ones put back until
                                      the kept count divides into the micro-batches, which keep their number
    train.timestep_selection: first   the first int(T·timestep_fraction) steps in sampling order (10 steps: 0-8,
                                      never the last, σ 0.1 → 0); `random` = a random subset in random order
    train.cfg_gradient: conditional   the unconditional prediction is detached, so the gradient is s·∇v_c; `both`
                                      adds (1 − s)·∇v_u
    train.batch_size                  the reference's micro-batch is its sampling batch (`train.batch_size =
                                      sample.train_batch_size`); a recipe sets it equal to `sample.batch_size` Flow-GRPO-Fast trains only an SDE window of 1–2 steps per trajectory (the others are ODE
steps), which `sample.eta` given per step expresses (`samplers.flow`, `diffrl.training.sde_window`).

GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
Clipping", https://arxiv.org/abs/2510.22319), `train.ratio_normalization`. The paper's diagnosis: with the
log-prob a mean over the D latent dims, a step's log-ratio under the rollout policy is, with d = μ_θ − μ_old, the
step std s = σ_t·√|Δt| and x_{t+Δt} = μ_old + s·ε,
    log ρ = mean(d·ε)/s − mean(d²)/(2s²),
whose mean −mean(d²)/(2s²) is below 0 and grows as 1/s² on the low-noise steps: the ratio is shifted left, so
PPO's clip band [1 − ε, 1 + ε] stops the ratios of positive-advantage samples far less than those of negative ones
(the "implicit over-optimisation"), and the low-noise steps dominate the gradient. Its fix, as the public
reference computes it (Flow-Factory, github.com/X-GenGroup/Flow-Factory@a0b2bc5, `src/flow_factory/trainers/
grpo.py`, `GRPOGuardTrainer.optimize`; golden numbers from it in `tests/trainers/data/grpo_guard_reference.json`):
    log ρ̃ = (log π_θ − log π_old)·s + mean((μ_θ − μ_old)²)/(2s)  = mean(d·ε)        (`guard_log_ratio`)
that is the mean shift removed (RatioNorm: + mean(d²)/(2s²)) and the result multiplied by s, which rebalances
the gradient across timesteps (its gradient is mean(∇μ_θ·ε), free of the 1/s of the raw ratio). The
clipped surrogate then acts on ρ̃ = exp(log ρ̃), centred at 1 on every step. Settings:
    none     the raw ratio (Flow-GRPO). The default.
    center   the mean shift removed only: log ρ + mean(d²)/(2s²) = mean(d·ε)/s (no timestep reweighting)
    guard    GRPO-Guard as the reference: centred and multiplied by s
μ_old, the rollout's step mean, is not in the trajectory: with center/guard the update first recomputes it for
every trained (sample, step) under the rollout's weights (a no-grad forward each, before any optimizer step).
Needs SDE steps (`sample.sampler: flow`); the reference's guard is only for its Flow-SDE dynamics too. The
paper's separate gradient-reweighting coefficient (its δ, given per SDE form) is not built: the reference
trainer computes only the expression above.

MixGRPO (Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE",
https://arxiv.org/abs/2507.21802; reference github.com/Tencent-Hunyuan/MixGRPO@e5cdd6a) is the SDE window with
`train.sde_window_schedule: progressive`: a window of W SDE steps that slides by `sde_window_stride` steps every
`sde_window_shift_every` epochs (ODE steps elsewhere), trained whole (`timestep_fraction: 1`); schedule in
`diffrl.training.sde_window`. Its Flash variant's higher-order ODE solver (DPM-Solver++ on the ODE steps after
the window) is not built.

The log-prob of a CPS step (`sample.sampler: flow_cps`) follows `train.cps_log_prob`: `reference` (the default),
flow_grpo's −mean((x − μ)²), on whose scale the published clip range acts; `gaussian`, the Gaussian log-density
(1/(2·std²) times the reference's log-ratio, see `samplers.flow`), whose ratio is a true likelihood ratio.

Differences from the reference code, on purpose: a group's k images are drawn in one process's sampling batch
(`advantage.group_size` divides `sample.batch_size`) instead of across GPUs (with `group_by: prompt`, draws of the
same prompt in one epoch still form one group); when every sample of a process ties, the reference trains none of
them, diffrl one per micro-batch (so every process makes the same backward passes); EMA is off by default (the published
runs evaluate an EMA with decay 0.9; `optim.use_ema` turns ours on); the recomputed log-probs are checked against the
rollout's before each epoch's first update (ratio 1, `samplers.base`). CFG-free training is `sample.guidance_scale
= 1` (the rollout and every recomputation then run the conditional branch only). LoRA targets: the published
runs adapt both streams' attention projections (`attn.to_q/k/v`, `attn.to_out.0`, `attn.add_q/k/v_proj`,
`attn.to_add_out`); a recipe names them in `model.lora.target_modules`.

"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.training import setup
from diffrl.training.advantages import make_stat_tracker
from diffrl.training.context import RunContext
from diffrl.training.reference import step_kl_to_reference
from diffrl.training.sde_window import (
    check_sampler,
    check_stochastic,
    trainable_steps,
)
from diffrl.training.setup import check_flow_sampler
from diffrl.training.update import advantage_epochs, check_ppo_config

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group), defaults as the published SD3.5-M runs
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FlowGRPOConfig:
    # trajectories per training micro-batch, per process (the published train_batch_size, = the sampling batch);
    # with drop_zero_advantage the micro-batches keep their number and share the kept samples equally
    batch_size: int = 9
    num_inner_epochs: int = 1  # passes over an epoch's samples
    timestep_fraction: float = 0.99  # fraction of each trajectory's eligible steps trained: int(T_eligible · it)
    # which steps: "first" = the first ones in sampling order, the same for every micro-batch (train_sd3.py: with
    # 10 steps and 0.99, steps 0-8, never the last); "random" = a random subset in random order per micro-batch
    # (ddpo-pytorch's)
    timestep_selection: Literal["first", "random"] = "first"
    skip_final_steps: int = 0  # never train the last N steps (the eligible steps are the first T − N)
    clip_range: float = 1e-4  # PPO ε of the per-step ratio (log-probs are means over latent dims)
    kl_beta: float = 0.04  # β of the KL to the reference policy (0.04 GenEval, 0.01 PickScore); 0 turns it off
    # what KL_t is: "reference" = flow_grpo's ‖Δμ‖² / (2·std_dev_t²), no |Δt| (the published β's scale);
    # "exact" = the true KL between the step Gaussians, 1/|Δt| times larger on SDE steps (module docstring)
    kl_convention: Literal["reference", "exact"] = "reference"
    # the log-prob of a CPS step (sample.sampler: flow_cps; no effect on SDE steps): "reference" = flow_grpo's
    # −mean((x − μ)²), the published clip range's scale; "gaussian" = the Gaussian log-density
    cps_log_prob: Literal["reference", "gaussian"] = "reference"
    # the CFG branches the training gradient flows through: "conditional" = the unconditional prediction detached
    # (train_sd3.py's compute_log_prob), "both" = v_u + s·(v_c − v_u) differentiated whole (adds (1 − s)·∇v_u)
    cfg_gradient: Literal["conditional", "both"] = "conditional"
    # leave out of training the samples whose advantage is exactly 0 (a group whose rewards are all equal), then
    # put back random ones until the kept count divides into the micro-batches (train_sd3.py); false keeps them
    # (they still add the KL term and dilute each micro-batch's mean)
    drop_zero_advantage: bool = True
    # Flow-GRPO-Fast: only `sde_window` consecutive steps per trajectory are stochastic (sample.eta) and trained,
    # the others ODE steps; the window starts at a step drawn each epoch in 0..sde_window_max_start (0 = all steps)
    sde_window: int = 0
    sde_window_max_start: int = 0
    # where the window starts each epoch: "random" (Flow-GRPO-Fast: drawn in 0..sde_window_max_start) or
    # "progressive" (MixGRPO: sde_window_stride steps later every sde_window_shift_every epochs, back to 0 at the end)
    sde_window_schedule: Literal["random", "progressive"] = "random"
    sde_window_shift_every: int = 25  # MixGRPO's shift interval τ (iters_per_group) in epochs
    sde_window_stride: int = 1  # steps the progressive window moves (MixGRPO's prog_overlap_step)
    # the PPO ratio: "none" = exp(log π_θ − log π_old) (Flow-GRPO); "center" = its mean shift removed; "guard" =
    # GRPO-Guard, centred and scaled by the step std (module docstring, `guard_log_ratio`)
    ratio_normalization: Literal["none", "center", "guard"] = "none"


# The shared `optim:` group: AdamW 3e-4 with weight decay 1e-4 on the LoRA, gradient clip 1.0 (config/base.py)
OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
# The `advantage:` group: group-relative with the epoch's std (`sample.global_std = True`) + 1e-4
# (flow_grpo/stat_tracking.py), clipped to ±5; a group is every sample of the epoch with the same prompt text (the
# reference's per-prompt tracker, cleared each epoch)
ADVANTAGE_DEFAULTS = {"mode": "group", "group_size": 8, "group_std": "global", "clip_max": 5.0, "std_eps": 1e-4,
                      "group_by": "prompt"}

TrainConfig = FlowGRPOConfig


# ---------------------------------------------------------------------------------------------------------------
# Pure loss
# ---------------------------------------------------------------------------------------------------------------


def guard_log_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: float | torch.Tensor,
    normalization: str = "guard",
) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of one SDE step (module docstring).

    `center`: `log ρ + m/(2s²)`; `guard`: `(log ρ)·s + m/(2s)` (the reference's), with `log ρ = log_probs −
    old_log_probs`, `m = mean over latent dims of (mean − old_mean)²` and `s = std`; both are `mean(d·ε)/s` resp.
    `mean(d·ε)` for a step drawn from the old policy, zero-mean whatever the policy change d.

    Args:
        log_probs (`torch.Tensor` `[B]`): the step's log-probs under the current weights (mean over latent dims).
        old_log_probs (`torch.Tensor` `[B]`): the rollout's.
        mean (`torch.Tensor` `[B, ...]`): the step's Gaussian mean under the current weights (carries the gradient).
        old_mean (`torch.Tensor` `[B, ...]`): the rollout's mean.
        std (`float` or 0-d `torch.Tensor`): the step's std σ_t·√|Δt| (> 0).
        normalization (`str`): `"center"` or `"guard"`.
    """
    sq = (mean - old_mean.to(mean)) ** 2
    m = sq.mean(dim=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq
    log_ratio = log_probs - old_log_probs
    if normalization == "center":
        return log_ratio + m / (2 * std**2)
    if normalization == "guard":
        return log_ratio * std + m / (2 * std)
    raise ValueError(f"normalization must be 'center' or 'guard', got {normalization!r}")


def flow_grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Flow-GRPO's loss for one denoising step of a batch: the negated clipped surrogate plus β·KL.

    `loss = mean_i max(−Â_i ρ_i, −Â_i clip(ρ_i, 1 − ε, 1 + ε)) + β · mean_i KL_i`, `ρ_i = exp(log_probs_i −
    old_log_probs_i)`. The max of the negated terms is the min of the objective, so moving the ratio past the clip
    range in the direction the advantage favours earns nothing.

    Args:
        log_probs (`torch.Tensor` `[B]`): log-probs of the step under the current weights (carry the gradient).
        old_log_probs (`torch.Tensor` `[B]`): log-probs recorded at rollout time.
        advantages (`torch.Tensor` `[B]`): group-relative advantages, already clipped.
        clip_range (`float`): PPO's ε.
        kl (`torch.Tensor` `[B]`, *optional*): KL_t of the step's policy to the reference (`gaussian_kl`).
        kl_beta (`float`, defaults to 0): β; needs `kl` when > 0.
        log_ratio (`torch.Tensor` `[B]`, *optional*): log ρ_i to use instead of `log_probs − old_log_probs`
            (GRPO-Guard's, `guard_log_ratio`).

    Returns:
        `(loss, stats)`: the scalar loss and detached diagnostics: `policy_loss`, `kl` (mean KL_t, 0 without),
        `approx_kl` (½·mean((log ρ)²)), `clipfrac` (fraction with |ρ − 1| > ε), `ratio` (mean ρ).
    """
    if kl_beta > 0 and kl is None:
        raise ValueError("kl_beta > 0 needs the per-sample KL to the reference policy")
    if log_ratio is None:
        log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_mean = kl.mean() if kl is not None else torch.zeros((), device=log_probs.device)
    loss = policy_loss + kl_beta * kl_mean if kl_beta > 0 else policy_loss
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach().double(),
            "kl": kl_mean.detach().double(),
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
            "ratio": ratio.double().mean(),
        }
    return loss, stats


def kl_std(constants, kl_convention: str) -> float:
    """The σ the per-step KL divides by (`gaussian_kl`): the step's std for `"exact"`, the reference code's
    `std_dev_t` for `"reference"` (SDE: std / √|Δt|; CPS: the std itself).

    Args:
        constants (`samplers.flow.FlowConstants`): the step's scalars (`FlowSampler.step_constants`).
        kl_convention (`str`): `"reference"` or `"exact"`.
    """
    if kl_convention not in ("reference", "exact"):
        raise ValueError(f"kl_convention must be 'reference' or 'exact', got {kl_convention!r}")
    return constants.std if kl_convention == "exact" else constants.std_dev_t


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune the flow-matching pipeline `cfg.model.pipeline` with Flow-GRPO against `cfg.reward`; write the run
    dir; return the final metrics. Arguments as `diffrl.trainers.ddpo.train`."""
    tc: FlowGRPOConfig = cfg.train
    check(cfg)
    n_train_steps = trained_steps_per_sample(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="flow_grpo", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=n_train_steps * cfg.optim.gradient_accumulation_steps)
    check_flow_sampler(ctx.sampler, cfg, "Flow-GRPO")
    check_sampler(cfg, ctx.sampler, "Flow-GRPO")
    if tc.ratio_normalization != "none" and getattr(ctx.sampler, "sde_type", "sde") != "sde":
        raise UserError(f"train.ratio_normalization={tc.ratio_normalization} (GRPO-Guard) corrects the ratio of SDE "
                        f"steps; this run samples with '{ctx.sampler.name}': set sample.sampler=flow")
    ctx.sampler.cps_log_prob = tc.cps_log_prob  # a CPS step's log-prob convention, before the first rollout
    ctx.sampler.cfg_gradient = tc.cfg_gradient
    ctx.load_state(stat_tracker=make_stat_tracker(cfg.advantage))  # advantage.mode=per_prompt's buffers
    # each epoch: k images per prompt from the SDE sampler (in an SDE window for Flow-GRPO-Fast), scored;
    # group-relative advantages; then `grpo_update`: clipped-ratio updates with the KL to the reference
    return advantage_epochs(ctx, grpo_update, n_train_steps=n_train_steps)


def trained_steps_per_sample(cfg) -> int:
    """Steps each trajectory trains per inner epoch: `timestep_fraction` of the eligible ones (the SDE window, or
    the first T − skip_final_steps)."""
    eligible = cfg.train.sde_window or cfg.sample.num_steps - cfg.train.skip_final_steps
    return setup.num_train_timesteps(eligible, cfg.train.timestep_fraction)


def grpo_update(ctx, *, traj, advantages, valid, n_train_steps: int, epoch: int) -> tuple[dict, bool]:
    """`num_inner_epochs` passes over this process's trajectories. Returns (epoch diagnostics, stop).

    The trained samples (`train_samples`: those with a non-zero advantage, topped up to a multiple of the
    micro-batch count, with `drop_zero_advantage`) are shuffled into micro-batches; each trains `n_train_steps`
    eligible steps (`trained_steps`); an optimizer step follows every `optim.gradient_accumulation_steps`
    micro-batches, its gradient the mean over their (sample, step) pairs. The KL term recomputes each step with
    the adapter off and divides by the σ of `train.kl_convention` (`kl_std`).
    """
    tc: FlowGRPOConfig = ctx.cfg.train
    rng = ctx.rng
    eligible = trainable_steps(traj, tc.skip_final_steps)
    n_micro = -(-len(traj) // tc.batch_size)
    kept = train_samples(advantages.cpu().numpy(), valid.cpu().numpy(), n_micro, rng, tc.drop_zero_advantage)
    guarded = tc.ratio_normalization != "none"
    # GRPO-Guard needs the rollout's step means: recomputed now, before any optimizer step changes the weights
    old_means = rollout_step_means(ctx, traj, guard_steps(eligible, n_train_steps, tc.timestep_selection),
                                   tc.batch_size) if guarded else None
    update = ctx.policy_update(losses_per_micro_batch=n_train_steps, ratio_check=f"epoch {epoch}, first inner step")
    for _ in update.passes(tc.num_inner_epochs):
        minibatches = np.array_split(kept[rng.permutation(len(kept))], n_micro)
        for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
            mb = traj.select(torch.as_tensor(idx))
            mb_adv, mb_ok = advantages[idx], valid[idx]
            for j in trained_steps(eligible, n_train_steps, tc.timestep_selection, rng):
                with ctx.accelerator.autocast():
                    if tc.kl_beta > 0:
                        sigma_kl = kl_std(ctx.sampler.step_constants(ctx.pipe, mb, j), tc.kl_convention)
                        step, kl = step_kl_to_reference(ctx.pipe, ctx.sampler, mb, j, kl_std=sigma_kl)
                    else:
                        step, kl = ctx.sampler.log_prob(ctx.pipe, mb, j, return_step=True), None
                log_probs = step.log_prob  # [b], current weights, guided as in the rollout
                old_log_probs = mb.log_probs[:, j].to(log_probs.device)
                update.check_ratio(log_probs, old_log_probs)  # ratio exactly 1 until the first update
                log_ratio = None
                if guarded:
                    log_ratio = guard_log_ratio(log_probs, old_log_probs, step.mean,
                                                old_means[j][torch.as_tensor(idx)], step.std,
                                                tc.ratio_normalization)[mb_ok]
                if bool(mb_ok.any()):
                    update.backward(*flow_grpo_loss(log_probs[mb_ok], old_log_probs[mb_ok], mb_adv[mb_ok],
                                                    tc.clip_range, kl=None if kl is None else kl[mb_ok],
                                                    kl_beta=tc.kl_beta, log_ratio=log_ratio))
                else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                    update.backward(log_probs.sum() * 0.0)
    # kl: the mean per-dim KL_t to the reference policy (train.kl_convention); approx_kl: rollout vs updated policy;
    # trained_fraction: of this process's samples (drop_zero_advantage leaves some out)
    return update.stats(("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "ratio", "grad_norm", "trained_fraction"),
                        trained_fraction=len(kept) / len(traj)), update.stopped


def guard_steps(eligible: np.ndarray, n: int, selection: str) -> np.ndarray:
    """The steps whose rollout means GRPO-Guard recomputes: those `trained_steps` can pick (the first `n` eligible
    ones with `"first"`, every eligible one with `"random"`)."""
    return eligible[:n] if selection == "first" else eligible


def rollout_step_means(ctx, traj, steps: np.ndarray, chunk: int) -> dict[int, torch.Tensor]:
    """The Gaussian mean of each step in `steps` for every sample of `traj` under the current (the rollout's)
    weights, without gradient: `{step: [N, ...]}` (GRPO-Guard's μ_old)."""
    out = {}
    with torch.no_grad():
        for j in steps.tolist():
            parts = []
            for start in range(0, len(traj), chunk):
                mb = traj.select(torch.arange(start, min(start + chunk, len(traj))))
                with ctx.accelerator.autocast():
                    parts.append(ctx.sampler.log_prob(ctx.pipe, mb, j, return_step=True).mean.float())
            out[j] = torch.cat(parts)
    return out


def train_samples(advantages: np.ndarray, valid: np.ndarray, n_micro: int, rng: np.random.Generator,
                  drop_zero: bool) -> np.ndarray:
    """Indices of the samples an epoch trains, in index order.

    Without `drop_zero`, all. With it, as `train_sd3.py`: the samples whose advantage is non-zero (a zero
    advantage, a group whose rewards all tie or a non-finite reward, adds nothing to the policy term), plus random
    others until the count is a multiple of `n_micro` (at least `n_micro`, so every micro-batch has a sample and
    every process makes the same number of backward passes), so the micro-batches share them equally.

    Args:
        advantages (`[N]`): this process's advantages.
        valid (`[N]` bool): samples with a finite reward.
        n_micro (`int`): micro-batches per inner epoch (≤ N).
        rng (`np.random.Generator`): draws the top-up.
        drop_zero (`bool`): `train.drop_zero_advantage`.
    """
    n = len(advantages)
    if not drop_zero:
        return np.arange(n)
    keep = (np.asarray(advantages) != 0) & np.asarray(valid, dtype=bool)
    short = max(n_micro, -(-int(keep.sum()) // n_micro) * n_micro) - int(keep.sum())
    if short:
        dropped = np.flatnonzero(~keep)
        keep[dropped[rng.permutation(len(dropped))[:short]]] = True
    return np.flatnonzero(keep)


def trained_steps(eligible: np.ndarray, n: int, selection: str, rng: np.random.Generator) -> list[int]:
    """The denoising steps a micro-batch trains, in training order: the first `n` eligible ones in sampling order
    (`"first"`, flow_grpo's `train_sd3.py`) or a random `n` of them in random order (`"random"`)."""
    if selection == "first":
        return eligible[:n].tolist()
    if selection == "random":
        return eligible[rng.permutation(len(eligible))[:n]].tolist()
    raise ValueError(f"timestep_selection must be 'first' or 'random', got {selection!r}")


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time and again in `train`). Raises `UserError`."""
    tc: FlowGRPOConfig = cfg.train
    check_ppo_config(cfg)
    if not tc.kl_beta >= 0:
        raise UserError(f"train.kl_beta must be >= 0, got {tc.kl_beta}")
    if tc.ratio_normalization not in ("none", "center", "guard"):
        raise UserError(f"train.ratio_normalization must be none, center or guard, got {tc.ratio_normalization!r}")
    if tc.ratio_normalization != "none" and cfg.sample.sampler == "flow_cps":
        raise UserError(f"train.ratio_normalization={tc.ratio_normalization} (GRPO-Guard) corrects the ratio of SDE "
                        f"steps; sample with sample.sampler=flow, not flow_cps")
    if cfg.sample.sampler not in ("auto", "flow", "flow_cps"):
        raise UserError(f"Flow-GRPO samples with a flow sampler (flow, flow_cps or auto), not "
                        f"sample.sampler={cfg.sample.sampler}")
    check_stochastic(cfg, "Flow-GRPO")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch, and the denoising steps each trajectory trains."""
    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size, passes=cfg.train.num_inner_epochs)
    out["train_timesteps_per_sample"] = trained_steps_per_sample(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Network passes of one epoch's training per process: a guided forward + backward of `train_batch` rows per
    trained (micro-batch, step), a reference forward for the KL when β > 0 (plus GRPO-Guard's no-grad forwards of
    the rollout means), an AdamW step per optimizer step."""
    tc = cfg.train
    micro_batches = tc.num_inner_epochs * -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    n_steps = trained_steps_per_sample(cfg)
    fwd_bwd = micro_batches * n_steps
    # no-grad forwards of train_batch rows: the KL's reference policy, and GRPO-Guard's rollout means (once per
    # epoch, for every step the update can pick)
    no_grad = fwd_bwd if tc.kl_beta > 0 else 0
    if tc.ratio_normalization != "none":
        eligible = tc.sde_window or cfg.sample.num_steps - tc.skip_final_steps
        chunks = -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
        no_grad += chunks * (n_steps if tc.timestep_selection == "first" else eligible)
    return {"train_batch": tc.batch_size, "fwd_bwd": fwd_bwd, "reference": no_grad,
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
