"""Golden tests of DPOK's pure math (diffrl/trainers/dpok.py); every expected number is worked out by hand in the comments."""


import pytest
import torch

from diffrl.trainers.dpok import baseline_advantages, dpok_loss, value_loss


def test_dpok_loss_by_hand():
    # ρ = 1; A = [2, -1]; KL = [0.18, 0.5]; α = 10, β = 0.01:
    # sample 0: -10·2·1 + 0.01·0.18 = -19.9982; sample 1: -10·(-1)·1 + 0.005 = 10.005; mean = -4.9966.
    lp = torch.zeros(2)
    loss, stats = dpok_loss(
        lp, lp.clone(), torch.tensor([2.0, -1.0]), torch.tensor([0.18, 0.5]),
        reward_weight=10.0, kl_weight=0.01, clip_range=1e-4,
    )
    assert loss.item() == pytest.approx(-4.9966, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(0.34)
    assert stats["policy_loss"].item() == pytest.approx(-5.0)


def test_dpok_ratio_clamp_stops_the_reward_gradient_not_the_kl_gradient():
    # log ρ = 0.1 > log(1 + 1e-4): clamped to 1.0001, so d loss / d log_probs = 0; the KL term keeps its gradient.
    lp = torch.tensor([0.1], requires_grad=True)
    kl_source = torch.tensor([0.5], requires_grad=True)
    loss, stats = dpok_loss(
        lp, torch.zeros(1), torch.tensor([3.0]), kl_source**2, reward_weight=1.0, kl_weight=0.1, clip_range=1e-4
    )
    assert loss.item() == pytest.approx(-3.0 * 1.0001 + 0.1 * 0.25, rel=1e-6)
    loss.backward()
    assert lp.grad.item() == 0.0
    assert kl_source.grad.item() == pytest.approx(0.1 * 2 * 0.5)
    assert stats["clipfrac"].item() == 1.0


def test_dpok_loss_gradient_inside_clip():
    # ε = 0.5, log ρ = 0 -> ρ = 1 inside the clamp: d/dlp (-α A ρ) = -α A ρ = -2·3·1 = -6.
    lp = torch.tensor([0.0], requires_grad=True)
    loss, _ = dpok_loss(lp, torch.zeros(1), torch.tensor([3.0]), torch.zeros(1),
                        reward_weight=2.0, kl_weight=0.0, clip_range=0.5)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-6.0)


def test_value_loss_is_the_mse_over_samples_with_a_finite_reward():
    # valid samples 0 and 2: ((1 - 0)² + (2 - 4)²) / 2 = 2.5; sample 1's return (NaN) is never read, and its value
    # gets no gradient; d/dV_0 = 2·(1 - 0)/2 = 1, d/dV_2 = 2·(2 - 4)/2 = -2.
    values = torch.tensor([1.0, 7.0, 2.0], requires_grad=True)
    loss = value_loss(values, torch.tensor([0.0, float("nan"), 4.0]), torch.tensor([True, False, True]))
    assert loss.item() == pytest.approx(2.5)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([1.0, 0.0, -2.0])
    # no valid sample: 0, not NaN (the backward still runs on every process)
    none = value_loss(torch.tensor([1.0]), torch.tensor([float("nan")]), torch.tensor([False]))
    assert none.item() == 0.0


def test_advantage_is_the_return_minus_the_value_then_clipped():
    returns, values = torch.tensor([3.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.25])
    # A = r - V = [2, -2, 0.25]; clipped to ±1.5: [1.5, -1.5, 0.25]; no baseline: the returns themselves
    assert baseline_advantages(returns, values, 0.0).tolist() == [2.0, -2.0, 0.25]
    assert baseline_advantages(returns, values, 1.5).tolist() == [1.5, -1.5, 0.25]
    assert baseline_advantages(returns, None, 0.0).tolist() == [3.0, -1.0, 0.5]
