"""`diffrl bench gradient`: the signal/noise estimator against hand computations and a synthetic case with known
signal and noise, then the bench end to end on the tiny pipeline."""

import argparse
import json
import math

import pytest
import torch
from pg_helpers import tiny_pipeline_dir

from diffrl.bench import gradient as bench


def test_signal_and_noise_by_hand():
    # g1 = (1, 0), g2 = (0, 1), g3 = (1, 1): pair products g1·g2 = 0, g1·g3 = 1, g2·g3 = 1 -> |s|² = 2/3;
    # mean |g|² = (1 + 1 + 2) / 3 = 4/3 -> v = chunk · (4/3 − 2/3) = 4 · 2/3.
    # Leave one out: [g2·g3, g1·g3, g1·g2] = [1, 1, 0] -> jackknife se = sqrt(2/3 · Σ(x − 2/3)²) = sqrt(2/3 · 2/3).
    out = bench.signal_and_noise(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), chunk=4)
    assert out["signal"] == pytest.approx(2 / 3) and out["noise"] == pytest.approx(8 / 3)
    assert out["signal_se"] == pytest.approx(2 / 3)
    assert out["samples_for_snr1"] is None  # 2/3 is not above two standard errors: not resolved
    assert out["samples_for_snr1_at_least"] == pytest.approx((8 / 3) / (2 / 3 + 4 / 3))  # v / (|s|² + 2 se)
    # identical chunk gradients: all signal, no noise
    same = bench.signal_and_noise(torch.ones(4, 3), chunk=8)
    assert same["signal"] == pytest.approx(3.0) and same["noise"] == pytest.approx(0.0, abs=1e-12)
    assert same["samples_for_snr1"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        bench.signal_and_noise(torch.ones(2, 3), chunk=8)


def test_signal_and_noise_recovers_a_known_signal_and_noise():
    # chunk gradients g_i = s + n_i with |s|² = 1 and one sample's noise v = 40 (so a chunk of 8 has 40/8 = 5)
    gen = torch.Generator().manual_seed(0)
    dims, m, chunk, v = 50_000, 16, 8, 40.0
    s = torch.randn(dims, generator=gen, dtype=torch.float64)
    s /= s.norm()
    noise = torch.randn(m, dims, generator=gen, dtype=torch.float64) * math.sqrt(v / chunk / dims)
    out = bench.signal_and_noise(s + noise, chunk=chunk)
    assert out["signal"] == pytest.approx(1.0, abs=0.05)
    assert out["noise"] == pytest.approx(v, rel=0.05)
    assert out["samples_for_snr1"] == pytest.approx(40.0, rel=0.1)
    # with n = v / |s|² samples the signal and the noise are equal: cosine 1/√2
    assert bench.expected_cosine(1.0, 40.0, 40) == pytest.approx(1 / math.sqrt(2))
    assert bench.expected_cosine(1.0, 3.0, 1) == pytest.approx(0.5)
    assert bench.expected_cosine(-1.0, 3.0, 1) == 0.0


SMALL = ["--set", "sample.num_steps=3", "--set", "sample.batch_size=4", "--set", "advantage.group_size=2",
         "--set", "advantage.mode=group", "--set", "prompts.source=[a red circle, a blue square]"]


def _run(tmp_path, argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "g.json"
    args = parser.parse_args(["--pipeline", str(tiny_pipeline_dir(tmp_path)), "--samples", "12", "--chunk", "4",
                              "--out", str(out), *SMALL, *argv])
    assert bench.run_gradient_bench(args) == 0
    return json.loads(out.read_text())


def test_gradient_bench_end_to_end_with_a_window_lever(tmp_path):
    rows = _run(tmp_path, ["--set", "reward.name=pg_helpers:brightness", "--sweep", "train.sde_window=1"])
    base, window = rows
    assert base["trained_steps"] == [0, 1, 2] and window["trained_steps"] == [0]  # the window starts at step 0
    assert base["samples"] == 12 and base["samples_per_optimizer_step"] == 4 * 2  # the recipe's 4 × 2 accumulation
    assert set(base["steps"]) == {"0", "1", "2"}
    for row in rows:
        assert row["all"]["noise"] > 0 and 0 <= row["cosine_per_optimizer_step"] <= 1


def test_a_constant_reward_has_no_gradient_at_all(tmp_path):
    # every advantage is 0 (a group's rewards are all equal): no signal, no noise, nothing resolved
    rows = _run(tmp_path, ["--set", "reward.name=pg_helpers:constant"])
    row = rows[0]
    assert row["zero_advantage"] == 1.0
    assert row["all"]["signal"] == 0.0 and row["all"]["noise"] == 0.0 and row["all"]["samples_for_snr1"] is None
    assert row["all"]["samples_for_snr1_at_least"] == 0.0


def test_projection_by_hand():
    from diffrl.bench.gradient import projection

    # projections on (1, 0) of three chunk gradients: 1, 3, 2 -> mean 2, sample std 1, se 1/sqrt(3), t = 2 sqrt(3)
    out = projection(torch.tensor([[1.0, 5.0], [3.0, -2.0], [2.0, 0.5]]), torch.tensor([4.0, 0.0]))
    assert out["mean"] == pytest.approx(2.0) and out["se"] == pytest.approx(1 / 3**0.5)
    assert out["t"] == pytest.approx(2 * 3**0.5)


@pytest.mark.parametrize("last", [0, 1])
def test_pathwise_estimator_runs_beside_the_policy_gradient(tmp_path, last):
    rows = _run(tmp_path, ["--set", "reward.name=pg_helpers:smooth_brightness", "--pathwise", "--pathwise-last", str(last)])
    pw = rows[0]["pathwise"]
    assert pw["last"] == last and pw["noise"] > 0 and pw["seconds_per_sample"] > 0
    assert set(pw["projection"]) == {"mean", "se", "t"} and pw["projection"]["se"] > 0


def test_pathwise_needs_a_differentiable_reward(tmp_path):
    from diffrl.errors import UserError

    with pytest.raises(UserError, match="--pathwise needs a differentiable reward"):
        _run(tmp_path, ["--set", "reward.name=pg_helpers:brightness", "--pathwise"])


def test_flow_grpo_measures_the_steps_it_trains(tmp_path):
    """Flow-GRPO trains the first int(T · 0.99) steps (`timestep_selection: first`): of 3, steps 0 and 1 only."""
    from pg_helpers import tiny_flow_pipeline_dir

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "g.json"
    args = parser.parse_args(["--recipe", "flow_grpo/tiny_shapes_flow_verifier", "--pipeline",
                              str(tiny_flow_pipeline_dir(tmp_path)), "--samples", "12", "--chunk", "4", "--out",
                              str(out), *SMALL, "--set", "reward.name=pg_helpers:brightness"])
    assert bench.run_gradient_bench(args) == 0
    row = json.loads(out.read_text())[0]
    assert row["trained_steps"] == [0, 1] and row["all"]["noise"] > 0
