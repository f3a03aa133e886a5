"""Steering recipes: a YAML file that fixes everything `diffrl steer` needs, loaded strictly.

    # recipes/steer/<model>_<reward>_<method>.yaml
    method: fk                                   # best-of-n | fk | svdd | guidance | reno
    pipeline: tiny-shapes                        # embedded name (tiny-shapes, tiny-shapes-flow, ...), folder or hub id
    reward: shapes_verifier                      # a name, {name, kwargs}, or a list of {name, weight, kwargs, label}
    prompts: "shapes:heldout"                    # a list, a text file, shapes:SET or module:function
    sample: {num_steps: 50, guidance_scale: 5.0, eta: 1.0}   # eta: DDIM η, or a flow's noise level a
    steer: {num_particles: 4, lmbda: 10.0, potential: max, interval: 10}   # the method's settings
    cads: {tau1: 0.6, tau2: 0.9}                 # optional: CADS (any subset of its settings; on = the defaults)
    seed: 0

An unknown key, a wrong type or a setting the method does not have is a `UserError` naming it, with the closest
valid key. Command-line flags and `key=value` overrides (`steer.num_particles=8`, `sample.num_steps=20`) go on top.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from diffrl.checks import MAX_SEED, check_number
from diffrl.config import apply_overrides, parse_yaml
from diffrl.errors import UserError
from diffrl.files import read_text
from diffrl.shipped_recipes import find_recipe
from diffrl.steering import METHODS, method_config
from diffrl.steering.bounds import MAX_IMAGE_SIDE
from rewards.registry import get_reward_factory
from samplers import SAMPLERS
from samplers.cads import CADSConfig, cads_settings

DTYPES = ("fp32", "fp16", "bf16")
SAMPLER_CHOICES = ("auto", *SAMPLERS)


@dataclass
class SampleSettings:
    sampler: str = "auto"  # "auto" (flow for SD3/FLUX, lcm for LCM pipelines, else ddim), ddim, lcm, flow, flow_cps
    num_steps: int = 0  # denoising steps; 0 = the default (50 DDIM, 4 LCM, 28 flow; ReNO: 1, or 4 on flow)
    guidance_scale: float | None = None  # CFG (DDIM, SD3), LCM w-embedding or FLUX guidance; None = 7.5 / 8.5 / 7.0
    eta: float | None = None  # DDIM η or the flow SDE's noise level a; None = 1.0 DDIM, 0.7 flow; FK and SVDD need > 0
    negative_prompt: str = ""  # for classifier-free guidance ("" = the unconditional embedding)
    height: int = 0  # image height in pixels; 0 = the pipeline's default size
    width: int = 0  # image width in pixels; 0 = the pipeline's default size


@dataclass
class SteerRecipe:
    method: str = ""  # best-of-n | fk | svdd | guidance | reno
    pipeline: str = ""  # embedded name, local diffusers folder or hub id
    lora: str = ""  # a run dir or LoRA folder to load into the pipeline ("" = none)
    dtype: str = "fp32"  # weights dtype: fp32 | fp16 | bf16
    reward: Any = ""  # reward name, {name, kwargs}, or a list of {name, weight, kwargs, label} (a weighted sum)
    prompts: Any = ""  # a list of prompts, a text file, shapes:SET or module:function
    num_prompts: int = 0  # use only the first N prompts; 0 = all
    seed: int = 0  # seed of the first prompt batch; batch i uses seed + i
    prompts_per_call: int = 4  # prompts steered together in one call (each with all its particles)
    rows_per_call: int = 0  # latent rows per model (UNet / transformer) or reward call; 0 = all rows of a call at once
    sample: SampleSettings = field(default_factory=SampleSettings)
    steer: dict = field(default_factory=dict)  # the method's settings (its config dataclass's fields)
    # CADS, condition-annealed sampling, in every model call (None = off); given as on/off, `--cads` text
    # ("tau1=0.6,tau2=0.9") or a mapping of tau1, tau2, noise_scale, mix, seed
    cads: CADSConfig | None = None


def _did_you_mean(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _check_type(path: str, value, expected) -> Any:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, float),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }.get(expected, True)
    if not ok:
        raise UserError(f"{path} must be {expected.__name__}, got {value!r}")
    return value


def _sample_settings(data) -> SampleSettings:
    if not isinstance(data, dict):
        raise UserError(f"sample must be a mapping of {', '.join(f.name for f in dataclasses.fields(SampleSettings))}")
    names = {f.name for f in dataclasses.fields(SampleSettings)}
    types = {"sampler": str, "num_steps": int, "negative_prompt": str, "height": int, "width": int}
    out = {}
    for key, value in data.items():
        if key not in names:
            raise UserError(f"unknown key 'sample.{key}'{_did_you_mean(key, names)}")
        if key in ("guidance_scale", "eta"):
            out[key] = None if value is None else _check_type(f"sample.{key}", value, float)
        else:
            out[key] = _check_type(f"sample.{key}", value, types[key])
    settings = SampleSettings(**out)
    if settings.sampler not in SAMPLER_CHOICES:
        raise UserError(f"sample.sampler must be one of {', '.join(SAMPLER_CHOICES)}, got {settings.sampler!r}")
    if settings.num_steps < 0 or settings.height < 0 or settings.width < 0:
        raise UserError("sample.num_steps, sample.height and sample.width must be ≥ 0")
    # num_steps' bound is checked by `steer_cli` after the pipeline's own (its scheduler's timesteps), the more
    # telling message where both apply
    for key, bound in (("height", MAX_IMAGE_SIDE), ("width", MAX_IMAGE_SIDE)):
        if getattr(settings, key) > bound:  # 0 is the default
            raise UserError(f"sample.{key} must be at most {bound}, got {getattr(settings, key)}")
    if settings.eta is not None:
        check_number("sample.eta", settings.eta, low=0)
    if settings.guidance_scale is not None:
        check_number("sample.guidance_scale", settings.guidance_scale, low=0)
    return settings


def recipe_from_dict(data: dict, source: str = "the recipe") -> SteerRecipe:
    """Build a `SteerRecipe` strictly from a raw mapping; validates the method's settings and the reward names."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: a steering recipe is a mapping (method, pipeline, reward, prompts, ...)")
    names = {f.name for f in dataclasses.fields(SteerRecipe)}
    types = {"method": str, "pipeline": str, "lora": str, "dtype": str, "num_prompts": int, "seed": int,
             "prompts_per_call": int, "rows_per_call": int}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise UserError(f"unknown key '{key}' in {source}{_did_you_mean(str(key), names)}")
        if key == "sample":
            kwargs[key] = _sample_settings(value or {})
        elif key == "steer":
            if not isinstance(value or {}, dict):
                raise UserError(f"steer must be a mapping of the method's settings, got {value!r}")
            kwargs[key] = dict(value or {})
        elif key == "cads":
            kwargs[key] = cads_settings(value, "cads")
        elif key in types:
            kwargs[key] = _check_type(key, value, types[key])
        else:
            kwargs[key] = value
    recipe = SteerRecipe(**kwargs)
    if recipe.method not in METHODS:
        raise UserError(f"method must be one of {', '.join(METHODS)}, got {recipe.method!r}"
                        f"{_did_you_mean(recipe.method, METHODS)} ({source})")
    method_config(recipe.method, **recipe.steer)  # every setting must be one of the method's
    if recipe.dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {recipe.dtype!r}")
    if recipe.num_prompts < 0 or recipe.prompts_per_call < 1 or recipe.rows_per_call < 0:
        raise UserError("num_prompts and rows_per_call must be ≥ 0 and prompts_per_call ≥ 1")
    check_number("seed", recipe.seed, low=0, high=MAX_SEED)
    check_reward_spec(recipe.reward)
    return recipe


def check_reward_spec(spec) -> None:
    """Check that a reward spec has the right shape and that every name it uses is registered (nothing is built)."""
    specs = spec if isinstance(spec, list) else [spec]
    if not specs or spec == "":
        raise UserError("reward is missing; give a name, {name, kwargs}, or a list of {name, weight, kwargs}")
    for item in specs:
        if isinstance(item, str):
            get_reward_factory(item)
            continue
        allowed = {"name", "kwargs"} | ({"weight", "label"} if isinstance(spec, list) else set())
        if not isinstance(item, dict) or "name" not in item or set(item) - allowed:
            raise UserError(f"reward entry {item!r}: give {{{', '.join(sorted(allowed))}}} with at least 'name'")
        get_reward_factory(item["name"])


def reward_spec_to_args(spec) -> tuple[Any, list[float] | None]:
    """(reward, weights) for `diffrl.steering.resolve_reward` from a recipe's reward spec."""
    if isinstance(spec, list):
        rewards = [item if isinstance(item, str) else {key: value for key, value in item.items() if key != "weight"}
                   for item in spec]
        weights = [1.0 if isinstance(item, str) else float(item.get("weight", 1.0)) for item in spec]
        return rewards, weights
    return spec, None


def load_steer_recipe(path_or_name, overrides=()) -> SteerRecipe:
    """Load a steering recipe: a YAML file or a shipped name (`steer/tiny-shapes_verifier_fk`), plus `key=value`
    overrides (values read as YAML)."""
    path = find_recipe(path_or_name)
    data = parse_yaml(read_text(path, "steering recipe"), str(path))
    if data is None:
        raise UserError(f"{path} is empty; a steering recipe needs at least method, pipeline, reward and prompts")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a steering recipe is a mapping (method, pipeline, reward, prompts, ...)")
    data, _ = apply_overrides(data, list(overrides))
    return recipe_from_dict(data, source=str(path))
