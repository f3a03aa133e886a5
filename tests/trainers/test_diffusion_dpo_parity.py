"""Diffusion-DPO's loss against numbers computed by the reference code (github.com/SalesforceAIResearch/DiffusionDPO).

`data/diffusion_dpo_reference.json` holds only numbers, with the commit and lines they came from (its `source`
entry): `train.py` at 5233e75 with `--train_method dpo`, run once in float64 on fixed-seed inputs (stored): the lines
that share t and ε within a pair, `DDPMScheduler.add_noise` (SD 1.x's schedule), and the loss with `beta_dpo` 5000,
backpropagated to the model output. Two pairs `[4, 4, 4, 4]` (rows 0–1 preferred, 2–3 rejected).

Checked: `diffusion_dpo_loss` gives the reference's per-image MSEs, its `inside_term` (−½β((mse_θ^w − mse_ref^w) −
(mse_θ^l − mse_ref^l)): β means `--beta_dpo`, T and the ½ folded in, no further T factor in the code), loss,
implicit accuracy and gradient w.r.t. the model output; `add_noise(x0, ε, alphas_cumprod[t])` gives its noisy
latents; and `dpo_epoch`'s pairing (the first half's t and ε repeated for the second) is the reference's.

Tolerances: the MSEs, inside term and noisy latents `RTOL` 1e-12 (float64 on both sides; the noisy latents measured
bit-identical); the loss `LOSS_RTOL` 1e-6 and the gradient `GRAD_ATOL` 1e-5 (entries up to 2.1): `diffusion_dpo_loss`
computes in float32 (`.float()`) where the reference ran in the inputs' float64, and β = 5000 multiplies the float32
rounding of the MSE differences (measured 3.7e-8 on the loss, 2.4e-6 absolute and 1.0e-6 in norm on the gradient).
"""

import json
from pathlib import Path

import pytest
import torch

from diffrl.models.unet import add_noise
from diffrl.trainers.diffusion_dpo import diffusion_dpo_loss

GOLDEN = json.loads((Path(__file__).parent / "data" / "diffusion_dpo_reference.json").read_text())
SHAPE = tuple(GOLDEN["shape"])
RTOL, LOSS_RTOL, GRAD_ATOL = 1e-12, 1e-6, 1e-5


def tensor(name: str) -> torch.Tensor:
    return torch.tensor(GOLDEN[name], dtype=torch.float64).reshape(SHAPE)


def alphas_cumprod() -> torch.Tensor:
    """ᾱ of SD 1.x's scaled-linear schedule in float32, as the reference's `DDPMScheduler` builds and holds it."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    return torch.cumprod(1 - betas, dim=0)


def test_a_pair_shares_t_and_noise_as_in_the_reference():
    half = SHAPE[0] // 2
    drawn_t = torch.tensor(GOLDEN["timesteps_drawn"])
    drawn_noise = tensor("noise_drawn")
    # dpo_epoch draws one t and one ε per pair and repeats them for the rejected half: the same as the reference
    assert drawn_t[:half].repeat(2).tolist() == GOLDEN["timesteps"]
    torch.testing.assert_close(drawn_noise[:half].repeat(2, 1, 1, 1), tensor("noise"), rtol=0, atol=0)


def test_add_noise_is_the_references():
    alpha_bar = alphas_cumprod()[torch.tensor(GOLDEN["timesteps"])]
    noisy = add_noise(tensor("latents"), tensor("noise"), alpha_bar)
    torch.testing.assert_close(noisy, tensor("noisy_latents"), rtol=RTOL, atol=1e-15)


def test_the_loss_and_its_gradient_are_the_references():
    model_pred = tensor("model_pred").requires_grad_()
    ref_pred, target = tensor("ref_pred"), tensor("noise")
    loss, stats = diffusion_dpo_loss(model_pred, ref_pred, target, GOLDEN["beta_dpo"])
    loss.backward()
    # the per-image MSEs and the inside term, recomputed in float64 as the loss defines them
    model_mse = ((model_pred.detach() - target) ** 2).mean(dim=(1, 2, 3))
    ref_mse = ((ref_pred - target) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(model_mse, torch.tensor(GOLDEN["model_losses"], dtype=torch.float64), rtol=RTOL, atol=0)
    torch.testing.assert_close(ref_mse, torch.tensor(GOLDEN["ref_losses"], dtype=torch.float64), rtol=RTOL, atol=0)
    half = SHAPE[0] // 2
    inside = -0.5 * GOLDEN["beta_dpo"] * ((model_mse[:half] - ref_mse[:half]) - (model_mse[half:] - ref_mse[half:]))
    torch.testing.assert_close(inside, torch.tensor(GOLDEN["inside_term"], dtype=torch.float64), rtol=1e-9, atol=0)
    assert min(GOLDEN["inside_term"]) < 0 < max(GOLDEN["inside_term"])  # both signs: the check has teeth
    # diffrl's loss and statistics
    assert loss.item() == pytest.approx(GOLDEN["loss"], rel=LOSS_RTOL)
    assert float(stats["implicit_acc"]) == GOLDEN["implicit_acc"] == 0.5
    assert float(stats["reward_margin"]) == pytest.approx(sum(GOLDEN["inside_term"]) / half, rel=1e-4)
    grad = tensor("grad_model_pred")
    torch.testing.assert_close(model_pred.grad, grad, rtol=0, atol=GRAD_ATOL)
    assert float((model_pred.grad - grad).norm() / grad.norm()) < 1e-5
