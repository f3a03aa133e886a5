"""Prompt sources and the per-process prompt sampler.

A source (the recipe's `prompts.source` / `prompts.eval_source`) is one of
- a list of prompts (in the YAML),
- a text file with one prompt per line (blank lines and lines starting with `#` skipped),
- a ShapesWorld prompt set, `shapes:NAME` (`diffrl.shapes.prompts.get_prompt_set(NAME)`),
- `package.module:function`, a function of no arguments returning a list of prompts.
"""

import importlib
from pathlib import Path

import numpy as np

from diffrl.errors import UserError
from diffrl.files import read_text
from diffrl.shapes.prompts import get_prompt_set

SHAPES_PREFIX = "shapes:"


def load_prompts(source) -> list[str]:
    """Resolve a prompt source to a non-empty list of strings. Raises `UserError` on anything else."""
    if isinstance(source, (list, tuple)):
        prompts = list(source)
        origin = "the prompt list"
    elif not isinstance(source, str) or not source.strip():
        raise UserError(f"prompt source {source!r} is empty; give a list, a text file, shapes:SET or module:function")
    elif source.startswith(SHAPES_PREFIX):
        prompts = list(get_prompt_set(source[len(SHAPES_PREFIX):]))
        origin = source
    elif Path(source).is_file():
        lines = read_text(source, "prompt file").splitlines()
        prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        origin = source
    elif ":" in source and not Path(source).suffix:
        prompts = _from_function(source)
        origin = source
    else:
        raise UserError(
            f"prompt source '{source}' is not a file, a shapes:SET name or a module:function; "
            "check the path (relative to the working directory)"
        )
    if not prompts:
        raise UserError(f"{origin} holds no prompts")
    bad = [p for p in prompts if not isinstance(p, str)]
    if bad:
        raise UserError(f"{origin}: every prompt must be a string, got {bad[0]!r}")
    return prompts


def _from_function(spec: str) -> list[str]:
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UserError(f"prompt source '{spec}': cannot import module '{module_name}' ({e})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"prompt source '{spec}': '{module_name}' has no function '{func_name}'")
    result = func()
    if isinstance(result, str) or not hasattr(result, "__iter__"):
        raise UserError(f"prompt source '{spec}' must return a list of prompts, got {type(result).__name__}")
    return list(result)


def draw_prompts(prompts: list[str], batch_size: int, group_size: int, rng: np.random.Generator) -> list[str]:
    """Draw a sampling batch: `batch_size // group_size` prompts uniformly with replacement, each repeated
    `group_size` times consecutively (so samples of one group sit next to each other)."""
    if batch_size % group_size:
        raise UserError(f"sample.batch_size ({batch_size}) must be a multiple of advantage.group_size ({group_size})")
    picks = rng.integers(0, len(prompts), size=batch_size // group_size)
    return [prompts[i] for i in picks for _ in range(group_size)]
