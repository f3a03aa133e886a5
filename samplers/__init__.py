"""Samplers: diffusers pipelines as stochastic policies with recorded trajectories, log-probs, hooks and gradients.

- `samplers.base`: `StepOutput`, `Trajectory`, `GradPolicy`, the `Sampler` and `SamplerHook` protocols,
  `StepHook`, `StepEdit`, `StepContext`, and the shared Gaussian math.
- `samplers.ddim.DDIMSampler`: DDIM with eta over Stable Diffusion 1.x/2.x/XL pipelines (DDPO, DPOK, D3PO,
  DRaFT, FK steering, SVDD).
- `samplers.lcm.LCMSampler`: the latent-consistency multistep sampler as a policy (RLCM).
- `samplers.testing`: tiny random-weight pipelines of the real architectures (tests, benchmarks).

Names resolve lazily, so `import samplers` does not import torch.
"""

from importlib import import_module

# name -> "module:attribute" of each sampler, for configs and the CLI
SAMPLERS = {"ddim": "samplers.ddim:DDIMSampler", "lcm": "samplers.lcm:LCMSampler"}

_LAZY = {
    "DDIMSampler": "samplers.ddim",
    "LCMSampler": "samplers.lcm",
    "StepOutput": "samplers.base",
    "Trajectory": "samplers.base",
    "GradPolicy": "samplers.base",
    "Sampler": "samplers.base",
    "SamplerHook": "samplers.base",
    "StepHook": "samplers.base",
    "StepEdit": "samplers.base",
    "StepContext": "samplers.base",
}

__all__ = [
    "SAMPLERS",
    "DDIMSampler",
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
]


def list_samplers() -> list[str]:
    return sorted(SAMPLERS)


def get_sampler(name: str, **kwargs):
    """A sampler by name (`"ddim"`, `"lcm"`); `kwargs` go to its constructor (e.g. `noise_device="cpu"`)."""
    from diffrl.errors import UserError

    if name not in SAMPLERS:
        raise UserError(f"unknown sampler '{name}'; known: {', '.join(list_samplers())}")
    module, attribute = SAMPLERS[name].split(":")
    return getattr(import_module(module), attribute)(**kwargs)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'samplers' has no attribute {name!r}")
