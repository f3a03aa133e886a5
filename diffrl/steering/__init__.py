"""Inference-time steering: raise a reward at sampling time, with no training.

One file per method, each a function of a `SteerContext` (a model-agnostic `DenoisingProcess` plus a reward):

| method      | file           | needs                                   |
|-------------|----------------|-----------------------------------------|
| best-of-n   | best_of_n.py   | any reward                              |
| fk          | fk.py          | any reward, a stochastic sampler (η > 0)|
| svdd        | svdd.py        | any reward, a stochastic sampler (η > 0)|
| guidance    | guidance.py    | a differentiable reward                 |
| reno        | reno.py        | a differentiable reward, a one/few-step chain (LCM; a few flow steps) |

`steer(pipe, prompts, reward, method=..., **cfg)` runs one on a diffusers pipeline: Stable Diffusion 1.x/2.x/XL and
LCM (`pipeline.PipelineProcess`, DDIM / LCM steps) or flow matching, SD3 and FLUX class (`flow_process.FlowProcess`,
the flow sampler's ODE/SDE steps; η is then Flow-GRPO's noise level a, and reward guidance shifts the velocity).
Every method runs on both; `steer_process` runs one on any `DenoisingProcess` (the 2-D toy of the tests, or a model
of your own). `steer(..., cads=CADSConfig(...))` adds condition-annealed sampling to any method (`cads.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Sequence
from typing import Any

from diffrl.errors import UserError
from diffrl.steering.bounds import (
    MAX_IMAGE_SIDE,
    MAX_LATENT_ROWS,
    MAX_NUM_STEPS,
    SIZE_BOUNDS,
    check_at_most,
    check_call_rows,
    check_method_sizes,
)
from samplers import get_sampler

METHODS = ("best-of-n", "fk", "svdd", "guidance", "reno")

__all__ = ["MAX_LATENT_ROWS", "METHODS", "SIZE_BOUNDS", "method_config", "resolve_reward", "steer", "steer_process"]


def _method(name: str):
    """(config class, run function) of a method; imports only that method's file (each loads torch, which
    `import diffrl.steering` does not: `diffrl --help` imports this package for its bounds)."""
    if name == "best-of-n":
        from diffrl.steering.best_of_n import BestOfNConfig, best_of_n  # torch

        return BestOfNConfig, best_of_n
    if name == "fk":
        from diffrl.steering.fk import FKConfig, fk_steer  # torch

        return FKConfig, fk_steer
    if name == "svdd":
        from diffrl.steering.svdd import SVDDConfig, svdd  # torch

        return SVDDConfig, svdd
    if name == "guidance":
        from diffrl.steering.guidance import GuidanceConfig, reward_guidance  # torch

        return GuidanceConfig, reward_guidance
    if name == "reno":
        from diffrl.steering.reno import ReNOConfig, reno  # torch

        return ReNOConfig, reno
    close = difflib.get_close_matches(str(name), METHODS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UserError(f"unknown steering method '{name}'; {hint}choose one of {', '.join(METHODS)}")


def method_config(method: str, *, other_names: Sequence[str] = (), **cfg):
    """The method's config dataclass filled from `cfg`; an unknown key is a `UserError` with a did-you-mean.

    `other_names` are further valid keywords of the caller (e.g. `steer`'s `num_steps`), offered as suggestions.
    """
    config_cls, _ = _method(method)
    names = [f.name for f in dataclasses.fields(config_cls)]
    for key in cfg:
        if key not in names:
            close = difflib.get_close_matches(key, names + list(other_names), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(f"{method} has no setting '{key}'; {hint}its settings: {', '.join(names)}")
    from diffrl.config import convert_value  # loads YAML, which `import diffrl.steering` does not

    hints = typing.get_type_hints(config_cls)
    config = config_cls(**{key: convert_value(hints[key], value, key, f"{method}'s settings")
                           for key, value in cfg.items()})
    check_method_sizes(method, config)
    return config


def resolve_reward(reward, weights: Sequence[float] | None = None):
    """A reward object from a registry name, a `{"name", "kwargs"}` dict, a reward, or a list of those.

    A list becomes `rewards.weighted_sum` of its terms with `weights` (all 1 by default); ReNO's several weighted
    rewards are exactly that. Terms are named by their reward; a dict term may carry a `"label"` to tell apart two
    terms of the same reward (e.g. one CLIP score at two settings).
    """
    from rewards import get_reward, weighted_sum  # the registry loads YAML (through diffrl.config)

    if isinstance(reward, (list, tuple)):
        if weights is None:
            weights = [1.0] * len(reward)
        if len(weights) != len(reward):
            raise UserError(f"got {len(weights)} reward weights for {len(reward)} rewards; give one weight per reward")
        if len(reward) == 1 and float(weights[0]) == 1.0:
            return resolve_reward(reward[0])
        terms = [
            {**_check_spec(r), "weight": float(w)} if isinstance(r, dict) else (resolve_reward(r), float(w))
            for r, w in zip(reward, weights)
        ]
        return weighted_sum(terms)
    if weights is not None and [float(w) for w in weights] != [1.0]:
        raise UserError("reward weights need a list of rewards; pass one reward per weight")
    if isinstance(reward, str):
        return get_reward(reward)
    if isinstance(reward, dict):
        spec = _check_spec(reward)
        return get_reward(spec["name"], **dict(spec.get("kwargs") or {}))
    return reward


def _check_spec(spec: dict) -> dict:
    if "name" not in spec or set(spec) - {"name", "kwargs", "label"}:
        raise UserError(f"reward spec {spec!r}: give 'name' and optionally 'kwargs' (and 'label' in a sum)")
    return spec


def steer_process(
    process, prompts: Sequence[str], reward, method: str = "fk", *, generator=None, batch_size=None, metadata=None,
    **cfg: Any,
):
    """Steer any `DenoisingProcess` (see `diffrl.steering.core`); returns a `SteerOutput`.

    Args:
        process (`DenoisingProcess`): the model, for the conditions `prompts`.
        prompts (`list[str]`): one per output sample.
        reward: a reward object (`rewards.Reward`-like).
        method (`str`, defaults to `"fk"`): one of `METHODS`.
        generator (`torch.Generator`, *optional*): drives every random draw.
        batch_size (`int`, *optional*): rows per model or reward call (all at once by default).
        metadata (`list[dict]`, *optional*): per-prompt metadata for the reward.
        **cfg: settings of the method's config dataclass (e.g. `num_particles=4, lmbda=10` for FK).
    """
    from diffrl.steering.core import SteerContext  # torch

    config = method_config(method, **cfg)
    check_call_rows(method, config, len(prompts))
    _, run = _method(method)
    if method in ("fk", "svdd") and not getattr(process, "stochastic", True):
        raise UserError(
            f"{method} needs a stochastic sampler, or resampled copies and candidates stay identical; set eta > 0"
        )
    ctx = SteerContext(process, reward, prompts, metadata=metadata, batch_size=batch_size)
    return run(ctx, config, generator)


def steer(
    pipe,
    prompts: Sequence[str] | str,
    reward,
    method: str = "fk",
    *,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    eta: float | None = None,
    sampler: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    metadata: Sequence[dict] | None = None,
    negative_prompt=None,
    height: int | None = None,
    width: int | None = None,
    reward_weights: Sequence[float] | None = None,
    cads=None,
    process_wrapper=None,
    **cfg: Any,
):
    """Raise `reward` at sampling time on a diffusers pipeline, one output image per prompt.

    Args:
        pipe: a Stable Diffusion (1.x/2.x/XL), LCM, SD3 or FLUX pipeline (e.g. from `diffrl.load_pipeline`).
        prompts (`str` or `list[str]`): one output image per prompt (repeat a prompt for several).
        reward: a registry name (`"shapes_verifier"`), a reward object, or a list of them (a weighted sum with
            `reward_weights`).
        method (`str`, defaults to `"fk"`): `"best-of-n"`, `"fk"`, `"svdd"`, `"guidance"` or `"reno"`.
        num_steps (`int`, *optional*): sampler steps; defaults to the sampler's `default_num_steps` (50 DDIM, 4 LCM,
            28 flow); for ReNO, which backpropagates through every step, to 1 (4 on a flow pipeline).
        guidance_scale (`float`, *optional*): defaults to the sampler's `default_guidance_scale` (7.5 DDIM, 8.5 LCM,
            7.0 flow, as diffusers' pipelines; on FLUX it is the embedded guidance).
        eta (`float`, *optional*): DDIM η (defaults to 1.0), or the flow SDE's noise level a (defaults to 0.7,
            Flow-GRPO's; 0 is the ODE). FK and SVDD need η > 0.
        sampler (`str`, *optional*): `"ddim"`, `"lcm"`, `"flow"` or `"flow_cps"`; defaults from the pipeline (flow for
            SD3/FLUX, LCM if its UNet has a w-embedding, else DDIM).
        seed (`int`, defaults to 0): seeds every draw (initial noise, step noise, resampling).
        batch_size (`int`, *optional*): rows per model (UNet or transformer) / reward call; all rows at once by
            default.
        metadata (`list[dict]`, *optional*): per-prompt metadata for the reward (e.g. for `shapes_verifier`).
        negative_prompt, height, width: as in diffusers (FLUX takes no negative prompt).
        cads (`samplers.cads.CADSConfig`, `str` or `dict`, *optional*): condition-annealed sampling (CADS) settings,
            also as `diffrl sample --cads` text (`"on"`, `"tau1=0.5,tau2=0.8"`) or a mapping; in every model call of
            every method, each particle with its own condition noise, keyed by `seed`, its slot and the step; FK's
            resampled copies and SVDD's candidates as `diffrl.steering.cads` explains. A chain that would never
            see its prompt (γ = 0 at every step) is an error.
        process_wrapper (`Callable`, *optional*): gets the pipeline's `DenoisingProcess` and returns the process to
            steer, e.g. one that watches its steps and decodes to show previews (the demo does).
        **cfg: the method's settings (`diffrl.steering.<method>` config dataclass), e.g. `num_particles=4`.

    Returns:
        `(images, scores, info)`: images `[B, 3, H, W]` float in [0, 1], raw reward scores `[B]`, and a dict
        with the method's settings, `nfe` (model evaluations, one per latent row and call; a classifier-free-guidance
        pair counts once), `reward_evals`, and the time split (`wall_s`, `model_s`, `decode_s`, `reward_s`,
        `backward_s`, `overhead_s` = wall time outside those evaluations, split into the sampler's `step_s` and the
        method's own `method_s`).
    """
    # torch, and the processes (which load diffusers), when a pipeline is steered: not on `import diffrl.steering`
    import torch

    from diffrl.steering.flow_process import FlowProcess
    from diffrl.steering.pipeline import PipelineProcess

    # fail on a bad method or setting, or a size beyond `bounds.py`, before building anything
    config = method_config(method, other_names=[p for p in inspect.signature(steer).parameters if p != "cfg"], **cfg)
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise UserError("steer needs at least one prompt")
    check_call_rows(method, config, len(prompts))
    for name, value, bound in (("num_steps", num_steps, MAX_NUM_STEPS), ("height", height, MAX_IMAGE_SIDE),
                               ("width", width, MAX_IMAGE_SIDE)):
        if value is not None:
            check_at_most(name, value, bound)
    chosen = get_sampler(sampler or "auto", pipe)  # for its defaults (the process builds its own)
    process_cls = FlowProcess if chosen.flow else PipelineProcess
    if num_steps is None:
        num_steps = process_cls.reno_num_steps if method == "reno" else chosen.default_num_steps
    if guidance_scale is None:
        guidance_scale = chosen.default_guidance_scale
    if eta is None:
        eta = process_cls.default_eta  # not the samplers' default (0, deterministic): FK and SVDD need step noise
    reward = resolve_reward(reward, reward_weights)
    process = process_cls(
        pipe, prompts, sampler=chosen.name, num_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
        negative_prompt=negative_prompt, height=height, width=width, cads=cads, seed=seed,
    )
    generator = torch.Generator(device=process.device).manual_seed(int(seed))
    cads_info = None if process.cads is None else dataclasses.asdict(process.cads.config)
    if process_wrapper is not None:
        process = process_wrapper(process)
    out = steer_process(
        process, prompts, reward, method, generator=generator, batch_size=batch_size, metadata=metadata, **cfg
    )
    info = dict(out.info)
    info.update(
        sampler=chosen.name, num_steps=process.num_steps, guidance_scale=guidance_scale, eta=process.eta, seed=seed,
        cads=cads_info,
    )
    return out.images, out.scores, info
