"""Helpers of the policy-gradient benchmarks (`diffrl bench train`, `diffrl bench learn`): recipe loading with a
pipeline fallback, running a trainer into a run dir, peak memory."""

from __future__ import annotations

import resource
import sys
import tempfile
from pathlib import Path

import torch

from diffrl.config import load_recipe
from diffrl.embedded import embedded_path, is_embedded
from diffrl.errors import UserError
from diffrl.files import lock_run_dir, writing
from diffrl.trainers import get_trainer
from samplers.testing import random_sd_pipeline

# a timed bench runs no held-out evaluation: the first command's recipe evaluates by the clock as well as by epoch
NO_EVALUATION = ("run.eval_every=0", "run.eval_every_minutes=0")


def add_common_arguments(parser, default_recipe: str) -> None:
    add = parser.add_argument
    add("--recipe", default=default_recipe, help=f"recipe file or shipped name (default {default_recipe})")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="recipe override, repeatable (e.g. --set sample.num_steps=10)")
    add("--pipeline", default=None,
        help="use this pipeline instead of the recipe's (default: the recipe's; when that is an embedded model that "
             "is not built yet, a random-weight SD pipeline of similar size, with a note)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add("--out", default=None, help="also write the result as JSON here")


def load_bench_recipe(recipe: str, overrides: list[str], pipeline: str | None, workdir: Path,
                      log=lambda line: print(line, file=sys.stderr)):
    """The recipe with `overrides`; `model.pipeline` replaced by `pipeline`, or by a random-weight stand-in saved
    under `workdir` when the recipe's embedded model is not built. Returns `(cfg, pipeline_label)`."""
    cfg = load_recipe(recipe, overrides)
    if pipeline:
        cfg.model.pipeline = pipeline
        return cfg, pipeline
    if is_embedded(cfg.model.pipeline):
        try:
            if not (embedded_path(cfg.model.pipeline) / "model_index.json").is_file():
                raise UserError(f"embedded model '{cfg.model.pipeline}' is not completely built yet")
        except UserError as e:
            folder = Path(workdir) / "random-small"
            if not (folder / "model_index.json").is_file():
                random_sd_pipeline("small").save_pretrained(folder, safe_serialization=True)
            log(f"note: {e}; using a random-weight stand-in (samplers.testing 'small' preset) instead")
            label = f"random-small (stand-in for {cfg.model.pipeline})"
            cfg.model.pipeline = str(folder)
            return cfg, label
    return cfg, cfg.model.pipeline


def run_trainer(cfg, run_dir: Path, step_callback=None) -> dict:
    """Train `cfg` into `run_dir` holding its writer lock, as `diffrl run` does (`bench learn --keep` leaves its run
    dirs where `diffrl resume` or a second bench can reach them)."""
    run_dir = Path(run_dir)
    with writing(f"run dir {run_dir}"):
        run_dir.mkdir(parents=True, exist_ok=True)
    with lock_run_dir(run_dir):
        return get_trainer(cfg.trainer).train(cfg, run_dir, step_callback=step_callback)


def peak_memory() -> dict:
    """Peak memory so far: CUDA max allocated (if CUDA) and the process's peak resident set size."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def temp_workdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="diffrl-bench-")
