"""The one place where numbers and devices from the user are checked: config values and command-line flags.

Rules that hold everywhere, so no value slips through because nobody listed it:
- every float is finite (NaN turns guidance off without a word, inf gives black images, a NaN learning rate
  crashes inside torch);
- every int of a config group, and every int flag, is >= 0 (no count, step or seed is negative);
- values with a tighter range say so in a table (`config.check_values`) or in their flag's type.

Devices and dtypes are checked before any model loads: an unknown name, or CUDA on a machine without a GPU, is one
line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from diffrl.errors import UserError


def check_number(name: str, value, *, low=None, high=None, low_open: bool = False, high_open: bool = False):
    """`value` if it is a finite number in the range, else a `UserError` naming `name`.

    Args:
        low, high (*optional*): bounds (inclusive unless `low_open` / `high_open`); `None` = unbounded.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise UserError(f"{name} must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise UserError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise UserError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def config_numbers(obj: Any, path: str = "") -> Iterator[tuple[str, Any, bool]]:
    """Every number in a config tree: `(dotted path, value, is a dataclass field)`. Dict values (reward kwargs)
    are included but are not dataclass fields."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            full = f"{path}.{f.name}" if path else f.name
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield full, value, True
            else:
                yield from config_numbers(value, full)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            full = f"{path}.{key}"
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield full, value, False
            else:
                yield from config_numbers(value, full)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            full = f"{path}.{i}"
            if isinstance(value, float):
                yield full, value, False
            else:
                yield from config_numbers(value, full)


def check_config_numbers(cfg, ranges: dict[str, dict]) -> None:
    """Every float in `cfg` finite, every int field >= 0, and the keys of `ranges` ({dotted key: check_number
    bounds}) in their range. Raises `UserError` naming the first bad key."""
    for path, bounds in ranges.items():
        value = cfg
        for part in path.split("."):
            value = getattr(value, part, None)
        if value is not None:
            check_number(path, value, **bounds)
    for path, value, is_field in config_numbers(cfg):
        if isinstance(value, float) or not is_field:
            check_number(path, value)
        else:
            check_number(path, value, low=0)


# ---------------------------------------------------------------------------------------------------------------
# command-line flags (argparse types: the message becomes "argument --steps: must be >= 1, got 0")
# ---------------------------------------------------------------------------------------------------------------


def _arg_type(convert, what: str, **bounds):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
        try:
            return check_number("value", value, **bounds)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def number(low=None, high=None, *, low_open: bool = False):
    """argparse type: a finite float in the range."""
    return _arg_type(float, "a number", low=low, high=high, low_open=low_open)


def whole(low: int = 0, *, low_open: bool = False, high: int | None = None):
    """argparse type: an int >= `low` (> `low` with `low_open`) and <= `high`."""
    return _arg_type(int, "a whole number", low=low, low_open=low_open, high=high)


positive = whole(0, low_open=True)
non_negative = whole(0)
finite = number()

# torch.Generator.manual_seed takes an unsigned 64-bit seed; `sample` and `steer` seed image i (batch i) with
# seed + i, so the last of those must fit too (`check_seeds`)
MAX_SEED = 2**64 - 1
seed = whole(0, high=MAX_SEED)


def check_seeds(name: str, first: int, count: int) -> None:
    """The `count` seeds `first, first + 1, ...` all fit a torch generator (<= `MAX_SEED`)."""
    if first + count - 1 > MAX_SEED:
        raise UserError(f"{name} {first} + {count - 1} (one seed per image or batch) is more than {MAX_SEED}, the "
                        "largest seed torch takes; use a smaller seed")


def check_num_steps(name: str, num_steps: int, scheduler_config: dict | None) -> None:
    """`num_steps` denoising steps must be distinct timesteps of the pipeline's scheduler: at most its
    `num_train_timesteps` (the integer timesteps the model was trained on; DDPM, DDIM, LCM) and, where the config has
    `original_inference_steps` (LCM), at most those (LCM picks its steps among them). A flow-matching scheduler
    (continuous σ) takes any count, as does an unknown config (`None`: a hub model not downloaded yet)."""
    if not scheduler_config or "FlowMatch" in str(scheduler_config.get("_class_name", "")):
        return
    bounds = [(scheduler_config.get("num_train_timesteps"), "timesteps the model was trained with (num_train_timesteps)"),
              (scheduler_config.get("original_inference_steps"), "steps LCM picks from (original_inference_steps)")]
    for bound, what in bounds:
        if isinstance(bound, int) and num_steps > bound:
            raise UserError(f"{name} is {num_steps}, more than the {bound} {what} of the pipeline's scheduler; use "
                            f"at most {bound}")


def device_arg(text: str) -> str:
    """argparse type for `--device`: a device this machine has."""
    try:
        return check_device(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def check_device(device: str | None) -> str:
    """The torch device string to use: `None` -> "cuda" when a GPU is available, else "cpu". An unknown name, or
    an accelerator this machine does not have, is a `UserError`."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    text = str(device).strip()
    try:
        resolved = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in DEVICE_TYPES:
        raise UserError(f"unknown device '{text}'; use cpu, cuda or cuda:N (a GPU index), mps or xpu")
    if resolved.type == "cpu":
        return text
    backend = torch.backends.mps if resolved.type == "mps" else getattr(torch, resolved.type, None)
    available = bool(backend is not None and backend.is_available())
    count = (torch.cuda.device_count() if resolved.type == "cuda" else 1) if available else 0
    if not available:
        raise UserError(f"device '{text}': this machine has no {resolved.type.upper()} device (torch sees none); "
                        "use cpu")
    if (resolved.index or 0) >= count:
        raise UserError(f"device '{text}': this machine has only {count} {resolved.type} device(s), "
                        f"{resolved.type}:0 to {resolved.type}:{count - 1}")
    return text


# ---------------------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------------------

_DTYPES = {
    "no": "float32", "fp32": "float32", "float32": "float32",  # "no": accelerate's mixed_precision name for fp32
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp64": "float64", "float64": "float64",
}


def resolve_dtype(dtype=None):
    """The `torch.dtype` of pipeline and reward-model weights: `None` -> float32; a `torch.dtype` as is; a name
    ("fp32"/"float32"/"no", "fp16"/"float16"/"half", "bf16"/"bfloat16", "fp64"/"float64", optionally "torch."-prefixed)
    -> its dtype. Any other name is a `UserError`."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use fp32, fp16, bf16 or fp64 (or float32, float16, bfloat16, "
                        "float64)")
    return getattr(torch, _DTYPES[key])
