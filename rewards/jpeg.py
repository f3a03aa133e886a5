"""JPEG (in)compressibility, the toy rewards of DDPO (Black et al. 2023, "Training Diffusion Models with
Reinforcement Learning", Sec. 5.1).

    size(x)                 = len(JPEG(uint8(x), quality=95)) / 1000        # kB, PIL encoder
    jpeg_incompressibility  = size(x)
    jpeg_compressibility    = -size(x)

uint8(x) = round(255·x) clamped to [0, 255], as the DDPO reference code quantises. Not differentiable (the
encoder is not), so DRaFT and guidance refuse these rewards.
"""

from __future__ import annotations

import io

from rewards.base import RewardOutput, check_inputs
from rewards.preprocess import to_uint8_hwc
from rewards.registry import register_reward


def jpeg_size_kb(images, quality: int = 95) -> list[float]:
    """Size in kB (1000 bytes) of each image encoded by PIL as JPEG at `quality`.

    Args:
        images (`torch.Tensor`): `[B, 3, H, W]` float in [0, 1].
        quality (`int`, *optional*, defaults to 95): the JPEG quality DDPO uses.
    """
    from PIL import Image

    sizes = []
    for array in to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return sizes


class JPEGSizeReward:
    """Plus or minus the JPEG size of each image in kB; see the module docstring."""

    differentiable = False
    higher_is_better = True

    def __init__(self, name: str, sign: float, quality: int = 95):
        self.name = name
        self.sign = sign
        self.quality = quality

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        import torch

        check_inputs(self.name, images, prompts, metadata)
        sizes = torch.tensor(jpeg_size_kb(images.detach(), self.quality), dtype=torch.float32)
        return RewardOutput(scores=(self.sign * sizes).to(images.device), info={"jpeg_kb": sizes})


# libjpeg's quality scale is 1..100 and it silently clamps anything outside (0 or -5 encode as 1, 1000 as 100); PIL's
# docs advise at most 95, which DDPO uses
QUALITY_RANGE = {"quality": {"low": 1, "high": 100}}


@register_reward("jpeg_compressibility", differentiable=False, ranges=QUALITY_RANGE)
def jpeg_compressibility(quality: int = 95) -> JPEGSizeReward:
    """Minus the JPEG size in kB (quality 95): smaller files score higher (DDPO)."""
    return JPEGSizeReward("jpeg_compressibility", -1.0, quality)


@register_reward("jpeg_incompressibility", differentiable=False, ranges=QUALITY_RANGE)
def jpeg_incompressibility(quality: int = 95) -> JPEGSizeReward:
    """The JPEG size in kB (quality 95): larger files score higher (DDPO)."""
    return JPEGSizeReward("jpeg_incompressibility", 1.0, quality)
