"""DPOK: policy gradient with a per-step KL to the pre-trained model, against a black-box reward (Fan et al. 2023).

Paper: "DPOK: Reinforcement Learning for Fine-tuning Text-to-Image Diffusion Models",
https://arxiv.org/abs/2305.16381.

The denoising chain is an MDP whose step policy is Gaussian (DDIM, eta > 0). DPOK maximises
`E[r(x_0, c)] - β · KL(p_θ(x_{0:T} | c) ‖ p_pre(x_{0:T} | c))`, bounding the trajectory KL by the sum of per-step
KLs between the fine-tuned and pre-trained step policies (the paper's KL upper bound). With a shared step std σ_t the
per-step KL is closed form in the difference of the two means:

    KL_t = ‖μ_θ(x_t, c, t) - μ_pre(x_t, c, t)‖² / (2 σ_t²)

Code names -> paper notation:
    log_probs        log p_θ(x_{t-1} | x_t, c)       under the current weights, mean over latent dims
    old_log_probs    log p_θ_old(x_{t-1} | x_t, c)   recorded at sampling time
    ratio            p_θ / p_θ_old, clamped to [1 - ratio_clip, 1 + ratio_clip]   (the importance weight)
    advantages       r(x_0, c) - V(x_t, c, t)  with the learned value baseline, else the (normalised) reward
    kl               KL_t above, averaged over latent dims (the same convention as the log-probs)
    reward_weight    α (weight on the reward term);  kl_weight  β
    mean_ref         μ_pre: the same UNet with its LoRA adapter disabled (no second copy in memory)

Differences from the reference code (google-research/dpok), on purpose:
- the KL is the closed-form Gaussian KL above; the reference penalises mean((ε_θ − ε_ref)²), which differs by a
  per-timestep factor, so its `kl_weight` values do not carry over unchanged;
- policy and value steps draw (trajectory, step) pairs from the current epoch's trajectories only, not from a
  replay buffer of earlier rounds: with the ratio clamped at 1 ± 1e-4, pairs from older policies fall outside the
  clamp and contribute no reward gradient anyway;
- each policy minibatch shares one denoising step (the UNet runs once per minibatch), and the value network sees
  the pipeline's own prompt embeddings (mean over tokens) instead of a separate CLIP text model.
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
# Config (the recipe's `train:` group). Defaults are the reference implementation's (google-research/dpok,
# train_online_pg.py argument defaults).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DPOKConfig:
    learning_rate: float = 1e-5  # AdamW step size of the policy (LoRA); not scaled by the number of processes
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.999  # AdamW β2
    adam_weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_epsilon: float = 1e-8  # AdamW ε
    lr_scheduler: str = "constant"  # diffusers.optimization.get_scheduler name
    lr_warmup_steps: int = 0  # optimizer steps of LR warm-up
    max_grad_norm: float = 0.1  # clip the policy's global gradient norm (after the cross-process mean); <= 0: off
    policy_batch_size: int = 2  # (trajectory, step) pairs per policy minibatch, per process (p_batch_size)
    gradient_accumulation_steps: int = 12  # policy minibatches per optimizer step
    policy_steps: int = 5  # policy optimizer steps per epoch (p_step)
    reward_weight: float = 100.0  # α, weight of the reward term
    kl_weight: float = 0.01  # β, weight of the per-step KL to the pre-trained model (KL in nats per latent dim)
    ratio_clip: float = 1e-4  # ε: the importance ratio is clamped to [1 - ε, 1 + ε]
    # never train the last N denoising steps (policy, KL or value): their tiny std makes the score term mostly noise
    # (`diffrl bench gradient`: the second-to-last of 10 steps carries most of the policy gradient's variance)
    skip_final_steps: int = 0
    # MixGRPO-style SDE window (`diffrl.training.sde_window`): only `sde_window` consecutive steps are stochastic and trained,
    # starting at a step drawn each epoch from 0..sde_window_max_start; 0 = every step stochastic (DPOK as published)
    sde_window: int = 0
    sde_window_max_start: int = 0
    # what A is built from before the value baseline is subtracted: none = raw reward (reference), batch = epoch
    # mean/std, per_prompt = running per-prompt stats, group = k samples per prompt
    advantage: Literal["none", "batch", "per_prompt", "group"] = "none"
    adv_clip_max: float = 0.0  # clip advantages to ±this; <= 0: no clipping (reference)
    stat_buffer_size: int = 16  # per_prompt: rewards kept per prompt
    stat_min_count: int = 16  # per_prompt: rewards needed before a prompt's own statistics are used
    group_size: int = 1  # samples per prompt drawn together in a sampling batch
    group_std: Literal["group", "global", "none"] = "group"  # group advantages: divide by group / epoch std / 1
    value_baseline: bool = True  # learn V(x_t, c, t) and use A = r - V (reference v_flag=1)
    value_learning_rate: float = 1e-4  # AdamW step size of the value network
    value_batch_size: int = 256  # (trajectory, step) pairs per value step, per process
    value_steps: int = 5  # value optimizer steps per epoch (before the policy steps)
    use_ema: bool = False  # keep an EMA of the trainable weights (used for evaluation and exported weights)
    ema_decay: float = 0.9999  # EMA decay per optimizer step
    max_nan_steps: int = 3  # consecutive optimizer steps with a non-finite loss/gradient that stop the run
    logprob_check_atol: float = 1e-5  # warn when recomputed log-probs differ from the rollout's by more (nats/dim)
    keep_checkpoints: int = 0  # newest checkpoints kept in checkpoints/; 0 = keep all

    def derived_numbers(self, cfg, num_processes: int) -> dict:
        """DPOK's optimizer steps per epoch are set directly (policy_steps), not by the number of samples."""
        per_step = self.policy_batch_size * self.gradient_accumulation_steps
        return {
            "global_train_batch": per_step * num_processes,  # (trajectory, step) pairs per optimizer step
            "optimizer_steps_per_epoch": self.policy_steps,
            "total_optimizer_steps": self.policy_steps * cfg.run.num_epochs,
        }


TrainConfig = DPOKConfig

# ---------------------------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------------------------


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Per-sample KL(N(mean, std²I) ‖ N(mean_ref, std²I)), averaged over the non-batch dims.

    Both step policies share the variance (it comes from the noise schedule, not the network), so the KL is
    `(mean - mean_ref)² / (2 std²)` per dimension. Averaging over dims (rather than summing) matches the
    log-prob convention, so `kl_weight` keeps the same meaning across image sizes. The DPOK reference code
    penalises `mean((ε_θ - ε_ref)²)` instead; since a DDIM mean is affine in ε̂ (μ = a·x_t + c_t·ε̂), that is
    this KL times 2σ_t²/c_t², a per-timestep factor, so published `kl_weight` values do not carry over as is.

    Args:
        mean (`torch.Tensor` of shape `[B, ...]`): mean of the policy step (carries the gradient).
        mean_ref (`torch.Tensor` of shape `[B, ...]`): mean of the reference step.
        std (`torch.Tensor` broadcastable to `mean`, or `float`): the shared standard deviation σ_t (> 0).

    Returns:
        `torch.Tensor` of shape `[B]`.
    """
    per_dim = (mean - mean_ref) ** 2 / (2 * torch.as_tensor(std, dtype=mean.dtype, device=mean.device) ** 2)
    return per_dim.flatten(1).mean(dim=1)


def dpok_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    kl: torch.Tensor,
    *,
    reward_weight: float,
    kl_weight: float,
    ratio_clip: float,
) -> tuple[torch.Tensor, dict]:
    """DPOK's per-step loss: `mean(-α · A · clamp(ρ, 1 - ε, 1 + ε) + β · KL_t)`.

    Unlike PPO's min/max, DPOK clamps the importance ratio itself: once ρ leaves [1 - ε, 1 + ε] that sample's
    reward term stops contributing gradient, which bounds how far a batch can move the policy.

    Args:
        log_probs (`torch.Tensor` of shape `[B]`): log-probs under the current weights.
        old_log_probs (`torch.Tensor` of shape `[B]`): log-probs recorded at sampling time.
        advantages (`torch.Tensor` of shape `[B]`): `r - V` or the normalised reward.
        kl (`torch.Tensor` of shape `[B]`): per-step KL to the pre-trained policy (carries the gradient).
        reward_weight (`float`): α.
        kl_weight (`float`): β.
        ratio_clip (`float`): ε.

    Returns:
        `(loss, stats)` with detached `policy_loss`, `kl`, `ratio` (mean clamped ρ), `approx_kl`, `clipfrac`.
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clamped = torch.clamp(ratio, 1.0 - ratio_clip, 1.0 + ratio_clip)
    policy_term = -reward_weight * advantages * clamped
    loss = (policy_term + kl_weight * kl).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": policy_term.double().mean(),
            "kl": kl.double().mean(),
            "ratio": ratio.double().mean(),
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > ratio_clip).double().mean(),
        }
    return loss, stats


def value_loss(values: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the value baseline V(x_t, c, t) against the final reward."""
    return torch.nn.functional.mse_loss(values.float(), rewards.float())


def step_kl_to_reference(pipe, sampler, traj, step_index: int):
    """Recompute step `step_index` of `traj` under the current weights and its per-step KL to the pre-trained model.

    The pre-trained step policy is the same UNet with its LoRA adapter disabled (no second copy in memory), run on
    the same x_t, conditioning and guidance. The policy step keeps the caller's grad mode; the reference runs
    without gradient.

    Args:
        pipe: the pipeline whose `unet` carries the LoRA adapter.
        sampler: the step policy that sampled `traj` (`sampler.log_prob(..., return_step=True)`).
        traj (`Trajectory`): the trajectories (any number of samples).
        step_index (`int`): which denoising step (0-based, sampling order).

    Returns:
        `(step, kl)`: the policy's `StepOutput` and `KL_t` `[B]` (`gaussian_kl`, per latent dim; zeros on a
        deterministic step, where there is no policy to regularise).
    """
    from diffrl.training.weights import adapter_disabled

    step = sampler.log_prob(pipe, traj, step_index, return_step=True)
    with torch.no_grad(), adapter_disabled(pipe.unet):
        step_ref = sampler.log_prob(pipe, traj, step_index, return_step=True)
    if float(step.std) > 0:
        kl = gaussian_kl(step.mean, step_ref.mean, step.std)
    else:  # a deterministic step (σ = 0) is a point mass on its mean
        kl = 0.0 * step.mean.flatten(1).mean(dim=1)
    return step, kl


# ---------------------------------------------------------------------------------------------------------------
# Value baseline
# ---------------------------------------------------------------------------------------------------------------


class ValueNet(torch.nn.Module):
    """V(x_t, c, t): the expected final reward given the latents at a step, the prompt and the timestep.

    A small CNN over the latents, a linear map of the mean-pooled text embedding and a sinusoidal timestep
    embedding, concatenated into an MLP. It only has to reduce the variance of the policy gradient, so it is kept
    tiny (a few hundred thousand weights at SD size) and trained with its own AdamW.

    Args:
        latent_channels (`int`): C of the latents.
        text_dim (`int`): D of `prompt_embeds` (the UNet's cross-attention width).
        width (`int`, *optional*, defaults to 64): hidden width.
    """

    def __init__(self, latent_channels: int, text_dim: int, width: int = 64):
        super().__init__()
        self.width = width
        self.image = torch.nn.Sequential(
            torch.nn.Conv2d(latent_channels, width, 3, padding=1), torch.nn.SiLU(),
            torch.nn.Conv2d(width, width, 3, stride=2, padding=1), torch.nn.SiLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        )
        self.text = torch.nn.Linear(text_dim, width)
        self.time = torch.nn.Linear(width, width)
        self.head = torch.nn.Sequential(torch.nn.Linear(3 * width, width), torch.nn.SiLU(), torch.nn.Linear(width, 1))

    def forward(self, latents: torch.Tensor, text: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        half = self.width // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=latents.device) / half)
        angles = timesteps.float()[:, None] * freqs[None]
        time = torch.cat([angles.sin(), angles.cos()], dim=1)
        features = torch.cat([self.image(latents.float()), self.text(text.float()), self.time(time)], dim=1)
        return self.head(features).squeeze(1)


def pooled_text(traj) -> torch.Tensor:
    """`[B, D]`: the prompt embeddings averaged over tokens (the value network's view of the prompt)."""
    return traj.prompt_embeds.float().mean(dim=1)


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with DPOK against `cfg.reward`; write the run dir; return the final metrics.

    Args:
        cfg (`RunConfig`): the resolved recipe (`cfg.train` is a `DPOKConfig`).
        run_dir (`Path`): the run dir (created if needed; must be writable).
        resume (`bool`, *optional*, defaults to `False`): continue from the newest checkpoint in `run_dir` (or
            from `cfg.run.resume` when that names one), exactly where it stopped.
        accelerator (`accelerate.Accelerator`, *optional*): defaults to one built from the config.
        step_callback (`Callable`, *optional*): called once before training and after every policy optimizer
            step with a dict (`global_step`, `epoch`, `params`, `unet`, `pipe`, `accelerator`).

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

    tc: DPOKConfig = cfg.train
    run_dir = Path(run_dir)
    resume = resume or bool(cfg.run.resume)
    check_run_dir_writable(run_dir)  # before anything slow: a bad output dir fails in seconds
    check_config(cfg)
    accelerator = setup.make_accelerator(cfg, run_dir, accelerator)
    setup.check_distributed_type(accelerator, "dpok", use_ema=tc.use_ema)
    derived = derived_numbers(cfg, accelerator.num_processes)
    if accelerator.is_main_process and not resume:
        setup.write_run_config(run_dir, cfg, derived)
    setup.print_derived(derived, accelerator)
    setup.seed_everything(cfg.run.seed, accelerator.process_index)

    # ---- policy (LoRA on the UNet; the reference policy is the same UNet with the adapter off), value net
    train_prompts = load_prompts(cfg.prompts.source)
    eval_prompts = load_prompts(cfg.prompts.eval_source or cfg.prompts.source)
    reward, gold = setup.build_reward(cfg), setup.build_gold_reward(cfg)
    pipe = setup.load_policy_pipeline(cfg, accelerator)
    sampler = setup.make_sampler(cfg.sample.sampler, pipe)
    check_sampler(cfg, sampler)
    check_atol = setup.logprob_check_atol(cfg, tc.logprob_check_atol, accelerator)
    unet = pipe.unet
    params = setup_policy_weights(unet, cfg.model, use_lora=True)
    broadcast_parameters(params, accelerator)  # every process starts from rank 0's (randomly initialised) adapter
    optimizer = setup.make_optimizer(params, learning_rate=tc.learning_rate, betas=(tc.adam_beta1, tc.adam_beta2),
                                     weight_decay=tc.adam_weight_decay, eps=tc.adam_epsilon)
    # under FSDP2 this shards the UNet in place and `params` become its (DTensor) shards
    optimizer, params = prepare_policy(unet, params, optimizer, accelerator, micro_batch_size=tc.policy_batch_size,
                                       backwards_per_step=tc.gradient_accumulation_steps,
                                       max_grad_norm=tc.max_grad_norm)
    lr_scheduler = setup.make_lr_scheduler(optimizer, tc.lr_scheduler, warmup_steps=tc.lr_warmup_steps,
                                           total_steps=derived["total_optimizer_steps"])
    extra_modules, extra_optimizers, value_net, value_optimizer = {}, {}, None, None
    if tc.value_baseline:
        value_net = ValueNet(unet.config.in_channels, unet.config.cross_attention_dim).to(accelerator.device)
        broadcast_parameters(list(value_net.parameters()), accelerator)
        value_optimizer = torch.optim.AdamW(value_net.parameters(), lr=tc.value_learning_rate)
        extra_modules["value_net"], extra_optimizers["value_net"] = value_net, value_optimizer
    state = TrainState(
        trainer="dpok", unet=unet, optimizer=optimizer, lr_scheduler=lr_scheduler,
        rng=setup.trainer_rng(cfg.run.seed, accelerator.process_index), use_lora=True,
        ema=_make_ema(params, tc), extra_modules=extra_modules, extra_optimizers=extra_optimizers,
        stat_tracker=(
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
        accelerator.init_trackers(run_dir.name, config={"trainer": "dpok", **derived})
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
        rollout = collect_rollouts(pipe=pipe, sampler=sampler, reward=reward, prompts=train_prompts,
                                   sample_cfg=cfg.sample, group_size=tc.group_size, rng=state.rng,
                                   accelerator=accelerator, keep_images=keep_images, eta=sde_window_etas(cfg, state.rng))
        if not rollout.finite.any():
            stop_run(run_dir, state, pipe=pipe, accelerator=accelerator, keep=tc.keep_checkpoints,
                     reason=f"all {len(rollout.all_rewards)} rewards of the epoch are NaN/inf; check the reward")
        state.samples_seen += len(rollout.all_rewards)
        state.nan_rewards_total += int((~rollout.finite).sum())

        # ---- 3. returns (the reward, optionally normalised) of every process's samples; this process's slice
        returns = compute_advantages(rollout, mode=tc.advantage, stat_tracker=state.stat_tracker,
                                     group_std=tc.group_std, adv_clip_max=0.0)
        mine = local_slice(accelerator, len(rollout.traj))
        traj = rollout.traj.to(accelerator.device)
        local_returns = torch.as_tensor(returns[mine], dtype=torch.float32, device=accelerator.device)
        local_ok = torch.as_tensor(rollout.finite[mine], device=accelerator.device)

        # ---- 4. fit the value baseline V(x_t, c, t) to the returns, then the KL-regularised policy steps
        train_start = time.perf_counter()
        stats = {}
        if value_net is not None:
            stats["value_loss"] = fit_value(value_net, value_optimizer, traj=traj, returns=local_returns,
                                            valid=local_ok, tc=tc, rng=state.rng, accelerator=accelerator)
        unet.train()
        policy_stats, stop = policy_update(pipe=pipe, sampler=sampler, traj=traj, returns=local_returns,
                                           valid=local_ok, value_net=value_net, params=params, state=state, tc=tc,
                                           accelerator=accelerator, nan_guard=nan_guard, epoch=epoch,
                                           step_callback=step_callback, check_atol=check_atol)
        stats.update(policy_stats)
        unet.eval()
        train_s = time.perf_counter() - train_start
        if stop:
            stop_run(run_dir, state, pipe=pipe, accelerator=accelerator, keep=tc.keep_checkpoints,
                     reason=f"{nan_guard.consecutive} optimizer steps in a row had a NaN/inf loss or gradient "
                            "(lower train.learning_rate or train.reward_weight, check the reward's scale)")
        state.epoch = epoch

        # ---- 5. log, checkpoint
        record.update(
            samples_seen=state.samples_seen, global_step=state.global_step, **reward_summary(rollout), **stats,
            lr=state.lr_scheduler.get_last_lr()[0], rollout_s=rollout.rollout_s, reward_s=rollout.reward_s,
            train_s=train_s,
        )
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
            progress.set_postfix(reward=f"{record['reward_mean']:.4g}", kl=f"{record.get('kl', float('nan')):.3g}")

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


def _draw_pairs(rng: np.random.Generator, n_samples: int, steps: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """`count` trajectories (without replacement when there are enough) and one denoising step of `steps` (the
    trainable ones) for all of them."""
    idx = rng.choice(n_samples, size=count, replace=count > n_samples)
    return idx, int(steps[rng.integers(len(steps))])


def fit_value(value_net, value_optimizer, *, traj, returns, valid, tc: DPOKConfig, rng, accelerator) -> float:
    """`value_steps` AdamW steps of MSE between V(x_t, c, t) and the returns, on random (trajectory, step) pairs."""
    from diffrl.training.distributed import all_reduce_gradients

    text = pooled_text(traj)
    eligible = trainable_steps(traj, tc.skip_final_steps)
    losses = []
    value_net.train()
    for _ in range(tc.value_steps):
        idx = rng.choice(len(traj), size=tc.value_batch_size, replace=True)
        steps = eligible[rng.integers(len(eligible), size=tc.value_batch_size)]
        idx_t, steps_t = torch.as_tensor(idx), torch.as_tensor(steps)
        latents = traj.latents[idx_t.to(traj.latents.device), steps_t.to(traj.latents.device)]
        values = value_net(latents, text[idx_t.to(text.device)], traj.timesteps[steps_t].to(latents.device))
        ok = valid[idx_t.to(valid.device)].float()
        target = torch.where(ok > 0, returns[idx_t.to(returns.device)], torch.zeros_like(values))
        loss = (ok * (values - target) ** 2).sum() / ok.sum().clamp(min=1.0)  # NaN-reward samples weigh 0
        loss.backward()
        all_reduce_gradients(list(value_net.parameters()), accelerator)
        value_optimizer.step()
        value_optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    value_net.eval()
    return float(np.mean(losses)) if losses else float("nan")


def policy_update(*, pipe, sampler, traj, returns, valid, value_net, params, state, tc: DPOKConfig, accelerator,
                  nan_guard, epoch: int, step_callback, check_atol: float) -> tuple[dict, bool]:
    """`policy_steps` optimizer steps of the DPOK loss on random (trajectory, step) pairs. Returns (stats, stop)."""
    from diffrl.training.distributed import policy_backward
    from diffrl.training.loop import RunningMean, optimizer_step
    from samplers.base import warn_if_log_probs_differ

    diag = RunningMean()
    text = pooled_text(traj) if value_net is not None else None
    first_ratios, max_diff, steps_skipped = [], 0.0, 0
    eligible = trainable_steps(traj, tc.skip_final_steps)
    for step_index in range(tc.policy_steps):
        losses_finite = True
        for micro in range(tc.gradient_accumulation_steps):
            idx, j = _draw_pairs(state.rng, len(traj), eligible, tc.policy_batch_size)
            mb = traj.select(torch.as_tensor(idx))
            with accelerator.autocast():  # the current policy (with graph) and its KL to the pre-trained one
                step, kl = step_kl_to_reference(pipe, sampler, mb, j)
            old_log_probs = mb.log_probs[:, j].to(step.log_prob.device)
            if step_index == 0:  # no update yet this epoch: the recomputed log-prob must equal the rollout's
                if not first_ratios:
                    warn_if_log_probs_differ(step.log_prob, old_log_probs, atol=check_atol,
                                             where=f"epoch {epoch}, first policy step")
                max_diff = max(max_diff, (step.log_prob.detach() - old_log_probs).abs().max().item())
                first_ratios.append(torch.exp(step.log_prob.detach() - old_log_probs).mean().item())
            idx_t = torch.as_tensor(idx, device=returns.device)
            advantages = returns[idx_t]
            if value_net is not None:
                with torch.no_grad():
                    t = traj.timesteps[j].repeat(len(idx)).to(mb.latents.device)
                    advantages = advantages - value_net(mb.latents[:, j], text[idx_t.to(text.device)], t)
            if tc.adv_clip_max > 0:
                advantages = advantages.clamp(-tc.adv_clip_max, tc.adv_clip_max)
            ok = valid[idx_t]
            if bool(ok.any()):
                loss, stats = dpok_loss(step.log_prob[ok], old_log_probs[ok], advantages[ok], kl[ok],
                                        reward_weight=tc.reward_weight, kl_weight=tc.kl_weight,
                                        ratio_clip=tc.ratio_clip)
                diag.add({"loss": loss.detach(), **stats})
            else:  # every drawn sample's reward was NaN: keep the backward (all processes must match), no gradient
                loss = step.log_prob.sum() * 0.0
            losses_finite &= bool(torch.isfinite(loss.detach()))
            policy_backward(loss / tc.gradient_accumulation_steps, accelerator,
                            last=micro == tc.gradient_accumulation_steps - 1)
        stepped, grad_norm, stop = optimizer_step(params, state, accelerator=accelerator,
                                                  max_grad_norm=tc.max_grad_norm, nan_guard=nan_guard,
                                                  losses_finite=losses_finite)
        steps_skipped += not stepped
        diag.add({"grad_norm": grad_norm})
        if stepped and step_callback is not None:
            step_callback({"global_step": state.global_step, "epoch": epoch, "params": params,
                           "unet": state.unet, "pipe": pipe, "accelerator": accelerator})
        if stop:
            break
    means = diag.means()
    return {
        "loss": means.get("loss", float("nan")),
        "kl": means.get("kl", float("nan")),
        "policy_loss": means.get("policy_loss", float("nan")),
        "approx_kl": means.get("approx_kl", float("nan")),
        "clipfrac": means.get("clipfrac", float("nan")),
        "ratio": means.get("ratio", float("nan")),
        "grad_norm": means.get("grad_norm", float("nan")),
        "ratio_first_step": float(np.mean(first_ratios)) if first_ratios else float("nan"),
        "logprob_max_diff": max_diff,
        "nan_losses": steps_skipped,
    }, stop


def _make_ema(params, tc: DPOKConfig):
    if not tc.use_ema:
        return None
    from diffusers.training_utils import EMAModel

    return EMAModel(params, decay=tc.ema_decay)


def check_config(cfg) -> None:
    """Cross-field checks of a recipe for this trainer; `diffrl.config` calls it at load time (so `diffrl validate`
    reports them), and `train` again. Raises `UserError`."""
    tc: DPOKConfig = cfg.train
    if cfg.model.full_finetune:
        raise UserError("DPOK's reference policy is the UNet with its LoRA adapter switched off, so it trains a "
                        "LoRA only: set model.full_finetune=false")
    if tc.advantage == "group" and tc.group_size < 2:
        raise UserError("train.advantage=group needs train.group_size >= 2 (samples per prompt to compare)")
    if cfg.sample.batch_size % tc.group_size:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be a multiple of train.group_size "
                        f"({tc.group_size}): a group's samples are drawn in the same batch")
    for key in ("policy_batch_size", "gradient_accumulation_steps", "policy_steps"):
        if getattr(tc, key) < 1:
            raise UserError(f"train.{key} must be >= 1, got {getattr(tc, key)}")
    if tc.value_baseline and (tc.value_batch_size < 1 or tc.value_steps < 1):
        raise UserError("train.value_batch_size and train.value_steps must be >= 1 with train.value_baseline=true")
    check_steps_config(cfg)
    if tc.ratio_clip <= 0 or tc.kl_weight < 0:
        raise UserError(f"train.ratio_clip must be > 0 and train.kl_weight >= 0, got {tc.ratio_clip}, {tc.kl_weight}")
    if cfg.sample.eta <= 0 and cfg.sample.sampler != "lcm":
        raise UserError(f"sample.eta={cfg.sample.eta} makes every denoising step deterministic (no policy to "
                        "optimise); DPOK samples with eta=1.0")


def _progress(accelerator, *, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="dpok epochs", disable=not accelerator.is_main_process,
                dynamic_ncols=True)
