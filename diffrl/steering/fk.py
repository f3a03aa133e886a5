"""Feynman-Kac (FK) steering: sequential Monte Carlo over the particles of a stochastic sampler.

Singhal et al., "A General Framework for Inference-time Scaling and Steering of Diffusion Models" (2025).

k particles per prompt run the base sampler (the proposal). At scheduled steps each particle's x̂0 is scored with the
reward, its importance weight is multiplied by a potential G_t, and the particles are resampled in proportion to
their weights when the effective sample size is low. Over the whole chain the potentials multiply to exp(λ·r(x0)),
so the weighted particles target the tilted distribution p(x0)·exp(λ·r(x0)) / Z.

Map from code to paper notation:
    `rewards`          r_t = r(x̂0(x_t)), the intermediate reward of a particle at a scheduled step
    `lmbda`            λ, the inverse temperature of the tilt exp(λ·r)
    `log_potential`    log G_t: max -> λ·max_{s≥t} r_s, add -> λ·Σ_{s≥t} r_s, difference -> λ·(r_t − r_{t+1}),
                       immediate -> λ·r_t (the sums and maxima run over this particle's scheduled steps so far)
    `log_weights`      log w_i, accumulated multiplicatively (added in log space) over scheduled steps since the last
                       resampling — the public reference code keeps only the current potential, which is wrong
                       whenever a scheduled step passes without resampling
    `history.log_prod` log ∏ G_s along the particle's ancestry; the final step multiplies by
                       exp(λ·r(x0)) / ∏ G_s so that every potential choice targets the same distribution
    `ess`              effective sample size 1 / Σ ŵ_i² of the normalised weights ŵ

Departures from the reference code (each a deliberate fix): weights accumulate between resamplings (above);
resampling picks ancestors x_t and then steps every copy with its own fresh noise (the reference resamples x_{t-1}
after the step, so copies stay identical until the next step); the final correction uses the reward of the final
sample itself, and the final weights are reported so the particles can be used as a weighted sample. The max
potential takes the maximum over all of a particle's scheduled rewards so far, as the paper defines it (the reference
code compares with the previous reward only, and starts from a floor of 0 where this starts from −∞); any choice is
unbiased for the same target once the final correction divides its product out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, gather_rows, rows_per_prompt

POTENTIALS = ("max", "add", "difference", "immediate")
RESAMPLERS = ("multinomial", "systematic")
SELECTIONS = ("best", "sample")


@dataclass
class FKConfig:
    """FK steering settings. Defaults follow the paper's text-to-image runs where it gives one."""

    num_particles: int = 4  # k, particles per prompt
    lmbda: float = 10.0  # λ, tilt strength: the target is p(x0)·exp(λ·r(x0))
    potential: str = "max"  # one of POTENTIALS
    resampling: str = "multinomial"  # one of RESAMPLERS
    adaptive: bool = True  # resample only when ESS < ess_threshold·k; False: at every scheduled step
    ess_threshold: float = 0.5  # fraction of k
    start: int = 0  # first step index (0 = noisiest) at which particles are scored
    end: int | None = None  # last step index that may be scheduled (inclusive); None: the step before the last
    interval: int = 10  # score every `interval` steps from `start`
    select: str = "best"  # which particle per prompt to return: highest final reward, or a draw ∝ final weights

    @property
    def latent_rows(self) -> int:
        """Latents held per prompt: every particle (bounded in `bounds.py`)."""
        return self.num_particles


class FKHistory(NamedTuple):
    """Per-particle reward history along its ancestry, all `[B, k]`; resampling gathers it with the particles."""

    prev: torch.Tensor  # r at the previous scheduled step (0 before the first)
    running_max: torch.Tensor  # max of scheduled rewards so far (−inf before the first)
    running_sum: torch.Tensor  # sum of scheduled rewards so far
    log_prod: torch.Tensor  # Σ log G_s so far


def init_history(shape, *, device=None, dtype=torch.float32) -> FKHistory:
    zeros = torch.zeros(shape, device=device, dtype=dtype)
    return FKHistory(zeros, torch.full_like(zeros, float("-inf")), zeros.clone(), zeros.clone())


def log_potential(potential: str, rewards: torch.Tensor, history: FKHistory, lmbda: float) -> torch.Tensor:
    """log G_t for the current scheduled step (any shape matching `history`)."""
    if potential == "max":
        return lmbda * torch.maximum(rewards, history.running_max)
    if potential == "add":
        return lmbda * (rewards + history.running_sum)
    if potential == "difference":
        return lmbda * (rewards - history.prev)
    if potential == "immediate":
        return lmbda * rewards
    raise UserError(f"unknown FK potential '{potential}'; choose one of {', '.join(POTENTIALS)}")


def update_history(history: FKHistory, rewards: torch.Tensor, log_g: torch.Tensor) -> FKHistory:
    return FKHistory(
        prev=rewards,
        running_max=torch.maximum(rewards, history.running_max),
        running_sum=history.running_sum + rewards,
        log_prod=history.log_prod + log_g,
    )


def final_log_potential(final_rewards: torch.Tensor, history: FKHistory, lmbda: float) -> torch.Tensor:
    """log G_0 = λ·r(x0) − Σ log G_s: makes the potentials of every lineage multiply to exp(λ·r(x0))."""
    return lmbda * final_rewards - history.log_prod


def normalized_weights(log_weights: torch.Tensor) -> torch.Tensor:
    """ŵ = softmax(log w) over the last axis (particles of one group)."""
    return torch.softmax(log_weights, dim=-1)


def effective_sample_size(log_weights: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / Σ ŵ², over the last axis: k for equal weights, 1 when one particle holds all the weight."""
    w = normalized_weights(log_weights)
    return 1.0 / (w * w).sum(dim=-1)


def multinomial_indices(log_weights: torch.Tensor, generator=None) -> torch.Tensor:
    """k ancestors per group drawn i.i.d. ∝ ŵ: `[B, k]` -> `[B, k]` indices into the group."""
    w = normalized_weights(log_weights)
    return torch.multinomial(w, w.shape[-1], replacement=True, generator=generator)


def systematic_indices(log_weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Systematic resampling: one uniform u ∈ [0, 1) per group, positions (u + j) / k, ancestor = the particle whose
    cumulative-weight interval holds the position. `uniforms` `[B]`; returns `[B, k]` indices.

    Every particle with weight ŵ_i gets ⌊k·ŵ_i⌋ or ⌈k·ŵ_i⌉ copies, so the resampling adds less variance than
    multinomial draws.
    """
    w = normalized_weights(log_weights)
    k = w.shape[-1]
    cumulative = torch.cumsum(w, dim=-1)
    positions = (uniforms.unsqueeze(-1).to(w) + torch.arange(k, device=w.device, dtype=w.dtype)) / k
    indices = torch.searchsorted(cumulative, positions, right=True)
    # Round-off can leave the last cumulative weight a hair below a position near 1.
    return indices.clamp(max=k - 1)


def resample_indices(log_weights: torch.Tensor, method: str, generator=None) -> torch.Tensor:
    device = generator.device if generator is not None else log_weights.device
    log_weights_on = log_weights.to(device)
    if method == "multinomial":
        indices = multinomial_indices(log_weights_on, generator)
    elif method == "systematic":
        uniforms = torch.rand(log_weights.shape[:-1], generator=generator, device=device)
        indices = systematic_indices(log_weights_on, uniforms)
    else:
        raise UserError(f"unknown resampling '{method}'; choose one of {', '.join(RESAMPLERS)}")
    return indices.to(log_weights.device)


def resample_step(
    log_weights: torch.Tensor, history: FKHistory, *, method: str, adaptive: bool, ess_threshold: float, generator=None
) -> tuple[torch.Tensor, torch.Tensor, FKHistory, torch.Tensor]:
    """Decide and perform resampling per group.

    Returns `(indices [B, k], log_weights, history, resampled [B] bool)`: groups that resample get ancestor indices,
    their histories gathered and their weights reset to equal; the others keep identity indices and their weights.
    """
    k = log_weights.shape[-1]
    if adaptive:
        resampled = effective_sample_size(log_weights) < ess_threshold * k
    else:
        resampled = torch.ones(log_weights.shape[:-1], dtype=torch.bool, device=log_weights.device)
    identity = torch.arange(k, device=log_weights.device).expand_as(log_weights)
    indices = identity
    if resampled.any():
        drawn = resample_indices(log_weights, method, generator)
        indices = torch.where(resampled.unsqueeze(-1), drawn, identity)
    history = FKHistory(*(torch.gather(h, -1, indices) for h in history))
    log_weights = torch.where(resampled.unsqueeze(-1), torch.zeros_like(log_weights), log_weights)
    return indices, log_weights, history, resampled


def scheduled_steps(num_steps: int, start: int, end: int | None, interval: int) -> list[int]:
    """Step indices at which particles are scored: start, start + interval, … up to `end` (inclusive).

    The last step is never scheduled: the final sample is scored after it and carries the final correction.
    """
    last = num_steps - 2 if end is None else min(end, num_steps - 2)
    return list(range(start, last + 1, interval))


def check_config(cfg: FKConfig) -> None:
    if cfg.num_particles < 1:
        raise UserError(f"num_particles must be at least 1, got {cfg.num_particles}")
    if cfg.potential not in POTENTIALS:
        raise UserError(f"unknown FK potential '{cfg.potential}'; choose one of {', '.join(POTENTIALS)}")
    if cfg.resampling not in RESAMPLERS:
        raise UserError(f"unknown resampling '{cfg.resampling}'; choose one of {', '.join(RESAMPLERS)}")
    if cfg.select not in SELECTIONS:
        raise UserError(f"unknown FK select '{cfg.select}'; choose one of {', '.join(SELECTIONS)}")
    if cfg.interval < 1:
        raise UserError(f"FK interval must be at least 1 step, got {cfg.interval}")
    if cfg.start < 0:
        raise UserError(f"FK start must be a step index ≥ 0, got {cfg.start}")
    if not 0 < cfg.ess_threshold <= 1:
        raise UserError(f"ess_threshold is a fraction of the particle count in (0, 1], got {cfg.ess_threshold}")


def fk_steer(ctx: SteerContext, cfg: FKConfig, generator=None, *, keep_particles: bool = False) -> SteerOutput:
    """Run FK steering for every prompt of `ctx` with `cfg.num_particles` particles each.

    Args:
        ctx (`SteerContext`): the model and reward.
        cfg (`FKConfig`): the settings.
        generator (`torch.Generator`, *optional*): drives the initial noise, the sampler noise and resampling.
        keep_particles (`bool`, *optional*, defaults to `False`):
            Also return every final particle, its final reward and normalised final weight in `info`
            (`particles [B·k, ...]`, `particle_scores [B, k]`, `final_weights [B, k]`), e.g. to use them as a
            weighted sample of the tilted target.

    Returns:
        `SteerOutput`: per prompt the particle chosen by `cfg.select`, its raw reward, and the accounting, with
        `resample_steps` (per scheduled step, how many prompt groups resampled) and `ess` (mean ESS per scheduled
        step).
    """
    check_config(cfg)
    B, k = ctx.num_prompts, cfg.num_particles
    # one particle has nothing to resample: scoring it along the way would only spend reward evaluations
    schedule = set(scheduled_steps(ctx.num_steps, cfg.start, cfg.end, cfg.interval)) if k > 1 else set()
    cond = rows_per_prompt(B, k)
    latents = ctx.initial_latents(cond, generator)
    cond = cond.to(latents.device)
    log_weights = torch.zeros(B, k, device=latents.device)
    history = init_history((B, k), device=latents.device)
    resample_log, ess_log = [], []

    for i in range(ctx.num_steps):
        model_output = ctx.predict(latents, i, cond)
        if i in schedule:
            pred_x0 = ctx.pred_x0(model_output, i, latents)
            rewards = ctx.score(pred_x0, cond).objective.view(B, k)
            log_g = log_potential(cfg.potential, rewards, history, cfg.lmbda)
            history = update_history(history, rewards, log_g)
            log_weights = log_weights + log_g
            ess_log.append(float(effective_sample_size(log_weights).mean()))
            indices, log_weights, history, resampled = resample_step(
                log_weights, history, method=cfg.resampling, adaptive=cfg.adaptive,
                ess_threshold=cfg.ess_threshold, generator=generator,
            )
            resample_log.append((i, int(resampled.sum())))
            if resampled.any():
                # Copies of an ancestor share x_t and its model output; the step below gives each its own noise.
                latents, model_output = gather_rows(latents, indices), gather_rows(model_output, indices)
        latents = ctx.step(model_output, i, latents, generator=generator).prev_sample

    final = ctx.score(latents, cond)
    final_rewards = final.objective.view(B, k)
    log_weights = log_weights + final_log_potential(final_rewards, history, cfg.lmbda)
    weights = normalized_weights(log_weights)
    if cfg.select == "best":
        chosen = final_rewards.argmax(dim=1)
    else:
        chosen = resample_indices(log_weights, "multinomial", generator)[:, 0]
    rows = chosen + torch.arange(B, device=chosen.device) * k
    info = ctx.accounting(
        "fk", num_particles=k, lmbda=cfg.lmbda, potential=cfg.potential, resampling=cfg.resampling,
        adaptive=cfg.adaptive, scheduled_steps=sorted(schedule), resample_steps=resample_log, ess=ess_log,
        final_ess=effective_sample_size(log_weights).tolist(),
    )
    if keep_particles:
        info.update(particles=latents, particle_scores=final_rewards * ctx.sign, final_weights=weights)
    return SteerOutput(images=final.samples[rows], scores=final.objective[rows] * ctx.sign, info=info)
