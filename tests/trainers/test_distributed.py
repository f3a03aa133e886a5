"""Two CPU processes (accelerate's debug launcher, gloo): identical weights on both ranks after every optimizer
step, and samples per epoch = per-process batch × batches × processes."""

import json
from pathlib import Path

import pytest
from pg_helpers import StepLog, load_cfg, tiny_pipeline_dir, tiny_recipe


def _worker(recipe: dict, run_dir: str, out_dir: str, trainer: str) -> None:
    import importlib

    from accelerate import PartialState

    train = importlib.import_module(f"diffrl.trainers.{trainer}").train
    log = StepLog()
    train(load_cfg(recipe), Path(run_dir), step_callback=log)
    rank = PartialState().process_index
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(log.steps))


@pytest.mark.parametrize("trainer", ["ddpo", "dpok"])
def test_two_processes_keep_identical_weights(tmp_path, trainer, monkeypatch):
    from accelerate import debug_launcher

    # else accelerate gives each CPU process cores / processes threads, which on a small busy CPU oversubscribes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from diffrl.trainers.common.metrics import read_metrics

    pipe_dir = tiny_pipeline_dir(tmp_path)
    groups = {
        "run": {"num_epochs": 2, "save_every": 0},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
        "log": {"tracker": "none", "image_every": 1, "grid_images": 4},
    }
    if trainer == "dpok":
        groups["trainer"] = "dpok"
        groups["train"] = {"learning_rate": 1e-2, "policy_batch_size": 2, "gradient_accumulation_steps": 1,
                           "policy_steps": 2, "value_batch_size": 4, "value_steps": 1, "reward_weight": 1.0}
    recipe = tiny_recipe(pipe_dir, tmp_path, **groups)
    run_dir = tmp_path / "run"
    debug_launcher(_worker, args=(recipe, str(run_dir), str(tmp_path), trainer), num_processes=2)

    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [step for step, _ in rank0] == [0, 1, 2, 3, 4]  # the start + 2 optimizer steps per epoch × 2 epochs
    assert rank0 == rank1  # same starting weights, and the same weights after every step
    assert len({fp for _, fp in rank0}) == 5  # and the weights did move at every step

    records = [r for r in read_metrics(run_dir) if not r.get("final")]
    # per-process batch 2 × 2 batches × 2 processes = 8 samples per epoch
    assert [r["samples_seen"] for r in records] == [8, 16]
    assert (run_dir / "images" / "epoch-1.png").is_file()
