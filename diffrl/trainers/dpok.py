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
    ratio            p_θ / p_θ_old, clamped to [1 - clip_range, 1 + clip_range]   (the importance weight)
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

import numpy as np
import torch

from diffrl.errors import UserError
from diffrl.models.base import module_dtype, step_dtype
from diffrl.training.advantages import check_advantage_config, make_stat_tracker
from diffrl.training.context import RunContext
from diffrl.training.distributed import all_reduce_gradients, broadcast_parameters
from diffrl.training.reference import step_kl_to_reference
from diffrl.training.rollout import epoch_advantages, local_batch
from diffrl.training.sde_window import (
    check_sampler,
    check_steps_config,
    check_stochastic,
    sde_window_etas,
    trainable_steps,
)

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults are the reference implementation's (google-research/dpok,
# train_online_pg.py argument defaults).
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DPOKConfig:
    batch_size: int = 2  # (trajectory, step) pairs per policy micro-batch, per process (reference p_batch_size)
    policy_steps: int = 5  # policy optimizer steps per epoch (p_step), each of optim.gradient_accumulation_steps
    reward_weight: float = 100.0  # α, weight of the reward term
    kl_weight: float = 0.01  # β, weight of the per-step KL to the pre-trained model (KL in nats per latent dim)
    clip_range: float = 1e-4  # ε: the importance ratio is clamped to [1 - ε, 1 + ε]
    # never train the last N denoising steps (policy, KL or value): their tiny std makes the score term mostly noise
    # (`diffrl bench gradient`: the second-to-last of 10 steps carries most of the policy gradient's variance)
    skip_final_steps: int = 0
    # MixGRPO-style SDE window (`diffrl.training.sde_window`): only `sde_window` consecutive steps are stochastic and
    # trained, starting at a step drawn each epoch from 0..sde_window_max_start; 0 = every step stochastic (DPOK)
    sde_window: int = 0
    sde_window_max_start: int = 0
    value_baseline: bool = True  # learn V(x_t, c, t) and use A = r - V (reference v_flag=1)
    value_learning_rate: float = 1e-4  # AdamW step size of the value network
    value_batch_size: int = 256  # (trajectory, step) pairs per value step, per process
    value_steps: int = 5  # value optimizer steps per epoch (before the policy steps)


# The shared `optim:` group's defaults for DPOK: google-research/dpok's train_online_pg.py (AdamW 1e-5, no weight
# decay, clip 0.1, 12 policy micro-batches per optimizer step).
OPTIM_DEFAULTS = {"learning_rate": 1e-5, "weight_decay": 0.0, "max_grad_norm": 0.1, "gradient_accumulation_steps": 12}
# The `advantage:` group: what A is built from before the value baseline is subtracted; the reference uses the raw
# reward (mode none) and does not clip (clip_max applies after the baseline here).
ADVANTAGE_DEFAULTS = {"mode": "none", "clip_max": 0.0}

TrainConfig = DPOKConfig

# ---------------------------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------------------------


def dpok_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    kl: torch.Tensor,
    *,
    reward_weight: float,
    kl_weight: float,
    clip_range: float,
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
        clip_range (`float`): ε.

    Returns:
        `(loss, stats)` with detached `policy_loss`, `kl`, `ratio` (mean clamped ρ), `approx_kl`, `clipfrac`.
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clamped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_term = -reward_weight * advantages * clamped
    loss = (policy_term + kl_weight * kl).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": policy_term.double().mean(),
            "kl": kl.double().mean(),
            "ratio": ratio.double().mean(),
            "approx_kl": 0.5 * (log_ratio.double() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
        }
    return loss, stats


def value_loss(values: torch.Tensor, returns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the value baseline V(x_t, c, t) against the returns, over the samples whose reward is
    finite (`valid`); samples with a NaN reward weigh 0 (their return is never read), and no valid sample gives 0.

    Args:
        values (`torch.Tensor` of shape `[B]`): V(x_t, c, t) (carries the gradient).
        returns (`torch.Tensor` of shape `[B]`): the returns it is fitted to.
        valid (`torch.Tensor` of shape `[B]`, bool): which returns are finite.
    """
    dtype = step_dtype(values.dtype)
    ok = valid.to(dtype)
    target = torch.where(valid, returns.to(dtype), torch.zeros_like(values, dtype=dtype))
    return (ok * (values.to(dtype) - target) ** 2).sum() / ok.sum().clamp(min=1.0)


def baseline_advantages(returns: torch.Tensor, values: torch.Tensor | None, clip_max: float) -> torch.Tensor:
    """A = r − V(x_t, c, t) (or the returns without a value baseline), clipped to ±clip_max when clip_max > 0."""
    advantages = returns if values is None else returns - values
    return advantages.clamp(-clip_max, clip_max) if clip_max > 0 else advantages


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
        dtype (`torch.dtype`, *optional*): of the weights, which are initialised in it (float64 beside a float64
            policy: torch's float32 initialisers have CPU-specific kernels); defaults to torch's default dtype.
    """

    def __init__(self, latent_channels: int, text_dim: int, width: int = 64, dtype: torch.dtype | None = None):
        super().__init__()
        self.width = width
        self.image = torch.nn.Sequential(
            torch.nn.Conv2d(latent_channels, width, 3, padding=1, dtype=dtype), torch.nn.SiLU(),
            torch.nn.Conv2d(width, width, 3, stride=2, padding=1, dtype=dtype), torch.nn.SiLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        )
        self.text = torch.nn.Linear(text_dim, width, dtype=dtype)
        self.time = torch.nn.Linear(width, width, dtype=dtype)
        self.head = torch.nn.Sequential(torch.nn.Linear(3 * width, width, dtype=dtype), torch.nn.SiLU(),
                                        torch.nn.Linear(width, 1, dtype=dtype))

    def forward(self, latents: torch.Tensor, text: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        half = self.width // 2
        dtype = self.text.weight.dtype  # float32, or float64 beside a float64 policy
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=latents.device, dtype=dtype) / half)
        angles = timesteps.to(dtype)[:, None] * freqs[None]
        time = torch.cat([angles.sin(), angles.cos()], dim=1)
        features = torch.cat([self.image(latents.to(dtype)), self.text(text.to(dtype)), self.time(time)], dim=1)
        return self.head(features).squeeze(1)


def pooled_text(traj) -> torch.Tensor:
    """`[B, D]`: the prompt embeddings averaged over tokens (the value network's view of the prompt)."""
    return traj.prompt_embeds.to(step_dtype(traj.prompt_embeds.dtype)).mean(dim=1)


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with DPOK against `cfg.reward`; write the run dir; return the final metrics.
    Arguments as `diffrl.trainers.ddpo.train` (`cfg.train` is a `DPOKConfig`; the step callback follows the policy's
    optimizer steps, not the value network's)."""
    tc: DPOKConfig = cfg.train
    check(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="dpok", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=cfg.optim.gradient_accumulation_steps)
    check_sampler(cfg, ctx.sampler, "DPOK")
    # the value network V(x_t, c, t), with its own AdamW, checkpointed beside the policy
    value_net = value_optimizer = None
    if tc.value_baseline:
        unet = ctx.unet
        # text width: the UNet's cross-attention input, or a flow transformer's joint-attention input
        text_dim = unet.config.get("cross_attention_dim") or unet.config["joint_attention_dim"]
        value_net = ValueNet(unet.config.in_channels, text_dim, dtype=step_dtype(module_dtype(unet)))
        value_net = value_net.to(ctx.accelerator.device)
        broadcast_parameters(list(value_net.parameters()), ctx.accelerator)
        value_optimizer = torch.optim.AdamW(value_net.parameters(), lr=tc.value_learning_rate)
    extra = {"value_net": value_net} if value_net is not None else {}
    state = ctx.load_state(stat_tracker=make_stat_tracker(cfg.advantage), extra_modules=extra,
                           extra_optimizers={"value_net": value_optimizer} if extra else {})
    adv = cfg.advantage

    for epoch, record in ctx.epochs():
        # ---- 1. sample trajectories with the current weights and score them
        rollout = ctx.rollout(group_size=adv.group_size, shared_start_noise=adv.shared_start_noise,
                              eta=sde_window_etas(cfg, ctx.rng))

        # ---- 2. returns (the reward, optionally normalised) of every process's samples; this process's slice
        returns = epoch_advantages(rollout, adv, state.stat_tracker, clip_max=0.0)
        traj, local_returns, local_ok = local_batch(rollout, returns, ctx.accelerator)

        # ---- 3. fit the value baseline V(x_t, c, t) to the returns, then the KL-regularised policy steps
        train_start = time.perf_counter()
        stats = {}
        if value_net is not None:
            stats["value_loss"] = fit_value(value_net, value_optimizer, traj=traj, returns=local_returns,
                                            valid=local_ok, tc=tc, rng=ctx.rng, accelerator=ctx.accelerator)
        ctx.unet.train()
        policy_stats, stop = policy_update(ctx, traj=traj, returns=local_returns, valid=local_ok, value_net=value_net,
                                           epoch=epoch)
        stats.update(policy_stats)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan("lower optim.learning_rate or train.reward_weight, check the reward's scale")

        # ---- 4. log, checkpoint
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start, show="kl")
    return ctx.finish()


def _draw_pairs(rng: np.random.Generator, n_samples: int, steps: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """`count` trajectories (without replacement when there are enough) and one denoising step of `steps` (the
    trainable ones) for all of them."""
    idx = rng.choice(n_samples, size=count, replace=count > n_samples)
    return idx, int(steps[rng.integers(len(steps))])


def fit_value(value_net, value_optimizer, *, traj, returns, valid, tc: DPOKConfig, rng, accelerator) -> float:
    """`value_steps` AdamW steps of MSE between V(x_t, c, t) and the returns, on random (trajectory, step) pairs."""
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
        loss = value_loss(values, returns[idx_t.to(returns.device)], valid[idx_t.to(valid.device)])
        loss.backward()
        all_reduce_gradients(list(value_net.parameters()), accelerator)
        value_optimizer.step()
        value_optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    value_net.eval()
    return float(np.mean(losses)) if losses else float("nan")


def policy_update(ctx, *, traj, returns, valid, value_net, epoch: int) -> tuple[dict, bool]:
    """`policy_steps` optimizer steps of the DPOK loss on random (trajectory, step) pairs. Returns (stats, stop)."""
    tc: DPOKConfig = ctx.cfg.train
    accumulation = ctx.cfg.optim.gradient_accumulation_steps
    text = pooled_text(traj) if value_net is not None else None
    eligible = trainable_steps(traj, tc.skip_final_steps)
    update = ctx.policy_update(losses_per_micro_batch=1, ratio_check=f"epoch {epoch}, first policy step")
    for _ in update.passes(tc.policy_steps):  # each pass: one optimizer step over `accumulation` micro-batches
        for _ in update.micro_batches(range(accumulation)):
            idx, j = _draw_pairs(ctx.rng, len(traj), eligible, tc.batch_size)
            mb = traj.select(torch.as_tensor(idx))
            with ctx.accelerator.autocast():  # the current policy (with graph) and its KL to the pre-trained one
                step, kl = step_kl_to_reference(ctx.pipe, ctx.sampler, mb, j)
            old_log_probs = mb.log_probs[:, j].to(step.log_prob.device)
            update.check_ratio(step.log_prob, old_log_probs)  # no update yet this epoch: the rollout's log-prob
            idx_t = torch.as_tensor(idx, device=returns.device)
            values = None
            if value_net is not None:
                with torch.no_grad():
                    t = traj.timesteps[j].repeat(len(idx)).to(mb.latents.device)
                    values = value_net(mb.latents[:, j], text[idx_t.to(text.device)], t)
            advantages = baseline_advantages(returns[idx_t], values, ctx.cfg.advantage.clip_max)
            ok = valid[idx_t]
            if bool(ok.any()):
                update.backward(*dpok_loss(step.log_prob[ok], old_log_probs[ok], advantages[ok], kl[ok],
                                           reward_weight=tc.reward_weight, kl_weight=tc.kl_weight,
                                           clip_range=tc.clip_range))
            else:  # every drawn sample's reward was NaN: keep the backward (all processes must match), no gradient
                update.backward(step.log_prob.sum() * 0.0)
    return update.stats(("loss", "kl", "policy_loss", "approx_kl", "clipfrac", "ratio", "grad_norm")), update.stopped


def check(cfg) -> None:
    """Cross-field checks of a recipe for this trainer; `diffrl.config` calls it at load time (so `diffrl validate`
    reports them), and `train` again. Raises `UserError`."""
    tc: DPOKConfig = cfg.train
    if cfg.model.full_finetune:
        raise UserError("DPOK's reference policy is the UNet with its LoRA adapter switched off, so it trains a "
                        "LoRA only: set model.full_finetune=false")
    check_advantage_config(cfg)
    for key in ("batch_size", "policy_steps"):
        if getattr(tc, key) < 1:
            raise UserError(f"train.{key} must be >= 1, got {getattr(tc, key)}")
    if tc.value_baseline and (tc.value_batch_size < 1 or tc.value_steps < 1):
        raise UserError("train.value_batch_size and train.value_steps must be >= 1 with train.value_baseline=true")
    check_steps_config(cfg)
    if tc.clip_range <= 0 or tc.kl_weight < 0:
        raise UserError(f"train.clip_range must be > 0 and train.kl_weight >= 0, got {tc.clip_range}, {tc.kl_weight}")
    check_stochastic(cfg, "DPOK")


def derived(cfg, num_processes: int) -> dict:
    """DPOK's optimizer steps per epoch are set directly (policy_steps), not by the number of samples."""
    per_step = cfg.train.batch_size * cfg.optim.gradient_accumulation_steps
    return {
        "global_train_batch": per_step * num_processes,  # (trajectory, step) pairs per optimizer step
        "optimizer_steps_per_epoch": cfg.train.policy_steps,
        "total_optimizer_steps": cfg.train.policy_steps * cfg.run.num_epochs,
    }


def epoch_passes(cfg) -> dict:
    """The network passes one epoch's training makes per process (`diffrl bench train`'s floor): per policy
    micro-batch one guided forward + backward and one no-grad reference forward (adapter off); one AdamW step per
    policy step; the value network's steps."""
    tc = cfg.train
    micro_batches = tc.policy_steps * cfg.optim.gradient_accumulation_steps
    return {"train_batch": tc.batch_size, "fwd_bwd": micro_batches, "reference": micro_batches,
            "adam": tc.policy_steps, "value": tc.value_steps if tc.value_baseline else 0,
            "value_batch": tc.value_batch_size}
