"""A run directory's layout: where its config, checkpoints and best weights are, and where trained weights are found
in it.

    runs/<name>/config.yaml                     the config the run was started with (and its derived numbers)
    runs/<name>/checkpoints/step-N/             complete checkpoints, N = optimizer steps taken (`.tmp-step-N` while
                                                being written, renamed when complete: `diffrl.training.checkpoint`)
    runs/<name>/best/                           the best evaluation's weights (LoRA `pytorch_lora_weights.safetensors`)

Low in the layers (above `diffrl.config`, whose YAML reader it uses, and below everything that loads or trains), so
the pipeline loader, the CLI, export and the demo all find a run's weights, its config and its pipeline the same way
without importing the training code or the CLI.
"""

import re
from pathlib import Path

from diffrl.errors import UserError
from diffrl.files import read_text

CHECKPOINT_RE = re.compile(r"^step-(\d+)$")
BEST_DIR = "best"  # the best evaluation's weights and best.json (run.keep_best)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def temp_checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f".tmp-step-{step}"


def final_checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary `.tmp-*` folders are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def find_trained_weights(path) -> tuple[str, Path]:
    """Where the trained weights under `path` are: `("lora", file)`, `("unet", folder)` or `("transformer", folder)`.

    `path` is a run dir (its newest `checkpoints/step-N` is used), a checkpoint folder, or a LoRA folder saved
    with `save_lora_weights`. Weights are looked for in the folder itself and one level below it.

    Raises:
        `UserError`: no such path, a run dir without checkpoints, or no weights found.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"LoRA path {path} does not exist; pass a run dir or a folder saved with save_lora_weights")
    if path.is_file():
        if path.suffix in (".safetensors", ".bin"):
            return "lora", path
        raise UserError(f"LoRA path {path} is a file but not .safetensors; pass its folder or a run dir")
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        step = latest_checkpoint(path)
        if step is None:
            raise UserError(f"run dir {path} has no checkpoints yet (checkpoints/step-N); wait for the first save")
        path = step
    for folder in [path] + sorted(p for p in path.iterdir() if p.is_dir()):
        for component in ("unet", "transformer"):  # a full fine-tune of an SD (UNet) or flow (transformer) model
            if (folder / component / "config.json").is_file():
                return component, folder / component
            if folder.name == component and (folder / "config.json").is_file():
                return component, folder
        lora_files = sorted(folder.glob("*lora*.safetensors")) or sorted(folder.glob("*lora*.bin"))
        if lora_files:
            return "lora", lora_files[0]
    raise UserError(f"no LoRA weights (*lora*.safetensors) or unet/ (transformer/) folder found in {path}")


def checkpoint_step(weights: Path | None) -> int | None:
    """N of the `checkpoints/step-N` folder that holds `weights` (None for a LoRA folder outside a run)."""
    for folder in (weights.parents if weights else ()):
        match = CHECKPOINT_RE.match(folder.name)
        if match:
            return int(match.group(1))
    return None


def run_config_of(path: str | None) -> dict:
    """The config.yaml (as a dict) of the run that `path` comes from: `path` is a run dir, or a folder inside one
    (`RUN/best`, `RUN/checkpoints/step-N`) whose run dir holds config.yaml; {} for a LoRA folder outside a run (or
    no path)."""
    if path:
        path = Path(path).resolve()
        # the folder itself, or the run dir above it (a parent counts only if it has the run's metrics.jsonl)
        for run_dir in (path, path.parent, path.parent.parent):
            if (run_dir / "config.yaml").is_file() and (run_dir == path or (run_dir / "metrics.jsonl").is_file()):
                config = run_dir / "config.yaml"
                # config's YAML reader, imported here: config loads yaml and its dataclasses, and the CLI imports this
                # module at its top (`diffrl --help` stays fast)
                from diffrl.config import parse_yaml

                data = parse_yaml(read_text(config, "run config"), str(config))
                return data if isinstance(data, dict) else {}
    return {}


def pipeline_of_run(run_config: dict) -> str | None:
    """The `model.pipeline` a run was trained on, from its config (`run_config_of`); None when it names none."""
    return (run_config.get("model") or {}).get("pipeline") or None


def sampling_size_of_run(run_config: dict, given: dict[str, int | None], flags: dict[str, str]) -> dict[str, int]:
    """The size to sample a run's weights at: for each key of `given` (`height`, `width`, `num_frames`), the given
    value where it is not None (a flag), else the run's `sample.<key>` (the size it trained at, `run_config_of`),
    else 0 = the pipeline's default. As `diffrl sample --lora RUN`, `diffrl steer --lora RUN` and the demo's Generate
    take it.

    Raises:
        `UserError`: a run config whose size is not an integer >= 0, naming the flag (`flags[key]`) to pass instead.
    """
    sample = run_config.get("sample") or {}
    size = {}
    for key, value in given.items():
        if value is None:
            value = sample.get(key) or 0
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"the run's config.yaml has sample.{key}={value!r}, not a size >= 0; pass {flags[key]}")
        size[key] = value
    return size
