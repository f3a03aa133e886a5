"""The `diffrl bench train|learn` benchmarks run end to end (tiny pipeline, cheap reward). Not timed: the numbers
they print are benchmark results, not test assertions."""

import argparse
import json

import pytest
import yaml
from pg_helpers import (
    StepLog,
    load_cfg,
    registered_trainers,
    tiny_flow_pipeline_dir,
    tiny_pipeline_dir,
    tiny_recipe,
    with_trainer,
)

from diffrl.errors import UserError

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
    # a recipe that evaluates by the clock (the first command's does, epoch 0 included): no evaluation is timed
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--epochs", "2", "--repeats", "1",
                         "--out", str(out), *SMALL, "--set", "run.eval_every_minutes=10"])
    assert bench.run_train_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["trainer"] == "ddpo" and result["epochs_timed"] == 1 and result["samples_per_epoch"] == 8
    assert result["evaluated_epochs"] == []
    for key in ("rollout_s", "reward_s", "train_s"):
        assert result["floor"][key] > 0 and result["epoch"][key] > 0
    assert result["ratio"] > 0 and result["peak_rss_mb"] > 0
    assert "epoch time / floor" in bench.format_result(result)


def test_bench_train_times_a_flow_grpo_recipe_with_a_progressive_sde_window(tmp_path):
    """Any trainer's recipe is timed (it times MixGRPO against Flow-GRPO): the floor counts the window's W of T
    steps, so with 1 of 3 steps trained the training floor is a third of the full recipe's (the same passes)."""
    from diffrl.bench import train as bench

    pipe = tiny_flow_pipeline_dir(tmp_path)
    flow = [*SMALL, "--set", "sample.num_steps=3", "--set", "sample.eta=0.7", "--set", "sample.guidance_scale=1.0",
            "--set", "train.batch_size=4", "--set", "train.timestep_fraction=1.0"]
    window = ["--set", "train.sde_window=1", "--set", "train.sde_window_schedule=progressive"]
    results = []
    for extra in ([], window):
        out = tmp_path / f"train{len(results)}.json"
        args = _args(bench, ["--recipe", "flow_grpo/tiny_shapes_flow_verifier", "--pipeline", str(pipe),
                             "--epochs", "2", "--repeats", "1", "--out", str(out), *flow, *extra])
        assert bench.run_train_bench(args) == 0
        results.append(json.loads(out.read_text()))
    for result in results:
        assert result["trainer"] == "flow_grpo" and result["samples_per_epoch"] == 8 and result["epochs_timed"] == 1
        # the timed epochs themselves (here one: the median is it)
        assert [e["epoch"] for e in result["epochs"]] == [1]
        assert result["epochs"][0]["wall_s"] == result["epoch"]["wall_s"]
        assert result["epoch"]["train_s"] > 0 and result["floor"]["train_s"] > 0
    # per epoch 2 micro-batches of 4: a forward + backward per trained (micro-batch, step) and as many KL reference
    # forwards (β 0.04), one AdamW step per micro-batch; 3 trained steps without the window, 1 with it
    for r, steps in zip(results, (3, 1)):
        f = r["floor"]
        assert f["train_s"] == pytest.approx(2 * steps * (f["fwd_bwd_call_s"] + f["reference_call_s"])
                                             + 2 * f["adam_call_s"], rel=1e-9)


@pytest.mark.parametrize("trainer", registered_trainers())
def test_bench_train_floor_times_between_the_trainers_steps_without_changing_its_training(tmp_path, trainer):
    """The floor is timed inside the run, on the trainer's networks: every optimizer step's weights must be exactly
    those of a run without it (gradients, weights, optimizer state, RNG and train/eval mode left as they were)."""
    import importlib

    from diffrl.bench.train import InterleavedFloor, epoch_floor

    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer(
        {"run": {"num_epochs": 2, "save_every": 0}, "log": {"tracker": "none", "image_every": 0}}, trainer))
    module = importlib.import_module(f"diffrl.trainers.{trainer}")
    plain = StepLog()
    module.train(load_cfg(recipe), tmp_path / "plain", step_callback=plain)
    cfg = load_cfg(recipe)
    floor, timed = InterleavedFloor(cfg, repeats=2), StepLog()

    def both(info):
        floor(info)
        timed(info)

    module.train(cfg, tmp_path / "timed", step_callback=both)
    assert len(plain.steps) > 2 and timed.steps == plain.steps
    assert sorted(floor.overhead) == [-1, 0, 1]  # built and warmed before training, timed once in each epoch
    counts = module.epoch_passes(load_cfg(recipe))
    expected = {"text", "unet", "decode", "reward"} | {k for k, n in counts.items() if n and not k.endswith("_batch")}
    assert set(floor.wall) == expected and all(len(v) == 4 for v in floor.wall.values())  # 2 epochs x 2 repeats
    result = floor.floor()
    assert result["calls_timed"] == 4
    parts = epoch_floor(cfg, {k: 1.0 for k in expected})  # every pass 1 s: the counts of each pass in an epoch
    s = cfg.sample
    assert parts["rollout_s"] == s.num_batches_per_epoch * (2 + s.num_steps)
    assert parts["reward_s"] == s.num_batches_per_epoch


def test_bench_learn_reports_before_after_and_kl_drift(tmp_path):
    from diffrl.bench import learn as bench

    out = tmp_path / "learn.json"
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--budget", "8", "--eval-images", "2",
                         "--kl-images", "2", "--eval-prompts", "[a green dog]", "--out", str(out), *SMALL,
                         "--trainers", "ddpo,dpok,draft-lv,raft",
                         "--set", "reward.gold=pg_helpers:redness", "--set", "reward.kwargs={}",
                         "--set-for", "dpok:train.batch_size=2",
                         "--set-for", "dpok:optim.gradient_accumulation_steps=1",
                         "--set-for", "dpok:train.policy_steps=1", "--set-for", "dpok:train.value_batch_size=4",
                         "--set-for", "draft-lv:reward.name=pg_helpers:smooth_brightness",
                         "--set-for", "raft:train.batch_size=2", "--set-for", "raft:sample.num_steps=2",
                         "--keep", str(tmp_path / "runs")])
    assert bench.run_learn_bench(args) == 0
    result = json.loads(out.read_text())
    assert [r["trainer"] for r in result["rows"]] == ["ddpo", "dpok", "draft-lv", "raft"]
    for row in result["rows"]:
        assert row["samples"] == 8 and row["epochs"] == 1
        assert row["gain"] == row["after"] - row["before"]
        assert row["kl_drift"] > 0  # the adapter moved away from the pre-trained model
        assert [p["epoch"] for p in row["curve"]] == [0, 1] and row["curve"][-1]["samples"] == 8
        # the score is the gold (redness), the proxy the trained-on reward; se = std / √2 images
        assert row["curve"][0]["score"] != row["curve"][0]["proxy"] and row["gain_se"] >= 0
        # the paired se from the first and last evaluations' per-image scores: with 2 images, |d_1 − d_2| / 2
        lines = (tmp_path / "runs" / f"learn-{row['trainer']}-baseline" / "eval_scores.jsonl").read_text().splitlines()
        evals = [json.loads(line)["scores"] for line in lines]
        d = [a - b for a, b in zip(evals[-1], evals[0])]
        assert sum(d) / 2 == pytest.approx(row["gain"], abs=1e-6)
        assert row["gain_paired_se"] == pytest.approx(abs(d[0] - d[1]) / 2, abs=1e-9)
        # the trained-on reward's gain gets its own paired se, from its per-image scores beside the gold's
        proxies = [json.loads(line)["proxy_scores"] for line in lines]
        p = [a - b for a, b in zip(proxies[-1], proxies[0])]
        assert sum(p) / 2 == pytest.approx(row["curve"][-1]["proxy"] - row["curve"][0]["proxy"], abs=1e-6)
        assert row["proxy_gain_paired_se"] == pytest.approx(abs(p[0] - p[1]) / 2, abs=1e-9)
        assert f"±{row['proxy_gain_paired_se']:.2g}" in bench.format_result(result)
    assert set(result["targets"]) == {"ddpo", "dpok", "draft-lv", "raft"}
    assert all(t["target_gain"] == 0.10 for t in result["targets"].values())
    # the row's variant reached its run: DRaFT-LV = the DRaFT recipe with k = 1 and n = 2
    config = yaml.safe_load((tmp_path / "runs" / "learn-draft-lv-baseline" / "config.yaml").read_text())
    assert (config["train"]["k"], config["train"]["lv_samples"]) == (1, 2)


def test_bench_learn_rows_cover_every_registered_trainer():
    from diffrl.bench.learn import ROWS
    from diffrl.config import load_recipe

    trainers = {load_recipe(recipe, overrides).trainer for recipe, overrides in ROWS.values()}
    assert trainers == set(registered_trainers())
    assert {"draft-1", "draft-lv", "alignprop"} <= set(ROWS)  # the DRaFT family's variants, each its own row
    # the JPEG rows: every trainer that takes a black-box reward, trained on and scored by compressibility (no gold),
    # Diffusion-DPO from pairs ranked by it
    jpeg = {row: load_recipe(*ROWS[row]) for row in ROWS if row.endswith("-jpeg")}
    assert {cfg.trainer for cfg in jpeg.values()} == set(registered_trainers()) - {"draft", "adjoint_matching"}
    for row, cfg in jpeg.items():
        assert (cfg.reward.name, cfg.reward.kwargs, cfg.reward.gold) == ("jpeg_compressibility", {}, ""), row
        assert load_recipe(*ROWS[row.removesuffix("-jpeg")]).sample == cfg.sample, row  # only the reward differs
    assert jpeg["diffusion_dpo-jpeg"].train.pairs == "shapes:train_jpeg"
    # Adjoint Matching's second row: the DRaFT rows' differentiable tiny PickScore instead of JPEG, the verifier gold
    am, am_pick = load_recipe(*ROWS["adjoint_matching"]), load_recipe(*ROWS["adjoint_matching-pickscore"])
    assert (am_pick.reward.name, am_pick.reward.kwargs, am_pick.reward.gold) == (
        "pickscore", {"model": "tiny-shapes-pickscore"}, "shapes_verifier")
    assert (am.reward.name, am.reward.gold) == ("clip_score", "shapes_verifier")
    assert am_pick.sample == am.sample and am_pick.train == am.train and am_pick.optim == am.optim
    assert jpeg["seppo-jpeg"].train.pairs == "shapes:train_jpeg"  # its winners: the set's preferred images
    # the flow trainers' PickScore rows: the dense tiny PickScore trained on, the verifier as gold, all else the same
    for row in ("flow_grpo", "diffusion_nft"):
        base, pick = load_recipe(*ROWS[row]), load_recipe(*ROWS[f"{row}-pickscore"])
        assert (pick.reward.name, pick.reward.kwargs, pick.reward.gold) == (
            "pickscore", {"model": "tiny-shapes-pickscore"}, "shapes_verifier"), row
        assert (base.reward.name, pick.sample, pick.train, pick.optim) == ("shapes_verifier", base.sample, base.train,
                                                                           base.optim), row


def test_bench_learn_minutes_gives_every_row_the_same_training_clock(tmp_path):
    # a clock any epoch exceeds: each run stops after its first epoch, is evaluated, and reports the samples drawn
    from diffrl.bench import learn as bench

    out = tmp_path / "minutes.json"
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--minutes", "1e-6", "--eval-every", "1",
                         "--eval-images", "2", "--kl-images", "0", "--eval-prompts", "[a green dog]",
                         "--trainers", "ddpo,draft-1", "--set-for", "draft-1:reward.name=pg_helpers:smooth_brightness",
                         "--set", "reward.gold=pg_helpers:redness", "--set", "reward.kwargs={}",
                         "--out", str(out), *SMALL])
    assert bench.run_learn_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["minutes"] == 1e-6
    for row in result["rows"]:
        assert row["epochs"] == 1 and row["samples"] == 8
        assert [p["epoch"] for p in row["curve"]] == [0, 1]  # before, and the final evaluation after epoch 0
    with pytest.raises(UserError, match="--minutes must be a positive number"):
        bench.learn_bench(_args(bench, ["--minutes", "0", *SMALL]), log=lambda line: None)


# ------------------------------------------------------------------------------------------------ compute to target


RECORDS = [  # epoch e's evaluation scores the policy after e epochs; wall_s of an epoch includes its evaluation
    {"epoch": 0, "samples_seen": 8, "wall_s": 10.0, "eval_s": 3.0, "eval_reward_mean": 0.2},
    {"epoch": 1, "samples_seen": 16, "wall_s": 6.0},
    {"epoch": 2, "samples_seen": 24, "wall_s": 12.0, "eval_s": 4.0, "eval_reward_mean": 0.35},
    {"epoch": 3, "samples_seen": 32, "wall_s": 5.0},
    {"epoch": 4, "samples_seen": 32, "final": True, "eval_reward_mean": 0.5},
]


def test_eval_curve_counts_the_compute_before_each_evaluated_policy():
    from diffrl.bench.learn import eval_curve, first_reaching

    curve = eval_curve(RECORDS)
    # epoch 0: nothing spent; epoch 2: 16 samples, (10 - 3) + 6 = 13 s; final: 32 samples, 13 + (12 - 4) + 5 = 26 s
    assert [{k: p[k] for k in ("epoch", "samples", "train_wall_s", "score")} for p in curve] == [
        {"epoch": 0, "samples": 0, "train_wall_s": 0.0, "score": 0.2},
        {"epoch": 2, "samples": 16, "train_wall_s": 13.0, "score": 0.35},
        {"epoch": 4, "samples": 32, "train_wall_s": 26.0, "score": 0.5}]
    # without a gold reward the score is the trained-on reward itself, so the proxy equals it; no counts: no s.e.
    assert all(p["proxy"] == p["score"] and p["score_se"] is None for p in curve)
    assert first_reaching(curve, 0.3)["epoch"] == 2
    assert first_reaching(curve, 0.2)["epoch"] == 0
    assert first_reaching(curve, 0.51) is None


def test_summary_target_defaults_to_the_pretrained_score_plus_a_gain():
    from diffrl.bench.learn import eval_curve, format_result, summarise

    def row(trainer, kl, lever="baseline", pipeline="p"):
        curve = eval_curve(RECORDS)
        return {"trainer": trainer, "lever": lever, "value": "", "samples": 32, "before": 0.2, "after": 0.5,
                "gain": 0.3, "kl_drift": kl, "train_wall_s": 26.0, "wall_s": 40.0, "curve": curve,
                "pipeline": pipeline, "same_as": None}

    args = argparse.Namespace(target_score=None, target_gain=0.1, budget=32, minutes=None, eval_images=4, eval_prompts="x",
                              kl_images=2)
    result = summarise([row("ddpo", 0.02), row("dpok", 0.01)], args, threads=1, memory={"peak_rss_mb": 1.0})
    assert result["target_score"] == pytest.approx(0.3)  # 0.2 + 0.1
    assert result["rows"][0]["to_target"] == {"samples": 16, "train_wall_s": 13.0, "epoch": 2}
    assert result["targets"]["ddpo"]["met"] and result["targets"]["dpok"]["met"]  # +0.3 in 26 s
    args.target_score = 0.9
    assert summarise([row("ddpo", 0.02)], args, threads=1, memory={"peak_rss_mb": 1.0})["rows"][0]["to_target"] is None
    assert "'-' = not reached" in format_result(result)
    # rows on different pipelines (a UNet trainer beside a flow one) name each pipeline once, in row order
    mixed = summarise([row("awm", 0.02, pipeline="tiny-shapes-flow"), row("prdp", 0.01, pipeline="tiny-shapes"),
                       row("awm-jpeg", 0.02, pipeline="tiny-shapes-flow")], args, threads=1,
                      memory={"peak_rss_mb": 1.0})
    assert "pipeline: tiny-shapes-flow, tiny-shapes; 1 threads" in format_result(mixed)


def test_bench_learn_sweeps_each_lever_once_per_value(tmp_path):
    from diffrl.bench import learn as bench

    out = tmp_path / "sweep.json"
    args = _args(bench, ["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--trainers", "ddpo", "--budget", "16",
                         "--eval-images", "2", "--kl-images", "0", "--eval-prompts", "[a green dog]",
                         "--target-score", "-1", "--sweep", "timestep_fraction=0.5,1.0", "--sweep", "group_size=1",
                         "--keep", str(tmp_path / "runs"), "--out", str(out), *SMALL])
    assert bench.run_learn_bench(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lever"], r["value"]) for r in rows] == [
        ("baseline", ""), ("timestep_fraction", "0.5"), ("timestep_fraction", "1.0"), ("group_size", "1")]
    # the recipe already trains every step: timestep_fraction=1.0 is the baseline, reported, not run again
    assert rows[2]["same_as"] == "learn-ddpo-baseline" and rows[2]["curve"] == rows[0]["curve"]
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("learn-"))
    assert runs == ["learn-ddpo-baseline", "learn-ddpo-group_size-1", "learn-ddpo-timestep_fraction-0.5"]
    config = yaml.safe_load((tmp_path / "runs" / "learn-ddpo-group_size-1" / "config.yaml").read_text())
    assert (config["advantage"]["group_size"], config["advantage"]["mode"]) == (1, "batch")
    assert config["sample"]["eval_num_steps"] == 2  # evaluation pinned to the baseline's
    for r in rows:  # 2 epochs of 8, evaluated every epoch (auto: 4 evaluations at most) and after the last
        assert [p["samples"] for p in r["curve"]] == [0, 8, 16]
        assert r["to_target"] == {"samples": 0, "train_wall_s": 0.0, "epoch": 0}  # any score >= -1
        assert r["kl_drift"] is None  # --kl-images 0
    # the same folder again would mix metrics: refused before any training
    with pytest.raises(UserError, match="already exists"):
        bench.learn_bench(args, log=lambda line: None)


@pytest.mark.parametrize("sweep, match", [("timestep_fraction", "expected LEVER=V1"),
                                          ("nonsense=1,2", "expected LEVER=V1"),
                                          ("timestep_fraction=0.5", "timestep_fraction")])
def test_bad_sweeps_fail_before_any_training(tmp_path, sweep, match):
    from diffrl.bench import learn as bench

    # DPOK has no train.timestep_fraction: an unknown key of its recipe, found while planning
    args = _args(bench, ["--trainers", "dpok", "--sweep", sweep, "--keep", str(tmp_path / "runs"), *SMALL])
    with pytest.raises(UserError, match=match):
        bench.learn_bench(args, log=lambda line: None)
    assert not (tmp_path / "runs").exists()


def test_the_first_command_bar_is_judged_at_the_first_evaluation_that_meets_it():
    # +0.10 over the row's own start within 600 s of training: met at 300 s even though the run ended at 601 s;
    # not met when the gain only arrives after 600 s
    from diffrl.bench.learn import summarise

    def row(trainer, curve):
        return {"trainer": trainer, "lever": "baseline", "value": "", "samples": 8, "before": curve[0]["score"],
                "after": curve[-1]["score"], "gain": curve[-1]["score"] - curve[0]["score"], "kl_drift": None,
                "train_wall_s": curve[-1]["train_wall_s"], "wall_s": 700.0, "curve": curve, "pipeline": "p",
                "same_as": None}

    def point(wall, score):
        return {"epoch": 0, "samples": 0, "train_wall_s": wall, "score": score}

    args = argparse.Namespace(target_score=None, target_gain=0.1, budget=None, minutes=10.0, eval_images=4,
                              eval_prompts="x", kl_images=0)
    early = row("early", [point(0.0, 0.5), point(300.0, 0.61), point(601.0, 0.62)])
    late = row("late", [point(0.0, 0.5), point(300.0, 0.55), point(601.0, 0.65)])
    targets = summarise([early, late], args, threads=1, memory={"peak_rss_mb": 1.0})["targets"]
    assert targets["early"]["met"] and targets["early"]["met_at_s"] == 300.0
    assert not targets["late"]["met"] and targets["late"]["met_at_s"] is None


def test_paired_gain_is_the_mean_and_standard_error_of_per_image_differences():
    from diffrl.training.evaluation import paired_gain

    # d = [0.5, 0, 0, 0.5]: mean 0.25; sample sd = sqrt(4 · 0.25² / 3) = 0.288675; se = sd / 2
    gain, se = paired_gain([0.0, 1.0, 0.5, 0.5], [0.5, 1.0, 0.5, 1.0])
    assert gain == pytest.approx(0.25) and se == pytest.approx(0.1443376, abs=1e-7)
    # identical shifts of every image: no spread, se 0 (while the unpaired se of these scores would be > 0.2)
    assert paired_gain([0.0, 1.0, 0.0], [0.1, 1.1, 0.1]) == (pytest.approx(0.1), pytest.approx(0.0, abs=1e-12))
    # a NaN score drops its pair
    gain, se = paired_gain([0.0, float("nan"), 0.0], [1.0, 0.0, 0.0])
    assert gain == pytest.approx(0.5) and se == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same images"):
        paired_gain([0.0], [0.0, 1.0])


def test_paired_se_reads_the_gold_or_the_proxy_scores_of_the_first_and_last_evaluations(tmp_path):
    from diffrl.bench.learn import paired_se

    lines = [{"epoch": 0, "final": False, "scores": [0.0, 1.0], "proxy_scores": [10.0, 12.0]},
             {"epoch": 3, "final": False, "scores": [9.0, 9.0], "proxy_scores": [0.0, 0.0]},
             {"epoch": 5, "final": True, "scores": [0.5, 1.0], "proxy_scores": [11.0, 12.2]}]
    (tmp_path / "eval_scores.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    # two images: se = sd/√2 = |d_1 − d_2|/2; gold d = [0.5, 0]: 0.25; proxy d = [1, 0.2]: 0.4 (the middle line unread)
    assert paired_se(tmp_path) == pytest.approx(0.25) and paired_se(tmp_path, "proxy_scores") == pytest.approx(0.4)
    # no gold: the lines carry no proxy scores, so no proxy se
    (tmp_path / "eval_scores.jsonl").write_text("".join(json.dumps({k: v for k, v in e.items() if k != "proxy_scores"})
                                                        + "\n" for e in lines))
    assert paired_se(tmp_path, "proxy_scores") is None and paired_se(tmp_path) == pytest.approx(0.25)


def test_image_order_undoes_the_rank_order_of_a_gather():
    import torch

    from diffrl.training.evaluation import image_order

    # 5 images on 2 processes: rank 0 draws images 0, 2, 4; rank 1 draws 1, 3 and pads with a repeat of 3
    gathered = torch.tensor([10.0, 12.0, 14.0, 11.0, 13.0, 13.0])
    assert image_order(gathered, 5, 2) == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert image_order(torch.tensor([1.0, 2.0]), 2, 1) == [1.0, 2.0]
