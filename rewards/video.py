"""Video rewards from image rewards: score every frame of a video with any image reward and aggregate over frames.

A video family (Wan) decodes to frames `[B, F, 3, H, W]` in [0, 1]; an image reward takes `[B, 3, H, W]`. `video`
wraps one image reward so trainers, evaluation and steering score videos with it unchanged:

    r(video) = aggregate_f r_img(frame_f)  +  consistency_weight · c(video)

- `aggregate="mean"` (the default): the mean frame score. It is the image reward's own scale (a 1-frame video scores
  what its frame scores), does not depend on the frame count, and a differentiable image reward sends gradient to
  every frame. It is what the per-frame rewards of the video RL frameworks amount to.
- `aggregate="min"`: the worst frame. A stricter target (one bad frame sinks the video), but the score and its
  gradient come from one frame per video, so it is noisier.
- the temporal-consistency term c = −mean over consecutive frame pairs of the mean absolute pixel change
  |x_{f+1} − x_f| (in [−1, 0]; 0 for a still video). It penalises flicker, but also motion: a policy can raise it by
  freezing the video, so it is off by default (`consistency_weight=0`) and should stay small beside the frame score.

The frame reward is called once on all `B·F'` frames (each prompt repeated per frame; `frame_stride` k scores frames
0, k, 2k, …, a k-fold saving for large reward models on long videos). An image batch `[B, 3, H, W]` is scored as
1-frame videos. `info` holds each video's `frame_mean`, `frame_min` and `consistency` (`[B]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from diffrl.errors import UserError
from rewards.base import RewardOutput, check_scores
from rewards.registry import declared_differentiable, get_reward, register_reward

if TYPE_CHECKING:  # torch is not imported at module level: listing rewards must not load it (rewards.registry)
    import torch

AGGREGATES = ("mean", "min")


def temporal_consistency(video: torch.Tensor) -> torch.Tensor:
    """c = −mean over consecutive frames of mean |x_{f+1} − x_f| for videos `[B, F, 3, H, W]` in [0, 1]: `[B]`, in
    [−1, 0]; 0 for one frame."""
    if video.shape[1] < 2:
        return video.new_zeros(video.shape[0])
    return -(video[:, 1:] - video[:, :-1]).abs().mean(dim=(1, 2, 3, 4))


def aggregate_frames(frame_scores: torch.Tensor, aggregate: str) -> torch.Tensor:
    """`[B, F]` frame scores → `[B]`: their mean or their minimum."""
    if aggregate == "mean":
        return frame_scores.mean(dim=1)
    if aggregate == "min":
        return frame_scores.min(dim=1).values
    raise UserError(f"video reward: aggregate {aggregate!r} is not one of {AGGREGATES}")


class VideoReward:
    """An image reward applied per frame and aggregated (module docstring)."""

    higher_is_better = True

    def __init__(self, frame_reward, *, aggregate: str = "mean", consistency_weight: float = 0.0,
                 frame_stride: int = 1):
        self.frame_reward = frame_reward
        self.name = f"video({frame_reward.name})"
        self.differentiable = frame_reward.differentiable
        self.aggregate = aggregate
        self.consistency_weight = consistency_weight
        self.frame_stride = frame_stride

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str], metadata=None) -> RewardOutput:
        import torch

        if isinstance(videos, torch.Tensor) and videos.ndim == 4:
            videos = videos[:, None]  # images: 1-frame videos
        if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
            shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
            raise UserError(f"reward '{self.name}' expects videos as a float tensor [B, F, 3, H, W] in [0, 1], "
                            f"got {shape}")
        if isinstance(prompts, str) or len(prompts) != videos.shape[0]:
            raise UserError(f"reward '{self.name}' got {videos.shape[0]} videos and {len(prompts)} prompts; give "
                            f"one prompt per video")
        frames = videos[:, :: self.frame_stride]  # [B, F', 3, H, W]
        b, f = frames.shape[:2]
        repeated = [p for p in prompts for _ in range(f)]
        frame_metadata = None if metadata is None else [m for m in metadata for _ in range(f)]
        out = self.frame_reward(frames.reshape(b * f, *frames.shape[2:]), repeated, frame_metadata)
        check_scores(self.frame_reward.name, out, b * f)
        frame_scores = out.scores.float().reshape(b, f)
        consistency = temporal_consistency(videos.float())
        scores = aggregate_frames(frame_scores, self.aggregate)
        if self.consistency_weight:
            scores = scores + self.consistency_weight * consistency.to(scores.device)
        info = {"frame_mean": frame_scores.mean(dim=1).detach(), "frame_min": frame_scores.min(dim=1).values.detach(),
                "consistency": consistency.detach()}
        return RewardOutput(scores=scores, info=info)


def _declared(kwargs: dict) -> bool | None:
    reward = kwargs.get("reward")
    return declared_differentiable(reward, kwargs.get("kwargs")) if isinstance(reward, str) else None


@register_reward("video", differentiable=_declared)
def video(reward, kwargs: dict | None = None, aggregate: str = "mean", consistency_weight: float = 0.0,
          frame_stride: int = 1) -> VideoReward:
    """Score each frame of a video `[B, F, 3, H, W]` with an image reward and aggregate over frames.

    Args:
        reward (`str` or reward): the image reward, a registry name (or `"package.module:factory"`) or an object.
        kwargs (`dict`, *optional*): options for building `reward` when it is a name.
        aggregate (`str`, *optional*, defaults to `"mean"`): `"mean"` or `"min"` over the scored frames.
        consistency_weight (`float`, *optional*, defaults to 0): weight of the temporal-consistency term
            −mean |x_{f+1} − x_f| (rewards still videos too; see the module docstring).
        frame_stride (`int`, *optional*, defaults to 1): score every `frame_stride`-th frame (from frame 0).

    Example (recipe):

    ```yaml
    reward:
      name: video
      kwargs: {reward: hpsv2, aggregate: mean}
    ```
    """
    if aggregate not in AGGREGATES:
        raise UserError(f"video reward: aggregate {aggregate!r} is not one of {AGGREGATES}")
    if int(frame_stride) != frame_stride or frame_stride < 1:
        raise UserError(f"video reward: frame_stride must be a whole number >= 1, got {frame_stride}")
    if isinstance(reward, str):
        reward = get_reward(reward, **(kwargs or {}))
    elif kwargs:
        raise UserError("video reward: 'kwargs' only applies when 'reward' is a registry name")
    return VideoReward(reward, aggregate=aggregate, consistency_weight=float(consistency_weight),
                       frame_stride=int(frame_stride))
