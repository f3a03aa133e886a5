"""DPOK's log-probs, loss, KL and value MSE against the reference (github.com/google-research/google-research, dpok/).

`data/dpok_reference.json` holds only numbers, with the commit and the file each came from (its `source` entry):
`scheduling_ddim_extended.py` at 10270a5 (`step_logprob`, the rollout's x_{t−1} and log-prob; `step_forward_logprob`,
training's), `pipeline_stable_diffusion_extended.py` at 4c42994 (`forward_calculate_logprob`: the guided ε of the
policy and of the pre-trained copy, the KL regulariser (ε_θ − ε_ref)²) and `train_online_pg.py` at 1d49f2c
(`_train_policy_func`: A = r − V, the ratio clamped to 1 ± 1e-4, loss = mean(−α·A·ρ) + β·mean((ε_θ − ε_ref)²), and
`_train_value_func`'s MSE), run once on a CPU stub pipeline with fixed-seed inputs (stored too): 2 samples at steps 3
and 40 of a 50-step SD 1.x DDIM schedule, one ratio inside the clamp and one outside.

Checked: `ddim_step` gives the reference's rollout and training log-probs; `baseline_advantages` its A; `value_loss`
(all rewards finite) its value MSE and gradient; and through the documented KL conversion (`dpok.py`'s "differences
from the reference code", `training/reference.py:gaussian_kl`) its KL and loss: the DDIM mean is affine in ε̂,
μ = a_t·x_t + c_t·ε̂ with c_t = √(1 − ᾱ_{t−1} − σ_t²) − √ᾱ_{t−1}·√(1 − ᾱ_t)/√ᾱ_t, so
    mean((ε_θ − ε_ref)²) = gaussian_kl(μ_θ, μ_ref, σ_t) · 2σ_t²/c_t²
per sample (the factor is 8.4 at step 3 and 10.0 at step 40 here: the reference's KL term is that many times the exact
Gaussian KL), and `dpok_loss` fed that converted KL gives the
reference's loss and its gradient w.r.t. the policy's guided ε. With diffrl's own (exact) KL the KL term differs by
that per-step factor, as documented. Not compared: the value network itself (diffrl's `ValueNet` is its own design) and
the replay buffer (documented).

Tolerances (float64 inputs): log-probs `LP_ATOL` 1e-6 absolute (the reference takes σ_t = √variance and the direction
√(1 − ᾱ_{t−1} − σ_t²) in float64 from float32 ᾱ, diffrl in float32: measured 3.5e-8); the converted KL `KL_RTOL` 1e-6
relative (float64 on both sides, but diffrl's Δε comes back through μ_θ − μ_ref, a difference of means of size 1 that
are 0.05·c_t apart: measured 1.3e-8); the loss `LOSS_RTOL` 1e-6 relative and its gradient `LOSS_RTOL` plus `GRAD_ATOL`
1e-7 absolute on entries up to 0.12 (the reference casts A and the ratio to float32: measured 5.9e-8 relative and
2.7e-8 absolute); the value loss and its gradient 1e-6 relative (float32 in the reference: measured 2.3e-7 and 3.6e-7).
"""

import json
from pathlib import Path

import pytest
import torch

from diffrl.trainers.dpok import baseline_advantages, dpok_loss, value_loss
from diffrl.training.reference import gaussian_kl
from samplers.ddim import ddim_constants, ddim_step

GOLDEN = json.loads((Path(__file__).parent / "data" / "dpok_reference.json").read_text())
SHAPE = (2, 4, 4, 4)
LP_ATOL, KL_RTOL, LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-6, 1e-6, 1e-7


def tensor(key) -> torch.Tensor:
    return torch.tensor(GOLDEN[key], dtype=torch.float64).reshape(SHAPE)


def input32(key) -> torch.Tensor:
    """An input drawn in float32 (stored with 9 digits), used as float64."""
    return torch.tensor(GOLDEN[key], dtype=torch.float32).reshape(SHAPE).double()


def close(actual, expected, rtol=0.0, atol=0.0) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.detach().double(), expected, rtol=rtol, atol=atol)


X, NEXT = input32("x"), tensor("next_latents")
CONSTANTS = [ddim_constants(a, a_prev, 1.0) for a, a_prev in zip(GOLDEN["alpha_prod_t"], GOLDEN["alpha_prod_t_prev"])]


def steps(eps: torch.Tensor):
    """Each sample's DDIM step at its own timestep, scoring the rollout's x_{t−1}: (log_probs [B], means [B, ...])."""
    out = [ddim_step(eps[i:i + 1], X[i:i + 1], c, prev_sample=NEXT[i:i + 1]) for i, c in enumerate(CONSTANTS)]
    return torch.cat([s.log_prob for s in out]), torch.cat([s.mean for s in out])


def kl_factor(c) -> float:
    """2σ_t²/c_t², c_t the weight of ε̂ in the DDIM mean: mean((ε_θ − ε_ref)²) = this · gaussian_kl(μ_θ, μ_ref, σ_t)."""
    c_t = c.direction - c.sqrt_alpha_prev * c.sqrt_beta / c.sqrt_alpha
    return 2 * c.std**2 / c_t**2


def test_the_log_probs_are_step_logprob_and_step_forward_logprobs():
    old_log_probs, _ = steps(input32("eps_old"))
    close(old_log_probs, GOLDEN["old_log_probs"], atol=LP_ATOL)
    log_probs, _ = steps(tensor("eps"))
    close(log_probs, GOLDEN["log_probs"], atol=LP_ATOL)


def test_the_exact_kl_is_the_reference_kl_over_the_documented_factor():
    _, means = steps(tensor("eps"))
    _, means_ref = steps(tensor("eps_ref"))
    kl = torch.cat([gaussian_kl(means[i:i + 1], means_ref[i:i + 1], c.std) for i, c in enumerate(CONSTANTS)])
    factors = torch.tensor([kl_factor(c) for c in CONSTANTS], dtype=torch.float64)
    close(kl * factors, GOLDEN["kl_regularizer_per_sample"], rtol=KL_RTOL)
    assert float((kl * factors).mean()) == pytest.approx(GOLDEN["kl_regularizer_mean"], rel=KL_RTOL)
    # the module docstring's numbers: at steps 40 and 3 of 50 the reference's KL is 10.0× and 8.4× the exact one
    assert GOLDEN["ts"] == [40, 3] and factors.tolist() == pytest.approx([10.0, 8.4], abs=0.05)


def test_the_loss_and_its_gradient_are_train_policy_funcs_with_the_kl_converted():
    eps = tensor("eps").requires_grad_(True)
    log_probs, means = steps(eps)
    _, means_ref = steps(tensor("eps_ref"))
    old_log_probs, _ = steps(input32("eps_old"))  # diffrl's own rollout log-probs, as in training
    kl = torch.cat([gaussian_kl(means[i:i + 1], means_ref[i:i + 1], c.std) * kl_factor(c)
                    for i, c in enumerate(CONSTANTS)])
    advantages = baseline_advantages(torch.tensor(GOLDEN["rewards"], dtype=torch.float64),
                                     torch.tensor(GOLDEN["values"], dtype=torch.float64), clip_max=0.0)
    close(advantages, GOLDEN["advantages"], rtol=1e-12)
    loss, stats = dpok_loss(log_probs, old_log_probs, advantages, kl, reward_weight=GOLDEN["reward_weight"],
                            kl_weight=GOLDEN["kl_weight"], clip_range=GOLDEN["ratio_clip"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(GOLDEN["loss"], rel=LOSS_RTOL)
    assert float(stats["clipfrac"]) == 0.5  # one ratio outside 1 ± 1e-4: its reward term has no gradient
    close(eps.grad, GOLDEN["grad_eps"], rtol=LOSS_RTOL, atol=GRAD_ATOL)


def test_the_value_loss_is_train_value_funcs_mse():
    ref = GOLDEN["value"]
    values = torch.tensor(ref["values"], dtype=torch.float64, requires_grad=True)
    loss = value_loss(values, torch.tensor(ref["rewards"], dtype=torch.float64), torch.ones(2, dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(ref["loss"], rel=1e-6)
    close(values.grad, ref["grad_values"], rtol=1e-6)
