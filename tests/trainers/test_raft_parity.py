"""RAFT's selection and fine-tuning loss against numbers computed by the reference code (github.com/OptimalScale/LMFlow,
`experimental/RAFT-diffusion`).

`data/raft_reference.json` holds only numbers, with the commit and lines they came from (its `source` entry), at
f3597db: the training step of `train_text_to_image_lora.py` (add_noise, the ε or v target, `F.mse_loss(...,
reduction="mean")`) run on fixed float64 inputs `[2, 4, 4, 4]` and backpropagated to the model output; and the
notebook `SD256-RAFT.ipynb`'s selection — `get_max_score` (each prompt's best sample, the first on a tie) and the
global cut (the best `topk` = 8 of the 10 prompt winners, sorted stably) — on a 10 × 10 table of scores with ties.

Checked: `add_noise` and `denoising_target` give the reference's noisy latents and v target; `raft_loss` its loss and
gradient; `select_kept(mode="per_prompt")` its per-prompt winners (ties to the lower index, as `list.index` does);
and the notebook's two-stage rule is `select_kept(per_prompt)` followed by `select_kept(global, keep_fraction=0.8)` on
the winners. That second cut is not a setting of diffrl's RAFT (raft.py's docstring, "Differences from the reference
code"): a recipe keeps each prompt's best (`selection: per_prompt`) or a global fraction, not both.

Tolerances: noisy latents and v target `RTOL` 1e-12 (float64 on both sides; measured bit-identical); loss and gradient
1e-6: both compute the MSE in float32 (`.float()`), in a different summation order (measured: ε loss and gradient
bit-identical, the v loss 6e-8).
"""

import json
from pathlib import Path

import pytest
import torch

from diffrl.models.unet import add_noise, denoising_target
from diffrl.trainers.raft import raft_loss, select_kept

GOLDEN = json.loads((Path(__file__).parent / "data" / "raft_reference.json").read_text())
SHAPE = tuple(GOLDEN["shape"])
RTOL, LOSS_RTOL = 1e-12, 1e-6


def tensor(name: str) -> torch.Tensor:
    return torch.tensor(GOLDEN[name], dtype=torch.float64).reshape(SHAPE)


def alpha_bar() -> torch.Tensor:
    """ᾱ_t of SD 1.x's scaled-linear schedule in float32 (as diffusers' `DDPMScheduler` holds it) at the timesteps."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    return torch.cumprod(1 - betas, dim=0)[torch.tensor(GOLDEN["timesteps"])]


def test_noising_and_targets_are_the_references():
    x0, noise = tensor("x0"), tensor("noise")
    torch.testing.assert_close(add_noise(x0, noise, alpha_bar()), tensor("noisy_latents"), rtol=RTOL, atol=1e-15)
    torch.testing.assert_close(denoising_target(x0, noise, alpha_bar(), "epsilon"), noise, rtol=0, atol=0)
    torch.testing.assert_close(denoising_target(x0, noise, alpha_bar(), "v_prediction"), tensor("target_v"),
                               rtol=RTOL, atol=1e-15)


@pytest.mark.parametrize("prediction_type,loss_key", [("epsilon", "loss"), ("v_prediction", "loss_v")])
def test_the_loss_is_the_references(prediction_type, loss_key):
    pred = tensor("model_pred").requires_grad_()
    loss, stats = raft_loss(pred, denoising_target(tensor("x0"), tensor("noise"), alpha_bar(), prediction_type))
    assert loss.item() == pytest.approx(GOLDEN[loss_key], rel=LOSS_RTOL)
    assert float(stats["denoise_mse"]) == pytest.approx(GOLDEN[loss_key], rel=LOSS_RTOL)
    if prediction_type == "epsilon":
        loss.backward()  # 2 (pred − ε) / numel, the gradient of a mean over all elements
        torch.testing.assert_close(pred.grad, tensor("grad_model_pred"), rtol=LOSS_RTOL, atol=1e-12)


def test_selection_is_the_notebooks_per_prompt_best_then_its_global_cut():
    sel = GOLDEN["selection"]
    scores = torch.tensor(sel["scores"], dtype=torch.float64)  # [prompts, samples]
    prompts, k = scores.shape
    groups = torch.arange(prompts).repeat_interleave(k)
    winners = select_kept(scores.reshape(-1), groups, mode="per_prompt", keep_per_prompt=1)
    assert [int(i) % k for i in winners] == sel["per_prompt_best"]  # ties: the lower index, as list.index
    assert sel["per_prompt_best"][3] == 2  # prompt 3's best is tied between samples 2 and 7
    # the notebook's second stage: the best topk of the winners (a tie between prompts 3 and 5 kept in prompt order)
    best = select_kept(scores.reshape(-1)[winners], torch.zeros(len(winners)), mode="global",
                       keep_fraction=sel["topk"] / prompts)
    kept = {(int(winners[i]) // k, int(winners[i]) % k) for i in best}
    assert kept == {tuple(pair) for pair in sel["kept"]} and len(kept) == sel["topk"]
