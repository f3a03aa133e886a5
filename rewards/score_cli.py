"""`diffrl score --reward NAME --prompt TEXT IMAGE...`: score image files with one reward.

The CLI verb calls `score_images`, which prints one line per image and writes `scores.json` in the format
`sample` and `steer` use: a list with, per image, `file`, `prompt`, `seed` (None: these images did not come
from a seeded sampler), the reward's score under its name, and every `[B]` entry of the reward's `info`
(e.g. each component of a `weighted_sum`) under its key.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from diffrl.errors import UserError
from diffrl.files import check_out_file, write_json
from rewards.preprocess import pil_to_tensor
from rewards.registry import get_reward


def load_images(image_paths: list[str]):
    """Image files -> list of `[1, 3, H, W]` float tensors in [0, 1] (uint8 / 255, RGB)."""
    from PIL import Image, UnidentifiedImageError

    tensors = []
    for path in image_paths:
        if not Path(path).is_file():
            raise UserError(f"image {path!r} does not exist")
        try:
            with warnings.catch_warnings():  # _check_pixels refuses what PIL would only warn about
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(path)
            with image:
                _check_pixels(path, image.size)
                tensors.append(pil_to_tensor(image).unsqueeze(0))
        except Image.DecompressionBombError:  # PIL refuses on open above twice its bound
            raise UserError(f"image {path!r} has more than {2 * Image.MAX_IMAGE_PIXELS} pixels, twice PIL's bound "
                            "against decompression bombs (Image.MAX_IMAGE_PIXELS); resize it first") from None
        except (UnidentifiedImageError, OSError) as err:
            raise UserError(f"cannot read image {path!r}: {err}") from err
    return tensors


def _check_pixels(path, size: tuple[int, int]) -> None:
    """Refuse, before decoding, an image larger than PIL's decompression-bomb bound (`Image.MAX_IMAGE_PIXELS`,
    ~89 megapixels by default): between one and two times the bound PIL only warns and decodes gigabytes."""
    from PIL import Image

    width, height = size
    if Image.MAX_IMAGE_PIXELS is not None and width * height > Image.MAX_IMAGE_PIXELS:
        raise UserError(f"image {path!r} is {width}x{height} = {width * height} pixels, more than the bound of "
                        f"{Image.MAX_IMAGE_PIXELS} (PIL's Image.MAX_IMAGE_PIXELS); resize it first")


def _per_image_values(info: dict, batch: int) -> dict[str, list[float]]:
    import torch

    values = {}
    for key, value in info.items():
        if isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape[0] == batch:
            values[key] = [float(v) for v in value.detach().cpu()]
    return values


def score_images(reward_spec: str, prompt: str, image_paths: list[str], out_path=None, **reward_kwargs) -> list[dict]:
    """Score image files against one prompt with one reward; print the scores and optionally write scores.json.

    Args:
        reward_spec (`str`): a registry name (`diffrl ls rewards`) or `"package.module:factory"`.
        prompt (`str`): the prompt every image is scored against.
        image_paths (`list[str]`): image files (any format PIL reads; converted to RGB).
        out_path (`str`, *optional*): where to write the JSON list; nothing is written if `None`.
        **reward_kwargs: options of the reward's factory (e.g. `model=`, `head=`, `device=`).

    Returns:
        `list[dict]`: per image `{"file", "prompt", "seed", <reward name>: score, <info key>: value, ...}`.
    """
    import torch

    if not image_paths:
        raise UserError("no images to score; pass one or more image files")
    reward = get_reward(reward_spec, **reward_kwargs)
    records = []
    with torch.no_grad():
        for path, image in zip(image_paths, load_images(image_paths)):
            out = reward(image, [prompt])
            record = {"file": str(path), "prompt": prompt, "seed": None, reward.name: float(out.scores[0])}
            record.update({key: values[0] for key, values in _per_image_values(out.info, 1).items()})
            records.append(record)
            extras = "  ".join(
                f"{k}={v:.4f}" for k, v in record.items() if k not in ("file", "prompt", "seed", reward.name)
            )
            print(f"{path}\t{reward.name}={record[reward.name]:.4f}" + (f"  {extras}" if extras else ""))
    if out_path is not None:
        write_json(check_out_file(out_path), records)
    return records
