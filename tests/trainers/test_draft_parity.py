"""DRaFT-K and DRaFT-LV against closed forms worked out by hand (DRaFT has no official code release to compare with).

Clark et al. 2023 (arXiv 2309.17400) publish no code, so "parity" here is with the paper's algorithms, evaluated by
hand on numbers chosen to be exact in binary where possible (ᾱ = 0.64: √ᾱ = 0.8, √(1 − ᾱ) = 0.6):

- Algorithm 2's re-noising x_t = √ᾱ·x0 + √(1 − ᾱ)·ε and one-step denoise x̂0 = (x_t − √(1 − ᾱ)·ε̂)/√ᾱ (ε) or
  √ᾱ·x_t − √(1 − ᾱ)·v̂ (v), with ε̂ = θ·x_t, θ = 0.5, x0 = 1.5, ε ∈ {−0.5, 1.0}, reward r = −(x̂0 − 1)²:
  ε: x_t = 0.9, 1.8 → x̂0 = 0.7875, 1.575 → L = −mean r = 0.187890625, dL/dθ = mean 2(x̂0 − 1)·(−0.75 x_t)
  = (0.286875 − 1.5525)/2 = −0.6328125; v: x̂0 = 0.5 x_t = 0.45, 0.9 → L = 0.15625, dL/dθ = (0.594 + 0.216)/2 = 0.405.
  The rollout's x0 gets no gradient (it is sampled under stop-gradient).
- DRaFT-1's gradient through one deterministic DDIM step (η = 0) from ᾱ_t = 0.64 to ᾱ_prev = 0.96:
  x_prev = √0.96·(x − 0.6θx)/0.8 + √0.04·θx, so with x = 1, θ = 0.5: x_prev = 0.9797959·0.875 + 0.1 = 0.9573214
  and dx_prev/dθ = −0.6·0.9797959/0.8 + 0.2 = −0.5348469.

Tolerances: 1e-7 relative on the LV numbers: `add_noise` turns a Python-float ᾱ into a float32 tensor before the
float64 arithmetic, so ᾱ = 0.64 enters as 0.63999999 (measured 2.2e-8 on x_t, 1.7e-8 on the gradient; harmless in
training, where ᾱ comes from the float32 `alphas_cumprod` table anyway); 1e-6 on the DDIM step (its scalars are float32
by design, `samplers.base.scalar32`, as diffusers computes them).
"""

import math

import pytest
import torch

from diffrl.models.unet import add_noise
from diffrl.trainers.draft import draft_loss, lv_reward, one_step_denoise
from samplers.ddim import ddim_constants, ddim_step


def test_the_lv_renoising_is_the_forward_process():
    x0, eps = torch.tensor([1.5], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)
    assert add_noise(x0, eps, 0.64).item() == pytest.approx(0.8 * 1.5 + 0.6 * -0.5, rel=1e-7)  # 0.9
    assert one_step_denoise(torch.tensor([0.9], dtype=torch.float64), torch.tensor([0.45], dtype=torch.float64),
                            0.64).item() == pytest.approx((0.9 - 0.6 * 0.45) / 0.8, rel=1e-12)  # 0.7875


@pytest.mark.parametrize("prediction_type,loss,grad", [("epsilon", 0.187890625, -0.6328125),
                                                       ("v_prediction", 0.15625, 0.405)])
def test_lv_loss_and_gradient_are_algorithm_2s(prediction_type, loss, grad):
    theta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    x0 = torch.tensor([[1.5]], dtype=torch.float64, requires_grad=True)  # [B = 1, 1]
    noise = torch.tensor([[[-0.5]], [[1.0]]], dtype=torch.float64)  # [n = 2, B, 1]
    rewards = lv_reward(x0, noise, renoise=lambda x, e: add_noise(x, e, 0.64),
                        denoise=lambda x: one_step_denoise(x, theta * x, 0.64, prediction_type),
                        reward_fn=lambda z: -((z - 1.0) ** 2)[:, 0])
    value, _ = draft_loss(rewards.double())
    value.backward()
    assert value.item() == pytest.approx(loss, rel=1e-7)  # draft_loss averages in float32
    assert theta.grad.item() == pytest.approx(grad, rel=1e-7)
    assert x0.grad is None  # stop-gradient on the rollout's sample


def test_draft_1_gradient_through_one_ddim_step():
    theta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    x = torch.tensor([[1.0]], dtype=torch.float64)
    step = ddim_step(theta * x, x, ddim_constants(0.64, 0.96, 0.0))
    step.prev_sample.sum().backward()
    sqrt_prev = math.sqrt(0.96)
    assert step.prev_sample.item() == pytest.approx(sqrt_prev * 0.875 + 0.1, rel=1e-6)
    assert theta.grad.item() == pytest.approx(-0.6 * sqrt_prev / 0.8 + 0.2, rel=1e-6)
    assert theta.grad.item() == pytest.approx(-0.5348469, abs=1e-6)  # the docstring's number
