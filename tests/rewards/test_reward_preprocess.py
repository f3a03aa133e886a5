"""The torch preprocessing against the published processors, pixel by pixel, plus golden sizes and offsets.

Tolerance: the torch path skips only PIL's rounding to uint8 (after each of its two resampling passes), so
every pixel is within 1.5 uint8 steps of the processor's and the mean difference is about 0.12 steps.
"""

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from reward_testing import quantised, sample_images
from transformers import CLIPImageProcessor, CLIPImageProcessorPil

from rewards.imagereward import IMAGE_SPEC
from rewards.preprocess import (
    CLIP_MEAN,
    CLIP_STD,
    ImageSpec,
    center_crop,
    center_pad,
    pil_to_tensor,
    preprocess,
    resized_size,
    to_pil,
)

SIZES = [(240, 320), (32, 32), (225, 301), (100, 50)]  # down, up, odd crop margins, portrait


def uint8_steps(a, b):
    """|a - b| of normalised pixels, in units of one uint8 step of the unnormalised image."""
    return (a - b).abs() * torch.tensor(CLIP_STD).view(1, 3, 1, 1) * 255


def test_resized_size_golden():
    assert resized_size(240, 320, 224, "shortest") == (224, 298)  # int(224·320/240) = int(298.67)
    assert resized_size(320, 240, 224, "shortest") == (298, 224)
    assert resized_size(100, 50, 224, "shortest") == (448, 224)
    assert resized_size(240, 320, 224, "longest") == (168, 224)  # 240·0.7
    assert resized_size(225, 301, 224, "longest") == (167, 224)  # round(225·224/301) = round(167.44)


def test_center_crop_offsets_and_pad_golden():
    x = torch.arange(227.0).view(1, 1, 1, 227).expand(1, 1, 224, 227)
    assert center_crop(x, 224, "floor")[0, 0, 0, 0].item() == 1  # (227 - 224) // 2
    assert center_crop(x, 224, "round")[0, 0, 0, 0].item() == 2  # round(1.5) = 2
    padded = center_pad(torch.ones(1, 1, 2, 3), 4)
    # pad_w = 1 -> 0 left, 1 right; pad_h = 2 -> 1 top, 1 bottom.
    assert padded[0, 0].tolist() == [[0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("height,width", SIZES)
def test_torch_path_matches_hf_clip_processors(height, width):
    images = quantised(sample_images(height, width))
    ours = preprocess(images, ImageSpec())
    # transformers 5's default CLIPImageProcessor (torchvision backend) and the PIL one.
    for processor_cls in (CLIPImageProcessor, CLIPImageProcessorPil):
        processor = processor_cls(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
        reference = processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        assert ours.shape == reference.shape == (4, 3, 224, 224)
        steps = uint8_steps(ours, reference)
        assert steps.max().item() < 1.5
        assert steps.mean().item() < 0.25


@pytest.mark.parametrize("height,width", SIZES)
def test_torch_path_matches_imagereward_torchvision_transform(height, width):
    images = quantised(sample_images(height, width))
    # ImageReward's published transform, applied to PIL images.
    pipeline = T.Compose(
        [
            T.Resize(224, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(224),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )
    reference = torch.stack([pipeline(image) for image in to_pil(images)])
    steps = uint8_steps(preprocess(images, IMAGE_SPEC), reference)
    assert steps.max().item() < 1.5
    assert steps.mean().item() < 0.25


@pytest.mark.parametrize("height,width", [(240, 320), (100, 50), (224, 224)])
def test_hps_spec_equals_hpsv2_tensor_transform(height, width):
    images = quantised(sample_images(height, width))
    # HPSv2's validation transform: ToTensor, resize the longest side on the tensor, pad with 0, normalise.
    expected = []
    for image in to_pil(images):
        x = pil_to_tensor(image)
        scale = 224 / max(height, width)
        if scale != 1.0:
            new = (round(height * scale), round(width * scale))
            x = TF.resize(x, list(new), T.InterpolationMode.BICUBIC, antialias=True)
            pad_h, pad_w = 224 - new[0], 224 - new[1]
            x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
        expected.append(TF.normalize(x, CLIP_MEAN, CLIP_STD))
    spec = ImageSpec(mode="longest", pil_resize=False)
    torch.testing.assert_close(preprocess(images, spec), torch.stack(expected), atol=1e-5, rtol=0)


def test_gradient_reaches_pixels():
    images = sample_images(100, 150).requires_grad_(True)
    preprocess(images, ImageSpec()).square().sum().backward()
    assert torch.isfinite(images.grad).all()
    assert (images.grad.abs().sum(dim=(1, 2, 3)) > 0).all()
