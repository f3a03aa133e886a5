"""D3PO: the per-step loss and its clamp by hand, the preference rules, and what the trainer feeds the loss (pairs that
share x_T, the adapter-off reference, a ratio of exactly 1 before the first update)."""

import math

import numpy as np
import pytest
import torch
from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.trainers import d3po
from diffrl.trainers.d3po import d3po_loss, labelled_pairs_of_epoch, pair_choices, winner_loser_rows

# ------------------------------------------------------------------------------------------------ the loss by hand


def _loss(ratios_w, ratios_l, beta=0.1, clip_range=0.1):
    lw = torch.log(torch.tensor(ratios_w, dtype=torch.float64)).requires_grad_()
    ll = torch.log(torch.tensor(ratios_l, dtype=torch.float64)).requires_grad_()
    zeros = torch.zeros_like(lw)  # reference log-probs 0: log ρ = log-prob
    loss, stats = d3po_loss(lw, zeros, ll, zeros, beta=beta, clip_range=clip_range)
    loss.backward()
    return loss.item(), lw.grad, ll.grad, stats


def test_loss_inside_the_clamp():
    # ρ_w = 1.05, ρ_l = 0.97, β = 0.1: logit = 0.1 (ln 1.05 − ln 0.97) = 0.1 (0.04879016 + 0.03045921) = 0.00792494
    # loss = ln(1 + e^−0.00792494) = 0.68919256; d loss / d log ρ_w = −β σ(−logit) = −0.1 · 0.49801878 = −0.04980188
    loss, grad_w, grad_l, stats = _loss([1.05], [0.97])
    assert loss == pytest.approx(0.68919256, abs=1e-8)
    assert grad_w.item() == pytest.approx(-0.04980188, abs=1e-8) and grad_l.item() == pytest.approx(0.04980188, abs=1e-8)
    assert stats["margin"].item() == pytest.approx(0.00792494, abs=1e-8)
    assert stats["accuracy"].item() == 1.0 and stats["clipfrac"].item() == 0.0


def test_the_clamp_bounds_the_ratio_and_stops_its_gradient():
    # ρ_w = 1.5 → 1.1 and ρ_l = 0.5 → 0.9 (ε = 0.1): logit = 0.1 (ln 1.1 − ln 0.9) = 0.1 (0.09531018 + 0.10536052)
    # = 0.02006707, loss = ln(1 + e^−0.02006707) = 0.68316398; both ratios are clamped: no gradient at all
    loss, grad_w, grad_l, stats = _loss([1.5], [0.5])
    assert loss == pytest.approx(0.68316398, abs=1e-8)
    assert grad_w.item() == 0.0 and grad_l.item() == 0.0
    assert stats["clipfrac"].item() == 1.0 and stats["ratio_w"].item() == pytest.approx(1.5)
    # one ratio clamped, the other not: only the unclamped one passes gradient
    _, grad_w, grad_l, _ = _loss([1.2], [1.0])
    assert grad_w.item() == 0.0 and grad_l.item() != 0.0


def test_ratio_one_gives_log_2_and_the_half_beta_gradient_averaged_over_pairs():
    # ρ = 1 for both chains of both pairs: logit 0, loss ln 2, gradient −β/2 per pair divided by the 2 pairs
    loss, grad_w, grad_l, stats = _loss([1.0, 1.0], [1.0, 1.0], beta=0.5)
    assert loss == pytest.approx(math.log(2), abs=1e-12)
    assert torch.allclose(grad_w, torch.full((2,), -0.5 / 2 / 2, dtype=torch.float64))
    assert torch.allclose(grad_l, torch.full((2,), 0.5 / 2 / 2, dtype=torch.float64))
    assert stats["ratio_w"].item() == 1.0 and stats["accuracy"].item() == 0.0


def test_a_large_negative_margin_does_not_overflow():
    # β = 1000 with the clamp's extremes: logit = −1000 (ln 1.1 − ln 0.9) = −200.67; loss = −ln σ(logit) ≈ 200.67
    loss, _, _, _ = _loss([0.5], [1.5], beta=1000.0)
    assert loss == pytest.approx(1000 * (math.log(1.1) - math.log(0.9)), rel=1e-9)


# ------------------------------------------------------------------------------------------------ preferences


def test_pair_choices_one_reward_and_pareto():
    one = pair_choices(torch.tensor([0.3, 0.1, 0.5, float("nan")]), torch.tensor([0.2, 0.4, 0.5, 0.1]))
    assert one.tolist() == [0, 1, -1, -1]  # higher wins; equal is a tie; a NaN score decides nothing
    a = torch.tensor([[1.0, 2.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    b = torch.tensor([[0.0, 2.0], [0.0, 1.0], [1.0, 1.0], [0.0, 3.0]])
    # dominates (≥ both, > one) / each better somewhere / equal / dominated
    assert pair_choices(a, b).tolist() == [0, -1, -1, 1]


def test_winner_loser_rows():
    winners, losers = winner_loser_rows(np.array([0, 3, 5]), np.array([1, 0, -1]))
    assert winners.tolist() == [1, 6, 10] and losers.tolist() == [0, 7, 11]


def test_labelled_pairs_cover_the_file_once_per_pass_and_processes_are_disjoint():
    n, per_process, processes = 7, 2, 2  # 4 pairs per epoch of a 7-line file
    epochs = [[labelled_pairs_of_epoch(n, e, per_process, processes, r, seed=3) for r in range(processes)]
              for e in range(7)]
    flat = np.concatenate([np.concatenate(e) for e in epochs])  # 28 positions = 4 passes of 7
    for k in range(4):
        assert sorted(flat[7 * k: 7 * k + 7].tolist()) == list(range(7))
    assert not set(epochs[0][0]) & set(epochs[0][1])
    assert labelled_pairs_of_epoch(n, 5, per_process, processes, 1, seed=3).tolist() == epochs[5][1].tolist()


# ------------------------------------------------------------------------------------------------ what the loss sees


def _recipe(tmp_path, **groups):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 0},
                         "sample": {"num_steps": 2, "batch_size": 4, "num_batches_per_epoch": 1},
                         "log": {"tracker": "none", "image_every": 0}}, "d3po")
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_pairs_share_x_T_and_differ_after_it(tmp_path, monkeypatch):
    from diffrl.training import context

    captured = []
    original = context.collect_rollouts

    def capture(**kwargs):
        out = original(**kwargs)
        captured.append(out.traj)
        return out

    monkeypatch.setattr(context, "collect_rollouts", capture)
    d3po.train(load_cfg(_recipe(tmp_path)), tmp_path / "run")
    latents = captured[0].latents  # [4, T+1, C, h, w]: pairs (0, 1) and (2, 3)
    assert torch.equal(latents[0, 0], latents[1, 0]) and torch.equal(latents[2, 0], latents[3, 0])
    assert not torch.equal(latents[0, 0], latents[2, 0])  # one x_T per pair
    assert (latents[0, 1:] - latents[1, 1:]).abs().amin(dim=(1, 2, 3)).gt(0).all()  # own step noise from step 1 on
    assert captured[0].prompts[0] == captured[0].prompts[1] and captured[0].prompts[2] == captured[0].prompts[3]


def test_the_reference_is_the_pre_trained_model_and_the_ratio_is_one_before_the_first_update(tmp_path, monkeypatch):
    from diffusers import StableDiffusionPipeline

    from samplers import get_sampler

    losses, references = [], []
    original_loss, original_reference = d3po.d3po_loss, d3po.reference_step

    def loss_spy(*args, **kwargs):
        losses.append([a.detach().clone() for a in args])
        return original_loss(*args, **kwargs)

    def reference_spy(pipe, sampler, traj, step_index):
        out = original_reference(pipe, sampler, traj, step_index)
        references.append((traj, step_index, out.log_prob.clone()))
        return out

    monkeypatch.setattr(d3po, "d3po_loss", loss_spy)
    monkeypatch.setattr(d3po, "reference_step", reference_spy)
    d3po.train(load_cfg(_recipe(tmp_path, run={"num_epochs": 2})), tmp_path / "run")

    # the first call, before any update: π_θ = π_ref exactly (a fresh LoRA adds zero), so ρ = 1 and the loss ln 2
    log_probs_w, ref_w, log_probs_l, ref_l = losses[0]
    assert torch.equal(log_probs_w, ref_w) and torch.equal(log_probs_l, ref_l)
    assert torch.exp(log_probs_w - ref_w).eq(1).all()
    # later calls: the policy has moved away from the reference...
    last_w, last_ref_w = losses[-1][0], losses[-1][1]
    assert (last_w - last_ref_w).abs().max() > 1e-6
    # ...and the reference is the pre-trained model itself: the same step's log-prob under a plain diffusers load of
    # the base weights (no adapter anywhere), not under the trained pipeline with its adapter switched off
    base = StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir(tmp_path))
    traj, j, ref_log_probs = references[-1]
    with torch.no_grad():
        expected = get_sampler("ddim", base).log_prob(base, traj, j)
    assert torch.allclose(ref_log_probs, expected, atol=1e-6, rtol=0)


def test_ties_are_skipped_and_counted(tmp_path):
    from diffrl.training.metrics import read_metrics

    # a constant reward: every pair is a tie, nothing to learn, every pair counted as skipped, weights unchanged
    # (without weight decay, which AdamW applies whatever the gradient)
    steps = []
    recipe = _recipe(tmp_path, reward={"name": "pg_helpers:constant"}, run={"num_epochs": 1},
                     optim={"weight_decay": 0.0})
    d3po.train(load_cfg(recipe), tmp_path / "run",
               step_callback=lambda info: steps.append([p.detach().clone() for p in info["params"]]))
    record = read_metrics(tmp_path / "run")[0]
    assert record["pairs_used"] == 0 and record["pairs_skipped"] == 2
    assert all(torch.equal(a, b) for a, b in zip(steps[0], steps[-1]))


@pytest.mark.parametrize("override, expected", [
    ("sample.batch_size=3", "must be even"),
    ("train.clip_range=1.0", "train.clip_range must be in (0, 1)"),
    ("train.beta=0.0", "train.beta must be > 0"),
    ("model.full_finetune=true", "LoRA only"),
    ("train.preference=pareto", "give at least two"),
    ("train.labels=x.jsonl", "read only with train.preference=labels"),
    ("train.preference=labels", "needs train.labels"),
    ("sample.eta=0.0 sample.sampler=ddim", "deterministic"),
])
def test_bad_settings_fail_at_load_time(override, expected):
    import re
    from pathlib import Path

    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "d3po" / "tiny_shapes_verifier.yaml"
    with pytest.raises(UserError, match=re.escape(expected)):
        load_recipe(recipe, override.split())


def test_sd15_recipe_has_the_reference_settings():
    from pathlib import Path

    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "d3po" / "sd15_compressibility.yaml")
    s, o, t = cfg.sample, cfg.optim, cfg.train
    assert (s.num_steps, s.eta, s.guidance_scale, s.batch_size, s.num_batches_per_epoch) == (20, 1.0, 5.0, 20, 2)
    assert (o.learning_rate, o.weight_decay, o.max_grad_norm, o.gradient_accumulation_steps) == (3e-5, 1e-4, 1.0, 1)
    assert (t.beta, t.clip_range, t.batch_size, t.preference) == (0.1, 0.1, 1, "reward")
    assert cfg.run.num_epochs == 400 and cfg.model.mixed_precision == "fp16" and cfg.model.lora.rank == 4
    assert derived_numbers(cfg, 1)["optimizer_steps_per_epoch"] == 20  # one pair per step, 20 pairs per GPU


def test_pareto_preferences_compare_each_reward_component(tmp_path, monkeypatch):
    from diffrl.training.metrics import read_metrics

    seen = []
    original = d3po.pair_choices

    def spy(scores_0, scores_1):
        seen.append((scores_0.clone(), scores_1.clone()))
        return original(scores_0, scores_1)

    monkeypatch.setattr(d3po, "pair_choices", spy)
    components = [{"name": "pg_helpers:brightness", "weight": 1.0}, {"name": "pg_helpers:redness", "weight": 1.0}]
    recipe = _recipe(tmp_path, reward={"name": "", "components": components}, train={"preference": "pareto"})
    d3po.train(load_cfg(recipe), tmp_path / "run")
    scores_0, scores_1 = seen[0]
    assert scores_0.shape == (2, 2)  # 2 pairs × (brightness, redness), not their sum
    dominated = ((scores_0 >= scores_1).all(1) & (scores_0 > scores_1).any(1)) | (
        (scores_1 >= scores_0).all(1) & (scores_1 > scores_0).any(1))
    record = read_metrics(tmp_path / "run")[0]
    assert record["pairs_used"] == int(dominated.sum()) and record["pairs_skipped"] == 2 - int(dominated.sum())
