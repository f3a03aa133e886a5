"""Kill a run with SIGKILL right after a checkpoint, resume it, and get bit-identical final weights."""

import multiprocessing
from pathlib import Path

import pytest
import torch
from pg_helpers import load_cfg, offline_trainers, registered_trainers, tiny_pipeline_dir, tiny_recipe, with_trainer
from safetensors.torch import load_file


def _train(recipe: dict, run_dir, **kwargs) -> None:
    import importlib

    importlib.import_module(f"diffrl.trainers.{recipe['trainer']}").train(load_cfg(recipe), Path(run_dir), **kwargs)


def _recipe(pipe_dir, out, reward, trainer="ddpo"):
    from diffrl.trainers import get_trainer

    groups = with_trainer({"run": {"num_epochs": 3, "save_every": 1},
                           "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
                           "log": {"tracker": "none", "image_every": 0}}, trainer)
    if trainer in offline_trainers():  # no rollouts: its reward is called only by evaluations, which kill it here
        groups["run"]["eval_every"] = 1
    if get_trainer(trainer).ADVANTAGE_DEFAULTS is not None:  # per-prompt statistics: the stat tracker resumes too
        # (over the trainer's tiny settings: a flow trainer's groups of 2 images per prompt stay)
        groups["advantage"] = {**groups.get("advantage", {}), "mode": "per_prompt", "stat_buffer_size": 4,
                               "stat_min_count": 2}
    # (DPOK's tiny settings: 2 policy steps per epoch with the value baseline on, whose weights and optimizer resume)
    return tiny_recipe(pipe_dir, out, **{**groups, "reward": reward})


@pytest.mark.parametrize("trainer", registered_trainers())
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted_run(tmp_path, trainer):
    from diffrl.config import load_run_config
    from diffrl.training.metrics import read_metrics

    pipe_dir = tiny_pipeline_dir(tmp_path)

    # the uninterrupted run
    straight_dir = tmp_path / "straight"
    _train(_recipe(pipe_dir, tmp_path, {"name": "pg_helpers:smooth_brightness"}, trainer), straight_dir)

    # the same run, SIGKILLed inside epoch 1 (its first reward call after checkpoint step-2 was written)
    killed_dir = tmp_path / "killed"
    reward = {"name": "pg_helpers:kill_after_checkpoint", "kwargs": {"run_dir": str(killed_dir), "step": 2}}
    recipe = _recipe(pipe_dir, tmp_path, reward, trainer)
    # a forked child (the modules are already imported) running the training, killed by the reward with SIGKILL
    child = multiprocessing.get_context("fork").Process(target=_train, args=(recipe, str(killed_dir)))
    child.start()
    child.join(timeout=600)
    assert child.exitcode == -9
    assert (killed_dir / "killed.marker").exists()
    assert sorted(p.name for p in (killed_dir / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step-2"]
    assert [r["epoch"] for r in read_metrics(killed_dir)] == [0]

    # resume from the run dir alone, as `diffrl resume RUN_DIR` does
    import importlib

    importlib.import_module(f"diffrl.trainers.{trainer}").train(load_run_config(killed_dir), killed_dir, resume=True)

    files = sorted(p.name for p in (straight_dir / "checkpoints" / "step-6").glob("*.safetensors"))
    assert "trainable.safetensors" in files  # and every extra module (DPOK's value network), the exported LoRA
    for file in files:
        final_straight = load_file(str(straight_dir / "checkpoints" / "step-6" / file))
        final_resumed = load_file(str(killed_dir / "checkpoints" / "step-6" / file))
        assert final_straight.keys() == final_resumed.keys()
        for name in final_straight:
            assert torch.equal(final_straight[name], final_resumed[name]), (file, name)
    # metrics: each epoch exactly once, with the same rewards as the uninterrupted run
    straight, resumed = ([r for r in read_metrics(d) if not r.get("final")] for d in (straight_dir, killed_dir))
    assert [r["epoch"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == b["loss"]
        assert a.get("value_loss") == b.get("value_loss")


def test_resume_without_checkpoint_is_a_user_error(tmp_path):
    from diffrl.errors import UserError

    with pytest.raises(UserError, match="nothing to resume"):
        _train(_recipe(tiny_pipeline_dir(tmp_path), tmp_path, {"name": "pg_helpers:brightness"}), tmp_path / "empty",
               resume=True)


def test_resume_refuses_other_process_count(tmp_path):
    from diffrl.errors import UserError
    from diffrl.training.state import load_checkpoint

    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"trainer": "ddpo", "num_processes": 2}')

    class _Acc:
        num_processes = 1

    class _State:
        trainer = "ddpo"

    with pytest.raises(UserError, match="same number of processes"):
        load_checkpoint(Path(ckpt), _State(), accelerator=_Acc())
