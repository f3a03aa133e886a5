"""The `diffrl bench train|learn` benchmarks run end to end (tiny pipeline, cheap reward). Not timed: the numbers
they print are benchmark results, not test assertions."""

import argparse
import json

from pg_helpers import tiny_pipeline_dir

SMALL = ["--set", "sample.num_steps=2", "--set", "sample.eval_num_steps=2", "--set", "sample.batch_size=4",
         "--set", "sample.num_batches_per_epoch=2", "--set", "reward.name=pg_helpers:brightness",
         "--set", "prompts.source=[a red circle, a blue square]", "--set", "log.image_every=0"]


def _args(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_train_reports_epoch_and_floor(tmp_path):
    from diffrl.bench import train as bench

    out = tmp_path / "train.json"
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--epochs", "2", "--repeats", "1",
                         "--out", str(out), *SMALL])
    assert bench.run_train_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["trainer"] == "ddpo" and result["epochs_timed"] == 1 and result["samples_per_epoch"] == 8
    for key in ("rollout_s", "reward_s", "train_s"):
        assert result["floor"][key] > 0 and result["epoch"][key] > 0
    assert result["ratio"] > 0 and result["peak_rss_mb"] > 0
    assert "epoch time / floor" in bench.format_result(result)


def test_bench_learn_reports_before_and_after(tmp_path):
    from diffrl.bench import learn as bench

    out = tmp_path / "learn.json"
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--budget", "8", "--eval-images", "2",
                         "--eval-prompts", "[a green dog]", "--out", str(out), *SMALL,
                         "--set-dpok", "reward.name=pg_helpers:brightness",
                         "--set-dpok", "train.policy_batch_size=2",
                         "--set-dpok", "train.gradient_accumulation_steps=1",
                         "--set-dpok", "train.policy_steps=1", "--set-dpok", "train.value_batch_size=4"])
    assert bench.run_learn_bench(args) == 0
    result = json.loads(out.read_text())
    assert [r["trainer"] for r in result["rows"]] == ["ddpo", "dpok"]
    for row in result["rows"]:
        assert row["samples"] == 8 and row["epochs"] == 1
        assert row["gain"] == row["after"] - row["before"]
    assert result["target"]["target_gain"] == 0.15
