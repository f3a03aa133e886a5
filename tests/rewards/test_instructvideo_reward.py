"""InstructVideo's reward (`rewards.instructvideo`): segment boundaries, the TAR weights, the aggregate on toy videos
with a toy frame reward and the gradient reaching only the drawn frames, all worked by hand; the seeded draw; DRaFT and
Flow-GRPO steps on the tiny Wan pipeline with it; the published-settings Wan recipe."""

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrl.errors import UserError
from rewards import get_reward, list_rewards
from rewards.base import RewardOutput
from rewards.instructvideo import attenuated_mean, draw_segment_frames, segment_bounds, tar_weights
from rewards.registry import declared_differentiable


class FrameBrightness:
    """Mean pixel value per image (a stand-in image reward that records the frames it is given)."""

    name = "frame_brightness"
    differentiable = True
    higher_is_better = True

    def __init__(self):
        self.frames = []

    def __call__(self, images, prompts, metadata=None):
        self.frames.append((images.detach().clone(), list(prompts)))
        return RewardOutput(scores=images.mean(dim=(1, 2, 3)))


def ramp_videos(batch, num_frames):
    """Videos `[B, F, 3, 2, 2]` whose frame f is constant f/10 (so a frame's score names the frame)."""
    values = torch.arange(num_frames, dtype=torch.float32) / 10
    return values[None, :, None, None, None].expand(batch, num_frames, 3, 2, 2).clone()


# ---------------------------------------------------------------------------------------------------------------
# Pure pieces


def test_segment_bounds_by_hand():
    assert segment_bounds(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # the paper's 16 frames, 4 segments
    assert segment_bounds(17, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]  # Wan's 17: frame 16 is never scored
    assert segment_bounds(81, 4) == [(0, 20), (20, 40), (40, 60), (60, 80)]
    assert segment_bounds(5, 2) == [(0, 2), (2, 4)]
    assert segment_bounds(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert segment_bounds(1, 1) == [(0, 1)]
    with pytest.raises(UserError, match="segments=6 is more than the video's 5 frames"):
        segment_bounds(5, 6)


def test_tar_weights_by_hand():
    e = math.exp
    # F = 16, centre ⌊16/2⌋ = 8, λ = 1
    torch.testing.assert_close(tar_weights(torch.tensor([[0, 4, 8, 12], [3, 7, 9, 15]]), 16, 1.0),
                               torch.tensor([[e(-8), e(-4), 1.0, e(-4)], [e(-5), e(-1), e(-1), e(-7)]]))
    # F = 17: the same centre, frame 8
    torch.testing.assert_close(tar_weights(torch.tensor([8, 16]), 17, 1.0), torch.tensor([1.0, e(-8)]))
    # F = 5, centre 2, λ = 0.5
    torch.testing.assert_close(tar_weights(torch.tensor([0, 2, 4]), 5, 0.5), torch.tensor([e(-1), 1.0, e(-1)]))
    torch.testing.assert_close(tar_weights(torch.tensor([0, 3, 15]), 16, 0.0), torch.ones(3))  # λ = 0: off


def test_attenuated_mean_by_hand():
    scores = torch.tensor([[1.0, 2.0], [4.0, 0.0]])
    weights = torch.tensor([[0.5, 1.0], [0.25, 0.75]])
    torch.testing.assert_close(attenuated_mean(scores, weights), torch.tensor([(0.5 + 2.0) / 2, 1.0 / 2]))
    torch.testing.assert_close(attenuated_mean(scores, weights, normalize=True),
                               torch.tensor([2.5 / 1.5, 1.0 / 1.0]))


def test_draw_stays_in_its_segment_reaches_every_frame_and_first_takes_the_starts():
    assert draw_segment_frames(2, 16, 4, selection="first").tolist() == [[0, 4, 8, 12]] * 2
    drawn = draw_segment_frames(500, 17, 4, generator=torch.Generator().manual_seed(0))  # [500, 4]
    for s in range(4):
        assert set(drawn[:, s].tolist()) == set(range(4 * s, 4 * s + 4))  # each frame of segment s, and only those
    assert drawn.dtype == torch.long


def test_draw_is_reproducible_from_a_generator_a_seed_or_the_global_seed():
    def draw(generator=None):
        return draw_segment_frames(8, 16, 4, generator=generator)

    assert torch.equal(draw(torch.Generator().manual_seed(3)), draw(torch.Generator().manual_seed(3)))
    assert not torch.equal(draw(torch.Generator().manual_seed(3)), draw(torch.Generator().manual_seed(4)))
    torch.manual_seed(11)
    first = draw()
    torch.manual_seed(11)
    assert torch.equal(draw(), first)

    videos = ramp_videos(4, 16)
    a, b = (get_reward("instructvideo", reward=FrameBrightness(), seed=5) for _ in range(2))
    calls_a = [a(videos, list("abcd")).scores for _ in range(3)]
    calls_b = [b(videos, list("abcd")).scores for _ in range(3)]
    for x, y in zip(calls_a, calls_b):  # the same sequence of draws from the same seed
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not all(torch.equal(calls_a[0], c) for c in calls_a[1:])  # and each call draws afresh
    # a call's generator overrides the reward's own
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    torch.testing.assert_close(a(videos, list("abcd"), generator=g1).scores,
                               b(videos, list("abcd"), generator=g2).scores, rtol=0, atol=0)


def test_default_draw_is_part_of_the_rng_state_a_checkpoint_saves():
    """Unseeded, the reward draws from torch's global CPU generator: the state `capture_rng_state` saves in every
    checkpoint and `restore_rng_state` sets on resume, so a restored state draws the same frames again."""
    from diffrl.training.checkpoint import capture_rng_state, restore_rng_state

    frame = FrameBrightness()
    reward = get_reward("instructvideo", reward=frame)
    videos = ramp_videos(4, 16)
    torch.manual_seed(0)
    reward(videos, list("abcd"))  # a first batch, so the saved state is mid-run
    saved = capture_rng_state()
    first = reward(videos, list("abcd")).scores
    restore_rng_state(saved)
    torch.testing.assert_close(reward(videos, list("abcd")).scores, first, rtol=0, atol=0)
    assert torch.equal(frame.frames[1][0], frame.frames[2][0])  # the same frames, not only the same scores


# ---------------------------------------------------------------------------------------------------------------
# The reward on toy videos


def test_first_frames_aggregate_by_hand():
    # F = 8, S = 4, first frames 0, 2, 4, 6 (scores 0, .2, .4, .6); centre 4: γ = e^-4, e^-2, 1, e^-2
    frame = FrameBrightness()
    out = get_reward("instructvideo", reward=frame, selection="first")(ramp_videos(2, 8), ["a", "b"])
    expected = (0.2 * math.exp(-2) + 0.4 + 0.6 * math.exp(-2)) / 4  # = 0.1 + 0.2 e^-2 = 0.127067...
    torch.testing.assert_close(out.scores, torch.tensor([expected, expected]))
    assert abs(expected - 0.1270670566) < 1e-9
    images, prompts = frame.frames[0]
    assert images.shape == (8, 3, 2, 2) and prompts == ["a"] * 4 + ["b"] * 4  # one call, S frames per video
    normalized = get_reward("instructvideo", reward=FrameBrightness(), selection="first", normalize=True)
    denominator = math.exp(-4) + 2 * math.exp(-2) + 1
    torch.testing.assert_close(normalized(ramp_videos(1, 8), ["a"]).scores,
                               torch.tensor([(0.2 * math.exp(-2) + 0.4 + 0.6 * math.exp(-2)) / denominator]))
    torch.testing.assert_close(out.info["frame_mean"], torch.tensor([0.3, 0.3]))  # (0 + .2 + .4 + .6) / 4
    plain = get_reward("instructvideo", reward=FrameBrightness(), selection="first", tar_lambda=0.0)
    torch.testing.assert_close(plain(ramp_videos(1, 8), ["a"]).scores, torch.tensor([0.3]))


def test_random_draw_aggregate_and_gradient_reach_only_the_drawn_frames():
    # F = 16, S = 4, λ = 1: the recorded frames name the drawn indices g (frame g is constant g/10)
    frame = FrameBrightness()
    reward = get_reward("instructvideo", reward=frame, segments=4, tar_lambda=1.0, seed=0)
    videos = ramp_videos(3, 16).requires_grad_(True)
    out = reward(videos, ["a", "b", "c"])
    images, _ = frame.frames[0]
    drawn = (images.mean(dim=(1, 2, 3)) * 10).round().long().reshape(3, 4)  # [B, S]
    for s in range(4):
        assert ((drawn[:, s] >= 4 * s) & (drawn[:, s] < 4 * s + 4)).all()
    for b in range(3):
        g = drawn[b].tolist()
        expected = sum(math.exp(-abs(i - 8)) * i / 10 for i in g) / 4
        assert abs(out.scores[b].item() - expected) < 1e-6
    out.scores.sum().backward()
    # d score / d pixel of drawn frame g = γ_g / (S · 12 pixels); every other frame gets exactly zero
    grad = videos.grad  # [3, 16, 3, 2, 2]
    for b in range(3):
        g = set(drawn[b].tolist())
        for f in range(16):
            want = math.exp(-abs(f - 8)) / (4 * 12) if f in g else 0.0
            torch.testing.assert_close(grad[b, f], torch.full((3, 2, 2), want), rtol=1e-6, atol=0)


def test_images_are_one_frame_videos_and_bad_input_is_one_line():
    images = torch.rand(2, 3, 4, 4)
    out = get_reward("instructvideo", reward=FrameBrightness(), segments=1)(images, ["a", "b"])
    torch.testing.assert_close(out.scores, images.mean(dim=(1, 2, 3)))  # S = 1, centre frame 0: γ = 1
    with pytest.raises(UserError, match="segments=4 is more than the video's 1 frames"):
        get_reward("instructvideo", reward=FrameBrightness())(images, ["a", "b"])
    with pytest.raises(UserError, match="got 2 videos and 1 prompts"):
        get_reward("instructvideo", reward=FrameBrightness())(torch.rand(2, 5, 3, 4, 4), ["a"])
    with pytest.raises(UserError, match="selection 'middle' is not one of"):
        get_reward("instructvideo", reward=FrameBrightness(), selection="middle")
    with pytest.raises(UserError, match="segments"):
        get_reward("instructvideo", reward=FrameBrightness(), segments=0)
    with pytest.raises(UserError, match="tar_lambda"):
        get_reward("instructvideo", reward=FrameBrightness(), tar_lambda=-1.0)


def test_registered_and_declares_its_image_rewards_differentiability():
    assert "instructvideo" in list_rewards()
    assert declared_differentiable("instructvideo", {"reward": "jpeg_compressibility"}) is False
    assert declared_differentiable("instructvideo", {"reward": "hpsv2"}) is True
    reward = get_reward("instructvideo", reward=FrameBrightness())
    assert reward.differentiable and reward.name == "instructvideo(frame_brightness)"


# ---------------------------------------------------------------------------------------------------------------
# A DRaFT step on the tiny Wan pipeline (the setting of tests/models/test_wan_family.py) with this reward

TESTS = Path(__file__).parents[1]


TRAINERS = {  # reward kwargs per trainer: DRaFT needs gradients; Flow-GRPO scores rollouts (a weighted mean there)
    "draft": {"reward": "pg_helpers:smooth_brightness"},
    "flow_grpo": {"reward": "pg_helpers:brightness", "normalize": True},
}


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_tiny_wan_training_step_with_the_instructvideo_reward(tmp_path, trainer):
    """DRaFT-1 and Flow-GRPO on the tiny random Wan (5 frames of 32x32) with InstructVideo's reward on brightness
    (S = 2: frames {0,1} and {2,3}, centre 2): every LoRA weight moves and the logged reward is finite."""
    for sub in ("models", "trainers"):
        if str(TESTS / sub) not in sys.path:
            sys.path.insert(0, str(TESTS / sub))
    from pg_helpers import load_cfg, tiny_recipe, with_trainer
    from test_wan_family import wan_folder

    from diffrl.training.metrics import read_metrics

    folder = wan_folder(tmp_path / "wan")
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 1},
                         "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 1},
                         "log": {"tracker": "none", "image_every": 1, "grid_images": 2}}, trainer)
    if trainer == "flow_grpo":
        base["sample"]["eta"] = 0.7  # an SDE rollout to take log-probs of (test_wan_family's setting)
    base["reward"] = {"name": "instructvideo", "kwargs": {**TRAINERS[trainer], "segments": 2, "tar_lambda": 1.0}}
    base["model"] = {**base.get("model", {}), "lora": {"rank": 2, "alpha": 2.0}}
    recipe = tiny_recipe(folder, tmp_path, **base)
    recipe["model"]["pipeline"] = str(folder)
    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                          if p.requires_grad}

    module = importlib.import_module(f"diffrl.trainers.{trainer}")
    module.train(load_cfg(recipe), tmp_path / "run", step_callback=snapshot)
    first, last = snapshots[0], snapshots[max(snapshots)]
    assert max(snapshots) >= 1 and first and all("lora" in n for n in first)
    assert not [n for n in first if torch.equal(first[n], last[n])]  # every LoRA weight moved
    record = read_metrics(tmp_path / "run")[0]
    assert np.isfinite(record["loss"]) and np.isfinite(record["reward_mean"])
    # brightness in [0, 1]; with the reference's 1/S, Σγ/S ≤ (1 + e^-1)/2 for S = 2 around centre 2 (frames 0..3)
    assert 0.0 <= record["reward_mean"] <= (1.0 if trainer == "flow_grpo" else (1 + math.exp(-1)) / 2)


def test_wan_recipe_keeps_instructvideos_reward_settings():
    """`diffrl validate`'s checks pass offline on the published-settings recipe, with the reference's numbers
    (ali-vilab/VGen@4014d1f, configs/instructvideo/train/...Partial06_Trunc1_Check_ddim20.yaml and config.py)."""
    from diffrl import config
    from diffrl.config_references import check_references

    cfg = config.load_recipe("draft/wan21_instructvideo_hpsv2", [])
    check_references(cfg)
    assert cfg.reward.name == "instructvideo"
    assert cfg.reward.kwargs == {"reward": "hpsv2", "segments": 4, "tar_lambda": 1.0, "selection": "random"}
    assert (cfg.sample.num_steps, cfg.sample.guidance_scale, cfg.sample.eta) == (20, 3.0, 0.0)
    assert (cfg.train.truncation, cfg.train.k) == ("last", 1)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.optim.learning_rate) == (4, 4.0, 1e-5)
