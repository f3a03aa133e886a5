"""Image preprocessing for reward models, in torch, so gradients reach the pixels.

Every CLIP-family reward (aesthetic, clip_score, pickscore, hps, imagereward) feeds its vision tower a
224x224 crop normalised by the OpenAI CLIP mean/std. The published pipelines do this on PIL images:

    HF CLIPImageProcessor / OpenAI CLIP / ImageReward:  resize shortest side -> 224 (bicubic), centre crop 224
    HPSv2 (its open_clip fork, validation transform):   ToTensor, then resize longest side -> 224 (bicubic, on
                                                        the float tensor), centre pad with 0

`preprocess(images, spec)` does the same in torch on float images in [0, 1], with the same output-size and
crop-offset arithmetic as the published code, then (x - mean) / std. Resampling:

* PIL-style (`spec.pil_resize=True`, every reward but HPS): PIL's bicubic (a = -0.5, antialiased, which torch's
  `interpolate(..., antialias=True)` implements) applied as PIL applies it: a horizontal pass, the result
  clipped to [0, 1], then a vertical pass, clipped again. PIL stores the intermediate as uint8; we clip but do
  not round, so the only difference left is rounding (at most one uint8 step per pixel). Clipping matters on
  high-frequency images, where bicubic overshoots: a single 2-D pass would differ from PIL by up to ~20 steps
  there. The clip zeroes the gradient only where PIL itself saturates.
* Tensor-style (`spec.pil_resize=False`, HPS): one 2-D antialiased bicubic pass on floats, no clipping, which
  is what HPSv2's transform computes (torchvision `resize` on a float tensor).

`to_pil` gives the uint8 images (round(255·x), clamped) that the published processors expect; a reward
built with `preprocess="processor"` runs that path instead and reproduces the published pipeline exactly on
images that are already uint8 (e.g. PNG files).
"""

from __future__ import annotations

from dataclasses import dataclass

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    """How a vision tower wants its pixels.

    Args:
        size (`int`): target of the resize: the shortest side (`mode="shortest"`) or longest side (`"longest"`).
        crop (`int`): side of the square the model sees.
        mean (`tuple[float, float, float]`): per-channel mean subtracted after resizing (images in [0, 1]).
        std (`tuple[float, float, float]`): per-channel std divided by.
        mode (`str`): `"shortest"` (resize the shortest side, centre crop) or `"longest"` (resize the longest
            side, centre pad with zeros; HPSv2).
        crop_rounding (`str`): `"floor"` (HF image processors: top = (H - crop) // 2) or `"round"` (torchvision
            `CenterCrop`: top = round((H - crop) / 2), ImageReward).
        pil_resize (`bool`): resample as PIL does (separable passes, clipped) or in one float pass (HPSv2).
    """

    size: int = 224
    crop: int = 224
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    mode: str = "shortest"
    crop_rounding: str = "floor"
    pil_resize: bool = True


def resized_size(height: int, width: int, size: int, mode: str) -> tuple[int, int]:
    """Output (height, width) of the published resizes.

    `"shortest"`: the short side becomes `size`, the long side `int(size * long / short)` (torchvision `Resize(int)`
    and HF `get_resize_output_image_size` truncate). `"longest"`: both sides scale by size / long and round
    (HPSv2 `ResizeMaxSize`).
    """
    if mode == "shortest":
        short, long = min(height, width), max(height, width)
        new_short, new_long = size, int(size * long / short)
        return (new_short, new_long) if height <= width else (new_long, new_short)
    if mode == "longest":
        scale = size / max(height, width)
        return round(height * scale), round(width * scale)
    raise ValueError(f"unknown resize mode {mode!r}")


def resize(images, height: int, width: int, pil_like: bool = True):
    """Antialiased bicubic resize of `[B, C, H, W]` float images (identity when the size is unchanged).

    `pil_like=True`: horizontal pass, clip to [0, 1], vertical pass, clip (PIL's order, uint8 range).
    `pil_like=False`: one 2-D pass, no clipping (torchvision `resize` on a float tensor).
    """
    import torch.nn.functional as F

    def bicubic(x, size):
        return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)

    if images.shape[-2:] == (height, width):
        return images
    if not pil_like:
        return bicubic(images, (height, width))
    if images.shape[-1] != width:
        images = bicubic(images, (images.shape[-2], width)).clamp(0, 1)
    if images.shape[-2] != height:
        images = bicubic(images, (height, width)).clamp(0, 1)
    return images


def center_crop(images, crop: int, rounding: str = "floor"):
    """Centre `crop`x`crop` window of `[B, C, H, W]` images (each side at least `crop`)."""
    height, width = images.shape[-2:]
    if rounding == "floor":
        top, left = (height - crop) // 2, (width - crop) // 2
    else:
        top, left = (
            round((height - crop) / 2.0),
            round((width - crop) / 2.0),
        )  # Python rounds half to even, as torchvision
    return images[..., top : top + crop, left : left + crop]


def center_pad(images, size: int):
    """Pad `[B, C, H, W]` images with zeros to `size`x`size`, the extra pixel (odd padding) going right/bottom."""
    import torch.nn.functional as F

    height, width = images.shape[-2:]
    pad_h, pad_w = size - height, size - width
    return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)


def normalize(images, mean, std):
    """(x - mean) / std per channel."""
    import torch

    mean = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean) / std


def preprocess(images, spec: ImageSpec = ImageSpec()):
    """Differentiable published preprocessing: `[B, 3, H, W]` in [0, 1] -> `[B, 3, crop, crop]` normalised."""
    height, width = images.shape[-2:]
    new_h, new_w = resized_size(height, width, spec.size, spec.mode)
    if spec.mode == "longest" and max(height, width) == spec.size:
        new_h, new_w = height, width  # HPSv2's ResizeMaxSize skips images whose longest side already fits
    images = resize(images, new_h, new_w, spec.pil_resize)
    if spec.mode == "shortest":
        images = center_crop(images, spec.crop, spec.crop_rounding)
    else:
        images = center_pad(images, spec.crop)
    return normalize(images, spec.mean, spec.std)


def to_uint8_hwc(images):
    """`[B, 3, H, W]` float in [0, 1] -> numpy `[B, H, W, 3]` uint8 (round(255·x), clamped), no graph."""
    import torch

    images = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images) -> list:
    """`[B, 3, H, W]` float in [0, 1] -> list of RGB PIL images (uint8 as `to_uint8_hwc`)."""
    from PIL import Image

    return [Image.fromarray(array) for array in to_uint8_hwc(images)]


def pil_to_tensor(image):
    """A PIL image -> `[3, H, W]` float32 in [0, 1] (uint8 / 255, as torchvision `ToTensor`)."""
    import numpy as np
    import torch

    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0
