"""Reading a parity test's stored golden numbers as tensors and comparing in float64 (DDPO and RLCM parity tests)."""

import numpy as np
import pytest
import torch

from diffrl.trainers.ddpo import ddpo_loss
from diffrl.training.advantages import clip_advantages

SHAPE = (2, 4, 4, 4)  # the stored step tensors' shape
ATOL = 1e-12  # float64 tensors computed by the same formula: equal to rounding


def tensor(values, shape=SHAPE) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def input32(values, shape=SHAPE) -> torch.Tensor:
    """An input drawn in float32 (stored with 9 digits), used as float64."""
    return torch.tensor(values, dtype=torch.float32).reshape(shape).double()


def close(actual, expected, rtol=0.0, atol=ATOL) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.detach().double(), expected, rtol=rtol, atol=atol)


def check_ppo(ppo: dict, log_prob, old_log_prob, model_output, *, loss_rtol: float, grad_rtol: float) -> None:
    """`ddpo_loss` on the stored advantages (clipped at the stored bound) against the reference's PPO lines: loss,
    approx_kl, clipfrac (3 of the 8 stored ratios outside 1 ± 1e-4) and the gradient w.r.t. the model output
    (`log_prob` must depend on `model_output`, a leaf with `requires_grad`)."""
    advantages = torch.as_tensor(clip_advantages(np.array(ppo["advantages"]), ppo["adv_clip_max"]))
    loss, stats = ddpo_loss(log_prob, old_log_prob, advantages, ppo["clip_range"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(ppo["loss"], rel=loss_rtol)
    assert float(stats["approx_kl"]) == pytest.approx(ppo["approx_kl"], rel=grad_rtol)
    assert float(stats["clipfrac"]) == ppo["clipfrac"] == 0.375
    close(model_output.grad, ppo["grad_model_output"], rtol=grad_rtol, atol=0)
    assert max(abs(a) for a in ppo["advantages"]) > ppo["adv_clip_max"]  # the advantage clip is exercised
