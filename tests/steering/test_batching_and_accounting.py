"""Batching, evaluation counts, reward sign and the time split, on the closed-form 2-D toy (see steer_toy.py).

The toy counts its own model calls and the reward its own calls, independently of `SteerContext`'s accounting, so
these tests pin that every method pushes all its particles / candidates through the model and the reward together
(one call per step, not one per particle), and that the NFE it reports is what the model saw.
"""

import pytest
import torch
from steer_toy import DTYPE, GMMProcess, LinearReward, default_gmm

from diffrl.errors import UserError
from diffrl.steering import steer_process

A = torch.tensor([1.0, 0.0], dtype=DTYPE)
PROMPTS = ["toy"] * 3


class CountingLinearReward(LinearReward):
    """a·x that also records the batch size of every call."""

    def __init__(self, a, higher_is_better=True):
        super().__init__(a)
        self.higher_is_better = higher_is_better
        self.batch_sizes = []

    def __call__(self, samples, prompts, metadata=None):
        self.batch_sizes.append(len(samples))
        return super().__call__(samples, prompts, metadata)


def _run(method, steps, batch_size=None, higher_is_better=True, seed=0, **cfg):
    process = GMMProcess(default_gmm(), num_steps=steps)
    reward = CountingLinearReward(A, higher_is_better)
    out = steer_process(
        process, PROMPTS, reward, method, generator=torch.Generator().manual_seed(seed), batch_size=batch_size, **cfg
    )
    return out, process, reward


def test_fk_moves_all_particles_through_one_model_and_one_reward_call():
    # 3 prompts × 5 particles = 15 rows; 20 steps; scheduled steps 0, 5, 10, 15 (18 is the last allowed)
    out, process, reward = _run("fk", 20, num_particles=5, interval=5)
    assert out.info["scheduled_steps"] == [0, 5, 10, 15]
    assert process.model_calls == 20  # one batched call per step, not one per particle
    assert reward.batch_sizes == [15] * 5  # four scheduled steps + the final score, every particle at once
    assert out.info["nfe"] == 15 * 20 and out.info["reward_evals"] == 15 * 5


def test_svdd_moves_all_candidates_through_one_model_and_one_reward_call():
    # 3 chains × M = 4 candidates; 10 steps. Step 0 needs x_T's model output (1 call); each of steps 0..8 evaluates
    # all 12 candidates at once (9 calls, reused at the next step); the toy's last step (to ᾱ = 1) adds no noise,
    # so it has a single candidate per chain, scored as the final sample.
    out, process, reward = _run("svdd", 10, num_candidates=4)
    assert process.model_calls == 1 + 9
    assert reward.batch_sizes == [12] * 9 + [3]
    assert out.info["nfe"] == 3 * (1 + 9 * 4) and out.info["reward_evals"] == 3 * (9 * 4 + 1)


def test_best_of_n_and_guidance_batch_their_chains():
    out, process, reward = _run("best-of-n", 12, num_samples=4)
    assert process.model_calls == 12 and reward.batch_sizes == [12]
    out, process, reward = _run("guidance", 12, num_samples=2, scale=0.5)
    # every guided step scores x̂0 of all 6 chains with a graph, then the final samples once
    assert process.model_calls == 12 and reward.batch_sizes == [6] * 13
    assert out.info["nfe_grad"] == 6 * 12 and out.info["backward_passes"] == 12


def test_batch_size_splits_calls_without_changing_the_count_of_evaluations():
    # 15 rows in chunks of 7: 3 calls per step and per scoring, the evaluations counted once per row
    out, process, reward = _run("fk", 20, batch_size=7, num_particles=5, interval=5)
    assert process.model_calls == 20 * 3
    assert reward.batch_sizes == [7, 7, 1] * 5
    assert out.info["nfe"] == 15 * 20 and out.info["reward_evals"] == 15 * 5
    # and the same draws: chunking changes nothing but the batching
    full, _, _ = _run("fk", 20, num_particles=5, interval=5)
    torch.testing.assert_close(out.images, full.images)


def test_reno_batches_prompts_and_counts_one_evaluation_per_generation():
    # a one-step toy (DDIM from t = 999 straight to ᾱ = 1) is a deterministic one-step generator G(ε)
    out, process, reward = _run("reno", 1, iterations=5, lr=0.5)
    assert process.model_calls == 5 and reward.batch_sizes == [3] * 5
    assert out.info["nfe"] == 3 * 5 and out.info["nfe_grad"] == 3 * 4 and out.info["backward_passes"] == 4


@pytest.mark.parametrize("method, cfg", [
    ("best-of-n", {"num_samples": 6}),
    ("fk", {"num_particles": 6, "lmbda": 2.0, "interval": 5}),
    ("svdd", {"num_candidates": 6}),
])
def test_lower_is_better_rewards_are_minimised_and_reported_raw(method, cfg):
    # The same reward a·x once as higher-is-better and once as lower-is-better, same seed: the second must steer
    # towards small a·x. The base mean of a·x is −0.4 (see steer_toy); both runs report raw a·x.
    up, _, _ = _run(method, 20, seed=1, **cfg)
    down, _, _ = _run(method, 20, seed=1, higher_is_better=False, **cfg)
    torch.testing.assert_close(down.scores.double(), down.images @ A, atol=1e-6, rtol=1e-6)  # raw, of the samples
    assert up.scores.mean() > -0.4 + 0.5 and down.scores.mean() < -0.4 - 0.5, (up.scores, down.scores)


def test_lower_is_better_best_of_n_keeps_the_minimum():
    from diffrl.steering.best_of_n import BestOfNConfig, best_of_n
    from diffrl.steering.core import SteerContext

    ctx = SteerContext(GMMProcess(default_gmm(), num_steps=10), CountingLinearReward(A, False), PROMPTS)
    out = best_of_n(ctx, BestOfNConfig(num_samples=5), torch.Generator().manual_seed(0), keep_samples=True)
    torch.testing.assert_close(out.scores, out.info["sample_scores"].min(dim=1).values)


def test_fk_on_a_lower_is_better_reward_targets_exp_of_minus_lambda_r():
    # Without resampling the final weights are exactly softmax(λ·objective) = softmax(−λ·r) for such a reward.
    from diffrl.steering.core import SteerContext
    from diffrl.steering.fk import FKConfig, fk_steer

    ctx = SteerContext(GMMProcess(default_gmm(), num_steps=20), CountingLinearReward(A, False), PROMPTS)
    cfg = FKConfig(num_particles=8, lmbda=0.7, interval=4, ess_threshold=1e-9)
    out = fk_steer(ctx, cfg, torch.Generator().manual_seed(2), keep_particles=True)
    raw = out.info["particle_scores"].double()
    torch.testing.assert_close(out.info["final_weights"].double(), torch.softmax(-0.7 * raw, dim=1))
    # "best" is the lowest raw score of each group
    torch.testing.assert_close(out.scores.double(), raw.min(dim=1).values)


def test_time_split_adds_up():
    out, _, _ = _run("fk", 20, num_particles=5, interval=5)
    info = out.info
    evaluations = info["model_s"] + info["decode_s"] + info["reward_s"] + info["backward_s"]
    assert info["wall_s"] >= evaluations + info["step_s"] - 1e-9
    assert info["overhead_s"] == pytest.approx(info["wall_s"] - evaluations, abs=1e-9)
    assert info["method_s"] == pytest.approx(info["overhead_s"] - info["step_s"], abs=1e-9)
    assert info["step_s"] > 0 and 0 <= info["overhead_frac"] <= 1


def _named(reward, name):
    reward.name = name  # a weighted sum needs distinct term names
    return reward


def test_gradient_methods_refuse_a_weighted_sum_with_a_non_differentiable_term(tiny_lcm):
    from steer_toy import Brightness

    from diffrl.steering import steer

    with pytest.raises(UserError, match="needs a differentiable reward"):
        steer(tiny_lcm, ["a red circle"], [Brightness(), _named(Brightness(differentiable=False), "frozen")], "reno",
              reward_weights=[1.0, 1.0], iterations=1)


def test_reno_optimises_the_weighted_sum_of_several_rewards(tiny_lcm):
    # 3·b − 2·b is b: the optimiser sees the same objective and gradients, so the runs match step for step, and the
    # reported score is the weighted sum (here equal to b itself)
    from steer_toy import Brightness

    from diffrl.steering import steer

    prompts = ["a red circle", "a blue square"]
    single = steer(tiny_lcm, prompts, Brightness(), "reno", seed=0, iterations=4)
    pair = steer(tiny_lcm, prompts, [Brightness(), _named(Brightness(), "brightness_again")], "reno",
                 reward_weights=[3.0, -2.0], seed=0, iterations=4)
    assert pair[2]["reward"] == "weighted_sum"
    torch.testing.assert_close(pair[1], single[1], atol=1e-3, rtol=1e-4)
    assert pair[2]["objective_per_iteration"] == pytest.approx(single[2]["objective_per_iteration"], abs=1e-3)


def test_a_sum_of_one_reward_at_two_settings_needs_labels():
    # two terms of the same registry reward: the weighted sum names terms by reward, so they need labels
    from diffrl.steering import resolve_reward

    spec = [{"name": "steer_toy:brightness", "kwargs": {"differentiable": True}},
            {"name": "steer_toy:brightness", "kwargs": {"differentiable": False}}]
    with pytest.raises(UserError, match="distinct 'label'"):
        resolve_reward(spec, [1.0, 0.5])
    labelled = [{**spec[0], "label": "soft"}, {**spec[1], "label": "hard"}]
    reward = resolve_reward(labelled, [1.0, 0.5])
    images = torch.full((2, 3, 4, 4), 0.5)
    out = reward(images, ["a", "b"])
    torch.testing.assert_close(out.scores, torch.full((2,), 1.5 * 50.0))  # 1·50 + 0.5·50
    assert set(out.info) >= {"soft", "hard"} and not reward.differentiable
    with pytest.raises(UserError, match="reward spec"):
        resolve_reward([{"name": "steer_toy:brightness", "colour": "red"}, "steer_toy:brightness"])
