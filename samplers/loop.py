"""The denoising loop every sampler runs: hooks, differentiable mode and the trajectory bookkeeping.

A sampler supplies its schedule's `timesteps` and one function, `step_fn(model_output, step_index, x_t,
prev_sample, noise)` (its Gaussian step, returning a `StepOutput`); `run_sampler` does the rest of `sample()` for
every sampler, DDIM, LCM and flow alike (conditioning, per-sample generators and start noise, the guided model call,
decoding, the `Trajectory`) and `recompute_log_prob` the rest of `log_prob()`. What differs between model families
(text encoders, the denoiser call, latent shapes, decoding) comes from the pipeline's family (`diffrl.models`).
Inside, `DenoisingLoop` draws per-sample noise, runs the hook chain (see `samplers.base`), keeps or drops the graph
per `GradPolicy`, checkpoints kept denoiser calls, and records latents `[B, T+1, ...]` and log-probs `[B, T]`. Per
step the only work besides the denoiser is elementwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import Conditioning, module_dtype
from samplers.base import (
    GradPolicy,
    SamplerHook,
    StepContext,
    StepEdit,
    StepOutput,
    Trajectory,
    check_trajectory,
    step_dtype,
)
from samplers.noise import draw_noise, make_generators

# `step_fn(model_output, step_index, x_t, prev_sample, noise) -> StepOutput`: one step of a sampler's schedule,
# drawing x_{t-1} with `noise` when `prev_sample` is None, else scoring `prev_sample`
StepFn = Callable[..., StepOutput]


def eta_step_fn(step_at: Callable[..., StepOutput], schedule, etas: Sequence[float]) -> StepFn:
    """The `StepFn` of a sampler whose step takes η: `step_at(schedule, i, model_output, x_t, eta=etas[i], ...)`."""
    return lambda model_output, i, x_t, prev_sample, noise: step_at(
        schedule, i, model_output, x_t, eta=etas[i], prev_sample=prev_sample, noise=noise
    )


@dataclass
class LoopResult:
    latents: torch.Tensor  # [B, T+1, C, h, w] fp32, detached
    log_probs: torch.Tensor  # [B, T] fp32, detached
    final_latents: torch.Tensor  # [B, C, h, w], with its graph in differentiable mode
    cond: Conditioning  # after any re-indexing by hooks
    prompts: list[str]
    grad_steps: list[int]
    nfe: int
    extras: dict


class DenoisingLoop:
    """One sampling run. Built by a sampler's `sample`; hooks reach it through `StepContext`.

    Args:
        sampler: the sampler object (exposed to hooks as `ctx.sampler`).
        pipe: the diffusers pipeline.
        timesteps (`torch.Tensor` `[T]`): model timesteps (moved to the latents' device once).
        predict_fn (`Callable[[Tensor, int, Conditioning], Tensor]`): guided model output, fp32.
        step_fn (`StepFn`): `step_fn(model_output, i, x_t, prev_sample, noise)`.
        cond (`Conditioning`): per-sample conditioning.
        prompts (`list[str]`), generators (`list[torch.Generator]`): one per sample.
        draws_noise (`list[bool]`): whether step i draws noise from the generators (keeps the per-sample
            random streams aligned with diffusers' own schedulers).
        evals_per_row (`int`): UNet rows per latent row (2 with classifier-free guidance), for `nfe`.
        hooks (`Sequence[SamplerHook]`), grad (`GradPolicy`, *optional*).
    """

    def __init__(
        self,
        *,
        sampler,
        pipe,
        timesteps: torch.Tensor,
        predict_fn: Callable[[torch.Tensor, int, Conditioning], torch.Tensor],
        step_fn: StepFn,
        cond: Conditioning,
        prompts: list[str],
        generators: Sequence[torch.Generator],
        draws_noise: Sequence[bool],
        evals_per_row: int,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
    ):
        self.sampler, self.pipe = sampler, pipe
        self.family = model_family(pipe)
        self.num_steps = len(timesteps)
        self.timesteps_device = timesteps.to(self.family.denoiser.device)
        self._predict_fn, self._step_fn = predict_fn, step_fn
        self.cond, self.prompts = cond, list(prompts)
        self.generators = list(generators)
        self.draws_noise = list(draws_noise)
        self.evals_per_row = evals_per_row
        self.hooks = tuple(hooks)
        for hook in self.hooks:
            if not isinstance(hook, SamplerHook):
                raise TypeError(f"hook {hook!r} has no before_step/after_step; wrap functions in StepHook")
        self.grad = grad if grad is not None else GradPolicy("none")
        self.kept: set[int] = set()
        # the conditioning this step's model calls use: `cond` unless a before_step hook replaced it (CADS)
        self.step_cond: Conditioning | None = None
        self.nfe = 0
        self.extras: dict = {}

    # -- model calls ------------------------------------------------------------------------------------

    def current_cond(self) -> Conditioning:
        """The conditioning of this step's model calls: a hook's replacement (`ctx.cond = ...`) or the batch's."""
        return self.step_cond if self.step_cond is not None else self.cond

    def predict(self, x: torch.Tensor, step_index: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Guided model output for `x`; `rows[j]` picks the conditioning of row j (hooks: candidates, particles)."""
        cond = self.current_cond() if rows is None else self.current_cond().select(rows)
        self.nfe += x.shape[0] * self.evals_per_row
        return self._predict_fn(x, step_index, cond)

    def predict_for_step(self, x: torch.Tensor, step_index: int) -> torch.Tensor:
        """The step's own model call: with a graph (and checkpointed) only in kept steps."""
        if step_index not in self.kept:
            with torch.no_grad():
                return self.predict(x, step_index)
        if self.grad.checkpoint:
            self.nfe += x.shape[0] * self.evals_per_row
            return checkpoint(self._predict_fn, x, step_index, self.current_cond(), use_reentrant=False)
        return self.predict(x, step_index)

    def take_step(self, model_output, step_index, x_t, *, prev_sample=None, noise=None) -> StepOutput:
        return self._step_fn(model_output, step_index, x_t, prev_sample, noise)

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, x_T: torch.Tensor) -> LoopResult:
        """Denoise from `x_T` (`[B, C, h, w]` fp32) through all steps."""
        self.kept = set(self.grad.kept_steps(self.num_steps))
        latents = [x_T.detach()]  # x_T, then each step's result
        log_probs: list[torch.Tensor] = []
        # the start latents carry a graph only when differentiating w.r.t. them (noise optimisation)
        x = x_T if (self.kept and x_T.requires_grad) else x_T.detach()
        for i in range(self.num_steps):
            # once a kept step has run, x carries a graph and the (affine) step map must keep it
            with torch.set_grad_enabled(i in self.kept or x.requires_grad):
                self.step_cond = None
                ctx = StepContext(loop=self, step_index=i, x_t=x)
                for hook in self.hooks:
                    replaced = hook.before_step(ctx)
                    if replaced is not None:
                        ctx._noise_pred = replaced
                noise = None
                if self.draws_noise[i]:
                    noise = draw_noise(self.generators, x.shape[1:], x.device, x.dtype)
                ctx.step = self._step_fn(ctx.noise_pred, i, ctx.x_t, None, noise)
                for hook in self.hooks:
                    edit = hook.after_step(ctx)
                    if edit is not None:
                        latents, log_probs = self._apply(edit, ctx, latents, log_probs)
            step = ctx.step
            latents.append(step.prev_sample.detach())
            log_probs.append(step.log_prob.detach())
            x = step.prev_sample
        self.step_cond = None
        return LoopResult(
            latents=torch.stack(latents, dim=1),
            log_probs=torch.stack(log_probs, dim=1),
            final_latents=x,
            cond=self.cond,
            prompts=self.prompts,
            grad_steps=sorted(self.kept),
            nfe=self.nfe,
            extras=self.extras,
        )

    def _apply(self, edit: StepEdit, ctx: StepContext, latents: list, log_probs: list):
        """Apply an after-step edit to the particle set and everything recorded about it."""
        i = ctx.step_index
        if edit.ancestors is not None:
            a = edit.ancestors.to(device=ctx.x_t.device, dtype=torch.long)
            if a.shape != (len(self.prompts),):
                raise ValueError(f"StepEdit.ancestors must have shape [{len(self.prompts)}], got {tuple(a.shape)}")
            latents = [h[a] for h in latents]
            log_probs = [h[a] for h in log_probs]
            self.cond = self.cond.select(a)
            if self.step_cond is not None:
                self.step_cond = self.step_cond.select(a)
            picked = a.tolist()
            self.prompts = [self.prompts[j] for j in picked]
            ctx.x_t = ctx.x_t[a]
            ctx._noise_pred = ctx._noise_pred[a]
            s = ctx.step
            ctx.step = replace(
                s, prev_sample=s.prev_sample[a], mean=s.mean[a], log_prob=s.log_prob[a], pred_x0=s.pred_x0[a]
            )
            # generators stay with their slots, so resampled copies of one particle draw different noise
            self.extras.setdefault("ancestors", []).append((i, a.cpu()))
        if edit.prev_sample is not None:
            # same mean and std (the step is a function of x_t and the prediction); new sample, new log-prob
            ctx.step = self._step_fn(ctx.noise_pred, i, ctx.x_t, edit.prev_sample, None)
        return latents, log_probs


def decode_images(family, final_latents: torch.Tensor, grad: GradPolicy | None) -> torch.Tensor:
    """Decode the final latents; with a graph only when the grad policy asks for it and the latents carry one."""
    if grad is None or not grad.decode or not final_latents.requires_grad:
        with torch.no_grad():
            return family.decode(final_latents.detach())
    if grad.checkpoint:
        return checkpoint(family.decode, final_latents, use_reentrant=False)
    return family.decode(final_latents)


def run_sampler(
    sampler,
    pipe,
    prompts: Sequence[str] | str | None,
    *,
    timesteps: torch.Tensor,
    step_fn: StepFn,
    draws_noise: Sequence[bool],
    guidance_scale: float,
    eta: float | tuple[float, ...],
    generator=None,
    latents: torch.Tensor | None = None,
    hooks: Sequence[SamplerHook] = (),
    grad: GradPolicy | None = None,
    seeds: Sequence[int] | None = None,
    output: str = "images",
    height: int | None = None,
    width: int | None = None,
    detach_uncond: bool = False,
    **conditioning,
) -> Trajectory:
    """The body of every sampler's `sample()`; the sampler brings only its schedule and its step.

    Args:
        sampler: the sampler (its `name` and `noise_device` are read; hooks see it as `ctx.sampler`).
        timesteps (`torch.Tensor` `[T]`): the schedule's model timesteps, in sampling order.
        step_fn (`StepFn`): the sampler's step at step index i.
        draws_noise (`list[bool]`): whether step i draws noise (see `DenoisingLoop`).
        eta (`float` or `tuple[float, ...]`): recorded in the trajectory as given.
        detach_uncond (`bool`): the family's CFG call as `recompute_log_prob` makes it for a trainer that keeps the
            gradient off the unconditional branch (the same calls, so the same numbers, in rollout and training).
        conditioning: `negative_prompt`, `prompt_embeds`, ... for the family's `encode`.
        Others: as `DDIMSampler.sample`.
    """
    if output not in ("images", "latents"):
        raise UserError(f"output must be 'images' or 'latents', got {output!r}")
    family = model_family(pipe)
    network = family.denoiser
    device, dtype = network.device, module_dtype(network)
    shape, height, width = family.latent_shape(height, width)
    cond, prompts = family.encode(prompts, guidance_scale=guidance_scale, height=height, width=width, **conditioning)
    batch = len(cond)
    generators, seeds = make_generators(batch, seeds=seeds, generator=generator, device=sampler.noise_device or device)
    if latents is None:
        # the start noise: init_noise_sigma is 1 for DDIM and LCM, and σ_0 = 1 is pure noise for flows
        x_T = draw_noise(generators, shape, device, step_dtype(dtype))
    else:
        if tuple(latents.shape) != (batch, *shape):
            raise UserError(f"latents must have shape {(batch, *shape)}, got {tuple(latents.shape)}")
        x_T = latents.to(device=device, dtype=step_dtype(dtype))

    timesteps_device = timesteps.to(device)

    def predict(x, i, c: Conditioning):
        return family.model_output(x, timesteps_device[i], c, guidance_scale, dtype, detach_uncond=detach_uncond)

    loop = DenoisingLoop(
        sampler=sampler,
        pipe=pipe,
        timesteps=timesteps,
        predict_fn=predict,
        step_fn=step_fn,
        cond=cond,
        prompts=prompts,
        generators=generators,
        draws_noise=draws_noise,
        evals_per_row=2 if cond.guided else 1,
        hooks=hooks,
        grad=grad,
    )
    result = loop.run(x_T)
    images = decode_images(family, result.final_latents, grad) if output == "images" else None
    return Trajectory(
        latents=result.latents,
        timesteps=timesteps,
        log_probs=result.log_probs,
        prompts=result.prompts,
        seeds=seeds,
        guidance_scale=float(guidance_scale),
        eta=eta,
        num_steps=len(timesteps),
        sampler=sampler.name,
        images=images,
        final_latents=result.final_latents,
        grad_steps=result.grad_steps,
        nfe=result.nfe,
        extras=result.extras,
        **result.cond.trajectory_fields(),
    )


def recompute_log_prob(
    sampler,
    pipe,
    traj: Trajectory,
    step_index: int,
    *,
    timesteps: torch.Tensor,
    step_fn: StepFn,
    indices: Sequence[int] | torch.Tensor | None = None,
    return_step: bool = False,
    detach_uncond: bool = False,
) -> torch.Tensor | StepOutput:
    """The body of every sampler's `log_prob()`: one batched model call at step `step_index` of `traj`, guided
    exactly as in the rollout, scored by `step_fn` (the schedule rebuilt from `traj` gives `timesteps`).
    `detach_uncond`: the gradient flows through the conditional CFG branch only (same value)."""
    check_trajectory(traj, sampler.name, step_index)
    if not torch.equal(timesteps, traj.timesteps.cpu()):
        raise ValueError("the pipeline's scheduler gives other timesteps than the trajectory was sampled with")
    family = model_family(pipe)
    sub = traj if indices is None else traj.select(indices)
    network = family.denoiser
    device, dtype = network.device, module_dtype(network)
    cond = Conditioning.from_trajectory(sub).to(device)
    if cond.guided != family.uses_cfg(traj.guidance_scale):
        raise ValueError("the trajectory's guidance does not match this pipeline (a CFG batch vs an embedded "
                         "guidance)")
    x_t = sub.latents[:, step_index].to(device)
    t = timesteps[step_index].to(device)
    model_output = family.model_output(x_t, t, cond, traj.guidance_scale, dtype, detach_uncond=detach_uncond)
    step = step_fn(model_output, step_index, x_t, sub.latents[:, step_index + 1].to(device), None)
    return step if return_step else step.log_prob
