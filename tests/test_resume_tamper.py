"""A checkpoint whose files were edited or swapped: `diffrl resume` checks every file against what it restores before
anything is copied (trainer_state.json's counters, the tensors' names, shapes and kinds in trainable.safetensors,
ema.safetensors and the optimizer's moments, the RNG states) and stops with one line naming the damaged file, what
is wrong and the checkpoint to resume from instead; exit 2, nothing written. DeepSpeed's ZeRO partitions load with
`weights_only=True` and DeepSpeed's own classes allowed, so a planted pickle there is refused too."""

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import tiny_ddpo_run
from safetensors.torch import load_file, save_file

from diffrl.cli import main

NUM_EPOCHS = 3  # checkpoints step-1 .. step-3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished 3-epoch DDPO run with EMA (so its checkpoints hold ema.safetensors too)."""
    root = tmp_path_factory.mktemp("resume_tamper")
    return tiny_ddpo_run(root, NUM_EPOCHS, optim_extra=", use_ema: true, ema_decay: 0.9")


def newest(run: Path) -> Path:
    return run / "checkpoints" / f"step-{NUM_EPOCHS}"


def edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def edit_tensors(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def first_key(tensors: dict) -> str:
    return min(tensors)


def _shrink_first(tensors):
    tensors[first_key(tensors)] = torch.ones(1)  # a [1] tensor: copy_ would broadcast it over the whole matrix


def _int_first(tensors):
    key = first_key(tensors)
    tensors[key] = torch.zeros(tensors[key].shape, dtype=torch.int64)


def _moment_of_wrong_shape(file: Path) -> None:
    state = torch.load(file, weights_only=True)
    state["state"][0]["exp_avg"] = torch.zeros(1)
    torch.save(state, file)


def _rng_without_torch_state(file: Path) -> None:
    state = torch.load(file, weights_only=True)
    del state["torch"]
    torch.save(state, file)


STATE = "trainer_state.json"
# (id, file in the newest checkpoint, damage, expected words after the file's path)
CASES = [
    ("epoch-string", STATE, lambda f: edit_json(f, lambda d: d.update(epoch="2")), 'has epoch "2", not an integer >= -1'),
    ("epoch-float", STATE, lambda f: edit_json(f, lambda d: d.update(epoch=2.5)), "has epoch 2.5, not an integer >= -1"),
    ("step-negative", STATE, lambda f: edit_json(f, lambda d: d.update(global_step=-4)),
     "has global_step -4, not an integer >= 0"),
    ("missing-key", STATE, lambda f: edit_json(f, lambda d: d.pop("samples_seen")), "has no 'samples_seen'"),
    ("trainer-not-a-name", STATE, lambda f: edit_json(f, lambda d: d.update(trainer=7)),
     "has trainer 7, not a trainer's name"),
    ("not-an-object", STATE, lambda f: f.write_text("[1, 2]\n"), "holds a JSON list"),
    ("not-json", STATE, lambda f: f.write_text("epoch: 2\n"), "is not valid JSON"),
    ("trainable-extra", "trainable.safetensors", lambda f: edit_tensors(f, lambda t: t.update(extra=torch.ones(2))),
     "has a tensor 'extra' that the model does not"),
    ("ema-shape", "ema.safetensors", lambda f: edit_tensors(f, _shrink_first), "has tensor '0' of shape [1]"),
    ("optimizer-moment-shape", "optimizer.pt", _moment_of_wrong_shape, "has exp_avg of shape [1] for parameter 0"),
    ("rng-state-keys", "rng_state_0.pt", _rng_without_torch_state, "does not hold the random states diffrl saves"),
]


def resume_refused(capsys, run: Path, expected: str) -> str:
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = main(["resume", str(run)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err
    assert f"move {newest(run)} out of checkpoints/ and `diffrl resume {run}` continues from step-{NUM_EPOCHS - 1}" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    return err


@pytest.mark.parametrize("file, damage, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_tampered_checkpoint_file_is_one_line_naming_it(reference, tmp_path, capsys, file, damage, expected):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    damage(newest(run) / file)
    resume_refused(capsys, run, f"{newest(run) / file} {expected}")


@pytest.mark.parametrize("damage, what", [(_shrink_first, "shape [1], the model's is [{shape}]"),
                                          (_int_first, "dtype torch.int64, the model's is torch.float32"),
                                          (lambda t: t.pop(first_key(t)), "has no tensor '{key}'")])
def test_trainable_tensors_must_fit_the_model(reference, tmp_path, capsys, damage, what):
    """The LoRA tensor the file held first (by name) is replaced by a [1] tensor, integers, or dropped: the message
    names it, with its shape as the reference run wrote it."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    file = newest(run) / "trainable.safetensors"
    original = load_file(str(file))
    key = first_key(original)
    edit_tensors(file, damage)
    shape = ", ".join(str(n) for n in original[key].shape)
    resume_refused(capsys, run, f"{file} " + ("" if "no tensor" in what else f"has tensor '{key}' of ")
                   + what.format(shape=shape, key=key))


def test_doing_what_the_message_says_resumes_to_the_same_weights(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    edit_json(newest(run) / STATE, lambda d: d.update(epoch="2"))
    resume_refused(capsys, run, "not an integer")
    newest(run).rename(tmp_path / "tampered-step")
    assert main(["resume", str(run)]) == 0  # redoes the last epoch from step-2
    ours = load_file(str(newest(run) / "trainable.safetensors"))
    theirs = load_file(str(newest(reference) / "trainable.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO partitions: weights_only=True with DeepSpeed's own classes


def _zero_state_dict(deepspeed):
    """The keys and kinds of `DeepSpeedZeroOptimizer.state_dict()` (deepspeed/runtime/zero/stage_1_and_2.py), built
    from DeepSpeed's own classes without running its kernels."""
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    moments = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0), "exp_avg_sq": torch.arange(6.0) ** 2}
    return {
        "loss_scaler": DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                         consecutive_hysteresis=False),
        "dynamic_loss_scale": True, "overflow": False, "clip_grad": 1.0,
        "base_optimizer_state": {"state": {0: moments}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999),
                                                                           "params": [0]}]},
        "single_partition_of_fp32_groups": [torch.linspace(0, 1, 6)],
        "zero_stage": ZeroStageEnum.gradients, "group_paddings": [0], "param_alignment_paddings": [0],
        "partition_count": [2], "ds_version": deepspeed.__version__,
        "param_slice_mappings": [OrderedDict({"unet.conv.weight": fragment_address(numel=6, start=0)})],
    }


def test_a_zero_partition_loads_with_weights_only(tmp_path):
    deepspeed = pytest.importorskip("deepspeed")
    from diffrl.files import save_torch
    from diffrl.training.state import load_zero_partition

    saved = _zero_state_dict(deepspeed)
    save_torch(tmp_path / "optimizer_rank0.pt", saved)
    loaded = load_zero_partition(tmp_path / "optimizer_rank0.pt")
    assert type(loaded["loss_scaler"]) is type(saved["loss_scaler"])
    assert loaded["loss_scaler"].__dict__ == saved["loss_scaler"].__dict__
    assert loaded["zero_stage"] is saved["zero_stage"]
    assert loaded["param_slice_mappings"] == saved["param_slice_mappings"]
    assert torch.equal(loaded["base_optimizer_state"]["state"][0]["exp_avg_sq"], torch.arange(6.0) ** 2)
    assert torch.equal(loaded["single_partition_of_fp32_groups"][0], torch.linspace(0, 1, 6))


class _Payload:
    """Unpickling this runs `pathlib.Path(marker).touch()`: what a planted pickle would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_planted_pickle_in_a_zero_partition_is_refused(tmp_path):
    deepspeed = pytest.importorskip("deepspeed")
    from diffrl.errors import UserError
    from diffrl.training.state import load_zero_partition

    marker = tmp_path / "ran"
    saved = _zero_state_dict(deepspeed)
    saved["loss_scaler"] = _Payload(marker)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    (tmp_path / "optimizer_rank0.pt").write_bytes(buffer.getvalue())
    with pytest.raises(UserError, match="optimizer_rank0.pt is not a readable torch file"):
        load_zero_partition(tmp_path / "optimizer_rank0.pt")
    assert not marker.exists()
