"""Bad input and faults through the real CLI entry point: one line on stderr, exit code 2, nothing lost.

Every case of the table runs `diffrl.cli.main` in-process and checks what a user's terminal would see: exit code 2,
exactly one stderr line (no status line before it, no traceback), the expected words, and every file that existed
before the command byte-identical after it, with no file added (no 0-byte leftover, no half-written output).
The fault tests put a full disk under a checkpoint, a sample write and a score write (an injected ENOSPC, and a
real full tmpfs where this machine lets the tests mount one), and damage a checkpoint and metrics.jsonl the way
a crash does; each then shows that the run resumes to the same weights as an uninterrupted one.
"""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error, snapshot, tiny_ddpo_run
from safetensors.torch import load_file, save_file

import diffrl.files
from diffrl.cli import main

REPO = Path(__file__).resolve().parent.parent
NUM_EPOCHS = 3  # one optimizer step per epoch: checkpoints step-1, step-2, step-3


# ---------------------------------------------------------------------------------------------------------------
# materials: a tiny pipeline, a finished 3-epoch run, bad files


@pytest.fixture(scope="module")
def materials(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    tiny_ddpo_run(root, NUM_EPOCHS)
    (root / "binary.bin").write_bytes(b"\xff\xfe\x00\x81 not text")
    (root / "prompts.txt").write_text("a red circle\n")
    (root / "a_file").write_text("a regular file, not a folder\n")
    (root / "earlier").mkdir()
    (root / "earlier" / "00000.png").write_bytes(b"an earlier image")
    (root / "earlier" / "scores.json").write_text("[]\n")
    (root / "image.png").write_bytes(_png_bytes())
    (root / "bomb.png").write_bytes(_bomb_png(10_000, 10_000))  # 1 to 2 times PIL's bound: PIL only warns
    (root / "bigger_bomb.png").write_bytes(_bomb_png(20_000, 20_000))  # over twice the bound: PIL raises
    (root / "flow_lora").mkdir()  # a LoRA of a flow transformer (SD3 / FLUX key names)
    save_file({f"transformer.transformer_blocks.0.attn.to_q.lora_{ab}.weight": torch.zeros(shape)
               for ab, shape in (("A", (2, 32)), ("B", (32, 2)))}, str(root / "flow_lora" / "pytorch_lora_weights.safetensors"))
    no_unet = root / "pipe_without_unet"
    shutil.copytree(root / "pipe", no_unet, ignore=shutil.ignore_patterns("unet"))
    bad_config = root / "pipe_bad_unet_config"
    shutil.copytree(root / "pipe", bad_config)
    (bad_config / "unet" / "config.json").write_text('{"in_channels": 4,')  # cut short
    from recipe_inputs import write_label_file

    # two labelled pairs drawn with the recipe's sample settings (16x16 images), for D3PO and Diffusion-DPO
    write_label_file(root / "labels", num_steps=2, guidance_scale=3.0, eta=1.0, choices=(0, 1))
    common = (f"run: {{name: pairs, output_dir: {root / 'runs'}, num_epochs: 1}}\n"
              f"model: {{pipeline: {root / 'pipe'}, lora: {{rank: 2, alpha: 2.0}}}}\n"
              "sample: {num_steps: 2, guidance_scale: 3.0, eta: 1.0, batch_size: 2, num_batches_per_epoch: 1}\n"
              "reward: {name: jpeg_compressibility}\nprompts: {source: [a red circle]}\n"
              "log: {tracker: none, image_every: 0}\n")
    (root / "d3po.yaml").write_text("trainer: d3po\n" + common + "train: {batch_size: 1, preference: labels, "
                                    "labels: LABELS}\n")
    (root / "dpo.yaml").write_text("trainer: diffusion_dpo\n" + common + "train: {batch_size: 1, steps_per_epoch: 1, "
                                   "pairs: LABELS}\n")
    return root


def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buffer, format="PNG")
    return buffer.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG of a few hundred bytes whose header declares `width` x `height` RGB pixels (a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    rows = zlib.compress(b"\0" * (3 * width + 1) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def copy_run(materials, dest: Path, *, keep_epochs: int = NUM_EPOCHS) -> Path:
    """A copy of the finished reference run as a run killed after epoch `keep_epochs - 1` left it: newer
    checkpoints and metrics records dropped."""
    run = dest / "run"
    shutil.copytree(materials / "runs" / "ref", run)
    for step in range(keep_epochs + 1, NUM_EPOCHS + 1):
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:keep_epochs]))
    return run


# ---------------------------------------------------------------------------------------------------------------
# the table: every verb


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage_newest_trainable(run: Path) -> None:
    _truncate(run / "checkpoints" / f"step-{NUM_EPOCHS}" / "trainable.safetensors")


def _damage_newest_lora(run: Path) -> None:
    _truncate(run / "checkpoints" / f"step-{NUM_EPOCHS}" / "pytorch_lora_weights.safetensors")


def _binary_run_config(run: Path) -> None:
    (run / "config.yaml").write_bytes(b"\xff\xfe" + (run / "config.yaml").read_bytes())


SAMPLE = ["sample", "--pipeline", "{pipe}", "--prompt", "a red circle", "--steps", "1"]
STEER = ["steer", "--pipeline", "{pipe}", "--method", "best-of-n", "--reward", "jpeg_compressibility",
         "--prompt", "a red circle", "--out", "{tmp}/steer"]
NOT_FINITE = "must be a finite number"

CASES = [
    # validate / run: unreadable recipes and numbers that are not numbers
    ("validate-binary-recipe", ["validate", "{root}/binary.bin"], "is not UTF-8 text", None),
    ("validate-lr-nan", ["validate", "{recipe}", "optim.learning_rate=.nan"], NOT_FINITE, None),
    ("validate-lr-inf", ["validate", "{recipe}", "optim.learning_rate=.inf"], NOT_FINITE, None),
    ("validate-lr-negative", ["validate", "{recipe}", "optim.learning_rate=-1"], "must be > 0, got -1", None),
    ("validate-lr-huge", ["validate", "{recipe}", "optim.learning_rate=1e9"], "must be <= 1", None),
    ("validate-old-lr-key", ["validate", "{recipe}", "train.learning_rate=1e-4"], "moved to 'optim.learning_rate'",
     None),
    ("validate-guidance-nan", ["validate", "{recipe}", "sample.guidance_scale=.nan"], NOT_FINITE, None),
    ("validate-train-float-nan", ["validate", "{recipe}", "train.clip_range=.nan"], NOT_FINITE, None),
    ("validate-negative-seed", ["validate", "{recipe}", "run.seed=-1"], "run.seed must be >= 0", None),
    ("validate-seed-beyond-numpy", ["validate", "{recipe}", "run.seed=4294967296"],
     "run.seed must be <= 4294967295, got 4294967296", None),
    ("validate-steps-beyond-scheduler", ["validate", "{recipe}", "sample.num_steps=1001"],
     "sample.num_steps is 1001, more than the 1000 timesteps the model was trained with", None),
    ("run-steps-beyond-scheduler", ["run", "{recipe}", "run.name=new", "sample.eval_num_steps=5000"],
     "sample.eval_num_steps is 5000, more than the 1000 timesteps", None),
    ("validate-reward-kwarg-nan", ["validate", "{recipe}", "reward.kwargs.quality=.nan"], NOT_FINITE, None),
    ("validate-reward-kwarg-type", ["validate", "{recipe}", "reward.kwargs.quality=high"],
     "reward.kwargs: quality must be int, got 'high' (str) (in the options of reward 'jpeg_compressibility')", None),
    ("validate-jpeg-quality-zero", ["validate", "{recipe}", "reward.kwargs.quality=0"],
     "reward.kwargs: quality must be >= 1, got 0", None),
    ("run-jpeg-quality-huge", ["run", "{recipe}", "run.name=new", "reward.kwargs.quality=1000"],
     "reward.kwargs: quality must be <= 100, got 1000", None),
    # validate runs the checks `run` makes before training
    ("validate-reward-option-typo", ["validate", "{recipe}", "reward.kwargs.qualty=80"],
     "reward.kwargs: reward 'jpeg_compressibility' has no option 'qualty'; did you mean 'quality'?", None),
    ("validate-pipeline-without-unet", ["validate", "{recipe}", "model.pipeline={root}/pipe_without_unet"],
     "has no unet folder", None),
    ("validate-pipeline-bad-unet-config", ["validate", "{recipe}", "model.pipeline={root}/pipe_bad_unet_config"],
     "unet/config.json is not valid JSON", None),
    ("validate-lora-target-typo", ["validate", "{recipe}", "model.lora.target_modules=[to_qq]"],
     "'to_qq' matches no module of the UNet", None),
    ("validate-lora-target-not-linear", ["validate", "{recipe}", "model.lora.target_modules=[norm1]"],
     "which LoRA cannot adapt", None),
    ("run-lora-target-typo", ["run", "{recipe}", "run.name=new", "model.lora.target_modules=[nosuch]"],
     "'nosuch' matches no module", None),
    ("run-lr-nan", ["run", "{recipe}", "run.name=new", "optim.learning_rate=.nan"], NOT_FINITE, None),
    ("run-same-name", ["run", "{recipe}"], "already exists; continue it with `diffrl resume", None),
    # sizes: per-process batch sizes bounded (config.MAX_BATCH_SIZE), prompts bounded (config.MAX_PROMPT_CHARS)
    ("validate-sample-batch-huge", ["validate", "{recipe}", "sample.batch_size=1000000000"],
     "sample.batch_size must be <= 4096, got 1000000000", None),
    ("run-train-batch-huge", ["run", "{recipe}", "run.name=new", "train.batch_size=100000"],
     "train.batch_size must be <= 4096, got 100000", None),
    ("validate-lora-rank-huge", ["validate", "{recipe}", "model.lora.rank=100000000"],
     "model.lora.rank must be <= 4096, got 100000000", None),
    ("run-eval-images-huge", ["run", "{recipe}", "run.name=new", "sample.eval_num_images=1000000000"],
     "sample.eval_num_images must be <= 100000, got 1000000000", None),
    ("validate-prompt-huge", ["validate", "{recipe}", f"prompts.source=[a red circle, {'x' * 3_000_000}]"],
     "prompts.source: prompt 2 is 3000000 characters, more than the bound of 10000", None),
    ("run-prompt-huge", ["run", "{recipe}", "run.name=new", f"prompts.eval_source=[{'x' * 10_001}]"],
     "prompts.eval_source: prompt 1 is 10001 characters, more than the bound of 10000", None),
    # a weighted sum whose every weight is 0 is a constant reward (the demo refuses it too)
    *[(f"{verb}-reward-weights-all-zero", [verb, "{recipe}", "run.name=new", "reward.name=''",
                                           ("reward.components=[{{name: jpeg_compressibility, weight: 0.0}}, "
                                            "{{name: jpeg_compressibility, weight: 0, kwargs: {{quality: 50}}}}]")],
       "every reward.components weight is 0", None) for verb in ("validate", "run")],
    # resume: a damaged run dir
    ("resume-binary-config", ["resume", "{run}"], "config.yaml is not UTF-8 text", _binary_run_config),
    ("resume-truncated-checkpoint", ["resume", "{run}"],
     f"checkpoint step-{NUM_EPOCHS} is damaged", _damage_newest_trainable),
    # sample: files, numbers, devices, outputs
    ("sample-binary-prompts", [*SAMPLE[:3], "--prompts", "{root}/binary.bin", "--out", "{tmp}/o"],
     "is not UTF-8 text", None),
    ("sample-guidance-nan", [*SAMPLE, "--guidance-scale", "nan", "--out", "{tmp}/o"], NOT_FINITE, None),
    ("sample-guidance-inf", [*SAMPLE, "--guidance-scale", "inf", "--out", "{tmp}/o"], NOT_FINITE, None),
    ("sample-eta-negative", [*SAMPLE, "--eta", "-1", "--out", "{tmp}/o"], "must be >= 0", None),
    ("sample-steps-zero", [*SAMPLE, "--steps", "0", "--out", "{tmp}/o"], "must be > 0, got 0", None),
    ("sample-seed-negative", [*SAMPLE, "--seed", "-3", "--out", "{tmp}/o"], "must be >= 0, got -3", None),
    ("sample-steps-beyond-scheduler", [*SAMPLE[:-1], "1001", "--out", "{tmp}/o"],
     "--steps is 1001, more than the 1000 timesteps the model was trained with (num_train_timesteps)", None),
    ("sample-lcm-steps-beyond-original", ["sample", "--pipeline", "tiny-shapes-lcm", "--prompt", "a red circle",
                                          "--steps", "51", "--out", "{tmp}/o"],
     "--steps is 51, more than the 50 steps LCM picks from (original_inference_steps)", None),
    ("sample-seed-beyond-torch", [*SAMPLE, "--seed", str(2**64), "--out", "{tmp}/o"],
     f"argument --seed: must be <= {2**64 - 1}", None),
    ("sample-last-seed-beyond-torch", [*SAMPLE, "-n", "2", "--seed", str(2**64 - 1), "--out", "{tmp}/o"],
     "the largest seed torch takes", None),
    ("sample-unknown-device", [*SAMPLE, "--device", "gpu0", "--out", "{tmp}/o"], "unknown device 'gpu0'", None),
    ("sample-existing-out", [*SAMPLE, "--out", "{root}/earlier"], "already holds files", None),
    ("sample-out-under-a-file", [*SAMPLE, "--out", "{root}/a_file/out"], "a_file is a file, not a folder", None),
    ("sample-reward-option-typo", [*SAMPLE, "--reward", "jpeg_compressibility", "--reward-arg", "qualty=80",
                                   "--out", "{tmp}/o"], "has no option 'qualty'", None),
    ("sample-reward-option-type", [*SAMPLE, "--reward", "clip_score", "--reward-arg", "model=12", "--out", "{tmp}/o"],
     "model must be str, got 12 (int) (in the options of reward 'clip_score')", None),
    *[(f"score-jpeg-quality-{quality}", ["score", "--reward", "jpeg_compressibility", "--reward-arg",
                                         f"quality={quality}", "--prompt", "x", "--out", "{tmp}/s.json",
                                         "{root}/image.png"], expected, None)
      for quality, expected in [(-5, "quality must be >= 1, got -5"), (0, "quality must be >= 1, got 0"),
                                (1000, "quality must be <= 100, got 1000")]],
    ("sample-truncated-lora", ["sample", "--lora", "{run}", "--prompt", "a red circle", "--out", "{tmp}/o"],
     "pytorch_lora_weights.safetensors is not a readable safetensors file", _damage_newest_lora),
    # a LoRA that matches no module of the pipeline: diffusers loads nothing and says nothing
    ("sample-unet-lora-into-flow-pipeline", ["sample", "--pipeline", "tiny-shapes-flow", "--lora", "{run}", "--prompt",
                                             "a red circle", "--steps", "1", "--out", "{tmp}/o"],
     "matches no module of StableDiffusion3Pipeline (its weights are for: unet); it was trained on another", None),
    ("sample-flow-lora-into-unet-pipeline", [*SAMPLE, "--lora", "{root}/flow_lora", "--out", "{tmp}/o"],
     "matches no module of StableDiffusionPipeline (its weights are for: transformer)", None),
    ("sample-lora-of-another-size", ["sample", "--pipeline", "tiny-shapes", "--lora", "{run}", "--prompt",
                                     "a red circle", "--steps", "1", "--out", "{tmp}/o"],
     "into StableDiffusionPipeline: Error(s) in loading state_dict for UNet2DConditionModel; size mismatch", None),
    # steer
    ("steer-steps-zero", [*STEER, "--steps", "0"], "argument --steps: must be > 0, got 0", None),
    ("steer-steps-beyond-scheduler", [*STEER, "--steps", "1001"], "is 1001, more than the 1000 timesteps", None),
    ("steer-seed-beyond-torch", [*STEER, "--seed", str(2**64)], f"argument --seed: must be <= {2**64 - 1}", None),
    ("steer-num-prompts-zero", [*STEER, "--num-prompts", "0"], "argument --num-prompts: must be > 0", None),
    ("steer-setting-not-a-number", [*STEER, "--set", "num_samples=abc"], "num_samples must be int, got 'abc'", None),
    ("steer-num-samples-huge", [*STEER, "--set", "num_samples=100000000"],
     "best-of-n's num_samples must be 1 to 4096 (per prompt), got 100000000", None),
    *[(f"steer-{method}-{key}-huge", [*STEER[:3], "--method", method, *STEER[5:], "--set", f"{key}={value}"],
       f"{method}'s {key} must be 1 to {bound} (per prompt), got {value}", None)
      for method, key, value, bound in [("fk", "num_particles", 10**8, 4096), ("svdd", "num_candidates", 10**8, 4096),
                                        ("svdd", "num_samples", 0, 4096), ("reno", "iterations", 10**7, 10_000)]],
    ("steer-svdd-rows-huge", [*STEER[:3], "--method", "svdd", *STEER[5:], "--set", "num_samples=300"],
     "svdd would hold 6000 latents per prompt at a step; keep it at most 4096 (num_samples=300, num_candidates=20)",
     None),
    ("steer-setting-nan", ["steer", "--pipeline", "{pipe}", "--method", "fk", "--reward", "jpeg_compressibility",
                           "--prompt", "a red circle", "--out", "{tmp}/steer", "--set", "lmbda=.nan"], NOT_FINITE,
     None),
    ("steer-guidance-nan", [*STEER, "--guidance-scale", "nan"], NOT_FINITE, None),
    ("steer-unknown-device", [*STEER, "--device", "tpu"], "unknown device 'tpu'", None),
    ("steer-existing-out", [*STEER[:-2], "--out", "{root}/earlier"], "already holds files", None),
    ("steer-binary-prompts", [*STEER[:-4], "--prompts", "{root}/binary.bin", "--out", "{tmp}/steer"],
     "is not UTF-8 text", None),
    # score
    ("score-out-under-a-file", ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out",
                                "{root}/a_file/scores.json", "{root}/image.png"], "a_file is a file, not a folder",
     None),
    ("score-not-an-image", ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out", "{tmp}/s.json",
                            "{root}/binary.bin"], "cannot read image", None),
    ("score-out-is-an-input", ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out",
                               "{root}/earlier/../image.png", "{root}/image.png"],
     "is one of the images to score and would be overwritten", None),
    # a user's reward whose output is not one score per image
    *[(f"score-user-reward-{factory}", ["score", "--reward", f"test_bad_inputs:{factory}", "--prompt", "x", "--out",
                                        "{tmp}/s.json", "{root}/image.png"],
       (f"reward 'test_bad_inputs:{factory}' returned scores of shape {shape} for 1 image; it must return one score "
        "per image, a tensor of shape [1]"), None) for factory, shape in (("too_many_scores", [2]), ("column_scores", [1, 1]))],
    ("score-user-reward-bare-tensor", ["score", "--reward", "test_bad_inputs:bare_tensor", "--prompt", "x", "--out",
                                       "{tmp}/s.json", "{root}/image.png"],
     "reward 'test_bad_inputs:bare_tensor' returned Tensor, not RewardOutput(scores=<tensor [B]>)", None),
    ("score-bigger-decompression-bomb", ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out",
                                         "{tmp}/s.json", "{root}/bigger_bomb.png"],
     "more than 178956970 pixels, twice PIL's bound", None),
    # demo: refused before gradio starts (an address in TEST-NET-1, RFC 5737, is on no machine)
    ("demo-port-beyond-65535", ["demo", "--port", "70000"], "argument --port: must be <= 65535, got 70000", None),
    ("demo-port-zero", ["demo", "--port", "0"], "argument --port: must be >= 1, got 0", None),
    ("demo-host-not-this-machine", ["demo", "--host", "192.0.2.1", "--port", "7861"],
     "cannot serve the demo on --host 192.0.2.1 --port 7861: Cannot assign requested address", None),
    # bench sample
    ("bench-sample-unknown-device", ["bench", "sample", "--pipeline", "{pipe}", "--device", "cuda:x"],
     "unknown device 'cuda:x'", None),
    ("bench-sample-steps-zero", ["bench", "sample", "--pipeline", "{pipe}", "--steps", "0"], "must be > 0", None),
    ("bench-sample-guidance-nan", ["bench", "sample", "--pipeline", "{pipe}", "--guidance-scale", "nan"], NOT_FINITE,
     None),
    ("bench-sample-out-under-a-file", ["bench", "sample", "--pipeline", "{pipe}", "--out", "{root}/a_file/r.json"],
     "a_file is a file, not a folder", None),
]
if not torch.cuda.is_available():
    CASES += [
        ("sample-cuda-without-gpu", [*SAMPLE, "--device", "cuda", "--out", "{tmp}/o"], "no CUDA device", None),
        ("steer-cuda-without-gpu", [*STEER, "--device", "cuda"], "no CUDA device", None),
        ("bench-sample-cuda-without-gpu", ["bench", "sample", "--pipeline", "{pipe}", "--device", "cuda"],
         "no CUDA device", None),
    ]


@pytest.mark.parametrize("argv, expected, damage", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_loses_nothing(materials, tmp_path, capsys, argv, expected, damage):
    run = copy_run(materials, tmp_path) if any("{run}" in a for a in argv) else None
    if damage is not None:
        damage(run)
    values = {"root": materials, "pipe": materials / "pipe", "recipe": materials / "recipe.yaml", "run": run,
              "tmp": tmp_path}
    one_line_error(capsys, [a.format(**values) for a in argv], expected, materials, tmp_path)


class _MiscountingReward:
    """A user's reward (`test_bad_inputs:FACTORY` below) whose scores have the wrong shape for the batch."""

    name, differentiable, higher_is_better = "miscounting", False, True

    def __init__(self, shape, bare: bool = False):
        self.shape, self.bare = shape, bare

    def __call__(self, images, prompts, metadata=None):
        from rewards.base import RewardOutput

        scores = torch.zeros(self.shape(images.shape[0]))
        return scores if self.bare else RewardOutput(scores=scores)


def too_many_scores():
    return _MiscountingReward(lambda b: (b + 1,))


def column_scores():
    return _MiscountingReward(lambda b: (b, 1))


def bare_tensor():
    return _MiscountingReward(lambda b: (b,), bare=True)


@pytest.mark.parametrize("factory, shape", [("too_many_scores", "[3]"), ("column_scores", "[2, 1]")])
def test_user_reward_of_the_wrong_shape_stops_run_in_one_line(materials, tmp_path, capsys, factory, shape):
    """The reward runs only once the run has started (its run dir exists); its wrong output is still one line, not a
    traceback whose last line says it, and no epoch is recorded."""
    capsys.readouterr()
    code = main(["run", str(materials / "recipe.yaml"), f"run.output_dir={tmp_path}", "run.name=user",
                 f"reward.name=test_bad_inputs:{factory}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"reward 'test_bad_inputs:{factory}' returned scores of shape {shape} for 2 images; it must return one "
            "score per image, a tensor of shape [2]") in err
    assert not (tmp_path / "user" / "metrics.jsonl").exists() or not (tmp_path / "user" / "metrics.jsonl").read_text()


# ---------------------------------------------------------------------------------------------------------------
# label files (D3PO from labels, Diffusion-DPO pairs): `validate` and `run` refuse them before any run dir exists


def _edit_line(folder: Path, index: int, **changes) -> None:
    path = folder / "pairs.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[index].update(changes)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _image_file(path: Path, size: int) -> None:
    from PIL import Image

    Image.new("RGB", (size, size), "blue").save(path)


def _symlink_out(folder: Path) -> None:
    (folder / "images" / "passwd.png").symlink_to("/etc/passwd")
    _edit_line(folder, 0, images=["images/passwd.png", "images/00000-1.png"])


def _outside_image(folder: Path) -> None:
    _image_file(folder.parent / "outside.png", 16)  # a real image, but not in the label file's folder
    _edit_line(folder, 1, images=["images/00001-0.png", "../outside.png"])


def _edit_metadata(folder: Path, **changes) -> None:
    from safetensors import safe_open

    file = folder / "latents" / "00001.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = {**f.metadata(), **changes}
    save_file(load_file(str(file)), str(file), metadata=meta)


def _edit_tensors(folder: Path, **changes) -> None:
    from safetensors import safe_open

    file = folder / "latents" / "00001.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    save_file({**load_file(str(file)), **changes}, str(file), metadata=meta)


BOTH, D3PO = ("d3po", "dpo"), ("d3po",)
LABEL_CASES = [  # (id, trainers, damage of a copy of the good label folder, expected words after "pairs.jsonl:")
    ("absolute-image-path", BOTH, lambda f: _edit_line(f, 0, images=[str(f / "images/00000-0.png"),
                                                                   "images/00000-1.png"]),
     "1: image {folder}/images/00000-0.png is an absolute path; give it relative to the label file's folder"),
    ("image-outside-the-folder", BOTH, _outside_image, "2: image ../outside.png leads out of the label file's folder"),
    ("symlink-to-a-system-file", BOTH, _symlink_out,
     "1: image images/passwd.png leads out of the label file's folder {folder} (to /etc/passwd)"),
    ("latents-outside-the-folder", D3PO, lambda f: _edit_line(f, 1, latents="../../labels/latents/00001.safetensors"),
     "2: latents file ../../labels/latents/00001.safetensors leads out of the label file's folder"),
    ("not-an-image", BOTH, lambda f: (f / "images/00001-1.png").write_text("root:x:0:0:root:/root:/bin/bash\n"),
     "2: image images/00001-1.png is not an image PIL can read"),
    ("decompression-bomb", BOTH, lambda f: (f / "images/00001-1.png").write_bytes(_bomb_png(10_000, 10_000)),
     "2: image images/00001-1.png has more pixels than PIL's bound against decompression bombs (89478485)"),
    ("image-of-another-size", D3PO, lambda f: _image_file(f / "images/00001-0.png", 32),
     "2: image images/00001-0.png is 32x32 pixels but line 1's are 16x16"),
    ("latents-metadata-not-a-number", D3PO, lambda f: _edit_metadata(f, num_steps="two"),
     "2: latents file {folder}/latents/00001.safetensors has num_steps='two' in its metadata, not an integer"),
    ("latents-seeds-not-json", D3PO, lambda f: _edit_metadata(f, sample_seeds="[1, 2"),
     "2: latents file {folder}/latents/00001.safetensors has sample_seeds='[1, 2' in its metadata, not a JSON list"),
    # the chains must fit the recipe's pipeline (its UNet config and scheduler config), which D3PO replays them through
    ("latents-of-another-size", D3PO, lambda f: _edit_tensors(f, latents=torch.zeros(2, 3, 4, 16, 16)),
     "2: latents in {folder}/latents/00001.safetensors are [4, 16, 16] per step, but the UNet of model.pipeline "),
    ("latents-of-other-channels", D3PO, lambda f: _edit_tensors(f, latents=torch.zeros(2, 3, 3, 8, 8)),
     "2: latents in {folder}/latents/00001.safetensors are [3, 8, 8] per step, but the UNet of model.pipeline "),
    ("timesteps-of-another-scheduler", D3PO, lambda f: _edit_tensors(f, timesteps=torch.tensor([999, 499])),
     "2: the pair was sampled at timesteps [999, 499], but the scheduler of model.pipeline "),
    ("another-negative-prompt", D3PO, lambda f: _edit_metadata(f, negative_prompt="blurry"),
     "2: the pair was sampled with negative_prompt 'blurry' but the recipe has sample.negative_prompt ''"),
    ("only-ties-and-unlabelled", BOTH, lambda f: (_edit_line(f, 0, choice="tie"), _edit_line(f, 1, choice=None)),
     " no labelled pair (choice 0 or 1) to train on; 1 ties, 1 unlabelled"),
    ("prompt-of-megabytes", BOTH, lambda f: _edit_line(f, 1, prompt="a red circle " * 250_000),
     "2: prompt is 3250000 characters, more than the bound of 10000"),
]


@pytest.mark.parametrize("verb", ["validate", "run"])
@pytest.mark.parametrize("trainer, damage, expected",
                         [(t, c[2], c[3]) for c in LABEL_CASES for t in c[1]],
                         ids=[f"{t}-{c[0]}" for c in LABEL_CASES for t in c[1]])
def test_bad_label_file_is_one_line_before_any_run_dir(materials, tmp_path, capsys, verb, trainer, damage, expected):
    folder = tmp_path / "work" / "labels"
    shutil.copytree(materials / "labels", folder)
    damage(folder)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((materials / f"{trainer}.yaml").read_text().replace("LABELS", str(folder / "pairs.jsonl")))
    one_line_error(capsys, [verb, str(recipe), f"run.output_dir={tmp_path / 'runs'}"],
                   f"{folder / 'pairs.jsonl'}:" + expected.format(folder=folder), materials, tmp_path)
    assert not (tmp_path / "runs").exists()


def test_the_good_label_file_validates_for_both_trainers(materials, tmp_path, capsys):
    """The tables above start from this file: it passes, so each refusal is its damage's."""
    for trainer in ("d3po", "dpo"):
        recipe = tmp_path / f"{trainer}.yaml"
        recipe.write_text((materials / f"{trainer}.yaml").read_text().replace("LABELS", str(materials / "labels" /
                                                                                             "pairs.jsonl")))
        assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_d3po_labels_naming_the_label_folder_point_at_its_file(materials, tmp_path, capsys):
    """train.labels given the folder `diffrl pairs sample --out` wrote, not its pairs.jsonl: one line naming the file
    in it (it said the folder "does not exist")."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((materials / "d3po.yaml").read_text().replace("LABELS", str(materials / "labels")))
    one_line_error(capsys, ["validate", str(recipe)], f"label file {materials / 'labels'} is a folder; give the label "
                   f"file in it; it has {materials / 'labels' / 'pairs.jsonl'}", materials, tmp_path)


def test_label_file_on_a_flow_pipeline_is_one_line_before_any_run_dir(materials, tmp_path, capsys):
    """D3PO replays labelled chains through a UNet: a flow pipeline (no UNet) is refused by validate, not an
    AttributeError once the run dir exists."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((materials / "d3po.yaml").read_text().replace("LABELS", str(materials / "labels" /
                                                                                 "pairs.jsonl")))
    for verb in ("validate", "run"):
        one_line_error(capsys, [verb, str(recipe), f"run.output_dir={tmp_path / 'runs'}",
                                "model.pipeline=tiny-shapes-flow"],
                       "train.labels: D3PO from labels replays the pairs' chains through a UNet; model.pipeline "
                       "tiny-shapes-flow is a flow-matching pipeline", materials)
    assert not (tmp_path / "runs").exists()


def test_long_prompt_is_refused_before_sampling_and_cut_in_the_message(materials, tmp_path, capsys):
    prompt = "red " * 2500
    err = one_line_error(capsys, ["sample", "--pipeline", "tiny-shapes", "--prompt", prompt, "--steps", "50",
                                  "--reward", "shapes_verifier", "--out", str(tmp_path / "o")],
                         "shapes_verifier cannot read the prompt", materials, tmp_path)
    assert len(err) < 500 and "(10000 characters)" in err
    assert not any((tmp_path / "o").iterdir())  # refused before the first image


def test_demo_on_a_port_in_use_is_one_line(materials, tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(capsys, ["demo", "--port", str(port)],
                       f"cannot serve the demo on --host 127.0.0.1 --port {port}: Address already in use", tmp_path)


@pytest.mark.parametrize("device, expected", [
    ("tpu", "unknown device 'tpu'"),
    pytest.param("cuda", "device 'cuda': this machine has no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_load_pipeline_on_a_device_this_machine_lacks(device, expected):
    """The Python API checks the device as the CLI's --device does: one `UserError`, before any weights load."""
    import diffrl
    from diffrl.errors import UserError

    with pytest.raises(UserError, match=f"^{expected}"):
        diffrl.load_pipeline("tiny-shapes", device=device)


def test_step_bound_comes_from_the_scheduler():
    """DDIM and LCM timesteps are integers below num_train_timesteps (LCM's among original_inference_steps); a
    flow-matching scheduler's σ is continuous, so any step count is allowed there."""
    from diffrl.checks import check_num_steps
    from diffrl.errors import UserError
    from diffrl.pipelines import read_scheduler_config

    check_num_steps("--steps", 5000, read_scheduler_config("tiny-shapes-flow"))
    check_num_steps("--steps", 1000, read_scheduler_config("tiny-shapes"))
    check_num_steps("--steps", 50, read_scheduler_config("tiny-shapes-lcm"))
    check_num_steps("--steps", 10**6, None)  # a hub model not downloaded yet: its first load checks
    with pytest.raises(UserError, match="more than the 1000 timesteps"):
        check_num_steps("--steps", 1001, read_scheduler_config("tiny-shapes"))


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_is_refused_before_decoding_without_pils_warning(materials, tmp_path, capsys):
    """10000 x 10000 pixels is between PIL's bound and twice it, where PIL only warns (two more stderr lines) and
    decodes gigabytes; `score` refuses it in one line naming the bound (the warning, as an error here, is not
    raised)."""
    one_line_error(capsys, ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out",
                            str(tmp_path / "s.json"), str(materials / "bomb.png")],
                   "is 10000x10000 = 100000000 pixels, more than the bound of 89478485", materials, tmp_path)


def test_debug_and_deepspeed_in_a_real_process(materials):
    """What a terminal sees from `python -m diffrl.cli`: `--debug` shows the traceback and still exits 2 (the
    one-line form is checked in-process above and in test_cli); DeepSpeed's accelerator line is not on stdout."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    base = [sys.executable, "-m", "diffrl.cli"]
    bad = ["validate", str(materials / "recipe.yaml"), "sample.guidance_scale=.nan", "--debug"]
    debug = subprocess.run([*base, *bad], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert debug.returncode == 2 and debug.stderr.startswith("Traceback")
    assert debug.stderr.endswith("UserError: sample.guidance_scale must be a finite number, got nan\n")
    # transformers imports DeepSpeed in some model loads; its first import logs the accelerator it picked to
    # stdout, which the CLI filters out: a fresh process that runs a verb, then imports DeepSpeed, prints nothing
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    env.pop("DS_ACCELERATOR", None)
    code = "from diffrl.cli import main; main(['ls', 'trainers']); import deepspeed.accelerator as a; a.get_accelerator()"
    ds = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                        check=False)
    assert ds.returncode == 0, ds.stderr
    assert "accelerator" not in ds.stdout + ds.stderr


# ---------------------------------------------------------------------------------------------------------------
# faults: full disk, damaged checkpoint, partial metrics line


def final_weights(run: Path) -> dict:
    return load_file(str(run / "checkpoints" / f"step-{NUM_EPOCHS}" / "trainable.safetensors"))


def assert_same_as_reference(materials, run: Path) -> None:
    reference, resumed = final_weights(materials / "runs" / "ref"), final_weights(run)
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    ref_metrics = [json.loads(line) for line in (materials / "runs" / "ref" / "metrics.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in metrics] == list(range(NUM_EPOCHS))  # each epoch once
    assert [r["reward_mean"] for r in metrics] == [r["reward_mean"] for r in ref_metrics]


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _enospc_writer(write, part: str):
    """`files.write_bytes` whose `open` fails with ENOSPC for paths containing `part` (the real error handling of
    write_bytes runs: its temporary file is removed and the OSError becomes a one-line UserError)."""
    import builtins

    def write_bytes(path, data):
        if part not in str(path):
            return write(path, data)
        real_open = builtins.open

        def full_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if "w" in mode:
                class Full:
                    def __enter__(self):
                        return self

                    def __exit__(self, *exc):
                        handle.close()
                        return False

                    def write(self, _):
                        raise _enospc()

                return Full()
            return handle

        builtins.open = full_open
        try:
            return write(path, data)
        finally:
            builtins.open = real_open

    return write_bytes


def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resume_works(materials, tmp_path, capsys,
                                                                              monkeypatch):
    run = copy_run(materials, tmp_path, keep_epochs=NUM_EPOCHS - 1)  # killed during the last epoch
    previous = run / "checkpoints" / f"step-{NUM_EPOCHS - 1}"
    kept = snapshot(previous)
    monkeypatch.setattr(diffrl.files, "write_bytes", _enospc_writer(diffrl.files.write_bytes, f".tmp-step-{NUM_EPOCHS}"))
    capsys.readouterr()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint step-{NUM_EPOCHS} not saved: cannot write" in err and "No space left on device" in err
    assert f"the newest checkpoint, {previous}, is intact" in err
    assert snapshot(previous) == kept
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{s}" for s in range(1, NUM_EPOCHS)]
    monkeypatch.undo()  # space freed: resume redoes the last epoch and ends where the uninterrupted run did
    assert main(["resume", str(run)]) == 0
    assert_same_as_reference(materials, run)


def test_damaged_checkpoint_names_the_file_and_the_one_to_resume_from(materials, tmp_path, capsys):
    run = copy_run(materials, tmp_path)
    newest = run / "checkpoints" / f"step-{NUM_EPOCHS}"
    _truncate(newest / "trainable.safetensors")
    err = one_line_error(capsys, ["resume", str(run)], f"{newest / 'trainable.safetensors'} is not a readable "
                         "safetensors file", run)
    assert f"move {newest} out of checkpoints/ and `diffrl resume {run}` continues from step-{NUM_EPOCHS - 1}" in err
    # doing what it says: the run redoes its last epoch from the previous checkpoint and ends as the uninterrupted
    # one, with that epoch's record replaced, not repeated
    newest.rename(tmp_path / "damaged-step")
    assert main(["resume", str(run)]) == 0
    assert_same_as_reference(materials, run)


def test_partial_last_metrics_line_is_dropped_on_resume(materials, tmp_path, capsys):
    # killed while appending the record of the last epoch, before its checkpoint: half a line, no newline
    run = copy_run(materials, tmp_path, keep_epochs=NUM_EPOCHS - 1)
    last = (materials / "runs" / "ref" / "metrics.jsonl").read_text().splitlines()[-1]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(last[: len(last) // 2])
    assert main(["resume", str(run)]) == 0
    assert_same_as_reference(materials, run)


def test_a_damaged_metrics_line_in_the_middle_is_named(materials, tmp_path, capsys):
    run = copy_run(materials, tmp_path, keep_epochs=NUM_EPOCHS - 1)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("{not json\n" + "".join(lines[1:]))
    one_line_error(capsys, ["resume", str(run)], f"{run / 'metrics.jsonl'} line 1 is not valid JSON; fix or delete",
                   run)


def test_full_disk_during_sample_and_score_writes(materials, tmp_path, capsys, monkeypatch):
    """An injected ENOSPC on the second image of `sample` and on `score --out`: one line, no file left behind, and
    an existing scores.json left as it was."""
    calls = []
    write = diffrl.files.write_bytes

    def full_after_one(path, data):
        calls.append(path)
        return _enospc_writer(write, "")(path, data) if len(calls) > 1 else write(path, data)

    monkeypatch.setattr(diffrl.files, "write_bytes", full_after_one)
    out = tmp_path / "samples"
    one_line_error(capsys, ["sample", "--pipeline", str(materials / "pipe"), "--prompt", "a", "--prompt", "b",
                            "--steps", "1", "--out", str(out)], "No space left on device", materials)
    assert [p.name for p in out.iterdir()] == ["00000.png"]  # the image written before the disk filled, no 0-byte one
    existing = tmp_path / "scores.json"
    existing.write_text('[{"file": "earlier.png"}]\n')
    calls.append("fill")  # from now on every write fails
    one_line_error(capsys, ["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--out", str(existing),
                            str(materials / "image.png")], "No space left on device", tmp_path, materials)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/full (Linux, root); the test is skipped where mounting is not allowed."""
    mount = tmp_path / "full"
    mount.mkdir()
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot run mount here")
    if result.returncode != 0:
        pytest.skip("this machine does not let the tests mount a tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True, timeout=10, check=False)


def test_real_full_disk_for_sample_and_score(materials, small_tmpfs, capsys):
    (small_tmpfs / "filler").write_bytes(b"\0" * (60 * 1024))  # one page of 4 KiB left: one tiny PNG fits
    out = small_tmpfs / "samples"
    one_line_error(capsys, ["sample", "--pipeline", str(materials / "pipe"), "--prompt", "a red circle", "-n", "4",
                            "--steps", "1", "--out", str(out)], "No space left on device", materials)
    assert [p.name for p in out.iterdir()] == ["00000.png"]  # the one that fitted; no 0-byte or temporary file
    existing = small_tmpfs / "scores.json"
    (small_tmpfs / "filler").unlink()
    existing.write_text('[{"file": "earlier.png"}]\n')
    (small_tmpfs / "filler").write_bytes(b"\0" * (56 * 1024))
    before = existing.read_bytes()
    images = [str(materials / "image.png")] * 200  # a scores.json larger than the space left
    err = one_line_error(capsys, ["score", "--reward", "jpeg_compressibility", "--prompt", "x" * 200, "--out",
                                  str(existing), *images], "No space left on device", materials, small_tmpfs)
    assert str(existing) in err and existing.read_bytes() == before


def test_real_full_disk_inside_safetensors_writer(small_tmpfs):
    """diffusers' `save_lora_weights` / `save_pretrained` write through safetensors' own (Rust) writer, which reports
    a full disk as a `SafetensorError`, not an `OSError`: the checkpoint's `files.writing` turns it into one line."""
    from safetensors.torch import save_file

    from diffrl.errors import UserError

    expected = r"^cannot write .*lora: No space left on device$"
    with pytest.raises(UserError, match=expected), diffrl.files.writing(small_tmpfs / "lora"):
        save_file({"lora_B": torch.zeros(64 * 1024)}, str(small_tmpfs / "lora.safetensors"))
