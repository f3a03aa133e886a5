"""A run dir's layout (`diffrl.rundir`): checkpoint folder names, the newest checkpoint, and a run's config and
pipeline found from a folder inside it."""

from pathlib import Path

import pytest

from diffrl.errors import UserError
from diffrl.rundir import (
    BEST_DIR,
    checkpoint_step,
    final_checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    pipeline_of_run,
    run_config_of,
    temp_checkpoint_path,
)


def make_run(root: Path, steps=(2, 10, 4)) -> Path:
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: ddpo\nmodel:\n  pipeline: tiny-shapes\n")
    (run / "metrics.jsonl").write_text("")
    for step in steps:
        (run / "checkpoints" / f"step-{step}").mkdir()
    (run / "checkpoints" / ".tmp-step-12").mkdir()  # being written: not a checkpoint yet
    (run / BEST_DIR).mkdir()
    return run


def test_checkpoint_names_and_order(tmp_path):
    run = make_run(tmp_path)
    assert temp_checkpoint_path(run, 12) == run / "checkpoints" / ".tmp-step-12"
    assert final_checkpoint_path(run, 12) == run / "checkpoints" / "step-12"
    assert [p.name for p in list_checkpoints(run)] == ["step-2", "step-4", "step-10"]  # by number, not by name
    assert latest_checkpoint(run).name == "step-10"
    assert latest_checkpoint(tmp_path / "empty") is None


def test_checkpoint_step_of_weights(tmp_path):
    run = make_run(tmp_path)
    assert checkpoint_step(run / "checkpoints" / "step-4" / "pytorch_lora_weights.safetensors") == 4
    assert checkpoint_step(run / BEST_DIR / "pytorch_lora_weights.safetensors") is None
    assert checkpoint_step(None) is None


def test_run_config_and_pipeline_from_a_folder_in_the_run(tmp_path):
    run = make_run(tmp_path)
    for where in (run, run / BEST_DIR, run / "checkpoints" / "step-4"):
        assert pipeline_of_run(run_config_of(str(where))) == "tiny-shapes", where
    outside = tmp_path / "lora"
    outside.mkdir()
    assert run_config_of(str(outside)) == {} and run_config_of(None) == {}
    assert pipeline_of_run({}) is None and pipeline_of_run({"model": {"pipeline": ""}}) is None
    # a folder beside a config.yaml but not in a run (no metrics.jsonl) is not read as that run's
    (run / "metrics.jsonl").unlink()
    assert run_config_of(str(run / BEST_DIR)) == {}


def test_unreadable_run_config_is_one_line(tmp_path):
    run = make_run(tmp_path)
    (run / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(UserError) as info:
        run_config_of(str(run))
    assert "\n" not in str(info.value)
