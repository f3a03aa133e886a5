"""The resumable state of a policy-gradient run and its checkpoint format.

`checkpoints/step-N/` holds
    pytorch_lora_weights.safetensors   the LoRA in diffusers' format (EMA weights when EMA is on), or unet/ for
                                       full fine-tuning: what `pipe.load_lora_weights(dir)` / users load
    trainable.safetensors              the raw trainable tensors by parameter name (exact resume)
    optimizer.pt, lr_scheduler.pt      their state dicts (under FSDP2 the optimizer's with full tensors, by parameter
                                       name, as torch.distributed.checkpoint's `get_optimizer_state_dict` writes it)
    optimizer_rank<r>.pt               instead of optimizer.pt under DeepSpeed: each process's ZeRO partition
                                       (AdamW moments and fp32 master weights of its slice; loaded with
                                       weights_only=True and DeepSpeed's own few classes allowed)
    ema.safetensors                    EMA shadow weights (when EMA is on)
    <name>.safetensors, <name>_optimizer.pt   extra modules (DPOK's value network) and their optimizers
    stat_tracker.json                  per-prompt reward buffers (when used)
    rng_state_<rank>.pt                python / numpy / torch / trainer-generator states of each process
    trainer_state.json                 epoch, global_step, samples_seen, NaN counters, num_processes, trainer
                                       (and "fsdp": true under FSDP2, "deepspeed_zero": stage under DeepSpeed)
Everything is written into `.tmp-step-N` and renamed once complete. On resume every file is checked against what
it restores (counters' types, tensors' names, shapes and kinds) before anything is copied: a damaged or foreign file
is one line naming it.
"""

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diffrl import files
from diffrl.errors import UserError
from diffrl.rundir import BEST_DIR, latest_checkpoint, list_checkpoints
from diffrl.training import checkpoint as ckpt
from diffrl.training.distributed import (
    deepspeed_engine,
    full_optimizer_state_dict,
    full_state_dict,
    is_fsdp,
    load_full_optimizer_state_dict,
    zero_stage,
)
from diffrl.training.weights import (
    TRAINABLE_NAME,
    export_weights,
    load_trainable,
    save_trainable,
    tensor_mismatch,
)


@dataclass
class TrainState:
    """Everything a checkpoint restores. Counters: `epoch` = last completed epoch (-1 before the first)."""

    trainer: str
    unet: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    rng: np.random.Generator
    use_lora: bool
    ema: object = None
    stat_tracker: object = None
    extra_modules: dict = field(default_factory=dict)
    extra_optimizers: dict = field(default_factory=dict)
    epoch: int = -1
    global_step: int = 0
    samples_seen: int = 0
    nan_rewards_total: int = 0
    nan_steps_total: int = 0
    train_wall_s: float = 0.0  # wall-clock of the epochs so far, evaluations left out (run.max_train_minutes)

    def counters(self) -> dict:
        return {k: getattr(self, k) for k in
                ("epoch", "global_step", "samples_seen", "nan_rewards_total", "nan_steps_total", "train_wall_s")}


def _ema_params(state: TrainState):
    return [p for p in state.unet.parameters() if p.requires_grad]


def save_checkpoint(run_dir: Path, state: TrainState, *, pipe, accelerator, keep: int = 0) -> Path:
    """Write `checkpoints/step-{global_step}` atomically; every process must call it (collective barriers).

    A write that fails (a full or read-only disk) removes the half-written temporary folder, leaves every earlier
    checkpoint as it was, and raises one `UserError` on every process, naming the newest intact checkpoint."""
    step = state.global_step
    error = _write_checkpoint(run_dir, state, pipe=pipe, accelerator=accelerator, keep=keep)
    if accelerator.num_processes > 1:  # every process stops on any process's write error
        from accelerate.utils import gather_object  # deferred: importing a trainer loads torch, not accelerate

        error = next((e for e in gather_object([error]) if e), None)
    if error:
        if accelerator.is_main_process:
            shutil.rmtree(ckpt.temp_checkpoint_path(run_dir, step), ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        kept = (f"the newest checkpoint, {previous}, is intact: free space and `diffrl resume {run_dir}`" if previous
                else f"no checkpoint was written before: free space and `diffrl resume {run_dir}` starts it again")
        raise UserError(f"checkpoint step-{step} not saved: {error}; {kept}")
    return ckpt.final_checkpoint_path(run_dir, step)


def _write_checkpoint(run_dir: Path, state: TrainState, *, pipe, accelerator, keep: int) -> str | None:
    """The writes of `save_checkpoint`; returns the first write error (every process still reaches every
    collective call, so none waits forever on one that stopped)."""
    step = state.global_step
    tmp = ckpt.temp_checkpoint_path(run_dir, step)
    errors = []

    def attempt(write) -> None:
        if not errors:
            try:
                with files.writing(tmp):  # diffusers' own writers (LoRA export, save_pretrained) raise OSError
                    write()
            except UserError as e:
                errors.append(str(e))

    if accelerator.is_main_process:
        attempt(lambda: ckpt.begin_checkpoint(run_dir, step))
    accelerator.wait_for_everyone()
    zero = zero_stage(accelerator)

    def process_parts():
        files.save_torch(tmp / f"rng_state_{accelerator.process_index}.pt",
                         ckpt.capture_rng_state({"trainer": state.rng}))
        if zero:  # ZeRO partitions AdamW's state over the processes: each writes its own part
            files.save_torch(tmp / f"optimizer_rank{accelerator.process_index}.pt",
                             deepspeed_engine(accelerator).optimizer.state_dict())

    attempt(process_parts)
    accelerator.wait_for_everyone()
    fsdp = is_fsdp(accelerator)
    if fsdp:  # the UNet and AdamW hold shards: gather full tensors on the main process (all processes take part)
        weights = full_state_dict(state.unet, accelerator, trainable_only=state.use_lora)
        optimizer_state = full_optimizer_state_dict(state.unet, state.optimizer)

    def main_parts():
        if fsdp:
            trainable = [n for n, p in state.unet.named_parameters() if p.requires_grad]
            files.save_safetensors(tmp / TRAINABLE_NAME, {n: weights[n] for n in trainable})
            export_weights(pipe, state.unet, tmp, use_lora=state.use_lora, state_dict=weights)
            files.save_torch(tmp / "optimizer.pt", optimizer_state)
        else:
            save_trainable(state.unet, tmp)
            if state.ema is not None:
                params = _ema_params(state)
                files.save_safetensors(tmp / "ema.safetensors", {f"{i}": t.detach().cpu().contiguous()
                                                                 for i, t in enumerate(state.ema.shadow_params)})
                ckpt.write_json(tmp / "ema.json", {"optimization_step": int(state.ema.optimization_step),
                                                   "num_params": len(params)})
                with ema_weights(state):
                    export_weights(pipe, state.unet, tmp, use_lora=state.use_lora)
            else:
                export_weights(pipe, state.unet, tmp, use_lora=state.use_lora)
            if not zero:
                files.save_torch(tmp / "optimizer.pt", state.optimizer.state_dict())
        files.save_torch(tmp / "lr_scheduler.pt", state.lr_scheduler.state_dict())
        for name, module in state.extra_modules.items():
            files.save_safetensors(tmp / f"{name}.safetensors",
                                   {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()})
        for name, opt in state.extra_optimizers.items():
            files.save_torch(tmp / f"{name}_optimizer.pt", opt.state_dict())
        if state.stat_tracker is not None:
            ckpt.write_json(tmp / "stat_tracker.json", state.stat_tracker.state_dict())
        ckpt.write_json(tmp / "trainer_state.json", {
            **state.counters(), "trainer": state.trainer, "num_processes": accelerator.num_processes,
            **({"fsdp": True} if fsdp else {}), **({"deepspeed_zero": zero} if zero else {}),
        })
        ckpt.commit_checkpoint(run_dir, step)
        ckpt.prune_checkpoints(run_dir, keep)

    if accelerator.is_main_process:
        attempt(main_parts)
    accelerator.wait_for_everyone()
    return errors[0] if errors else None


def save_best(run_dir: Path, state: TrainState, *, pipe, accelerator, record: dict) -> Path:
    """Export the current weights (EMA when on) to `run_dir/best` atomically with `best.json` (`record`: the epoch
    and the score that made them the best); every process must call it (FSDP gathers full tensors)."""
    best, tmp = Path(run_dir) / BEST_DIR, Path(run_dir) / f".tmp-{BEST_DIR}"
    weights = full_state_dict(state.unet, accelerator, trainable_only=state.use_lora) if is_fsdp(accelerator) else None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        with files.writing(tmp):
            tmp.mkdir(parents=True)
            with ema_weights(state):
                export_weights(pipe, state.unet, tmp, use_lora=state.use_lora, state_dict=weights)
            ckpt.write_json(tmp / "best.json", record)
            shutil.rmtree(best, ignore_errors=True)
            tmp.replace(best)
    accelerator.wait_for_everyone()
    return best


def read_best(run_dir: Path) -> dict | None:
    """`best.json` of the weights in `run_dir/best`, or None."""
    path = Path(run_dir) / BEST_DIR / "best.json"
    return ckpt.read_json(path) if path.is_file() else None


def load_checkpoint(path: Path, state: TrainState, *, accelerator) -> None:
    """Restore `state` in place from a checkpoint folder written by `save_checkpoint`. A damaged file (truncated
    by a crash or a full disk) is a `UserError` naming it and the checkpoint to resume from instead."""
    path = Path(path)
    try:
        _load_checkpoint(path, state, accelerator=accelerator)
    except files.DamagedFile as e:
        older = [p for p in list_checkpoints(path.parent.parent) if p != path]
        run_dir = path.parent.parent
        then = f"continues from {older[-1].name}" if older else "starts the run again"
        raise UserError(f"checkpoint {path.name} is damaged: {e}; move {path} out of checkpoints/ and "
                        f"`diffrl resume {run_dir}` {then}") from None


# trainer_state.json: counter -> its least value (every one an integer; `train_wall_s` a number, absent in checkpoints
# written before it existed; `fsdp` / `deepspeed_zero` present only under FSDP2 / DeepSpeed)
TRAINER_STATE_COUNTERS = {"epoch": -1, "global_step": 0, "samples_seen": 0, "nan_rewards_total": 0,
                          "nan_steps_total": 0, "num_processes": 1}


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's `trainer_state.json` as a JSON object with `trainer` a name, `num_processes` an integer >= 1,
    `fsdp` a bool and `deepspeed_zero` a ZeRO stage (what decides whether this run can load the checkpoint at all);
    `check_counters` checks the rest. Anything else (a hand edit, another program's file) is a `DamagedFile` naming
    the file and the key, not a `TypeError` deep in the resumed run."""
    meta = ckpt.read_json(path)
    if not isinstance(meta, dict):
        raise files.DamagedFile(path, f"holds a JSON {type(meta).__name__}, not an object of the run's counters")
    if not isinstance(meta.get("trainer"), str) or not meta["trainer"]:
        raise files.DamagedFile(path, f"has trainer {files.shorten(json.dumps(meta.get('trainer')))}, not a "
                                "trainer's name")
    _check_counter(path, meta, "num_processes")
    if not isinstance(meta.get("fsdp", False), bool):
        raise files.DamagedFile(path, f"has fsdp {files.shorten(json.dumps(meta['fsdp']))}, not true or false")
    if meta.get("deepspeed_zero", 0) not in (0, 1, 2) or isinstance(meta.get("deepspeed_zero"), bool):
        raise files.DamagedFile(path, f"has deepspeed_zero {files.shorten(json.dumps(meta['deepspeed_zero']))}, "
                                "not a ZeRO stage 1 or 2")
    return meta


def check_counters(path: Path, meta: dict) -> None:
    """The counters of a `trainer_state.json` (`read_trainer_state`): every one an integer in range and
    `train_wall_s` a number of seconds; a `DamagedFile` naming the key otherwise."""
    for key in TRAINER_STATE_COUNTERS:
        _check_counter(path, meta, key)
    wall = meta.get("train_wall_s", 0.0)
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall) or wall < 0:
        raise files.DamagedFile(path, f"has train_wall_s {files.shorten(json.dumps(wall))}, not a number of seconds")


def _check_counter(path: Path, meta: dict, key: str) -> None:
    low = TRAINER_STATE_COUNTERS[key]
    if key not in meta:
        raise files.DamagedFile(path, f"has no '{key}'")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise files.DamagedFile(path, f"has {key} {files.shorten(json.dumps(value))}, not an integer >= {low}")


def _check_tensors(path: Path, targets: dict, tensors: dict) -> None:
    """`tensors` (read from `path`) fit `targets` (by the same names; `tensor_mismatch`), or a `DamagedFile` naming
    the file and the tensor: a misfit is never broadcast by `copy_`."""
    problem = tensor_mismatch(targets, tensors)
    if problem:
        raise files.DamagedFile(path, f"{problem} (damaged, or written for another model or setting)")


def _check_optimizer_state(path: Path, saved, optimizer) -> None:
    """A saved `optimizer.state_dict()` fits `optimizer`: the same groups of the same sizes, and every moment
    tensor the shape of its parameter (torch's own `load_state_dict` checks the counts with a traceback and never
    the shapes)."""
    try:
        _check_optimizer_groups(path, saved, optimizer)
    except (TypeError, AttributeError):  # params that are not lists of indices, a moment table that is not a dict
        raise files.DamagedFile(path, "is not an optimizer state of this optimizer") from None


def _check_optimizer_groups(path: Path, saved, optimizer) -> None:
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        raise files.DamagedFile(path, "is not an optimizer state (no 'state' and 'param_groups')")
    groups = optimizer.param_groups
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
    if sizes != [len(g["params"]) for g in groups]:
        raise files.DamagedFile(path, f"holds parameter groups of {sizes} parameters, the optimizer's have "
                                f"{[len(g['params']) for g in groups]}")
    params = dict(zip((i for g in saved["param_groups"] for i in g["params"]), (p for g in groups for p in g["params"])))
    for index, moments in saved["state"].items():
        if index not in params or not isinstance(moments, dict):
            raise files.DamagedFile(path, f"has state for parameter {files.shorten(index)}, which no group lists")
        for name, value in moments.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and tuple(value.shape) != tuple(params[index].shape):
                raise files.DamagedFile(path, f"has {name} of shape {list(value.shape)} for parameter {index}, whose "
                                        f"shape is {list(params[index].shape)}")


def load_zero_partition(path: Path) -> dict:
    """One process's ZeRO-1/2 optimizer partition (`optimizer_rank<r>.pt`), loaded with `weights_only=True`.

    DeepSpeed's `DeepSpeedZeroOptimizer.state_dict()` holds, besides tensors and plain containers, its loss scaler
    object (`LossScaler` / `DynamicLossScaler`), a `ZeroStageEnum` and `fragment_address` records; exactly those
    classes are allowed to the unpickler, so a planted pickle is refused like any other checkpoint file's."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # DeepSpeed runs: it is installed
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return files.torch_load(path)


def _load_checkpoint(path: Path, state: TrainState, *, accelerator) -> None:
    meta = read_trainer_state(path / "trainer_state.json")
    if meta["trainer"] != state.trainer:
        raise UserError(f"checkpoint {path} is from trainer '{meta['trainer']}', not '{state.trainer}'")
    if meta["num_processes"] != accelerator.num_processes:
        raise UserError(
            f"checkpoint {path} was written by {meta['num_processes']} processes but this run has "
            f"{accelerator.num_processes}; resume with the same number of processes (exact resume restores "
            "each process's random state)"
        )
    if meta.get("fsdp", False) != is_fsdp(accelerator):
        raise UserError(f"checkpoint {path} was written {'with' if meta.get('fsdp') else 'without'} FSDP; resume "
                        "under the same accelerate config (its optimizer state is stored differently)")
    zero = zero_stage(accelerator)
    if meta.get("deepspeed_zero", 0) != zero:
        written = f"with DeepSpeed ZeRO-{meta['deepspeed_zero']}" if meta.get("deepspeed_zero") else "without DeepSpeed"
        raise UserError(f"checkpoint {path} was written {written}; resume under the same accelerate config (its "
                        "optimizer state is stored differently)")
    check_counters(path / "trainer_state.json", meta)
    load_trainable(state.unet, path)
    if zero:  # every process reads every part (ZeRO's loader indexes the list by rank) and keeps its own
        parts = [load_zero_partition(path / f"optimizer_rank{r}.pt") for r in range(accelerator.num_processes)]
        deepspeed_engine(accelerator).optimizer.load_state_dict(parts, load_from_fp32_weights=True)
    elif is_fsdp(accelerator):
        load_full_optimizer_state_dict(state.unet, state.optimizer, files.torch_load(path / "optimizer.pt"))
    else:
        saved = files.torch_load(path / "optimizer.pt")
        _check_optimizer_state(path / "optimizer.pt", saved, state.optimizer)
        state.optimizer.load_state_dict(saved)
    state.lr_scheduler.load_state_dict(files.torch_load(path / "lr_scheduler.pt"))
    if state.ema is not None:
        shadow, params = files.load_safetensors(path / "ema.safetensors"), state.ema.shadow_params
        _check_tensors(path / "ema.safetensors", {f"{i}": p for i, p in enumerate(params)}, shadow)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(shadow[f"{i}"].to(p.device, p.dtype))
        ema_meta = ckpt.read_json(path / "ema.json")
        step = ema_meta.get("optimization_step") if isinstance(ema_meta, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise files.DamagedFile(path / "ema.json", "has no optimization_step (an integer >= 0)")
        state.ema.optimization_step = step
    for name, module in state.extra_modules.items():
        file = path / f"{name}.safetensors"
        tensors = files.load_safetensors(file)
        _check_tensors(file, module.state_dict(), tensors)
        module.load_state_dict(tensors)
    for name, opt in state.extra_optimizers.items():
        file = path / f"{name}_optimizer.pt"
        saved = files.torch_load(file)
        _check_optimizer_state(file, saved, opt)
        opt.load_state_dict(saved)
    if state.stat_tracker is not None:
        state.stat_tracker.load_state_dict(ckpt.read_json(path / "stat_tracker.json"))
    rng_file = path / f"rng_state_{accelerator.process_index}.pt"
    try:
        ckpt.restore_rng_state(files.torch_load(rng_file), {"trainer": state.rng})
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
        raise files.DamagedFile(rng_file, "does not hold the random states diffrl saves (python, numpy, torch, "
                                "trainer)") from None
    for key in ("epoch", "global_step", "samples_seen", "nan_rewards_total", "nan_steps_total"):
        setattr(state, key, meta[key])
    state.train_wall_s = float(meta.get("train_wall_s", 0.0))  # absent in checkpoints written before it existed


def resume_path(run_dir: Path, resume: str) -> Path:
    """The checkpoint to resume from: `"latest"`/`""` -> newest in the run dir, else the given folder."""
    if resume in ("", "latest"):
        found = latest_checkpoint(run_dir)
        if found is None:
            raise UserError(f"nothing to resume in {run_dir}: no checkpoints/step-N yet (the run stopped before its "
                            "first checkpoint; start it again with `diffrl run`)")
        return found
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"run.resume={resume} is not a checkpoint folder (no trainer_state.json)")
    return path


class ema_weights:
    """Context manager: the UNet's trainable parameters hold the EMA weights inside, the raw ones after."""

    def __init__(self, state: TrainState):
        self.state = state

    def __enter__(self):
        if self.state.ema is not None:
            params = _ema_params(self.state)
            self.state.ema.store(params)
            self.state.ema.copy_to(params)

    def __exit__(self, *exc):
        if self.state.ema is not None:
            self.state.ema.restore(_ema_params(self.state))
        return False
