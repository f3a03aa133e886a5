"""One run dir, one writer: `diffrl run` and `diffrl resume` (and the runs of `diffrl bench`; `diffrl pairs sample`
on the folder it fills) take an OS lock on `RUN_DIR/.lock` before they write anything; a second writer gets one line naming the run dir and the holder's PID (exit 2) and writes nothing; the
kernel drops the lock when its holder dies (SIGKILL included), so a killed run resumes as before."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import snapshot, tiny_ddpo_run

from diffrl.cli import main

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fcntl: no run dir lock on Windows")


@pytest.fixture(scope="module")
def materials(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_lock")
    tiny_ddpo_run(root, 2)
    return root


HOLD = """
import sys, time
from diffrl.files import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """Start a process that takes a run dir's lock through `diffrl.files.lock_run_dir` and keeps it; killed after."""
    started = []

    def hold(run_dir: Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=ENV, stdout=subprocess.PIPE,
                                   text=True)
        started.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield hold
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def one_line(capsys, argv) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_resume_while_another_process_holds_the_run_then_after_it_is_killed(materials, tmp_path, capsys, holder):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(materials / "runs" / "ref", run)
    assert (run / ".lock").read_bytes() == b""  # the finished run left its lock file empty
    process = holder(run)
    before = snapshot(run)
    err = one_line(capsys, ["resume", str(run)])
    assert f"run dir {run} is in use by process {process.pid}" in err, err
    assert snapshot(run) == before  # nothing written, not even the lock file
    process.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
    process.wait(timeout=30)
    capsys.readouterr()
    assert main(["resume", str(run)]) == 0  # the lock was the dead holder's only
    assert (run / ".lock").read_bytes() == b""


def test_run_of_a_name_another_process_holds(materials, tmp_path, capsys, holder):
    runs = tmp_path / "runs"
    (runs / "taken").mkdir(parents=True)
    process = holder(runs / "taken")
    recipe = str(materials / "recipe.yaml")
    err = one_line(capsys, ["run", recipe, f"run.output_dir={runs}", "run.name=taken"])
    assert f"run dir {runs / 'taken'} is in use by process {process.pid}" in err
    assert sorted(p.name for p in (runs / "taken").iterdir()) == [".lock"]  # no config.yaml, no metrics
    # a run dir whose config.yaml exists while its run still goes: in use, not "already exists; resume it"
    (runs / "taken" / "config.yaml").write_text("trainer: ddpo\n")
    err = one_line(capsys, ["run", recipe, f"run.output_dir={runs}", "run.name=taken"])
    assert "is in use by process" in err and "already exists" not in err


def test_two_runs_of_one_name_started_together(materials, tmp_path):
    """Two real `diffrl run` processes with the same run.name: one trains, the other stops with one line naming the
    first one's PID (or, if it looked after the first had ended, that the run dir exists); the run's metrics hold
    each epoch once."""
    argv = [sys.executable, "-m", "diffrl.cli", "run", str(materials / "recipe.yaml"), f"run.output_dir={tmp_path}",
            "run.name=race", "run.num_epochs=3"]
    processes = [subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    results = [(p, *p.communicate(timeout=300)) for p in processes]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err) for p, _, err in results]
    (winner, _, _), = [r for r in results if r[0].returncode == 0]
    (_, _, err), = [r for r in results if r[0].returncode == 2]
    assert err.count("\n") == 1, err
    assert (f"run dir {tmp_path / 'race'} is in use by process {winner.pid}" in err
            or f"run dir {tmp_path / 'race'} already exists" in err), err
    records = [json.loads(line) for line in (tmp_path / "race" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2]


def test_pairs_sample_into_a_folder_another_draw_fills(materials, tmp_path, capsys, holder):
    """`diffrl pairs sample --out DIR` holds DIR as a run holds its run dir: a second draw into it would overwrite
    the first one's images and chains, and the label file written last would pair them wrongly."""
    out = tmp_path / "pairs"
    out.mkdir()
    process = holder(out)
    before = snapshot(out)
    err = one_line(capsys, ["pairs", "sample", str(materials / "recipe.yaml"), "--out", str(out), "-n", "1"])
    assert f"{out} is in use by process {process.pid} (a `diffrl pairs sample` into it); give another --out" in err
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == [".lock"]
    process.kill()
    process.wait(timeout=30)
    capsys.readouterr()
    assert main(["pairs", "sample", str(materials / "recipe.yaml"), "--out", str(out), "-n", "1"]) == 0
    assert (out / "pairs.jsonl").is_file() and (out / ".lock").read_bytes() == b""


def test_a_bench_run_holds_its_run_dir(materials, tmp_path, holder):
    """`diffrl bench learn --keep DIR` trains into run dirs a `diffrl resume` can reach: its runs hold the lock too."""
    from diffrl.bench.common import run_trainer
    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    run = tmp_path / "bench-row"
    run.mkdir()
    process = holder(run)
    cfg = load_recipe(str(materials / "recipe.yaml"), [f"run.output_dir={tmp_path}", "run.name=bench-row"])
    with pytest.raises(UserError, match=f"run dir {run} is in use by process {process.pid}"):
        run_trainer(cfg, run)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
