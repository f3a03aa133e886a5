"""diffrl: fine-tune and steer diffusion models against rewards.

Heavy imports (torch, diffusers) happen on first use, so `import diffrl` and `diffrl --help` stay fast.
"""

__version__ = "0.1.0"

__all__ = ["UserError", "__version__", "load_pipeline", "steer"]

from diffrl import trainers as _trainers  # noqa: F401  fills diffrl.trainer_lookup for diffrl.config (module paths only)
from diffrl.errors import UserError


def __getattr__(name):
    if name == "load_pipeline":
        from diffrl.pipelines import load_pipeline  # on first use: it loads huggingface_hub

        return load_pipeline
    if name == "steer":
        from diffrl.steering import steer  # on first use: `import diffrl` loads only the trainer table

        return steer
    raise AttributeError(f"module 'diffrl' has no attribute {name!r}")
