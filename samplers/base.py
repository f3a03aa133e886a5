"""The sampler contract: step outputs, trajectories, differentiable mode, hooks, and the shared Gaussian math.

A *sampler* turns a diffusers pipeline into a stochastic policy. Each denoising step is a Gaussian
`x_{t-1} ~ N(mean, std² I)` whose mean depends on the model; the sampler records every latent and the
log-probability of every step, so trainers (DDPO, DPOK, D3PO, RLCM) can recompute it under new weights,
and differentiable trainers (DRaFT, AlignProp) can backpropagate through chosen steps.

Log-probabilities are the MEAN over latent dimensions of the elementwise Gaussian log density (as the
DDPO, D3PO and Flow-GRPO reference code computes them, so the published PPO clip ranges mean the same
thing here). A deterministic step (`std == 0`: DDIM with `eta = 0`, DDIM's last step when
`set_alpha_to_one=True`, LCM's last step) is a point mass; its log-prob is defined as 0 in the rollout and
in every recomputation, so its PPO ratio is exactly 1 and it carries no policy gradient.

Hooks
-----
A hook steers sampling without touching sampler internals. It is any object with two methods (see
`SamplerHook`; `StepHook` wraps two plain functions). At step `i` of `T`, with latents `x_t` (`[B, C, h, w]`,
fp32) and `ctx` a `StepContext`:

1. `before_step(ctx) -> Tensor | None`: before the step. `ctx.noise_pred` is the model output after
   classifier-free guidance (computed on first access, so a hook that builds its own prediction, e.g. with
   a graph to `x_t` for reward guidance, does not pay for a second UNet call). Return a tensor to replace
   the noise prediction (DPS / reward-gradient guidance), or `None` to leave it. A hook may also assign
   `ctx.cond` (a `Conditioning` with the batch's rows) before the prediction is computed: this step's model
   calls then use it, the batch's own conditioning and the trajectory stay unchanged (CADS, `samplers.cads`).
2. The sampler takes the step with the (possibly replaced) prediction and draws its noise.
3. `after_step(ctx) -> StepEdit | None`: `ctx.step` is the `StepOutput` (next latents, mean, std, log-prob,
   pred_x0). Return `StepEdit(ancestors=...)` to re-index the whole particle set (FK resampling: every
   per-sample record — latent history, log-probs, prompt embeddings, prompts — follows its ancestor, while
   each slot keeps its own noise generator so resampled copies diverge afterwards), and/or
   `StepEdit(prev_sample=...)` to replace the next latents (SVDD candidate selection). A replaced
   `prev_sample` gets its log-prob re-evaluated under the step's Gaussian, so the stored log-probs stay
   consistent with what `log_prob` recomputes.

Hooks run under the sampler's grad mode (no graph at all in a plain rollout): a hook that needs gradients,
e.g. of a reward with respect to x_t, opens `torch.enable_grad()` itself and returns detached tensors.

Hooks form a chain: `sample(..., hooks=(h1, h2))` calls `h1` then `h2` at each stage, and `h2` sees `h1`'s
edits. For steering methods a context also offers `ctx.model(x, step_index, rows)` (the guided model
prediction for any latents, e.g. SVDD candidates or a graph-carrying `x_t`), `ctx.to_pred_x0(noise_pred, x)`,
`ctx.take_step(...)`, `ctx.decode(latents)` (images in [0, 1] for a reward) and `ctx.extras` (a dict saved in
the trajectory). `ctx.nfe` counts UNet rows evaluated so far (a guided step on B samples counts 2B).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch

from diffrl.errors import UserError
from diffrl.models.base import Conditioning, step_dtype

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


# ----------------------------------------------------------------------------------------------------------
# Math shared by the samplers (pure functions of tensors)


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """Elementwise log density of `N(mean, std²)` at `x`: `−(x − μ)² / (2σ²) − log σ − ½ log 2π`, shaped like `x`.
    `std` is a positive number or a tensor broadcastable to `x`. PXPO weights these per latent position."""
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device)
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """Mean over all but the first dimension of `gaussian_log_density`: averaged over the `C·h·w` latent
    dimensions. Returns `[B]`."""
    return gaussian_log_density(x, mean, std).mean(dim=tuple(range(1, x.ndim)))


def step_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """`gaussian_log_prob` with the point-mass convention: zeros `[B]` when `std == 0` (a deterministic step)."""
    if std == 0:
        # times 0 rather than new zeros: keeps the result on the model's graph, so a loss over deterministic
        # steps only still backpropagates (to zero) instead of failing
        return 0 * mean.sum(dim=tuple(range(1, mean.ndim)))
    return gaussian_log_prob(x, mean, std)


def scalar32(fn: Callable[..., torch.Tensor], *values: float) -> float:
    """Evaluate `fn` on 0-d float32 tensors made from `values` and return a Python float.

    The per-step constants (√ᾱ_t, σ_t, ...) are computed once per schedule this way, with the same torch
    float32 scalar ops diffusers' schedulers use (torch's float32 `** 0.5` is not always the correctly
    rounded square root), so the loop multiplies by exactly the numbers diffusers would.
    """
    return fn(*(torch.tensor(v, dtype=torch.float32) for v in values)).item()


def pred_x0_and_eps(
    model_output: torch.Tensor, x_t: torch.Tensor, sqrt_alpha: float, sqrt_beta: float, prediction_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted clean sample x̂0 and noise ε̂ from a model output, for the three diffusers parameterisations.

    With `sqrt_alpha` = √ᾱ_t and `sqrt_beta` = √(1−ᾱ_t): epsilon: x̂0 = (x_t − √(1−ᾱ_t) ε̂)/√ᾱ_t;
    v_prediction: x̂0 = √ᾱ_t x_t − √(1−ᾱ_t) v, ε̂ = √ᾱ_t v + √(1−ᾱ_t) x_t; sample: x̂0 = output,
    ε̂ = (x_t − √ᾱ_t x̂0)/√(1−ᾱ_t).
    """
    if prediction_type == "epsilon":
        return (x_t - sqrt_beta * model_output) / sqrt_alpha, model_output
    if prediction_type == "v_prediction":
        return sqrt_alpha * x_t - sqrt_beta * model_output, sqrt_alpha * model_output + sqrt_beta * x_t
    if prediction_type == "sample":
        return model_output, (x_t - sqrt_alpha * model_output) / sqrt_beta
    raise ValueError(f"prediction_type {prediction_type!r} is not one of {PREDICTION_TYPES}")


def dynamic_threshold(x0: torch.Tensor, ratio: float, max_value: float) -> torch.Tensor:
    """Imagen's dynamic thresholding of x̂0 (per sample: s = clamp(quantile(|x̂0|, ratio), 1, max); x̂0 ← clamp/s)."""
    flat = x0.reshape(x0.shape[0], -1)
    s = torch.quantile(flat.abs(), ratio, dim=1).clamp(min=1, max=max_value)[:, None]
    return (torch.maximum(torch.minimum(flat, s), -s) / s).reshape(x0.shape)


def clip_pred_x0(x0: torch.Tensor, scheduler_config) -> torch.Tensor:
    """Apply the scheduler config's `thresholding` / `clip_sample` to x̂0, as diffusers' DDIM/LCM steps do."""
    if scheduler_config.get("thresholding", False):
        return dynamic_threshold(
            x0,
            scheduler_config.get("dynamic_thresholding_ratio", 0.995),
            scheduler_config.get("sample_max_value", 1.0),
        )
    if scheduler_config.get("clip_sample", False):
        limit = scheduler_config.get("clip_sample_range", 1.0)
        return x0.clamp(-limit, limit)
    return x0


def warn_if_log_probs_differ(
    recomputed: torch.Tensor, stored: torch.Tensor, *, atol: float = 1e-5, where: str = ""
) -> float:
    """The runtime check of the PPO invariant: warn when recomputed log-probs differ from the rollout's.

    Call it on the first inner step (the weights have not moved, so the ratio must be 1). Returns the
    largest absolute difference.
    """
    diff = (recomputed.detach().float() - stored.detach().float().to(recomputed.device)).abs().max().item()
    if diff > atol:
        warnings.warn(
            f"recomputed log-probs differ from the rollout's by {diff:.2e} (> {atol:g})"
            f"{' at ' + where if where else ''}:"
            " the PPO ratio is not 1 before any update; check that sampling and training use the same pipeline,"
            " dtype, guidance scale and eta",
            stacklevel=2,
        )
    return diff


def check_trajectory(traj: Trajectory, sampler_name: str, step_index: int) -> None:
    """Fail early when a trajectory is recomputed by the wrong sampler or at a step it does not have."""
    if traj.sampler != sampler_name:
        raise ValueError(f"this trajectory was sampled by the {traj.sampler!r} sampler, not {sampler_name!r}")
    if not 0 <= step_index < traj.num_steps:
        raise IndexError(f"step_index {step_index} out of range for {traj.num_steps} steps")


def in_step_dtype(model_output: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step function's inputs in the dtype of its math: `step_dtype` of the wider of the two."""
    dtype = step_dtype(torch.promote_types(model_output.dtype, x_t.dtype))
    return model_output.to(dtype), x_t.to(dtype)


def current_schedule(schedule, how: str):
    """The schedule a sampler's `step` uses: `schedule` (the one given, else the sampler's last one); an error that
    says `how` to build one when there is none yet."""
    if schedule is None:
        raise ValueError(f"no schedule yet: call {how} or sample() first")
    return schedule


def timestep_index(timesteps: torch.Tensor, t) -> int:
    """The step index of timestep `t` in a schedule's `timesteps` `[T]`."""
    matches = (timesteps == int(t)).nonzero()
    if len(matches) == 0:
        raise ValueError(f"timestep {int(t)} is not in this schedule {timesteps.tolist()}")
    return int(matches[0])


# ----------------------------------------------------------------------------------------------------------
# Records


@dataclass
class StepOutput:
    """One denoising step as a Gaussian policy.

    Args:
        prev_sample (`torch.Tensor` `[B, C, h, w]`): the next latents x_{t-1} (drawn, or the one passed in).
        mean (`torch.Tensor` `[B, C, h, w]`): the mean of the step's Gaussian (fp32).
        std (`torch.Tensor`, 0-d): its standard deviation σ_t (0 for a deterministic step).
        log_prob (`torch.Tensor` `[B]`): mean over latent dimensions of log N(prev_sample; mean, σ_t²).
        pred_x0 (`torch.Tensor` `[B, C, h, w]`): the model's prediction of the clean latents.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    pred_x0: torch.Tensor

    @classmethod
    def gaussian(cls, prev_sample: torch.Tensor, mean: torch.Tensor, std: float, pred_x0: torch.Tensor) -> StepOutput:
        """The record of x_{t-1} ~ N(mean, std² I), scored at `prev_sample` without its graph (`step_log_prob`)."""
        dtype = step_dtype(mean.dtype)
        log_prob = step_log_prob(prev_sample.detach().to(dtype), mean, std)
        std_tensor = torch.full((), std, dtype=dtype, device=mean.device)
        return cls(prev_sample=prev_sample, mean=mean, std=std_tensor, log_prob=log_prob, pred_x0=pred_x0)


# fields of Trajectory that hold one entry per sample (indexed by `select`, concatenated by `cat`)
_PER_SAMPLE = ("latents", "log_probs", "images", "final_latents", *(f.name for f in fields(Conditioning)))
# text embeddings padded per batch with a mask (Qwen-Image: to the batch's longest prompt): `cat` zero-pads them and
# their masks to the longest of the batches it joins
_MASKED_TEXT = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}


@dataclass
class Trajectory:
    """A batch of sampled chains and everything needed to recompute their log-probs.

    Args:
        latents (`torch.Tensor` `[B, T+1, C, h, w]`): fp32, detached; `latents[:, 0]` is the start noise x_T,
            `latents[:, i+1]` the result of step `i`, `latents[:, T]` the final latents.
        timesteps (`torch.Tensor` `[T]`): the model timesteps, on CPU: int64 for DDIM/LCM, float32 σ·1000 for the
            flow samplers.
        log_probs (`torch.Tensor` `[B, T]`): fp32, detached; the log-prob of each step (0 on deterministic steps).
        prompt_embeds (`torch.Tensor` `[B, L, D]`), and the other fields of `diffrl.models.base.Conditioning`
            (`negative_prompt_embeds`, `pooled_prompt_embeds`, ..., `negative_prompt_embeds_mask`; *optional*): the
            batch's text conditioning as the denoiser is fed it, described there (`Conditioning.from_trajectory`).
        prompts (`list[str]`): the prompts (empty strings when only embeddings were given).
        seeds (`list[int]`, *optional*): per-sample seeds; sample i's start noise and step noise come from
            `torch.Generator(noise_device).manual_seed(seeds[i])`. `None` when generators were passed in.
        guidance_scale (`float`), eta (`float`), num_steps (`int`): the settings used.
        sampler (`str`): `"ddim"`, `"lcm"`, `"flow"` or `"flow_cps"`, the sampler that produced it.
        images (`torch.Tensor` `[B, 3, H, W]`, *optional*): float in [0, 1]; `None` with `output="latents"`.
            Carries a graph in differentiable mode when the `GradPolicy` backpropagates through the decoder.
        final_latents (`torch.Tensor` `[B, C, h, w]`, *optional*): the final latents with their graph in
            differentiable mode (`latents[:, -1]` is the detached copy).
        grad_steps (`list[int]`): steps that kept a graph to the model.
        nfe (`int`): UNet rows evaluated (a guided step on B samples counts 2B), hooks included.
        extras (`dict`): what hooks recorded (e.g. FK ancestries, potentials).
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    log_probs: torch.Tensor
    prompt_embeds: torch.Tensor
    prompts: list[str]
    seeds: list[int] | None
    guidance_scale: float
    eta: float | tuple[float, ...]  # one η, or one per step
    num_steps: int
    sampler: str
    images: torch.Tensor | None = None
    final_latents: torch.Tensor | None = None
    # the rest of `Conditioning`'s fields, same names and order (`Conditioning.from_trajectory` reads them)
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    add_time_ids: torch.Tensor | None = None
    timestep_cond: torch.Tensor | None = None
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None
    grad_steps: list[int] = field(default_factory=list)
    nfe: int = 0
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, indices: Sequence[int] | torch.Tensor) -> Trajectory:
        """The sub-batch `indices` (a list or an int64 tensor; order is kept, repeats allowed)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        changes = {}
        for name in _PER_SAMPLE:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[index.to(value.device)]
        picked = index.tolist()
        changes["prompts"] = [self.prompts[i] for i in picked]
        changes["seeds"] = None if self.seeds is None else [self.seeds[i] for i in picked]
        return replace(self, **changes)

    @staticmethod
    def cat(trajectories: Sequence[Trajectory]) -> Trajectory:
        """Concatenate trajectories sampled with the same settings along the batch dimension."""
        first = trajectories[0]
        for other in trajectories[1:]:
            same = (other.num_steps, other.eta, other.guidance_scale, other.sampler)
            if same != (first.num_steps, first.eta, first.guidance_scale, first.sampler):
                raise ValueError("cannot concatenate trajectories sampled with different settings")
        trajectories = _pad_masked_text(trajectories)
        changes = {}
        for name in _PER_SAMPLE:
            values = [getattr(t, name) for t in trajectories]
            changes[name] = None if any(v is None for v in values) else torch.cat(values)
        changes["prompts"] = [p for t in trajectories for p in t.prompts]
        seeds = [t.seeds for t in trajectories]
        changes["seeds"] = None if any(s is None for s in seeds) else [s for group in seeds for s in group]
        changes["nfe"] = sum(t.nfe for t in trajectories)
        changes["extras"] = {}
        return replace(first, **changes)

    def to(self, device) -> Trajectory:
        """The same trajectory with every per-sample tensor moved to `device` (timesteps stay on CPU)."""
        changes = {n: getattr(self, n).to(device) for n in _PER_SAMPLE if getattr(self, n) is not None}
        return replace(self, **changes)


def _pad_masked_text(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The trajectories with each masked text field zero-padded (mask 0) to the longest `L` among them."""
    trajectories = list(trajectories)
    for name, mask_name in _MASKED_TEXT.items():
        if any(getattr(t, mask_name) is None for t in trajectories):
            continue
        length = max(getattr(t, name).shape[1] for t in trajectories)
        trajectories = [replace(t, **{name: _pad_dim1(getattr(t, name), length),
                                      mask_name: _pad_dim1(getattr(t, mask_name), length)}) for t in trajectories]
    return trajectories


def _pad_dim1(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    pad = x.new_zeros(x.shape[0], length - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], dim=1)


@dataclass(frozen=True)
class GradPolicy:
    """Which denoising steps keep a graph to the model in differentiable sampling (DRaFT, AlignProp, ReNO).

    In a kept step the UNet runs with gradients; in any other step its output is treated as a constant
    (`noise_pred.detach()`), so parameters receive gradient only through kept steps. The latent chain itself
    stays differentiable from the first kept step on (the step map is affine in x_t), so gradient from the
    end reaches every kept step; steps before the first kept one run under `no_grad` unless the start
    latents require grad (noise optimisation), in which case the whole chain keeps its graph.

    Args:
        keep (`str`, defaults to `"none"`): `"none"`, `"all"`, `"last"` (the last `k` steps: DRaFT-K),
            `"random"` (`k` distinct steps drawn uniformly per batch) or `"random_last"` (the last K steps with
            K drawn uniformly from 1..`k` per batch: AlignProp's randomised truncation).
        k (`int`, defaults to 1): the K above.
        checkpoint (`bool`, defaults to `False`): recompute each kept UNet call (and the VAE decode) in the
            backward pass (`torch.utils.checkpoint`); same gradient, far less memory.
        decode (`bool`, defaults to `True`): backpropagate through the VAE decode into `Trajectory.images`.
    """

    keep: str = "none"
    k: int = 1
    checkpoint: bool = False
    decode: bool = True

    KINDS = ("none", "all", "last", "random", "random_last")

    def __post_init__(self):
        if self.keep not in self.KINDS:
            raise UserError(f"GradPolicy keep={self.keep!r} is not one of {self.KINDS}")
        if self.keep in ("last", "random", "random_last") and self.k < 1:
            raise UserError(f"GradPolicy k={self.k} must be at least 1 for keep={self.keep!r}")

    def kept_steps(self, num_steps: int, generator: torch.Generator | None = None) -> list[int]:
        """Indices (0-based, in sampling order) of the steps that keep a graph; random kinds use `generator`."""
        k = min(self.k, num_steps)
        if self.keep == "none":
            return []
        if self.keep == "all":
            return list(range(num_steps))
        if self.keep == "last":
            return list(range(num_steps - k, num_steps))
        if self.keep == "random":
            return sorted(torch.randperm(num_steps, generator=generator)[:k].tolist())
        drawn = int(torch.randint(1, k + 1, (1,), generator=generator))
        return list(range(num_steps - drawn, num_steps))


# ----------------------------------------------------------------------------------------------------------
# Hooks


@dataclass
class StepEdit:
    """What an `after_step` hook changes.

    Args:
        ancestors (`torch.Tensor` `[B]` int64, *optional*): new particle i continues particle `ancestors[i]`
            (applied first).
        prev_sample (`torch.Tensor` `[B, C, h, w]`, *optional*): replaces the next latents (after re-indexing).
    """

    ancestors: torch.Tensor | None = None
    prev_sample: torch.Tensor | None = None


@runtime_checkable
class SamplerHook(Protocol):
    """A steering hook; see the module docstring for when each method runs and what it may return."""

    def before_step(self, ctx: StepContext) -> torch.Tensor | None: ...

    def after_step(self, ctx: StepContext) -> StepEdit | None: ...


@dataclass
class StepHook:
    """A `SamplerHook` from plain functions: `StepHook(before=fn)`, `StepHook(after=fn)` or both."""

    before: Callable[[StepContext], torch.Tensor | None] | None = None
    after: Callable[[StepContext], StepEdit | None] | None = None

    def before_step(self, ctx):
        return None if self.before is None else self.before(ctx)

    def after_step(self, ctx):
        return None if self.after is None else self.after(ctx)


class StepContext:
    """What a hook sees at one step. Attributes:

    - `step_index` (`int`), `num_steps` (`int`), `t` (0-d int64 tensor, the model timestep)
    - `x_t` (`[B, C, h, w]` fp32), `noise_pred` (after guidance; lazily computed), `pred_x0`
    - `step` (`StepOutput`, `None` before the step), `prompts`, `pipe`, `sampler`, `extras`, `nfe`
    - `cond` (this step's `Conditioning`; assignable before the prediction), `generators` (one per sample slot)
    - `model(x, step_index=None, rows=None)`: guided model output for latents `x`; `rows[j]` is the sample
      whose conditioning row j uses (default: row j of the batch). Runs under the caller's grad mode.
    - `to_pred_x0(noise_pred, x, step_index=None)`, `take_step(noise_pred, x, ..., noise=None)`, `decode(latents)`.
    """

    def __init__(self, *, loop, step_index: int, x_t: torch.Tensor):
        self._loop = loop
        self.step_index = step_index
        self.num_steps = loop.num_steps
        self.t = loop.timesteps_device[step_index]
        self.x_t = x_t
        self._noise_pred = None
        self.step: StepOutput | None = None

    # the batch as the loop currently holds it (after any re-indexing by earlier hooks)
    @property
    def prompts(self) -> list[str]:
        return self._loop.prompts

    @property
    def pipe(self):
        return self._loop.pipe

    @property
    def sampler(self):
        return self._loop.sampler

    @property
    def extras(self) -> dict:
        return self._loop.extras

    @property
    def nfe(self) -> int:
        return self._loop.nfe

    @property
    def generators(self) -> list[torch.Generator]:
        """One generator per sample slot, the loop's own (read `initial_seed()`; drawing from them would move the
        sampler's noise)."""
        return self._loop.generators

    @property
    def cond(self):
        """The `Conditioning` this step's model calls use (the batch's, unless a hook replaced it)."""
        return self._loop.current_cond()

    @cond.setter
    def cond(self, value):
        if self._noise_pred is not None:
            raise RuntimeError("the step's prediction is already computed; replace ctx.cond in a before_step hook "
                               "that runs before any hook reads ctx.noise_pred")
        if len(value) != len(self._loop.cond):
            raise ValueError(f"ctx.cond must keep the batch's {len(self._loop.cond)} rows, got {len(value)}")
        self._loop.step_cond = value

    @property
    def noise_pred(self) -> torch.Tensor:
        if self._noise_pred is None:
            self._noise_pred = self._loop.predict_for_step(self.x_t, self.step_index)
        return self._noise_pred

    @property
    def pred_x0(self) -> torch.Tensor:
        if self.step is not None:
            return self.step.pred_x0
        return self.to_pred_x0(self.noise_pred, self.x_t)

    def model(self, x: torch.Tensor, step_index: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._loop.predict(x, self.step_index if step_index is None else step_index, rows)

    def to_pred_x0(self, noise_pred: torch.Tensor, x: torch.Tensor, step_index: int | None = None) -> torch.Tensor:
        i = self.step_index if step_index is None else step_index
        return self._loop.take_step(noise_pred, i, x, prev_sample=x).pred_x0

    def take_step(self, noise_pred, x, step_index=None, *, prev_sample=None, noise=None) -> StepOutput:
        i = self.step_index if step_index is None else step_index
        return self._loop.take_step(noise_pred, i, x, prev_sample=prev_sample, noise=noise)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self._loop.family.decode(latents)


# ----------------------------------------------------------------------------------------------------------
# The sampler protocol


@runtime_checkable
class Sampler(Protocol):
    """A stochastic denoising policy over a diffusers pipeline (`DDIMSampler`, `LCMSampler`, `FlowSampler`).

    Callers read its capabilities, class attributes, instead of testing its name. Its `sample` and `log_prob` are
    `samplers.loop.run_sampler` and `recompute_log_prob` given its schedule's timesteps and its step.
    """

    name: str  # the registry key (`samplers.SAMPLERS`), recorded in its trajectories
    per_step_eta: bool  # takes η, a number or one per step; False: the schedule fixes the noise (η = default_eta)
    consistency: bool  # guidance is the UNet's w-embedding (one UNet row per sample); no negative prompt
    flow: bool  # a flow-matching sampler (FlowMatchEulerDiscreteScheduler pipelines)
    default_num_steps: int  # sampling defaults, as the diffusers pipeline it serves
    default_guidance_scale: float
    default_eta: float

    def sample(
        self,
        pipe,
        prompts: Sequence[str] | None,
        *,
        num_steps: int,
        guidance_scale: float,
        eta: float,
        generator=None,
        latents: torch.Tensor | None = None,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
        negative_prompt=None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        seeds: Sequence[int] | None = None,
        output: str = "images",
        **kwargs: Any,
    ) -> Trajectory: ...

    def step(
        self, model_output: torch.Tensor, t, x_t: torch.Tensor, *, prev_sample=None, generator=None, **kwargs: Any
    ) -> StepOutput: ...

    def log_prob(self, pipe, traj: Trajectory, step_index: int, **kwargs: Any) -> torch.Tensor | StepOutput: ...
