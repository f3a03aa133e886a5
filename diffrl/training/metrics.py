"""Run-dir logging: metrics.jsonl, experiment trackers, sample grids and the reward curve.

Everything here runs on the main process only (the trainer checks `accelerator.is_main_process`).

metrics.jsonl holds one JSON object per epoch. Keys common to the policy-gradient trainers:
epoch, samples_seen, global_step, reward_mean, reward_std, loss, kl, approx_kl, clipfrac, wall_s (and
rollout_s / reward_s / train_s / eval_s; cpu_s is the process's CPU time, steadier on a shared CPU),
ratio_first_step (mean PPO ratio before the epoch's first update), logprob_max_diff (largest |recomputed - rollout|
log-prob there), nan_rewards, nan_losses, lr, reward/<component> per reward component, and eval_reward_mean /
eval_gold_mean ... on evaluation epochs.
Evaluation at epoch e scores the policy that sampled epoch e's rollouts (before that epoch's update); the record
with `"final": true` and epoch = num_epochs holds the evaluation of the finished model.
"""

import importlib.util
import io
import json
import logging
import math
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from diffrl.errors import UserError
from diffrl.files import read_jsonl, write_bytes, write_text, writing

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "reward_curve.png"
GIF_FRAME_MS = 125  # video grids play at 8 frames per second: an 81-frame Wan video in ~10 s


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl; a partial last line (a process killed while appending it) is left out."""
    return read_jsonl(Path(run_dir) / METRICS_FILE, "metrics file")


def truncate_metrics(run_dir: Path, last_epoch: int) -> None:
    """Keep the records of epochs up to `last_epoch`, the last checkpoint's (-1: none), once each: a resumed run
    re-does the epochs its checkpoint does not cover, and an epoch's record is written before its checkpoint."""
    if not (Path(run_dir) / METRICS_FILE).is_file():
        return
    records = {}
    for r in read_metrics(run_dir):
        if r.get("epoch", -1) <= last_epoch and not r.get("final"):
            records[r.get("epoch", -1)] = r  # a record repeated by an earlier resume: the newest one
    write_text(Path(run_dir) / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in records.values()))


def eval_curve(records: list[dict]) -> list[dict]:
    """Held-out score of every evaluated policy against the compute spent to get it.

    The evaluation logged at epoch e scores the policy after e epochs of updates (the `final` record: after all of
    them). Its compute is what epochs 0 .. e-1 spent: `samples` drawn and `train_wall_s`, their wall-clock without
    the evaluations (`wall_s - eval_s`).

    Returns:
        `list[dict]`: `epoch`, `samples`, `train_wall_s`, `score`, in the order of the run.
    """
    epochs = sorted((r for r in records if not r.get("final")), key=lambda r: r["epoch"])
    samples, wall, points = 0, 0.0, []
    for r in epochs:
        if r.get("eval_reward_mean") is not None:
            points.append({"epoch": r["epoch"], "samples": samples, "train_wall_s": wall, **_eval_score(r)})
        samples = r["samples_seen"]
        wall += r["wall_s"] - (r.get("eval_s") or 0.0)
    final = next((r for r in records if r.get("final")), None)
    if final is not None and final.get("eval_reward_mean") is not None:
        points.append({"epoch": final["epoch"], "samples": samples, "train_wall_s": wall, **_eval_score(final)})
    return points


def _eval_score(record: dict) -> dict:
    """An evaluation's held-out score — the gold reward's where the run has one, else the trained-on reward's — with
    its standard error over the images, and the trained-on (proxy) reward's mean."""
    gold = "eval_gold" if record.get("eval_gold_mean") is not None else "eval_reward"
    n, std = record.get(f"{gold}_n"), record.get(f"{gold}_std")
    return {"score": record[f"{gold}_mean"], "proxy": record["eval_reward_mean"],
            "score_se": std / math.sqrt(n) if n and std is not None else None}


class MetricsLogger:
    """Appends epoch records to metrics.jsonl and forwards scalars to the accelerate trackers (if any).

    Args:
        run_dir (`Path`): the run dir.
        accelerator (`accelerate.Accelerator`, *optional*): its trackers get every numeric value; `None` = none.
    """

    def __init__(self, run_dir: Path, accelerator=None):
        self.path = Path(run_dir) / METRICS_FILE
        self.accelerator = accelerator

    def log(self, record: dict) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self.accelerator is not None and self.accelerator.trackers:
            scalars = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.accelerator.log(scalars, step=int(record.get("epoch", 0)))


# TensorBoard is optional (the test extra installs it): a fresh install logs to metrics.jsonl alone and says so in
# one line, since viewing TensorBoard logs needs the package anyway, and installing it turns them on.
TENSORBOARD_MISSING = ("log.tracker=tensorboard: tensorboard is not installed, so scalars go to metrics.jsonl only "
                       "(`pip install tensorboard` to also log them for TensorBoard)")


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def tracker_kwargs(tracker: str) -> dict:
    """`log_with` for `accelerate.Accelerator`: TensorBoard when installed (else none: the run context prints
    `TENSORBOARD_MISSING` once), wandb when asked."""
    if tracker == "none":
        return {}
    if tracker == "tensorboard":
        return {"log_with": "tensorboard"} if tensorboard_installed() else {}
    if tracker == "wandb":
        if importlib.util.find_spec("wandb") is None:
            raise UserError("log.tracker=wandb but wandb is not installed; `pip install diffrl[wandb]` or set "
                            "log.tracker=tensorboard")
        return {"log_with": "wandb"}
    raise UserError(f"log.tracker must be tensorboard, wandb or none, got '{tracker}'")


def save_image_grid(path: Path, images, captions: list[str], *, columns: int = 4) -> None:
    """Write `images` (`[N, 3, H, W]` float in [0, 1]) as a grid with a caption under each image.

    Videos (`[N, F, 3, H, W]`, a video family's frames) give the grid of their first frames at `path` and the same
    grid animated over all frames as a looping GIF beside it (`path` with `.gif`)."""
    images = images.detach().float().clamp(0, 1).cpu().numpy()
    if images.ndim == 5:
        frames = [_grid_canvas(images[:, f], captions, columns) for f in range(images.shape[1])]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _write_png(path, frames[0])
        _write_gif(Path(path).with_suffix(".gif"), frames)
        return
    canvas = _grid_canvas(images, captions, columns)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _write_png(path, canvas)


def _grid_canvas(images, captions: list[str], columns: int):
    """The PIL grid of `images` (numpy `[N, 3, H, W]` in [0, 1]) with captions."""
    n, _, h, w = images.shape
    scale = max(1, 128 // max(h, w))  # tiny 32x32 images are upscaled (nearest) so the grid is readable
    line_h, prompt_lines = 12, 3  # the default bitmap font is 11 px high
    cell_w, cell_h = w * scale, h * scale
    text_h = line_h * (prompt_lines + max(len(c.split(" | ")) - 1 for c in captions)) + 4
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    canvas = Image.new("RGB", (cols * cell_w, rows * (cell_h + text_h)), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    chars_per_line = max(8, cell_w // 6)
    for i in range(n):
        arr = (images[i].transpose(1, 2, 0) * 255).round().astype(np.uint8)
        tile = Image.fromarray(arr).resize((cell_w, cell_h), Image.NEAREST)
        x, y = (i % cols) * cell_w, (i // cols) * (cell_h + text_h)
        canvas.paste(tile, (x, y))
        # "prompt | r=0.123": the prompt wrapped on word boundaries (at most 3 lines, cut with "..."), then each
        # score on a line of its own, never cut
        prompt, *scores = captions[i].split(" | ")
        lines = textwrap.wrap(prompt, chars_per_line, max_lines=prompt_lines, placeholder=" ...") + scores
        draw.multiline_text((x + 2, y + cell_h + 1), "\n".join(lines), fill="black", font=font, spacing=1)
    return canvas


def plot_reward_curve(run_dir: Path, records: list[dict] | None = None) -> None:
    """Redraw reward_curve.png: training reward (mean ± std) and the evaluation rewards, from `records`
    (defaults to metrics.jsonl). Uses matplotlib's object API with the Agg canvas: no pyplot state, no backend
    switch in the caller's process, safe off the main thread."""
    # matplotlib is slow to import and only this plot needs it: readers of metrics.jsonl (the demo, `bench`) skip it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(run_dir) if records is None else records
    train = [r for r in records if r.get("reward_mean") is not None]
    evals = [r for r in records if r.get("eval_reward_mean") is not None]
    golds = [r for r in records if r.get("eval_gold_mean") is not None]
    panels = 2 if golds else 1
    fig = Figure(figsize=(6 * panels, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)
    ax = axes[0, 0]
    if train:
        x = [r["epoch"] for r in train]
        mean = [r["reward_mean"] for r in train]
        std = [r.get("reward_std") or 0.0 for r in train]
        ax.plot(x, mean, label="train reward")
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    if evals:
        ax.plot([r["epoch"] for r in evals], [r["eval_reward_mean"] for r in evals], "o-",
                label="eval reward (held-out prompts)")
    ax.set_xlabel("epoch (policy before that epoch's update)")
    ax.set_ylabel("reward")
    if train or evals:
        ax.legend(loc="best")
    ax.grid(alpha=0.3)
    if golds:
        gx = [r["epoch"] for r in golds]
        axes[0, 1].plot(gx, [r["eval_gold_mean"] for r in golds], "o-", color="tab:green", label="gold reward")
        axes[0, 1].set_xlabel("epoch")
        axes[0, 1].set_ylabel("gold reward")
        axes[0, 1].legend(loc="best")
        axes[0, 1].grid(alpha=0.3)
        axes[0, 1].set_title("training and gold curves diverging = reward hacking", fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=80, format="png")
    write_bytes(Path(run_dir) / CURVE_FILE, buffer.getvalue())


class CurvePlotter:
    """Redraws reward_curve.png on a background thread, so an epoch never waits for matplotlib, and at most once
    every `min_interval_s` seconds: a redraw costs 0.2-1 s of CPU on a small machine (0.17 s measured on one core
    with tiny-shapes-flow, about 1 % of a 17 s epoch, which a one-core run pays even on a thread). The newest request
    wins: a redraw still waiting is replaced. `wait()` draws the newest records not drawn yet and returns once every
    redraw is done, so the file is current at the end of a run.

    Args:
        run_dir (`Path`): the run dir.
        min_interval_s (`float`, defaults to 60): the shortest time between the starts of two redraws.
    """

    def __init__(self, run_dir: Path, min_interval_s: float = 60.0):
        self.run_dir = Path(run_dir)
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._pending: list | None = None
        self._running = False
        self._thread = None
        self._last_start = -math.inf

    def request(self, records: list[dict]) -> None:
        with self._lock:
            self._pending = list(records)
            if not self._running and time.monotonic() - self._last_start >= self.min_interval_s:
                self._running = True
                self._thread = threading.Thread(target=self._drain, name="reward-curve", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        with self._lock:
            records, self._pending = self._pending, None
            self._last_start = time.monotonic()
        try:
            if records is not None:
                self._plot(records)
        finally:
            with self._lock:
                self._running = False

    def _plot(self, records: list[dict]) -> None:
        try:
            plot_reward_curve(self.run_dir, records)
        except (UserError, OSError, ValueError, RuntimeError) as e:  # a failed plot must never stop training
            logger.warning(f"could not redraw {self.run_dir / CURVE_FILE}: {e}")  # one line

    def wait(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            records, self._pending = self._pending, None
        if records is not None:
            self._plot(records)


def save_before_after(images_dir: Path) -> Path | None:
    """`images/before-after.png`: the first evaluation's grid (`eval-epoch-0.png`, the pre-trained model unless the
    run resumed) beside the final one (`eval-final.png`), same prompts and seeds; None when either is missing."""
    before, after = Path(images_dir) / "eval-epoch-0.png", Path(images_dir) / "eval-final.png"
    if not (before.is_file() and after.is_file()):
        return None
    left, right = Image.open(before).convert("RGB"), Image.open(after).convert("RGB")
    gap, header = 16, 16
    canvas = Image.new("RGB", (left.width + gap + right.width, header + max(left.height, right.height)), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    draw.text((2, 2), "before training (epoch 0)", fill="black", font=font)
    draw.text((left.width + gap + 2, 2), "after training (final)", fill="black", font=font)
    canvas.paste(left, (0, header))
    canvas.paste(right, (left.width + gap, header))
    path = Path(images_dir) / "before-after.png"
    _write_png(path, canvas)
    return path


def _write_png(path: Path, image) -> None:
    """A PIL image written atomically (a full disk leaves no half-written PNG)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    write_bytes(path, buffer.getvalue())


def _write_gif(path: Path, frames: list) -> None:
    """PIL images written atomically as one looping animated GIF."""
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=GIF_FRAME_MS, loop=0)
    write_bytes(path, buffer.getvalue())
