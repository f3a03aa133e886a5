"""SDE windows (MixGRPO; Flow-GRPO-Fast) and the step checks of the trainers that train sampled steps: DDPO, DPOK and
Flow-GRPO (windows), D3PO (`check_stochastic`, `trainable_steps`).

With a window only `train.sde_window` consecutive denoising steps of a trajectory are stochastic (η = sample.eta:
DDIM's η, or the flow samplers' noise level a) and trained; the others are deterministic (η = 0: no noise,
log-prob 0 under any weights, so no gradient). The window starts at a step drawn once per epoch from the trainer's
generator in 0..`train.sde_window_max_start`. Less noise per trajectory for the reward to be credited to, and
training costs W steps instead of T. A window needs a sampler that takes one η per step (`per_step_eta`: DDIM and
the flow samplers; not LCM). Without a window every step is stochastic and the first T − `train.skip_final_steps`
are trained.
"""

import numpy as np

from diffrl.errors import UserError


def sde_window_etas(cfg, rng: np.random.Generator) -> tuple[float, ...] | None:
    """This epoch's per-step η with an SDE window (drawn from `rng`), or None (every step at sample.eta)."""
    tc = cfg.train
    if not tc.sde_window:
        return None  # no draw: the trainer's random stream stays what it was without the option
    start = int(rng.integers(0, tc.sde_window_max_start + 1))
    return tuple(cfg.sample.eta if start <= i < start + tc.sde_window else 0.0 for i in range(cfg.sample.num_steps))


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
        from samplers import get_sampler

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
