"""PRDP: the clipped reward-difference-prediction loss worked by hand (Deng et al. 2024, Eq. 14-21 and appendix G's
code), its clip, its symmetry and direction, the pairs it counts, and what the trainer feeds it (every pair of a
prompt's chains, the adapter-off reference, the rollout's own log-probs before the first update)."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.trainers import prdp
from diffrl.trainers.prdp import pair_counts, prdp_loss, reward_difference_pairs

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------------ the loss by hand


def _loss(log_probs, old, ref, rewards, beta, clip_range):
    """prdp_loss on float64 `[G, B, T]` inputs; returns (loss, d loss / d log_probs, stats)."""
    log_probs = torch.tensor(log_probs, dtype=torch.float64).requires_grad_()
    loss, stats = prdp_loss(log_probs, torch.tensor(old, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                            torch.tensor(rewards, dtype=torch.float64), beta=beta, clip_range=clip_range)
    loss.backward()
    return loss.item(), log_probs.grad, stats


def test_one_pair_with_a_clipped_step():
    # one prompt, chains a and b, T = 2 steps, β = 0.5, ε = 0.1, π_ref = π_old (log-probs 0): r̂_t = log π_θ,t.
    # a = [0.05, 0.25] -> clipped to [0.05, 0.10]; b = [-0.02, 0.00] inside the clip.
    # r̂_a = 0.15, r̂_a^clip = 0.075, r̂_b = r̂_b^clip = -0.01 (means over steps).
    # r_a = 1.0 > r_b = 0.5: target Δr/β = 1.0. Δr̂ = 0.16 -> (0.16 - 1)² = 0.7056; Δr̂^clip = 0.085 -> 0.837225.
    # loss = max = 0.837225 (the clipped square). Its gradient, 2(0.085 - 1)/T = -0.915 per unclipped step of a, and
    # +0.915 per step of b; a's clipped step 1 passes none.
    zeros = [[[0.0, 0.0], [0.0, 0.0]]]
    loss, grad, stats = _loss([[[0.05, 0.25], [-0.02, 0.0]]], zeros, zeros, [[1.0, 0.5]], beta=0.5, clip_range=0.1)
    assert loss == pytest.approx(0.837225, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[[-0.915, 0.0], [0.915, 0.915]]], dtype=torch.float64), atol=1e-12)
    # moved = log π_θ − log π_old = 0.05, 0.25, −0.02, 0: approx_kl = ½·(0.0025 + 0.0625 + 0.0004)/4 = 0.008175;
    # one of four steps moved more than ε
    assert stats["approx_kl"].item() == pytest.approx(0.008175, abs=1e-12)
    assert stats["clipfrac"].item() == 0.25 and stats["accuracy"].item() == 1.0 and stats["pairs"].item() == 1


def test_three_chains_with_a_tie_and_a_reference_apart_from_the_snapshot():
    # T = 1, β = 2, ε = 0.05. ref = [0.1, -0.2, 0.3], old = [0.2, -0.1, 0.3] -> r̂_old = [0.1, 0.1, 0.0];
    # log π_θ = [0.3, -0.12, 0.31] -> r̂ = [0.2, 0.08, 0.01]; clip windows [0.05, 0.15], [0.05, 0.15], [-0.05, 0.05]
    # -> r̂_clip = [0.15, 0.08, 0.01]. Rewards [2, 1, 2]: pairs (0, 1) and (2, 1) with target (2 - 1)/2 = 0.5; (0, 2)
    # is a tie and left out.
    # (0, 1): Δ = 0.12 -> 0.1444, Δ_clip = 0.07 -> 0.1849: 0.1849.  (2, 1): Δ = Δ_clip = -0.07 -> 0.3249.
    # loss = (0.1849 + 0.3249)/2 = 0.2549. Gradient (÷ 2 pairs): chain 0 clipped: 0; chain 1: (-2(0.07 - 0.5)
    # - 2(-0.07 - 0.5))/2 = (0.86 + 1.14)/2 = 1.0; chain 2: 2(-0.57)/2 = -0.57.
    loss, grad, stats = _loss([[[0.3], [-0.12], [0.31]]], [[[0.2], [-0.1], [0.3]]], [[[0.1], [-0.2], [0.3]]],
                              [[2.0, 1.0, 2.0]], beta=2.0, clip_range=0.05)
    assert loss == pytest.approx(0.2549, abs=1e-12)
    assert torch.allclose(grad.flatten(), torch.tensor([0.0, 1.0, -0.57], dtype=torch.float64), atol=1e-12)
    # Δr̂ ranks (0, 1) right (0.12 > 0), (2, 1) wrong (-0.07); moved = [0.1, -0.02, 0.01]: one of three beyond ε
    assert stats["accuracy"].item() == 0.5 and stats["pairs"].item() == 2
    assert stats["clipfrac"].item() == pytest.approx(1 / 3, abs=1e-12)


def test_a_step_moved_past_the_clip_the_wrong_way_keeps_its_gradient():
    # T = 1, β = 1, ε = 0.1, ref = old = 0, r_a = 1 > r_b = 0: target 1. a moved to -0.3 (against the target):
    # Δr̂ = -0.3 -> (-1.3)² = 1.69; clipped to -0.1 -> (-1.1)² = 1.21. The max is the unclipped square, so the
    # step keeps its gradient 2(-1.3) = -2.6 (pessimistic, as PPO's min): the update pulls it back up.
    zeros = [[[0.0], [0.0]]]
    loss, grad, _ = _loss([[[-0.3], [0.0]]], zeros, zeros, [[1.0, 0.0]], beta=1.0, clip_range=0.1)
    assert loss == pytest.approx(1.69, abs=1e-12)
    assert torch.allclose(grad.flatten(), torch.tensor([-2.6, 2.6], dtype=torch.float64), atol=1e-12)


def test_outside_the_clip_in_the_wanted_direction_no_gradient():
    # the same pair with a moved to +0.3 (towards the target 1): Δr̂ = 0.3 -> 0.49, clipped 0.1 -> 0.81. The max is
    # the clipped square, whose a-term is constant: no gradient for a; b (inside) gets 2(1 - 0.1)·1 = 1.8
    zeros = [[[0.0], [0.0]]]
    loss, grad, stats = _loss([[[0.3], [0.0]]], zeros, zeros, [[1.0, 0.0]], beta=1.0, clip_range=0.1)
    assert loss == pytest.approx(0.81, abs=1e-12)
    assert grad.flatten()[0].item() == 0.0 and grad.flatten()[1].item() == pytest.approx(1.8, abs=1e-12)
    assert stats["clipfrac"].item() == 0.5


def test_swapping_the_chains_of_a_group_gives_the_same_loss():
    rng = np.random.default_rng(0)
    log_probs, old, ref = (rng.normal(0, 0.1, size=(2, 3, 4)) for _ in range(3))
    rewards = rng.normal(size=(2, 3))
    loss, grad, _ = _loss(log_probs, old, ref, rewards, beta=0.3, clip_range=0.05)
    order = [2, 0, 1]
    loss_p, grad_p, _ = _loss(log_probs[:, order], old[:, order], ref[:, order], rewards[:, order], 0.3, 0.05)
    assert loss_p == pytest.approx(loss, abs=1e-12)
    assert torch.allclose(grad_p, grad[:, order], atol=1e-12)


def test_direction_at_the_snapshot_the_better_chain_is_pushed_up():
    # at θ = θ_old = ref every Δr̂ is 0: each pair's gradient is -2Δr/β on its better chain, +2Δr/β on the other,
    # / T per step, / the number of pairs. Rewards [3, 1, 2], β = 1, T = 2, 3 pairs: chain 0 gets
    # (-2·2 - 2·1)/2/3 = -1 per step, chain 1 (2·2 + 2·1)/6 = +1, chain 2 (2·1 - 2·1)/6 = 0.
    zeros = np.zeros((1, 3, 2))
    loss, grad, _ = _loss(zeros, zeros, zeros, [[3.0, 1.0, 2.0]], beta=1.0, clip_range=1e-4)
    assert loss == pytest.approx((4 + 1 + 1) / 3, abs=1e-12)  # (Δr/β)² = 2², 1², 1²
    assert torch.allclose(grad, torch.tensor([[[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]], dtype=torch.float64),
                          atol=1e-12)


def test_no_counted_pair_gives_zero_loss_and_gradient():
    zeros = np.zeros((1, 2, 2))
    loss, grad, stats = _loss(zeros + 0.1, zeros, zeros, [[1.0, 1.0]], beta=1.0, clip_range=1e-4)
    assert loss == 0.0 and grad.abs().sum().item() == 0.0 and stats["pairs"].item() == 0


def test_reward_difference_pairs_leave_out_ties_and_non_finite_rewards():
    targets, counted = reward_difference_pairs(torch.tensor([[1.0, 1.0, 2.0, float("nan")]]), beta=0.5)
    # counted: (2, 0) and (2, 1) only (r = 2 > 1); (0, 1) a tie; every pair with the NaN chain out
    expected = torch.zeros(1, 4, 4, dtype=torch.bool)
    expected[0, 2, 0] = expected[0, 2, 1] = True
    assert torch.equal(counted, expected)
    assert targets[0, 2, 0].item() == 2.0 and targets[0, 0, 2].item() == -2.0  # (2 − 1)/0.5
    assert torch.isfinite(targets).all()
    # 6 pairs in the group: 2 counted, a tie and 3 with the NaN chain skipped
    assert pair_counts(np.array([1.0, 1.0, 2.0, np.nan]), 4) == {"pairs_used": 2, "pairs_skipped": 4}


# ------------------------------------------------------------------------------------------------ the trainer


def _recipe(tmp_path, **groups):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 0},
                         "sample": {"num_steps": 2, "batch_size": 4, "num_batches_per_epoch": 1},
                         "log": {"tracker": "none", "image_every": 0}}, "prdp")
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_first_loss_is_the_targets_mean_square_and_the_weights_change(tmp_path, monkeypatch):
    from diffrl.training import context
    from diffrl.training.metrics import read_metrics

    # one micro-batch of both prompts' 2 chains, one pass: the epoch's loss is the first micro-batch's, taken before
    # any update, where log π_θ = log π_old = log π_ref (a fresh LoRA adds zero), so every Δr̂ is 0 and the loss is
    # the mean over the pairs of (Δr/β)², worked out here from the rollout's rewards
    rewards, trajs, steps = [], [], []
    original = context.collect_rollouts

    def capture(**kwargs):
        out = original(**kwargs)
        rewards.append(out.all_rewards.copy())
        trajs.append(out.traj)
        return out

    monkeypatch.setattr(context, "collect_rollouts", capture)
    recipe = _recipe(tmp_path, train={"group_size": 2, "batch_size": 2, "beta": 0.01})
    prdp.train(load_cfg(recipe), tmp_path / "run",
               step_callback=lambda info: steps.append([p.detach().clone() for p in info["params"]]))
    r = rewards[0]  # [4]: prompt 0's chains 0, 1 and prompt 1's 2, 3
    expected = (((r[0] - r[1]) / 0.01) ** 2 + ((r[2] - r[3]) / 0.01) ** 2) / 2
    record = read_metrics(tmp_path / "run")[0]
    assert record["loss"] == pytest.approx(expected, rel=1e-6)
    assert record["ratio_first_step"] == 1.0 and record["logprob_max_diff"] == 0.0
    assert record["pairs_used"] == 2 and record["pairs_skipped"] == 0
    assert len(steps) == 2 and any(not torch.equal(a, b) for a, b in zip(steps[0], steps[-1]))
    # a group is one prompt's chains, each from its own x_T (i.i.d. from π_θold, Algorithm 1 line 6)
    traj = trajs[0]
    assert traj.prompts[0] == traj.prompts[1] and traj.prompts[2] == traj.prompts[3]
    assert not torch.equal(traj.latents[0, 0], traj.latents[1, 0])


def test_the_step_by_step_backward_is_the_gradient_of_the_trajectory_loss(tmp_path, monkeypatch):
    from diffrl.training import context
    from diffrl.training.reference import reference_step

    # the trainer never holds the graph of all T steps: it takes d loss / d log π_t from the pure loss and backpropagates
    # coefficient × log π_t step by step. At the first optimizer step (one micro-batch: both prompts' 2 chains, no
    # accumulation) the summed gradient must equal the gradient of prdp_loss built on log-probs that all carry the
    # graph, computed here at the same (pre-update) weights
    captured, compared = [], []
    original_collect, original_step = context.collect_rollouts, context.RunContext.optimizer_step

    def collect(**kwargs):
        out = original_collect(**kwargs)
        captured.append(out)
        return out

    def optimizer_step(self, losses_finite):
        if not compared:
            params = [p for p in self.params if p.grad is not None]
            trainer_grads = [p.grad.clone() for p in params]
            rollout, tc = captured[0], self.cfg.train
            traj, steps = rollout.traj, range(self.cfg.sample.num_steps)
            for p in params:
                p.grad = None
            log_probs = torch.stack([self.sampler.log_prob(self.pipe, traj, j) for j in steps], dim=1)
            ref = torch.stack([reference_step(self.pipe, self.sampler, traj, j).log_prob for j in steps], dim=1)
            loss, _ = prdp_loss(log_probs.view(2, 2, -1), traj.log_probs.view(2, 2, -1), ref.view(2, 2, -1),
                                rollout.rewards.view(2, 2), beta=tc.beta, clip_range=tc.clip_range)
            loss.backward()
            compared.append([(a, p.grad.clone()) for a, p in zip(trainer_grads, params)])
            for p, g in zip(params, trainer_grads):
                p.grad = g.clone()  # the step clips gradients in place: keep the compared copy apart
        return original_step(self, losses_finite)

    monkeypatch.setattr(context, "collect_rollouts", collect)
    monkeypatch.setattr(context.RunContext, "optimizer_step", optimizer_step)
    recipe = _recipe(tmp_path, train={"group_size": 2, "batch_size": 2, "beta": 0.01, "clip_range": 1e-4})
    prdp.train(load_cfg(recipe), tmp_path / "run")
    assert compared and any(b.abs().max() > 0 for _, b in compared[0])
    for trainer_grad, direct_grad in compared[0]:
        assert torch.allclose(trainer_grad, direct_grad, rtol=1e-4, atol=1e-6 * direct_grad.abs().max().item())


def test_a_constant_reward_counts_every_pair_as_skipped_and_trains_nothing(tmp_path):
    from diffrl.training.metrics import read_metrics

    steps = []
    recipe = _recipe(tmp_path, reward={"name": "pg_helpers:constant"}, optim={"weight_decay": 0.0},
                     train={"group_size": 4, "batch_size": 1})
    prdp.train(load_cfg(recipe), tmp_path / "run",
               step_callback=lambda info: steps.append([p.detach().clone() for p in info["params"]]))
    record = read_metrics(tmp_path / "run")[0]
    assert record["pairs_used"] == 0 and record["pairs_skipped"] == 6
    assert all(torch.equal(a, b) for a, b in zip(steps[0], steps[-1]))


@pytest.mark.parametrize("override, expected", [
    ("train.group_size=1", "train.group_size must be >= 2"),
    ("train.group_size=3", "must be a multiple of train.group_size"),
    ("optim.gradient_accumulation_steps=3", "not a multiple of train.batch_size × train.group_size"),
    ("train.beta=0.0", "train.beta must be > 0"),
    ("train.clip_range=0.0", "train.clip_range must be > 0"),
    ("train.skip_final_steps=10", "train.skip_final_steps must be in"),
    ("model.full_finetune=true", "LoRA only"),
    ("sample.eta=0.0 sample.sampler=ddim", "deterministic"),
])
def test_bad_settings_fail_at_load_time(override, expected):
    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    with pytest.raises(UserError, match=re.escape(expected)):
        load_recipe(REPO / "recipes" / "prdp" / "tiny_shapes_verifier.yaml", override.split())
