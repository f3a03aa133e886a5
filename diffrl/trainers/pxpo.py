"""PXPO: pixel-wise policy optimisation, DDPO with a per-pixel reward map (Kordzanganeh, Keshvary, Arian 2024).

Paper: "Pixel-wise RL on Diffusion Models: Reinforcement Learning from Rich Feedback", https://arxiv.org/abs/2404.04356.
No public code was found; this module follows the paper's objective as far as the text available here shows it.

DDPO credits one reward r(x_0, c) to every latent element of every denoising step. PXPO takes feedback per pixel,
r(x_0, c) = Σ_ij r(x_0^ij, c), and credits each pixel's reward only to its own part of each step's likelihood:
∇J_PXPO = E[Σ_ij r(x_0^ij, c) Σ_t ∇ log p_θ(x_{t-1}^ij | x_t, c)]. A DDIM step's Gaussian has a diagonal covariance,
so log p_θ(x_{t-1} | x_t, c) is a sum over latent elements and splits exactly into per-position terms. Here, as in
DDPO, each term goes through PPO's clipped importance ratio against the rollout policy.

Code names -> paper notation:
    maps              r(x_0^ij, c): the reward's `info["maps"]` [B, H, W] (a reward without maps: its score everywhere)
    position_log_probs  log π_θ(x_{t-1}^ij | x_t, c) at latent position (i, j): the Gaussian's log density averaged
                      over the latent channels, [B, h, w] (DDPO's step log-prob is the mean of these over (i, j))
    old_position_log_probs  the same under the rollout's weights (recomputed without gradient before the update)
    ratio             ρ^ij = exp(position_log_probs − old_position_log_probs)
    advantage_maps    Â^ij (`pixel_advantages`): the image's DDPO advantage Â plus the pixel's deviation from its
                      image's mean reward, in units of the epoch's reward std
    clip_range        ε of PPO's clip(ρ^ij, 1 − ε, 1 + ε)

Differences from the paper, on purpose or where its text is silent:
- the map reaches the latent grid by area averaging ([H, W] -> [h, w], the VAE's downsampling factor): a latent
  position's feedback is the mean over the pixels it decodes to (the paper's text read here does not say how it maps
  pixels to a latent diffusion model's latents);
- a latent position's log-prob is the MEAN over its channels, not the sum, and the loss is the mean over positions,
  samples and trained steps: DDPO's mean-over-dimensions convention, so a constant map gives DDPO's loss except that
  each position's ratio is clipped on its own;
- the paper's gradient uses the raw per-pixel reward; here it is normalised like DDPO's (the shared `advantage:`
  group, per prompt by default): Â^ij = Â + (m^ij − m̄)/(σ_r + ε), m̄ the image's mean map value, σ_r the std of
  the epoch's scalar rewards (every process), then clipped to ±advantage.clip_max. Its mean over an image's pixels is
  the image's DDPO advantage (before that clip); in `advantage.mode: batch` it is the pixels' reward (m^ij − μ)/σ.
- the clip range ε defaults to DDPO's 1e-4 although a position's log-ratio, an average over C channels rather than
  C·h·w elements, moves more per update than DDPO's: untuned; `clipfrac` shows how often it binds.
- PPO needs the rollout's per-position log-probs, which the sampler does not record (only their mean): each epoch
  recomputes them with the rollout's weights before the first update (one extra no-gradient forward per trained
  (sample, step); their mean is checked against the recorded log-probs, as every PPO trainer's first step is).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from diffrl.config import minibatch_numbers
from diffrl.errors import UserError
from diffrl.trainers.ddpo import ddpo_loss
from diffrl.training import rollout as rollouts
from diffrl.training.advantages import check_advantage_config, make_stat_tracker
from diffrl.training.context import RunContext
from diffrl.training.sde_window import check_stochastic, trainable_steps
from rewards.base import RewardOutput
from samplers.base import StepOutput, gaussian_log_density

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group): DDPO's fields and defaults (ddpo-pytorch's), without the SDE window.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PXPOConfig:
    batch_size: int = 4  # trajectories per training micro-batch, per process
    num_inner_epochs: int = 1  # passes over an epoch's samples (PPO epochs)
    timestep_fraction: float = 1.0  # fraction of each trajectory's eligible denoising steps trained (random subset)
    skip_final_steps: int = 0  # never train the last N denoising steps (tiny σ there)
    clip_range: float = 1e-4  # PPO ε for each latent position's ratio (DDPO's value; untuned for PXPO)


OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 2}
ADVANTAGE_DEFAULTS = {"mode": "per_prompt", "clip_max": 5.0, "stat_buffer_size": 16, "stat_min_count": 16}

TrainConfig = PXPOConfig

# ---------------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------------


def position_log_probs(step: StepOutput) -> torch.Tensor:
    """`[B, h, w]` log density of the step's sample x_{t-1} under its Gaussian, averaged over the latent channels;
    their mean over (h, w) is the step's `log_prob`. Zeros (on the model's graph) for a deterministic step."""
    if step.prev_sample.ndim != 4:
        raise UserError(f"PXPO needs image latents [B, C, h, w]; this pipeline's are {tuple(step.prev_sample.shape)}")
    std = float(step.std)
    if std == 0:
        return 0 * step.mean.mean(dim=1)
    x = step.prev_sample.detach().to(step.mean.dtype)
    return gaussian_log_density(x, step.mean, std).mean(dim=1)


def latent_maps(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Per-pixel maps `[B, H, W]` area-averaged to the latent grid `size` = (h, w): `[B, h, w]`."""
    return F.adaptive_avg_pool2d(maps[:, None].float(), size)[:, 0]


def pixel_advantages(maps: torch.Tensor, advantages: torch.Tensor, reward_std: float, clip_max: float) -> torch.Tensor:
    """Per-position advantages `[B, h, w]`: `Â^ij = Â + (m^ij − m̄)/reward_std`, clipped to ±clip_max (> 0).

    Args:
        maps (`torch.Tensor` of shape `[B, h, w]`): the feedback on the latent grid.
        advantages (`torch.Tensor` of shape `[B]`): each image's (clipped) scalar advantage Â.
        reward_std (`float`): σ_r + ε, the epoch's reward std.
        clip_max (`float`): the advantage clip; <= 0 for none.
    """
    deviation = maps - maps.mean(dim=(1, 2), keepdim=True)
    out = advantages[:, None, None].to(maps) + deviation / reward_std
    return out.clamp(-clip_max, clip_max) if clip_max > 0 else out


def pxpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate per latent position, averaged over samples and positions.

    `loss = mean_{b,i,j} max(−Â ρ, −Â clip(ρ, 1 − ε, 1 + ε))` with `ρ = exp(log_probs − old_log_probs)` per (b, i, j):
    each position's likelihood moves with its own feedback.

    Args:
        log_probs (`torch.Tensor` of shape `[B, h, w]`): per-position log-probs under the current weights (grad).
        old_log_probs (`torch.Tensor` of shape `[B, h, w]`): the same under the rollout's weights.
        advantages (`torch.Tensor` of shape `[B, h, w]`): per-position advantages (`pixel_advantages`).
        clip_range (`float`): ε.

    Returns:
        `(loss, stats)`: `diffrl.trainers.ddpo.ddpo_loss` on the per-position tensors (its mean runs over samples
        and positions): the scalar loss and detached `approx_kl`, `clipfrac` and `ratio` over positions.
    """
    return ddpo_loss(log_probs, old_log_probs, advantages, clip_range)


class MapRecorder:
    """The run's reward, keeping each scored batch's maps (`info["maps"]` `[B, H, W]`, on the CPU; a reward without
    maps: its scores as 1×1 maps) in sampling order, so a rollout's maps line up with its trajectories."""

    def __init__(self, reward):
        self.reward = reward
        self.name = getattr(reward, "name", type(reward).__name__)
        self.batches: list[torch.Tensor] = []

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        out = self.reward(images, prompts, metadata)
        maps = (out.info or {}).get("maps")
        if maps is None:
            maps = out.scores.detach().reshape(-1, 1, 1)
        elif maps.ndim != 3 or maps.shape[0] != images.shape[0]:
            raise UserError(f"reward '{self.name}' returned info['maps'] of shape {tuple(maps.shape)}; PXPO needs "
                            f"[B, H, W] with B = {images.shape[0]}")
        self.batches.append(maps.detach().float().cpu())
        return out

    def maps(self) -> torch.Tensor:
        return torch.cat(self.batches)


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with PXPO against `cfg.reward`'s maps; write the run dir; return the metrics.
    Arguments as `diffrl.trainers.ddpo.train` (`cfg.train` is a `PXPOConfig`)."""
    tc: PXPOConfig = cfg.train
    adv = cfg.advantage
    check(cfg)
    n_train_steps = trained_steps_per_sample(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="pxpo", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=n_train_steps * cfg.optim.gradient_accumulation_steps)
    check_stochastic(cfg, "PXPO", ctx.sampler)
    ctx.load_state(stat_tracker=make_stat_tracker(adv))

    for epoch, record in ctx.epochs():
        # ---- 1. sample with the current weights; score, keeping each image's map
        recorder = MapRecorder(ctx.reward)
        rollout = ctx.rollout(group_size=adv.group_size, shared_start_noise=adv.shared_start_noise, reward=recorder)

        # ---- 2. the images' DDPO advantages (every process's rewards), this process's slice, its maps
        advantages = rollouts.epoch_advantages(rollout, adv, ctx.state.stat_tracker)
        traj, local_adv, local_ok = rollouts.local_batch(rollout, advantages, ctx.accelerator)
        finite = rollout.all_rewards[rollout.finite]
        reward_std = float(np.std(finite)) + adv.std_eps

        # ---- 3. PPO on every (sample, trained step, latent position), each position weighted by its feedback
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = pxpo_update(ctx, traj=traj, advantages=local_adv, valid=local_ok, maps=recorder.maps(),
                                  reward_std=reward_std, n_train_steps=n_train_steps, epoch=epoch)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan()

        # ---- 4. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def trained_steps_per_sample(cfg) -> int:
    """Denoising steps each trajectory trains per inner epoch: `timestep_fraction` of the first T − skip_final_steps
    (DDPO's rule, int(n·fraction), at least 1)."""
    eligible = cfg.sample.num_steps - cfg.train.skip_final_steps
    return max(1, int(eligible * cfg.train.timestep_fraction))


def old_position_log_probs(ctx, traj, steps: np.ndarray, update) -> torch.Tensor:
    """`[N, len(steps), h, w]` per-position log-probs of every trajectory under the rollout's weights (no gradient,
    micro-batches of `train.batch_size`); their means go through the first-step check against the recorded ones."""
    rows = ctx.cfg.train.batch_size
    out = []
    for start in range(0, len(traj), rows):
        idx = torch.arange(start, min(start + rows, len(traj)))
        mb = traj.select(idx)
        per_step = []
        for j in steps.tolist():
            with torch.no_grad(), ctx.accelerator.autocast():
                step = ctx.sampler.log_prob(ctx.pipe, mb, j, return_step=True)
            update.check_ratio(step.log_prob, mb.log_probs[:, j].to(step.log_prob.device))
            per_step.append(position_log_probs(step).float())
        out.append(torch.stack(per_step, dim=1))
    return torch.cat(out)


def pxpo_update(ctx, *, traj, advantages, valid, maps, reward_std: float, n_train_steps: int,
                epoch: int) -> tuple[dict, bool]:
    """`num_inner_epochs` passes of per-position PPO over this process's trajectories. Returns (diagnostics, stop).

    The loop is `ddpo.ppo_update`'s (shuffled micro-batches of `batch_size`, a random subset of `n_train_steps` steps
    each, an optimizer step every `optim.gradient_accumulation_steps` micro-batches), except that each step's loss is
    `pxpo_loss` over latent positions, against per-position log-probs recomputed before the first update.
    """
    tc: PXPOConfig = ctx.cfg.train
    rng, n_local = ctx.rng, len(traj)
    eligible = trainable_steps(traj, tc.skip_final_steps)
    column = {int(j): k for k, j in enumerate(eligible)}
    update = ctx.policy_update(losses_per_micro_batch=n_train_steps, ratio_check=f"epoch {epoch}, before the update")
    old = old_position_log_probs(ctx, traj, eligible, update)  # [N, steps, h, w]
    advantage_maps = pixel_advantages(latent_maps(maps, tuple(old.shape[-2:])).to(old.device), advantages.to(old),
                                      reward_std, ctx.cfg.advantage.clip_max)  # [N, h, w]
    for _ in update.passes(tc.num_inner_epochs):
        order = rng.permutation(n_local)
        minibatches = [order[i: i + tc.batch_size] for i in range(0, n_local, tc.batch_size)]
        for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
            mb = traj.select(torch.as_tensor(idx))
            mb_ok = valid[idx]
            steps = eligible[rng.permutation(len(eligible))[:n_train_steps]].tolist()
            for j in steps:
                with ctx.accelerator.autocast():
                    step = ctx.sampler.log_prob(ctx.pipe, mb, j, return_step=True)  # current weights, with grad
                log_probs = position_log_probs(step)  # [b, h, w]
                if bool(mb_ok.any()):
                    old_log_probs = old[idx, column[j]].to(log_probs)
                    update.backward(*pxpo_loss(log_probs[mb_ok], old_log_probs[mb_ok],
                                               advantage_maps[idx].to(log_probs)[mb_ok], tc.clip_range))
                else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                    update.backward(log_probs.sum() * 0.0)
    return update.stats(("loss", "kl", "approx_kl", "clipfrac", "ratio", "grad_norm"), kl=None), update.stopped


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer (at load time, so `diffrl validate` reports them). Raises
    `UserError`."""
    tc: PXPOConfig = cfg.train
    check_advantage_config(cfg)
    if tc.batch_size < 1 or tc.num_inner_epochs < 1:
        raise UserError("train.batch_size and train.num_inner_epochs must be >= 1")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    if not 0 <= tc.skip_final_steps < cfg.sample.num_steps:
        raise UserError(f"train.skip_final_steps must be in [0, sample.num_steps = {cfg.sample.num_steps}), "
                        f"got {tc.skip_final_steps}")
    if not (tc.clip_range > 0 and math.isfinite(tc.clip_range)):
        raise UserError(f"train.clip_range must be > 0, got {tc.clip_range}")
    check_stochastic(cfg, "PXPO")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch (DDPO's), and the denoising steps each trajectory trains."""
    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size, passes=cfg.train.num_inner_epochs)
    out["train_timesteps_per_sample"] = trained_steps_per_sample(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """Per process and epoch: one guided UNet forward + backward of `train_batch` rows per trained (micro-batch,
    step); the no-gradient recomputation of the rollout's per-position log-probs (`reference`: every eligible step
    of every micro-batch, once); one AdamW step per optimizer step."""
    tc = cfg.train
    per_pass = -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    micro_batches = tc.num_inner_epochs * per_pass
    return {"train_batch": tc.batch_size, "fwd_bwd": micro_batches * trained_steps_per_sample(cfg),
            "reference": per_pass * (cfg.sample.num_steps - tc.skip_final_steps),
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
