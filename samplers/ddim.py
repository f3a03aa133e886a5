"""DDIM with eta as a Gaussian policy over a diffusers Stable Diffusion (1.x/2.x/XL) pipeline.

Paper: Song, Meng & Ermon, "Denoising Diffusion Implicit Models" (ICLR 2021), eqs. (12) and (16); used as
the step policy of DDPO (Black et al. 2023), DPOK (Fan et al. 2023) and D3PO (Yang et al. 2023), with η = 1.

Code name → paper notation:
    alphas_cumprod[t]   ᾱ_t        alpha_prod_prev  ᾱ_{t−1} (ᾱ of the previous timestep; `final_alpha_cumprod`
    model_output        ε̂ (or v)                    past the end of the schedule)
    pred_x0             x̂0 = (x_t − √(1−ᾱ_t) ε̂) / √ᾱ_t
    variance            (1−ᾱ_{t−1})/(1−ᾱ_t) · (1 − ᾱ_t/ᾱ_{t−1})
    std                 σ_t = η · √variance
    mean                μ = √ᾱ_{t−1} x̂0 + √(1 − ᾱ_{t−1} − σ_t²) ε̂
    prev_sample         x_{t−1} = μ + σ_t z,  z ~ N(0, I)
    log_prob            mean over latent dims of log N(x_{t−1}; μ, σ_t² I)   (0 when σ_t = 0)

The schedule comes from the pipeline's scheduler config (`alphas_cumprod` from its betas, `set_timesteps`
with its `timestep_spacing` and `steps_offset`, `set_alpha_to_one`, `prediction_type` epsilon / v_prediction /
sample, `clip_sample` / `thresholding`), built through `DDIMScheduler.from_config`, so any SD checkpoint's
scheduler config works. The math matches `DDIMScheduler.step` (diffusers 0.42, read and re-derived, not
copied); as there, the previous timestep is `t − num_train_timesteps // num_steps` and the model output
itself (not one re-derived from a clipped x̂0) is the direction term. Unlike there, the step math always
runs in fp32, even when the UNet runs in fp16/bf16, and latents are kept in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from samplers.loop import eta_step_fn, recompute_log_prob, run_sampler
from samplers.noise import noise_for_step


@dataclass(frozen=True)
class DDIMConstants:
    """The scalars of one DDIM step (float32 values as Python floats)."""

    sqrt_alpha: float  # √ᾱ_t
    sqrt_beta: float  # √(1 − ᾱ_t)
    sqrt_alpha_prev: float  # √ᾱ_{t−1}
    std: float  # σ_t = η √variance
    direction: float  # √(1 − ᾱ_{t−1} − σ_t²), the weight of ε̂ in the mean


def ddim_constants(alpha_prod_t: float, alpha_prod_prev: float, eta: float) -> DDIMConstants:
    """Step scalars from ᾱ_t, ᾱ_{t−1} and η (DDIM eqs. 12 and 16), in torch float32 scalar arithmetic."""

    def variance(a_t, a_prev):  # (1−ᾱ_{t−1})/(1−ᾱ_t) · (1 − ᾱ_t/ᾱ_{t−1})
        return ((1 - a_prev) / (1 - a_t)) * (1 - a_t / a_prev)

    std = scalar32(lambda a_t, a_prev: eta * variance(a_t, a_prev) ** 0.5, alpha_prod_t, alpha_prod_prev)
    return DDIMConstants(
        sqrt_alpha=scalar32(lambda a: a**0.5, alpha_prod_t),
        sqrt_beta=scalar32(lambda a: (1 - a) ** 0.5, alpha_prod_t),
        sqrt_alpha_prev=scalar32(lambda a: a**0.5, alpha_prod_prev),
        std=std,
        direction=scalar32(lambda a, s: (1 - a - s**2) ** 0.5, alpha_prod_prev, std),
    )


def ddim_step(
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    constants: DDIMConstants,
    *,
    prediction_type: str = "epsilon",
    scheduler_config: dict | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One DDIM step as a Gaussian, in fp32 (pure function; see the module docstring for the math).

    Args:
        model_output (`torch.Tensor` `[B, C, h, w]`): the (guided) model output at x_t.
        x_t (`torch.Tensor` `[B, C, h, w]`): the current latents.
        constants (`DDIMConstants`): from `ddim_constants(ᾱ_t, ᾱ_{t−1}, η)`.
        prediction_type (`str`, defaults to `"epsilon"`): what the model predicts.
        scheduler_config (`dict`, *optional*): `clip_sample`/`thresholding` settings applied to x̂0.
        prev_sample (`torch.Tensor`, *optional*): score this x_{t−1} instead of drawing one.
        noise (`torch.Tensor`, *optional*): z for the draw; required when `prev_sample` is `None` and σ_t > 0.
    """
    c = constants
    model_output, x_t = in_step_dtype(model_output, x_t)
    pred_x0, eps = pred_x0_and_eps(model_output, x_t, c.sqrt_alpha, c.sqrt_beta, prediction_type)
    pred_x0 = clip_pred_x0(pred_x0, scheduler_config or {})
    mean = c.sqrt_alpha_prev * pred_x0 + c.direction * eps
    if prev_sample is None:
        if c.std > 0 and noise is None:
            raise ValueError("a stochastic DDIM step (eta > 0) needs `noise` or `prev_sample`")
        prev_sample = mean if c.std == 0 else mean + c.std * noise.to(mean)
    return StepOutput.gaussian(prev_sample, mean, c.std, pred_x0)


@dataclass(frozen=True)
class DDIMSchedule:
    """The per-step constants of one (scheduler config, num_steps) pair, on CPU."""

    timesteps: torch.Tensor  # [T] int64, model timesteps in sampling order
    alphas_cumprod: tuple[float, ...]  # ᾱ_t per step
    alphas_cumprod_prev: tuple[float, ...]  # ᾱ_{t−1} per step
    config: dict  # the scheduler config (prediction_type, clip_sample, thresholding, ...)
    _by_eta: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, scheduler_config, num_steps: int) -> DDIMSchedule:
        from diffusers import DDIMScheduler

        scheduler = DDIMScheduler.from_config(scheduler_config)
        scheduler.set_timesteps(num_steps)
        timesteps = scheduler.timesteps.to("cpu", torch.long)
        # diffusers' DDIM convention, whatever the spacing: the previous timestep is a fixed stride back
        prev = timesteps - scheduler.config.num_train_timesteps // num_steps
        alphas = scheduler.alphas_cumprod  # fp32, as diffusers computes it from the betas
        alpha_prev = torch.where(prev >= 0, alphas[prev.clamp(min=0)], scheduler.final_alpha_cumprod)
        return cls(
            timesteps=timesteps,
            alphas_cumprod=tuple(alphas[timesteps].tolist()),
            alphas_cumprod_prev=tuple(alpha_prev.tolist()),
            config=dict(scheduler.config),
        )

    def __len__(self) -> int:
        return len(self.timesteps)

    def index(self, t) -> int:
        return timestep_index(self.timesteps, t)

    def constants(self, i: int, eta: float) -> DDIMConstants:
        """Step `i`'s scalars for this η (computed once per η)."""
        if eta not in self._by_eta:
            pairs = zip(self.alphas_cumprod, self.alphas_cumprod_prev)
            self._by_eta[eta] = [ddim_constants(a_t, a_prev, eta) for a_t, a_prev in pairs]
        return self._by_eta[eta][i]


def step_etas(eta: float | Sequence[float], num_steps: int) -> tuple[float, ...]:
    """η of every step: a number applies to all `num_steps`; a sequence must have one value per step."""
    etas = (float(eta),) * num_steps if isinstance(eta, (int, float)) else tuple(float(e) for e in eta)
    if len(etas) != num_steps:
        raise UserError(f"eta: got {len(etas)} per-step values for {num_steps} steps; give one per step or a number")
    if any(not e >= 0 for e in etas):  # also NaN
        raise UserError(f"eta must be >= 0, got {eta}")
    return etas


class DDIMSampler:
    """DDIM-with-η sampling, step and log-prob recomputation over a diffusers Stable Diffusion pipeline.

    Classifier-free guidance runs as one batched UNet call per step; each sample draws its start noise and
    step noise from its own generator (from `seeds`), so its chain does not depend on the batch it is in.
    See `samplers.base` for hooks and `GradPolicy`.

    Args:
        noise_device (`str` or `torch.device`, *optional*): where per-sample generators live; defaults to
            the UNet's device. `"cpu"` makes a seed give the same noise on every device.
    """

    name = "ddim"
    # capabilities: what callers read instead of testing the name
    per_step_eta = True  # η is a number or one value per step
    consistency = False  # classifier-free guidance with an unconditional batch half; takes a negative prompt
    flow = False
    # sampling defaults (diffusers' StableDiffusionPipeline: 50 steps, guidance 7.5, deterministic)
    default_num_steps = 50
    default_guidance_scale = 7.5
    default_eta = 0.0

    def __init__(self, *, noise_device=None):
        self.noise_device = noise_device
        self._schedules: dict = {}
        self._current: DDIMSchedule | None = None

    def schedule(self, pipe_or_config, num_steps: int) -> DDIMSchedule:
        """The step constants for a pipeline (or a scheduler config) and a step count (cached)."""
        config = getattr(pipe_or_config, "scheduler", pipe_or_config)
        config = getattr(config, "config", config)
        key = (json.dumps(dict(config), sort_keys=True, default=str), int(num_steps))
        if key not in self._schedules:
            self._schedules[key] = DDIMSchedule.from_config(config, num_steps)
        self._current = self._schedules[key]
        return self._current

    def _step_at(self, schedule, i, model_output, x_t, *, eta, prev_sample=None, noise=None) -> StepOutput:
        return ddim_step(
            model_output,
            x_t,
            schedule.constants(i, eta),
            prediction_type=schedule.config["prediction_type"],
            scheduler_config=schedule.config,
            prev_sample=prev_sample,
            noise=noise,
        )

    @staticmethod
    def draws_noise(schedule: DDIMSchedule, etas: Sequence[float]) -> list[bool]:
        """Whether each step draws noise: wherever η > 0 (as diffusers does, even where σ_t = 0, which keeps the
        per-sample random streams equal to its own)."""
        return [e > 0 for e in etas]

    def step(
        self,
        model_output: torch.Tensor,
        t,
        x_t: torch.Tensor,
        *,
        eta: float,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        noise: torch.Tensor | None = None,
        schedule: DDIMSchedule | None = None,
    ) -> StepOutput:
        """One step from timestep `t` (as `DDIMScheduler.step`, plus mean, std and log-prob).

        Args:
            model_output (`torch.Tensor` `[B, C, h, w]`): guided model output at `x_t`.
            t (`int` or 0-d `torch.Tensor`): a timestep of `schedule`.
            x_t (`torch.Tensor` `[B, C, h, w]`): current latents.
            eta (`float`): η.
            prev_sample (`torch.Tensor`, *optional*): score this x_{t−1} instead of sampling.
            generator (`torch.Generator` or a list of one per sample, *optional*): for the noise draw.
            noise (`torch.Tensor`, *optional*): the standard-normal z itself.
            schedule (`DDIMSchedule`, *optional*): defaults to the last one built by `schedule`/`sample`.
        """
        schedule = current_schedule(schedule or self._current, "sampler.schedule(pipe, num_steps)")
        i = schedule.index(t)
        noise = noise_for_step(generator, x_t, prev_sample=prev_sample, noise=noise, draws=eta > 0)
        return self._step_at(schedule, i, model_output, x_t, eta=eta, prev_sample=prev_sample, noise=noise)

    def sample(
        self,
        pipe,
        prompts: Sequence[str] | str | None,
        *,
        num_steps: int,
        guidance_scale: float,
        eta: float | Sequence[float],
        generator=None,
        latents: torch.Tensor | None = None,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
        negative_prompt: Sequence[str] | str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        seeds: Sequence[int] | None = None,
        output: str = "images",
        height: int | None = None,
        width: int | None = None,
    ) -> Trajectory:
        """Sample a batch and record its trajectory.

        Args:
            pipe: a `StableDiffusionPipeline`-like pipeline (`unet`, `vae`, `encode_prompt`, `scheduler`), or SDXL.
            prompts (`list[str]`): one per sample (`None` with `prompt_embeds`).
            num_steps (`int`): denoising steps T.
            guidance_scale (`float`): CFG scale s (no CFG when ≤ 1, as in diffusers).
            eta (`float` or `Sequence[float]`): η ≥ 0, or one η per step (e.g. stochastic only in a window of
                steps and deterministic elsewhere, as MixGRPO samples; the trajectory then keeps the tuple).
            generator (`torch.Generator` or list, *optional*): a list gives one generator per sample; a single
                generator seeds per-sample generators. Exclusive with `seeds`.
            latents (`torch.Tensor` `[B, C, h, w]`, *optional*): the start noise x_T (may require grad).
            hooks (`Sequence[SamplerHook]`, defaults to `()`): steering hooks, applied in order.
            grad (`GradPolicy`, *optional*): differentiable mode; `None` samples without any graph.
            negative_prompt (`str` or `list[str]`, *optional*): for the unconditional half of CFG.
            prompt_embeds, negative_prompt_embeds (`torch.Tensor`, *optional*): precomputed (cached) text
                embeddings; a one-row negative is broadcast. SDXL also takes the pooled ones.
            seeds (`list[int]`, *optional*): per-sample seeds (drawn from torch's global RNG when not given).
            output (`str`, defaults to `"images"`): `"images"` decodes with the VAE; `"latents"` skips it.
            height, width (`int`, *optional*): image size; defaults to the UNet's sample size.
        """
        if num_steps < 1:
            raise UserError(f"num_steps must be >= 1, got {num_steps}")
        etas = step_etas(eta, num_steps)
        schedule = self.schedule(pipe, num_steps)
        return run_sampler(
            self, pipe, prompts,
            timesteps=schedule.timesteps,
            step_fn=eta_step_fn(self._step_at, schedule, etas),
            draws_noise=self.draws_noise(schedule, etas),
            eta=etas[0] if isinstance(eta, (int, float)) else etas,
            guidance_scale=guidance_scale, generator=generator, latents=latents, hooks=hooks, grad=grad, seeds=seeds,
            output=output, height=height, width=width, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
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
        """Recompute the log-prob of step `step_index` of `traj` under the pipeline's current weights.

        Batched over the samples (one UNet call, guided exactly as in the rollout), with gradients when the
        caller has them enabled. Equals `traj.log_probs[:, step_index]` before any update, for any sub-batch.

        Args:
            pipe: the pipeline (same scheduler config; any weights).
            traj (`Trajectory`): a rollout of this sampler.
            step_index (`int`): which step (0-based, sampling order).
            indices (`list[int]` or `torch.Tensor`, *optional*): only these samples.
            return_step (`bool`, defaults to `False`): return the whole `StepOutput` (mean, std — e.g. for
                DPOK's policy-vs-reference KL — and pred_x0) instead of just `log_prob` `[B]`.
        """
        schedule = self.schedule(pipe, traj.num_steps)
        step_fn = eta_step_fn(self._step_at, schedule, step_etas(traj.eta, traj.num_steps))
        return recompute_log_prob(
            self, pipe, traj, step_index, timesteps=schedule.timesteps, step_fn=step_fn, indices=indices,
            return_step=return_step,
        )
