"""Collecting an epoch of trajectories and their rewards, and turning rewards into per-sample advantages."""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from diffrl.prompts import draw_prompts
from diffrl.training.advantages import (
    STD_EPS,
    PerPromptStatTracker,
    batch_advantages,
    clip_advantages,
    group_advantages,
)
from diffrl.training.distributed import gather_list, gather_tensor
from rewards.base import check_scores


@dataclass
class Rollout:
    """One process's samples of an epoch, plus the epoch's gathered rewards (every process, rank order).

    Args:
        traj (`Trajectory`): this process's trajectories, `N_local` of them (images dropped after scoring).
        images (`torch.Tensor` `[k, 3, H, W]`): the first few images, kept for the sample grid.
        rewards (`torch.Tensor` `[N_local]` float64): this process's rewards (non-finite where the reward failed).
        all_rewards (`np.ndarray` `[N]`), all_prompts (`list[str]`), all_groups (`np.ndarray` `[N]`): gathered.
        components (`dict[str, np.ndarray]`): gathered per-component rewards (`[N]` each) from the reward's info.
        rollout_s, reward_s (`float`): seconds spent sampling and scoring on this process.
    """

    traj: object
    images: torch.Tensor
    rewards: torch.Tensor
    all_rewards: np.ndarray
    all_prompts: list
    all_groups: np.ndarray
    components: dict = field(default_factory=dict)
    rollout_s: float = 0.0
    reward_s: float = 0.0

    @property
    def finite(self) -> np.ndarray:
        """`[N]` bool: samples whose reward is finite (the others are dropped from training)."""
        return np.isfinite(self.all_rewards)


def sync_device(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; timers would charge it to what waits next)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def score_images(reward, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict]:
    """Score images; returns float64 scores `[B]` (non-finite ones kept, to be dropped later) and `[B]` components."""
    with torch.no_grad():
        out = reward(images, prompts, None)
    check_scores(getattr(reward, "name", type(reward).__name__), out, images.shape[0])
    scores = out.scores.detach().double().cpu()
    components = {
        k: v.detach().double().cpu().reshape(-1)
        for k, v in (out.info or {}).items()
        if isinstance(v, torch.Tensor) and v.numel() == images.shape[0]
    }
    return scores, components


def collect_rollouts(
    *,
    pipe,
    sampler,
    reward,
    prompts: list[str],
    sample_cfg,
    group_size: int,
    rng: np.random.Generator,
    accelerator,
    keep_images: int,
    shared_start_noise: bool = False,
    eta: tuple[float, ...] | None = None,
) -> Rollout:
    """Sample `num_batches_per_epoch` batches of `batch_size` on this process, score them, gather the rewards.

    Prompts and per-sample seeds come from `rng` (this process's trainer generator), so a resumed run draws
    exactly what the uninterrupted one would have. With `shared_start_noise` the `group_size` samples of a group
    start from one x_T, drawn from a seed of its own (not a sample's, whose stream then draws the step noise).
    `eta` (one per step) replaces `sample_cfg.eta`.
    """
    trajs, rewards, comps, kept = [], [], {}, []
    rollout_s = reward_s = 0.0
    negative = [sample_cfg.negative_prompt] * sample_cfg.batch_size if sample_cfg.negative_prompt else None
    for _ in range(sample_cfg.num_batches_per_epoch):
        batch_prompts, seeds = draw_batch(prompts, sample_cfg.batch_size, group_size, rng)
        start_latents = None
        if shared_start_noise:
            group_seeds = rng.integers(0, 2**62, size=sample_cfg.batch_size // group_size).tolist()
            start_latents = shared_group_noise(pipe, group_seeds, group_size)
        start = time.perf_counter()
        with torch.no_grad(), accelerator.autocast():
            traj = sampler.sample(
                pipe,
                batch_prompts,
                num_steps=sample_cfg.num_steps,
                guidance_scale=sample_cfg.guidance_scale,
                eta=sample_cfg.eta if eta is None else eta,
                seeds=seeds,
                negative_prompt=negative,
                latents=start_latents,
            )
        sync_device(accelerator.device)
        rollout_s += time.perf_counter() - start
        start = time.perf_counter()
        scores, components = score_images(reward, traj.images, batch_prompts)
        sync_device(accelerator.device)
        reward_s += time.perf_counter() - start
        if sum(len(k) for k in kept) < keep_images:
            kept.append(traj.images[: keep_images - sum(len(k) for k in kept)].detach().float().cpu())
        traj.images = None  # free the decoded images; training needs only latents and conditioning
        trajs.append(traj)
        rewards.append(scores)
        for k, v in components.items():
            comps.setdefault(k, []).append(v)
    return gather_rollout(trajs, rewards, comps, kept, group_size=group_size, accelerator=accelerator,
                          rollout_s=rollout_s, reward_s=reward_s)


def draw_batch(prompts: list[str], batch_size: int, group_size: int, rng: np.random.Generator):
    """A sampling batch's prompts (groups of `group_size` consecutive copies) and per-sample seeds, from `rng`."""
    batch_prompts = draw_prompts(prompts, batch_size, group_size, rng)
    return batch_prompts, rng.integers(0, 2**62, size=batch_size).tolist()


def gather_rollout(trajs: list, rewards: list, comps: dict, kept: list, *, group_size: int, accelerator,
                   rollout_s: float, reward_s: float) -> Rollout:
    """One `Rollout` from this process's sampling batches: their trajectories and rewards concatenated, the
    rewards, prompts, group ids and reward components of every process gathered in rank order."""
    traj = type(trajs[0]).cat(trajs)
    local_rewards = torch.cat(rewards)
    n_local = len(local_rewards)
    # group ids unique over the whole epoch: (process, position // group_size)
    local_groups = torch.arange(n_local) // group_size + accelerator.process_index * n_local
    return Rollout(
        traj=traj,
        images=torch.cat(kept) if kept else torch.empty(0),
        rewards=local_rewards,
        all_rewards=gather_tensor(accelerator, local_rewards).numpy(),
        all_prompts=gather_list(accelerator, traj.prompts),
        all_groups=gather_tensor(accelerator, local_groups).numpy(),
        components={k: gather_tensor(accelerator, torch.cat(v)).numpy() for k, v in comps.items()},
        rollout_s=rollout_s,
        reward_s=reward_s,
    )


def shared_group_noise(pipe, group_seeds: list[int], group_size: int) -> torch.Tensor:
    """Start latents `[len(group_seeds) * group_size, C, h, w]`: one standard-normal x_T per group (from its seed,
    on the CPU, so a seed gives the same x_T on any device), repeated for the group's consecutive samples."""
    # deferred: diffrl.models (and samplers.noise/base through it) imports diffusers, which takes seconds; importing a
    # trainer loads torch only
    from diffrl.models import model_family
    from diffrl.models.base import module_dtype, step_dtype
    from samplers.noise import draw_noise, make_generators

    family = model_family(pipe)
    shape, _, _ = family.latent_shape(None, None)
    generators, _ = make_generators(len(group_seeds), seeds=group_seeds, generator=None, device="cpu")
    dtype = step_dtype(module_dtype(family.denoiser))
    return draw_noise(generators, shape, "cpu", dtype).repeat_interleave(group_size, dim=0)


def compute_advantages(
    rollout: Rollout,
    *,
    mode: str,
    stat_tracker: PerPromptStatTracker | None,
    group_std: str,
    adv_clip_max: float,
    std_eps: float = STD_EPS,
    group_by: str = "draw",
) -> np.ndarray:
    """Advantages `[N]` for every sample of the epoch (0 where the reward was non-finite), identical on all ranks.
    `std_eps` is added to the std of the group and batch modes (the per-prompt tracker holds its own). In group
    mode `group_by="draw"` groups the samples drawn together for a prompt, `"prompt"` every sample of the epoch
    with the same prompt text.

    Non-finite rewards are left out of every statistic (and of the stat tracker's buffers).
    """
    finite = rollout.finite
    rewards = rollout.all_rewards[finite]
    if mode == "per_prompt":
        prompts = [p for p, ok in zip(rollout.all_prompts, finite) if ok]
        adv = stat_tracker.update(prompts, rewards)
    elif mode == "group":
        adv = group_advantages(rewards, group_ids(rollout, group_by)[finite], std=group_std, std_eps=std_eps)
    elif mode == "batch":
        adv = batch_advantages(rewards, std_eps=std_eps)
    elif mode == "none":
        adv = rewards.astype(np.float64)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}")
    out = np.zeros(len(finite), dtype=np.float64)
    out[finite] = clip_advantages(adv, adv_clip_max)
    return out


def epoch_advantages(rollout: Rollout, adv, stat_tracker: PerPromptStatTracker | None, *,
                     clip_max: float | None = None) -> np.ndarray:
    """`compute_advantages` with the settings of a recipe's `advantage:` group (`clip_max` overrides its clip)."""
    return compute_advantages(rollout, mode=adv.mode, stat_tracker=stat_tracker, group_std=adv.group_std,
                              adv_clip_max=adv.clip_max if clip_max is None else clip_max, std_eps=adv.std_eps,
                              group_by=adv.group_by)


def group_ids(rollout: Rollout, group_by: str) -> np.ndarray:
    """`[N]` group ids of the epoch's samples: their draw's (`"draw"`) or their prompt text's (`"prompt"`)."""
    if group_by == "draw":
        return rollout.all_groups
    if group_by == "prompt":
        return np.unique(np.asarray(rollout.all_prompts, dtype=object), return_inverse=True)[1].reshape(-1)
    raise ValueError(f"group_by must be 'draw' or 'prompt', got {group_by!r}")


def local_slice(accelerator, n_local: int) -> slice:
    """Positions of this process's samples in the gathered (rank-ordered) arrays."""
    start = accelerator.process_index * n_local
    return slice(start, start + n_local)


def local_batch(rollout: Rollout, values: np.ndarray, accelerator) -> tuple:
    """This process's trajectories (on its device), its slice of per-sample `values` (advantages, returns) as
    float32, and which of its samples have a finite reward."""
    mine = local_slice(accelerator, len(rollout.traj))
    device = accelerator.device
    return (rollout.traj.to(device), torch.as_tensor(values[mine], dtype=torch.float32, device=device),
            torch.as_tensor(rollout.finite[mine], device=device))


class FirstStepCheck:
    """Before an epoch's first update the weights are the rollout's, so a recomputed step log-prob must equal the
    recorded one (ratio exactly 1): warns once per epoch when it does not, and reports `ratio_first_step` and
    `logprob_max_diff`. A mismatch means rollout and training run different numerics (batch composition, dtype,
    guidance), which biases every importance ratio."""

    def __init__(self, atol: float, where: str):
        self.atol, self.where = atol, where
        self.ratios: list[float] = []
        self.max_diff = 0.0

    def add(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> None:
        from samplers.base import warn_if_log_probs_differ  # deferred: see shared_group_noise

        log_probs = log_probs.detach()
        if not self.ratios:
            warn_if_log_probs_differ(log_probs, old_log_probs, atol=self.atol, where=self.where)
        self.max_diff = max(self.max_diff, (log_probs - old_log_probs).abs().max().item())
        self.ratios.append(torch.exp(log_probs - old_log_probs).mean().item())

    def stats(self) -> dict:
        return {"ratio_first_step": float(np.mean(self.ratios)) if self.ratios else float("nan"),
                "logprob_max_diff": self.max_diff}
