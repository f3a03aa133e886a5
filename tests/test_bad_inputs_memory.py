"""A size within the bounds (`config.MAX_BATCH_SIZE`, `steering.bounds`) that the machine cannot hold: the run or
the verb stops with one line naming the setting to lower and its value now, exit code 2, and what was written
before (checkpoints, images) is kept whole and goes on.

Running out of memory is simulated, not provoked: a user's reward (`test_bad_inputs_memory:running_out`) scores
like jpeg_compressibility and raises the error an allocator raises — torch's `OutOfMemoryError` (CUDA), Python's
`MemoryError`, the `RuntimeError` of torch's CPU allocator — at a chosen call, i.e. at a chosen epoch of a run.
"""

import shutil

import pytest
import torch
from cli_helpers import snapshot, tiny_ddpo_run
from safetensors.torch import load_file

from diffrl.cli import is_out_of_memory, main

NUM_EPOCHS = 3  # a checkpoint every epoch: step-1, step-2, step-3

ERRORS = {
    "cuda": lambda: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.2 GiB "
        "is free. Of the allocated memory 70.1 GiB is allocated by PyTorch.\nIf reserved but unallocated memory is "
        "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."),
    "python": MemoryError,
    "cpu-allocator": lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
        "7200000000 bytes."),
}
FIRST_WORDS = {"cuda": "(CUDA out of memory)", "python": "(MemoryError)", "cpu-allocator": "(DefaultCPUAllocator: "
               "not enough memory: you tried to allocate 7200000000 bytes.)"}
FAIL = {"at_call": None, "error": "cuda"}  # set by a test: the reward call (1-based) that runs out of memory
calls = []


class _RunningOut:
    """jpeg_compressibility's scores, until call FAIL["at_call"], which raises FAIL["error"]'s exception."""

    def __init__(self):
        from rewards import get_reward

        self.inner = get_reward("jpeg_compressibility")
        self.name, self.differentiable, self.higher_is_better = "running_out", False, True

    def __call__(self, images, prompts, metadata=None):
        calls.append(len(images))
        if len(calls) == FAIL["at_call"]:
            raise ERRORS[FAIL["error"]]()
        return self.inner(images, prompts, metadata)


def running_out():
    return _RunningOut()


@pytest.fixture(scope="module")
def materials(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    tiny_ddpo_run(root, NUM_EPOCHS)  # the uninterrupted reference, with jpeg_compressibility
    return root


@pytest.fixture
def failing(monkeypatch):
    def fail(at_call: int, error: str = "cuda") -> None:
        calls.clear()
        monkeypatch.setitem(FAIL, "at_call", at_call)
        monkeypatch.setitem(FAIL, "error", error)

    yield fail
    calls.clear()


def final_weights(run) -> dict:
    return load_file(str(run / "checkpoints" / f"step-{NUM_EPOCHS}" / "trainable.safetensors"))


def assert_same_weights(a, b) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def one_line(capsys, argv) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("error", list(ERRORS))
def test_a_run_out_of_memory_is_one_line_naming_the_sizes_and_keeps_its_checkpoints(materials, tmp_path, capsys,
                                                                                   failing, error):
    recipe = str(materials / "recipe.yaml")
    runs = tmp_path / "runs"
    failing(at_call=NUM_EPOCHS, error=error)  # the last epoch's sampling batch: step-1 and step-2 are written
    err = one_line(capsys, ["run", recipe, f"run.output_dir={runs}", "run.name=oom",
                            "reward.name=test_bad_inputs_memory:running_out"])
    run = runs / "oom"
    newest = run / "checkpoints" / f"step-{NUM_EPOCHS - 1}"
    assert err.startswith(f"diffrl: error: out of memory during the run {FIRST_WORDS[error]}: lower "
                          "sample.batch_size (now 2; sampling), sample.num_batches_per_epoch (now 1; an epoch's "
                          "samples are kept for training) or train.batch_size (now 2), per process"), err
    assert "raise optim.gradient_accumulation_steps" in err and "model.gradient_checkpointing=true" in err
    assert f"{run} keeps its checkpoints (newest step-{NUM_EPOCHS - 1}): go on from it in a new run with " \
           f"run.resume={newest} and the smaller size" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{s}" for s in range(1, NUM_EPOCHS)]
    assert (run / ".lock").read_bytes() == b""  # the lock was released
    if error != "cuda":
        return
    # doing what the message says (memory freed: the same sizes fit now) ends where the uninterrupted run did
    kept = snapshot(run)
    failing(at_call=None)
    assert main(["run", recipe, f"run.output_dir={runs}", "run.name=next", f"run.resume={newest}",
                 "reward.name=test_bad_inputs_memory:running_out"]) == 0
    assert snapshot(run) == kept
    assert_same_weights(materials / "runs" / "ref", runs / "next")
    # and so does `diffrl resume` of the run that ran out
    assert main(["resume", str(run)]) == 0
    assert_same_weights(materials / "runs" / "ref", run)


def test_a_run_out_of_memory_before_its_first_checkpoint(materials, tmp_path, capsys, failing):
    failing(at_call=1, error="python")
    err = one_line(capsys, ["run", str(materials / "recipe.yaml"), f"run.output_dir={tmp_path}", "run.name=early",
                            "reward.name=test_bad_inputs_memory:running_out"])
    assert f"{tmp_path / 'early'} has no checkpoint yet: start a new run with the smaller size" in err


def test_resume_out_of_memory_is_one_line_too(materials, tmp_path, capsys, failing):
    run = tmp_path / "run"
    shutil.copytree(materials / "runs" / "ref", run)
    shutil.rmtree(run / "checkpoints" / f"step-{NUM_EPOCHS}")
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("name: jpeg_compressibility",
                                                    "name: test_bad_inputs_memory:running_out"))
    kept = snapshot(run / "checkpoints")
    failing(at_call=1)
    err = one_line(capsys, ["resume", str(run)])
    assert "out of memory during the run (CUDA out of memory)" in err and f"newest step-{NUM_EPOCHS - 1}" in err
    assert snapshot(run / "checkpoints") == kept


def test_sample_out_of_memory_names_batch_size_and_keeps_the_images_written(materials, tmp_path, capsys, failing):
    out = tmp_path / "o"
    failing(at_call=2)  # the second batch
    err = one_line(capsys, ["sample", "--pipeline", str(materials / "pipe"), "--prompt", "a red circle", "-n", "3",
                            "--batch-size", "1", "--steps", "1", "--reward", "test_bad_inputs_memory:running_out",
                            "--out", str(out)])
    assert err == "diffrl: error: out of memory (CUDA out of memory): lower --batch-size (now 1)\n"
    assert sorted(p.name for p in out.iterdir()) == ["00000.png"]  # the first batch's image, whole


def test_score_out_of_memory(materials, tmp_path, capsys, failing):
    from cli_helpers import one_line_error

    failing(at_call=1, error="cpu-allocator")
    image = tmp_path / "image.png"
    from PIL import Image

    Image.new("RGB", (16, 16), "red").save(image)
    one_line_error(capsys, ["score", "--reward", "test_bad_inputs_memory:running_out", "--prompt", "x", "--out",
                            str(tmp_path / "s.json"), str(image), str(image)],
                   "out of memory (DefaultCPUAllocator: not enough memory: you tried to allocate 7200000000 bytes.): "
                   "score fewer images per call (now 2)", tmp_path)


def test_other_errors_are_not_taken_for_memory():
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocators' error types
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 9.00 GB)"))
