"""Flow-matching sampling as a Gaussian policy over diffusers' SD3- and FLUX-class pipelines (Flow-GRPO's step).

Papers: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025, arXiv 2505.05470), eq. (9):
the reverse-time SDE that has the flow ODE's marginals, discretised with Euler–Maruyama, and σ_t = a·√(t/(1−t))
below it; Wang & Yu, "Coefficients-Preserving Sampling for Reinforcement Learning with Flow Matching" (CPS, 2025,
arXiv 2509.05952), whose step keeps the forward process's coefficients (1 − σ) on x0 and σ on the noise.

Notation (rectified flow, as diffusers' `FlowMatchEulerDiscreteScheduler`): x_σ = (1 − σ)·x0 + σ·ε, σ from 1
(noise) to 0 (data); the transformer predicts the velocity v = ε − x0; the model timestep is σ·1000.

Code name → paper notation (one step from σ to σ' = `sigma_next`, σ' < σ):
    sigma, sigma_next    t, t + Δt in the paper's time (Δt = `dt` = σ' − σ < 0)
    eta                  a, the noise level (Flow-GRPO: 0.7); 0 is the probability-flow ODE = diffusers' Euler step
    model_output         v_θ(x_t, t) after classifier-free guidance
    pred_x0              x̂0 = x − σ·v
    SDE (Flow-GRPO eq. 9):
      s                  σ_t = a·√(σ/(1 − σ))   (at σ = 1 the reference code uses 1 − σ' in the denominator; so do we)
      mean               μ = x·(1 + s²·dt/(2σ)) + v·(1 + s²·(1 − σ)/(2σ))·dt
      std                s·√(−dt)
    CPS:
      std                σ'·sin(a·π/2)
      mean               μ = (1 − σ')·x̂0 + √(σ'² − std²)·x̂1,  x̂1 = x + (1 − σ)·v the predicted noise
    std_dev_t            the reference code's name: the SDE's σ_t = s (std per √|Δt|), CPS's std; 0 on an ODE step
    prev_sample          x_σ' = μ + std·z, z ~ N(0, I)
    log_prob             mean over latent dims of log N(x_σ'; μ, std² I); 0 when std = 0 (see `samplers.base`).
                         CPS with `cps_log_prob="reference"`: −mean((x_σ' − μ)²), the reference code's convention

Both steps are written as μ = x_coef·x + v_coef·v with per-step scalars computed once in float32. With a = 0 both
reduce to x + dt·v, diffusers' Euler step, so `eta=0` reproduces the pipelines' own output. CPS's last step
(σ' = 0) has std 0: a point mass at x̂0. The SDE's last step is stochastic (std = a·σ at σ' = 0).

Log-prob conventions of a CPS step (`FlowSampler(cps_log_prob=...)`): `"gaussian"` (the default) is the Gaussian
log-density, as every other step here; `"reference"` is flow_grpo's `sde_step_with_logprob(sde_type="cps")`, the
squared distance alone, −mean((x_σ' − μ)²). They differ by more than a constant: gaussian = reference / (2·std²) −
log std − ½ log 2π, so a PPO log-ratio on the gaussian scale is 1/(2·std²) times the reference's (0.68× on the first
of 10 steps at a = 0.7 and shift 3, 7,900× on the ninth, the last stochastic one), and a clip range tuned on one
scale does not carry over to the other. Both conventions are tested against numbers from the reference code
(`tests/trainers/test_flow_grpo_parity.py`).

Differences from the reference code, on purpose: latents are kept unpacked (`[B, C, h, w]`) for FLUX too, so hooks,
rewards and the trajectory see the same shapes as for SD; they are packed into tokens only for the transformer call.

The schedule is the pipeline's: its scheduler config through `FlowMatchEulerDiscreteScheduler.set_timesteps`,
called as `StableDiffusion3Pipeline` (num_steps; μ from the image size when `use_dynamic_shifting`) or
`FluxPipeline` (σ = linspace(1, 1/T, T) with the resolution-dependent μ) call it (diffusers 0.42).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from samplers.base import (
    GradPolicy,
    SamplerHook,
    StepOutput,
    Trajectory,
    current_schedule,
    in_step_dtype,
    scalar32,
)
from samplers.ddim import step_etas
from samplers.loop import eta_step_fn, recompute_log_prob, run_sampler
from samplers.noise import noise_for_step

SDE_TYPES = ("sde", "cps")
CPS_LOG_PROBS = ("gaussian", "reference")  # the log-prob of a CPS step: Gaussian log-density, or flow_grpo's
CFG_GRADIENTS = ("both", "conditional")  # which CFG branches a recomputed step's gradient flows through


# ----------------------------------------------------------------------------------------------------------
# The step (pure math)


@dataclass(frozen=True)
class FlowConstants:
    """The scalars of one flow step from σ to σ' (float32 values as Python floats): μ = x_coef·x + v_coef·v."""

    sigma: float  # σ
    sigma_next: float  # σ'
    x_coef: float
    v_coef: float
    std: float  # 0 for a deterministic step
    std_dev_t: float = 0.0  # the reference code's std_dev_t: SDE σ_t = std / √|Δt|, CPS std (Flow-GRPO's KL uses it)


def sde_constants(sigma: float, sigma_next: float, eta: float) -> FlowConstants:
    """Flow-GRPO's SDE step (eq. 9) with noise level a = `eta`, in torch float32 scalar arithmetic."""
    if eta == 0:  # the ODE: exactly diffusers' Euler step x + dt·v
        dt = scalar32(lambda s, n: n - s, sigma, sigma_next)
        return FlowConstants(sigma, sigma_next, x_coef=1.0, v_coef=dt, std=0.0, std_dev_t=0.0)
    # σ/(1 − σ) is infinite at σ = 1; the reference code divides by 1 − σ' there instead
    denominator = sigma_next if sigma == 1 else sigma
    s = scalar32(lambda s, d: eta * (s / (1 - d)) ** 0.5, sigma, denominator)
    return FlowConstants(
        sigma,
        sigma_next,
        x_coef=scalar32(lambda s_t, sg, n: 1 + s_t**2 * (n - sg) / (2 * sg), s, sigma, sigma_next),
        v_coef=scalar32(lambda s_t, sg, n: (1 + s_t**2 * (1 - sg) / (2 * sg)) * (n - sg), s, sigma, sigma_next),
        std=scalar32(lambda s_t, sg, n: s_t * (sg - n) ** 0.5, s, sigma, sigma_next),
        std_dev_t=s,
    )


def cps_constants(sigma: float, sigma_next: float, eta: float) -> FlowConstants:
    """The coefficients-preserving step with noise level a = `eta`: std = σ'·sin(aπ/2),
    μ = (1 − σ')(x − σv) + √(σ'² − std²)(x + (1 − σ)v), written as x_coef·x + v_coef·v."""
    if eta == 0:
        return sde_constants(sigma, sigma_next, 0.0)
    std = scalar32(lambda n: n * math.sin(eta * math.pi / 2), sigma_next)
    c = scalar32(lambda n, sd: (n**2 - sd**2).clamp(min=0) ** 0.5, sigma_next, std)  # weight of x̂1
    return FlowConstants(
        sigma,
        sigma_next,
        x_coef=scalar32(lambda n, c: (1 - n) + c, sigma_next, c),
        v_coef=scalar32(lambda sg, n, c: -sg * (1 - n) + c * (1 - sg), sigma, sigma_next, c),
        std=std,
        std_dev_t=std,
    )


def flow_step(
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    constants: FlowConstants,
    *,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One flow step as a Gaussian, in fp32 (pure function; see the module docstring for the math).

    Args:
        model_output (`torch.Tensor` `[B, C, h, w]`): the (guided) velocity v at x_t.
        x_t (`torch.Tensor` `[B, C, h, w]`): the current latents x_σ.
        constants (`FlowConstants`): from `sde_constants` or `cps_constants`.
        prev_sample (`torch.Tensor`, *optional*): score this x_σ' instead of drawing one.
        noise (`torch.Tensor`, *optional*): z for the draw; required when `prev_sample` is `None` and std > 0.
    """
    c = constants
    v, x = in_step_dtype(model_output, x_t)
    mean = c.x_coef * x + c.v_coef * v
    pred_x0 = x - c.sigma * v
    if prev_sample is None:
        if c.std > 0 and noise is None:
            raise ValueError("a stochastic flow step (eta > 0) needs `noise` or `prev_sample`")
        prev_sample = mean if c.std == 0 else mean + c.std * noise.to(mean)
    return StepOutput.gaussian(prev_sample, mean, c.std, pred_x0)


def cps_reference_log_prob(step: StepOutput) -> StepOutput:
    """`step` with flow_grpo's CPS "log-prob": −mean over latent dims of (x_σ' − μ)², the Gaussian's 1/(2·std²) and
    constants dropped (`sde_step_with_logprob(sde_type="cps")`); 0 on a deterministic step (std = 0), as
    `samplers.base.step_log_prob`. Pure function."""
    if float(step.std) == 0:
        return step
    squared = (step.prev_sample.detach().to(step.mean.dtype) - step.mean) ** 2
    return replace(step, log_prob=-squared.mean(dim=tuple(range(1, squared.ndim))))


# ----------------------------------------------------------------------------------------------------------
# The schedule


def flow_family(pipe):
    """The pipeline's model family, which must be a flow-matching one."""
    family = model_family(pipe)
    if not family.flow:
        raise UserError(f"the flow sampler needs a flow-matching pipeline (SD3, FLUX class), not a "
                        f"{type(pipe).__name__}; use the ddim or lcm sampler")
    return family


@dataclass(frozen=True)
class FlowSchedule:
    """σ_0 = 1 > ... > σ_T = 0 and the model timesteps of one (scheduler config, num_steps, size), on CPU."""

    timesteps: torch.Tensor  # [T] float32, σ·num_train_timesteps as diffusers feeds the transformer
    sigmas: tuple[float, ...]  # T + 1 values, float32 as the scheduler holds them
    _by_eta: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, scheduler_config, set_timesteps: dict) -> FlowSchedule:
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        scheduler.set_timesteps(**set_timesteps)
        return cls(timesteps=scheduler.timesteps.to("cpu", torch.float32), sigmas=tuple(scheduler.sigmas.tolist()))

    def __len__(self) -> int:
        return len(self.timesteps)

    def index(self, t) -> int:
        matches = (self.timesteps == torch.as_tensor(t, dtype=torch.float32).cpu()).nonzero()
        if len(matches) == 0:
            raise ValueError(f"timestep {float(t)} is not in this schedule {self.timesteps.tolist()}")
        return int(matches[0])

    def constants(self, i: int, eta: float, sde_type: str) -> FlowConstants:
        key = (eta, sde_type)
        if key not in self._by_eta:
            make = sde_constants if sde_type == "sde" else cps_constants
            self._by_eta[key] = [make(s, n, eta) for s, n in zip(self.sigmas[:-1], self.sigmas[1:])]
        return self._by_eta[key][i]


# ----------------------------------------------------------------------------------------------------------
# The sampler


class FlowSampler:
    """Flow-matching sampling with Flow-GRPO's SDE (or CPS) step, step and log-prob recomputation, over a
    `StableDiffusion3Pipeline` or `FluxPipeline` (any pipeline with their transformer, VAE, `encode_prompt` and a
    `FlowMatchEulerDiscreteScheduler` config).

    `eta` is the noise level a: 0 is the ODE (diffusers' own Euler sampler), Flow-GRPO samples with 0.7; one value
    per step gives an SDE window (stochastic only there, as Flow-GRPO-Fast and MixGRPO). Per-sample generators,
    hooks and `GradPolicy` as in `DDIMSampler` (`samplers.base`). Latents are `[B, C, h, w]` for both families.

    Args:
        sde_type (`str`, defaults to `"sde"`): `"sde"` (Flow-GRPO eq. 9) or `"cps"` (coefficients-preserving).
            Recorded in the trajectory as the sampler name `"flow"` / `"flow_cps"`.
        cps_log_prob (`str`, defaults to `"gaussian"`): the log-prob of a CPS step: `"gaussian"`, the Gaussian
            log-density (as every other step); `"reference"`, flow_grpo's −mean((x − μ)²), whose PPO ratio a clip
            range published for the reference code means the same thing on (module docstring). No effect on SDE
            steps. Flow-GRPO sets it from `train.cps_log_prob`.
        cfg_gradient (`str`, defaults to `"both"`): which CFG branches a recomputed step's gradient flows through
            (`log_prob`): `"both"`, v = v_u + s·(v_c − v_u) as computed; `"conditional"`, the unconditional branch
            detached (flow_grpo's training step), and — in `sample` as in `log_prob`, so rollout and recomputation
            agree exactly — computed by its own call without a graph (SD3; the backward covers half the batch). The
            values agree with `"both"` to float rounding. Flow-GRPO sets it from `train.cfg_gradient`.
        noise_device (`str` or `torch.device`, *optional*): where per-sample generators live (the transformer's).
    """

    name = "flow"
    # capabilities: what callers read instead of testing the name
    per_step_eta = True  # the noise level a is a number or one value per step (SDE window)
    consistency = False
    flow = True
    # sampling defaults (diffusers' StableDiffusion3Pipeline: 28 steps, CFG 7.0, its deterministic Euler sampler;
    # FluxPipeline: 28 steps, embedded guidance 3.5, set by `adapt_defaults`)
    default_num_steps = 28
    default_guidance_scale = 7.0
    default_eta = 0.0

    def adapt_defaults(self, pipe) -> None:
        """The family's own default guidance: FLUX's is the transformer's embedded guidance, 3.5 in diffusers, not
        SD3's CFG 7.0."""
        self.default_guidance_scale = flow_family(pipe).default_guidance_scale

    def __init__(self, *, sde_type: str = "sde", cps_log_prob: str = "gaussian", cfg_gradient: str = "both",
                 noise_device=None):
        if sde_type not in SDE_TYPES:
            raise UserError(f"sde_type {sde_type!r} is not one of {SDE_TYPES}")
        if cps_log_prob not in CPS_LOG_PROBS:
            raise UserError(f"cps_log_prob {cps_log_prob!r} is not one of {CPS_LOG_PROBS}")
        self.sde_type = sde_type
        self.cps_log_prob = cps_log_prob
        if cfg_gradient not in CFG_GRADIENTS:
            raise UserError(f"cfg_gradient {cfg_gradient!r} is not one of {CFG_GRADIENTS}")
        self.cfg_gradient = cfg_gradient
        self.name = "flow" if sde_type == "sde" else "flow_cps"
        self.noise_device = noise_device
        self._schedules: dict = {}
        self._current: FlowSchedule | None = None

    def schedule(self, pipe, num_steps: int, latent_hw: tuple[int, int]) -> FlowSchedule:
        """The σ schedule for a pipeline, a step count and a latent size `(h, w)` (cached)."""
        config = pipe.scheduler.config
        kwargs = flow_family(pipe).schedule_kwargs(num_steps, latent_hw)
        key = (json.dumps(dict(config), sort_keys=True, default=str), json.dumps(kwargs, default=str))
        if key not in self._schedules:
            self._schedules[key] = FlowSchedule.from_config(config, kwargs)
        self._current = self._schedules[key]
        return self._current

    def _step_at(self, schedule, i, model_output, x_t, *, eta, prev_sample=None, noise=None) -> StepOutput:
        constants = schedule.constants(i, eta, self.sde_type)
        step = flow_step(model_output, x_t, constants, prev_sample=prev_sample, noise=noise)
        if self.sde_type == "cps" and self.cps_log_prob == "reference":
            step = cps_reference_log_prob(step)
        return step

    def step_constants(self, pipe, traj: Trajectory, step_index: int) -> FlowConstants:
        """The `FlowConstants` of step `step_index` of `traj` (σ, σ', std, the reference's std_dev_t), from the
        pipeline's schedule for the trajectory's step count and size."""
        schedule = self.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:]))
        return schedule.constants(step_index, step_etas(traj.eta, traj.num_steps)[step_index], self.sde_type)

    def draws_noise(self, schedule: FlowSchedule, etas: Sequence[float]) -> list[bool]:
        """Whether each step draws noise: wherever its std > 0 (a > 0; not CPS's last step)."""
        return [schedule.constants(i, e, self.sde_type).std > 0 for i, e in enumerate(etas)]

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
        schedule: FlowSchedule | None = None,
    ) -> StepOutput:
        """One step from model timestep `t` (as `FlowMatchEulerDiscreteScheduler.step` at a = 0, plus mean, std,
        log-prob). `schedule` defaults to the last one built by `schedule`/`sample`; others as `DDIMSampler.step`."""
        schedule = current_schedule(schedule or self._current, "sampler.schedule(pipe, num_steps, (h, w))")
        i = schedule.index(t)
        draws = schedule.constants(i, eta, self.sde_type).std > 0
        noise = noise_for_step(generator, x_t, prev_sample=prev_sample, noise=noise, draws=draws)
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
        max_sequence_length: int | None = None,
    ) -> Trajectory:
        """Sample a batch and record its trajectory.

        Args:
            pipe: a `StableDiffusion3Pipeline` or `FluxPipeline`.
            prompts (`list[str]`): one per sample (`None` with `prompt_embeds` and `pooled_prompt_embeds`).
            num_steps (`int`): denoising steps T.
            guidance_scale (`float`): SD3: the CFG scale (no CFG when ≤ 1); FLUX: the embedded guidance.
            eta (`float` or `Sequence[float]`): the noise level a ≥ 0, or one per step (SDE window).
            latents (`torch.Tensor` `[B, C, h, w]`, *optional*): start noise x_1, unpacked also for FLUX.
            max_sequence_length (`int`, *optional*): T5 tokens (default: the loaded folder's
                `_diffrl_max_sequence_length` (0 for tiny-shapes-flow), else the pipeline's: 256 SD3, 512 FLUX).
            Others: as `DDIMSampler.sample` (FLUX takes no negative prompt).
        """
        if num_steps < 1:
            raise UserError(f"num_steps must be >= 1, got {num_steps}")
        etas = step_etas(eta, num_steps)
        shape, _, _ = flow_family(pipe).latent_shape(height, width)
        schedule = self.schedule(pipe, num_steps, shape[1:])
        return run_sampler(
            self, pipe, prompts, timesteps=schedule.timesteps,
            step_fn=eta_step_fn(self._step_at, schedule, etas), draws_noise=self.draws_noise(schedule, etas),
            guidance_scale=guidance_scale,
            eta=etas[0] if isinstance(eta, (int, float)) else etas, generator=generator, latents=latents,
            hooks=hooks, grad=grad, seeds=seeds, output=output, height=height, width=width,
            negative_prompt=negative_prompt, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds, negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_sequence_length, detach_uncond=self.cfg_gradient == "conditional",
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
        """Recompute the log-prob of step `step_index` of `traj` under the pipeline's current weights: one batched
        transformer call, guided as in the rollout. Equals `traj.log_probs[:, step_index]` before any update.
        Arguments as `DDIMSampler.log_prob`; with `return_step` the `StepOutput` (mean and std for a KL)."""
        flow_family(pipe)
        schedule = self.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:]))
        eta = step_etas(traj.eta, traj.num_steps)[step_index]
        return recompute_log_prob(
            self, pipe, traj, step_index, timesteps=schedule.timesteps,
            step_fn=lambda v, i, x_t, prev, noise: self._step_at(schedule, i, v, x_t, eta=eta, prev_sample=prev),
            indices=indices, return_step=return_step, detach_uncond=self.cfg_gradient == "conditional",
        )  # fmt: skip
