"""Reward-gradient guidance (DPS-style): push every step along the gradient of the reward of x̂0.

Chung et al., "Diffusion Posterior Sampling for General Noisy Inverse Problems" (2023), with a reward in place of a
measurement likelihood, as in universal / reward guidance (Bansal et al. 2023).

The guidance adds γ·∇_{x_t} r(D(x̂0(x_t))) to the score ∇ log p_t(x_t), where D decodes latents to images. The
gradient runs back through the reward, the decoder and the model at x_t, so the reward must be differentiable. The
model output then shifts by −γ·c_t·∇_{x_t} r, with c_t the process's `guidance_coefficient`:

ε-prediction (DDIM, LCM; x_t = √ᾱ_t·x0 + √(1−ᾱ_t)·ε): the noise prediction is a scaled score,
ε̂ = −√(1−ᾱ_t)·∇ log p_t(x_t), so c_t = √(1−ᾱ_t) and

    ε̃ = ε̂ − γ·√(1−ᾱ_t)·∇_{x_t} r,    x̂0(x_t) = (x_t − √(1−ᾱ_t)·ε̂) / √ᾱ_t.

Velocity (rectified flow, `flow_process.py`; x_σ = (1 − σ)·x0 + σ·ε, v = ε − x0, x̂0 = x − σ·v): Tweedie's formula
gives ε̂ = E[ε | x] = −σ·∇ log p_σ(x), and x = (1 − σ)·x̂0 + σ·ε̂ with v = ε̂ − x̂0 gives ε̂ = x + (1 − σ)·v, i.e.
v = (ε̂ − x) / (1 − σ) = −(x + σ·∇ log p_σ(x)) / (1 − σ). Adding γ·∇r to the score (ε̃ = ε̂ − γ·σ·∇r) gives

    ṽ = v − γ·σ/(1 − σ)·∇_x r,        c_σ = σ/(1 − σ),

the same as moving x̂0 by the step g = γ·σ²/(1 − σ)·∇_x r and reading v back through x̂0 = x − σ·v (ṽ = v − g/σ).
It is the ε-rule above under the change of variables x_vp = x/k, k = √((1 − σ)² + σ²) (then √ᾱ = (1 − σ)/k,
√(1−ᾱ) = σ/k and ∇_{x_vp} = k·∇_x), so both parameterisations steer alike; for Gaussian data and a linear reward
it gives the tilted model's velocity exactly (tested). At σ = 1 (the first step of every flow schedule) x carries no
information about x0: an exact model's x̂0 does not depend on x, so ∇_x r vanishes while σ/(1 − σ) diverges, and the
finite limit (−γ·Cov[x0]·∇r for a Gaussian posterior) needs the data covariance, which the model does not give. So
c = 0 there: pure-noise steps are never guided, and `guided_steps` in the info lists the steps that were.

Map from code to paper notation:
    `scale`             γ, the guidance strength
    `alpha_bar`         ᾱ_t
    `sigma`             σ, the flow's noise level
    `coefficient`       c_t, the model output's shift per unit of γ·∇r
    `reward_grad`       ∇_{x_t} r(D(x̂0(x_t)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, rows_per_prompt, select_per_prompt


@dataclass
class GuidanceConfig:
    scale: float = 1.0  # γ
    start: int = 0  # first guided step index (0 = noisiest)
    end: int | None = None  # last guided step index (inclusive); None: every step to the end
    num_samples: int = 1  # guided samples per prompt; the best final one is returned

    @property
    def latent_rows(self) -> int:
        """Latents held per prompt: every guided sample (bounded in `bounds.py`)."""
        return self.num_samples


def guided_output(model_output: torch.Tensor, reward_grad: torch.Tensor, coefficient: float, scale: float):
    """The model output after adding γ·∇r to the score: output − γ·c_t·∇_{x_t} r."""
    return model_output - scale * coefficient * reward_grad


def guided_noise(noise_pred: torch.Tensor, reward_grad: torch.Tensor, alpha_bar: float, scale: float) -> torch.Tensor:
    """ε̃ = ε̂ − γ·√(1−ᾱ_t)·∇_{x_t} r."""
    return guided_output(noise_pred, reward_grad, math.sqrt(1.0 - alpha_bar), scale)


def velocity_guidance_coefficient(sigma: float) -> float:
    """c_σ = σ/(1 − σ) of a rectified-flow velocity, 0 at σ = 1 (pure noise; see the module docstring)."""
    return 0.0 if sigma >= 1 else sigma / (1.0 - sigma)


def guided_velocity(velocity: torch.Tensor, reward_grad: torch.Tensor, sigma: float, scale: float) -> torch.Tensor:
    """ṽ = v − γ·σ/(1 − σ)·∇_x r (v unchanged at σ = 1)."""
    return guided_output(velocity, reward_grad, velocity_guidance_coefficient(sigma), scale)


def guidance_coefficient(process, step_index: int) -> float:
    """c_t of a `DenoisingProcess`: its own `guidance_coefficient`, or √(1 − ᾱ_t) for an ε-predicting process that
    gives only `alpha_bar` (as the tests' closed-form toy does)."""
    own = getattr(process, "guidance_coefficient", None)
    if own is not None:
        return float(own(step_index))
    return math.sqrt(1.0 - process.alpha_bar(step_index))


def reward_guidance(ctx: SteerContext, cfg: GuidanceConfig, generator=None) -> SteerOutput:
    """Sample with the model output shifted by the reward gradient at every step in `[start, end]` (but σ = 1)."""
    ctx.require_differentiable("reward guidance")
    if cfg.num_samples < 1:
        raise UserError(f"num_samples must be at least 1, got {cfg.num_samples}")
    last = ctx.num_steps - 1 if cfg.end is None else cfg.end
    in_range = [i for i in range(ctx.num_steps) if cfg.start <= i <= last] if cfg.scale != 0 else []
    coefficients = {i: guidance_coefficient(ctx.process, i) for i in in_range}
    guided_steps = [i for i in in_range if coefficients[i] != 0]  # c = 0 only at a flow's pure noise
    if in_range and not guided_steps:
        raise UserError(f"guidance steps {cfg.start}..{last} are all at pure noise (σ = 1), where a flow model's "
                        "guidance is 0; set start to 1 or later")
    cond = rows_per_prompt(ctx.num_prompts, cfg.num_samples)
    latents = ctx.initial_latents(cond, generator)
    cond = cond.to(latents.device)
    slots = torch.arange(len(latents))  # each chain's particle slot, for a process with per-particle noise (CADS)

    for i in range(ctx.num_steps):
        if i in guided_steps:
            # One chunk at a time, so the graph through model, decoder and reward never spans more rows than fit.
            model_output = torch.empty_like(latents)
            for rows in ctx.chunks(len(latents)):
                x_t = latents[rows].detach().requires_grad_(True)
                output = ctx.predict(x_t, i, cond[rows], grad=True, particles=slots[rows])
                objective = ctx.score(ctx.pred_x0(output, i, x_t), cond[rows], grad=True).objective
                reward_grad = ctx.grad(objective.sum(), x_t)
                model_output[rows] = guided_output(output.detach(), reward_grad, coefficients[i], cfg.scale)
        else:
            model_output = ctx.predict(latents, i, cond)
        latents = ctx.step(model_output, i, latents, generator=generator).prev_sample.detach()

    final = ctx.score(latents, cond)
    best = select_per_prompt(final.objective, ctx.num_prompts)
    info = ctx.accounting(
        "guidance", scale=cfg.scale, start=cfg.start, end=last, num_samples=cfg.num_samples, guided_steps=guided_steps
    )
    return SteerOutput(images=final.samples[best], scores=final.objective[best] * ctx.sign, info=info)
