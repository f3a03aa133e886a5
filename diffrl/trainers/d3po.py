"""D3PO: direct preference optimisation on the denoising steps, without a reward model (Yang et al. 2023).

Paper: "Using Human Feedback to Fine-tune Diffusion Models without Any Reward Model", CVPR 2024,
https://arxiv.org/abs/2311.13231. Reference code: github.com/yk7333/d3po (scripts/rm/train_d3po.py for preferences
from rewards, scripts/train.py for human labels; config/base.py for the defaults).

The denoising chain is a multi-step MDP whose step policy is the Gaussian DDIM step (η = 1). For each prompt two
chains start from the same x_T; a judge (a person, one reward, or several rewards) prefers one final image, and the
paper treats every step of the preferred chain as a preferred action (its Sec. 4: the DPO objective of Rafailov et
al. applied to each state-action pair of the two trajectories). The loss of step k of a pair is

    L_k = -log σ( β · log clamp(ρ_k^w, 1 - ε, 1 + ε) - β · log clamp(ρ_k^l, 1 - ε, 1 + ε) )
    ρ_k = π_θ(x_{k-1} | x_k, c) / π_ref(x_{k-1} | x_k, c)

with the ratio clamp the reference code adds ("constraining the probability ratio", train.eps = 0.1; the authors
fixed it to [0.9, 1.1] after [0.8, 1.2] made images disintegrate, yk7333/d3po issue #4): once a ratio leaves
[1 - ε, 1 + ε] its gradient is zero, which bounds how far the policy moves from the reference. (Equation numbers are
not given here: the paper's text was not at hand when this was written; the loss above is checked against the
reference code's `train_d3po.py`, line for line in meaning.)

Code names -> paper notation:
    log_probs        log π_θ(x_{k-1} | x_k, c)   under the current weights (mean over latent dims, as DDPO)
    ref_log_probs    log π_ref(x_{k-1} | x_k, c)  the same UNet with its LoRA adapter off (no second copy)
    ratio            ρ_k = π_θ / π_ref;  `_w` of the preferred (winner) chain, `_l` of the other
    beta             β, the DPO temperature;  clip_range  ε of the ratio clamp
    choice           which chain of a pair is preferred: 0, 1, or -1 (tie / unlabelled: skipped and counted)

Preferences (`train.preference`): `reward` — the (weighted-sum) reward decides, equal rewards are a tie;
`pareto` — the `reward.components` compared one by one, a chain preferred only when it dominates (no component
worse, one better), as the reference's multi-reward `compare`; `labels` — a human label file (`diffrl.pairs.labels`),
trained offline from its saved chains (the reward then only scores the log and the evaluations).

Differences from the reference code, on purpose:
- ties and unlabelled pairs are dropped from the mean (the reference keeps them at loss log 2 with zero gradient,
  which only rescales the gradient by the fraction of decided pairs) and counted in `pairs_skipped`;
- the reference is the adapter-off UNet, not a deep copy made before training (the same weights: a fresh LoRA adds
  exactly zero), so ρ = 1 before the first update;
- each micro-batch shares one random subset of steps (the reference shuffles steps per sample; equal at its batch
  size of one pair); from labels, each epoch trains the next `sample.batch_size × sample.num_batches_per_epoch / 2`
  pairs per process of a seeded shuffle of the file, instead of the reference's whole file per epoch.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.pairs.labels import check_pair_settings, load_pair_images, load_pairs_trajectory, read_label_file
from diffrl.training import setup
from diffrl.training.context import RunContext
from diffrl.training.distributed import gather_tensor
from diffrl.training.reference import reference_step
from diffrl.training.rollout import gather_rollout, local_slice, score_images
from diffrl.training.sde_window import check_stochastic, trainable_steps

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults are the reference implementation's (yk7333/d3po config/base.py).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class D3POConfig:
    batch_size: int = 1  # pairs per training micro-batch, per process (2 chains each; reference train.batch_size)
    num_inner_epochs: int = 1  # passes over an epoch's pairs
    timestep_fraction: float = 1.0  # fraction of the T denoising steps trained per pair (random subset)
    skip_final_steps: int = 0  # never train the last N steps (tiny σ: their log-prob gradient is mostly noise)
    beta: float = 0.1  # β, the DPO temperature (reference train.beta)
    clip_range: float = 0.1  # ε: each ratio π_θ/π_ref is clamped to [1 - ε, 1 + ε] (reference train.eps)
    # who prefers: the reward (weighted sum), each reward component (Pareto dominance), or a human label file
    preference: Literal["reward", "pareto", "labels"] = "reward"
    labels: str = ""  # the label file (JSONL, diffrl.pairs.labels) with preference=labels; relative to the working dir


# The shared `optim:` group's defaults: the reference's (AdamW 3e-5, weight decay 1e-4, clip 1.0, no accumulation).
OPTIM_DEFAULTS = {"learning_rate": 3e-5, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
ADVANTAGE_DEFAULTS = None  # preferences, not advantages

TrainConfig = D3POConfig

# ---------------------------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------------------------


def pair_choices(scores_0: torch.Tensor, scores_1: torch.Tensor) -> torch.Tensor:
    """Which chain of each pair is preferred, by Pareto dominance over K scores (higher is better).

    Chain 0 is preferred when no score of it is lower than chain 1's and one is higher; chain 1 likewise; else
    (equal, or each better somewhere, or a non-finite score) neither. With K = 1 this is "the higher reward wins,
    equal rewards tie".

    Args:
        scores_0 (`torch.Tensor` of shape `[P]` or `[P, K]`): chain 0's scores.
        scores_1 (`torch.Tensor` of the same shape): chain 1's scores.

    Returns:
        `torch.Tensor` int64 `[P]`: 0, 1, or -1 (no preference).
    """
    a = scores_0.reshape(len(scores_0), -1).double()
    b = scores_1.reshape(len(scores_1), -1).double()
    finite = torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1)
    a_wins = (a >= b).all(dim=1) & (a > b).any(dim=1) & finite
    b_wins = (b >= a).all(dim=1) & (b > a).any(dim=1) & finite
    choice = torch.full((len(a),), -1, dtype=torch.long)
    choice[a_wins] = 0
    choice[b_wins] = 1
    return choice


def d3po_loss(
    log_probs_w: torch.Tensor,
    ref_log_probs_w: torch.Tensor,
    log_probs_l: torch.Tensor,
    ref_log_probs_l: torch.Tensor,
    *,
    beta: float,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """D3PO's loss for one denoising step of a batch of decided pairs (see the module docstring).

    `loss = mean_i -log σ(β log clamp(ρ_w,i, 1 - ε, 1 + ε) - β log clamp(ρ_l,i, 1 - ε, 1 + ε))` with
    `ρ = exp(log_probs - ref_log_probs)`. The clamp is on the ratio itself (as the reference code), so a ratio
    outside the range passes no gradient.

    Args:
        log_probs_w, log_probs_l (`torch.Tensor` of shape `[B]`): the preferred / other chain's step log-prob under
            the current weights (carry the gradient).
        ref_log_probs_w, ref_log_probs_l (`torch.Tensor` of shape `[B]`): the same under the reference.
        beta (`float`): β.
        clip_range (`float`): ε, in (0, 1).

    Returns:
        `(loss, stats)`: the scalar loss and detached float64 diagnostics `ratio_w`, `ratio_l` (mean unclamped ρ),
        `clipfrac` (fraction of ratios outside the clamp), `accuracy` (fraction of pairs whose clamped margin is
        > 0: the implicit reward ranks the preferred chain higher) and `margin` (mean of the logit).
    """
    ratio_w = torch.exp(log_probs_w - ref_log_probs_w)
    ratio_l = torch.exp(log_probs_l - ref_log_probs_l)
    clamped_w = torch.clamp(ratio_w, 1.0 - clip_range, 1.0 + clip_range)
    clamped_l = torch.clamp(ratio_l, 1.0 - clip_range, 1.0 + clip_range)
    logits = beta * torch.log(clamped_w) - beta * torch.log(clamped_l)
    loss = -F.logsigmoid(logits).mean()  # = -log σ(logits), without underflow for large negative logits
    with torch.no_grad():
        outside = torch.cat([(ratio_w - 1).abs(), (ratio_l - 1).abs()]) > clip_range
        stats = {"ratio_w": ratio_w.double().mean(), "ratio_l": ratio_l.double().mean(),
                 "clipfrac": outside.double().mean(), "accuracy": (logits > 0).double().mean(),
                 "margin": logits.double().mean()}
    return loss, stats


def winner_loser_rows(pairs: np.ndarray, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (into a trajectory whose pair i is rows 2i, 2i+1) of each pair's preferred and other chain; a
    pair without preference gets (2i, 2i+1), to be masked out."""
    second = choice == 1
    return 2 * pairs + second, 2 * pairs + ~second


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with D3PO; write the run dir; return the final metrics.

    Args:
        cfg (`RunConfig`): the resolved recipe (`cfg.train` is a `D3POConfig`).
        run_dir (`Path`): the run dir (created if needed; must be writable).
        resume (`bool`, *optional*, defaults to `False`): continue from the newest checkpoint in `run_dir` (or
            from `cfg.run.resume`), exactly where it stopped.
        accelerator (`accelerate.Accelerator`, *optional*): defaults to one built from the config.
        step_callback (`Callable`, *optional*): called once before training and after every optimizer step with a
            dict (`global_step`, `epoch`, `params`, `unet`, `pipe`, `accelerator`).

    Returns:
        `dict`: the last epoch's metrics, plus the final evaluation when `run.eval_every > 0`.
    """
    tc: D3POConfig = cfg.train
    check(cfg)
    labelled = read_label_file(tc.labels, need_latents=True) if tc.preference == "labels" else None
    n_train_steps = trained_steps_per_pair(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="d3po", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=2 * tc.batch_size,
                           backwards_per_step=n_train_steps * cfg.optim.gradient_accumulation_steps)
    check_stochastic(cfg, "D3PO", ctx.sampler)
    ctx.load_state()

    for epoch, record in ctx.epochs():
        # ---- 1. this epoch's pairs: two chains per prompt from one x_T, judged by the reward(s); or labelled ones
        if labelled is None:
            rollout = ctx.rollout(group_size=2, shared_start_noise=True)
            choice = rollout_choices(rollout, ctx.reward, tc.preference, ctx.accelerator)
        else:
            rollout, choice = labelled_rollout(ctx, labelled, epoch)
        traj = rollout.traj.to(ctx.accelerator.device)

        # ---- 2. the per-step DPO loss against the adapter-off reference, on every decided pair
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = dpo_update(ctx, traj=traj, choice=choice, n_train_steps=n_train_steps, epoch=epoch,
                                 check_rollout=labelled is None)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan("lower optim.learning_rate or train.beta")
        decided = gather_tensor(ctx.accelerator, torch.tensor([int((choice >= 0).sum()), len(choice)]).view(1, 2))
        stats.update(pairs_used=int(decided[:, 0].sum()), pairs_skipped=int(decided[:, 1].sum() - decided[:, 0].sum()))

        # ---- 3. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def rollout_choices(rollout, reward, preference: str, accelerator) -> np.ndarray:
    """This process's pairs' choices (`[P]`: 0, 1 or -1) from the gathered rewards: the reward itself, or with
    `pareto` each component of a weighted sum (its per-term scores, logged under the terms' labels)."""
    if preference == "pareto":
        labels = [label for label, _, _ in reward.terms]
        scores = torch.as_tensor(np.stack([rollout.components[label] for label in labels], axis=1))  # [N, K]
    else:
        scores = torch.as_tensor(rollout.all_rewards)[:, None]  # [N, 1]
    choice = pair_choices(scores[0::2], scores[1::2]).numpy()  # pair i = samples 2i, 2i+1 (one group)
    mine = local_slice(accelerator, len(rollout.traj))
    return choice[mine.start // 2: mine.stop // 2]


def labelled_pairs_of_epoch(n_labelled: int, epoch: int, pairs_per_process: int, num_processes: int,
                            process_index: int, seed: int) -> np.ndarray:
    """Indices into the label file of the pairs one process trains in `epoch`: the epoch's consecutive block of
    `pairs_per_process × num_processes` positions in an endless sequence of shuffles of the file (shuffle k from
    `default_rng([seed, k])`), this process's share of it. A function of the epoch alone, so a resumed run draws
    what the uninterrupted one would."""
    per_epoch = pairs_per_process * num_processes
    start = epoch * per_epoch + process_index * pairs_per_process
    positions = np.arange(start, start + pairs_per_process)
    shuffles = {k: np.random.default_rng([seed, k]).permutation(n_labelled) for k in set(positions // n_labelled)}
    return np.array([shuffles[p // n_labelled][p % n_labelled] for p in positions], dtype=np.int64)


def labelled_rollout(ctx, labelled, epoch: int):
    """This epoch's labelled pairs as a `Rollout` (their saved chains; their images scored by the recipe's reward,
    for the log only) and their choices (`[P]`: 0, 1 or -1 for tie / unlabelled)."""
    cfg, accelerator = ctx.cfg, ctx.accelerator
    pairs_per_process = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // 2
    picked = labelled_pairs_of_epoch(len(labelled), epoch, pairs_per_process, accelerator.num_processes,
                                     accelerator.process_index, cfg.run.seed)
    pairs = [labelled[i] for i in picked]
    start = time.perf_counter()
    traj = load_pairs_trajectory(pairs, ctx.pipe, ctx.sampler, cfg.sample)
    images = load_pair_images(pairs)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    scores, components = score_images(ctx.reward, images.to(accelerator.device), traj.prompts)
    rollout = gather_rollout([traj], [scores], {k: [v] for k, v in components.items()},
                             [images[: ctx.grid_images_per_process]], group_size=2, accelerator=accelerator,
                             rollout_s=load_s, reward_s=time.perf_counter() - start)
    choice = np.array([-1 if p.preferred is None else p.preferred for p in pairs], dtype=np.int64)
    return ctx.count(rollout), choice


def trained_steps_per_pair(cfg) -> int:
    """Denoising steps each pair trains per inner epoch: `timestep_fraction` of the first T − skip_final_steps."""
    return setup.num_train_timesteps(cfg.sample.num_steps - cfg.train.skip_final_steps, cfg.train.timestep_fraction)


def dpo_update(ctx, *, traj, choice: np.ndarray, n_train_steps: int, epoch: int,
               check_rollout: bool) -> tuple[dict, bool]:
    """`num_inner_epochs` passes over this process's pairs in micro-batches of `batch_size` pairs; each micro-batch
    trains a random subset of `n_train_steps` steps (one policy forward with gradient and one adapter-off reference
    forward per step, over the micro-batch's preferred and other chains together); an optimizer step every
    `optim.gradient_accumulation_steps` micro-batches. Returns (epoch diagnostics, stop)."""
    tc: D3POConfig = ctx.cfg.train
    rng, n_pairs = ctx.rng, len(choice)
    eligible = trainable_steps(traj, tc.skip_final_steps)
    # chains from a label file were not sampled by these weights' rollout: no ratio to check
    update = ctx.policy_update(losses_per_micro_batch=n_train_steps,
                               ratio_check=f"epoch {epoch}, first step" if check_rollout else None)
    for _ in update.passes(tc.num_inner_epochs):
        order = rng.permutation(n_pairs)
        minibatches = [order[i: i + tc.batch_size] for i in range(0, n_pairs, tc.batch_size)]
        for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
            mb_choice = choice[idx]
            winners, losers = winner_loser_rows(idx, mb_choice)
            mb = traj.select(torch.as_tensor(np.concatenate([winners, losers])))  # [preferred..., other...]
            ok = torch.as_tensor(mb_choice >= 0)
            b = len(idx)
            steps = eligible[rng.permutation(len(eligible))[:n_train_steps]].tolist()
            for j in steps:
                with ctx.accelerator.autocast():
                    log_probs = ctx.sampler.log_prob(ctx.pipe, mb, j)  # [2b], current weights
                    ref_log_probs = reference_step(ctx.pipe, ctx.sampler, mb, j).log_prob  # [2b], adapter off
                update.check_ratio(log_probs, mb.log_probs[:, j].to(log_probs.device))
                ok_d = ok.to(log_probs.device)
                if bool(ok.any()):
                    update.backward(*d3po_loss(log_probs[:b][ok_d], ref_log_probs[:b][ok_d], log_probs[b:][ok_d],
                                               ref_log_probs[b:][ok_d], beta=tc.beta, clip_range=tc.clip_range))
                else:  # only ties / unlabelled pairs here: keep the backward (every process must match), no gradient
                    update.backward(log_probs.sum() * 0.0)
    # the KL to the reference is implicit in the DPO loss
    return update.stats(("loss", "kl", "ratio_w", "ratio_l", "clipfrac", "accuracy", "margin", "grad_norm"),
                        kl=None), update.stopped


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time, so `diffrl validate` reports them); with
    `preference: labels`, the whole label file (every line, image and chain file) is checked here, before any run
    dir exists. Raises `UserError`."""
    tc: D3POConfig = cfg.train
    if tc.batch_size < 1 or tc.num_inner_epochs < 1:
        raise UserError("train.batch_size and train.num_inner_epochs must be >= 1")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    if not 0 <= tc.skip_final_steps < cfg.sample.num_steps:
        raise UserError(f"train.skip_final_steps must be in [0, sample.num_steps = {cfg.sample.num_steps}), "
                        f"got {tc.skip_final_steps}")
    if not (tc.beta > 0 and math.isfinite(tc.beta)):
        raise UserError(f"train.beta must be > 0, got {tc.beta}")
    if not 0 < tc.clip_range < 1:
        raise UserError(f"train.clip_range must be in (0, 1) (the ratio is clamped to [1 - ε, 1 + ε]), "
                        f"got {tc.clip_range}")
    if cfg.sample.batch_size % 2:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be even: a pair's two chains are drawn "
                        "in one batch")
    if cfg.model.full_finetune:
        raise UserError("D3PO's reference policy is the UNet with its LoRA adapter switched off, so it trains a "
                        "LoRA only: set model.full_finetune=false")
    check_stochastic(cfg, "D3PO")
    if tc.preference == "pareto" and len(cfg.reward.components) < 2:
        raise UserError("train.preference=pareto compares reward.components one by one; give at least two (or use "
                        "train.preference=reward)")
    if tc.preference != "labels" and tc.labels:
        raise UserError(f"train.labels is read only with train.preference=labels (got preference={tc.preference})")
    if tc.preference == "labels":
        if not tc.labels:
            raise UserError("train.preference=labels needs train.labels (a label file made by `diffrl pairs sample`)")
        pairs = read_label_file(tc.labels, need_latents=True)
        check_pair_settings(tc.labels, pairs, cfg.sample)


def derived(cfg, num_processes: int) -> dict:
    """Pairs per epoch, global batch (chains per optimizer step) and optimizer steps per epoch; the steps each pair
    trains."""
    tc = cfg.train
    out = minibatch_numbers(cfg, num_processes, batch_size=2 * tc.batch_size, passes=tc.num_inner_epochs)
    out["pairs_per_epoch"] = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * num_processes // 2
    out["train_timesteps_per_pair"] = trained_steps_per_pair(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Per process and epoch: per trained (micro-batch, step) one guided UNet forward + backward and one adapter-off
    reference forward of `train_batch` rows (both chains of `batch_size` pairs); one AdamW step per optimizer step."""
    tc = cfg.train
    pairs = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // 2
    micro_batches = tc.num_inner_epochs * -(-pairs // tc.batch_size)
    passes = micro_batches * trained_steps_per_pair(cfg)
    return {"train_batch": 2 * tc.batch_size, "fwd_bwd": passes, "reference": passes,
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
