"""Two CPU processes (accelerate's debug launcher, gloo): identical weights on both ranks after every optimizer
step, and samples per epoch = per-process batch × batches × processes."""

import json
import sys
from pathlib import Path

import pytest
import torch
from pg_helpers import (
    StepLog,
    launch,
    load_cfg,
    policy_gradient_trainers,
    registered_trainers,
    require_deepspeed,
    tiny_pipeline_dir,
    tiny_recipe,
    with_trainer,
)


def _worker(recipe: dict, run_dir: str, out_dir: str, trainer: str) -> None:
    import importlib

    from accelerate import PartialState

    train = importlib.import_module(f"diffrl.trainers.{trainer}").train
    log = StepLog()
    train(load_cfg(recipe), Path(run_dir), step_callback=log)
    rank = PartialState().process_index
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(log.steps))


@pytest.mark.parametrize("trainer", registered_trainers())
def test_two_processes_keep_identical_weights(tmp_path, trainer, monkeypatch):

    # else accelerate gives each CPU process cores / processes threads, which on a small busy CPU oversubscribes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from diffrl.training.metrics import read_metrics

    pipe_dir = tiny_pipeline_dir(tmp_path)
    groups = {
        "run": {"num_epochs": 2, "save_every": 0},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
        "log": {"tracker": "none", "image_every": 1, "grid_images": 4},
    }
    recipe = tiny_recipe(pipe_dir, tmp_path, **with_trainer(groups, trainer))
    run_dir = tmp_path / "run"
    launch(_worker, args=(recipe, str(run_dir), str(tmp_path), trainer), num_processes=2)

    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [step for step, _ in rank0] == [0, 1, 2, 3, 4]  # the start + 2 optimizer steps per epoch × 2 epochs
    assert rank0 == rank1  # same starting weights, and the same weights after every step
    assert len({fp for _, fp in rank0}) == 5  # and the weights did move at every step

    records = [r for r in read_metrics(run_dir) if not r.get("final")]
    # per-process batch 2 × 2 batches × 2 processes = 8 samples per epoch
    assert [r["samples_seen"] for r in records] == [8, 16]
    assert (run_dir / "images" / "epoch-1.png").is_file()


# ------------------------------------------------------------------------------------------------ FSDP2


def _fsdp_worker(recipe: dict, run_dir: str, out_dir: str, trainer: str, resume: bool) -> None:
    import importlib

    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # accelerate enables FSDP on GPUs only and keeps MULTI_CPU here; forcing the type runs its FSDP2 prepare path
    # (fully_shard over gloo), the code an `accelerate launch` with an FSDP config runs on GPUs, on this CPU. Both
    # shared states: every new AcceleratorState() copies PartialState's values over its own.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    log = StepLog()
    shards = []

    def callback(info):
        log(info)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in info["params"])
        shards.append([hasattr(p, "to_local") for p in info["params"]] == [True] * len(info["params"])
                      and local < sum(p.numel() for p in info["params"]))

    train = importlib.import_module(f"diffrl.trainers.{trainer}").train
    train(load_cfg(recipe), Path(run_dir), accelerator=accelerator, step_callback=callback, resume=resume)
    rank = accelerator.process_index
    Path(out_dir, f"fsdp-rank{rank}.json").write_text(json.dumps({"steps": log.steps, "sharded": shards}))


@pytest.mark.parametrize("trainer, full_finetune", [("ddpo", False), ("ddpo", True), ("dpok", False)])
def test_fsdp2_two_processes_match_data_parallel_and_resume(tmp_path, trainer, full_finetune, monkeypatch):
    """The same run under DDP-style data parallelism and under accelerate's FSDP2: FSDP shards every UNet weight,
    both ranks hold the same full weights after every step, and those equal the data-parallel run's (FSDP's
    reduce-scatter mean is the explicit gradient mean); checkpoints export the same weights; resuming under FSDP
    from the first epoch's checkpoint gives the uninterrupted run's final weights bit for bit."""
    import shutil

    from safetensors.torch import load_file

    from diffrl.training.metrics import read_metrics

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pipe_dir = tiny_pipeline_dir(tmp_path)
    groups = {
        "run": {"num_epochs": 2, "save_every": 1},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
        "log": {"tracker": "none", "image_every": 1, "grid_images": 4},
        "model": {"full_finetune": full_finetune, "lora": {"rank": 2, "alpha": 2.0}},
    }
    if full_finetune:  # a smaller step for the whole UNet
        groups["optim"] = {"learning_rate": 1e-4}
    recipe = tiny_recipe(pipe_dir, tmp_path, **with_trainer(groups, trainer))
    ddp_dir, fsdp_dir, resumed_dir = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "resumed"
    launch(_worker, args=(recipe, str(ddp_dir), str(tmp_path), trainer), num_processes=2)
    launch(_fsdp_worker, args=(recipe, str(fsdp_dir), str(tmp_path), trainer, False), num_processes=2)

    ddp = json.loads((tmp_path / "rank0.json").read_text())
    rank0 = json.loads((tmp_path / "fsdp-rank0.json").read_text())
    rank1 = json.loads((tmp_path / "fsdp-rank1.json").read_text())
    assert all(rank0["sharded"]) and len(rank0["sharded"]) == 5  # every trainable weight was an FSDP shard
    assert [step for step, _ in rank0["steps"]] == [0, 1, 2, 3, 4]
    assert rank0["steps"] == rank1["steps"]  # the same full weights on both ranks after every step
    assert len({fp for _, fp in rank0["steps"]}) == 5  # and they moved at every step
    # FSDP's reduce-scatter sums in another order than the explicit mean: ~1e-9 apart after a step, which AdamW's
    # division by sqrt(v) magnifies where a gradient is near zero (about 1e-5 after four steps at lr 1e-2)
    for (_, fsdp_fp), (_, ddp_fp) in zip(rank0["steps"], ddp):
        assert fsdp_fp == pytest.approx(ddp_fp, rel=1e-4)
    records = [r for r in read_metrics(fsdp_dir) if not r.get("final")]
    assert [r["samples_seen"] for r in records] == [8, 16]  # per-process batch 2 × 2 batches × 2 processes
    # the gradient is the mean over processes, as under data parallelism (AdamW alone would not tell a sum from it)
    ddp_records = [r for r in read_metrics(ddp_dir) if not r.get("final")]
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ddp_records], rel=1e-5)

    # the exported weights (diffusers' LoRA format, or the full UNet) match the data-parallel run's
    exported = "unet/diffusion_pytorch_model.safetensors" if full_finetune else "pytorch_lora_weights.safetensors"
    for file in ("trainable.safetensors", exported):
        ours = load_file(str(fsdp_dir / "checkpoints/step-4" / file))
        theirs = load_file(str(ddp_dir / "checkpoints/step-4" / file))
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=1e-4)

    # resume under FSDP from step-2 (after epoch 0): the uninterrupted run's final weights, bit for bit
    shutil.copytree(fsdp_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints/step-4")
    launch(_fsdp_worker, args=(recipe, str(resumed_dir), str(tmp_path), trainer, True), num_processes=2)
    for file in ("trainable.safetensors", "optimizer.pt"):
        if file.endswith(".pt"):
            ours = torch.load(resumed_dir / "checkpoints/step-4" / file, weights_only=True)["state"]
            theirs = torch.load(fsdp_dir / "checkpoints/step-4" / file, weights_only=True)["state"]
            ours = {f"{k}.{s}": v for k, d in ours.items() for s, v in d.items()}
            theirs = {f"{k}.{s}": v for k, d in theirs.items() for s, v in d.items()}
        else:
            ours = load_file(str(resumed_dir / "checkpoints/step-4" / file))
            theirs = load_file(str(fsdp_dir / "checkpoints/step-4" / file))
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key


# ------------------------------------------------------------------------------------------------ DeepSpeed


def _deepspeed_accelerator(stage: int, mixed_precision: str = "no"):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0)  # the recipe's max_grad_norm must win
    accelerator = Accelerator(cpu=True)
    # accelerate enables DeepSpeed off the CPU only; forcing the type (as for FSDP above) runs its DeepSpeed prepare
    # path, `deepspeed.initialize` with ZeRO over gloo, the code an `accelerate launch` with a DeepSpeed config runs
    PartialState().distributed_type = DistributedType.DEEPSPEED
    accelerator.state.distributed_type = DistributedType.DEEPSPEED
    plugin.set_mixed_precision(mixed_precision)
    plugin.select(_from_accelerator_state=True)
    accelerator.state.deepspeed_plugins = plugin
    accelerator.deepspeed_engine_wrapped = None
    return accelerator


def _deepspeed_worker(recipe: dict, run_dir: str, out_dir: str, trainer: str, stage: int, resume: bool) -> None:
    import importlib
    import logging

    accelerator = _deepspeed_accelerator(stage)
    log = StepLog()
    seen = {}
    warned = []  # accelerate's own warnings at prepare ("Gradient accumulation steps mismatch ...")
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("accelerate.accelerator").addHandler(handler)

    def callback(info):
        log(info)
        engine = accelerator.deepspeed_engine_wrapped.engine
        partition = sum(t.numel() for t in engine.optimizer.single_partition_of_fp32_groups)
        seen.update(optimizer=type(engine.optimizer).__name__, clipping=engine.gradient_clipping(),
                    partitioned=partition < sum(p.numel() for p in info["params"]),
                    same_unet=engine.module is info["pipe"].unet,
                    accumulation=[engine.gradient_accumulation_steps(), accelerator.gradient_accumulation_steps])

    train = importlib.import_module(f"diffrl.trainers.{trainer}").train
    train(load_cfg(recipe), Path(run_dir), accelerator=accelerator, step_callback=callback, resume=resume)
    Path(out_dir, f"ds-rank{accelerator.process_index}.json").write_text(
        json.dumps({"steps": log.steps, "warned": warned, **seen}))


@pytest.mark.parametrize("trainer, stage, full_finetune", [("ddpo", 2, False), ("ddpo", 1, True), ("dpok", 2, False)])
def test_deepspeed_zero_two_processes_match_data_parallel_and_resume(tmp_path, trainer, stage, full_finetune,
                                                                     monkeypatch):
    """The same run under data parallelism and under accelerate's DeepSpeed ZeRO: AdamW's state is partitioned,
    the samplers' UNet is the engine's, the recipe's clipping is the engine's, both ranks hold the same weights after
    every step and those equal the data-parallel run's; resuming from the first epoch's checkpoint (each rank's
    ZeRO partition) gives the uninterrupted run's final weights bit for bit."""
    require_deepspeed()
    import shutil

    from safetensors.torch import load_file

    from diffrl.training.metrics import read_metrics

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    groups = {
        "run": {"num_epochs": 2, "save_every": 1},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
        "log": {"tracker": "none", "image_every": 0},
        "model": {"full_finetune": full_finetune, "lora": {"rank": 2, "alpha": 2.0}},
        "optim": {"learning_rate": 1e-4 if full_finetune else 1e-2, "max_grad_norm": 0.5},
    }
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer(groups, trainer))
    ddp_dir, ds_dir, resumed_dir = tmp_path / "ddp", tmp_path / "ds", tmp_path / "resumed"
    launch(_worker, args=(recipe, str(ddp_dir), str(tmp_path), trainer), num_processes=2)
    launch(_deepspeed_worker, args=(recipe, str(ds_dir), str(tmp_path), trainer, stage, False),
                   num_processes=2)

    ddp = json.loads((tmp_path / "rank0.json").read_text())
    rank0 = json.loads((tmp_path / "ds-rank0.json").read_text())
    rank1 = json.loads((tmp_path / "ds-rank1.json").read_text())
    assert rank0["optimizer"] == "DeepSpeedZeroOptimizer" and rank0["partitioned"] and rank0["same_unet"]
    assert rank0["clipping"] == 0.5
    # backwards per optimizer step: DDPO one per trained step (2) of its one minibatch, DPOK one (accumulation 1);
    # accelerate agrees with the engine from the start instead of warning of a mismatch
    assert rank0["accumulation"] == [1 if trainer == "dpok" else 2] * 2
    assert not [m for m in rank0["warned"] if "mismatch" in m], rank0["warned"]
    assert [step for step, _ in rank0["steps"]] == [0, 1, 2, 3, 4]
    assert rank0["steps"] == rank1["steps"]  # the same weights on both ranks after every step
    assert len({fp for _, fp in rank0["steps"]}) == 5  # and they moved at every step
    for (_, ds_fp), (_, ddp_fp) in zip(rank0["steps"], ddp):  # reduction order differs (see the FSDP test)
        assert ds_fp == pytest.approx(ddp_fp, rel=1e-4)
    records = [r for r in read_metrics(ds_dir) if not r.get("final")]
    ddp_records = [r for r in read_metrics(ddp_dir) if not r.get("final")]
    assert [r["samples_seen"] for r in records] == [8, 16]
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ddp_records], rel=1e-5)
    final = ds_dir / "checkpoints/step-4"
    assert (final / "optimizer_rank0.pt").is_file() and (final / "optimizer_rank1.pt").is_file()
    exported = "unet/diffusion_pytorch_model.safetensors" if full_finetune else "pytorch_lora_weights.safetensors"
    for file in ("trainable.safetensors", exported):
        ours, theirs = load_file(str(final / file)), load_file(str(ddp_dir / "checkpoints/step-4" / file))
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=1e-4)

    shutil.copytree(ds_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints/step-4")
    launch(_deepspeed_worker, args=(recipe, str(resumed_dir), str(tmp_path), trainer, stage, True),
                   num_processes=2)
    ours = load_file(str(resumed_dir / "checkpoints/step-4/trainable.safetensors"))
    theirs = load_file(str(final / "trainable.safetensors"))
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    for rank in (0, 1):  # each rank's AdamW moments and fp32 master slice
        ours = torch.load(resumed_dir / f"checkpoints/step-4/optimizer_rank{rank}.pt", weights_only=False)
        theirs = torch.load(final / f"optimizer_rank{rank}.pt", weights_only=False)
        for a, b in zip(ours["single_partition_of_fp32_groups"], theirs["single_partition_of_fp32_groups"]):
            assert torch.equal(a, b)
        for index, moments in theirs["base_optimizer_state"]["state"].items():
            for name, value in moments.items():
                assert torch.equal(ours["base_optimizer_state"]["state"][index][name], value), (rank, index, name)


def _deepspeed_nan_worker(recipe: dict, run_dir: str, out_dir: str) -> None:
    from diffrl.trainers import ddpo
    from diffrl.training.guards import TrainingStopped

    ddpo.ddpo_loss = lambda log_probs, *args: (log_probs.sum() * float("nan"), {})  # this forked process only
    from safetensors.torch import save_file

    accelerator = _deepspeed_accelerator(2)
    log = StepLog()

    def callback(info):
        log(info)
        if info["global_step"] == 0 and accelerator.is_main_process:
            start = {n: p.detach().clone() for n, p in info["unet"].named_parameters() if p.requires_grad}
            save_file(start, str(Path(out_dir, "start.safetensors")))

    try:
        ddpo.train(load_cfg(recipe), Path(run_dir), accelerator=accelerator, step_callback=callback)
        message = "not stopped"
    except TrainingStopped as err:
        message = str(err)
    Path(out_dir, f"nan-rank{accelerator.process_index}.json").write_text(json.dumps([message, log.steps]))


def test_deepspeed_skips_non_finite_steps_and_the_nan_guard_stops_the_run(tmp_path, monkeypatch):
    """NaN losses under ZeRO: the engine skips each step (weights untouched), and the NaN guard stops the run with
    a checkpoint of the starting weights, as without DeepSpeed."""
    require_deepspeed()
    from safetensors.torch import load_file

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path,
                         sample={"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
                         log={"tracker": "none", "image_every": 0}, run={"num_epochs": 2, "save_every": 0, "max_nan_steps": 2})
    launch(_deepspeed_nan_worker, args=(recipe, str(tmp_path / "run"), str(tmp_path)), num_processes=2)
    for rank in (0, 1):
        message, steps = json.loads((tmp_path / f"nan-rank{rank}.json").read_text())
        assert "2 optimizer steps in a row had a NaN/inf loss" in message
        assert [step for step, _ in steps] == [0]  # no step was taken
    saved = load_file(str(tmp_path / "run/checkpoints/step-0/trainable.safetensors"))
    start = load_file(str(tmp_path / "start.safetensors"))
    assert saved and saved.keys() == start.keys()
    assert all(torch.equal(saved[n], start[n]) for n in saved)


def _deepspeed_bf16_worker(recipe: dict, run_dir: str, out_dir: str) -> None:
    from diffrl.trainers import ddpo

    accelerator = _deepspeed_accelerator(2, "bf16")
    log, seen = StepLog(), {}

    def callback(info):
        log(info)
        seen["dtype"] = str(next(info["unet"].parameters()).dtype)
        if accelerator.deepspeed_engine_wrapped is not None:
            seen["check_overflow"] = accelerator.deepspeed_engine_wrapped.engine._config.bfloat16_config.check_grad_overflow

    ddpo.train(load_cfg(recipe), Path(run_dir), accelerator=accelerator, step_callback=callback)
    Path(out_dir, f"bf16-rank{accelerator.process_index}.json").write_text(json.dumps({"steps": log.steps, **seen}))


def test_deepspeed_bf16_trains_the_bf16_unet_with_ratio_one_and_overflow_checks(tmp_path, monkeypatch):
    """DeepSpeed's bf16 casts the whole UNet (LoRA included) to bf16, fp32 master weights in ZeRO: rollout and
    training use the same bf16 network, so the first inner step's ratio is exactly 1; non-finite steps are checked."""
    require_deepspeed()

    from diffrl.training.metrics import read_metrics

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, run={"num_epochs": 2, "save_every": 0},
                         sample={"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
                         log={"tracker": "none", "image_every": 0})
    launch(_deepspeed_bf16_worker, args=(recipe, str(tmp_path / "run"), str(tmp_path)), num_processes=2)
    rank0 = json.loads((tmp_path / "bf16-rank0.json").read_text())
    rank1 = json.loads((tmp_path / "bf16-rank1.json").read_text())
    assert rank0["dtype"] == "torch.bfloat16" and rank0["check_overflow"] is True
    assert rank0["steps"] == rank1["steps"] and len({fp for _, fp in rank0["steps"]}) == 5
    records = [r for r in read_metrics(tmp_path / "run") if not r.get("final")]
    assert [r["ratio_first_step"] for r in records] == [1.0, 1.0]


def _slice_worker(recipe: dict, run_dir: str, out_dir: str, trainer: str) -> None:
    from accelerate import PartialState

    from diffrl.trainers import get_trainer
    from diffrl.training import rollout as rollout_module

    original, seen = rollout_module.local_batch, []

    def recording(rollout, values, accelerator):
        traj, local, ok = original(rollout, values, accelerator)
        seen.append({"all": [float(v) for v in values], "local": local.tolist(),
                     "all_rewards": rollout.all_rewards.tolist(), "local_rewards": rollout.rewards.tolist()})
        return traj, local, ok

    module = get_trainer(trainer)  # imported first: a trainer may bind `local_batch` by name
    for loaded in list(sys.modules.values()):  # every module holding it (rollout, the shared epoch, trainers)
        if getattr(loaded, "local_batch", None) is original:
            loaded.local_batch = recording
    module.train(load_cfg(recipe), Path(run_dir))
    Path(out_dir, f"slice{PartialState().process_index}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("trainer", policy_gradient_trainers())
def test_each_process_trains_on_its_own_slice_of_the_advantages(tmp_path, trainer, monkeypatch):
    """Advantages are computed from every process's rewards (gathered in rank order); process r must train on
    positions r·n .. (r+1)·n − 1, its own samples. Every rank taking slice 0 would still keep identical weights."""

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    groups = {"run": {"num_epochs": 1, "save_every": 0},
              "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
              "log": {"tracker": "none", "image_every": 0}}
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer(groups, trainer))
    recipe["advantage"] = {**recipe.get("advantage", {}), "mode": "batch"}  # (a flow trainer's groups of 2 stay)
    launch(_slice_worker, args=(recipe, str(tmp_path / "run"), str(tmp_path), trainer), num_processes=2)
    ranks = [json.loads((tmp_path / f"slice{r}.json").read_text())[0] for r in (0, 1)]
    n = 4  # 2 per batch × 2 batches per process
    assert ranks[0]["all"] == ranks[1]["all"] and len(ranks[0]["all"]) == 2 * n  # the same advantages everywhere
    for r, seen in enumerate(ranks):
        # this process's rewards sit at its rank's positions of the gathered ones, and so do its advantages
        assert seen["local_rewards"] == seen["all_rewards"][r * n:(r + 1) * n]
        assert seen["local"] == pytest.approx(seen["all"][r * n:(r + 1) * n], abs=1e-6)
    assert ranks[0]["local"] != ranks[1]["local"]
