"""What a run tells its user: a progress bar over the run, one line per held-out evaluation, a summary at the end.

The way diffusers' and trl's training scripts talk, with two rules of their own:
- a terminal gets a tqdm bar (on stderr, as every tqdm bar); anything else (a log file, CI, a pipe) never gets a
  carriage return: a plain progress line at most once a minute instead;
- only the main process prints (`RunConsole(enabled=False)` on the others).

Evaluation lines and the summary go to stdout. The formatting is pure functions of numbers, tested with
hand-worked values in tests/test_run_output.py; `RunConsole` keeps the little state the progress needs, and
`run_summary` reads what a finished run left in its run dir (metrics.jsonl, eval_scores.jsonl, best/best.json),
so the summary is the same for every trainer and for `diffrl resume`.
"""

from __future__ import annotations

import importlib.util
import math
import shlex
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from diffrl.files import read_jsonl
from diffrl.prompts import load_prompts
from diffrl.training.evaluation import paired_gain
from diffrl.training.metrics import CURVE_FILE, eval_curve, read_metrics
from diffrl.training.state import BEST_DIR, read_best

EVAL_SCORES_FILE = "eval_scores.jsonl"  # written by loop.run_evaluation: per-image held-out scores, one line an eval
PLAIN_EVERY_S = 60.0  # a plain progress line (no terminal) at most this often, wall-clock
RUNNING_EPOCHS = 10  # the progress shows the training reward averaged over this many last epochs

# ---------------------------------------------------------------------------------------------------------------
# pure formatting
# ---------------------------------------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """`42 s`, `2.5 min`, `1.5 h`."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def decimals_for(*values: float | None) -> int:
    """Decimals that show three significant digits of the largest |value| below 1000 (0.626, 12.78, 123.4, 1234)."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    return 3 if top < 10 else 2 if top < 100 else 1 if top < 1000 else 0


def eval_line(*, when: str, score: float, start: float | None = None, gain: float | None = None,
              se: float | None = None, score_se: float | None = None, proxy: float | None = None,
              gold: bool = True, note: str = "") -> str:
    """One evaluation, e.g. `eval 2.5 min (epoch 66): held-out gold 0.626 (+0.092 ± 0.033 from 0.534), proxy 12.78`.

    Args:
        when (`str`): when it was taken (`before training (epoch 0)`, `2.5 min (epoch 66)`, `final, ...`).
        score (`float`): the held-out score: the gold reward's mean (`gold=True`), else the training reward's.
        start (`float`, *optional*): the run's first evaluation; with `gain` and its paired standard error `se`
            the line shows the change since then. Without `start` the line shows `score_se`, the standard error
            of the mean itself.
        proxy (`float`, *optional*): the training (proxy) reward's held-out mean, shown beside the gold's.
        note (`str`, *optional*): appended after a semicolon (`new best → best/`).
    """
    d = decimals_for(score, start)
    text = f"eval {when}: held-out {'gold' if gold else 'reward'} {score:.{d}f}"
    if start is not None and gain is not None:
        spread = f" ± {se:.{d}f}" if se is not None and math.isfinite(se) else ""
        text += f" ({gain:+.{d}f}{spread} from {start:.{d}f})"
    elif score_se is not None and math.isfinite(score_se):
        text += f" ± {score_se:.{d}f}"
    if proxy is not None:
        text += f", proxy {proxy:.{decimals_for(proxy)}f}"
    return text + (f"; {note}" if note else "")


def progress_fraction(*, epochs_done: int, num_epochs: int, train_s: float, max_train_minutes: float) -> float:
    """How far the run is, 0 to 1: epochs done of `run.num_epochs`, or minutes of training of
    `run.max_train_minutes` (when set), whichever is further: that one ends the run."""
    fraction = epochs_done / num_epochs if num_epochs else 0.0
    if max_train_minutes:
        fraction = max(fraction, train_s / (60.0 * max_train_minutes))
    return min(1.0, fraction)


def progress_text(*, epochs_done: int, num_epochs: int, train_s: float, max_train_minutes: float,
                  samples_per_s: float | None, reward: float | None, loss_name: str = "loss",
                  loss: float | None = None) -> str:
    """The progress's numbers, e.g. `epoch 103/1000, 4.2/10 min of training, 5.5 samples/s, train reward 12.31,
    loss -12.3` (a field whose value is None or not finite is left out)."""
    parts = [f"epoch {epochs_done}/{num_epochs}"]
    if max_train_minutes:
        parts.append(f"{train_s / 60:.1f}/{max_train_minutes:g} min of training")
    if samples_per_s is not None and math.isfinite(samples_per_s):
        parts.append(f"{samples_per_s:.3g} samples/s")
    if reward is not None and math.isfinite(reward):
        parts.append(f"train reward {reward:.{decimals_for(reward)}f}")
    if loss is not None and math.isfinite(loss):
        parts.append(f"{loss_name} {loss:.3g}")
    return ", ".join(parts)


def summary_lines(*, run_dir: Path, trainer: str, records: list[dict], evals: list[dict], best: dict | None,
                  wall_s: float, num_epochs: int, max_train_minutes: float, resumed: bool = False,
                  score_name: str = "", proxy_name: str = "", files: dict[str, Path] | None = None,
                  prompt: str = "a prompt", score_with: str = "", runs_dir: str = "runs",
                  demo_installed: bool = True) -> list[str]:
    """The summary printed when a run ends: what happened, where the results are, what to run next.

    Args:
        run_dir (`Path`): the run dir (shown in the paths and commands).
        records (`list[dict]`): metrics.jsonl's records (epoch records, and the final evaluation's).
        evals (`list[dict]`): eval_scores.jsonl's lines (`epoch`, `final`, per-image `scores`), for the paired
            standard errors of the gains; an evaluation without its line shows its gain without one.
        best (`dict`, *optional*): best/best.json (`epoch`, `score`); None when `run.keep_best` is off.
        wall_s (`float`): this command's wall-clock seconds.
        num_epochs, max_train_minutes: `run.num_epochs` and `run.max_train_minutes`, to say what ended the run.
        resumed (`bool`): the command was `diffrl resume` (its wall-clock is this session's, the training all of it).
        score_name (`str`): the held-out score's reward (the gold reward's name, else the training reward's).
        proxy_name (`str`): the training reward's name when a gold reward is the score, else "".
        files (`dict[str, Path]`): label -> path of the result files that exist (reward curve, before/after).
        prompt (`str`): an example prompt for the `diffrl sample` command.
        score_with (`str`): a reward the `diffrl sample` command scores its images with (`--reward`), or "".
        runs_dir (`str`): the folder that holds the run dir (the demo's `--runs-dir` when it is not `runs`).
        demo_installed (`bool`): gradio is installed (else the demo command says how to install it).
    """
    epochs = [r for r in records if not r.get("final")]
    trained = [r for r in epochs if r.get("wall_s") is not None]  # the records of epochs that ran
    train_s = sum(r["wall_s"] - (r.get("eval_s") or 0.0) for r in trained)
    samples = trained[-1]["samples_seen"] if trained else 0
    last_epoch = trained[-1]["epoch"] if trained else -1
    ended = ""
    if max_train_minutes and last_epoch + 1 < num_epochs:
        ended = f" (run.max_train_minutes={max_train_minutes:g} reached)"
    lines = [(f"done in {format_duration(wall_s)}{' (resumed)' if resumed else ''}: {trainer}, {last_epoch + 1} of "
              f"{num_epochs} epochs{ended}, {samples:,} samples, {format_duration(train_s)} of training")]

    curve = eval_curve(records)
    if curve:
        keys = [(p["epoch"], False) for p in curve]
        if any(r.get("final") and r.get("eval_reward_mean") is not None for r in records):
            keys[-1] = (curve[-1]["epoch"], True)  # eval_curve puts the final evaluation last
        lines += _held_out_lines(curve, keys, evals, best, score_name=score_name, proxy_name=proxy_name,
                                 run_dir=run_dir)
    else:
        lines.append("no held-out evaluation (run.eval_every and run.eval_every_minutes are 0)")
        rewards = [r["reward_mean"] for r in trained if r.get("reward_mean") is not None]
        if rewards:
            d = decimals_for(*rewards)
            lines.append(f"training reward ({proxy_name or score_name or 'reward'}, each epoch's samples): "
                         f"{rewards[0]:.{d}f} in the first epoch, {rewards[-1]:.{d}f} in the last")
    for label, path in (files or {}).items():
        lines.append(f"{label + ':':<14}{path}")

    weights = Path(run_dir) / BEST_DIR if best is not None else Path(run_dir)
    sample = (f"diffrl sample --lora {shlex.quote(str(weights))} --prompt {shlex.quote(prompt)} -n 4 "
              f"--out {shlex.quote(str(Path(run_dir) / 'samples'))}"
              + (f" --reward {shlex.quote(score_with)}" if score_with else ""))
    demo = "diffrl demo" + (f" --runs-dir {shlex.quote(runs_dir)}" if runs_dir != "runs" else "")
    if not demo_installed:
        demo = f'pip install "diffrl[demo]" && {demo}'
    export = (f"diffrl export {shlex.quote(str(run_dir))}{' --best' if best is not None else ''} "
              f"--out {shlex.quote(str(run_dir) + '-export')}")
    lines.append("next:")
    for what, command in ((f"sample the {'best' if best is not None else 'final'} weights", sample),
                          ("compare with the base model (the demo's Compare page)", demo),
                          ("export for plain diffusers, with a model card", export)):
        lines += [f"  {what}:", f"    {command}"]
    return lines


def _held_out_lines(curve: list[dict], keys: list[tuple[int, bool]], evals: list[dict], best: dict | None, *,
                    score_name: str, proxy_name: str, run_dir: Path) -> list[str]:
    """start / best / final of the held-out score; each gain with its paired standard error when eval_scores.jsonl
    has both evaluations' per-image scores. `keys[i]` is curve point i's `(epoch, final)`."""
    scores = {(e["epoch"], bool(e.get("final"))): e["scores"] for e in evals}  # a line repeated by a resume: the newest
    first, last = curve[0], curve[-1]
    before = scores.get(keys[0])
    d = decimals_for(*(p["score"] for p in curve))

    def row(label: str, score: float, i: int | None, where: str) -> str:
        change = ""
        if i is not None and i > 0:
            change = f"{curve[i]['score'] - first['score']:+.{d}f}"
            after = scores.get(keys[i])
            if before is not None and after is not None and len(after) == len(before):
                se = paired_gain(before, after)[1]
                change += f" ± {se:.{d}f}" if math.isfinite(se) else ""
        return f"  {label:<6} {score:.{d}f}  {change:<16}  {where}"

    images = f", {len(before)} images" if before else ""
    lines = [(f"held-out {'gold' if proxy_name else 'reward'} ({score_name or 'score'}{images}), "
              "change since the start ± its paired standard error:")]
    lines.append(row("start", first["score"], None,
                     f"epoch {first['epoch']}" + (" (before training)" if first["epoch"] == 0 else "")))
    if best is not None:
        i = max((j for j, k in enumerate(keys) if k[0] == best["epoch"]), default=None)
        lines.append(row("best", best["score"], i, f"epoch {best['epoch']}, weights in {Path(run_dir) / BEST_DIR}/"))
    if len(curve) > 1:
        lines.append(row("final", last["score"], len(curve) - 1,
                         f"epoch {last['epoch']}, after {format_duration(last['train_wall_s'])} of training"))
    if proxy_name:
        p = decimals_for(first["proxy"], last["proxy"])
        lines.append(f"  proxy ({proxy_name}) {first['proxy']:.{p}f} at the start, {last['proxy']:.{p}f} at the end")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# the run's console (main process)
# ---------------------------------------------------------------------------------------------------------------


class RunConsole:
    """The progress of one run and its evaluation lines. The run context makes one per run; on every process but
    the main one it is built with `enabled=False` and prints nothing.

    Args:
        run_dir (`Path`): the run dir (its eval_scores.jsonl gives the paired standard errors).
        trainer (`str`): the bar's label.
        num_epochs, max_train_minutes: `run.num_epochs` and `run.max_train_minutes` (0: no clock).
        history (`list[dict]`): the run's epoch records so far (a resumed run's), for its start score and position.
        train_s (`float`): seconds of training so far (`state.train_wall_s`).
        samples_seen (`int`): samples so far.
        enabled (`bool`): print at all (the main process).
        terminal (`bool`, *optional*): draw a tqdm bar; defaults to whether stderr is a terminal.
    """

    def __init__(self, run_dir: Path, *, trainer: str, num_epochs: int, max_train_minutes: float, history: list[dict],
                 train_s: float, samples_seen: int, enabled: bool, terminal: bool | None = None):
        self.run_dir, self.trainer, self.enabled = Path(run_dir), trainer, enabled
        self.num_epochs, self.max_train_minutes = num_epochs, max_train_minutes
        trained = [r for r in history if r.get("wall_s") is not None]
        self._epochs_done = trained[-1]["epoch"] + 1 if trained else 0
        self._train_s0, self._samples0 = train_s, samples_seen
        self._rewards = [r["reward_mean"] for r in trained[-RUNNING_EPOCHS:] if r.get("reward_mean") is not None]
        curve = eval_curve(history)
        self._start = curve[0]["score"] if curve else None  # the run's first held-out score
        self._last_plain = None  # wall-clock of the last plain progress line
        self._bar = None
        if enabled and (sys.stderr.isatty() if terminal is None else terminal):
            self._bar = tqdm(total=1.0, initial=self._fraction(train_s), desc=trainer, file=sys.stderr,
                             dynamic_ncols=True, bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")

    def _fraction(self, train_s: float) -> float:
        return progress_fraction(epochs_done=self._epochs_done, num_epochs=self.num_epochs, train_s=train_s,
                                 max_train_minutes=self.max_train_minutes)

    def line(self, text: str) -> None:
        """A line on stdout, above the bar (if any), flushed so a log file has it now."""
        if not self.enabled:
            return
        with tqdm.external_write_mode(file=sys.stdout):
            print(text, flush=True)

    def epoch(self, record: dict, *, train_s: float, show: str = "loss") -> None:
        """An epoch ended (`record`: its metrics); `train_s`: seconds of training now."""
        if not self.enabled:
            return
        self._epochs_done = record["epoch"] + 1
        if record.get("reward_mean") is not None:
            self._rewards = (self._rewards + [record["reward_mean"]])[-RUNNING_EPOCHS:]
        seconds = train_s - self._train_s0
        text = progress_text(
            epochs_done=self._epochs_done, num_epochs=self.num_epochs, train_s=train_s,
            max_train_minutes=self.max_train_minutes,
            samples_per_s=(record["samples_seen"] - self._samples0) / seconds if seconds > 0 else None,
            reward=sum(self._rewards) / len(self._rewards) if self._rewards else None,
            loss_name=show, loss=record.get(show))
        fraction = self._fraction(train_s)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(fraction - self._bar.n)
        elif self._last_plain is None or time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = time.monotonic()
            self.line(f"{self.trainer} {100 * fraction:.0f}%: {text}")

    def evaluation(self, metrics: dict, *, epoch: int, train_s: float, final: bool, note: str = "") -> None:
        """A held-out evaluation (`metrics`: its eval_* values) just finished and wrote its eval_scores.jsonl line."""
        if not self.enabled:
            return
        gold = metrics.get("eval_gold_mean") is not None
        prefix = "eval_gold" if gold else "eval_reward"
        score = metrics[f"{prefix}_mean"]
        proxy = metrics.get("eval_reward_mean") if gold else None
        if self._start is None:  # the run's first evaluation
            self._start = score
            std, n = metrics.get(f"{prefix}_std"), metrics.get(f"{prefix}_n")
            when = "before training" if epoch == 0 else "start"
            self.line(eval_line(when=f"{when} (epoch {epoch})", score=score, gold=gold, proxy=proxy,
                                score_se=std / math.sqrt(n) if std is not None and n else None))
            return
        evals = read_jsonl(self.run_dir / EVAL_SCORES_FILE, "evaluation scores")
        se = None
        if len(evals) >= 2 and len(evals[0]["scores"]) == len(evals[-1]["scores"]):
            se = paired_gain(evals[0]["scores"], evals[-1]["scores"])[1]
        when = f"{'final, after ' if final else ''}{format_duration(train_s)} (epoch {epoch})"
        self.line(eval_line(when=when, score=score, start=self._start, gain=score - self._start, se=se, gold=gold,
                            proxy=proxy, note=note))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------------------------------
# the summary of a finished run, from its run dir
# ---------------------------------------------------------------------------------------------------------------


def run_summary(run_dir: Path, cfg, *, wall_s: float, resumed: bool = False) -> str:
    """The summary of the run in `run_dir` (finished or stopped early), as `summary_lines` words it."""
    run_dir = Path(run_dir)
    outputs = {"reward curve": run_dir / CURVE_FILE, "before/after": run_dir / "images" / "before-after.png"}
    gold = cfg.reward.gold
    training = cfg.reward.name or "+".join(c.name for c in cfg.reward.components)
    lines = summary_lines(
        run_dir=run_dir, trainer=cfg.trainer, records=read_metrics(run_dir),
        evals=read_jsonl(run_dir / EVAL_SCORES_FILE, "evaluation scores"), best=read_best(run_dir), wall_s=wall_s,
        num_epochs=cfg.run.num_epochs, max_train_minutes=cfg.run.max_train_minutes, resumed=resumed,
        score_name=gold or training, proxy_name=training if gold else "",
        files={label: path for label, path in outputs.items() if path.is_file()},
        prompt=load_prompts(cfg.prompts.eval_source or cfg.prompts.source)[0], runs_dir=str(run_dir.parent),
        score_with=gold if gold and not cfg.reward.gold_kwargs else "",  # `--reward` takes no options
        demo_installed=importlib.util.find_spec("gradio") is not None)
    return "\n".join(lines)
