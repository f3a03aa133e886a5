"""The denoising loop every sampler runs: hooks, differentiable mode and the trajectory bookkeeping.

A sampler supplies two functions — `predict(x, step_index, cond)` (the guided model output) and
`step(model_output, step_index, x_t, prev_sample, noise)` (its Gaussian step, returning a `StepOutput`) — and
`DenoisingLoop` does the rest the same way for all of them: draw per-sample noise, run the hook chain
(see `samplers.base`), keep or drop the graph per `GradPolicy`, checkpoint kept UNet calls, and record
latents `[B, T+1, ...]` and log-probs `[B, T]`. Per step the only work besides the UNet is elementwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from samplers.base import GradPolicy, SamplerHook, StepContext, StepEdit, StepOutput
from samplers.conditioning import Conditioning, decode_latents, draw_noise


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
        step_fn (`Callable[..., StepOutput]`): `step_fn(model_output, i, x_t, prev_sample, noise)`.
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
        step_fn: Callable[..., StepOutput],
        cond: Conditioning,
        prompts: list[str],
        generators: Sequence[torch.Generator],
        draws_noise: Sequence[bool],
        evals_per_row: int,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
    ):
        self.sampler, self.pipe = sampler, pipe
        self.num_steps = len(timesteps)
        self.timesteps_device = timesteps.to(pipe.unet.device)
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
        self.nfe = 0
        self.extras: dict = {}

    # -- model calls ------------------------------------------------------------------------------------

    def predict(self, x: torch.Tensor, step_index: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Guided model output for `x`; `rows[j]` picks the conditioning of row j (hooks: candidates, particles)."""
        cond = self.cond if rows is None else self.cond.select(rows)
        self.nfe += x.shape[0] * self.evals_per_row
        return self._predict_fn(x, step_index, cond)

    def predict_for_step(self, x: torch.Tensor, step_index: int) -> torch.Tensor:
        """The step's own model call: with a graph (and checkpointed) only in kept steps."""
        if step_index not in self.kept:
            with torch.no_grad():
                return self.predict(x, step_index)
        if self.grad.checkpoint:
            self.nfe += x.shape[0] * self.evals_per_row
            return checkpoint(self._predict_fn, x, step_index, self.cond, use_reentrant=False)
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
                ctx = StepContext(loop=self, step_index=i, x_t=x)
                for hook in self.hooks:
                    replaced = hook.before_step(ctx)
                    if replaced is not None:
                        ctx._noise_pred = replaced
                noise = None
                if self.draws_noise[i]:
                    noise = draw_noise(self.generators, x.shape[1:], x.device)
                ctx.step = self._step_fn(ctx.noise_pred, i, ctx.x_t, None, noise)
                for hook in self.hooks:
                    edit = hook.after_step(ctx)
                    if edit is not None:
                        latents, log_probs = self._apply(edit, ctx, latents, log_probs)
            step = ctx.step
            latents.append(step.prev_sample.detach())
            log_probs.append(step.log_prob.detach())
            x = step.prev_sample
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


def decode_images(pipe, final_latents: torch.Tensor, grad: GradPolicy | None) -> torch.Tensor:
    """Decode the final latents; with a graph only when the grad policy asks for it and the latents carry one."""
    if grad is None or not grad.decode or not final_latents.requires_grad:
        with torch.no_grad():
            return decode_latents(pipe, final_latents.detach())
    if grad.checkpoint:
        return checkpoint(decode_latents, pipe, final_latents, use_reentrant=False)
    return decode_latents(pipe, final_latents)
