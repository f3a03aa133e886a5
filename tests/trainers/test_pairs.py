"""Human labels end to end: `diffrl pairs sample` → edit the choices → `diffrl run` a D3PO labels recipe; and every
malformed label file stops `diffrl run` with one line naming the file and line, exit code 2, nothing written."""

import json

import numpy as np
import pytest
import torch
import yaml
from pg_helpers import tiny_pipeline_dir, tiny_recipe, with_trainer
from recipe_inputs import write_label_file

from diffrl.cli import main


def _recipe_file(tmp_path, labels, **train) -> str:
    """A D3PO recipe on the tiny pipeline (3 steps, guidance 3, η 1; 2 pairs per epoch, 2 epochs) training from
    `labels`, written to disk as a user would."""
    groups = with_trainer({"run": {"num_epochs": 2, "save_every": 1, "output_dir": str(tmp_path / "runs")},
                           "log": {"tracker": "none", "image_every": 1, "grid_images": 2}}, "d3po")
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path / "runs", **groups)
    recipe["train"].update({"preference": "labels", "labels": str(labels), **train})
    path = tmp_path / "labels.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_pairs_sample_then_label_then_train(tmp_path, capsys):
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from diffrl.config import load_recipe
    from diffrl.pairs.labels import load_pairs_trajectory, read_label_file
    from diffrl.training.metrics import read_metrics
    from samplers import get_sampler

    out = tmp_path / "labels"
    recipe = _recipe_file(tmp_path, out / "pairs.jsonl")
    # the recipe cannot run before its label file exists...
    assert main(["run", recipe]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    # ...which `pairs sample` draws with the recipe's model and sampling settings
    assert main(["pairs", "sample", recipe, "--out", str(out), "-n", "4", "--seed", "1"]) == 0
    lines = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["choice"] is None for line in lines)

    # the saved chains are what was sampled: both start from the pair's x_T (a standard normal drawn on the CPU from
    # the pair's seed), and every step's log-prob recomputed by plain diffrl from them equals the saved one
    pairs = read_label_file(out / "pairs.jsonl", need_latents=True)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir(tmp_path))
    sampler = get_sampler("ddim", pipe)
    traj = load_pairs_trajectory(pairs, pipe, sampler, load_recipe(recipe, ["train.preference=reward",
                                                                            "train.labels="]).sample)
    for i, line in enumerate(lines):
        x_T = torch.randn((4, 8, 8), generator=torch.Generator("cpu").manual_seed(line["seed"]))
        assert torch.equal(traj.latents[2 * i, 0], x_T) and torch.equal(traj.latents[2 * i + 1, 0], x_T)
    with torch.no_grad():
        for j in range(3):
            assert torch.allclose(sampler.log_prob(pipe, traj, j), traj.log_probs[:, j], atol=1e-5, rtol=0)

    # a person labels them: the brighter image preferred in the first two, a tie, one left unlabelled
    for line in lines[:2]:
        brightness = [np.asarray(Image.open(out / p), dtype=np.float64).mean() for p in line["images"]]
        line["choice"] = int(np.argmax(brightness))
    lines[2]["choice"] = "tie"
    (out / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    assert main(["run", recipe]) == 0
    records = [r for r in read_metrics(tmp_path / "runs" / "t") if not r.get("final")]
    assert [r["epoch"] for r in records] == [0, 1]
    # 2 pairs per epoch × 2 epochs = the 4 lines once: 2 decided, 2 skipped (the tie and the unlabelled one)
    assert sum(r["pairs_used"] for r in records) == 2 and sum(r["pairs_skipped"] for r in records) == 2
    assert all(np.isfinite(r["reward_mean"]) for r in records)
    assert (tmp_path / "runs" / "t" / "checkpoints").is_dir()


def test_pairs_sample_never_overwrites_a_label_file(tmp_path, capsys):
    labels = write_label_file(tmp_path / "labels", num_steps=3, guidance_scale=3.0, eta=1.0, choices=(0,))
    before = labels.read_text()
    recipe = _recipe_file(tmp_path, labels)
    assert main(["pairs", "sample", recipe, "--out", str(labels.parent), "-n", "1"]) == 2
    assert "already exists" in capsys.readouterr().err and labels.read_text() == before


def _break(labels, how):
    lines = labels.read_text().splitlines()
    second = json.loads(lines[1])
    if how == "json":
        lines[1] = lines[1][:-5]
    elif how == "image":
        (labels.parent / second["images"][1]).unlink()
    elif how == "choice":
        second["choice"] = 2
    elif how == "key":
        second["choise"] = second.pop("choice")
    elif how == "latents":
        del second["latents"]
    elif how == "images":
        second["images"] = second["images"][:1]
    if how in ("choice", "key", "latents", "images"):
        lines[1] = json.dumps(second)
    labels.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("how, expected", [
    ("json", "not valid JSON"),
    ("image", "image images/00001-1.png does not exist"),
    ("choice", 'choice must be 0, 1, "tie" or null, got 2'),
    ("key", "unknown key 'choise'; did you mean 'choice'?"),
    ("latents", "no 'latents' file"),
    ("images", "images must be a list of two paths"),
])
def test_a_malformed_label_file_is_one_line_naming_file_and_line_exit_2_nothing_written(tmp_path, capsys, how,
                                                                                        expected):
    labels = write_label_file(tmp_path / "labels", num_steps=3, guidance_scale=3.0, eta=1.0, choices=(0, 1, "tie"))
    _break(labels, how)
    recipe = _recipe_file(tmp_path, labels)
    capsys.readouterr()  # (building the tiny pipeline logs)
    for verb in ("validate", "run"):
        assert main([verb, recipe]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{labels}:2: " in err and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_pairs_drawn_with_other_settings_are_refused(tmp_path, capsys):
    labels = write_label_file(tmp_path / "labels", num_steps=4, guidance_scale=3.0, eta=1.0, choices=(0,))
    recipe = _recipe_file(tmp_path, labels)
    capsys.readouterr()
    assert main(["run", recipe]) == 2
    err = capsys.readouterr().err
    assert f"{labels}:1: the pair was sampled with num_steps=4 but the recipe has sample.num_steps=3" in err
    assert not (tmp_path / "runs").exists()


def test_pairs_from_another_model_are_refused_before_any_run_dir(tmp_path, capsys):
    # the headers agree with the recipe, but the chains have 4×4 latents where the tiny pipeline makes 8×8: the
    # recipe's pipeline config says so, so `validate` and `run` refuse it before a run dir exists
    labels = write_label_file(tmp_path / "labels", num_steps=3, guidance_scale=3.0, eta=1.0, choices=(0, 1),
                              latent_shape=(4, 4, 4))
    recipe = _recipe_file(tmp_path, labels)
    capsys.readouterr()
    for verb in ("validate", "run"):
        assert main([verb, recipe]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{labels}:1: latents in {labels.parent / 'latents' / '00000.safetensors'} " \
            "are [4, 4, 4] per step, but the UNet of model.pipeline" in err and "denoises [4, 8, 8]" in err, err
    assert not (tmp_path / "runs").exists()
