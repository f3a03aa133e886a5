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

CADS is for sampling (`diffrl sample --cads`, this hook) and steering (`diffrl steer --cads`: every method, through
`diffrl/steering/cads.py`, which applies the same functions with each particle's own noise); a trajectory sampled
with it records the plain conditioning, so its log-probs cannot be recomputed by a trainer (the hook notes its
settings in `traj.extras["cads"]`).
"""

from __future__ import annotations

import difflib
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


def cads_settings(spec, source: str = "cads") -> CADSConfig | None:
    """CADS settings as a recipe or the command line gives them; None means CADS is off.

    `spec`: None, `False` or `"off"` (off); `True` or `"on"` (the defaults); the `--cads` text
    (`"tau1=0.6,tau2=0.9"`, see `parse_cads`); a mapping of `CADSConfig` fields (any subset); or a `CADSConfig`.
    """
    if spec is None or spec is False or (isinstance(spec, str) and spec.strip() == "off"):
        return None
    if spec is True:
        return CADSConfig()
    if isinstance(spec, CADSConfig):
        return spec
    if isinstance(spec, str):
        return parse_cads(spec)
    if not isinstance(spec, dict):
        raise UserError(f"{source} must be on, off, a text such as tau1=0.6,tau2=0.9 or a mapping of "
                        f"{', '.join(f.name for f in fields(CADSConfig))}; got {spec!r}")
    names = [f.name for f in fields(CADSConfig)]
    values = {}
    for key, value in spec.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"unknown key '{source}.{key}'{hint} (CADS settings: {', '.join(names)})")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (key == "seed" and not isinstance(value, int)) or not math.isfinite(value):
            kind = "an integer" if key == "seed" else "a finite number"
            raise UserError(f"{source}.{key} must be {kind}, got {value!r}")
        values[key] = int(value) if key == "seed" else float(value)
    return CADSConfig(**values)


def _seeded_generator(entropy: list[int], device) -> torch.Generator:
    """A generator seeded from several integers through NumPy's `SeedSequence` (63 bits of its state)."""
    state = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) | (int(state[1] & 0x7FFFFFFF) << 32))


def _noise_generator(sample_generator: torch.Generator, seed: int) -> torch.Generator:
    """A generator for one sample's condition noise: seeded from the sample's seed and `seed`, independent of the
    sample's own stream (which it never draws from)."""
    return _seeded_generator([sample_generator.initial_seed(), seed], sample_generator.device)


def keyed_condition_noise(keys: list[list[int]], shapes: list[tuple[int, ...]], device) -> list[torch.Tensor]:
    """Standard normal condition noise, one row per key: row i of every returned tensor (`[len(keys), *shape]`, one
    per entry of `shapes`, drawn in that order) comes from a generator seeded from `keys[i]` alone, so a row's noise
    depends on its key and on nothing else (not on the other rows, nor on earlier draws)."""
    generators = [_seeded_generator(list(key), device) for key in keys]
    return [draw_noise(generators, shape, device, torch.float32) for shape in shapes]


def anneal_conditioning(cond, gamma: float, config: CADSConfig, noise: dict[str, torch.Tensor]):
    """`cond` (a `Conditioning`) with Eqs. 3 and 4 applied to each field named in `noise` (n of that field's shape);
    `cond` itself when γ = 1."""
    if gamma >= 1.0:
        return cond
    return replace(cond, **{name: anneal_condition(getattr(cond, name), gamma, config.noise_scale, config.mix, n)
                            for name, n in noise.items()})


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
        # drawn at every step, whatever γ, so step i's noise does not depend on the schedule
        noise = {name: draw_noise(self._generators, getattr(cond, name).shape[1:], getattr(cond, name).device,
                                  torch.float32)
                 for name in NOISED_FIELDS if getattr(cond, name) is not None}
        if gamma < 1.0:
            ctx.cond = anneal_conditioning(cond, gamma, self.config, noise)

    def after_step(self, ctx: StepContext):
        return None
