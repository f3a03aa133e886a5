"""Golden tests of the steering math: every expected number below is worked out by hand in the comments."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.errors import UserError
from diffrl.steering import fk
from diffrl.steering.best_of_n import best_of_n_indices
from diffrl.steering.core import gather_rows, select_per_prompt
from diffrl.steering.guidance import guided_noise
from diffrl.steering.reno import clip_grad_norm_per_sample, norm_prior_nll, update_best
from diffrl.steering.svdd import svdd_select


def _history(prev, running_max, running_sum, log_prod=(0.0, 0.0)):
    def row(values):
        return torch.tensor([list(values)])

    return fk.FKHistory(row(prev), row(running_max), row(running_sum), row(log_prod))


# ---------------------------------------------------------------------------------------------- potentials


def test_potentials_by_hand():
    # two particles; current rewards r = (0.5, 2.0); history: previous r = (1.0, 1.0), running max (1.5, 1.0),
    # running sum (3.0, -1.0); λ = 2
    rewards = torch.tensor([[0.5, 2.0]])
    history = _history((1.0, 1.0), (1.5, 1.0), (3.0, -1.0))
    # max: λ·max(r, max) = 2·(1.5, 2.0) = (3, 4)
    assert fk.log_potential("max", rewards, history, 2.0).tolist() == [[3.0, 4.0]]
    # add: λ·(r + sum) = 2·(3.5, 1.0) = (7, 2)
    assert fk.log_potential("add", rewards, history, 2.0).tolist() == [[7.0, 2.0]]
    # difference: λ·(r − prev) = 2·(−0.5, 1.0) = (−1, 2)
    assert fk.log_potential("difference", rewards, history, 2.0).tolist() == [[-1.0, 2.0]]
    # immediate: λ·r = (1, 4)
    assert fk.log_potential("immediate", rewards, history, 2.0).tolist() == [[1.0, 4.0]]
    with pytest.raises(UserError, match="unknown FK potential"):
        fk.log_potential("sum", rewards, history, 2.0)


def test_first_step_potentials_equal_lambda_r():
    # before any scheduled step: prev 0, max −inf, sum 0, so every potential is λ·r
    history = fk.init_history((1, 3))
    rewards = torch.tensor([[0.2, -1.0, 3.0]])
    for name in fk.POTENTIALS:
        torch.testing.assert_close(fk.log_potential(name, rewards, history, 3.0), 3.0 * rewards)


def test_history_and_final_correction_telescope_to_lambda_r0():
    # rewards at three scheduled steps for one particle: 1, 3, 2; final reward 2.5; λ = 0.5.
    # The product of all potentials including the final correction must be exp(λ·r0) = exp(1.25) for every kind.
    for name in fk.POTENTIALS:
        history = fk.init_history((1, 1))
        total = torch.zeros(1, 1)
        for r in (1.0, 3.0, 2.0):
            rewards = torch.tensor([[r]])
            log_g = fk.log_potential(name, rewards, history, 0.5)
            history = fk.update_history(history, rewards, log_g)
            total = total + log_g
        total = total + fk.final_log_potential(torch.tensor([[2.5]]), history, 0.5)
        torch.testing.assert_close(total, torch.tensor([[1.25]]))
    # and the max history itself: running max after (1, 3, 2) is 3, sum 6, prev 2;
    # log_prod for "max" = 0.5·(1 + 3 + 3) = 3.5, so the final correction is 1.25 − 3.5 = −2.25
    history = fk.init_history((1, 1))
    for r in (1.0, 3.0, 2.0):
        rewards = torch.tensor([[r]])
        history = fk.update_history(history, rewards, fk.log_potential("max", rewards, history, 0.5))
    assert history.running_max.item() == 3.0 and history.running_sum.item() == 6.0 and history.prev.item() == 2.0
    assert history.log_prod.item() == 3.5
    assert fk.final_log_potential(torch.tensor([[2.5]]), history, 0.5).item() == -2.25


# ---------------------------------------------------------------------------------------------- ESS


def test_effective_sample_size_by_hand():
    # equal weights: ESS = k
    assert fk.effective_sample_size(torch.zeros(1, 4)).item() == pytest.approx(4.0)
    # ŵ = (0.5, 0.25, 0.25): Σŵ² = 0.25 + 0.0625 + 0.0625 = 0.375, ESS = 8/3
    log_w = torch.log(torch.tensor([[2.0, 1.0, 1.0]]))
    assert fk.effective_sample_size(log_w).item() == pytest.approx(8 / 3)
    # one particle with (numerically) all the weight: ESS = 1; log-space input must not overflow
    assert fk.effective_sample_size(torch.tensor([[1000.0, 0.0, 0.0]])).item() == pytest.approx(1.0)
    # per group
    both = fk.effective_sample_size(torch.cat([torch.zeros(1, 3), log_w]))
    torch.testing.assert_close(both, torch.tensor([3.0, 8 / 3]))


# ---------------------------------------------------------------------------------------------- resampling


def test_systematic_resampling_by_hand():
    # ŵ = (0.1, 0.2, 0.3, 0.4), cumulative (0.1, 0.3, 0.6, 1.0); u = 0.5 -> positions (0.125, 0.375, 0.625, 0.875)
    # fall in intervals 1, 2, 3, 3.
    log_w = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert fk.systematic_indices(log_w, torch.tensor([0.5])).tolist() == [[1, 2, 3, 3]]
    # u = 0 -> positions (0, 0.25, 0.5, 0.75) -> intervals 0, 1, 2, 3
    assert fk.systematic_indices(log_w, torch.tensor([0.0])).tolist() == [[0, 1, 2, 3]]
    # u just below 1: positions (0.2499, 0.4999, 0.7499, 0.9999) -> 1, 2, 3, 3
    assert fk.systematic_indices(log_w, torch.tensor([0.9996])).tolist() == [[1, 2, 3, 3]]


def test_systematic_copies_are_floor_or_ceil_of_k_w():
    generator = torch.Generator().manual_seed(0)
    w = torch.tensor([0.05, 0.45, 0.3, 0.2])  # k·ŵ = (0.2, 1.8, 1.2, 0.8)
    for _ in range(50):
        idx = fk.resample_indices(torch.log(w)[None], "systematic", generator)[0]
        counts = torch.bincount(idx, minlength=4)
        assert torch.all(counts >= torch.floor(4 * w)) and torch.all(counts <= torch.ceil(4 * w))


def test_multinomial_resampling_frequencies():
    generator = torch.Generator().manual_seed(0)
    w = torch.tensor([0.1, 0.6, 0.3])
    idx = fk.resample_indices(torch.log(w).expand(4000, 3), "multinomial", generator)
    freq = torch.bincount(idx.reshape(-1), minlength=3).double() / idx.numel()
    # 12 000 draws: standard error ≤ √(0.25/12000) ≈ 0.0046; 0.02 is > 4 standard errors
    torch.testing.assert_close(freq, w.double(), atol=0.02, rtol=0)


def test_adaptive_resampling_decision_per_group():
    # group 0: equal weights, ESS 3 ≥ 0.5·3 -> kept; group 1: ŵ ≈ (1, 0, 0), ESS ≈ 1 < 1.5 -> resampled to all copies
    # of particle 0 with weights reset to equal and the history gathered along.
    log_w = torch.tensor([[0.0, 0.0, 0.0], [0.0, -50.0, -50.0]])
    history = fk.FKHistory(*(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]) + i for i in range(4)))
    indices, new_log_w, new_history, resampled = fk.resample_step(
        log_w, history, method="systematic", adaptive=True, ess_threshold=0.5, generator=torch.Generator()
    )
    assert resampled.tolist() == [False, True]
    assert indices.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert new_log_w.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert new_history.prev.tolist() == [[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]
    assert new_history.log_prod.tolist() == [[4.0, 5.0, 6.0], [7.0, 7.0, 7.0]]


class ScriptedReward:
    """Returns the scores of `script` in order, one `[k]` row per call, whatever the samples: the rewards FK sees
    at each scheduled step are then known by hand."""

    name, differentiable, higher_is_better = "scripted", False, True

    def __init__(self, script):
        self.script = list(script)

    def __call__(self, samples, prompts, metadata=None):
        scores = torch.tensor(self.script.pop(0), dtype=samples.dtype)
        assert scores.shape == (len(samples),)
        return SimpleNamespace(scores=scores, info={})


def test_weights_accumulate_across_steps_without_resampling(monkeypatch):
    # fk_steer on the toy, one prompt, k = 2 particles, 5 steps, scheduled at steps 1 and 3 (start 1, interval 2).
    # With k = 2 and ess_threshold 0.5 it resamples only when ESS < 1, which never happens (ESS ≥ 1), so the weights
    # at step 3 must be the product of both potentials (the public reference code keeps only the current one).
    # Max potential, λ = 1; rewards r1 = (1, 0) at step 1, r2 = (0, 0.5) at step 3, r0 = (0.2, 0.4) at the end:
    #   step 1: log G1 = λ·r1 = (1, 0)                               log w = (1, 0)
    #   step 3: log G3 = λ·max(r2, max(r1)) = (max(0, 1), max(0.5, 0)) = (1, 0.5)
    #           log w = log G1 + log G3 = (2, 0.5)                   (the current potential alone: (1, 0.5))
    #   end:    log w + λ·r0 − (log G1 + log G3) = λ·r0 = (0.2, 0.4) (current only: (1, 0.5) + r0 − (2, 0.5))
    from steer_toy import GMMProcess, default_gmm

    from diffrl.steering.core import SteerContext

    seen = []

    def recording_resample_step(log_weights, history, **kwargs):
        seen.append(log_weights.clone())
        return resample_step(log_weights, history, **kwargs)

    resample_step = fk.resample_step
    monkeypatch.setattr(fk, "resample_step", recording_resample_step)
    reward = ScriptedReward([(1.0, 0.0), (0.0, 0.5), (0.2, 0.4)])
    ctx = SteerContext(GMMProcess(default_gmm(), num_steps=5), reward, ["toy"])
    cfg = fk.FKConfig(num_particles=2, lmbda=1.0, potential="max", start=1, interval=2, ess_threshold=0.5)
    out = fk.fk_steer(ctx, cfg, torch.Generator().manual_seed(0), keep_particles=True)

    assert reward.script == []  # two scheduled scores and the final one
    assert out.info["scheduled_steps"] == [1, 3] and out.info["resample_steps"] == [(1, 0), (3, 0)]
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(seen[1], torch.tensor([[2.0, 0.5]]))

    def two_particle_ess(log_w1, log_w2):  # ŵ1 = 1 / (1 + e^(log w2 − log w1)), ESS = 1 / (ŵ1² + ŵ2²)
        w1 = 1.0 / (1.0 + math.exp(log_w2 - log_w1))
        return 1.0 / (w1**2 + (1.0 - w1) ** 2)

    # ESS 1.648 and 1.425 (only the current potential at step 3 would give 1.887)
    assert out.info["ess"] == pytest.approx([two_particle_ess(1.0, 0.0), two_particle_ess(2.0, 0.5)], rel=1e-6)
    # final weights softmax(0.2, 0.4) = (1, e^0.2) / (1 + e^0.2)
    w1 = 1.0 / (1.0 + math.exp(0.2))
    torch.testing.assert_close(out.info["final_weights"], torch.tensor([[w1, 1.0 - w1]]))
    assert out.scores.tolist() == [pytest.approx(0.4)]  # "best": the higher final reward


def test_non_adaptive_resamples_every_scheduled_step():
    generator = torch.Generator().manual_seed(0)
    _, log_w, _, resampled = fk.resample_step(
        torch.zeros(2, 4), fk.init_history((2, 4)), method="multinomial", adaptive=False, ess_threshold=0.5,
        generator=generator,
    )
    assert resampled.all() and log_w.abs().sum() == 0


def test_gather_rows_keeps_particles_in_their_group():
    rows = torch.arange(6.0)  # two groups of three: (0, 1, 2), (3, 4, 5)
    indices = torch.tensor([[2, 2, 0], [1, 0, 1]])
    assert gather_rows(rows, indices).tolist() == [2.0, 2.0, 0.0, 4.0, 3.0, 4.0]


def test_scheduled_steps():
    # 50 steps, start 10, every 10, no end: 10, 20, 30, 40 (48 is the last allowed: the final step is never scheduled)
    assert fk.scheduled_steps(50, 10, None, 10) == [10, 20, 30, 40]
    assert fk.scheduled_steps(100, 20, 80, 20) == [20, 40, 60, 80]
    assert fk.scheduled_steps(10, 0, None, 3) == [0, 3, 6]
    assert fk.scheduled_steps(5, 0, 100, 1) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- selection


def test_best_of_n_and_per_prompt_selection():
    objective = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 2.0]])
    assert best_of_n_indices(objective).tolist() == [1, 0]  # first of equal maxima
    assert select_per_prompt(objective.reshape(-1), 2).tolist() == [1, 3]


def test_svdd_select_argmax_and_softmax():
    values = torch.tensor([[0.0, 1.0, 0.5], [3.0, 2.0, 1.0]])
    assert svdd_select(values, 0.0).tolist() == [1, 0]
    # α = 1 on values (0, ln 2, ln 3): probabilities ∝ (1, 2, 3) = (1/6, 1/3, 1/2)
    generator = torch.Generator().manual_seed(0)
    v = torch.log(torch.tensor([1.0, 2.0, 3.0])).expand(6000, 3)
    picks = svdd_select(v, 1.0, generator)
    freq = torch.bincount(picks, minlength=3).double() / len(picks)
    torch.testing.assert_close(freq, torch.tensor([1 / 6, 1 / 3, 1 / 2], dtype=torch.float64), atol=0.02, rtol=0)
    # α = 0.5 doubles the values: ∝ (1, 4, 9) = (1/14, 4/14, 9/14)
    picks = svdd_select(v, 0.5, generator)
    freq = torch.bincount(picks, minlength=3).double() / len(picks)
    torch.testing.assert_close(freq, torch.tensor([1, 4, 9], dtype=torch.float64) / 14, atol=0.02, rtol=0)


# ---------------------------------------------------------------------------------------------- guidance, ReNO


def test_guided_noise_by_hand():
    # ε̃ = ε − γ·√(1−ᾱ)·g with ε = 1, g = 2, γ = 0.5, ᾱ = 0.75: 1 − 0.5·0.5·2 = 0.5
    assert guided_noise(torch.ones(1), torch.full((1,), 2.0), 0.75, 0.5).item() == pytest.approx(0.5)


def test_norm_prior_by_hand():
    # ε = (3, 4): ‖ε‖ = 5, d = 2: ½·25 − 1·log 5
    nll = norm_prior_nll(torch.tensor([[3.0, 4.0]]))
    assert nll.item() == pytest.approx(12.5 - math.log(5.0), rel=1e-6)
    # minimum at ‖ε‖ = √(d − 1): gradient zero there (d = 5, ‖ε‖ = 2)
    eps = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    norm_prior_nll(eps).sum().backward()
    assert eps.grad.abs().max().item() < 1e-6


def test_clip_grad_norm_per_sample_by_hand():
    grad = torch.tensor([[3.0, 4.0], [0.03, 0.04]])  # norms 5 and 0.05
    clipped = clip_grad_norm_per_sample(grad, 0.1)
    torch.testing.assert_close(clipped, torch.tensor([[0.06, 0.08], [0.03, 0.04]]))
    assert clip_grad_norm_per_sample(grad, 0.0) is grad


def test_update_best_keeps_per_sample_maximum():
    best_obj, best = update_best(None, None, torch.tensor([1.0, 5.0]), torch.tensor([[1.0], [5.0]]))
    best_obj, best = update_best(best_obj, best, torch.tensor([2.0, 4.0]), torch.tensor([[2.0], [4.0]]))
    assert best_obj.tolist() == [2.0, 5.0] and best.tolist() == [[2.0], [5.0]]
    best_obj, best = update_best(best_obj, best, torch.tensor([2.0, 4.0]), torch.tensor([[9.0], [9.0]]))
    assert best.tolist() == [[2.0], [5.0]]  # ties keep the earlier sample


def test_reno_first_update_is_one_clipped_nesterov_step():
    # ReNO on the toy's one-step generator G(ε) = x̂0(ε) (DDIM from t = 999 to ᾱ = 1), reward a·x, 3 prompts.
    # Worked by hand: loss(ε) = −Σ a·G(ε_i) + λ_reg Σ (½‖ε_i‖² − (d − 1) log‖ε_i‖), d = 2; each row's gradient
    # clipped to norm c; SGD with Nesterov momentum μ takes (1 + μ)·lr·g as its first step (buffer = g, update
    # g + μ·buffer). The second evaluation must score G(ε0 − (1 + μ)·lr·g).
    from steer_toy import DTYPE, GMMProcess, LinearReward, default_gmm

    from diffrl.steering import steer_process

    a = torch.tensor([1.0, 0.5], dtype=DTYPE)
    lr, mu, clip, reg = 5.0, 0.9, 0.01, 0.01  # the paper's lr and μ; gradient norms here are 0.015–0.04
    process = GMMProcess(default_gmm(), num_steps=1)

    def generate(eps):
        return process.step(process.predict(eps, 0, None), 0, eps).prev_sample

    eps0 = torch.randn(3, 2, generator=torch.Generator().manual_seed(0), dtype=DTYPE).requires_grad_(True)
    norm = eps0.norm(dim=1)
    loss = -(generate(eps0) @ a).sum() + reg * (0.5 * norm**2 - 1.0 * torch.log(norm)).sum()
    (g,) = torch.autograd.grad(loss, eps0)
    g_norm = g.norm(dim=1, keepdim=True)
    assert (g_norm > clip).all()  # the clip is active on every row, so the test sees it
    eps1 = eps0.detach() - (1 + mu) * lr * g * clip / g_norm
    expected = [float((generate(eps0.detach()) @ a).mean()), float((generate(eps1) @ a).mean())]

    out = steer_process(process, ["toy"] * 3, LinearReward(a), "reno", generator=torch.Generator().manual_seed(0),
                        iterations=2, lr=lr, momentum=mu, grad_clip=clip, reg_weight=reg)
    assert out.info["objective_per_iteration"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # plain momentum (no Nesterov) would have moved by lr·g only: a different second objective
    plain = float((generate(eps0.detach() - lr * g * clip / g_norm) @ a).mean())
    assert abs(plain - expected[1]) > 1e-4
