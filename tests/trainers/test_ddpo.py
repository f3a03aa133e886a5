"""Golden tests of DDPO's pure math (diffrl/trainers/ddpo.py); every expected number is worked out by hand in the comments."""

import math

import pytest
import torch

from diffrl.trainers.ddpo import ddpo_loss


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


def test_ddpo_loss_clips_the_pessimistic_side_below_one_minus_epsilon():
    # log ρ = -0.5 -> ρ = 0.6065307 < 1 - ε = 0.8.
    # Â = -2 (the update wants ρ smaller): max(2·0.6065307 = 1.2130613, 2·0.8 = 1.6) = 1.6: clipped, no gradient —
    #   without the lower bound the loss would be 1.2130613 and keep pushing ρ down.
    # Â = +2: max(-1.2130613, -1.6) = -1.2130613: unclipped, gradient -Â·ρ/2 = -0.6065307.
    lp = torch.tensor([-0.5, -0.5], requires_grad=True)
    loss, stats = ddpo_loss(lp, torch.zeros(2), torch.tensor([-2.0, 2.0]), clip_range=0.2)
    assert loss.item() == pytest.approx((1.6 - 2 * math.exp(-0.5)) / 2, rel=1e-6)
    loss.backward()
    assert lp.grad[0].item() == 0.0
    assert lp.grad[1].item() == pytest.approx(-math.exp(-0.5), rel=1e-6)
    assert stats["clipfrac"].item() == 1.0
