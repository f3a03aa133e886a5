"""Samplers: diffusers pipelines as stochastic policies with recorded trajectories, log-probs, hooks and gradients.

- `samplers.base`: `StepOutput`, `Trajectory`, `GradPolicy`, the `Sampler` and `SamplerHook` protocols,
  `StepHook`, `StepEdit`, `StepContext`, and the shared Gaussian math.
- `samplers.ddim.DDIMSampler`: DDIM with eta over Stable Diffusion 1.x/2.x/XL pipelines (DDPO, DPOK, D3PO,
  DRaFT, FK steering, SVDD).
- `samplers.lcm.LCMSampler`: the latent-consistency multistep sampler as a policy (RLCM).
- `samplers.flow.FlowSampler`: flow matching over SD3 / FLUX pipelines: the ODE, Flow-GRPO's SDE step (`flow`) or
  the coefficients-preserving step (`flow_cps`) (Flow-GRPO, DiffusionNFT rollouts, DRaFT on flow models).
- `samplers.loop`: `DenoisingLoop` (per-sample noise, hooks, `GradPolicy`, the trajectory's latents and log-probs)
  and `run_sampler` / `recompute_log_prob`, the body of every sampler's `sample()` / `log_prob()`; what differs
  between model families (text encoders, the denoiser call, latent shapes, decoding) comes from `diffrl.models`.
- `samplers.cads.CADSHook`: condition-annealed sampling (CADS), a hook every sampler takes.
- `samplers.noise`: one generator per sample and the noise drawn from them.
- `samplers.testing`: tiny random-weight pipelines of the real architectures (tests, benchmarks).

`get_sampler(name="auto", pipe)` is the one factory; callers read a sampler's capabilities (`Sampler`) instead of
its name.

Names resolve lazily, so `import samplers` does not import torch.
"""

import difflib
from importlib import import_module

from diffrl.errors import UserError

# name -> "module:attribute" of each sampler, for configs and the CLI
SAMPLERS = {
    "ddim": "samplers.ddim:DDIMSampler",
    "lcm": "samplers.lcm:LCMSampler",
    "lcm_rlcm": "samplers.lcm:LCMSampler",
    "flow": "samplers.flow:FlowSampler",
    "flow_cps": "samplers.flow:FlowSampler",
}
# constructor arguments a registry name implies (one class, two step policies)
SAMPLER_OPTIONS = {"flow_cps": {"sde_type": "cps"}, "lcm_rlcm": {"spacing": "rlcm"}}

_LAZY = {
    "DDIMSampler": "samplers.ddim",
    "LCMSampler": "samplers.lcm",
    "FlowSampler": "samplers.flow",
    "StepOutput": "samplers.base",
    "Trajectory": "samplers.base",
    "GradPolicy": "samplers.base",
    "Sampler": "samplers.base",
    "SamplerHook": "samplers.base",
    "StepHook": "samplers.base",
    "StepEdit": "samplers.base",
    "StepContext": "samplers.base",
    "CADSHook": "samplers.cads",
}

__all__ = [
    "SAMPLERS",
    "CADSHook",
    "DDIMSampler",
    "FlowSampler",
    "GradPolicy",
    "LCMSampler",
    "Sampler",
    "SamplerHook",
    "StepContext",
    "StepEdit",
    "StepHook",
    "StepOutput",
    "Trajectory",
    "get_sampler",
    "list_samplers",
    "resolve_sampler_name",
]


def list_samplers() -> list[str]:
    return sorted(SAMPLERS)


def resolve_sampler_name(pipe) -> str:
    """The sampler a pipeline is made for: `"flow"` for a transformer with a flow-matching scheduler (SD3, FLUX),
    `"lcm"` for an LCM pipeline or a UNet with a guidance embedding (`time_cond_proj_dim`), else `"ddim"`."""
    scheduler = getattr(pipe, "scheduler", None)
    if getattr(pipe, "transformer", None) is not None and "FlowMatch" in type(scheduler).__name__:
        return "flow"
    unet = getattr(pipe, "unet", None)
    has_w_embedding = unet is not None and unet.config.get("time_cond_proj_dim") is not None
    # an LCM pipeline without the embedding (LCM-LoRA) also resolves to lcm, so it fails loudly there
    # instead of being sampled with 50 DDIM steps
    if has_w_embedding or type(pipe).__name__.startswith("LatentConsistencyModel"):
        return "lcm"
    return "ddim"


def get_sampler(name: str = "auto", pipe=None, **kwargs):
    """The one sampler factory, for configs, the CLI and steering.

    Callers read what a sampler can do from its class attributes, never from its name: `name`, `per_step_eta`
    (η is a number or one per step; `False`: the step noise is fixed by the schedule and η must be `default_eta`),
    `consistency` (guidance is the UNet's w-embedding, no negative prompt), `flow` (flow matching: velocity model,
    σ schedule, `pipe.transformer`), and the
    sampling defaults `default_num_steps`, `default_guidance_scale`, `default_eta`.

    Args:
        name (`str`, defaults to `"auto"`): a key of `SAMPLERS`, or `"auto"` to pick from `pipe`
            (`resolve_sampler_name`).
        pipe (*optional*): the pipeline to sample; required for `"auto"`, and checked against the sampler.
        kwargs: go to the sampler's constructor (e.g. `noise_device="cpu"`).
    """
    if name == "auto":
        if pipe is None:
            raise ValueError("get_sampler('auto') needs the pipeline to pick a sampler for")
        name = resolve_sampler_name(pipe)
    if name not in SAMPLERS:
        close = difflib.get_close_matches(str(name), list(SAMPLERS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown sampler '{name}'{hint} (known: auto, {', '.join(list_samplers())})")
    module, attribute = SAMPLERS[name].split(":")
    try:
        sampler_cls = getattr(import_module(module), attribute)
    except ModuleNotFoundError as e:
        raise UserError(f"sampler '{name}' is not available in this install ({e.name} missing)") from None
    unet = getattr(pipe, "unet", None)
    if sampler_cls.consistency and unet is not None and unet.config.get("time_cond_proj_dim") is None:
        raise UserError(f"the {name} sampler needs a UNet with a guidance embedding (time_cond_proj_dim); use ddim")
    if pipe is not None and sampler_cls.flow != (resolve_sampler_name(pipe) == "flow"):
        fits = resolve_sampler_name(pipe)
        raise UserError(f"the {name} sampler does not fit a {type(pipe).__name__}; use {fits} (or auto)")
    sampler = sampler_cls(**{**SAMPLER_OPTIONS.get(name, {}), **kwargs})
    if pipe is not None and hasattr(sampler, "adapt_defaults"):
        sampler.adapt_defaults(pipe)  # defaults that depend on the pipeline class (FLUX's guidance)
    return sampler


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'samplers' has no attribute {name!r}")
