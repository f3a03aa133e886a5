"""Shared pieces of the reward tests: tiny random-weight models saved once per test process in the published
layouts (built by `rewards.random_weights`), and a few test images.

The folders are built lazily and cached for the session, so each test file pays only for what it uses.
"""

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rewards import random_weights

_ROOT = Path(tempfile.mkdtemp(prefix="diffrl-reward-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.cache
def tiny_clip_dir() -> str:
    """A tiny transformers CLIP (projection 768) with its CLIPProcessor in one folder."""
    return str(random_weights.save_hf_clip(_ROOT / "clip", "tiny", seed=0))


@functools.cache
def tiny_clip_split_dirs() -> tuple[str, str]:
    """(model folder without processor, processor-only folder): PickScore's published layout."""
    model = random_weights.save_hf_clip(_ROOT / "pick-model", "tiny", seed=1, with_processor=False)
    _, processor = random_weights.random_hf_clip("tiny", seed=1)
    processor.save_pretrained(_ROOT / "pick-processor")
    return str(model), str(_ROOT / "pick-processor")


@functools.cache
def aesthetic_head(version: str) -> str:
    return str(random_weights.save_aesthetic_head(_ROOT / f"aesthetic-{version}.pth", version, 768, seed=2))


@functools.cache
def tiny_hps() -> dict:
    return random_weights.save_hps(_ROOT / "hps", "tiny", seed=3)


@functools.cache
def tiny_imagereward() -> dict:
    return random_weights.save_imagereward(_ROOT / "imagereward", "tiny", seed=4)


def sample_images(height: int = 240, width: int = 320) -> torch.Tensor:
    """Four distinct images [4, 3, H, W] in [0, 1]: a flat colour, a horizontal gradient, stripes, noise."""
    g = torch.Generator().manual_seed(0)
    flat = torch.tensor([0.8, 0.3, 0.1]).view(3, 1, 1).expand(3, height, width)
    ramp = torch.linspace(0, 1, width).view(1, 1, width).expand(3, height, width) * torch.tensor([1.0, 0.5, 0.2]).view(
        3, 1, 1
    )
    stripes = ((torch.arange(width) // 16) % 2).float().view(1, 1, width).expand(3, height, width) * 0.9
    noise = torch.rand(3, height, width, generator=g)
    return torch.stack([flat, ramp, stripes, noise]).contiguous()


def quantised(images: torch.Tensor) -> torch.Tensor:
    """Images on the uint8 grid (as PNG files are), so processor and torch paths see identical pixels."""
    return (images * 255).round() / 255


PROMPTS = ["a red cube on a table", "a blue sphere", "a photo of a cat", "a painting of a house"]
