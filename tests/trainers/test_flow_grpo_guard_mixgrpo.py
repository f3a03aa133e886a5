"""GRPO-Guard (`train.ratio_normalization`) and MixGRPO (`train.sde_window_schedule: progressive`) as settings of
Flow-GRPO: the guarded log-ratio by hand and against numbers from the public reference (Flow-Factory), its
centring on a toy whose biased ratio is known in closed form, the sliding window's schedule by hand, the checks, and
one epoch of each tiny recipe."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrl.config import load_recipe
from diffrl.errors import UserError
from diffrl.trainers.flow_grpo import flow_grpo_loss, guard_log_ratio
from diffrl.training.sde_window import progressive_window_start, sde_window_etas
from samplers.flow import flow_step, sde_constants

DATA = Path(__file__).parent / "data"


def _gaussian_log_prob(x, mean, std):
    """Mean over latent dims of log N(x; mean, std²), written out here (not the sampler's)."""
    d = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return d.flatten(1).mean(dim=1)


def test_guard_log_ratio_by_hand():
    # D = 2, old mean (0, 0), new mean d = (0.2, -0.1), x = (0.3, 0.1), s = 0.5:
    # raw log ρ = mean((x - μ_old)² - (x - μ)²)/(2s²) = ((0.09 - 0.01) + (0.01 - 0.04))/2 / 0.5 = 0.05
    # m = mean(d²) = 0.025; center: 0.05 + 0.025/(2·0.25) = 0.1 (= mean(d·x)/s² = 0.025/0.25)
    # guard: 0.05·0.5 + 0.025/(2·0.5) = 0.05 (= mean(d·x)/s = 0.025/0.5)
    x, old_mean, mean = torch.tensor([[0.3, 0.1]]), torch.zeros(1, 2), torch.tensor([[0.2, -0.1]])
    lp, old_lp = _gaussian_log_prob(x, mean, 0.5), _gaussian_log_prob(x, old_mean, 0.5)
    assert (lp - old_lp).item() == pytest.approx(0.05, abs=1e-6)
    assert guard_log_ratio(lp, old_lp, mean, old_mean, 0.5, "center").item() == pytest.approx(0.1, abs=1e-6)
    assert guard_log_ratio(lp, old_lp, mean, old_mean, 0.5, "guard").item() == pytest.approx(0.05, abs=1e-6)
    # the same step with no policy change: every ratio is exactly 1
    assert guard_log_ratio(old_lp, old_lp, old_mean, old_mean, 0.5).item() == 0.0
    # the loss takes the guarded ratio: A = 2, ε = 0.01, ρ̃ = e^0.05 > 1 + ε, so the clipped term -A(1 + ε) wins
    loss, stats = flow_grpo_loss(lp, old_lp, torch.tensor([2.0]), 0.01,
                                 log_ratio=guard_log_ratio(lp, old_lp, mean, old_mean, 0.5))
    assert loss.item() == pytest.approx(-2 * 1.01, abs=1e-6) and stats["ratio"].item() == pytest.approx(math.exp(0.05))
    with pytest.raises(ValueError, match="normalization"):
        guard_log_ratio(lp, old_lp, mean, old_mean, 0.5, "none")


def test_guard_matches_the_reference_numbers():
    """diffrl's SDE step (samplers.flow) and `guard_log_ratio` on the inputs of the reference's golden numbers:
    Flow-Factory's scheduler step and GRPOGuardTrainer expression (source in the data file)."""
    ref = json.loads((DATA / "grpo_guard_reference.json").read_text())
    assert "Flow-Factory@a0b2bc5" in ref["source"]
    for case in ref["cases"]:
        shape = case["shape"]
        x, v_old, v_new, x_next = (torch.tensor(case[k]).reshape(shape) for k in ("x", "v_old", "v_new", "x_next"))
        c = sde_constants(case["sigma"], case["sigma_next"], case["eta"])
        old = flow_step(v_old, x, c, prev_sample=x_next)
        new = flow_step(v_new, x, c, prev_sample=x_next)
        assert c.std == pytest.approx(case["std"], rel=1e-6)
        assert old.log_prob.item() == pytest.approx(case["old_log_prob"], abs=1e-5)
        assert new.log_prob.item() == pytest.approx(case["log_prob"], abs=1e-5)
        log_ratio = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
        assert log_ratio.item() == pytest.approx(case["guard_log_ratio"], abs=2e-6)
        assert (new.log_prob - old.log_prob).item() == pytest.approx(case["raw_log_ratio"], abs=2e-6)
        loss, _ = flow_grpo_loss(new.log_prob, old.log_prob, torch.tensor([case["advantage"]]), case["clip_range"],
                                 log_ratio=log_ratio)
        assert loss.item() == pytest.approx(case["policy_loss"], abs=1e-5)
    # the reference's low-noise steps: the raw log-ratio is shifted down (−0.15 at σ = 0.2), the guarded one is not
    assert ref["cases"][-1]["raw_log_ratio"] < -0.1 and abs(ref["cases"][-1]["guard_log_ratio"]) < 0.01


def test_the_guarded_ratio_is_centred_where_the_raw_ratio_is_biased_in_closed_form():
    """x = μ_old + s·ε, μ_θ = μ_old + d, log-prob a mean over D dims: log ρ = mean(d·ε)/s − m/(2s²) with
    m = mean(d²), so E[log ρ] = −m/(2s²) and E[ρ] = exp(−m/(2s²)·(1 − 1/D)); the guarded log ρ̃ = mean(d·ε) has
    mean 0 and std √(m/D)."""
    gen = torch.Generator().manual_seed(0)
    n, dims, s = 20000, 64, 0.1
    d = 0.05 * torch.where(torch.arange(dims) % 2 == 0, 1.0, -1.0)[None]  # m = 0.0025: m/(2s²) = 0.125
    m = float((d**2).mean())
    old_mean = torch.zeros(n, dims, dtype=torch.float64)
    mean = old_mean + d
    x = old_mean + s * torch.randn(n, dims, generator=gen, dtype=torch.float64)
    lp, old_lp = _gaussian_log_prob(x, mean, s), _gaussian_log_prob(x, old_mean, s)
    raw = lp - old_lp
    guarded = guard_log_ratio(lp, old_lp, mean, old_mean, s)
    sd_guard = math.sqrt(m / dims)  # = 0.00625; raw's std is sd_guard / s
    se = sd_guard / math.sqrt(n)
    # the raw ratio: mean log-ratio at its closed form −0.125, mean ratio 0.884, 97.7 % of the ratios below 1
    assert raw.mean().item() == pytest.approx(-m / (2 * s**2), abs=4 * se / s)
    assert torch.exp(raw).mean().item() == pytest.approx(math.exp(-m / (2 * s**2) * (1 - 1 / dims)), rel=0.01)
    assert (raw < 0).double().mean().item() > 0.97
    # the guarded one: centred at 0 (ratio 1), half the ratios on each side, the spread of mean(d·ε)
    assert abs(guarded.mean().item()) < 4 * se
    assert guarded.std().item() == pytest.approx(sd_guard, rel=0.03)
    assert (guarded < 0).double().mean().item() == pytest.approx(0.5, abs=0.02)
    # closed form per sample: mean(d·ε)
    eps = (x - old_mean) / s
    assert torch.allclose(guarded, (d * eps).mean(dim=1), atol=1e-12)


def test_the_progressive_window_by_hand():
    # MixGRPO's published run: 25 steps, the last 2 never in the window (L = 23), W = 4, moved 1 step every 25
    # iterations: epochs 0-24 at 0, 25-49 at 1, ..., 300 iterations end at 11; (23 − 4)//1 + 1 = 20 positions
    kw = {"window": 4, "shift_every": 25, "stride": 1, "limit": 23}
    assert [progressive_window_start(e, **kw) for e in (0, 24, 25, 49, 50, 299, 475, 499, 500, 525)] == \
        [0, 0, 1, 1, 2, 11, 19, 19, 0, 1]
    # stride 2, L = 10, W = 3: starts 0, 2, 4, 6 (the window 6-8 ends below 10; 8 would cross it), then back to 0
    kw = {"window": 3, "shift_every": 2, "stride": 2, "limit": 10}
    assert [progressive_window_start(e, **kw) for e in range(10)] == [0, 0, 2, 2, 4, 4, 6, 6, 0, 0]
    # a window as long as the trained steps never moves
    assert {progressive_window_start(e, window=5, shift_every=1, stride=1, limit=5) for e in range(7)} == {0}
    with pytest.raises(ValueError):
        progressive_window_start(0, window=6, shift_every=1, stride=1, limit=5)


def test_the_progressive_window_etas_and_no_draw():
    cfg = load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo")
    # the published run's path (window 4 of 25 steps, the last 2 untrained, 25 of 300 iterations a position: starts
    # 0-11, steps 0-14 = 60 % of 25) on 10 steps: starts 0-3 over the recipe's 30 epochs, steps 0-5 = 60 % of 10
    assert (cfg.train.sde_window, cfg.train.sde_window_shift_every, cfg.train.sde_window_stride) == (3, 8, 1)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    a = cfg.sample.eta
    assert sde_window_etas(cfg, rng, 0) == (a, a, a, 0, 0, 0, 0, 0, 0, 0)
    assert sde_window_etas(cfg, rng, 8) == (0, a, a, a, 0, 0, 0, 0, 0, 0)
    assert sde_window_etas(cfg, rng, 29) == (0, 0, 0, a, a, a, 0, 0, 0, 0)  # the run's last epoch: steps 3-5
    assert {sde_window_etas(cfg, rng, e).index(a) for e in range(cfg.run.num_epochs)} == {0, 1, 2, 3}
    assert sde_window_etas(cfg, rng, 56) == (0, 0, 0, 0, 0, 0, 0, a, a, a)  # a longer run: the last of 8 positions
    assert sde_window_etas(cfg, rng, 64) == (a, a, a, 0, 0, 0, 0, 0, 0, 0)  # 8 positions × 8 epochs: rolled back
    assert rng.bit_generator.state == state  # the progressive window draws nothing
    with pytest.raises(ValueError, match="epoch"):
        sde_window_etas(cfg, rng)
    # the random window (Flow-GRPO-Fast) still draws its start
    fast = load_recipe("flow_grpo/tiny_shapes_flow_verifier", ["train.sde_window=2", "train.sde_window_max_start=3"])
    etas = sde_window_etas(fast, rng)
    assert sum(e > 0 for e in etas) == 2 and rng.bit_generator.state != state


def test_the_settings_are_checked():
    with pytest.raises(UserError, match="sde_window_max_start"):
        load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo", ["train.sde_window_max_start=2"])
    with pytest.raises(UserError, match="shift_every"):
        load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo", ["train.sde_window_shift_every=0"])
    with pytest.raises(UserError, match="needs train.sde_window"):
        load_recipe("flow_grpo/tiny_shapes_flow_verifier", ["train.sde_window_schedule=progressive"])
    with pytest.raises(UserError, match="sde_window_schedule"):
        load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo", ["train.sde_window_schedule=sliding"])
    with pytest.raises(UserError, match="fit in the trained steps"):
        load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo", ["train.sde_window=11"])
    with pytest.raises(UserError, match="ratio_normalization"):
        load_recipe("flow_grpo/tiny_shapes_flow_guard", ["train.ratio_normalization=mean"])
    with pytest.raises(UserError, match="flow_cps"):
        load_recipe("flow_grpo/tiny_shapes_flow_guard", ["sample.sampler=flow_cps"])
    guard = load_recipe("flow_grpo/tiny_shapes_flow_guard")
    assert guard.train.ratio_normalization == "guard"


def test_epoch_passes_count_the_guards_forwards():
    from diffrl.trainers.flow_grpo import epoch_passes

    # 2 batches of 16, micro-batches of 16: 2 micro-batches x int(10 x 0.99) = 9 steps = 18 forward+backward passes;
    # the KL's 18 reference forwards, plus the guard's rollout means: 2 chunks x 9 steps = 18
    guard = load_recipe("flow_grpo/tiny_shapes_flow_guard")
    assert epoch_passes(guard) == {"train_batch": 16, "fwd_bwd": 18, "reference": 36, "adam": 2}
    assert epoch_passes(load_recipe("flow_grpo/tiny_shapes_flow_guard", ["train.kl_beta=0"]))["reference"] == 18
    # timestep_selection=random can pick any of the 10 eligible steps: 2 x 10 means
    assert epoch_passes(load_recipe("flow_grpo/tiny_shapes_flow_guard", ["train.kl_beta=0",
                                                                          "train.timestep_selection=random"]))[
        "reference"] == 20
    # MixGRPO: 2 micro-batches x the 3 window steps
    assert epoch_passes(load_recipe("flow_grpo/tiny_shapes_flow_mixgrpo")) == \
        {"train_batch": 16, "fwd_bwd": 6, "reference": 6, "adam": 2}
    pub = load_recipe("flow_grpo/mixgrpo_flux_dev_multireward")
    assert (pub.sample.num_steps, pub.sample.eta, pub.train.sde_window, pub.train.sde_window_shift_every,
            pub.train.sde_window_stride, pub.train.skip_final_steps, pub.train.clip_range, pub.train.kl_beta,
            pub.optim.learning_rate, pub.advantage.group_size, pub.run.num_epochs) == \
        (25, 0.7, 4, 25, 1, 2, 1e-4, 0.0, 1e-5, 12, 300)


# one epoch of the shipped tiny recipe, shrunk: 4 images, 4 steps
SMALL = ["run.num_epochs=1", "run.eval_every=0", "run.save_every=0", "sample.num_steps=4", "sample.batch_size=4",
         "sample.num_batches_per_epoch=1", "sample.eval_num_steps=4", "advantage.group_size=4", "train.batch_size=4",
         "log.tracker=none", "log.image_every=0", "run.name=r",
         "reward.name=jpeg_compressibility"]  # a reward that varies within a group of 4


def _train_one_epoch(tmp_path, recipe, overrides, monkeypatch):
    from diffrl.trainers import flow_grpo
    from diffrl.training import update
    from diffrl.training.metrics import read_metrics

    seen = []
    real = update.sde_window_etas

    def spy(cfg, rng, epoch=None):
        seen.append(real(cfg, rng, epoch))
        return seen[-1]

    monkeypatch.setattr(update, "sde_window_etas", spy)
    cfg = load_recipe(recipe, [*SMALL, f"run.output_dir={tmp_path}", *overrides])
    flow_grpo.train(cfg, tmp_path / "r")
    (record,) = [r for r in read_metrics(tmp_path / "r") if "policy_loss" in r]
    return cfg, record, seen


def test_the_tiny_guard_recipe_trains_an_epoch(tmp_path, monkeypatch):
    from diffrl.trainers import flow_grpo

    guarded = []
    real = flow_grpo.guard_log_ratio

    def spy(*args):
        guarded.append(real(*args).detach())
        return real(*args)

    monkeypatch.setattr(flow_grpo, "guard_log_ratio", spy)
    cfg, record, seen = _train_one_epoch(tmp_path, "flow_grpo/tiny_shapes_flow_guard", [], monkeypatch)
    assert cfg.train.ratio_normalization == "guard" and seen == [None]
    # one micro-batch, 3 trained steps, all before the optimizer step: the weights are the rollout's, so the
    # recomputed means equal the rollout means recorded before the update and every guarded log-ratio is ~0
    assert len(guarded) == 3 and all(g.shape == (4,) and g.abs().max() < 1e-5 for g in guarded)
    assert math.isfinite(record["policy_loss"]) and record["grad_norm"] > 0
    assert record["ratio"] == pytest.approx(1.0, abs=0.05)


def test_the_tiny_mixgrpo_recipe_trains_an_epoch_in_its_window(tmp_path, monkeypatch):
    cfg, record, seen = _train_one_epoch(tmp_path, "flow_grpo/tiny_shapes_flow_mixgrpo", ["train.sde_window=2"],
                                         monkeypatch)
    a = cfg.sample.eta
    assert seen == [(a, a, 0.0, 0.0)]  # epoch 0: the window at steps 0-1, ODE after
    assert math.isfinite(record["policy_loss"]) and record["grad_norm"] > 0
