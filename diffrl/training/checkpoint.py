"""Checkpoint files: atomic directory writes, RNG state capture/restore, finding and pruning checkpoints.

A checkpoint is `runs/<name>/checkpoints/step-N/` (N = optimizer steps taken so far). It is first written to a
hidden sibling `.tmp-step-N` and renamed into place only when complete, so a run killed while saving never
leaves a half-written `step-N` behind for `diffrl resume` to pick up.
"""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from diffrl import files
from diffrl.rundir import final_checkpoint_path, list_checkpoints, temp_checkpoint_path


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """Create (empty) the temporary folder that `commit_checkpoint` will rename to `step-N`."""
    tmp = temp_checkpoint_path(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a run killed while saving
    tmp.mkdir(parents=True)
    return tmp


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def commit_checkpoint(run_dir: Path, step: int) -> Path:
    """Flush the temporary folder to disk and rename it to `step-N` (replacing an older `step-N`)."""
    tmp, final = temp_checkpoint_path(run_dir, step), final_checkpoint_path(run_dir, step)
    _fsync_tree(tmp)
    if final.exists():
        # Same step saved twice (e.g. the "last good" checkpoint of a stopped run): move the old one aside first
        # so at every moment either the old or the new complete folder exists under a findable name.
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (`keep <= 0` keeps all)."""
    if keep <= 0:
        return
    for path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def write_json(path: Path, data) -> None:
    files.write_json(path, data, sort_keys=True)


def read_json(path: Path):
    return files.read_json(path)


def _numpy_legacy_state() -> tuple:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, keys.tolist(), int(pos), int(has_gauss), float(cached))


def _generator_state(g):
    return g.bit_generator.state if isinstance(g, np.random.Generator) else g.get_state()


def _set_generator_state(g, state) -> None:
    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def capture_rng_state(generators: dict | None = None) -> dict:
    """Python, numpy, torch (CPU and every CUDA device) RNG states plus named generators
    (`torch.Generator` or `numpy.random.Generator`)."""
    state = {
        "python": random.getstate(),
        # the key array as a list so the state loads with torch.load(weights_only=True)
        "numpy": _numpy_legacy_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: _generator_state(g) for name, g in (generators or {}).items()},
    }
    return state


def restore_rng_state(state: dict, generators: dict | None = None) -> None:
    """Inverse of `capture_rng_state`; every generator named in `generators` must be in the saved state."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in (generators or {}).items():
        if name not in state["generators"]:
            raise KeyError(f"checkpoint has no state for generator '{name}'")
        _set_generator_state(g, state["generators"][name])
