"""The reward protocol every reward in diffrl follows, and the small helpers their `__call__`s share.

A reward maps a batch of images and their prompts to one score per image:

    reward(images [B, 3, H, W] float in [0, 1], prompts: list[str], metadata: list[dict] | None) -> RewardOutput

Rewards are plain objects, not subclasses of anything: the `Reward` Protocol only states the shape. Trainers
(DRaFT) and steering methods (guidance, ReNO) read `differentiable` and refuse a reward that cannot give
gradients; `higher_is_better` tells samplers which way to push.

Gradient convention: a reward keeps a graph only when autograd is on *and* the images require grad (the
caller is backpropagating to the pixels, as DRaFT, guidance and ReNO do). Otherwise it runs under `no_grad`,
so scoring rollouts for DDPO costs no activation memory. Reward-model weights are frozen either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from diffrl.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass
class RewardOutput:
    """What a reward returns.

    Args:
        scores (`torch.Tensor`):
            `[B]` float32, one score per image, on the device of the input images.
        info (`dict`, *optional*):
            Extra per-batch values to log, e.g. each component of a `weighted_sum` (`[B]` tensors) or the
            running mean of a normalised reward (floats).
    """

    scores: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Anything that scores images against prompts.

    Attributes:
        name (`str`): the registry key of the factory that built it (or a label for composite rewards).
        differentiable (`bool`): whether `__call__` can return scores with a graph back to the pixels.
        higher_is_better (`bool`): whether larger scores are better (all built-in rewards: `True`).
    """

    name: str
    differentiable: bool
    higher_is_better: bool

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
    ) -> RewardOutput: ...


def check_inputs(name: str, images, prompts, metadata=None) -> list[str]:
    """Validate a reward call; returns the prompts as a list. Raises `UserError` on a wrong shape or count."""
    import torch

    if isinstance(images, torch.Tensor) and images.ndim == 5 and images.shape[2] == 3:  # a video family's frames
        raise UserError(f"reward '{name}' scores images [B, 3, H, W], got videos {tuple(images.shape)} [B, F, 3, H, W]; "
                        f"score them per frame with the video reward (reward: {{name: video, kwargs: {{reward: {name}}}}})")
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise UserError(f"reward '{name}' expects images as a float tensor [B, 3, H, W] in [0, 1], got {shape}")
    if not images.is_floating_point():
        raise UserError(
            f"reward '{name}' expects float images in [0, 1], got dtype {images.dtype}; divide uint8 by 255"
        )
    if isinstance(prompts, str):
        raise UserError(f"reward '{name}' expects a list of prompts (one per image), got a single string")
    prompts = list(prompts)
    if len(prompts) != images.shape[0]:
        raise UserError(f"reward '{name}' got {images.shape[0]} images but {len(prompts)} prompts; give one per image")
    if metadata is not None and len(metadata) != images.shape[0]:
        raise UserError(f"reward '{name}' got {images.shape[0]} images but {len(metadata)} metadata entries")
    return prompts


def check_scores(name: str, output, batch: int) -> None:
    """A reward's output holds one score per image: a `RewardOutput` whose `scores` is a `[batch]` tensor. Raises a
    one-line `UserError` naming the reward otherwise (a user's reward returning `[B, 1]`, `B + 1` scores or a bare
    tensor), before any caller indexes, reshapes or broadcasts the scores."""
    import torch

    scores = getattr(output, "scores", None)
    if not isinstance(scores, torch.Tensor):
        got = type(scores if scores is not None else output).__name__
        raise UserError(f"reward '{name}' returned {got}, not RewardOutput(scores=<tensor [B]>): return one score "
                        "per image as RewardOutput(scores=...)")
    if tuple(scores.shape) != (batch,):
        raise UserError(f"reward '{name}' returned scores of shape {list(scores.shape)} for {batch} "
                        f"image{'s' * (batch != 1)}; it must return one score per image, a tensor of shape [{batch}]")


def wants_grad(images) -> bool:
    """True when the caller backpropagates to the pixels: autograd is on and the images require grad."""
    import torch

    return torch.is_grad_enabled() and images.requires_grad


def score_in_batches(
    score_fn: Callable[[torch.Tensor, list[str]], torch.Tensor],
    images: torch.Tensor,
    prompts: list[str],
    batch_size: int | None,
) -> torch.Tensor:
    """Run `score_fn(images_chunk, prompts_chunk) -> [b]` over chunks of `batch_size` rows and concatenate."""
    import torch

    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    n = images.shape[0]
    if n == 0:
        return torch.zeros(0, device=images.device)
    size = batch_size or n
    chunks = [score_fn(images[i : i + size], prompts[i : i + size]) for i in range(0, n, size)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def resolve_device(device=None):
    """`None` -> CUDA when available, else CPU. A CUDA device this machine does not have is a `UserError`."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"device={device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1'") from err
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            have = f"only {count} CUDA device(s)" if count else "no CUDA device"
            raise UserError(f"device={device!r}: this machine has {have}; use device='cpu' or leave device unset")
    return resolved
