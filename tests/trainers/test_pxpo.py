"""PXPO: the per-position loss and advantages worked by hand, the per-position log-prob against the step's own, and a
one-epoch run on the tiny pipeline with a map reward."""

import math

import numpy as np
import pytest
import torch
from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.trainers import pxpo
from diffrl.trainers.pxpo import latent_maps, pixel_advantages, position_log_probs, pxpo_loss
from rewards.base import RewardOutput
from samplers.base import StepOutput

# ------------------------------------------------------------------------------------------------ the pure functions


def test_loss_by_hand():
    # four latent positions of one sample, ε = 0.2:
    #   ρ = 1.5, Â = 2:   max(−3, −2·1.2 = −2.4)      = −2.4   (clipped: no gain beyond 1 + ε)
    #   ρ = 0.5, Â = −1:  max(0.5, 1·0.8 = 0.8)        = 0.8    (clipped)
    #   ρ = 1,   Â = 3:   max(−3, −3)                  = −3
    #   ρ = 0.9, Â = 1:   max(−0.9, −0.9)              = −0.9   (inside the clip range)
    # loss = (−2.4 + 0.8 − 3 − 0.9) / 4 = −1.375; clipfrac 2/4; mean ρ = 3.9/4
    old = torch.tensor([[[0.3, -0.1], [0.2, 0.0]]])
    log_probs = old + torch.log(torch.tensor([[[1.5, 0.5], [1.0, 0.9]]]))
    advantages = torch.tensor([[[2.0, -1.0], [3.0, 1.0]]])
    loss, stats = pxpo_loss(log_probs, old, advantages, clip_range=0.2)
    assert loss.item() == pytest.approx(-1.375, abs=1e-6)
    assert stats["clipfrac"].item() == 0.5 and stats["ratio"].item() == pytest.approx(0.975, abs=1e-6)
    expected_kl = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + math.log(0.9) ** 2) / 4
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-6)


def test_at_ratio_one_each_position_is_pushed_by_its_own_advantage():
    # at ρ = 1 the surrogate's gradient w.r.t. a position's log-prob is −Â^ij / (positions): no cross-talk
    advantages = torch.tensor([[[1.0, -2.0], [0.0, 4.0]]])
    log_probs = torch.zeros(1, 2, 2, requires_grad=True)
    pxpo_loss(log_probs, torch.zeros(1, 2, 2), advantages, clip_range=0.1)[0].backward()
    assert torch.allclose(log_probs.grad, -advantages / 4)


def test_direction_raising_the_likelihood_where_the_feedback_is_high_lowers_the_loss():
    # one sample, the left column's feedback +1 and the right's −1; the same small likelihood gain (inside the clip)
    # lowers the loss on the left and raises it on the right
    advantages = torch.tensor([[[1.0, -1.0], [1.0, -1.0]]])
    old = torch.zeros(1, 2, 2)
    up_left = torch.tensor([[[0.01, 0.0], [0.01, 0.0]]])
    loss_left = pxpo_loss(old + up_left, old, advantages, clip_range=0.2)[0]
    loss_right = pxpo_loss(old + up_left.flip(-1), old, advantages, clip_range=0.2)[0]
    loss_none = pxpo_loss(old, old, advantages, clip_range=0.2)[0]
    assert loss_left < loss_none < loss_right


def test_pixel_advantages_by_hand():
    # image 0: map [1, −1] (mean 0), Â = 0.5, σ = 2: [0.5 + 1/2, 0.5 − 1/2] = [1, 0]; image 1: constant map -> Â = −3
    maps = torch.tensor([[[1.0, -1.0]], [[0.7, 0.7]]])
    out = pixel_advantages(maps, torch.tensor([0.5, -3.0]), reward_std=2.0, clip_max=5.0)
    assert torch.allclose(out, torch.tensor([[[1.0, 0.0]], [[-3.0, -3.0]]]))
    # clipped to ±0.8: [0.8, 0], [−0.8, −0.8]; clip_max 0 = no clip
    out = pixel_advantages(maps, torch.tensor([0.5, -3.0]), reward_std=2.0, clip_max=0.8)
    assert torch.allclose(out, torch.tensor([[[0.8, 0.0]], [[-0.8, -0.8]]]))
    assert pixel_advantages(maps, torch.tensor([0.5, -3.0]), 2.0, 0.0)[1, 0, 0].item() == -3.0


def test_latent_maps_average_each_latent_positions_pixels():
    # a 4x4 map to a 2x2 grid: each latent position is the mean of its 2x2 pixel block
    maps = torch.tensor([[[1.0, 1.0, 0.0, -1.0],
                          [1.0, 1.0, -1.0, 0.0],
                          [0.0, 0.0, 1.0, 1.0],
                          [0.0, 4.0, 1.0, -1.0]]])
    assert torch.equal(latent_maps(maps, (2, 2)), torch.tensor([[[1.0, -0.5], [1.0, 0.5]]]))
    # a 1x1 map (a reward without maps: its score) spreads to every position
    assert torch.equal(latent_maps(torch.full((1, 1, 1), 0.3), (2, 3)), torch.full((1, 2, 3), 0.3))


def test_position_log_probs_by_hand_and_their_mean_is_the_step_log_prob():
    # x = μ + σ·z per element: log N = −z²/2 − log σ − ½ log 2π; position (0, 0) has z = 1 in channel 0 and z = −3 in
    # channel 1: mean over the two channels = −(1 + 9)/4 − log σ − ½ log 2π
    sigma = 0.5
    z = torch.zeros(1, 2, 2, 3)
    z[0, 0, 0, 0], z[0, 1, 0, 0] = 1.0, -3.0
    z[0, :, 1, 2] = 2.0
    mean = torch.randn(1, 2, 2, 3, generator=torch.Generator().manual_seed(0))
    step = StepOutput.gaussian(mean + sigma * z, mean, sigma, pred_x0=mean)
    out = position_log_probs(step)
    const = -math.log(sigma) - 0.5 * math.log(2 * math.pi)
    assert out.shape == (1, 2, 3)
    assert out[0, 0, 0].item() == pytest.approx(-10 / 4 + const, abs=1e-5)
    assert out[0, 1, 2].item() == pytest.approx(-2.0 + const, abs=1e-5)
    assert out[0, 0, 1].item() == pytest.approx(const, abs=1e-5)
    assert out.mean().item() == pytest.approx(step.log_prob.item(), abs=1e-6)


def test_a_deterministic_step_has_zero_log_probs_on_the_graph():
    mean = torch.randn(2, 4, 3, 3, requires_grad=True)
    out = position_log_probs(StepOutput.gaussian(mean.detach(), mean, 0.0, pred_x0=mean))
    assert torch.equal(out, torch.zeros(2, 3, 3)) and out.requires_grad


def test_the_recorder_keeps_maps_in_order_and_a_scalar_reward_as_one_pixel_maps():
    from diffrl.errors import UserError

    class Scores:
        name = "scores"

        def __call__(self, images, prompts, metadata=None):
            return RewardOutput(scores=images.mean(dim=(1, 2, 3)), info={})

    recorder = pxpo.MapRecorder(Scores())
    recorder(torch.full((2, 3, 4, 4), 0.25), ["a", "b"])
    recorder(torch.full((1, 3, 4, 4), 0.75), ["c"])
    assert torch.equal(recorder.maps(), torch.tensor([0.25, 0.25, 0.75]).view(3, 1, 1))
    wrong = pxpo.MapRecorder(lambda images, prompts, metadata=None: RewardOutput(
        scores=torch.zeros(2), info={"maps": torch.zeros(2, 4)}))
    with pytest.raises(UserError, match=r"PXPO needs \[B, H, W\]"):
        wrong(torch.zeros(2, 3, 4, 4), ["a", "b"])


# ------------------------------------------------------------------------------------------------ the trainer


def left_minus_right():
    """A map reward for the tests: per-pixel brightness, counted + on the left quarter and − on the rest (unequal
    areas, so the clipped pixel advantages do not average to zero)."""

    class LeftMinusRight:
        name, differentiable, higher_is_better = "left_minus_right", False, True

        def __call__(self, images, prompts, metadata=None):
            maps = images.mean(dim=1)
            quarter = maps.shape[-1] // 4
            maps = torch.cat([maps[..., :quarter], -maps[..., quarter:]], dim=-1)
            return RewardOutput(scores=maps.mean(dim=(1, 2)), info={"maps": maps})

    return LeftMinusRight()


def test_one_epoch_loss_is_minus_the_mean_pixel_advantage_and_the_lora_changes(tmp_path, monkeypatch):
    from diffrl.training import context
    from diffrl.training.metrics import read_metrics

    # one micro-batch of all 4 samples, one pass: every step's loss is taken before the update, at ρ = 1, where the
    # loss is −mean(Â^ij); Â^ij worked out here in numpy from the rewards and the latent maps the trainer used
    rewards, grids, steps = [], [], []
    original_rollouts, original_maps = context.collect_rollouts, pxpo.latent_maps

    def capture_rollouts(**kwargs):
        out = original_rollouts(**kwargs)
        rewards.append(out.all_rewards.copy())
        return out

    def capture_maps(maps, size):
        grids.append(original_maps(maps, size).numpy().astype(np.float64))
        return original_maps(maps, size)

    monkeypatch.setattr(context, "collect_rollouts", capture_rollouts)
    monkeypatch.setattr(pxpo, "latent_maps", capture_maps)
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer({
        "run": {"num_epochs": 1, "save_every": 0}, "log": {"tracker": "none", "image_every": 0},
        "sample": {"num_steps": 2, "batch_size": 4, "num_batches_per_epoch": 1},
        "reward": {"name": "test_pxpo:left_minus_right"}}, "pxpo"))
    recipe.update({"optim": {"learning_rate": 1e-2, "gradient_accumulation_steps": 1},
                   "advantage": {"mode": "batch", "clip_max": 5.0}, "train": {"batch_size": 4, "clip_range": 0.2}})
    pxpo.train(load_cfg(recipe), tmp_path / "run",
               step_callback=lambda info: steps.append([p.detach().clone() for p in info["params"]]))
    r, m = rewards[0], grids[0]
    std = r.std() + 1e-6
    advantage = np.clip((r - r.mean()) / std, -5, 5)
    expected = -np.clip(advantage[:, None, None] + (m - m.mean(axis=(1, 2), keepdims=True)) / std, -5, 5).mean()
    record = read_metrics(tmp_path / "run")[0]
    assert record["global_step"] == 1 and abs(expected) > 0.1
    assert record["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert record["ratio_first_step"] == 1.0 and record["logprob_max_diff"] < 1e-5
    assert len(steps) == 2 and any(not torch.equal(a, b) for a, b in zip(steps[0], steps[-1]))


@pytest.mark.parametrize("override, expected", [
    ("train.clip_range=0", "train.clip_range must be > 0"),
    ("train.timestep_fraction=0", "timestep_fraction must be in (0, 1]"),
    ("train.skip_final_steps=10", "skip_final_steps must be in [0, sample.num_steps = 10)"),
    ("sample.eta=0.0 sample.sampler=ddim", "deterministic"),
])
def test_bad_settings_fail_at_load_time(override, expected):
    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_recipe("pxpo/tiny_shapes_verifier_map", override.split())


def test_the_shipped_recipe_trains_on_the_verifiers_maps(tmp_path, monkeypatch):
    from diffrl.config import load_recipe

    # pxpo/tiny_shapes_verifier_map on the embedded tiny-shapes model, cut to one epoch of 4 samples and one optimizer
    # step: the verifier's [B, H, W] maps (values in [−1, 1]) reach the latent grid and the LoRA moves
    grids, steps = [], []
    original = pxpo.latent_maps

    def capture(maps, size):
        grids.append(maps.clone())
        return original(maps, size)

    monkeypatch.setattr(pxpo, "latent_maps", capture)
    cfg = load_recipe("pxpo/tiny_shapes_verifier_map", [
        "run.num_epochs=1", "run.eval_every=0", "run.save_every=0", f"run.output_dir={tmp_path}", "log.tracker=none",
        "log.image_every=0", "sample.num_steps=2", "sample.batch_size=4", "sample.num_batches_per_epoch=1",
        "advantage.group_size=2", "train.batch_size=4"])
    pxpo.train(cfg, tmp_path / "run",
               step_callback=lambda info: steps.append([p.detach().clone() for p in info["params"]]))
    maps = grids[0]
    assert maps.ndim == 3 and maps.shape[0] == 4 and maps.shape[-1] > 1 and maps.abs().max() <= 1
    assert len(steps) == 2 and any(not torch.equal(a, b) for a, b in zip(steps[0], steps[-1]))
