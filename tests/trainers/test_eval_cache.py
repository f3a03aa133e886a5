"""The base model's held-out evaluation is reused across runs only when it would be the same evaluation."""

import json

import pytest
import torch
from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.trainers import ddpo
from diffrl.training import eval_cache


def _recipe(tmp_path, name, **sample):
    groups = {
        "run": {"num_epochs": 1, "save_every": 0, "eval_every": 1, "name": name},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 1, "eval_num_images": 6, **sample},
        "log": {"tracker": "none", "image_every": 1, "grid_images": 4},
        "reward": {"name": "pg_helpers:brightness", "gold": "pg_helpers:redness"},
    }
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer(groups, "ddpo"))


def _run(tmp_path, name, **sample):
    recipe = _recipe(tmp_path, name, **sample)
    ddpo.train(load_cfg(recipe), tmp_path / name)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    scores = [json.loads(line) for line in (tmp_path / name / "eval_scores.jsonl").read_text().splitlines()]
    return rows[0], scores[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "evals"
    monkeypatch.setenv("DIFFRL_EVAL_CACHE", str(folder))
    return folder


def test_a_second_run_reads_the_base_evaluation_and_it_equals_a_fresh_one(tmp_path, cache, monkeypatch):
    calls = []
    real = eval_cache.store
    monkeypatch.setattr(eval_cache, "store", lambda *a: (calls.append(a[0]), real(*a)))
    first, first_scores = _run(tmp_path, "a")
    assert first["epoch"] == 0 and "eval_cached" not in first and len(calls) == 1
    assert len(list(cache.iterdir())) == 1
    second, second_scores = _run(tmp_path, "b")
    assert second["eval_cached"] is True and second["eval_s"] == 0.0
    for key in ("eval_reward_mean", "eval_gold_mean", "eval_gold_std", "eval_gold_n"):
        assert second[key] == first[key]
    assert second_scores == first_scores
    # the grid written from the kept images is the first run's, byte for byte
    assert (tmp_path / "b/images/eval-epoch-0.png").read_bytes() == (tmp_path / "a/images/eval-epoch-0.png").read_bytes()
    # and both equal an evaluation made with the cache off
    monkeypatch.setenv("DIFFRL_EVAL_CACHE", "off")
    fresh, fresh_scores = _run(tmp_path, "c")
    assert "eval_cached" not in fresh and fresh_scores["scores"] == first_scores["scores"]
    assert fresh["eval_gold_mean"] == first["eval_gold_mean"]


@pytest.mark.parametrize("change", ["eval_num_steps", "eval_batch_size", "a_weight", "adapter_not_at_zero"])
def test_anything_that_changes_the_evaluation_misses(tmp_path, cache, monkeypatch, change):
    _run(tmp_path, "a")
    if change == "eval_num_steps":
        second, _ = _run(tmp_path, "b", eval_num_steps=3)
    elif change == "eval_batch_size":
        second, _ = _run(tmp_path, "b", eval_batch_size=3)
    elif change == "a_weight":  # the same folder with one VAE weight changed (a fine-tuned copy under the same name)
        import safetensors.torch as st

        path = next((tmp_path / "tiny-sd" / "vae").glob("*.safetensors"))
        weights = st.load_file(str(path))
        name = next(iter(weights))
        weights[name] = weights[name] + 1e-3
        st.save_file(weights, str(path))
        second, _ = _run(tmp_path, "b")
    else:  # an adapter whose up-projection is not zero does not output the base model's images
        from diffrl.training import weights as w

        real = w.setup_trainable

        def nonzero_b(*args, **kwargs):
            params = real(*args, **kwargs)
            for p in params:
                p.data.fill_(1e-3)
            return params

        monkeypatch.setattr("diffrl.training.weights.setup_trainable", nonzero_b)
        second, _ = _run(tmp_path, "b")
    assert "eval_cached" not in second


def test_a_damaged_cache_entry_is_evaluated_again(tmp_path, cache):
    _, first_scores = _run(tmp_path, "a")
    (entry,) = cache.iterdir()
    (entry / "eval.json").write_text("{not json")
    second, second_scores = _run(tmp_path, "b")
    assert "eval_cached" not in second and second_scores["scores"] == first_scores["scores"]


def test_the_off_switch_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_EVAL_CACHE", "off")
    assert eval_cache.cache_dir() is None
    assert eval_cache.load("0" * 64) is None
    eval_cache.store("0" * 64, {}, torch.zeros(1, 3, 2, 2), ["x"])
    monkeypatch.setenv("DIFFRL_EVAL_CACHE", str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()
