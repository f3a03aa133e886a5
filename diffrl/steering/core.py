"""The model-agnostic core that every steering method runs on.

A steering method never touches a UNet, a VAE or a scheduler. It sees a `DenoisingProcess` — a model output (ε̂ or
a flow velocity), a stochastic step, an x̂0 formula and a decoder — plus a reward, both reached through a
`SteerContext` that batches rows, counts model and reward evaluations and times them. A diffusers pipeline becomes a
`DenoisingProcess` in `diffrl/steering/pipeline.py` (UNet pipelines: SD 1.x/2.x/XL, LCM) or
`diffrl/steering/flow_process.py` (flow matching: SD3, FLUX), on top of the samplers' step math; the analytic 2-D
Gaussian-mixture toy of the tests is another one. All run through the same method code, so the toy's closed-form
checks test the code that steers images.

Rows and conditions: a method lays its particles out as rows `[N, ...]`; `cond` (`LongTensor [N]`) says which
prompt each row belongs to. Methods keep rows of one prompt together (`cond = arange(B).repeat_interleave(k)`), so a
`[N]` tensor reshapes to `[B, k]` per prompt group.

Why a loop of its own rather than the samplers' hook chain (`samplers.base.SamplerHook`): the same method code has
to run on models that are not diffusers pipelines (the closed-form toy has no UNet, VAE or text conditioning); FK
resamples x_t before the step, so every copy of an ancestor draws its own noise at once (a hook can re-index the
particles only after the step, leaving the copies of x_{t-1} identical for a step); and the accounting (NFE, reward
evaluations, time outside them) needs every model and reward call to pass through one place. The steps themselves
are the samplers' (`DDIMSampler.step`, `LCMSampler.step`, `FlowSampler.step`, via `pipeline.PipelineProcess` and
`flow_process.FlowProcess`), so a steered chain takes exactly the steps the sampler's own `sample` takes (tested at
η = 0 for DDIM, and with the same noise for the flow SDE).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from diffrl.errors import UserError


class DenoisingProcess(Protocol):
    """What steering needs from a diffusion model, for a fixed set of conditions (prompts).

    Step indices run `0 .. num_steps - 1` from the noisiest timestep to the last one; the step at index `i` maps
    x_t to x_{t-1}, and the output of step `num_steps - 1` is the final sample.
    """

    num_steps: int

    def initial_latents(self, cond: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """x_T for each row of `cond` (`[N, ...]`), already scaled as the first step expects."""

    def predict(self, latents: torch.Tensor, step_index: int, cond: torch.Tensor) -> torch.Tensor:
        """The model output (ε̂, or a flow's velocity v; with classifier-free guidance applied) at x_t for each row.

        A process whose model call draws noise per particle (CADS's condition noise, `diffrl.steering.cads`) says so
        with a true attribute `particle_noise` and takes `predict(..., particles=)`: each row's particle slot
        (`LongTensor [N]`), which `SteerContext.predict` then passes."""

    def step(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor, *, generator=None) -> Any:
        """One stochastic step; returns an object with `prev_sample`, `pred_x0` and `std` (`[N]` or broadcastable)."""

    def pred_x0(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor) -> torch.Tensor:
        """x̂0(x_t) from the model output, differentiable in `latents` and `model_output`."""

    def guidance_coefficient(self, step_index: int) -> float:
        """c_t: adding γ·∇ r to the score at `step_index` shifts the model output by −γ·c_t·∇ r (reward-gradient
        guidance; √(1 − ᾱ_t) for ε̂, σ/(1 − σ) for a flow velocity, see `guidance.py`). A process predicting ε̂ may
        give `alpha_bar(step_index)` (ᾱ_t) instead."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents x0 to what the reward scores (images `[N, 3, H, W]` in [0, 1]), differentiable."""


@dataclass
class Scored:
    """Objective values of a batch of clean latents and the decoded samples they came from."""

    objective: torch.Tensor  # [N] reward × sign, so that higher is always better for the method
    samples: torch.Tensor  # [N, ...] decoded (images), kept so the final selection needs no second decode


@dataclass
class SteerOutput:
    """What every steering method returns: one sample per prompt, its raw reward, and the accounting."""

    images: torch.Tensor  # [B, ...] selected sample per prompt
    scores: torch.Tensor  # [B] raw reward of each selected sample (the reward's own sign)
    info: dict = field(default_factory=dict)


def _sync(tensor: torch.Tensor) -> None:
    # CUDA runs asynchronously; without a sync the timers would charge model time to whatever waits next.
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class SteerContext:
    """A `DenoisingProcess` and a reward as a steering method uses them: batched, counted and timed.

    Args:
        process (`DenoisingProcess`):
            The model.
        reward (`Callable`):
            A reward: `reward(samples, prompts, metadata)` returns an object with `scores` (`[N]`); it has
            attributes `name`, `differentiable` and `higher_is_better`, as `rewards.Reward` does.
        prompts (`list[str]`):
            One prompt per condition; row `n` of a batch belongs to `prompts[cond[n]]`.
        metadata (`list[dict]`, *optional*):
            Per-prompt metadata handed to the reward (e.g. what a verifier checks).
        batch_size (`int`, *optional*):
            Rows per model or reward call; defaults to all rows at once.
    """

    def __init__(self, process, reward, prompts: Sequence[str], *, metadata=None, batch_size: int | None = None):
        self.process = process
        self.reward = reward
        self.prompts = list(prompts)
        self.metadata = None if metadata is None else list(metadata)
        if self.metadata is not None and len(self.metadata) != len(self.prompts):
            raise UserError(
                f"got {len(self.metadata)} metadata entries for {len(self.prompts)} prompts; give one per prompt"
            )
        if batch_size is not None and batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        # A reward that says lower is better is steered on its negation; scores are reported in its own sign.
        self.sign = 1.0 if getattr(reward, "higher_is_better", True) else -1.0
        self.num_steps = process.num_steps
        self.nfe = 0  # model evaluations, one per row per call (a classifier-free-guidance pair counts once)
        self.nfe_grad = 0  # of those, evaluations that kept a graph for a backward pass
        self.reward_evals = 0  # samples scored
        self.reward_grad_evals = 0  # of those, scored with a graph for a backward pass
        self.backward_passes = 0
        # time inside evaluations: model calls, decoding, reward calls, backward passes through them
        self.timers = {"model_s": 0.0, "decode_s": 0.0, "reward_s": 0.0, "backward_s": 0.0}
        # time in the sampler's own step (its arithmetic and noise draws): not an evaluation, but plain sampling
        # spends it too, so the accounting reports it apart from the method's own work
        self.step_s = 0.0
        self._started = time.perf_counter()

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def require_differentiable(self, method: str) -> None:
        if not getattr(self.reward, "differentiable", False):
            name = getattr(self.reward, "name", type(self.reward).__name__)
            raise UserError(
                f"{method} needs a differentiable reward and '{name}' is not; pick a differentiable one "
                "(`diffrl ls rewards`) or use best-of-n, fk or svdd, which need only reward values"
            )

    def chunks(self, num_rows: int) -> list[slice]:
        size = self.batch_size or max(num_rows, 1)
        return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]

    def initial_latents(self, cond: torch.Tensor, generator=None) -> torch.Tensor:
        return self.process.initial_latents(cond, generator)

    def predict(self, latents: torch.Tensor, step_index: int, cond: torch.Tensor, *, grad: bool = False,
                particles: torch.Tensor | None = None):
        """Model output for every row, in chunks of `batch_size`; with `grad=False` no graph is kept.

        `particles` (`LongTensor [N]`, *optional*): each row's particle slot, for a process that draws noise per
        particle (CADS); defaults to the row index. A method passes it where its rows are not its particles (SVDD's
        candidates share their chain's slot) or are a chunk of them (guidance).
        """
        start = time.perf_counter()
        if getattr(self.process, "particle_noise", False):
            slots = torch.arange(len(latents)) if particles is None else particles.cpu()
            calls = [(s, {"particles": slots[s]}) for s in self.chunks(len(latents))]
        else:
            calls = [(s, {}) for s in self.chunks(len(latents))]
        with torch.set_grad_enabled(grad):
            outs = [self.process.predict(latents[s], step_index, cond[s], **extra) for s, extra in calls]
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        _sync(out)
        self.timers["model_s"] += time.perf_counter() - start
        self.nfe += len(latents)
        self.nfe_grad += len(latents) if grad else 0
        return out

    def step(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor, *, generator=None):
        start = time.perf_counter()
        out = self.process.step(model_output, step_index, latents, generator=generator)
        _sync(out.prev_sample)
        self.step_s += time.perf_counter() - start
        return out

    def pred_x0(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor) -> torch.Tensor:
        return self.process.pred_x0(model_output, step_index, latents)

    def score(self, clean_latents: torch.Tensor, cond: torch.Tensor, *, grad: bool = False) -> Scored:
        """Decode clean latents and score them; the objective is the reward times `sign` (higher is better)."""
        objectives, samples = [], []
        for s in self.chunks(len(clean_latents)):
            with torch.set_grad_enabled(grad):
                start = time.perf_counter()
                decoded = self.process.decode(clean_latents[s])
                _sync(decoded)
                middle = time.perf_counter()
                rows = cond[s].tolist()
                prompts = [self.prompts[c] for c in rows]
                metadata = None if self.metadata is None else [self.metadata[c] for c in rows]
                scores = self.reward(decoded, prompts, metadata).scores
                scores = torch.as_tensor(scores, device=clean_latents.device).to(torch.float32)
                _sync(scores)
                self.timers["decode_s"] += middle - start
                self.timers["reward_s"] += time.perf_counter() - middle
            objectives.append(scores * self.sign)
            samples.append(decoded)
        self.reward_evals += len(clean_latents)
        self.reward_grad_evals += len(clean_latents) if grad else 0
        return Scored(torch.cat(objectives), torch.cat(samples))

    def grad(self, output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """d output / d inputs (output a scalar); the backward pass is timed on its own."""
        start = time.perf_counter()
        (gradient,) = torch.autograd.grad(output, inputs)
        _sync(gradient)
        self.timers["backward_s"] += time.perf_counter() - start
        self.backward_passes += 1
        return gradient

    def accounting(self, method: str, **extra) -> dict:
        """NFE, reward evaluations and the time split.

        `overhead_s` is the wall time outside model, decode, reward and backward calls: everything a method spends
        beyond its evaluations. It splits into `step_s` (the sampler's step math and noise, which plain sampling
        spends too) and `method_s` (the method's own work: weights, resampling, selection, gathering rows).
        """
        wall = time.perf_counter() - self._started
        counted = sum(self.timers.values())
        overhead = max(wall - counted, 0.0)
        info = {
            "method": method,
            "reward": getattr(self.reward, "name", type(self.reward).__name__),
            "num_prompts": self.num_prompts,
            "num_steps": self.num_steps,
            "nfe": self.nfe,
            "nfe_per_prompt": self.nfe / max(self.num_prompts, 1),
            "nfe_grad": self.nfe_grad,
            "reward_evals": self.reward_evals,
            "reward_evals_per_prompt": self.reward_evals / max(self.num_prompts, 1),
            "reward_grad_evals": self.reward_grad_evals,
            "backward_passes": self.backward_passes,
            "wall_s": wall,
            **self.timers,
            "overhead_s": overhead,
            "overhead_frac": overhead / wall if wall > 0 else 0.0,
            "step_s": self.step_s,
            "method_s": max(overhead - self.step_s, 0.0),
        }
        info.update(extra)
        return info


def rows_per_prompt(num_prompts: int, per_prompt: int, device=None) -> torch.Tensor:
    """`cond` for `per_prompt` rows per prompt, rows of one prompt adjacent: `[0, 0, 1, 1, ...]`."""
    return torch.arange(num_prompts, device=device).repeat_interleave(per_prompt)


def sample_chain(ctx: SteerContext, latents: torch.Tensor, cond: torch.Tensor, generator=None) -> torch.Tensor:
    """Plain ancestral sampling from x_T to the final clean latents, no steering."""
    for i in range(ctx.num_steps):
        model_output = ctx.predict(latents, i, cond)
        latents = ctx.step(model_output, i, latents, generator=generator).prev_sample
    return latents


def is_deterministic(step_output) -> bool:
    """True when a step adds no noise (DDIM's last step, eta = 0): its candidates would all be equal."""
    std = getattr(step_output, "std", None)
    if std is None:
        return False
    return bool(torch.as_tensor(std).abs().max() == 0)


def gather_rows(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Pick rows per group: `tensor` `[B * k, ...]` (groups adjacent), `indices` `[B, k]` in `0..k-1`; returns
    `[B * k, ...]`.

    The resampled row `j` of group `b` is the old row `indices[b, j]` of the same group; a particle never moves to
    another prompt.
    """
    num_groups, k = indices.shape
    offsets = torch.arange(num_groups, device=indices.device).unsqueeze(1) * k
    flat = (indices + offsets).reshape(-1).to(tensor.device)
    return tensor[flat]


def select_per_prompt(values: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """Index (`[B]`, into rows `[B * k]`) of the highest value within each prompt's group."""
    k = len(values) // num_prompts
    best = values.view(num_prompts, k).argmax(dim=1)
    return best + torch.arange(num_prompts, device=values.device) * k


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok or math.isnan(value):
        bound = "at least 0" if allow_zero else "positive"
        raise UserError(f"{name} must be a {bound} number, got {value!r}")
