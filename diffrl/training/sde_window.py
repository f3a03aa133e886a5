"""SDE windows (MixGRPO; Flow-GRPO-Fast) and the step checks of the trainers that train sampled steps: DDPO, DPOK and
Flow-GRPO (windows), D3PO (`check_stochastic`, `trainable_steps`).

With a window only `train.sde_window` consecutive denoising steps of a trajectory are stochastic (η = sample.eta:
DDIM's η, or the flow samplers' noise level a) and trained; the others are deterministic (η = 0: no noise,
log-prob 0 under any weights, so no gradient). Less noise per trajectory for the reward to be credited to, and
training costs W steps instead of T. Where the window starts each epoch is `train.sde_window_schedule`:

    random        (Flow-GRPO-Fast) a step drawn once per epoch from the trainer's generator in
                  0..`train.sde_window_max_start`
    progressive   (MixGRPO's sliding window, Li et al. 2025, arXiv 2507.21802; reference code
                  github.com/Tencent-Hunyuan/MixGRPO@e5cdd6a, `fastvideo/utils/grpo_states.py`
                  `GRPOTrainingStates` with sample_strategy="progressive", prog_overlap, roll_back) the window
                  moves `train.sde_window_stride` steps later every `train.sde_window_shift_every` epochs (the
                  paper's shift interval τ; one epoch = one of the reference's training iterations: a rollout and
                  its update) and starts again at step 0 once it would pass the trained steps:
                      n = epoch // shift_every,  positions P = (L − W) // stride + 1,  start = (n mod P) · stride
                  with L = T − `train.skip_final_steps` and W = `train.sde_window`. No random draw, so a resumed
                  run continues the schedule from its epoch number. One difference from the reference on purpose:
                  its window is cut at L and shrinks over its last W − 1 positions, then is empty (trains nothing)
                  for one shift interval before rolling back; here the window keeps its W steps and rolls back
                  when it would cross L. The published run (25 steps, W = 4, τ = 25, 300 iterations: positions
                  0-11) never reaches the end, so it is the same there. A window needs a sampler that takes one η per step (`per_step_eta`: DDIM and
the flow samplers; not LCM). Without a window every step is stochastic and the first T − `train.skip_final_steps`
are trained.
"""

import numpy as np

from diffrl.errors import UserError
from samplers import get_sampler


def sde_window_etas(cfg, rng: np.random.Generator, epoch: int | None = None) -> tuple[float, ...] | None:
    """This epoch's per-step η with an SDE window (its start drawn from `rng`, or MixGRPO's progressive schedule at
    `epoch`), or None (every step at sample.eta)."""
    tc = cfg.train
    if not tc.sde_window:
        return None  # no draw: the trainer's random stream stays what it was without the option
    if getattr(tc, "sde_window_schedule", "random") == "progressive":
        if epoch is None:
            raise ValueError("the progressive SDE window needs the epoch number")
        start = progressive_window_start(epoch, window=tc.sde_window, shift_every=tc.sde_window_shift_every,
                                         stride=tc.sde_window_stride,
                                         limit=cfg.sample.num_steps - tc.skip_final_steps)
    else:
        start = int(rng.integers(0, tc.sde_window_max_start + 1))
    return tuple(cfg.sample.eta if start <= i < start + tc.sde_window else 0.0 for i in range(cfg.sample.num_steps))


def progressive_window_start(epoch: int, *, window: int, shift_every: int, stride: int, limit: int) -> int:
    """MixGRPO's sliding window: the first SDE step at `epoch` (module docstring).

    Args:
        epoch (`int`): the epoch (0-based; the reference's training iteration).
        window (`int`): W, the window's length in steps.
        shift_every (`int`): τ, epochs between two moves of the window.
        stride (`int`): steps the window moves each time (the reference's prog_overlap_step).
        limit (`int`): L, the window's steps stay below it (T − skip_final_steps).
    """
    if window < 1 or shift_every < 1 or stride < 1 or window > limit:
        raise ValueError(f"need 1 <= window <= limit and shift_every, stride >= 1, got window={window}, "
                         f"limit={limit}, shift_every={shift_every}, stride={stride}")
    positions = (limit - window) // stride + 1
    return (epoch // shift_every) % positions * stride


def trainable_steps(traj, skip_final_steps: int) -> np.ndarray:
    """Step indices a trainer trains: the first T − skip_final_steps, or with per-step η only the stochastic ones."""
    if isinstance(traj.eta, tuple):
        return np.flatnonzero(np.asarray(traj.eta) > 0)
    return np.arange(traj.num_steps - skip_final_steps)


def check_steps_config(cfg) -> None:
    """`train.skip_final_steps`, `train.sde_window` and `train.sde_window_max_start` against sample.num_steps."""
    tc, num_steps = cfg.train, cfg.sample.num_steps
    if not 0 <= tc.skip_final_steps < num_steps:
        raise UserError(f"train.skip_final_steps must be in [0, sample.num_steps = {num_steps}), "
                        f"got {tc.skip_final_steps}")
    if tc.sde_window < 0 or tc.sde_window_max_start < 0:
        raise UserError("train.sde_window and train.sde_window_max_start must be >= 0")
    schedule = getattr(tc, "sde_window_schedule", "random")
    if schedule not in ("random", "progressive"):
        raise UserError(f"train.sde_window_schedule must be 'random' or 'progressive', got {schedule!r}")
    if schedule == "progressive":
        if not tc.sde_window:
            raise UserError("train.sde_window_schedule=progressive needs train.sde_window >= 1 (the window's length)")
        if tc.sde_window_max_start:
            raise UserError("train.sde_window_max_start is the random window's; the progressive window moves by "
                            "train.sde_window_stride every train.sde_window_shift_every epochs: set it to 0")
        if tc.sde_window_shift_every < 1 or tc.sde_window_stride < 1:
            raise UserError("train.sde_window_shift_every and train.sde_window_stride must be >= 1")
    if tc.sde_window and tc.sde_window_max_start + tc.sde_window > num_steps - tc.skip_final_steps:
        raise UserError(f"train.sde_window_max_start ({tc.sde_window_max_start}) + train.sde_window "
                        f"({tc.sde_window}) must be <= sample.num_steps - train.skip_final_steps "
                        f"({num_steps - tc.skip_final_steps}): the window must fit in the trained steps")
    if tc.sde_window_max_start and not tc.sde_window:
        raise UserError("train.sde_window_max_start needs train.sde_window >= 1 (the window's length)")


def check_stochastic(cfg, trainer: str, sampler=None) -> None:
    """A policy-gradient trainer needs stochastic steps: eta > 0 for a sampler whose noise eta scales (DDIM, flow); a
    consistency sampler (LCM) re-noises every step whatever eta is. Without `sampler` (at load time) only a sampler
    the recipe names is checked; "auto" waits until the pipeline is loaded (`check_sampler`)."""
    if sampler is None and cfg.sample.sampler != "auto":
        sampler = get_sampler(cfg.sample.sampler)
    if sampler is not None and cfg.sample.eta <= 0 and not sampler.consistency:
        raise UserError(f"sample.eta={cfg.sample.eta} makes every denoising step deterministic (no policy to "
                        f"optimise); {trainer} samples with eta=1.0")


def check_sampler(cfg, sampler, trainer: str) -> None:
    """Options that need a particular sampler (known only once the pipeline is loaded). Raises `UserError`."""
    check_stochastic(cfg, trainer, sampler)
    if cfg.train.sde_window and not sampler.per_step_eta:
        raise UserError(f"train.sde_window needs a sampler that takes one eta per step (ddim, flow); this run "
                        f"samples with '{sampler.name}': set train.sde_window=0 or use a DDIM or flow pipeline")
