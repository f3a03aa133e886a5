"""The video reward (`rewards.video`): an image reward per frame, aggregated over frames, with hand-computed numbers."""

import pytest
import torch

from diffrl.errors import UserError
from rewards import get_reward
from rewards.base import RewardOutput
from rewards.registry import declared_differentiable


class FrameBrightness:
    """Mean pixel value per image (a stand-in image reward that records its calls)."""

    name = "frame_brightness"
    differentiable = True
    higher_is_better = True

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata=None):
        self.calls.append((tuple(images.shape), list(prompts)))
        return RewardOutput(scores=images.mean(dim=(1, 2, 3)))


def videos_with_frame_values(values):
    """Videos `[B, F, 3, 2, 2]` whose frame f of video b is constant `values[b][f]`."""
    v = torch.tensor(values, dtype=torch.float32)
    return v[:, :, None, None, None].expand(*v.shape, 3, 2, 2).clone()


VALUES = [[0.2, 0.6, 0.4], [1.0, 0.0, 0.5]]


def test_mean_min_and_consistency_by_hand():
    frame = FrameBrightness()
    videos = videos_with_frame_values(VALUES)
    out = get_reward("video", reward=frame)(videos, ["a", "b"])
    torch.testing.assert_close(out.scores, torch.tensor([0.4, 0.5]))  # (0.2+0.6+0.4)/3, (1+0+0.5)/3
    assert frame.calls == [((6, 3, 2, 2), ["a", "a", "a", "b", "b", "b"])]  # one call, each prompt per frame
    torch.testing.assert_close(out.info["frame_min"], torch.tensor([0.2, 0.0]))
    # consistency: −mean |Δ| over consecutive frames: −(0.4 + 0.2)/2, −(1.0 + 0.5)/2
    torch.testing.assert_close(out.info["consistency"], torch.tensor([-0.3, -0.75]))
    worst = get_reward("video", reward=FrameBrightness(), aggregate="min")(videos, ["a", "b"])
    torch.testing.assert_close(worst.scores, torch.tensor([0.2, 0.0]))
    mixed = get_reward("video", reward=FrameBrightness(), consistency_weight=0.5)(videos, ["a", "b"])
    torch.testing.assert_close(mixed.scores, torch.tensor([0.4 - 0.15, 0.5 - 0.375]))


def test_frame_stride_scores_every_kth_frame():
    frame = FrameBrightness()
    out = get_reward("video", reward=frame, frame_stride=2)(videos_with_frame_values(VALUES), ["a", "b"])
    torch.testing.assert_close(out.scores, torch.tensor([0.3, 0.75]))  # frames 0 and 2: (0.2+0.4)/2, (1+0.5)/2
    assert frame.calls[0][0] == (4, 3, 2, 2)


def test_images_are_one_frame_videos_and_gradient_reaches_every_frame():
    images = torch.rand(2, 3, 4, 4)
    out = get_reward("video", reward=FrameBrightness())(images, ["a", "b"])
    torch.testing.assert_close(out.scores, images.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(out.info["consistency"], torch.zeros(2))
    videos = torch.rand(1, 4, 3, 2, 2, requires_grad=True)
    get_reward("video", reward=FrameBrightness())(videos, ["a"]).scores.sum().backward()
    # d mean-of-frame-means / d pixel = 1 / (4 frames · 12 pixels) on every pixel of every frame
    torch.testing.assert_close(videos.grad, torch.full_like(videos, 1 / 48))


def test_video_reward_by_name_and_its_refusals():
    from rewards.jpeg import jpeg_compressibility  # noqa: F401  (registers the built-in)

    reward = get_reward("video", reward="jpeg_compressibility")
    assert reward.name == "video(jpeg_compressibility)"
    assert declared_differentiable("video", {"reward": "jpeg_compressibility"}) is False
    assert reward(torch.rand(2, 3, 3, 16, 16), ["a", "b"]).scores.shape == (2,)
    with pytest.raises(UserError, match="aggregate 'median'"):
        get_reward("video", reward=FrameBrightness(), aggregate="median")
    with pytest.raises(UserError, match="frame_stride"):
        get_reward("video", reward=FrameBrightness(), frame_stride=0)
    with pytest.raises(UserError, match=r"\[B, F, 3, H, W\]"):
        get_reward("video", reward=FrameBrightness())(torch.rand(2, 3, 3), ["a", "b"])
    with pytest.raises(UserError, match="one prompt per video"):
        get_reward("video", reward=FrameBrightness())(torch.rand(2, 3, 3, 2, 2), ["a"])


def test_an_image_reward_given_videos_names_the_video_reward():
    from rewards.jpeg import jpeg_compressibility

    with pytest.raises(UserError, match=r"got videos \(2, 3, 3, 16, 16\).*reward: \{name: video, kwargs: "
                                        r"\{reward: jpeg_compressibility\}\}") as error:
        jpeg_compressibility()(torch.rand(2, 3, 3, 16, 16), ["a", "b"])
    assert "\n" not in str(error.value)
