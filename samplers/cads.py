"""CADS: condition-annealed sampling, a sampler hook that raises diversity at high guidance.

Paper: Sadat, Buhmann, Bradley, Hilliges, Weber, "CADS: Unleashing the Diversity of Diffusion Models through
Condition-Annealed Sampling", ICLR 2024, arXiv 2310.17347 (Section 3.1, Eqs. 2–4). At each denoising step the
text conditioning y of the conditional branch is replaced by a noised copy:

    γ(t) = 1 for t ≤ τ1, (τ2 − t)/(τ2 − τ1) for τ1 < t < τ2, 0 for t ≥ τ2      (Eq. 2; t = 1 is pure noise)
    ŷ = √γ(t) · y + s · √(1 − γ(t)) · n,  n ~ N(0, I)                              (Eq. 3)
    ŷ_rescaled = (ŷ − mean(ŷ)) / std(ŷ) · std(y) + mean(y);  ŷ_final = ψ · ŷ_rescaled + (1 − ψ) · ŷ   (Eq. 4)

so early (noisy) steps see a weak, randomised condition and the last steps the real one.

Code names → paper: `tau1`, `tau2` = τ1, τ2; `noise_scale` = s; `mix` = ψ; `cads_gamma` = γ(t);
`noise_condition` = Eq. 3; `rescale_condition` = Eq. 4. `t` is the step's model timestep over the scheduler's
`num_train_timesteps` (DDIM/LCM: t/1000; flow: σ, since their timesteps are σ·1000).

Defaults τ1 = 0.6, τ2 = 0.9, s = 0.25, ψ = 1 are those of the public A1111 implementation (v0xie/sd-webui-cads
@0bb8839216e984f032346c62fb62fea0bf865532, scripts/cads.py), which cites the paper for them; the paper's own tables
were not read here.

What is noised: `prompt_embeds` and `pooled_prompt_embeds` (the conditional branch's text embedding and, for
SDXL/SD3/FLUX, its pooled vector). The negative (unconditional) embeddings, SDXL's `add_time_ids` and LCM's
guidance embedding are left alone.

Differences from that implementation, on purpose:
- the unconditional CFG branch is not noised (the A1111 script noises both branches); CADS anneals the
  condition, and the null condition carries none;
- mean and std in Eq. 4 are per sample (over all of a sample's entries; std unbiased as `torch.std`), not over the
  whole batch, so a sample does not depend on the batch it is in;
- n is drawn afresh at every step from a per-sample generator seeded from the sample's own seed and `seed`
  (the A1111 script reseeds one global generator with the image seed before every step), so results are
  reproducible per sample seed and the sampler's own noise stream is untouched.

CADS is for sampling (`diffrl sample --cads`); a trajectory sampled with it records the plain conditioning, so
its log-probs cannot be recomputed by a trainer (the hook notes its settings in `traj.extras["cads"]`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch

from diffrl.errors import UserError
from samplers.base import StepContext
from samplers.noise import draw_noise

# fields of `Conditioning` that carry the prompt's meaning in the conditional branch
NOISED_FIELDS = ("prompt_embeds", "pooled_prompt_embeds")


def cads_gamma(t: float, tau1: float, tau2: float) -> float:
    """The annealing schedule γ(t) (Eq. 2): 1 for t ≤ τ1, 0 for t ≥ τ2, linear between; t in [0, 1], 1 = noise."""
    if t <= tau1:
        return 1.0
    if t >= tau2:
        return 0.0
    return (tau2 - t) / (tau2 - tau1)


def noise_condition(y: torch.Tensor, gamma: float, noise_scale: float, noise: torch.Tensor) -> torch.Tensor:
    """ŷ = √γ · y + s · √(1 − γ) · n (Eq. 3); `noise` n has `y`'s shape."""
    return math.sqrt(gamma) * y + noise_scale * math.sqrt(1.0 - gamma) * noise


def rescale_condition(y_noised: torch.Tensor, y: torch.Tensor, mix: float) -> torch.Tensor:
    """ψ · ŷ_rescaled + (1 − ψ) · ŷ (Eq. 4): ŷ standardised per sample and given y's per-sample mean and std."""
    dims = tuple(range(1, y.ndim))
    mean, std = y.mean(dim=dims, keepdim=True), y.std(dim=dims, keepdim=True)
    mean_noised, std_noised = y_noised.mean(dim=dims, keepdim=True), y_noised.std(dim=dims, keepdim=True)
    rescaled = (y_noised - mean_noised) / std_noised * std + mean
    return mix * rescaled + (1.0 - mix) * y_noised


def anneal_condition(y: torch.Tensor, gamma: float, noise_scale: float, mix: float, noise: torch.Tensor):
    """Eqs. 3 and 4 on one embedding, in float32, back in `y`'s dtype; `y` itself when γ = 1 (plain sampling)."""
    if gamma >= 1.0:
        return y
    y32 = y.float()
    noised = noise_condition(y32, gamma, noise_scale, noise.to(device=y.device, dtype=torch.float32))
    if mix > 0:
        noised = rescale_condition(noised, y32, mix)
    return noised.to(y.dtype)


@dataclass(frozen=True)
class CADSConfig:
    """CADS settings.

    Args:
        tau1 (`float`, defaults to 0.6): τ1, normalised time at and below which the condition is clean.
        tau2 (`float`, defaults to 0.9): τ2, normalised time at and above which the condition is noise only.
        noise_scale (`float`, defaults to 0.25): s, the std of the noise replacing the condition.
        mix (`float`, defaults to 1.0): ψ, the weight of the rescaled condition (0: no rescaling).
        seed (`int`, defaults to 0): mixed with each sample's seed to seed its condition noise.
    """

    tau1: float = 0.6
    tau2: float = 0.9
    noise_scale: float = 0.25
    mix: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.tau1 <= self.tau2 <= 1.0:
            raise UserError(f"CADS needs 0 <= tau1 <= tau2 <= 1, got tau1={self.tau1}, tau2={self.tau2}")
        if not self.noise_scale >= 0.0:
            raise UserError(f"CADS noise_scale must be >= 0, got {self.noise_scale}")
        if not 0.0 <= self.mix <= 1.0:
            raise UserError(f"CADS mix must be in [0, 1], got {self.mix}")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"CADS seed must be in [0, 2**63), got {self.seed}")


def parse_cads(text: str) -> CADSConfig:
    """A `CADSConfig` from `"tau1=0.6,tau2=0.9,noise_scale=0.25,mix=1,seed=0"` (any subset; `"on"` = defaults)."""
    names = {f.name: f.type for f in fields(CADSConfig)}
    values = {}
    for item in [] if text.strip() in ("", "on") else text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in names:
            raise UserError(f"--cads: {item.strip()!r} is not one of {', '.join(k + '=' for k in names)} "
                            "(e.g. --cads tau1=0.6,tau2=0.9,noise_scale=0.25,mix=1)")
        try:
            values[key] = int(value) if key == "seed" else float(value)
        except ValueError:
            raise UserError(f"--cads: {key}={value!r} is not a number") from None
        if not math.isfinite(values[key]):
            raise UserError(f"--cads: {key}={value!r} is not finite")
    return CADSConfig(**values)


def _noise_generator(sample_generator: torch.Generator, seed: int) -> torch.Generator:
    """A generator for one sample's condition noise: seeded from the sample's seed and `seed`, independent of the
    sample's own stream (which it never draws from)."""
    state = np.random.SeedSequence([sample_generator.initial_seed(), seed]).generate_state(2, np.uint32)
    return torch.Generator(device=sample_generator.device).manual_seed(int(state[0]) | (int(state[1] & 0x7FFFFFFF) << 32))


class CADSHook:
    """The CADS sampler hook: before each step, this step's model calls see the annealed conditioning.

    Works with every sampler (`hooks=(CADSHook(),)`): DDIM, LCM and flow, with or without CFG, since it only
    replaces `ctx.cond`. Put it first in a hook chain (it must act before any hook reads `ctx.noise_pred`).

    Args:
        config (`CADSConfig`, *optional*): the settings; keyword arguments (`tau1=...`) build one instead.
    """

    def __init__(self, config: CADSConfig | None = None, **settings):
        self.config = config if config is not None else CADSConfig(**settings)
        if config is not None and settings:
            self.config = replace(config, **settings)
        self._generators: list[torch.Generator] = []

    def gamma(self, ctx: StepContext) -> float:
        t = float(ctx.t) / ctx.pipe.scheduler.config.num_train_timesteps
        return cads_gamma(t, self.config.tau1, self.config.tau2)

    def before_step(self, ctx: StepContext):
        if ctx.step_index == 0:  # a new run: one condition-noise generator per sample slot
            self._generators = [_noise_generator(g, self.config.seed) for g in ctx.generators]
            ctx.extras["cads"] = asdict(self.config)
        gamma = self.gamma(ctx)
        cond = ctx.cond
        changes = {}
        for name in NOISED_FIELDS:
            y = getattr(cond, name)
            if y is None:
                continue
            # drawn at every step, whatever γ, so step i's noise does not depend on the schedule
            noise = draw_noise(self._generators, y.shape[1:], y.device, torch.float32)
            changes[name] = anneal_condition(y, gamma, self.config.noise_scale, self.config.mix, noise)
        if gamma < 1.0:
            ctx.cond = replace(cond, **changes)

    def after_step(self, ctx: StepContext):
        return None
