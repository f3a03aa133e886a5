"""`diffrl export`: a real tiny run exported, loaded back in plain diffusers, its model card checked against the run's
own files, and bad input as one line with exit code 2 and nothing written.

The loading path of the checks uses only diffusers (`StableDiffusionPipeline.from_pretrained` + `load_lora_weights`),
as a person without diffrl would; diffrl only makes the run and the images it is compared with (`diffrl sample`).
"""

import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from huggingface_hub import ModelCard
from PIL import Image

from diffrl.cli import main

EMBEDDED = Path(__file__).resolve().parents[1] / "diffrl" / "shapes" / "assets" / "tiny-shapes"
PROMPT = "a red circle"
# DRaFT on tiny-shapes for 2 epochs of 2 samples: evaluations at epochs 0 and 1 and after the last (4 held-out images,
# JPEG compressibility as a gold reward that varies per image), a checkpoint per epoch, best/ kept
RUN_ARGS = ["run.num_epochs=2", "run.max_train_minutes=0", "run.eval_every=1", "run.eval_every_minutes=0",
            "run.save_every=1", "run.keep_best=true", "sample.num_steps=2", "sample.batch_size=2",
            "sample.eval_num_steps=2", "sample.eval_num_images=4", "reward.gold=jpeg_compressibility",
            "log.tracker=none", "log.grid_images=4", "log.image_every=1", "optim.learning_rate=0.05"]
CHECK_NO_DIFFRL = """
import sys
assert not [m for m in sys.modules if m.split(".")[0] in ("diffrl", "rewards", "samplers")]
print(image.size)
"""
SAMPLE_ARGS = ["--prompt", PROMPT, "-n", "2", "--steps", "3", "--guidance-scale", "5", "--eta", "0", "--seed", "0",
               "--batch-size", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    assert main(["run", "draft/tiny_shapes_pickscore", f"run.output_dir={root}", "run.name=r", *RUN_ARGS]) == 0
    return root / "r"


def plain_images(pipe) -> list[np.ndarray]:
    """`SAMPLE_ARGS`' images drawn by plain diffusers (one generator per image, seeds 0 and 1), as 8-bit pixels the
    way `diffrl sample` writes its PNGs."""
    pipe.set_progress_bar_config(disable=True)
    out = []
    for seed in (0, 1):
        image = pipe(PROMPT, num_inference_steps=3, guidance_scale=5.0, eta=0.0,
                     generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
        out.append((np.clip(image, 0, 1) * 255).round().astype(np.int16))
    return out


def sampled(folder: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(folder / f"{i:05d}.png"), dtype=np.int16) for i in range(2)]


def assert_same_pixels(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    # different CPU kernels (batched or not) can flip a pixel's 8-bit rounding: at most one level
    for x, y in zip(a, b):
        assert x.shape == y.shape and np.abs(x - y).max() <= 1 and (x == y).mean() > 0.99


def assert_one_line_error(capsys, argv: list[str], expected: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err


@pytest.mark.slow
def test_exported_lora_loads_in_plain_diffusers_and_draws_what_diffrl_sample_draws(run_dir, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    # the run's newest LoRA, byte for byte, beside a complete copy of the embedded base
    newest = run_dir / "checkpoints" / "step-2" / "pytorch_lora_weights.safetensors"
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == newest.read_bytes()
    assert (out / "base" / "model_index.json").is_file()
    # no path of this machine in a folder meant to be shared
    assert not [p for p in (out / "base").rglob("*.json") if "_name_or_path" in p.read_text()]

    assert main(["sample", "--lora", str(run_dir), *SAMPLE_ARGS, "--out", str(tmp_path / "run")]) == 0
    assert main(["sample", "--pipeline", "tiny-shapes", "--lora", str(out), *SAMPLE_ARGS,
                 "--out", str(tmp_path / "exported")]) == 0
    from_run, from_export = sampled(tmp_path / "run"), sampled(tmp_path / "exported")
    assert_same_pixels(from_export, from_run)

    pipe = StableDiffusionPipeline.from_pretrained(out / "base")  # the copied base: no diffrl needed
    base = plain_images(pipe)
    pipe.load_lora_weights(out)
    assert_same_pixels(plain_images(pipe), from_run)
    # the same with the embedded folder itself as the base
    pipe = StableDiffusionPipeline.from_pretrained(EMBEDDED)
    pipe.load_lora_weights(out)
    assert_same_pixels(plain_images(pipe), from_run)
    # and the LoRA changes the images (else the comparisons above could not fail)
    assert max(np.abs(a - b).max() for a, b in zip(base, from_run)) > 8

    # the card's loading code runs as written, given this folder's path, in a Python that never imports diffrl
    code = re.search(r"```python\n(.*?)```", (out / "README.md").read_text(), re.DOTALL).group(1)
    script = tmp_path / "card.py"
    script.write_text(code.replace("path/to/this/folder", str(out)) + CHECK_NO_DIFFRL)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "(32, 32)", done.stderr


def test_card_states_the_run_and_its_held_out_numbers(run_dir, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    card = ModelCard.load(out / "README.md")
    assert {"diffrl", "diffusers", "lora", "draft", "text-to-image"} <= set(card.data.tags)
    assert card.data.license == "apache-2.0"  # the diffrl distribution's, which ships tiny-shapes
    assert card.data.library_name == "diffusers"
    text = card.text
    for phrase in ("**draft** trainer", "`tiny-shapes`", "`pickscore` (model=tiny-shapes-pickscore)",
                   "`jpeg_compressibility` as the held-out gold reward", "rank 8, alpha 8",
                   "(images/reward_curve.png)", "(images/before-after.png)", "[`recipe.yaml`](recipe.yaml)",
                   "lv_samples: 2"):
        assert phrase in text, phrase
    assert (out / "images" / "reward_curve.png").read_bytes() == (run_dir / "reward_curve.png").read_bytes()
    assert (out / "images" / "before-after.png").read_bytes() == (run_dir / "images" / "before-after.png").read_bytes()

    # the numbers, recomputed from the run's files with plain arithmetic
    state = json.loads((run_dir / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    steps = f"{state['global_step']} optimizer step" + ("s" if state["global_step"] != 1 else "")
    assert f"after {steps} and **{state['samples_seen']} samples seen**" in text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval_reward_mean") is not None]
    start, final = evals[0], evals[-1]
    best_epoch = json.loads((run_dir / "best" / "best.json").read_text())["epoch"]
    best = next(r for r in evals if r["epoch"] == best_epoch)
    assert final["final"] and start["epoch"] == 0

    def cell(record, prefix):
        se = record[f"{prefix}_std"] / math.sqrt(record[f"{prefix}_n"])
        return f"{record[f'{prefix}_mean']:.4g} ± {se:.2g}"

    seen_before = {r["epoch"]: 0 for r in evals}
    for previous, record in itertools.pairwise(records):
        seen_before[record["epoch"]] = previous["samples_seen"]  # an epoch's evaluation runs before its training
    for name, record in (("start", start), ("best", best), ("final (exported)", final)):
        samples = record["samples_seen"] if record.get("final") else seen_before[record["epoch"]]
        row = (f"| {name} | {record['epoch']} | {samples} | {cell(record, 'eval_gold')} | "
               f"{cell(record, 'eval_reward')} |")
        assert row in text, row
    per_image = {(e["epoch"], e["final"]): e["scores"]
                 for e in map(json.loads, (run_dir / "eval_scores.jsonl").read_text().splitlines())}
    before = per_image[(0, False)]
    for name, record in (("best", best), ("final", final)):
        if record is start:
            continue
        after = per_image[(record["epoch"], bool(record.get("final")))]
        d = [b - a for a, b in zip(before, after)]
        gain, se = sum(d) / len(d), statistics.stdev(d) / math.sqrt(len(d))
        assert f"- start → {name}: {gain:+.4g} ± {se:.2g} ({len(d)} images)" in text, name

    # the recipe trains again as it is
    assert main(["validate", str(out / "recipe.yaml")]) == 0


def test_best_exports_the_best_weights(run_dir, tmp_path):
    out = tmp_path / "best"
    assert main(["export", str(run_dir), "--best", "--out", str(out)]) == 0
    best = run_dir / "best" / "pytorch_lora_weights.safetensors"
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == best.read_bytes()
    record = json.loads((run_dir / "best" / "best.json").read_text())
    text = ModelCard.load(out / "README.md").text
    steps = f"{record['global_step']} optimizer step" + ("s" if record["global_step"] != 1 else "")
    assert f"`best` of the run, after {steps} and **{record['samples_seen']} " in text
    assert "| best (exported) |" in text


def test_full_finetune_exports_a_complete_pipeline(tmp_path, capsys):
    args = ["run.num_epochs=1", "run.eval_every=0", "model.full_finetune=true", "reward.name=jpeg_compressibility",
            "sample.num_steps=2", "sample.batch_size=2", "sample.num_batches_per_epoch=1", "train.batch_size=2",
            "advantage.mode=batch", "advantage.group_size=1", "optim.learning_rate=1e-3", "log.tracker=none",
            "log.image_every=0"]
    assert main(["run", "ddpo/tiny_shapes_verifier", f"run.output_dir={tmp_path}", "run.name=full", *args]) == 0
    run_dir, out = tmp_path / "full", tmp_path / "export"
    assert_one_line_error(capsys, ["export", str(run_dir), "--with-base", "--out", str(out)], "already a complete")
    assert not out.exists()
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert not (out / "base").exists()
    text = ModelCard.load(out / "README.md").text
    assert "fully fine-tuned unet" in text and "made no held-out evaluation" in text

    assert main(["sample", "--lora", str(run_dir), *SAMPLE_ARGS, "--out", str(tmp_path / "run")]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(out)  # the export is the whole pipeline
    assert_same_pixels(plain_images(pipe), sampled(tmp_path / "run"))
    base = plain_images(StableDiffusionPipeline.from_pretrained(EMBEDDED))
    assert max(np.abs(a - b).max() for a, b in zip(base, sampled(tmp_path / "run"))) > 8


def _no_leftovers(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("case", ["missing", "not-a-run", "no-weights", "no-best", "out-not-empty", "out-a-file",
                                  "bad-repo"])
def test_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path, capsys, case):
    out = tmp_path / "out"
    source, extra = str(run_dir), []
    if case == "missing":
        source, expected = str(tmp_path / "nope"), "does not exist"
    elif case == "not-a-run":
        (tmp_path / "plain").mkdir()
        source, expected = str(tmp_path / "plain"), "is not a run dir"
    elif case in ("no-weights", "no-best"):
        fresh = tmp_path / "fresh"
        (fresh / "checkpoints" / "step-2").mkdir(parents=True)
        (fresh / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
        if case == "no-best":
            step = fresh / "checkpoints" / "step-2"
            for name in ("pytorch_lora_weights.safetensors", "trainer_state.json"):
                (step / name).write_bytes((run_dir / "checkpoints" / "step-2" / name).read_bytes())
            extra, expected = ["--best"], "has no best/"
        else:
            (fresh / "checkpoints" / "step-2").rmdir()
            expected = "no trained weights yet"
        source = str(fresh)
    elif case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = "already holds files"
    elif case == "out-a-file":
        out.write_text("mine")
        expected = "is a file"
    else:
        extra, expected = ["--push-to-hub", "not a/valid//repo"], "is not a hub repo id"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert_one_line_error(capsys, ["export", source, "--out", str(out), *extra], expected)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, nothing changed
    _no_leftovers(tmp_path)


def test_push_to_hub_offline_keeps_the_folder(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "export"
    capsys.readouterr()
    assert main(["export", str(run_dir), "--out", str(out), "--push-to-hub", "someone/tiny-draft"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "HF_HUB_OFFLINE" in captured.err and str(out) in captured.err
    assert f"wrote {out}" in captured.out
    assert (out / "README.md").is_file() and (out / "pytorch_lora_weights.safetensors").is_file()
    # the card's loading code names the repo the folder is meant for
    assert 'snapshot_download("someone/tiny-draft")' in (out / "README.md").read_text()
    _no_leftovers(tmp_path)


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(run_dir, tmp_path, monkeypatch):
    import diffrl.export

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs["repo_id"], kwargs))

    monkeypatch.setattr(diffrl.export, "hub_offline", lambda: False)
    monkeypatch.setattr(diffrl.export, "hub_reachable", lambda: True)
    monkeypatch.setattr(diffrl.export, "HfApi", FakeApi)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out), "--push-to-hub", "someone/tiny-draft"]) == 0
    assert [(name, repo) for name, repo, _ in calls] == [("create_repo", "someone/tiny-draft"),
                                                         ("upload_folder", "someone/tiny-draft")]
    assert calls[0][2]["exist_ok"] is True and calls[1][2]["folder_path"] == str(out)
