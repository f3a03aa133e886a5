"""InstructVideo's video reward: an image reward on one frame drawn per temporal segment, weighted by the temporally
attenuated reward (TAR).

Paper: "InstructVideo: Instructing Video Diffusion Models with Human Feedback", Yuan, Zhang, Wang, Wei, Feng, Pan,
Zhang, Liu, Albanie & Ni, CVPR 2024, https://arxiv.org/abs/2312.12490 ("Segmental Video Reward" and "Temporally
Attenuated Reward"). Reference code: ali-vilab/VGen@4014d1fae4ac4a35e8e8442123611e913001399e,
utils/reward/reward.py (`DiffRewardModel.reward_scorer`), defaults in tools/modules/config.py and the paper's training
config configs/instructvideo/train/reward_webvid_ani45_20_reg_vidldm_LoRA_TSNExp16Diffreward_Partial06_Trunc1_Check_
ddim20.yaml. The formulas below are read from that code (the paper's text was not at hand offline).

For a video of F frames x^0 … x^{F−1} with prompt c, S segments of span L = ⌊F/S⌋:

    segment s = frames [s·L, (s+1)·L)                      s = 0 … S−1 (the last F − S·L frames are never scored)
    g_s = s·L + u_s,  u_s ~ U{0, …, L−1}                   segmental sparse sampling (TSN-style), drawn per video
    γ_s = exp(−λ · |g_s − ⌊F/2⌋|)                           TAR: decays away from the central frame ⌊F/2⌋
    r(video, c) = (1/S) Σ_s γ_s · r_img(x^{g_s}, c)

Code names → paper / reference-code notation:
    segments          S  (`cfg.segments`; the paper's training config: 4, on 16 frames)
    tar_lambda        λ  (`cfg.lambda_TAR`, 1.0); 0 turns TAR off (γ_s = 1: a plain mean over the drawn frames)
    selection         "random": u_s drawn as above (`selection_method: TSN`, the training config's);
                      "first": u_s = 0, the first frame of each segment (`fixed_first`, config.py's default)
    frame_indices     g_s  (`global_index`), `[B, S]`
    tar_weights       γ_s  (`TSN_coef`), `[B, S]`

Only the S drawn frames go through the image reward (one call on `B·S` frames), so a differentiable image reward sends
gradient to those frames alone: DRaFT's backward through the reward costs S frames, not F (the VAE still decodes
all F). The draw is reproducible: a `generator=` given to the call, else the reward's own generator when built with
`seed`, else torch's global CPU generator, which a training run seeds from `run.seed` and saves in its checkpoints (that a
resumed run then draws the frames an uninterrupted one would is not tested).

Differences from the reference code, on purpose:
- The reference turns its reward into a loss 1 − r (HPSv2 logits) inside the reward model; here the reward is r and
  the trainer's loss is −r (DRaFT), the same gradient.
- `normalize=True` (off by default, the reference's form) divides by Σ_s γ_s instead of S: a weighted mean, so a video
  whose frames all score v scores v whatever frames were drawn. With the reference form and λ = 1 the score moves by
  up to e^{−⌊F/2⌋}-fold with the draw alone, which a per-group advantage (Flow-GRPO) sees as signal; the weighted
  mean removes that part of the draw noise.
- The reference works on 16-frame ModelScopeT2V clips; a Wan video has F = 4k + 1 frames. With F = 17 and S = 4
  the segments and the centre (frame 8) are the reference's for 16 frames, and frame 16 is never scored.
- An image batch `[B, 3, H, W]` is scored as 1-frame videos (needs S = 1: γ = 1, the image reward itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from diffrl.errors import UserError
from rewards.base import RewardOutput, check_scores
from rewards.registry import declared_differentiable, get_reward, register_reward

if TYPE_CHECKING:  # torch is not imported at module level: listing rewards must not load it (rewards.registry)
    import torch

SELECTIONS = ("random", "first")


def segment_bounds(num_frames: int, segments: int) -> list[tuple[int, int]]:
    """The S segments' frame ranges `[(start, stop), ...]`, each of span ⌊F/S⌋, from frame 0 (module docstring)."""
    if segments > num_frames:
        raise UserError(f"instructvideo reward: segments={segments} is more than the video's {num_frames} frames; "
                        f"set reward.kwargs.segments to at most {num_frames}")
    span = num_frames // segments
    return [(s * span, (s + 1) * span) for s in range(segments)]


def draw_segment_frames(batch: int, num_frames: int, segments: int, *, selection: str = "random",
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """g_s = s·L + u_s for each of `batch` videos: `[batch, S]` long frame indices on the CPU. `selection="random"`
    draws u_s ~ U{0..L−1} from `generator` (torch's global CPU generator when `None`); `"first"` takes u_s = 0."""
    import torch

    starts = torch.tensor([start for start, _ in segment_bounds(num_frames, segments)])  # [S]
    if selection == "first":
        return starts.expand(batch, segments).clone()
    span = num_frames // segments
    return starts + torch.randint(span, (batch, segments), generator=generator)


def tar_weights(frame_indices: torch.Tensor, num_frames: int, tar_lambda: float) -> torch.Tensor:
    """γ = exp(−λ · |g − ⌊F/2⌋|) for frame indices g (any shape), float32."""
    import torch

    return torch.exp(-tar_lambda * (frame_indices - num_frames // 2).abs().float())


def attenuated_mean(frame_scores: torch.Tensor, weights: torch.Tensor, *, normalize: bool = False) -> torch.Tensor:
    """`[B, S]` scores and weights → `[B]`: (1/S) Σ γ_s r_s, or Σ γ_s r_s / Σ γ_s with `normalize`."""
    weighted = (weights * frame_scores).sum(dim=1)
    return weighted / (weights.sum(dim=1) if normalize else frame_scores.shape[1])


class InstructVideoReward:
    """An image reward on one frame per segment, TAR-weighted (module docstring)."""

    higher_is_better = True

    def __init__(self, frame_reward, *, segments: int = 4, tar_lambda: float = 1.0, selection: str = "random",
                 normalize: bool = False, seed: int | None = None):
        import torch

        self.frame_reward = frame_reward
        self.name = f"instructvideo({frame_reward.name})"
        self.differentiable = frame_reward.differentiable
        self.segments = segments
        self.tar_lambda = tar_lambda
        self.selection = selection
        self.normalize = normalize
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str], metadata=None, *,
                 generator: torch.Generator | None = None) -> RewardOutput:
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
        b, num_frames = videos.shape[:2]
        indices = draw_segment_frames(b, num_frames, self.segments, selection=self.selection,
                                      generator=generator or self.generator)  # [B, S]
        weights = tar_weights(indices, num_frames, self.tar_lambda).to(videos.device)  # [B, S]
        frames = videos[torch.arange(b)[:, None], indices]  # [B, S, 3, H, W]; gradient reaches these frames only
        repeated = [p for p in prompts for _ in range(self.segments)]
        frame_metadata = None if metadata is None else [m for m in metadata for _ in range(self.segments)]
        out = self.frame_reward(frames.reshape(b * self.segments, *frames.shape[2:]), repeated, frame_metadata)
        check_scores(self.frame_reward.name, out, b * self.segments)
        frame_scores = out.scores.float().reshape(b, self.segments)
        scores = attenuated_mean(frame_scores, weights.to(frame_scores.device), normalize=self.normalize)
        info = {"frame_mean": frame_scores.mean(dim=1).detach(), "tar_weight_mean": weights.mean(dim=1)}
        return RewardOutput(scores=scores, info=info)


def _declared(kwargs: dict) -> bool | None:
    reward = kwargs.get("reward")
    return declared_differentiable(reward, kwargs.get("kwargs")) if isinstance(reward, str) else None


@register_reward("instructvideo", differentiable=_declared,
                 ranges={"segments": {"low": 1}, "tar_lambda": {"low": 0.0}})
def instructvideo(reward, kwargs: dict | None = None, segments: int = 4, tar_lambda: float = 1.0,
                  selection: str = "random", normalize: bool = False, seed: int | None = None) -> InstructVideoReward:
    """InstructVideo's segmental, temporally attenuated video reward from an image reward (module docstring).

    Args:
        reward (`str` or reward): the image reward, a registry name (or `"package.module:factory"`) or an object.
        kwargs (`dict`, *optional*): options for building `reward` when it is a name.
        segments (`int`, *optional*, defaults to 4): S, the number of segments, one frame scored in each (the
            paper's training config: 4 on 16 frames). At most the video's frame count.
        tar_lambda (`float`, *optional*, defaults to 1.0): λ of γ = exp(−λ·|g − ⌊F/2⌋|) (the reference's
            `lambda_TAR`); 0 turns the attenuation off.
        selection (`str`, *optional*, defaults to `"random"`): `"random"` draws the frame within each segment,
            `"first"` takes each segment's first frame.
        normalize (`bool`, *optional*, defaults to `False`): divide by Σγ instead of S (a weighted mean; the
            reference divides by S).
        seed (`int`, *optional*): seed of the reward's own frame-draw generator; unset, frames are drawn from torch's
            global CPU generator (seeded by `run.seed`, restored on resume). A call's `generator=` overrides both.

    Example (recipe):

    ```yaml
    reward:
      name: instructvideo
      kwargs: {reward: hpsv2, segments: 4, tar_lambda: 1.0}
    ```
    """
    if selection not in SELECTIONS:
        raise UserError(f"instructvideo reward: selection {selection!r} is not one of {SELECTIONS}")
    if int(segments) != segments or segments < 1:
        raise UserError(f"instructvideo reward: segments must be a whole number >= 1, got {segments}")
    if seed is not None and (int(seed) != seed or seed < 0):
        raise UserError(f"instructvideo reward: seed must be a whole number >= 0, got {seed}")
    if isinstance(reward, str):
        reward = get_reward(reward, **(kwargs or {}))
    elif kwargs:
        raise UserError("instructvideo reward: 'kwargs' only applies when 'reward' is a registry name")
    return InstructVideoReward(reward, segments=int(segments), tar_lambda=float(tar_lambda), selection=selection,
                               normalize=bool(normalize), seed=None if seed is None else int(seed))
