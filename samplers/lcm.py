"""The latent-consistency multistep sampler as a stochastic policy (RLCM's step policy).

Papers: Luo et al., "Latent Consistency Models" (2023), Algorithm 1 (multistep sampling); Oertell et al.,
"RL for Consistency Models" (RLCM, 2024), which treats each multistep step as a Gaussian policy.

Code name → paper notation (τ the current, τ' the next timestep of the LCM schedule):
    alphas_cumprod[τ]   ᾱ_τ
    c_skip, c_out       boundary-condition scalings at τ: with s = τ·timestep_scaling and σ_data = 0.5,
                        c_skip = σ_data² / (s² + σ_data²), c_out = s / √(s² + σ_data²)
    model_output        the UNet output (ε̂, v or x̂0 per `prediction_type`), guided through the UNet's
                        w-embedding `timestep_cond` of w = guidance_scale − 1 (no CFG batch), as diffusers'
                        `LatentConsistencyModelPipeline` does
    pred_x0             x̂0 = c_skip·x_τ + c_out·f_θ(x_τ, τ, c)   (f_θ: x̂0 from the model output)
    mean, std           μ = √ᾱ_τ' x̂0, σ = √(1 − ᾱ_τ')
    prev_sample         x_τ' = μ + σ z, z ~ N(0, I)
    log_prob            mean over latent dims of log N(x_τ'; μ, σ² I)

The last step returns x̂0 itself (deterministic, as diffusers' `LCMScheduler`), so the final latents are
what the pipeline decodes. Its log-prob is defined as 0 (a point mass; see `samplers.base`), in the
rollout and in every recomputation, so its PPO ratio is exactly 1: the image is a deterministic function of
the last state, and that step carries no score-function gradient. (The RLCM reference code instead scores
a re-noised copy of x̂0 whose noise never reaches the image; that term has zero expected gradient and only
adds variance.) With `num_steps=1` every step is deterministic and all log-probs are 0.

Schedule, boundary scalings and clipping come from the pipeline's `LCMScheduler` config
(`LCMScheduler.from_config`, `set_timesteps` with `original_inference_steps`); the math matches
`LCMScheduler.step` of diffusers 0.42 (re-derived, not copied), computed in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from samplers.base import (
    GradPolicy,
    SamplerHook,
    StepOutput,
    Trajectory,
    clip_pred_x0,
    current_schedule,
    in_step_dtype,
    pred_x0_and_eps,
    scalar32,
    timestep_index,
)
from samplers.loop import StepFn, recompute_log_prob, run_sampler
from samplers.noise import noise_for_step

SIGMA_DATA = 0.5  # σ_data of the consistency boundary condition (diffusers' LCMScheduler fixes it too)


@dataclass(frozen=True)
class LCMConstants:
    """The scalars of one LCM step (float32 values as Python floats)."""

    sqrt_alpha: float  # √ᾱ_τ
    sqrt_beta: float  # √(1 − ᾱ_τ)
    c_skip: float
    c_out: float
    sqrt_alpha_next: float  # √ᾱ_τ' (unused on the last step)
    std: float  # √(1 − ᾱ_τ'); 0 on the last step


def lcm_constants(
    timestep: int, alpha_prod_t: float, alpha_prod_next: float | None, timestep_scaling: float = 10.0
) -> LCMConstants:
    """Step scalars at timestep τ (ᾱ_τ = `alpha_prod_t`) towards ᾱ_τ' = `alpha_prod_next` (`None`: last step)."""
    scaled = scalar32(lambda t: t * timestep_scaling, timestep)
    last = alpha_prod_next is None
    return LCMConstants(
        sqrt_alpha=scalar32(lambda a: a**0.5, alpha_prod_t),
        sqrt_beta=scalar32(lambda a: (1 - a) ** 0.5, alpha_prod_t),
        c_skip=scalar32(lambda s: SIGMA_DATA**2 / (s**2 + SIGMA_DATA**2), scaled),
        c_out=scalar32(lambda s: s / (s**2 + SIGMA_DATA**2) ** 0.5, scaled),
        sqrt_alpha_next=0.0 if last else scalar32(lambda a: a**0.5, alpha_prod_next),
        std=0.0 if last else scalar32(lambda a: (1 - a) ** 0.5, alpha_prod_next),
    )


def lcm_step(
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    constants: LCMConstants,
    *,
    prediction_type: str = "epsilon",
    scheduler_config: dict | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One LCM multistep step as a Gaussian (a point mass at x̂0 on the last step), in fp32. Pure function.

    Args:
        model_output (`torch.Tensor` `[B, C, h, w]`): UNet output at x_τ (w-embedding guided).
        x_t (`torch.Tensor` `[B, C, h, w]`): x_τ.
        constants (`LCMConstants`): from `lcm_constants`.
        prediction_type (`str`), scheduler_config (`dict`, *optional*): as the pipeline's scheduler.
        prev_sample (`torch.Tensor`, *optional*): score this x_τ' instead of drawing one.
        noise (`torch.Tensor`, *optional*): z; required to draw on a non-final step.
    """
    c = constants
    model_output, x_t = in_step_dtype(model_output, x_t)
    f_theta, _ = pred_x0_and_eps(model_output, x_t, c.sqrt_alpha, c.sqrt_beta, prediction_type)
    f_theta = clip_pred_x0(f_theta, scheduler_config or {})
    pred_x0 = c.c_out * f_theta + c.c_skip * x_t  # the consistency function's output x̂0
    if c.std == 0:  # last step: deterministic
        mean = pred_x0
        if prev_sample is None:
            prev_sample = pred_x0
    else:
        mean = c.sqrt_alpha_next * pred_x0
        if prev_sample is None:
            if noise is None:
                raise ValueError("a stochastic LCM step needs `noise` or `prev_sample`")
            prev_sample = mean + c.std * noise.to(mean)
    return StepOutput.gaussian(prev_sample, mean, c.std, pred_x0)


@dataclass(frozen=True)
class LCMSchedule:
    """Timesteps and per-step constants of one LCM schedule, on CPU."""

    timesteps: torch.Tensor  # [T] int64
    steps: tuple[LCMConstants, ...]
    config: dict

    @classmethod
    def from_timesteps(cls, scheduler_config, timesteps: torch.Tensor) -> LCMSchedule:
        from diffusers import LCMScheduler

        scheduler = LCMScheduler.from_config(scheduler_config)
        timesteps = timesteps.to("cpu", torch.long)
        alphas = scheduler.alphas_cumprod
        values = timesteps.tolist()
        steps = []
        for i, t in enumerate(values):
            if i + 1 < len(values):
                nxt = values[i + 1]
                alpha_next = (alphas[nxt] if nxt >= 0 else scheduler.final_alpha_cumprod).item()
            else:
                alpha_next = None
            steps.append(lcm_constants(t, alphas[t].item(), alpha_next, scheduler.config.timestep_scaling))
        return cls(timesteps=timesteps, steps=tuple(steps), config=dict(scheduler.config))

    @property
    def alphas_cumprod(self) -> tuple[float, ...]:
        """ᾱ_τ per step, as the step constants hold it (√ᾱ_τ squared)."""
        return tuple(s.sqrt_alpha**2 for s in self.steps)

    def __len__(self) -> int:
        return len(self.timesteps)

    def index(self, t) -> int:
        return timestep_index(self.timesteps, t)


def lcm_timesteps(scheduler_config, num_steps: int, original_inference_steps: int | None = None) -> torch.Tensor:
    """The timesteps `LCMScheduler.set_timesteps` picks for `num_steps` (int64 `[T]`, CPU)."""
    from diffusers import LCMScheduler

    scheduler = LCMScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(num_steps, original_inference_steps=original_inference_steps)
    return scheduler.timesteps.to("cpu", torch.long)


LCM_SPACINGS = ("diffusers", "rlcm")  # whose choice of timesteps: diffusers' LCMScheduler, or RLCM's reference code


def rlcm_timesteps(num_train_timesteps: int, original_steps: int, num_steps: int) -> torch.Tensor:
    """The timesteps RLCM's own `LCMScheduler.set_timesteps` picks (Owen-Oertell/rlcm@b8330ed,
    `lcm_rl_pytorch/diffusers_patch/lcm_scheduler.py`), int64 `[T]`: of the distillation schedule
    c·k − 1 (k = 1..original_steps, c = num_train_timesteps // original_steps), every (original_steps // T)-th from
    the top. diffusers 0.42's `set_timesteps` spaces them otherwise (8 of 50: 999, 879, 759, 639, 519, 399, 279, 159
    here; 999, 879, 759, 639, 499, 379, 259, 139 there)."""
    if not 1 <= num_steps <= original_steps <= num_train_timesteps:
        raise UserError(f"the RLCM schedule needs 1 <= steps ({num_steps}) <= original_inference_steps "
                        f"({original_steps}) <= num_train_timesteps ({num_train_timesteps})")
    c = num_train_timesteps // original_steps
    origin = [c * k - 1 for k in range(1, original_steps + 1)]
    return torch.tensor(origin[::-(original_steps // num_steps)][:num_steps], dtype=torch.long)


def _check_eta(eta: float) -> None:
    if eta != 1.0:
        raise UserError(f"the LCM sampler's noise is fixed by its schedule; eta must be 1.0, got {eta}")


class LCMSampler:
    """LCM multistep sampling as a policy, with step and log-prob recomputation (RLCM).

    Guidance enters through the UNet's w-embedding, so every step is one UNet call on B rows. Per-sample
    generators as in `DDIMSampler`; hooks and `GradPolicy` as in `samplers.base`.

    Args:
        spacing (`str`, defaults to `"diffusers"`): which timesteps T steps take: `"diffusers"`, those
            `LCMScheduler.set_timesteps` picks; `"rlcm"`, those RLCM's reference code picks (`rlcm_timesteps`;
            registry name `lcm_rlcm`).
        noise_device (`str` or `torch.device`, *optional*): where per-sample generators live (UNet's device).
    """

    name = "lcm"
    # capabilities: what callers read instead of testing the name
    per_step_eta = False  # the step noise is fixed by the schedule: η is always `default_eta`
    consistency = True  # guidance is the UNet's w-embedding (one UNet row per sample); no negative prompt
    flow = False
    # sampling defaults (diffusers' LatentConsistencyModelPipeline: 4 steps, guidance 8.5)
    default_num_steps = 4
    default_guidance_scale = 8.5
    default_eta = 1.0

    def __init__(self, *, spacing: str = "diffusers", noise_device=None):
        if spacing not in LCM_SPACINGS:
            raise UserError(f"LCM timestep spacing {spacing!r} is not one of {LCM_SPACINGS}")
        self.spacing = spacing
        self.name = "lcm" if spacing == "diffusers" else "lcm_rlcm"
        self.noise_device = noise_device
        self._schedules: dict = {}
        self._current: LCMSchedule | None = None

    def schedule(
        self,
        pipe_or_config,
        num_steps: int | None = None,
        *,
        timesteps: torch.Tensor | None = None,
        original_inference_steps: int | None = None,
    ) -> LCMSchedule:
        """The step constants for a pipeline (or scheduler config) and `num_steps` (the timesteps
        `LCMScheduler.set_timesteps` picks) or a given descending `timesteps` sequence (cached)."""
        config = getattr(pipe_or_config, "scheduler", pipe_or_config)
        config = getattr(config, "config", config)
        if timesteps is None and self.spacing == "rlcm":
            original = original_inference_steps or config.get("original_inference_steps", 50)
            timesteps = rlcm_timesteps(config["num_train_timesteps"], original, num_steps)
        elif timesteps is None:
            timesteps = lcm_timesteps(config, num_steps, original_inference_steps)
        key = (json.dumps(dict(config), sort_keys=True, default=str), tuple(timesteps.tolist()))
        if key not in self._schedules:
            self._schedules[key] = LCMSchedule.from_timesteps(config, timesteps)
        self._current = self._schedules[key]
        return self._current

    @staticmethod
    def _step_at(schedule, i, model_output, x_t, *, prev_sample=None, noise=None) -> StepOutput:
        return lcm_step(
            model_output,
            x_t,
            schedule.steps[i],
            prediction_type=schedule.config["prediction_type"],
            scheduler_config=schedule.config,
            prev_sample=prev_sample,
            noise=noise,
        )

    def _step_fn(self, schedule: LCMSchedule) -> StepFn:
        return lambda model_output, i, x_t, prev_sample, noise: self._step_at(
            schedule, i, model_output, x_t, prev_sample=prev_sample, noise=noise
        )

    @staticmethod
    def draws_noise(schedule: LCMSchedule, etas: Sequence[float] = ()) -> list[bool]:
        """Whether each step draws noise: all but the last, as `LCMScheduler` (η plays no part)."""
        return [s.std > 0 for s in schedule.steps]

    def step(
        self,
        model_output: torch.Tensor,
        t,
        x_t: torch.Tensor,
        *,
        eta: float = 1.0,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        noise: torch.Tensor | None = None,
        schedule: LCMSchedule | None = None,
    ) -> StepOutput:
        """One step from timestep `t` (as `LCMScheduler.step`, plus mean, std and log-prob). Arguments as
        `DDIMSampler.step`, except `eta` (`float`, defaults to 1.0): must be 1.0 (see `sample`)."""
        _check_eta(eta)
        schedule = current_schedule(schedule or self._current, "sampler.schedule(pipe, num_steps)")
        i = schedule.index(t)
        noise = noise_for_step(generator, x_t, prev_sample=prev_sample, noise=noise, draws=schedule.steps[i].std > 0)
        return self._step_at(schedule, i, model_output, x_t, prev_sample=prev_sample, noise=noise)

    def sample(
        self,
        pipe,
        prompts: Sequence[str] | str | None,
        *,
        num_steps: int,
        guidance_scale: float,
        eta: float = 1.0,
        generator=None,
        latents: torch.Tensor | None = None,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
        negative_prompt=None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        seeds: Sequence[int] | None = None,
        output: str = "images",
        height: int | None = None,
        width: int | None = None,
        original_inference_steps: int | None = None,
        timesteps: Sequence[int] | None = None,
    ) -> Trajectory:
        """Sample a batch with the LCM multistep sampler and record its trajectory.

        Args:
            pipe: a `LatentConsistencyModelPipeline`-like pipeline (UNet with `time_cond_proj_dim`).
            prompts (`list[str]`): one per sample.
            num_steps (`int`): LCM steps (typically 2–8).
            guidance_scale (`float`): the scale s whose w = s − 1 the UNet embeds.
            eta (`float`, defaults to 1.0): must be 1.0 — the LCM step re-noises with its full √(1 − ᾱ_τ')
                noise; accepted so the `Sampler` protocol's callers can pass it.
            original_inference_steps (`int`, *optional*): the LCM distillation schedule length (the scheduler's
                config by default). timesteps (`list[int]`, *optional*): a custom descending schedule.
            negative_prompt, negative_prompt_embeds: not used by LCM (no CFG batch); passing them is an error.
            Others: as `DDIMSampler.sample`.
        """
        _check_eta(eta)
        if negative_prompt is not None or negative_prompt_embeds is not None:
            raise UserError("LCM pipelines guide through the UNet's w-embedding and take no negative prompt")
        if pipe.unet.config.time_cond_proj_dim is None:
            raise UserError("the LCM sampler needs a UNet with a guidance embedding (time_cond_proj_dim); use ddim")
        if timesteps is not None:
            schedule = self.schedule(pipe, timesteps=torch.tensor(list(timesteps), dtype=torch.long))
        else:
            schedule = self.schedule(pipe, num_steps, original_inference_steps=original_inference_steps)
        return run_sampler(
            self, pipe, prompts,
            timesteps=schedule.timesteps,
            step_fn=self._step_fn(schedule),
            draws_noise=self.draws_noise(schedule),
            eta=1.0,
            guidance_scale=guidance_scale, generator=generator, latents=latents, hooks=hooks, grad=grad, seeds=seeds,
            output=output, height=height, width=width, prompt_embeds=prompt_embeds,
        )  # fmt: skip

    def log_prob(
        self,
        pipe,
        traj: Trajectory,
        step_index: int,
        *,
        indices: Sequence[int] | torch.Tensor | None = None,
        return_step: bool = False,
    ) -> torch.Tensor | StepOutput:
        """Recompute the log-prob of step `step_index` of `traj` under the current weights (see `DDIMSampler`).

        Returns `[B]` log-probs (0 for the deterministic last step), or the `StepOutput` with `return_step`.
        """
        schedule = self.schedule(pipe, timesteps=traj.timesteps.cpu())
        return recompute_log_prob(
            self, pipe, traj, step_index, timesteps=schedule.timesteps, step_fn=self._step_fn(schedule),
            indices=indices, return_step=return_step,
        )
