"""DDPO's JPEG rewards against PIL directly."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.errors import UserError
from rewards import get_reward


def pil_jpeg_kb(array: np.ndarray, quality: int = 95) -> float:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000


def test_sizes_match_pil_and_flat_compresses_better_than_noise():
    g = torch.Generator().manual_seed(0)
    flat = torch.full((3, 64, 64), 0.5)
    noise = torch.rand(3, 64, 64, generator=g)
    images = torch.stack([flat, noise])
    # What PIL itself gives on the same uint8 arrays (round(255·x)).
    expected = [pil_jpeg_kb((img.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()) for img in images]
    incompress = get_reward("jpeg_incompressibility")(images, ["", ""])
    compress = get_reward("jpeg_compressibility")(images, ["", ""])
    assert incompress.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert compress.scores.tolist() == pytest.approx([-e for e in expected], abs=1e-6)
    assert expected[0] < expected[1] / 5  # flat grey is a few hundred bytes, 64x64 noise several kB
    assert compress.scores[0] > compress.scores[1]
    assert incompress.info["jpeg_kb"].tolist() == pytest.approx(expected, abs=1e-6)


def test_quantisation_rounds_and_clamps():
    # 0.5·255 = 127.5 rounds to 128 (round half to even gives 128 too); out-of-range values clamp to 0 and 255.
    images = torch.tensor([0.5, -0.2, 1.3]).view(1, 3, 1, 1).expand(1, 3, 16, 16).contiguous()
    array = np.zeros((16, 16, 3), dtype=np.uint8)
    array[..., 0], array[..., 1], array[..., 2] = 128, 0, 255
    assert get_reward("jpeg_incompressibility")(images, [""]).scores.item() == pytest.approx(pil_jpeg_kb(array))


def test_not_differentiable_and_detached():
    reward = get_reward("jpeg_compressibility")
    assert reward.differentiable is False and reward.higher_is_better is True
    images = torch.rand(1, 3, 8, 8, requires_grad=True)
    assert not reward(images, [""]).scores.requires_grad


def test_bad_inputs_are_user_errors():
    reward = get_reward("jpeg_compressibility")
    with pytest.raises(UserError, match=r"expects images as a float tensor \[B, 3, H, W\]"):
        reward(torch.rand(3, 8, 8), [""])
    with pytest.raises(UserError, match="got 2 images but 1 prompts"):
        reward(torch.rand(2, 3, 8, 8), [""])
    with pytest.raises(UserError, match="divide uint8 by 255"):
        reward(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), [""])
