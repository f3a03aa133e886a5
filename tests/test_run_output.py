"""What a run prints: the evaluation lines, the progress and the summary as pure functions with hand-worked
numbers, and a tiny real `diffrl run` / `diffrl resume` whose stdout (not a terminal) has no carriage return, one
line per evaluation, the summary with the right paths and no JSON dump."""

import json
import math
import warnings
from pathlib import Path

import pytest

from diffrl.cli import main
from diffrl.training import console
from diffrl.training.console import (
    RunConsole,
    eval_line,
    format_duration,
    progress_fraction,
    progress_text,
    summary_lines,
)
from diffrl.training.metrics import TENSORBOARD_MISSING

# ---------------------------------------------------------------------------------------------------------------
# pure formatting
# ---------------------------------------------------------------------------------------------------------------


def test_durations_and_decimals():
    assert [format_duration(s) for s in (0.4, 42, 150, 600, 5400)] == ["0 s", "42 s", "2.5 min", "10.0 min", "1.5 h"]
    # three significant digits of the largest value below 1000
    assert [console.decimals_for(v) for v in (0.626, -9.9, 12.78, 123.4, 1234.0)] == [3, 3, 2, 1, 0]
    assert console.decimals_for(0.5, None, float("nan"), 12.0) == 2


def test_eval_lines():
    assert eval_line(when="2.5 min (epoch 66)", score=0.626, start=0.534, gain=0.092, se=0.033, proxy=12.78) == (
        "eval 2.5 min (epoch 66): held-out gold 0.626 (+0.092 ± 0.033 from 0.534), proxy 12.78")
    # the first evaluation: the mean's own standard error (std / √n = 0.4 / √256 = 0.025)
    assert eval_line(when="before training (epoch 0)", score=0.534, score_se=0.4 / math.sqrt(256), proxy=12.3) == (
        "eval before training (epoch 0): held-out gold 0.534 ± 0.025, proxy 12.30")
    # no gold reward: the training reward is the held-out score, no proxy; a gain without a paired se; a note
    assert eval_line(when="final, after 10.0 min (epoch 262)", score=12.5, start=12.0, gain=0.5, gold=False,
                     note="best so far, saved to best/") == (
        "eval final, after 10.0 min (epoch 262): held-out reward 12.50 (+0.50 from 12.00); best so far, saved to best/")
    assert eval_line(when="2 s (epoch 2)", score=0.5, start=0.5, gain=0.0, se=float("nan")) == (
        "eval 2 s (epoch 2): held-out gold 0.500 (+0.000 from 0.500)")


def test_progress_shows_whichever_of_epochs_and_minutes_ends_the_run():
    # 103 of 1000 epochs, 4.2 of 10 minutes: the clock ends the run, at 42 %
    assert progress_fraction(epochs_done=103, num_epochs=1000, train_s=252, max_train_minutes=10) == pytest.approx(0.42)
    # 4 of 5 epochs in 1 of 10 minutes: the epochs end it, at 80 %; no clock: epochs alone
    assert progress_fraction(epochs_done=4, num_epochs=5, train_s=60, max_train_minutes=10) == pytest.approx(0.8)
    assert progress_fraction(epochs_done=4, num_epochs=5, train_s=6000, max_train_minutes=0) == pytest.approx(0.8)
    assert progress_fraction(epochs_done=1, num_epochs=5, train_s=700, max_train_minutes=10) == 1.0
    assert progress_text(epochs_done=103, num_epochs=1000, train_s=252, max_train_minutes=10, samples_per_s=5.5,
                         reward=12.3125, loss=-12.34) == (
        "epoch 103/1000, 4.2/10 min of training, 5.5 samples/s, train reward 12.31, loss -12.3")
    # an offline trainer: no training reward; a NaN loss and an unknown rate are left out; DPOK shows its KL
    assert progress_text(epochs_done=3, num_epochs=10, train_s=30, max_train_minutes=0, samples_per_s=None,
                         reward=None, loss_name="kl", loss=float("nan")) == "epoch 3/10"
    assert progress_text(epochs_done=3, num_epochs=10, train_s=30, max_train_minutes=0, samples_per_s=1.6,
                         reward=None, loss_name="kl", loss=0.0123) == "epoch 3/10, 1.6 samples/s, kl 0.0123"


# A 4-epoch run (16 samples an epoch) evaluated on 4 images before training, at epoch 2 and at the end.
# Training time: each epoch's wall_s minus its eval_s: (10 - 4) + 6 + (11 - 5) + 6 = 24 s.
RECORDS = [
    {"epoch": 0, "eval_reward_mean": 10.0, "eval_gold_mean": 0.5, "eval_gold_std": 0.35, "eval_gold_n": 4,
     "eval_s": 4.0, "samples_seen": 16, "reward_mean": 9.0, "wall_s": 10.0},
    {"epoch": 1, "samples_seen": 32, "reward_mean": 9.5, "wall_s": 6.0},
    {"epoch": 2, "eval_reward_mean": 10.5, "eval_gold_mean": 0.75, "eval_gold_std": 0.25, "eval_gold_n": 4,
     "eval_s": 5.0, "samples_seen": 48, "reward_mean": 9.75, "wall_s": 11.0},
    {"epoch": 3, "samples_seen": 64, "reward_mean": 10.25, "wall_s": 6.0},
    {"epoch": 4, "samples_seen": 64, "final": True, "eval_reward_mean": 11.0, "eval_gold_mean": 0.875,
     "eval_gold_std": 0.2, "eval_gold_n": 4},
]
# per-image gold scores; final − start = [0.5, 0, 0.5, 0.5]: mean 0.375, sample sd 0.25, se 0.25 / √4 = 0.125
EVALS = [
    {"epoch": 0, "final": False, "scores": [0.0, 1.0, 0.5, 0.5]},
    {"epoch": 2, "final": False, "scores": [0.5, 1.0, 0.5, 1.0]},
    {"epoch": 4, "final": True, "scores": [0.5, 1.0, 1.0, 1.0]},
]


def test_summary_of_a_run_with_a_gold_reward_and_keep_best():
    run = Path("runs/r")
    lines = summary_lines(run_dir=run, trainer="draft", records=RECORDS, evals=EVALS,
                          best={"epoch": 4, "score": 0.875}, wall_s=60, num_epochs=4, max_train_minutes=0,
                          score_name="shapes_verifier", proxy_name="pickscore",
                          files={"reward curve": run / "reward_curve.png"}, prompt="a red circle",
                          score_with="shapes_verifier")
    assert lines == [
        "done in 1.0 min: draft, 4 of 4 epochs, 64 samples, 24 s of training",
        "held-out gold (shapes_verifier, 4 images), change since the start ± its paired standard error:",
        "  start  0.500                    epoch 0 (before training)",
        "  best   0.875  +0.375 ± 0.125    epoch 4, weights in runs/r/best/",
        "  final  0.875  +0.375 ± 0.125    epoch 4, after 24 s of training",
        "  proxy (pickscore) 10.00 at the start, 11.00 at the end",
        "reward curve: runs/r/reward_curve.png",
        "next:",
        "  sample the best weights:",
        "    diffrl sample --lora runs/r/best --prompt 'a red circle' -n 4 --out runs/r/samples --reward shapes_verifier",
        "  compare with the base model (the demo's Compare page):",
        "    diffrl demo",
        "  export for plain diffusers, with a model card:",
        "    diffrl export runs/r --best --out runs/r-export",
    ]


def test_summary_best_in_the_middle_without_per_image_scores_and_stopped_by_the_clock():
    # best at epoch 2: final − start without eval_scores.jsonl has no standard error; a resumed command
    lines = summary_lines(run_dir=Path("out/r"), trainer="ddpo", records=RECORDS, evals=[],
                          best={"epoch": 2, "score": 0.75}, wall_s=30, num_epochs=100, max_train_minutes=0.4,
                          resumed=True, score_name="shapes_verifier", proxy_name="jpeg_compressibility",
                          runs_dir="out", demo_installed=False)
    assert lines[0] == ("done in 30 s (resumed): ddpo, 4 of 100 epochs (run.max_train_minutes=0.4 reached), "
                        "64 samples, 24 s of training")
    assert lines[1] == "held-out gold (shapes_verifier), change since the start ± its paired standard error:"
    assert lines[3] == "  best   0.750  +0.250            epoch 2, weights in out/r/best/"
    assert lines[4] == "  final  0.875  +0.375            epoch 4, after 24 s of training"
    assert lines[-3] == '    pip install "diffrl[demo]" && diffrl demo --runs-dir out'


def test_summary_without_gold_without_keep_best():
    # the training reward is the held-out score (no proxy line); the best weights were not kept: sample and export
    # the run dir (its newest checkpoint)
    records = [{k: v for k, v in r.items() if not k.startswith("eval_gold")} for r in RECORDS]
    # the reward's per-image scores, means 10 and 11: differences [2, 0, 1, 1], sd √(2/3), se √(2/3) / 2 = 0.408
    evals = [{"epoch": 0, "final": False, "scores": [9.0, 11.0, 10.0, 10.0]},
             {"epoch": 4, "final": True, "scores": [11.0, 11.0, 11.0, 11.0]}]
    lines = summary_lines(run_dir=Path("runs/r"), trainer="ddpo", records=records, evals=evals, best=None,
                          wall_s=60, num_epochs=4, max_train_minutes=0, score_name="pickscore")
    assert lines[1:4] == [
        "held-out reward (pickscore, 4 images), change since the start ± its paired standard error:",
        "  start  10.00                    epoch 0 (before training)",
        "  final  11.00  +1.00 ± 0.41      epoch 4, after 24 s of training",
    ]
    assert "    diffrl sample --lora runs/r --prompt 'a prompt' -n 4 --out runs/r/samples" in lines
    assert "    diffrl export runs/r --out runs/r-export" in lines
    assert not any("best" in line for line in lines)


def test_summary_without_evaluation():
    records = [r for r in RECORDS if not r.get("final")]
    records = [{k: v for k, v in r.items() if not k.startswith("eval")} | {"wall_s": 6.0} for r in records]
    lines = summary_lines(run_dir=Path("runs/r"), trainer="raft", records=records, evals=[], best=None, wall_s=40,
                          num_epochs=4, max_train_minutes=0, score_name="shapes_verifier")
    assert lines[:3] == [
        "done in 40 s: raft, 4 of 4 epochs, 64 samples, 24 s of training",
        "no held-out evaluation (run.eval_every and run.eval_every_minutes are 0)",
        "training reward (shapes_verifier, each epoch's samples): 9.00 in the first epoch, 10.25 in the last",
    ]
    # an offline trainer (no training reward) that ran nothing: still a summary
    lines = summary_lines(run_dir=Path("runs/r"), trainer="diffusion_dpo", records=[], evals=[], best=None,
                          wall_s=3, num_epochs=2, max_train_minutes=0)
    assert lines[:2] == ["done in 3 s: diffusion_dpo, 0 of 2 epochs, 0 samples, 0 s of training",
                         "no held-out evaluation (run.eval_every and run.eval_every_minutes are 0)"]


# ---------------------------------------------------------------------------------------------------------------
# the console: plain lines off a terminal, a bar on one, nothing off the main process
# ---------------------------------------------------------------------------------------------------------------


def _feed(run_console, tmp_path):
    (tmp_path / "eval_scores.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVALS[:2]))
    run_console.evaluation(RECORDS[0], epoch=0, train_s=0.0, final=False)
    run_console.epoch(RECORDS[0], train_s=6.0)
    run_console.epoch(RECORDS[1], train_s=12.0)
    run_console.evaluation(RECORDS[2], epoch=2, train_s=12.0, final=False, note="best so far, saved to best/")
    run_console.close()


def test_console_off_a_terminal_prints_plain_lines(tmp_path, capsys):
    run_console = RunConsole(tmp_path, trainer="draft", num_epochs=4, max_train_minutes=0, history=[], train_s=0.0,
                             samples_seen=0, enabled=True, terminal=False)
    _feed(run_console, tmp_path)
    out, err = capsys.readouterr()
    # one progress line (the first epoch; the next is due a minute later), paired se of [0.5, 0, 0, 0.5] = 0.144
    assert out.splitlines() == [
        "eval before training (epoch 0): held-out gold 0.500 ± 0.175, proxy 10.00",
        "draft 25%: epoch 1/4, 2.67 samples/s, train reward 9.000",
        "eval 12 s (epoch 2): held-out gold 0.750 (+0.250 ± 0.144 from 0.500), proxy 10.50; best so far, saved to best/",
    ]
    assert err == "" and "\r" not in out


def test_console_on_a_terminal_draws_a_bar_and_prints_lines_above_it(tmp_path, capsys):
    run_console = RunConsole(tmp_path, trainer="draft", num_epochs=4, max_train_minutes=0, history=[], train_s=0.0,
                             samples_seen=0, enabled=True, terminal=True)
    _feed(run_console, tmp_path)
    out, err = capsys.readouterr()
    assert next(line for line in out.splitlines() if line.strip()).startswith("eval before training (epoch 0)")
    assert "draft  50%|" in err and "epoch 2/4, 2.67 samples/s, train reward 9.250" in err


def test_console_prints_nothing_off_the_main_process(tmp_path, capsys):
    run_console = RunConsole(tmp_path, trainer="draft", num_epochs=4, max_train_minutes=0, history=[], train_s=0.0,
                             samples_seen=0, enabled=False, terminal=True)
    _feed(run_console, tmp_path)
    assert capsys.readouterr() == ("", "")


# ---------------------------------------------------------------------------------------------------------------
# a real run through the CLI
# ---------------------------------------------------------------------------------------------------------------

TINY = ["run.num_epochs=3", "run.max_train_minutes=0", "run.eval_every_minutes=0", "run.eval_every=2",
        "sample.num_steps=2", "sample.eval_num_steps=2", "sample.eval_num_images=4", "sample.batch_size=2",
        "log.image_every=1", "log.grid_images=2", "log.tracker=tensorboard"]


def test_first_command_talks_without_a_terminal(tmp_path, capsys, monkeypatch):
    # a fresh install has no tensorboard: one info line on stdout, not a warning
    monkeypatch.setattr("diffrl.training.context.tensorboard_installed", lambda: False)
    monkeypatch.setattr("diffrl.training.metrics.tensorboard_installed", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["run", "draft/tiny_shapes_pickscore", f"run.output_dir={tmp_path}", "run.name=r", *TINY]) == 0
    # what Python shows a user by default: all but these (hidden unless asked for)
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    shown = [w for w in caught if not issubclass(w.category, hidden)]
    assert not shown, [str(w.message) for w in shown]
    out, err = capsys.readouterr()
    run = tmp_path / "r"
    assert "\r" not in out + err and "{" not in out  # no bar redraws, no JSON dump
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"run dir: {run}"
    assert lines.count(TENSORBOARD_MISSING) == 1
    evals = [line for line in lines if line.startswith("eval ")]
    assert len(evals) == 3 and evals[0].startswith("eval before training (epoch 0): held-out gold ")
    assert "(epoch 2)" in evals[1] and evals[2].startswith("eval final, after ") and "(epoch 3)" in evals[2]
    assert all("held-out gold" in line and "proxy" in line for line in evals)
    assert any(line.startswith("draft ") and "epoch 1/3" in line for line in lines)  # the first epoch's progress
    done = lines.index(next(line for line in lines if line.startswith("done in ")))
    summary = lines[done:]
    assert ": draft, 3 of 3 epochs, 6 samples, " in summary[0]
    assert summary[1].startswith("held-out gold (shapes_verifier, 4 images)")
    assert f"reward curve: {run / 'reward_curve.png'}" in summary
    assert f"before/after: {run / 'images' / 'before-after.png'}" in summary
    assert (run / "reward_curve.png").is_file() and (run / "images" / "before-after.png").is_file()
    assert any(line.startswith("  best ") and f"weights in {run / 'best'}/" in line for line in summary)
    assert f"    diffrl export {run} --best --out {run}-export" in summary
    assert any(line.startswith(f"    diffrl sample --lora {run / 'best'} --prompt ") and
               line.endswith(" --reward shapes_verifier") for line in summary)

    # resume says the same things: the finished run evaluated again, its summary
    assert main(["resume", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out and "{" not in out and err == ""
    assert any(line.startswith("eval final, after ") for line in out.splitlines())
    assert any(line.startswith("done in ") and "(resumed): draft, 3 of 3 epochs" in line for line in out.splitlines())
