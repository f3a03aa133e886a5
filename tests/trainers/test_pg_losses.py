"""Golden tests of the pure trainer math; every expected number is worked out by hand in the comments."""

import math

import pytest
import torch

from diffrl.trainers.ddpo import ddpo_loss
from diffrl.trainers.dpok import dpok_loss, gaussian_kl, value_loss

# ------------------------------------------------------------------------------------------------ DDPO


def test_ddpo_loss_ratio_one_negative_advantage():
    # ρ = 1, Â = -1, ε = 1e-4: max(-(-1)·1, -(-1)·1) = 1.
    lp = torch.tensor([-0.7])
    loss, stats = ddpo_loss(lp, lp.clone(), torch.tensor([-1.0]), clip_range=1e-4)
    assert loss.item() == pytest.approx(1.0, abs=0)
    assert stats["approx_kl"].item() == 0.0
    assert stats["clipfrac"].item() == 0.0
    assert stats["ratio"].item() == 1.0


def test_ddpo_loss_inside_clip_range_is_the_plain_surrogate():
    # log ρ = 0.1 -> ρ = e^0.1 = 1.1051709; Â = 1, ε = 0.2: both terms -1.1051709.
    loss, _ = ddpo_loss(torch.tensor([0.1]), torch.tensor([0.0]), torch.tensor([1.0]), clip_range=0.2)
    assert loss.item() == pytest.approx(-math.exp(0.1), rel=1e-6)


def test_ddpo_loss_clips_only_the_optimistic_side():
    # log ρ = 0.5 -> ρ = 1.6487213, ε = 0.2.
    # Â = +2: max(-3.2974425, -2·1.2 = -2.4) = -2.4 (clipped, no gradient)
    # Â = -2: max(+3.2974425, +2.4) = 3.2974425 (pessimistic side stays unclipped)
    # mean = (−2.4 + 3.2974425) / 2 = 0.44872127
    lp = torch.tensor([0.5, 0.5], requires_grad=True)
    old = torch.zeros(2)
    loss, stats = ddpo_loss(lp, old, torch.tensor([2.0, -2.0]), clip_range=0.2)
    assert loss.item() == pytest.approx(0.44872127, rel=1e-6)
    assert stats["clipfrac"].item() == 1.0
    assert stats["approx_kl"].item() == pytest.approx(0.125)  # ½·mean(0.25, 0.25)
    loss.backward()
    # d/dlp of mean: sample 0 clipped -> 0; sample 1: -Â·ρ / 2 = 2·1.6487213 / 2 = 1.6487213
    assert lp.grad[0].item() == 0.0
    assert lp.grad[1].item() == pytest.approx(math.exp(0.5), rel=1e-6)


def test_ddpo_loss_approx_kl_and_clipfrac_mixed():
    # log ρ = [0.5, 0]: approx_kl = ½·(0.25 + 0)/2 = 0.0625; one of two outside ε = 1e-4.
    _, stats = ddpo_loss(torch.tensor([0.5, 0.0]), torch.zeros(2), torch.ones(2), clip_range=1e-4)
    assert stats["approx_kl"].item() == pytest.approx(0.0625)
    assert stats["clipfrac"].item() == 0.5


# ------------------------------------------------------------------------------------------------ DPOK


def test_gaussian_kl_constant_mean_difference():
    # Every dim differs by 0.3 with σ = 0.5: 0.09 / (2·0.25) = 0.18 per dim, mean over dims = 0.18.
    mean = torch.full((2, 4, 2, 2), 0.3)
    kl = gaussian_kl(mean, torch.zeros_like(mean), 0.5)
    assert kl.shape == (2,)
    assert torch.allclose(kl, torch.tensor([0.18, 0.18]), atol=1e-7)


def test_gaussian_kl_single_dim_difference_with_tensor_std():
    # One of 4 dims differs by 1 with σ = 1: (1/2 + 0 + 0 + 0) / 4 = 0.125; sample 2 with σ = 2: 1/8/4 = 0.03125.
    mean = torch.zeros(2, 4)
    mean[:, 0] = 1.0
    std = torch.tensor([1.0, 2.0]).view(2, 1)
    kl = gaussian_kl(mean, torch.zeros_like(mean), std)
    assert torch.allclose(kl, torch.tensor([0.125, 0.03125]))


def test_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean, mean_ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    std = 0.37
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std)
    ).mean(dim=1)
    assert torch.allclose(gaussian_kl(mean, mean_ref, std), expected, atol=1e-6)


def test_gaussian_kl_is_the_reference_eps_penalty_times_a_step_factor():
    # μ = a·x_t + c·ε̂ for a DDIM step, so μ_θ - μ_ref = c (ε_θ - ε_ref): KL = c² / (2σ²) · mean((Δε)²).
    g = torch.Generator().manual_seed(1)
    x, eps, eps_ref = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    a, c, sigma = 0.9, -0.3, 0.2
    kl = gaussian_kl(a * x + c * eps, a * x + c * eps_ref, sigma)
    eps_penalty = ((eps - eps_ref) ** 2).flatten(1).mean(dim=1)
    assert torch.allclose(kl, c**2 / (2 * sigma**2) * eps_penalty, rtol=1e-5)


def test_dpok_loss_by_hand():
    # ρ = 1; A = [2, -1]; KL = [0.18, 0.5]; α = 10, β = 0.01:
    # sample 0: -10·2·1 + 0.01·0.18 = -19.9982; sample 1: -10·(-1)·1 + 0.005 = 10.005; mean = -4.9966.
    lp = torch.zeros(2)
    loss, stats = dpok_loss(
        lp, lp.clone(), torch.tensor([2.0, -1.0]), torch.tensor([0.18, 0.5]),
        reward_weight=10.0, kl_weight=0.01, ratio_clip=1e-4,
    )
    assert loss.item() == pytest.approx(-4.9966, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(0.34)
    assert stats["policy_loss"].item() == pytest.approx(-5.0)


def test_dpok_ratio_clamp_stops_the_reward_gradient_not_the_kl_gradient():
    # log ρ = 0.1 > log(1 + 1e-4): clamped to 1.0001, so d loss / d log_probs = 0; the KL term keeps its gradient.
    lp = torch.tensor([0.1], requires_grad=True)
    kl_source = torch.tensor([0.5], requires_grad=True)
    loss, stats = dpok_loss(
        lp, torch.zeros(1), torch.tensor([3.0]), kl_source**2, reward_weight=1.0, kl_weight=0.1, ratio_clip=1e-4
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
                        reward_weight=2.0, kl_weight=0.0, ratio_clip=0.5)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-6.0)


def test_value_loss():
    # ((1 - 0)² + (2 - 4)²) / 2 = 2.5
    assert value_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])).item() == pytest.approx(2.5)
