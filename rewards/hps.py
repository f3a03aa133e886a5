"""Human Preference Score v2 and v2.1 (Wu et al. 2023, "Human Preference Score v2: A Solid Benchmark for
Evaluating Human Preferences of Text-to-Image Synthesis").

An open_clip ViT-H-14 fine-tuned on human preference pairs (HPD v2). With f the open_clip model:

    hps_i = < f.encode_image(x_i, normalize=True), f.encode_text(prompt_i, normalize=True) >

i.e. the cosine, without logit scale; typical values are 0.2-0.35. v2 and v2.1 are different checkpoints of
the same architecture and their scores are not comparable with each other.

Checkpoints (full state dicts under the key `state_dict`), on the hub as `xswu/HPSv2`:
`HPS_v2_compressed.pt` (v2) and `HPS_v2.1_compressed.pt` (v2.1). The architecture is open_clip's built-in
`ViT-H-14` config, built without pretrained weights (the HPS file holds all of them), so no LAION download
is needed. Text goes through open_clip's CLIP tokenizer (77 tokens).

Preprocessing follows HPSv2's validation transform: ToTensor, then the longest side is resized to 224
(bicubic, antialiased, on the float tensor) and the image centre-padded with zeros to 224x224, then
normalised with the OpenAI mean/std. For square images this is a plain resize to 224x224. (With torchvision
< 0.17, tensor resizes were not antialiased by default; HPSv2 scores computed then differ slightly on large
images.)
"""

from __future__ import annotations

from pathlib import Path

from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from rewards.base import RewardOutput, check_inputs, resolve_device, score_in_batches, wants_grad
from rewards.clip_common import check_preprocess_mode
from rewards.loading import cached, freeze, hub_file, load_torch_file
from rewards.preprocess import CLIP_MEAN, CLIP_STD, ImageSpec, pil_to_tensor, preprocess, to_pil
from rewards.registry import register_reward, torch_preprocess

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"hpsv2": "HPS_v2_compressed.pt", "hpsv21": "HPS_v2.1_compressed.pt"}


def open_clip_model_name(architecture: str) -> str:
    """An open_clip model name: a built-in config name as is, a folder with `open_clip_config.json` as `local-dir:`."""
    path = Path(architecture).expanduser()
    if path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise UserError(f"architecture={architecture!r} is a folder without open_clip_config.json")
        return f"local-dir:{path}"
    return architecture


def build_open_clip(architecture: str, *, reward: str):
    """An open_clip model with random weights from a built-in config name or a `local-dir` folder (no download)."""
    import logging

    import open_clip

    name = open_clip_model_name(architecture)
    if not name.startswith("local-dir:") and name not in open_clip.list_models():
        raise UserError(
            f"reward '{reward}': architecture={architecture!r} is neither an open_clip config name (e.g. ViT-H-14) "
            "nor a folder with open_clip_config.json"
        )
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # open_clip logs a warning for every model built without pretrained weights
    try:
        return open_clip.create_model(name, pretrained=None)
    finally:
        root.setLevel(level)


def hps_state_dict(checkpoint: dict) -> dict:
    """The model state dict inside an HPS checkpoint (`{"state_dict": ...}` or bare; `module.` prefixes removed)."""
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else checkpoint
    return {(key.removeprefix("module.")): value for key, value in state.items()}


def load_hps_model(checkpoint_path: Path, architecture: str, *, reward: str, device, dtype, weights_only=True):
    model = build_open_clip(architecture, reward=reward)
    checkpoint = load_torch_file(checkpoint_path, reward=reward, option="checkpoint", weights_only=weights_only)
    state = hps_state_dict(checkpoint)
    does_not_fit = f"reward '{reward}': checkpoint {str(checkpoint_path)!r} does not fit open_clip {architecture!r}"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches raise even with strict=False
        raise UserError(f"{does_not_fit} ({str(err).splitlines()[-1].strip()})") from err
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"{does_not_fit} ({len(result.missing_keys)} missing keys, e.g. {result.missing_keys[:2]}; "
            f"{len(result.unexpected_keys)} unexpected, e.g. {result.unexpected_keys[:2]})"
        )
    return freeze(model.to(device=device, dtype=dtype))


class HPSReward:
    """HPS v2 / v2.1 score of each image with its prompt; see the module docstring."""

    higher_is_better = True

    def __init__(self, name, model, tokenizer, *, preprocess="torch", batch_size=None):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.preprocess = preprocess
        self.batch_size = batch_size
        self.differentiable = preprocess == "torch"
        size = model.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else size
        cfg = getattr(model.visual, "preprocess_cfg", {})
        self.spec = ImageSpec(
            size=size,
            crop=size,
            mean=tuple(cfg.get("mean", CLIP_MEAN)),
            std=tuple(cfg.get("std", CLIP_STD)),
            mode="longest",
            pil_resize=False,
        )
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def pixel_values(self, images):
        import torch

        if self.preprocess == "processor":
            # HPSv2's own order: PIL -> ToTensor (uint8 / 255) -> resize longest + pad on the tensor -> normalise.
            images = torch.stack([pil_to_tensor(image) for image in to_pil(images)])
        return preprocess(images.to(self.device), self.spec).to(self.dtype)

    def _score(self, images, prompts):
        tokens = self.tokenizer(prompts).to(self.device)
        image_features = self.model.encode_image(self.pixel_values(images), normalize=True)
        text_features = self.model.encode_text(tokens, normalize=True)
        return (image_features.float() * text_features.float()).sum(dim=-1)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        import torch

        prompts = check_inputs(self.name, images, prompts, metadata)
        with torch.set_grad_enabled(self.differentiable and wants_grad(images)):
            scores = score_in_batches(self._score, images, prompts, self.batch_size)
        return RewardOutput(scores=scores.to(images.device), info={})


def _hps(name, checkpoint, architecture, preprocess, batch_size, device, dtype, weights_only) -> HPSReward:
    import open_clip

    check_preprocess_mode(name, preprocess)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    if checkpoint is None:
        path = hub_file(HPS_REPO, HPS_FILES[name], reward=name, option="checkpoint")
    else:
        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise UserError(
                f"reward '{name}': checkpoint={checkpoint!r} is not a file; pass the path of {HPS_FILES[name]}"
            )
    model = cached(
        ("open_clip_hps", str(path), architecture, str(device), str(dtype)),
        lambda: load_hps_model(path, architecture, reward=name, device=device, dtype=dtype, weights_only=weights_only),
    )
    name_or_dir = open_clip_model_name(architecture)
    tokenizer = cached(("open_clip_tokenizer", name_or_dir), lambda: open_clip.get_tokenizer(name_or_dir))  # ~0.25 s
    return HPSReward(name, model, tokenizer, preprocess=preprocess, batch_size=batch_size)


@register_reward("hpsv2", differentiable=torch_preprocess)
def hpsv2(
    checkpoint: str | None = None,
    architecture: str = "ViT-H-14",
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
    weights_only: bool = True,
) -> HPSReward:
    """HPS v2: normalised image·text features of the HPS-fine-tuned open_clip ViT-H-14.

    Args:
        checkpoint (`str`, *optional*):
            Path to `HPS_v2_compressed.pt`; defaults to that file of hub repo `xswu/HPSv2` (cache first).
        architecture (`str`, *optional*, defaults to `"ViT-H-14"`):
            open_clip config name, or a folder with an `open_clip_config.json` (`{"model_cfg": {...}}`).
        preprocess (`str`, *optional*, defaults to `"torch"`):
            `"torch"` (differentiable) or `"processor"` (HPSv2's transform on the uint8 image).
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): model dtype; defaults to float32.
        weights_only (`bool`, *optional*, defaults to `True`):
            Load the checkpoint with `torch.load(weights_only=True)`; set `False` only for a file you trust.
    """
    return _hps("hpsv2", checkpoint, architecture, preprocess, batch_size, device, dtype, weights_only)


@register_reward("hpsv21", differentiable=torch_preprocess)
def hpsv21(
    checkpoint: str | None = None,
    architecture: str = "ViT-H-14",
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
    weights_only: bool = True,
) -> HPSReward:
    """HPS v2.1: as `hpsv2` with the v2.1 checkpoint (`HPS_v2.1_compressed.pt`); scores differ from v2's.

    Args:
        checkpoint (`str`, *optional*):
            Path to `HPS_v2.1_compressed.pt`; defaults to that file of hub repo `xswu/HPSv2` (cache first).
        architecture (`str`, *optional*, defaults to `"ViT-H-14"`): as for `hpsv2`.
        preprocess (`str`, *optional*, defaults to `"torch"`): as for `hpsv2`.
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): model dtype; defaults to float32.
        weights_only (`bool`, *optional*, defaults to `True`):
            Load the checkpoint with `torch.load(weights_only=True)`; set `False` only for a file you trust.
    """
    return _hps("hpsv21", checkpoint, architecture, preprocess, batch_size, device, dtype, weights_only)
