"""DDPO: PPO on the denoising steps of a diffusion model against a black-box reward (Black et al. 2023).

Paper: "Training Diffusion Models with Reinforcement Learning", https://arxiv.org/abs/2305.13301.

Each denoising step of a DDIM sampler with eta > 0 is a Gaussian policy π_θ(x_{t-1} | x_t, c). DDPO collects
trajectories with the current weights, scores the final images with a reward r(x_0, c), turns rewards into
advantages and runs PPO's clipped surrogate on every (sample, timestep) pair (the paper's DDPO_IS).

Code names -> paper notation:
    log_probs       log π_θ(x_{t-1} | x_t, c)   recomputed under the current weights (mean over latent dims)
    old_log_probs   log π_old(x_{t-1} | x_t, c) recorded at rollout time (the behaviour policy)
    ratio           ρ = π_θ / π_old = exp(log_probs - old_log_probs)
    advantages      Â = (r - μ_c) / σ_c, per-prompt statistics (or group / batch), clipped to ±adv_clip_max
    clip_range      ε of PPO's clip(ρ, 1 - ε, 1 + ε)

Log-probs are the MEAN over latent dimensions (as the reference code does), so ε = 1e-4 means what it means there.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from diffrl.errors import UserError
from diffrl.training.sde_window import check_sampler, check_steps_config, sde_window_etas, trainable_steps

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults are the reference implementation's (ddpo-pytorch, the configs of
# the published SD 1.x runs: 256 samples and 4 optimizer steps per epoch on 8 GPUs).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DDPOConfig:
    learning_rate: float = 3e-4  # AdamW step size (LoRA); the same on every process, not scaled by their number
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.999  # AdamW β2
    adam_weight_decay: float = 1e-4  # AdamW decoupled weight decay
    adam_epsilon: float = 1e-8  # AdamW ε
    lr_scheduler: str = "constant"  # diffusers.optimization.get_scheduler name (constant, linear, cosine, ...)
    lr_warmup_steps: int = 0  # optimizer steps of LR warm-up
    max_grad_norm: float = 1.0  # clip the global gradient norm (after the cross-process mean); <= 0: no clipping
    batch_size: int = 4  # trajectories per training minibatch, per process
    gradient_accumulation_steps: int = 2  # minibatches per optimizer step (each minibatch: all its trained steps)
    num_inner_epochs: int = 1  # passes over an epoch's samples (PPO epochs)
    timestep_fraction: float = 1.0  # fraction of each trajectory's T denoising steps trained (random subset)
    # never train the last N denoising steps: near t = 0 the step's std is tiny, so its log-prob gradient is large
    # and mostly noise about details a reward barely sees (the subset above is drawn from the first T - N steps)
    skip_final_steps: int = 0
    clip_range: float = 1e-4  # PPO ε for the per-step ratio (log-probs are means over latent dims)
    adv_clip_max: float = 5.0  # clip advantages to [-adv_clip_max, adv_clip_max]; <= 0: no clipping
    # per_prompt: running per-prompt mean/std (batch stats below stat_min_count); group: k samples per prompt,
    # GRPO-style; batch: whole-epoch mean/std; none: raw reward
    advantage: Literal["per_prompt", "group", "batch", "none"] = "per_prompt"
    stat_buffer_size: int = 16  # per_prompt: rewards kept per prompt (global, all processes' samples)
    stat_min_count: int = 16  # per_prompt: rewards a prompt needs before its own statistics are used
    group_size: int = 1  # samples per prompt drawn together in a sampling batch (must divide sample.batch_size)
    group_std: Literal["group", "global", "none"] = "group"  # group advantages: divide by group std / epoch std / 1
    # a group's samples start from the same x_T (DanceGRPO): the start noise decides much of a layout, so with it
    # shared, differences within a group come from the step noise the policy gradient credits
    shared_start_noise: bool = False
    # MixGRPO-style SDE window: only `sde_window` consecutive steps per trajectory are stochastic (sample.eta) and
    # trained, the others deterministic (η = 0); the window starts at a step drawn each epoch from
    # 0..sde_window_max_start. Far less noise per trajectory for the reward to be credited to, and training costs
    # W steps instead of T. 0 = every step stochastic (DDPO as published).
    sde_window: int = 0
    sde_window_max_start: int = 0
    use_ema: bool = False  # keep an EMA of the trainable weights (used for evaluation and exported weights)
    ema_decay: float = 0.9999  # EMA decay per optimizer step
    max_nan_steps: int = 3  # consecutive optimizer steps with a non-finite loss/gradient that stop the run
    logprob_check_atol: float = 1e-5  # warn when recomputed log-probs differ from the rollout's by more (nats/dim)
    keep_checkpoints: int = 0  # newest checkpoints kept in checkpoints/; 0 = keep all


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
    from diffrl.config import derived_numbers
    from diffrl.training import setup
    from diffrl.training.advantages import PerPromptStatTracker
    from diffrl.training.distributed import broadcast_parameters, prepare_policy
    from diffrl.training.guards import NanStepGuard, check_run_dir_writable
    from diffrl.training.loop import (
        reward_summary,
        run_evaluation,
        stop_run,
        training_grid,
        write_epoch_images,
    )
    from diffrl.training.metrics import (
        CurvePlotter,
        MetricsLogger,
        plot_reward_curve,
        read_metrics,
        truncate_metrics,
    )
    from diffrl.prompts import load_prompts
    from diffrl.training.rollout import collect_rollouts, compute_advantages, local_slice
    from diffrl.training.state import TrainState, load_checkpoint, resume_path, save_checkpoint
    from diffrl.training.weights import setup_policy_weights

    tc: DDPOConfig = cfg.train
    run_dir = Path(run_dir)
    resume = resume or bool(cfg.run.resume)
    check_run_dir_writable(run_dir)  # before anything slow: a bad output dir fails in seconds
    check_config(cfg)
    accelerator = setup.make_accelerator(cfg, run_dir, accelerator)
    setup.check_distributed_type(accelerator, "ddpo", use_ema=tc.use_ema)
    derived = derived_numbers(cfg, accelerator.num_processes)
    n_train_steps = trained_steps_per_sample(cfg)
    derived["train_timesteps_per_sample"] = n_train_steps
    if accelerator.is_main_process and not resume:
        setup.write_run_config(run_dir, cfg, derived)
    setup.print_derived(derived, accelerator)
    setup.seed_everything(cfg.run.seed, accelerator.process_index)

    # ---- policy, reward, prompts
    train_prompts = load_prompts(cfg.prompts.source)
    eval_prompts = load_prompts(cfg.prompts.eval_source or cfg.prompts.source)
    reward, gold = setup.build_reward(cfg), setup.build_gold_reward(cfg)
    pipe = setup.load_policy_pipeline(cfg, accelerator)
    sampler = setup.make_sampler(cfg.sample.sampler, pipe)
    check_sampler(cfg, sampler)
    check_atol = setup.logprob_check_atol(cfg, tc.logprob_check_atol, accelerator)
    unet = pipe.unet
    params = setup_policy_weights(unet, cfg.model, use_lora=not cfg.model.full_finetune)
    broadcast_parameters(params, accelerator)  # every process starts from rank 0's (randomly initialised) adapter
    optimizer = setup.make_optimizer(params, learning_rate=tc.learning_rate, betas=(tc.adam_beta1, tc.adam_beta2),
                                     weight_decay=tc.adam_weight_decay, eps=tc.adam_epsilon)
    # under FSDP2 this shards the UNet in place and `params` become its (DTensor) shards; DeepSpeed wraps it
    optimizer, params = prepare_policy(unet, params, optimizer, accelerator, micro_batch_size=tc.batch_size,
                                       backwards_per_step=n_train_steps * tc.gradient_accumulation_steps,
                                       max_grad_norm=tc.max_grad_norm)
    lr_scheduler = setup.make_lr_scheduler(optimizer, tc.lr_scheduler, warmup_steps=tc.lr_warmup_steps,
                                           total_steps=derived["total_optimizer_steps"])
    state = TrainState(
        trainer="ddpo", unet=unet, optimizer=optimizer, lr_scheduler=lr_scheduler,
        rng=setup.trainer_rng(cfg.run.seed, accelerator.process_index), use_lora=not cfg.model.full_finetune,
        ema=_make_ema(params, tc), stat_tracker=(
            PerPromptStatTracker(tc.stat_buffer_size, tc.stat_min_count) if tc.advantage == "per_prompt" else None),
    )
    history: list[dict] = []  # this run's epoch records so far (main process), for the reward curve
    if resume:
        load_checkpoint(resume_path(run_dir, cfg.run.resume), state, accelerator=accelerator)
        if accelerator.is_main_process:
            truncate_metrics(run_dir, state.epoch)
            history = read_metrics(run_dir)
            print(f"resuming after epoch {state.epoch} (optimizer step {state.global_step})", flush=True)
    logger = MetricsLogger(run_dir, accelerator) if accelerator.is_main_process else None
    curve = CurvePlotter(run_dir)
    if accelerator.log_with:
        accelerator.init_trackers(run_dir.name, config={"trainer": "ddpo", **derived})
    nan_guard = NanStepGuard(tc.max_nan_steps)
    keep_images = -(-cfg.log.grid_images // accelerator.num_processes) if cfg.log.image_every else 0
    eval_kwargs = {"pipe": pipe, "sampler": sampler, "reward": reward, "gold": gold, "prompts": eval_prompts,
                   "accelerator": accelerator, "run_dir": run_dir}
    if step_callback is not None:  # once before any update, so callers see the starting weights
        step_callback({"global_step": state.global_step, "epoch": state.epoch, "params": params, "unet": unet,
                       "pipe": pipe, "accelerator": accelerator})
    record: dict = {}
    progress = _progress(accelerator, start=state.epoch + 1, total=cfg.run.num_epochs)

    for epoch in range(state.epoch + 1, cfg.run.num_epochs):
        epoch_start, epoch_cpu_start = time.perf_counter(), time.process_time()
        record = {"epoch": epoch}

        # ---- 1. evaluate the policy that is about to sample this epoch
        if cfg.run.eval_every and epoch % cfg.run.eval_every == 0:
            record.update(run_evaluation(cfg, state, epoch=epoch, **eval_kwargs))

        # ---- 2. sample trajectories with the current weights and score them
        unet.eval()
        etas = sde_window_etas(cfg, state.rng)
        rollout = collect_rollouts(pipe=pipe, sampler=sampler, reward=reward, prompts=train_prompts,
                                   sample_cfg=cfg.sample, group_size=tc.group_size, rng=state.rng,
                                   accelerator=accelerator, keep_images=keep_images,
                                   shared_start_noise=tc.shared_start_noise, eta=etas)
        if not rollout.finite.any():
            stop_run(run_dir, state, pipe=pipe, accelerator=accelerator, keep=tc.keep_checkpoints,
                     reason=f"all {len(rollout.all_rewards)} rewards of the epoch are NaN/inf; check the reward")
        state.samples_seen += len(rollout.all_rewards)
        state.nan_rewards_total += int((~rollout.finite).sum())

        # ---- 3. advantages over every process's samples, then this process's slice
        advantages = compute_advantages(rollout, mode=tc.advantage, stat_tracker=state.stat_tracker,
                                        group_std=tc.group_std, adv_clip_max=tc.adv_clip_max)
        mine = local_slice(accelerator, len(rollout.traj))
        traj = rollout.traj.to(accelerator.device)
        local_adv = torch.as_tensor(advantages[mine], dtype=torch.float32, device=accelerator.device)
        local_ok = torch.as_tensor(rollout.finite[mine], device=accelerator.device)

        # ---- 4. PPO updates on every (sample, trained timestep) pair
        train_start = time.perf_counter()
        unet.train()
        stats, stop = ppo_update(pipe=pipe, sampler=sampler, traj=traj, advantages=local_adv, valid=local_ok,
                                 params=params, state=state, tc=tc, accelerator=accelerator,
                                 n_train_steps=n_train_steps, nan_guard=nan_guard, epoch=epoch,
                                 step_callback=step_callback, check_atol=check_atol)
        unet.eval()
        train_s = time.perf_counter() - train_start
        if stop:
            stop_run(run_dir, state, pipe=pipe, accelerator=accelerator, keep=tc.keep_checkpoints,
                     reason=f"{nan_guard.consecutive} optimizer steps in a row had a NaN/inf loss or gradient "
                            "(lower train.learning_rate, check the reward's scale)")
        state.epoch = epoch

        # ---- 5. log, checkpoint
        record.update(
            samples_seen=state.samples_seen, global_step=state.global_step, **reward_summary(rollout), **stats,
            lr=state.lr_scheduler.get_last_lr()[0], rollout_s=rollout.rollout_s, reward_s=rollout.reward_s,
            train_s=train_s,
        )
        if state.stat_tracker is not None:
            record["stat_tracker_prompts"] = state.stat_tracker.stats()["num_prompts"]
        grid = training_grid(accelerator, rollout, cfg.log.grid_images) if keep_images else None
        if accelerator.is_main_process:
            write_epoch_images(cfg, run_dir, curve, history, record, grid, epoch)
        if epoch == cfg.run.num_epochs - 1 or (cfg.run.save_every and (epoch + 1) % cfg.run.save_every == 0):
            save_checkpoint(run_dir, state, pipe=pipe, accelerator=accelerator, keep=tc.keep_checkpoints)
        record["wall_s"] = time.perf_counter() - epoch_start  # everything of the epoch: images and checkpoint too
        record["cpu_s"] = time.process_time() - epoch_cpu_start  # this process's CPU time (all its threads)
        if accelerator.is_main_process:
            logger.log(record)
            history.append(record)
            progress.update(1)
            progress.set_postfix(reward=f"{record['reward_mean']:.4g}", loss=f"{record.get('loss', float('nan')):.3g}")

    # ---- the finished model, evaluated like every other epoch (the record of "epoch num_epochs")
    progress.close()
    final = dict(record)
    if cfg.run.eval_every:
        final_eval = run_evaluation(cfg, state, epoch=cfg.run.num_epochs, final=True, **eval_kwargs)
        final.update(final_eval)
        if accelerator.is_main_process:
            logger.log({"epoch": cfg.run.num_epochs, "samples_seen": state.samples_seen,
                        "global_step": state.global_step, "final": True, **final_eval})
    if accelerator.is_main_process:
        curve.wait()
        plot_reward_curve(run_dir)  # with the final evaluation
    accelerator.end_training()
    return final


def trained_steps_per_sample(cfg) -> int:
    """Denoising steps each trajectory trains per inner epoch: `timestep_fraction` of the eligible steps (the SDE
    window, or else the first T − skip_final_steps)."""
    from diffrl.training import setup

    eligible = cfg.train.sde_window or cfg.sample.num_steps - cfg.train.skip_final_steps
    return setup.num_train_timesteps(eligible, cfg.train.timestep_fraction)


def ppo_update(*, pipe, sampler, traj, advantages, valid, params, state, tc: DDPOConfig, accelerator,
               n_train_steps: int, nan_guard, epoch: int, step_callback, check_atol: float) -> tuple[dict, bool]:
    """`num_inner_epochs` passes of PPO over this process's trajectories. Returns (epoch diagnostics, stop).

    Each pass shuffles the trajectories into minibatches of `batch_size`; each minibatch trains a random subset of
    `n_train_steps` denoising steps in random order (shared by the minibatch's samples: the reference draws one per
    sample, which is the same thing at its default batch size of 1). An optimizer step follows every
    `gradient_accumulation_steps` minibatches, its gradient the mean over all their (sample, step) pairs.
    """
    from diffrl.training.distributed import policy_backward
    from diffrl.training.loop import RunningMean, optimizer_step
    from samplers.base import warn_if_log_probs_differ

    n_local = len(traj)
    eligible = trainable_steps(traj, tc.skip_final_steps)
    diag = RunningMean()
    first_update_done, first_ratios, max_diff = False, [], 0.0
    steps_skipped = 0
    for _ in range(tc.num_inner_epochs):
        order = state.rng.permutation(n_local)
        minibatches = [order[i: i + tc.batch_size] for i in range(0, n_local, tc.batch_size)]
        losses_finite = True
        for mb_index, idx in enumerate(minibatches):
            mb = traj.select(torch.as_tensor(idx))
            mb_adv, mb_ok = advantages[idx], valid[idx]
            # a random subset of the eligible steps (all of them at timestep_fraction = 1), in random order
            steps = eligible[state.rng.permutation(len(eligible))[:n_train_steps]].tolist()
            step_ends = (mb_index + 1) % tc.gradient_accumulation_steps == 0
            for k, j in enumerate(steps):
                with accelerator.autocast():
                    log_probs = sampler.log_prob(pipe, mb, j)  # [b], under the current weights, same CFG as rollout
                old_log_probs = mb.log_probs[:, j].to(log_probs.device)
                if not first_update_done:  # the weights have not moved yet this epoch: ratio must be exactly 1
                    diff = (log_probs.detach() - old_log_probs).abs().max().item()
                    if not first_ratios:
                        warn_if_log_probs_differ(log_probs, old_log_probs, atol=check_atol,
                                                 where=f"epoch {epoch}, first inner step")
                    max_diff = max(max_diff, diff)
                    first_ratios.append(torch.exp(log_probs.detach() - old_log_probs).mean().item())
                if bool(mb_ok.any()):
                    loss, stats = ddpo_loss(log_probs[mb_ok], old_log_probs[mb_ok], mb_adv[mb_ok], tc.clip_range)
                    diag.add({"loss": loss.detach(), **stats})
                else:  # every sample's reward was NaN: keep the backward (all processes must match), no gradient
                    loss = log_probs.sum() * 0.0
                losses_finite &= bool(torch.isfinite(loss.detach()))
                policy_backward(loss / (n_train_steps * tc.gradient_accumulation_steps), accelerator,
                                last=step_ends and k == len(steps) - 1)
            if step_ends:
                stepped, grad_norm, stop = optimizer_step(params, state, accelerator=accelerator,
                                                          max_grad_norm=tc.max_grad_norm, nan_guard=nan_guard,
                                                          losses_finite=losses_finite)
                first_update_done = True
                losses_finite = True
                steps_skipped += not stepped
                diag.add({"grad_norm": grad_norm})
                if stepped and step_callback is not None:
                    step_callback({"global_step": state.global_step, "epoch": epoch, "params": params,
                                   "unet": state.unet, "pipe": pipe, "accelerator": accelerator})
                if stop:
                    return _epoch_stats(diag, first_ratios, max_diff, steps_skipped), True
    return _epoch_stats(diag, first_ratios, max_diff, steps_skipped), False


def _epoch_stats(diag, first_ratios, max_diff, steps_skipped) -> dict:
    means = diag.means()
    return {
        "loss": means.get("loss", float("nan")),
        "kl": None,  # DDPO has no reference-policy KL term; approx_kl is the KL between rollout and updated policy
        "approx_kl": means.get("approx_kl", float("nan")),
        "clipfrac": means.get("clipfrac", float("nan")),
        "ratio": means.get("ratio", float("nan")),
        "grad_norm": means.get("grad_norm", float("nan")),
        "ratio_first_step": float(np.mean(first_ratios)) if first_ratios else float("nan"),
        "logprob_max_diff": max_diff,
        "nan_losses": steps_skipped,
    }


def _make_ema(params, tc: DDPOConfig):
    if not tc.use_ema:
        return None
    from diffusers.training_utils import EMAModel

    return EMAModel(params, decay=tc.ema_decay)


def check_config(cfg) -> None:
    """Cross-field checks of a recipe for this trainer; `diffrl.config` calls it at load time (so `diffrl validate`
    reports them), and `train` again. Raises `UserError`."""
    tc: DDPOConfig = cfg.train
    if tc.advantage == "group" and tc.group_size < 2:
        raise UserError("train.advantage=group needs train.group_size >= 2 (samples per prompt to compare)")
    if cfg.sample.batch_size % tc.group_size:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be a multiple of train.group_size "
                        f"({tc.group_size}): a group's samples are drawn in the same batch")
    if tc.shared_start_noise and tc.group_size < 2:
        raise UserError("train.shared_start_noise needs groups to share within: set train.group_size >= 2")
    if tc.batch_size < 1 or tc.gradient_accumulation_steps < 1 or tc.num_inner_epochs < 1:
        raise UserError("train.batch_size, train.gradient_accumulation_steps and train.num_inner_epochs must be >= 1")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    check_steps_config(cfg)
    if tc.clip_range <= 0 or not math.isfinite(tc.clip_range):
        raise UserError(f"train.clip_range must be > 0, got {tc.clip_range}")
    if cfg.sample.eta <= 0 and cfg.sample.sampler != "lcm":
        raise UserError(f"sample.eta={cfg.sample.eta} makes every denoising step deterministic (no policy to "
                        "optimise); DDPO samples with eta=1.0")


def _progress(accelerator, *, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="ddpo epochs", disable=not accelerator.is_main_process,
                dynamic_ncols=True)
