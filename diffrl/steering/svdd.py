"""SVDD-PM: soft value-based decoding with the pretrained model as the value's posterior mean.

Li et al., "Derivative-Free Guidance in Continuous and Discrete Diffusion Models with Soft Value-Based Decoding"
(2024), Algorithm 1 with the "PM" value estimate.

At every step each particle draws M candidates x_{t-1}^{(m)} from the base sampler's transition; each candidate is
valued by v^{(m)} = r(x̂0(x_{t-1}^{(m)})), the reward of the model's own clean-sample estimate (one model evaluation
per candidate, reused as the chosen candidate's model output at the next step), and one candidate is kept: the
argmax for α = 0, otherwise a draw from softmax(v / α). At the last step the candidates are final samples and are
valued by their reward directly.

Map from code to paper notation:
    `num_candidates`   M, candidates per particle and step (the image code uses 20)
    `alpha`            α, the temperature of the soft selection; 0 selects greedily
    `values`           v, the soft value estimate r(x̂0(x_{t-1}))

Cost per particle: 1 + (T − 1)·M model evaluations and (T − 1)·M + M reward evaluations (a deterministic last
step — DDIM with ᾱ_prev = 1 — has one candidate only; with M = 1 only the final sample is scored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.errors import UserError
from diffrl.steering.core import SteerContext, SteerOutput, is_deterministic, rows_per_prompt, select_per_prompt


@dataclass
class SVDDConfig:
    num_candidates: int = 20  # M, candidates drawn per particle at each step
    alpha: float = 0.0  # α, selection temperature; 0 = argmax
    num_samples: int = 1  # independent SVDD chains per prompt; the best final one is returned

    @property
    def latent_rows(self) -> int:
        """Latents held per prompt at a step: every chain's candidates (bounded in `bounds.py`)."""
        return self.num_samples * self.num_candidates


def svdd_select(values: torch.Tensor, alpha: float, generator=None) -> torch.Tensor:
    """`[N, M]` candidate values -> `[N]` chosen candidate: argmax for α = 0, else a draw ∝ exp(v / α)."""
    if alpha == 0:
        return values.argmax(dim=-1)
    device = generator.device if generator is not None else values.device
    probs = torch.softmax(values.to(device) / alpha, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(values.device)


def svdd(ctx: SteerContext, cfg: SVDDConfig, generator=None) -> SteerOutput:
    """Run SVDD-PM with `cfg.num_samples` chains per prompt and return the best final sample of each prompt."""
    if cfg.num_candidates < 1 or cfg.num_samples < 1:
        raise UserError(
            f"num_candidates and num_samples must be at least 1, got {cfg.num_candidates} and {cfg.num_samples}"
        )
    if cfg.alpha < 0:
        raise UserError(f"alpha is a temperature ≥ 0 (0 = argmax), got {cfg.alpha}")
    M = cfg.num_candidates
    cond = rows_per_prompt(ctx.num_prompts, cfg.num_samples)
    latents = ctx.initial_latents(cond, generator)
    cond = cond.to(latents.device)
    N = len(latents)
    model_output = ctx.predict(latents, 0, cond)
    final = None

    for i in range(ctx.num_steps):
        last = i == ctx.num_steps - 1
        probe = ctx.step(model_output[:1], i, latents[:1], generator=generator)
        m = 1 if is_deterministic(probe) else M
        cand_cond = cond.repeat_interleave(m)
        cand_slots = torch.arange(N).repeat_interleave(m)  # a chain's candidates share its slot (CADS's noise)
        candidates = ctx.step(
            model_output.repeat_interleave(m, dim=0), i, latents.repeat_interleave(m, dim=0), generator=generator
        ).prev_sample
        if last:
            scored = ctx.score(candidates, cand_cond)
            values, cand_output = scored.objective, None
        else:
            cand_output = ctx.predict(candidates, i + 1, cand_cond, particles=cand_slots)
            if m == 1:  # a single candidate is kept whatever it scores: no value needed
                values = torch.zeros(len(candidates), device=candidates.device)
            else:
                values = ctx.score(ctx.pred_x0(cand_output, i + 1, candidates), cand_cond).objective
        rows = svdd_select(values.view(N, m), cfg.alpha, generator) + torch.arange(N, device=values.device) * m
        latents = candidates[rows]
        if last:
            final = (scored.samples[rows], values[rows])
        else:
            model_output = cand_output[rows]

    samples, objective = final
    best = select_per_prompt(objective, ctx.num_prompts)
    info = ctx.accounting("svdd", num_candidates=M, alpha=cfg.alpha, num_samples=cfg.num_samples)
    return SteerOutput(images=samples[best], scores=objective[best] * ctx.sign, info=info)
