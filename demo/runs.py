"""Read a run dir for the Runs page: config, metrics, reward curve, sample grids by epoch, checkpoints. Read only.

The page reads only what it was started to show: a folder under the demo's runs folder (`diffrl demo --runs-dir`),
and in it only files that are inside it. A typed path elsewhere (`/etc`, `~/.config/app`), `..` out of the runs
folder, a run dir that is a symlink to another place, or a `config.yaml` / metrics file / image that links out of
the run dir is a one-line refusal: the page must not show any `config.yaml` of the machine to whoever reaches it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from diffrl.config import parse_yaml
from diffrl.errors import UserError
from diffrl.prompts import SHAPES_PREFIX, load_prompts
from diffrl.rundir import list_checkpoints
from diffrl.training.metrics import CURVE_FILE, METRICS_FILE, read_metrics

# metrics.jsonl keys drawn on the page's curve: the trained-on (proxy) reward and the evaluations (gold)
CURVE_KEYS = ("reward_mean", "eval_reward_mean", "eval_gold_mean")


@dataclass
class RunView:
    run_dir: Path
    config: str  # config.yaml as written
    metrics: list[dict]  # metrics.jsonl, one record per epoch (and the final evaluation)
    curve: list[dict]  # long format for a line plot: {"epoch", "value", "series"}
    curve_png: Path | None  # the trainer's own reward_curve.png
    grids: list[tuple[Path, str]]  # (images/epoch-N.png, caption), by epoch
    checkpoints: list[str]


def find_runs(root: str | Path) -> list[str]:
    """Run dirs (folders with a config.yaml) directly under `root`, newest first."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if (p / "config.yaml").is_file()]
    return [str(p) for p in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)]


def _inside(folder: Path, file: Path) -> Path:
    """`file`, if it (after following links) is inside `folder`; else a `UserError`: the page never follows a link
    out of a run dir."""
    if not file.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{file} links out of the run dir {folder}; the Runs page reads only files inside it")
    return file


def under_runs_root(text: str, root: str | Path, page: str = "Runs") -> Path:
    """The run dir `text` names (a path, or a name under `root`), if it is under `root`, else a `UserError` naming
    the `page` that refused it. Whether it exists is the caller's next check."""
    root = Path(root).expanduser()
    path = Path(text).expanduser()
    if not path.is_absolute() and not path.exists() and (root / text).exists():
        path = root / text
    real, real_root = path.resolve(), root.resolve()
    if real == real_root or not real.is_relative_to(real_root):
        raise UserError(f"{text} is not a run dir under {root} (the demo's --runs-dir); the {page} page reads only "
                        "those")
    return path


def read_run(run_dir: str, root: str | Path | None = None) -> RunView:
    """What the Runs page shows of a run dir; a `UserError` if `run_dir` is not one, is not under `root` (when given),
    or holds a file that links out of it."""
    text = (run_dir or "").strip()
    if not text:
        raise UserError("no run dir: give a folder written by `diffrl run` (runs/<name>)")
    path = Path(text).expanduser() if root is None else under_runs_root(text, root)
    if not path.is_dir():
        raise UserError(f"run dir {path} does not exist")
    if not (path / "config.yaml").is_file():
        raise UserError(f"{path} is not a run dir: it has no config.yaml (made by `diffrl run`)")
    config = _inside(path, path / "config.yaml").read_text()
    _inside(path, path / METRICS_FILE)
    try:
        metrics = read_metrics(path)
    except ValueError as e:
        raise UserError(f"{path}/metrics.jsonl is not JSON lines: {e}") from None
    curve = [{"epoch": r["epoch"], "value": float(r[key]), "series": key}
             for r in metrics for key in CURVE_KEYS
             if isinstance(r.get(key), (int, float)) and isinstance(r.get("epoch"), (int, float))]

    def epoch_of(p: Path) -> int:
        match = re.search(r"(\d+)", p.stem)
        return int(match.group(1)) if match else -1

    grids = sorted((_inside(path, p) for p in (_inside(path, path / "images")).glob("*.png")),
                   key=lambda p: (epoch_of(p), p.name))
    curve_png = _inside(path, path / CURVE_FILE)
    return RunView(
        run_dir=path,
        config=config,
        metrics=metrics,
        curve=curve,
        curve_png=curve_png if curve_png.is_file() else None,
        grids=[(p, p.stem) for p in grids],
        checkpoints=[p.name for p in list_checkpoints(path)],
    )


# held-out prompts the Compare page offers for a run (few: Compare draws prompts × images on both sides)
COMPARE_PROMPTS = 4


def compare_defaults(run_dir: str, root: str | Path) -> dict:
    """What the Compare page sets when a run is chosen, from its config.yaml, so that its defaults show what the
    fine-tuning did: the run's held-out prompts (`prompts.eval_source`, else `prompts.source`; only a list in the
    YAML or a `shapes:SET` name — a file or `module:function` source is not read or imported here), its evaluation
    steps and guidance, and its reward's name. Keys are left out where the config does not say; `{}` for a folder
    that is not a readable run dir (Compare then says why when it runs)."""
    try:
        path = under_runs_root((run_dir or "").strip(), root, "Compare")
        config = parse_yaml(_inside(path, path / "config.yaml").read_text(), "config.yaml")
    except (UserError, OSError):
        return {}
    if not isinstance(config, dict):
        return {}
    section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}
    defaults = {}
    prompts, sample, reward = section("prompts"), section("sample"), section("reward")
    for key in ("eval_source", "source"):
        source = prompts.get(key)
        if isinstance(source, list) or (isinstance(source, str) and source.startswith(SHAPES_PREFIX)):
            try:
                defaults["prompts"] = load_prompts(source)[:COMPARE_PROMPTS]
                break
            except UserError:
                continue
    steps = sample.get("eval_num_steps") or sample.get("num_steps")
    if isinstance(steps, int) and steps > 0:
        defaults["steps"] = steps
    if isinstance(sample.get("guidance_scale"), (int, float)):
        defaults["guidance"] = float(sample["guidance_scale"])
    if isinstance(reward.get("name"), str):
        defaults["reward"] = reward["name"]
    return defaults
