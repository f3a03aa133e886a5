"""DDPO: PPO on the denoising steps of a diffusion model against a black-box reward (Black et al. 2023).

Paper: "Training Diffusion Models with Reinforcement Learning", https://arxiv.org/abs/2305.13301.

Each denoising step of a DDIM sampler with eta > 0 is a Gaussian policy π_θ(x_{t-1} | x_t, c). DDPO collects
trajectories with the current weights, scores the final images with a reward r(x_0, c), turns rewards into
advantages and runs PPO's clipped surrogate on every (sample, timestep) pair (the paper's DDPO_IS).

Code names -> paper notation:
    log_probs       log π_θ(x_{t-1} | x_t, c)   recomputed under the current weights (mean over latent dims)
    old_log_probs   log π_old(x_{t-1} | x_t, c) recorded at rollout time (the behaviour policy)
    ratio           ρ = π_θ / π_old = exp(log_probs - old_log_probs)
    advantages      Â = (r - μ_c) / σ_c, per-prompt statistics (or group / batch), clipped to ±advantage.clip_max
    clip_range      ε of PPO's clip(ρ, 1 - ε, 1 + ε)

Log-probs are the MEAN over latent dimensions (as the reference code does), so ε = 1e-4 means what it means there.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffrl.config import minibatch_numbers
from diffrl.training import setup
from diffrl.training.advantages import make_stat_tracker
from diffrl.training.context import RunContext
from diffrl.training.sde_window import (
    check_sampler,
    check_stochastic,
    trainable_steps,
)
from diffrl.training.update import advantage_epochs, check_ppo_config

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults are the reference implementation's (ddpo-pytorch, the configs of
# the published SD 1.x runs: 256 samples and 4 optimizer steps per epoch on 8 GPUs).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DDPOConfig:
    batch_size: int = 4  # trajectories per training micro-batch, per process (optim.gradient_accumulation_steps
    #                      micro-batches make one optimizer step; each micro-batch trains all its trained steps)
    num_inner_epochs: int = 1  # passes over an epoch's samples (PPO epochs)
    timestep_fraction: float = 1.0  # fraction of each trajectory's T denoising steps trained (random subset)
    # never train the last N denoising steps: near t = 0 the step's std is tiny, so its log-prob gradient is large
    # and mostly noise about details a reward barely sees (the subset above is drawn from the first T - N steps)
    skip_final_steps: int = 0
    clip_range: float = 1e-4  # PPO ε for the per-step ratio (log-probs are means over latent dims)
    # MixGRPO-style SDE window: only `sde_window` consecutive steps per trajectory are stochastic (sample.eta) and
    # trained, the others deterministic (η = 0); the window starts at a step drawn each epoch from
    # 0..sde_window_max_start. Far less noise per trajectory for the reward to be credited to, and training costs
    # W steps instead of T. 0 = every step stochastic (DDPO as published).
    sde_window: int = 0
    sde_window_max_start: int = 0


# The shared `optim:` group's defaults for DDPO: ddpo-pytorch's (AdamW 3e-4 on the LoRA, weight decay 1e-4, clip 1.0,
# 2 micro-batches per optimizer step).
OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0, "gradient_accumulation_steps": 2}
# The `advantage:` group: per-prompt statistics (16 kept, 16 needed), clipped to ±5, as ddpo-pytorch.
ADVANTAGE_DEFAULTS = {"mode": "per_prompt", "clip_max": 5.0, "stat_buffer_size": 16, "stat_min_count": 16}

TrainConfig = DDPOConfig


# ---------------------------------------------------------------------------------------------------------------
# Pure loss
# ---------------------------------------------------------------------------------------------------------------


def ddpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate for one denoising step of a batch of trajectories.

    `loss = mean_i max(-Â_i ρ_i, -Â_i clip(ρ_i, 1 - ε, 1 + ε))` with `ρ_i = exp(log_probs_i - old_log_probs_i)`.
    The max of the two negated terms is the min of PPO's objective, so the update never profits from moving the
    ratio beyond the clip range in the direction the advantage favours.

    Args:
        log_probs (`torch.Tensor` of shape `[B]`): log-probs under the current weights (carry the gradient).
        old_log_probs (`torch.Tensor` of shape `[B]`): log-probs recorded when the trajectory was sampled.
        advantages (`torch.Tensor` of shape `[B]`): advantages, already clipped.
        clip_range (`float`): PPO's ε.

    Returns:
        `(loss, stats)`: the scalar loss and detached diagnostics `approx_kl` (½·mean((log ρ)²), the estimator of
        the reference code), `clipfrac` (fraction of |ρ - 1| > ε) and `ratio` (mean ρ).
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
            "ratio": ratio.double().mean(),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with DDPO against `cfg.reward`; write the run dir; return the final metrics.

    Args:
        cfg (`RunConfig`): the resolved recipe (`cfg.train` is a `DDPOConfig`).
        run_dir (`Path`): the run dir (created if needed; must be writable).
        resume (`bool`, *optional*, defaults to `False`): continue from the newest checkpoint in `run_dir` (or
            from `cfg.run.resume` when that names one), exactly where it stopped.
        accelerator (`accelerate.Accelerator`, *optional*): defaults to one built from the config.
        step_callback (`Callable`, *optional*): called once before training and after every optimizer step with a
            dict (`global_step`, `epoch`, `params`, `unet`, `pipe`, `accelerator`), e.g. to check that all processes hold
            the same weights.

    Returns:
        `dict`: the last epoch's metrics, plus the final evaluation when `run.eval_every > 0`.
    """
    tc: DDPOConfig = cfg.train
    check(cfg)
    n_train_steps = trained_steps_per_sample(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="ddpo", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=n_train_steps * cfg.optim.gradient_accumulation_steps)
    check_sampler(cfg, ctx.sampler, "DDPO")
    ctx.load_state(stat_tracker=make_stat_tracker(cfg.advantage))
    # each epoch: sample and score, advantages, then `ppo_update` on every (sample, trained timestep) pair
    return advantage_epochs(ctx, ppo_update, n_train_steps=n_train_steps)


def trained_steps_per_sample(cfg) -> int:
    """Denoising steps each trajectory trains per inner epoch: `timestep_fraction` of the eligible steps (the SDE
    window, or else the first T − skip_final_steps)."""
    eligible = cfg.train.sde_window or cfg.sample.num_steps - cfg.train.skip_final_steps
    return setup.num_train_timesteps(eligible, cfg.train.timestep_fraction)


def ppo_update(ctx, *, traj, advantages, valid, n_train_steps: int, epoch: int) -> tuple[dict, bool]:
    """`num_inner_epochs` passes of PPO over this process's trajectories. Returns (epoch diagnostics, stop).

    Each pass shuffles the trajectories into micro-batches of `batch_size`; each micro-batch trains a random subset
    of `n_train_steps` denoising steps in random order (shared by the micro-batch's samples: the reference draws one
    per sample, which is the same thing at its default batch size of 1). An optimizer step follows every
    `optim.gradient_accumulation_steps` micro-batches, its gradient the mean over all their (sample, step) pairs.
    """
    tc: DDPOConfig = ctx.cfg.train
    rng, n_local = ctx.rng, len(traj)
    eligible = trainable_steps(traj, tc.skip_final_steps)
    update = ctx.policy_update(losses_per_micro_batch=n_train_steps, ratio_check=f"epoch {epoch}, first inner step")
    for _ in update.passes(tc.num_inner_epochs):
        order = rng.permutation(n_local)
        minibatches = [order[i: i + tc.batch_size] for i in range(0, n_local, tc.batch_size)]
        for idx in update.micro_batches(minibatches):  # an optimizer step every gradient_accumulation_steps
            mb = traj.select(torch.as_tensor(idx))
            mb_adv, mb_ok = advantages[idx], valid[idx]
            # a random subset of the eligible steps (all of them at timestep_fraction = 1), in random order
            steps = eligible[rng.permutation(len(eligible))[:n_train_steps]].tolist()
            for j in steps:
                with ctx.accelerator.autocast():
                    log_probs = ctx.sampler.log_prob(ctx.pipe, mb, j)  # [b], current weights, same CFG as rollout
                old_log_probs = mb.log_probs[:, j].to(log_probs.device)
                update.check_ratio(log_probs, old_log_probs)  # ratio exactly 1 until the first update
                if bool(mb_ok.any()):
                    update.backward(*ddpo_loss(log_probs[mb_ok], old_log_probs[mb_ok], mb_adv[mb_ok], tc.clip_range))
                else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                    update.backward(log_probs.sum() * 0.0)
    # DDPO has no reference-policy KL term; approx_kl is the KL between rollout and updated policy
    return update.stats(("loss", "kl", "approx_kl", "clipfrac", "ratio", "grad_norm"), kl=None), update.stopped


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer; `diffrl.config` calls it at load time (so `diffrl validate`
    reports them), and `train` again. Raises `UserError`."""
    check_ppo_config(cfg)
    check_stochastic(cfg, "DDPO")


def derived(cfg, num_processes: int) -> dict:
    """Global batch and optimizer steps per epoch (an epoch's samples in micro-batches of `train.batch_size`,
    `num_inner_epochs` times), and the denoising steps each trajectory trains."""
    out = minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size, passes=cfg.train.num_inner_epochs)
    out["train_timesteps_per_sample"] = trained_steps_per_sample(cfg)
    return out


def epoch_passes(cfg) -> dict:
    """The network passes one epoch's training makes per process (`diffrl bench train`'s floor): one guided UNet
    forward + backward of `train_batch` rows per trained (micro-batch, step), one AdamW step per optimizer step."""
    tc = cfg.train
    micro_batches = tc.num_inner_epochs * -(-cfg.sample.batch_size * cfg.sample.num_batches_per_epoch // tc.batch_size)
    return {"train_batch": tc.batch_size, "fwd_bwd": micro_batches * trained_steps_per_sample(cfg),
            "adam": micro_batches // cfg.optim.gradient_accumulation_steps}
