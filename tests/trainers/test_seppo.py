"""SePPO: the loss and the anchor-based adaptive flipper worked by hand, the reference-checkpoint pool (which
checkpoint is kept, which is drawn), the reference update schedule of a run, the winners of a label file and of a
ShapesWorld prompt set, and the settings it refuses."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pg_helpers import (
    PROMPTS,
    SD3_LORA_TARGETS,
    TINY_PAIRS,
    load_cfg,
    tiny_flow_pipeline_dir,
    tiny_pipeline_dir,
    tiny_recipe,
    with_trainer,
)
from PIL import Image
from safetensors.torch import load_file

from diffrl.errors import UserError
from diffrl.pairs.datasets import load_pairs
from diffrl.rundir import latest_checkpoint
from diffrl.shapes.prompts import get_prompt_set
from diffrl.shapes.verifier import verify
from diffrl.shapes.world import render
from diffrl.trainers import get_trainer, seppo
from diffrl.trainers.diffusion_dpo import diffusion_dpo_loss
from diffrl.trainers.seppo import (
    ReferencePool,
    aaf_sign,
    caption_scene,
    choose_reference,
    seppo_loss,
    slot_to_replace,
)
from diffrl.training.metrics import read_metrics


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------ the loss by hand

# One latent dim, target 0, so each row's squared error is its prediction squared. Rows: winners of pairs 0 and 1,
# then their reference samples.
#   pair 0: winner  θ 1 (mse 1), ref 2 (mse 4): the policy fits the anchor better -> s = +1 (a loser)
#           sample  θ 3 (mse 9), ref 1 (mse 1);  Δw = −3, Δref = 8
#           argument −½β(Δw − Δref) = −0.1·(−11) = 1.1          (β = 0.2)
#   pair 1: winner  θ 2 (mse 4), ref 1 (mse 1): the reference fits the anchor better -> s = −1 (a winner too)
#           sample  θ 0.5 (mse 0.25), ref 2 (mse 4);  Δw = 3, Δref = −3.75
#           argument −½β(Δw + Δref) = −0.1·(−0.75) = 0.075
MODEL = torch.tensor([1.0, 2.0, 3.0, 0.5]).reshape(4, 1, 1, 1)
REF = torch.tensor([2.0, 1.0, 1.0, 2.0]).reshape(4, 1, 1, 1)
TARGET = torch.zeros(4, 1, 1, 1)
BETA = 0.2


def test_loss_of_two_pairs_one_of_them_flipped():
    model = MODEL.clone().requires_grad_(True)
    loss, stats = seppo_loss(model, REF, TARGET, BETA)
    # −log σ(a) = log(1 + e^−a): log(1 + e^−1.1) = 0.2873353, log(1 + e^−0.075) = 0.6563500
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1.1)) + math.log1p(math.exp(-0.075))) / 2, abs=1e-6)
    assert loss.item() == pytest.approx((0.2873353 + 0.6563500) / 2, abs=1e-6)
    assert stats["aaf_rate"].item() == 0.5  # pair 1 flipped
    assert stats["implicit_acc"].item() == 1.0  # both arguments > 0
    assert stats["reward_margin"].item() == pytest.approx((1.1 + 0.075) / 2, abs=1e-6)
    assert stats["winner_gain"].item() == pytest.approx(((4 - 1) + (1 - 4)) / 2, abs=1e-12)  # mean mse_ref^w − mse_θ^w
    assert stats["model_mse"].item() == pytest.approx((1 + 4 + 9 + 0.25) / 4)
    assert stats["ref_mse"].item() == pytest.approx((4 + 1 + 1 + 4) / 4)
    loss.backward()
    # d loss / d pred = (1/B)·(−σ(−a))·(d a / d mse)·2·pred, with d a / d mse_θ^w = −½β = −0.1 and
    # d a / d mse_θ^ref = +½β·s = 0.1·s:
    #   winner rows:  ½·σ(−1.1)·0.1·2·1 = 0.1·σ(−1.1);     ½·σ(−0.075)·0.1·2·2 = 0.2·σ(−0.075)
    #   sample rows:  −½·σ(−1.1)·0.1·2·3 = −0.3·σ(−1.1) (s = +1: descent raises its error, a loser);
    #                 +½·σ(−0.075)·0.1·2·0.5 = 0.05·σ(−0.075) (s = −1: descent lowers it, fitted like a winner)
    expected = torch.tensor([0.1 * _sigmoid(-1.1), 0.2 * _sigmoid(-0.075), -0.3 * _sigmoid(-1.1),
                             0.05 * _sigmoid(-0.075)]).reshape(4, 1, 1, 1)
    assert torch.allclose(model.grad, expected, atol=1e-6)


def test_without_the_flipper_every_reference_sample_is_a_loser_as_in_diffusion_dpo():
    loss, stats = seppo_loss(MODEL, REF, TARGET, BETA, aaf=False)
    # pair 1 unflipped: −½β(Δw − Δref) = −0.1·(3 + 3.75) = −0.675 -> log(1 + e^0.675) = 1.0865509
    assert loss.item() == pytest.approx((0.2873353 + 1.0865509) / 2, abs=1e-6)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1.1)) + math.log1p(math.exp(0.675))) / 2, abs=1e-6)
    assert stats["aaf_rate"].item() == 0.0 and stats["implicit_acc"].item() == 0.5
    dpo, _ = diffusion_dpo_loss(MODEL, REF, TARGET, BETA)  # the same loss with the samples as rejected images
    assert loss.item() == pytest.approx(dpo.item(), abs=1e-7)


def test_the_flipper_by_hand():
    # −1 only where the reference's error on the winner is strictly lower than the policy's; a tie (θ = θ_ref, as at
    # the start of every run) keeps the reference sample a loser
    model_w = torch.tensor([1.0, 4.0, 2.0, 0.3])
    ref_w = torch.tensor([4.0, 1.0, 2.0, 0.29999])
    assert aaf_sign(model_w, ref_w).tolist() == [1.0, -1.0, 1.0, -1.0]


def test_loss_is_log_two_at_the_start_whatever_the_samples():
    torch.manual_seed(0)
    ref, target = torch.randn(6, 4, 2, 2), torch.randn(6, 4, 2, 2)
    loss, stats = seppo_loss(ref.clone(), ref, target, 5000.0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7) and stats["aaf_rate"].item() == 0.0


def test_loss_refuses_an_odd_number_of_rows():
    with pytest.raises(ValueError, match="pairs"):
        seppo_loss(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1), 1.0)


# ------------------------------------------------------------------------------------------------ the reference pool


class _FixedDraw:
    """A generator whose `integers(n)` returns a fixed index (the `random` choice's one draw)."""

    def __init__(self, value):
        self.value, self.asked = value, []

    def integers(self, n):
        self.asked.append(n)
        return self.value


def test_which_checkpoint_is_the_reference():
    ages = [0, 3, 1, -1]  # slot 0 holds θ_0, slot 1 epoch 3's weights, slot 2 epoch 1's, slot 3 is empty
    assert choose_reference(ages, "first", None) == 0  # the pre-trained model
    assert choose_reference(ages, "last", None) == 1  # the newest checkpoint
    draw = _FixedDraw(2)
    assert choose_reference(ages, "random", draw) == 2 and draw.asked == [3]  # uniform over the 3 filled slots
    rng = np.random.default_rng(0)
    drawn = {choose_reference(ages, "random", rng) for _ in range(200)}
    assert drawn == {0, 1, 2}  # every kept checkpoint, never the empty slot


def test_which_slot_a_new_checkpoint_takes():
    assert slot_to_replace([0, -1, -1]) == 1  # the first empty one
    assert slot_to_replace([0, 5, 3, 4]) == 2  # full: the oldest one past θ_0 (epoch 3)
    assert slot_to_replace([0]) == -1  # K = 1: θ_0 only, kept


def test_pool_keeps_copies_and_swaps_them_in_and_back():
    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([3.0]))]
    pool = ReferencePool(params, max_references=2)
    assert pool.ages.tolist() == [0, -1]
    with torch.no_grad():
        params[0].add_(10.0)
    pool.add(params, epoch=1)
    with torch.no_grad():
        params[0].add_(10.0)
    pool.add(params, epoch=2)  # full: replaces epoch 1's copy, θ_0 stays
    assert pool.ages.tolist() == [0, 2]
    with pool.active(0, params):
        assert params[0].tolist() == [1.0, 2.0] and params[1].tolist() == [3.0]
    with pool.active(1, params):
        assert params[0].tolist() == [21.0, 22.0]
    assert params[0].tolist() == [21.0, 22.0]  # restored
    loaded = ReferencePool(params, max_references=2)
    loaded.load_state_dict(pool.state_dict())  # what a checkpoint saves and resume loads
    assert loaded.ages.tolist() == [0, 2] and loaded.tensors(0)[0].tolist() == [1.0, 2.0]


# ------------------------------------------------------------------------------------------------ the trainer


def _recipe(tmp_path, **groups):
    base = with_trainer({"run": {"num_epochs": 4, "save_every": 1},
                         "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
                         "log": {"tracker": "none", "image_every": 0}}, "seppo")
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


@pytest.mark.parametrize("choice, expected", [("last", [0, 1, 2, 3]), ("first", [0, 0, 0, 0])])
def test_a_checkpoint_joins_the_pool_every_epoch_and_the_reference_follows_the_choice(tmp_path, choice, expected):
    recipe = _recipe(tmp_path, train={"max_references": 3, "reference_choice": choice})
    get_trainer("seppo").train(load_cfg(recipe), tmp_path / "run")
    records = [r for r in read_metrics(tmp_path / "run") if not r.get("final")]
    assert [r["reference_epoch"] for r in records] == expected
    assert [r["pool_size"] for r in records] == [1, 2, 3, 3]  # θ_0, then one more per epoch up to K = 3
    # after epoch 3: θ_0 and the two newest (epochs 2 and 3; epoch 1's was replaced)
    ages = load_file(latest_checkpoint(tmp_path / "run") / "reference_pool.safetensors")["ages"]
    assert sorted(ages.tolist()) == [0, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)


def _micro_batch_losses(tmp_path, monkeypatch, choice: str) -> list[float]:
    """The loss of every micro-batch of a 2-epoch run (2 micro-batches an epoch, an optimizer step after each)."""
    seen, original = [], seppo.seppo_loss

    def recording(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        seen.append((loss.item(), stats["aaf_rate"].item()))
        return loss, stats

    monkeypatch.setattr(seppo, "seppo_loss", recording)
    recipe = _recipe(tmp_path / choice, run={"num_epochs": 2, "save_every": 0}, train={"reference_choice": choice})
    get_trainer("seppo").train(load_cfg(recipe), tmp_path / choice / "run")
    return seen


def test_the_reference_is_the_pool_checkpoint_not_the_adapter_off_model(tmp_path, monkeypatch):
    # `last`: each epoch's reference is the weights the epoch starts from, so its first micro-batch sees θ = θ_ref:
    # argument 0, loss log 2, nothing flipped; after an update the two differ. `first` keeps θ_0 (the adapter off)
    # as the reference, which the policy has left by epoch 1.
    last = _micro_batch_losses(tmp_path, monkeypatch, "last")
    assert [round(loss, 6) for loss, _ in last[0::2]] == [round(math.log(2), 6)] * 2
    assert all(rate == 0.0 for _, rate in last[0::2])
    assert all(abs(loss - math.log(2)) > 1e-4 for loss, _ in last[1::2])
    first = _micro_batch_losses(tmp_path, monkeypatch, "first")
    assert first[0][0] == pytest.approx(math.log(2), abs=1e-6) and abs(first[2][0] - math.log(2)) > 1e-4


def test_the_random_reference_is_one_of_the_kept_checkpoints(tmp_path):
    recipe = _recipe(tmp_path, run={"num_epochs": 5}, train={"max_references": 7})
    get_trainer("seppo").train(load_cfg(recipe), tmp_path / "run")
    records = [r for r in read_metrics(tmp_path / "run") if not r.get("final")]
    assert all(0 <= r["reference_epoch"] <= r["epoch"] for r in records)
    assert records[0]["reference_epoch"] == 0 and records[0]["loss"] == pytest.approx(math.log(2), abs=0.05)


def test_the_winners_of_a_label_file_are_its_preferred_images(tmp_path):
    cfg = load_cfg(_recipe(tmp_path))
    pairs = load_pairs(TINY_PAIRS)
    lines = [json.loads(line) for line in Path(TINY_PAIRS).read_text().splitlines()]
    decided = [line for line in lines if line["choice"] in (0, 1)]
    assert len(pairs) == len(decided) == 4
    for i, line in enumerate(decided):  # the file's order; the image `choice` points at
        preferred = np.asarray(Image.open(Path(TINY_PAIRS).parent / line["images"][line["choice"]]).convert("RGB"))
        assert np.array_equal(np.asarray(pairs.images(i)[0]), preferred)
    assert seppo.check(cfg) is None


def test_a_shapes_caption_renders_as_an_image_that_satisfies_it():
    captions = get_prompt_set("shapes:train")[:24]
    images = np.stack([render(caption_scene(c), seed, 32) for seed, c in enumerate(captions)])
    scores, _ = verify(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, captions)
    # the verifier reads the world's own renders back: every clause satisfied
    assert [round(float(s), 6) for s in scores] == [1.0] * len(captions)


def test_from_the_prompt_set_alone_on_tiny_shapes(tmp_path):
    recipe = _recipe(tmp_path, run={"num_epochs": 1, "save_every": 0}, model={"pipeline": "tiny-shapes"},
                     prompts={"source": "shapes:train"}, reward={"name": "shapes_verifier"},
                     train={"pairs": "", "batch_size": 2, "steps_per_epoch": 1}, log={"image_every": 1,
                                                                                      "grid_images": 4})
    get_trainer("seppo").train(load_cfg(recipe), tmp_path / "run")
    record = read_metrics(tmp_path / "run")[0]
    assert record["samples_seen"] == 2 and math.isfinite(record["loss"]) and record["reward_mean"] is None
    assert (tmp_path / "run" / "images" / "epoch-0.png").is_file()


@pytest.mark.parametrize("train, message", [
    ({"beta": 0.0}, "train.beta must be > 0"),
    ({"max_references": 0}, "train.max_references must be >= 1"),
    ({"steps_per_epoch": 0}, "must be >= 1"),
    ({"pairs": ""}, "not a ShapesWorld caption"),  # the contract prompts ("a green dog") and no pairs
    ({"pairs": "shapes:trian"}, "did you mean 'shapes:train'"),
])
def test_bad_settings_are_one_line_user_errors(tmp_path, train, message):
    recipe = _recipe(tmp_path, train=train, prompts={"source": PROMPTS})
    with pytest.raises(UserError, match=message) as info:
        seppo.check(load_cfg(recipe))
    assert "\n" not in str(info.value)


def test_it_runs_on_a_flow_matching_pipeline(tmp_path):
    # the tiny random SD3: winners and reference samples noised by the flow's forward process, the velocity errors in
    # the loss (Diffusion-DPO's flow path), the reference samples drawn with the flow ODE
    recipe = _recipe(tmp_path, run={"num_epochs": 2, "save_every": 0}, sample={"eta": 0.0},
                     model={"pipeline": str(tiny_flow_pipeline_dir(tmp_path)),
                            "lora": {"rank": 2, "alpha": 2.0, "target_modules": SD3_LORA_TARGETS}})
    weights = []
    get_trainer("seppo").train(load_cfg(recipe), tmp_path / "run", step_callback=lambda info: weights.append(
        torch.cat([p.detach().flatten().clone() for p in info["params"]])))
    records = [r for r in read_metrics(tmp_path / "run") if not r.get("final")]
    assert [r["reference_epoch"] is not None for r in records] == [True, True]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert not torch.equal(weights[0], weights[-1])
