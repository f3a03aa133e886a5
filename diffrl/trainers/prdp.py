"""PRDP: Proximal Reward Difference Prediction (Deng et al., CVPR 2024).

Paper: "PRDP: Proximal Reward Difference Prediction for Large-Scale Reward Finetuning of Diffusion Models",
https://arxiv.org/abs/2402.08714 (equation numbers below are the paper's). There is no official code; the paper's
appendix G prints the loss in JAX, and this module follows it where it differs from the main text (noted below).

The KL-regularised objective max E[r(x_0, c)] − β·KL[π_θ(x̄|c) ‖ π_ref(x̄|c)] over whole denoising chains x̄ = x_{0:T}
(Eq. 6) has the optimum π* ∝ π_ref·exp(r/β) (Eq. 7), so for two chains a, b of one prompt the log-ratios to the
reference differ by the reward difference over β (Eq. 9, 13). PRDP regresses that: with r̂_θ(x̄) = log π_θ/π_ref
(Eq. 10), the Reward Difference Prediction loss is ‖Δr̂_θ(x̄^a, x̄^b) − Δr(x_0^a, x_0^b)/β‖² (Eq. 14), a supervised
regression whose zero is the RL optimum (Eq. 15). Online (Sec. 3.2, Algorithm 1): each epoch samples B chains per
prompt from the snapshot π_θold and trains every pair of a prompt's chains, K gradient updates per epoch. Proximal
(Sec. 3.3): each step's log-ratio is clipped to within ε of the snapshot's, r̂_θ,t^clip = clip(r̂_θ,t, r̂_θold,t − ε,
r̂_θold,t + ε) (Eq. 19–20), and the loss is the larger of the clipped and unclipped squared errors (Eq. 17–18): as in
PPO, no gain from moving a step's likelihood more than ε past the snapshot in the direction the loss wants.

Code names -> paper notation:
    log_probs        log π_θ(x_{t-1} | x_t, c)    per step, under the current weights (mean over latent dims, as DDPO)
    old_log_probs    log π_θold(x_{t-1} | x_t, c) recorded at rollout time (the snapshot of Algorithm 1, line 3)
    ref_log_probs    log π_ref(x_{t-1} | x_t, c)  the same UNet with its LoRA adapter off
    log_ratio        r̂_θ,t = log_probs − ref_log_probs (Eq. 19); `r_hat` = its mean over the trained steps
    beta             β, the KL weight;  clip_range  ε, the stepwise clipping range (Eq. 20)
    group_size       B, chains per prompt;  num_inner_epochs  K, gradient passes per epoch (Algorithm 1, line 9)
    rewards          r(x_0, c);  targets  Δr/β of every ordered pair with r_a > r_b

Differences from the paper, on purpose:
- r̂ is the MEAN of the per-step log-ratios over the trained steps, as appendix G's code (`jnp.mean(..., axis=-1)`),
  not the sum of Eq. 21 (the published β, 3e-5 and 3e-6, presumably goes with that code). The paper does not say how a
  step's log-prob is reduced over latent dimensions; diffrl's is the mean (DDPO's convention, whose clip 1e-4 equals
  PRDP's large-scale ε), so β and ε carry over only if the paper's code did the same — an assumption, not checked.
- as appendix G, each unordered pair is counted once (the ordered pair with r_a > r_b) and pairs of equal reward are
  left out (Algorithm 1 averages over all B(B−1)/2 pairs; equal only without ties). The mean is over every counted
  pair of a micro-batch (appendix G's loss is one prompt's; averaging per prompt first would weight prompts with
  many ties up). Pairs with a non-finite reward are left out too.
- a LoRA with the adapter-off UNet as π_ref (the paper fine-tunes the full UNet beside a frozen copy): the same
  π_ref at the start, without a second UNet in memory.
- each micro-batch's loss is a function of every trained step of its chains, so its gradient is taken in two passes:
  the per-step log-probs without gradient give the loss and d loss / d log π_t (autograd on the pure loss), then one
  forward + backward per step of that coefficient × log π_t. The sum is the exact gradient of the trajectory loss,
  with one step's activations in memory instead of T (one extra forward per step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.training.context import RunContext
from diffrl.training.reference import reference_step
from diffrl.training.sde_window import check_stochastic

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults are the paper's small-scale settings (its Table 4, first column:
# 45 prompts, HPSv2 or PickScore); its large-scale runs use B = 8, K = 1, β = 3e-6, ε = 1e-4.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PRDPConfig:
    group_size: int = 16  # B: chains per prompt, each from its own x_T (sample.batch_size must be a multiple)
    batch_size: int = 1  # prompts (groups of group_size chains) per training micro-batch, per process
    num_inner_epochs: int = 10  # K: passes over an epoch's groups (one optimizer step per pass when
    #                             optim.gradient_accumulation_steps covers all of a process's micro-batches)
    beta: float = 3e-5  # β, the KL weight: the targets are reward differences / β
    clip_range: float = 1e-6  # ε: each step's log-ratio stays within ε of the rollout snapshot's (Eq. 20)
    skip_final_steps: int = 0  # leave the last N denoising steps out of r̂ (tiny σ there; 0 = every step, as PRDP)


# The shared `optim:` group's defaults: the paper's (AdamW at 1e-5, weight decay 1e-4, gradient clip 1.0).
OPTIM_DEFAULTS = {"learning_rate": 1e-5, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
ADVANTAGE_DEFAULTS = None  # reward differences within a prompt's group, not advantages

TrainConfig = PRDPConfig

# ---------------------------------------------------------------------------------------------------------------
# Pure loss
# ---------------------------------------------------------------------------------------------------------------


def reward_difference_pairs(rewards: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The regression targets of every ordered pair of each group, and which pairs count.

    Args:
        rewards (`torch.Tensor` of shape `[G, B]`): the rewards of G groups (prompts) of B chains.
        beta (`float`): β.

    Returns:
        `(targets, counted)`: `[G, B, B]` float64 `(r_a − r_b) / β` (0 where a reward is not finite) and `[G, B, B]`
        bool, true for the ordered pairs with `r_a > r_b` (each unordered pair with distinct finite rewards once).
    """
    rewards = rewards.double()
    finite = torch.isfinite(rewards)
    safe = torch.where(finite, rewards, torch.zeros_like(rewards))  # a NaN would poison the gradient through `where`
    diff = safe[:, :, None] - safe[:, None, :]
    counted = (diff > 0) & finite[:, :, None] & finite[:, None, :]
    return diff / beta, counted


def prdp_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    rewards: torch.Tensor,
    *,
    beta: float,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """PRDP's clipped reward-difference-prediction loss for G groups of B chains of one prompt each (Eq. 14–21).

    With `log_ratio = log_probs − ref_log_probs` (r̂_θ,t), `old = old_log_probs − ref_log_probs` (r̂_θold,t),
    `clipped = clamp(log_ratio, old − ε, old + ε)`, `r̂` and `r̂_clip` their means over steps, for every pair a, b of
    a group with `r_a > r_b`: `l = max((Δr̂ − Δr/β)², (Δr̂_clip − Δr/β)²)`; the loss is the mean of `l` over those
    pairs (0, with zero gradient, when there are none). Computed in float64: with the published β the targets are
    ~1e2–1e4 while ε-sized changes of r̂ decide which of the two squares is larger.

    Args:
        log_probs (`torch.Tensor` of shape `[G, B, T]`): step log-probs under the current weights (carry the gradient).
        old_log_probs (`torch.Tensor` of shape `[G, B, T]`): the same recorded at rollout time.
        ref_log_probs (`torch.Tensor` of shape `[G, B, T]`): the same under the reference.
        rewards (`torch.Tensor` of shape `[G, B]`): the chains' rewards (non-finite ones leave their pairs out).
        beta (`float`): β > 0.
        clip_range (`float`): ε > 0.

    Returns:
        `(loss, stats)`: the scalar loss (float64) and detached float64 diagnostics: `approx_kl` (½·mean((log π_θ −
        log π_θold)²) over every step, DDPO's estimator), `clipfrac` (fraction of steps whose log-prob moved more than
        ε from the snapshot's), `accuracy` (fraction of counted pairs whose predicted difference Δr̂ is > 0: the
        implicit reward ranks them as the reward does) and `pairs` (the number of counted pairs).
    """
    log_probs, old_log_probs, ref_log_probs = log_probs.double(), old_log_probs.double(), ref_log_probs.double()
    log_ratio = log_probs - ref_log_probs  # r̂_θ,t
    old_ratio = old_log_probs - ref_log_probs  # r̂_θold,t
    clipped = torch.clamp(log_ratio, old_ratio - clip_range, old_ratio + clip_range)
    r_hat, r_hat_clip = log_ratio.mean(dim=-1), clipped.mean(dim=-1)  # [G, B]
    targets, counted = reward_difference_pairs(rewards.to(log_probs.device), beta)
    predicted = r_hat[:, :, None] - r_hat[:, None, :]  # Δr̂ of every ordered pair, [G, B, B]
    predicted_clip = r_hat_clip[:, :, None] - r_hat_clip[:, None, :]
    per_pair = torch.maximum((predicted - targets) ** 2, (predicted_clip - targets) ** 2)
    n_pairs = counted.sum()
    loss = torch.where(counted, per_pair, torch.zeros_like(per_pair)).sum() / n_pairs.clamp(min=1)
    with torch.no_grad():
        moved = log_probs - old_log_probs
        stats = {"approx_kl": 0.5 * (moved**2).mean(), "clipfrac": (moved.abs() > clip_range).double().mean(),
                 "accuracy": (predicted[counted] > 0).double().mean() if n_pairs else torch.tensor(float("nan")),
                 "pairs": n_pairs.double()}
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with PRDP against `cfg.reward`; write the run dir; return the final metrics.
    Arguments as `diffrl.trainers.ddpo.train` (`cfg.train` is a `PRDPConfig`)."""
    tc: PRDPConfig = cfg.train
    check(cfg)
    n_steps = trained_steps_per_chain(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="prdp", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback,
                           micro_batch_size=tc.batch_size * tc.group_size,
                           backwards_per_step=n_steps * cfg.optim.gradient_accumulation_steps)
    check_stochastic(cfg, "PRDP", ctx.sampler)
    ctx.load_state()

    for epoch, record in ctx.epochs():
        # ---- 1. B chains per prompt from the snapshot π_θold (the current weights), each from its own x_T; rewards
        rollout = ctx.rollout(group_size=tc.group_size)
        traj = rollout.traj.to(ctx.accelerator.device)

        # ---- 2. K passes of the clipped RDP loss over every pair of each prompt's chains
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = rdp_update(ctx, traj=traj, rewards=rollout.rewards, epoch=epoch)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan("lower optim.learning_rate or raise train.beta")
        stats.update(pair_counts(rollout.all_rewards, tc.group_size))

        # ---- 3. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def trained_steps_per_chain(cfg) -> int:
    """Denoising steps in each chain's r̂: the first T − skip_final_steps."""
    return cfg.sample.num_steps - cfg.train.skip_final_steps


def pair_counts(all_rewards: np.ndarray, group_size: int) -> dict:
    """The epoch's pairs (every process's): `pairs_used` (distinct finite rewards) and `pairs_skipped` (ties or a
    non-finite reward), from the gathered rewards, whose consecutive runs of `group_size` are one prompt's chains."""
    _, counted = reward_difference_pairs(torch.as_tensor(all_rewards).view(-1, group_size), 1.0)
    n_groups = len(all_rewards) // group_size
    used = int(counted.sum())
    return {"pairs_used": used, "pairs_skipped": n_groups * group_size * (group_size - 1) // 2 - used}


def reference_log_probs(ctx, traj, steps: list[int], rows: int) -> torch.Tensor:
    """`[N, len(steps)]` step log-probs of every chain under the reference (adapter off, no gradient), in chunks of
    `rows`; once per epoch, since π_ref does not change."""
    out = []
    for start in range(0, len(traj), rows):
        chunk = traj.select(torch.arange(start, min(start + rows, len(traj))))
        with ctx.accelerator.autocast():
            out.append(torch.stack([reference_step(ctx.pipe, ctx.sampler, chunk, j).log_prob for j in steps], dim=1))
    return torch.cat(out).float()


def rdp_update(ctx, *, traj, rewards: torch.Tensor, epoch: int) -> tuple[dict, bool]:
    """`num_inner_epochs` passes over this process's groups in micro-batches of `batch_size` groups; an optimizer step
    every `optim.gradient_accumulation_steps` micro-batches. Returns (epoch diagnostics, stop).

    Per micro-batch: the step log-probs without gradient give the loss and its gradient w.r.t. every step log-prob;
    then per step one forward with gradient and a backward of that coefficient × log-prob (see the module docstring).
    """
    tc: PRDPConfig = ctx.cfg.train
    rng, k = ctx.rng, tc.group_size
    n_groups = len(traj) // k
    steps = list(range(trained_steps_per_chain(ctx.cfg)))
    ref_all = reference_log_probs(ctx, traj, steps, tc.batch_size * k)  # [N, T']
    old_all = traj.log_probs[:, steps].float().to(ref_all.device)  # [N, T']
    rewards = rewards.to(ref_all.device)
    update = ctx.policy_update(losses_per_micro_batch=len(steps), ratio_check=f"epoch {epoch}, first pass")
    for _ in update.passes(tc.num_inner_epochs):
        order = rng.permutation(n_groups)
        minibatches = [order[i: i + tc.batch_size] for i in range(0, n_groups, tc.batch_size)]
        for groups in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
            rows = torch.as_tensor((groups[:, None] * k + np.arange(k)).reshape(-1))  # each group's k chains
            mb = traj.select(rows)
            with torch.no_grad(), ctx.accelerator.autocast():
                log_probs = torch.stack([ctx.sampler.log_prob(ctx.pipe, mb, j) for j in steps], dim=1).float()
            update.check_ratio(log_probs, old_all[rows])  # the rollout's own log-probs until the first update
            leaf = log_probs.detach().requires_grad_()
            shape = (len(groups), k, len(steps))
            loss, stats = prdp_loss(leaf.view(shape), old_all[rows].view(shape), ref_all[rows].view(shape),
                                    rewards[rows].view(shape[:2]), beta=tc.beta, clip_range=tc.clip_range)
            (coefficient,) = torch.autograd.grad(loss, leaf)  # d loss / d log π_t, [b·k, T'] (zero without pairs)
            if stats["pairs"] > 0:
                update.diag.add({"loss": loss.detach(), **stats})
            for i, j in enumerate(steps):
                with ctx.accelerator.autocast():
                    step_log_probs = ctx.sampler.log_prob(ctx.pipe, mb, j)  # [b·k], with gradient
                # this step's share of the loss's gradient; PolicyUpdate divides each of the T' backwards by T'
                update.backward(len(steps) * (coefficient[:, i].to(step_log_probs) * step_log_probs).sum())
    return update.stats(("loss", "kl", "approx_kl", "clipfrac", "accuracy", "grad_norm"), kl=None), update.stopped


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time, so `diffrl validate` reports them). Raises
    `UserError`."""
    tc: PRDPConfig = cfg.train
    if tc.group_size < 2:
        raise UserError(f"train.group_size must be >= 2 (PRDP trains pairs of one prompt's chains), got {tc.group_size}")
    if tc.batch_size < 1 or tc.num_inner_epochs < 1:
        raise UserError("train.batch_size and train.num_inner_epochs must be >= 1")
    if cfg.sample.batch_size % tc.group_size:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be a multiple of train.group_size "
                        f"({tc.group_size}): a prompt's chains are drawn in one batch")
    per_process = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
    per_step = tc.batch_size * tc.group_size * cfg.optim.gradient_accumulation_steps
    if per_process % per_step:
        raise UserError(f"chains per process per epoch (sample.batch_size × sample.num_batches_per_epoch = "
                        f"{per_process}) is not a multiple of train.batch_size × train.group_size × "
                        f"optim.gradient_accumulation_steps = {per_step}")
    if not 0 <= tc.skip_final_steps < cfg.sample.num_steps:
        raise UserError(f"train.skip_final_steps must be in [0, sample.num_steps = {cfg.sample.num_steps}), "
                        f"got {tc.skip_final_steps}")
    if not (tc.beta > 0 and math.isfinite(tc.beta)):
        raise UserError(f"train.beta must be > 0, got {tc.beta}")
    if not (tc.clip_range > 0 and math.isfinite(tc.clip_range)):
        raise UserError(f"train.clip_range must be > 0, got {tc.clip_range}")
    if cfg.model.full_finetune:
        raise UserError("PRDP's reference policy is the UNet with its LoRA adapter switched off, so it trains a LoRA "
                        "only: set model.full_finetune=false")
    check_stochastic(cfg, "PRDP")


def derived(cfg, num_processes: int) -> dict:
    """Global batch (chains per optimizer step), optimizer steps per epoch, prompts per epoch and the steps in each
    chain's r̂."""
    tc = cfg.train
    out = minibatch_numbers(cfg, num_processes, batch_size=tc.batch_size * tc.group_size, passes=tc.num_inner_epochs)
    out["prompts_per_epoch"] = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * num_processes // tc.group_size
    out["train_timesteps_per_chain"] = trained_steps_per_chain(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Per process and epoch: per (micro-batch, step) one guided UNet forward + backward of `train_batch` rows; as
    no-gradient forwards (`reference`) the adapter-off reference once per epoch and the policy's first pass per
    micro-batch; one AdamW step per optimizer step."""
    tc = cfg.train
    chains = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
    per_pass = -(-chains // (tc.batch_size * tc.group_size))
    micro_batches = tc.num_inner_epochs * per_pass
    steps = trained_steps_per_chain(cfg)
    return {"train_batch": tc.batch_size * tc.group_size, "fwd_bwd": micro_batches * steps,
            "reference": (per_pass + micro_batches) * steps,
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
