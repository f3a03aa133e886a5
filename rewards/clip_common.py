"""What the CLIP-family rewards share, as plain functions: load a transformers CLIP with its processor, turn
images into pixel values (torch path or published-processor path), embed images and texts, and take the
cosine of each image with its own prompt.

    image_embeds = visual_projection(vision_model(pixels).pooler_output)      # = CLIPModel.get_image_features
    text_embeds  = text_projection(text_model(ids, mask).pooler_output)        # = CLIPModel.get_text_features
    cos_i        = <image_embeds_i / |image_embeds_i|, text_embeds_i / |text_embeds_i|>
"""

from __future__ import annotations

from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from rewards.base import resolve_device
from rewards.loading import cached, freeze, load_pretrained, quiet_transformers
from rewards.preprocess import ImageSpec, preprocess, to_pil

PREPROCESS_MODES = ("torch", "processor")


def check_preprocess_mode(reward: str, mode: str) -> str:
    if mode not in PREPROCESS_MODES:
        raise UserError(f"reward '{reward}': preprocess={mode!r}; use 'torch' (differentiable) or 'processor'")
    return mode


def load_hf_clip(model: str, *, reward: str, device=None, dtype=None, option: str = "model", vision_only=False):
    """A frozen transformers CLIP (`CLIPModel`, or `CLIPVisionModelWithProjection` if `vision_only`), cached."""
    device, dtype = resolve_device(device), resolve_dtype(dtype)

    def build():
        from transformers import CLIPConfig, CLIPModel, CLIPVisionModelWithProjection

        def load(source, local_only):
            with quiet_transformers():
                if not vision_only:
                    return CLIPModel.from_pretrained(source, local_files_only=local_only, dtype=dtype)
                # Only the vision tower and projection; the projection width lives in the top-level config.
                config = CLIPConfig.from_pretrained(source, local_files_only=local_only)
                vision_config = config.vision_config
                vision_config.projection_dim = config.projection_dim
                return CLIPVisionModelWithProjection.from_pretrained(
                    source, config=vision_config, local_files_only=local_only, dtype=dtype
                )

        return freeze(load_pretrained(load, model, reward=reward, option=option).to(device))

    return cached(("hf_clip", model, vision_only, str(device), str(dtype)), build)


def load_hf_processor(name: str, *, reward: str, option: str = "processor", tokenizer: bool = True):
    """The `CLIPProcessor` (or, with `tokenizer=False`, only the image processor) of a model id or folder, cached."""

    def build():
        from transformers import AutoImageProcessor, AutoProcessor

        cls = AutoProcessor if tokenizer else AutoImageProcessor

        def load(source, local_only):
            with quiet_transformers():
                return cls.from_pretrained(source, local_files_only=local_only)

        return load_pretrained(load, name, reward=reward, option=option)

    return cached(("hf_processor", name, tokenizer), build)


def image_spec_from_processor(image_processor, *, reward: str) -> ImageSpec:
    """The `ImageSpec` equivalent to an HF CLIP-style image processor (shortest-edge resize, bicubic, crop)."""
    size = dict(image_processor.size)
    crop = dict(image_processor.crop_size) if image_processor.do_center_crop else None
    resample = int(getattr(image_processor.resample, "value", image_processor.resample))
    if "shortest_edge" not in size or crop is None or crop["height"] != crop["width"] or resample != 3:
        raise UserError(
            f"reward '{reward}': the image processor (size={size}, crop_size={crop}, resample={resample}) is not a "
            "CLIP-style shortest-edge bicubic resize + square crop, which the torch path implements; "
            "use preprocess='processor'"
        )
    return ImageSpec(
        size=size["shortest_edge"],
        crop=crop["height"],
        mean=tuple(image_processor.image_mean),
        std=tuple(image_processor.image_std),
        mode="shortest",
        crop_rounding="floor",
    )


def hf_pixel_values(images, *, mode: str, image_processor, spec: ImageSpec, device, dtype):
    """`[B, 3, H, W]` in [0, 1] -> the vision tower's input, by our torch path or the HF processor on PIL."""
    if mode == "torch":
        return preprocess(images.to(device=device, dtype=images.dtype), spec).to(dtype)
    pixels = image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
    return pixels.to(device=device, dtype=dtype)


def hf_clip_image_embeds(model, pixel_values):
    """Projected image embeddings `[B, D]` (not normalised) of a `CLIPModel` / `CLIPVisionModelWithProjection`."""
    if hasattr(model, "vision_model") and hasattr(model, "visual_projection"):
        return model.visual_projection(model.vision_model(pixel_values=pixel_values).pooler_output)
    raise TypeError(f"{type(model).__name__} is not a transformers CLIP model with a visual projection")


def hf_clip_text_embeds(model, tokenizer, prompts: list[str], device):
    """Projected text embeddings `[B, D]` (not normalised) of a `CLIPModel` for `prompts`."""
    max_length = min(tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
    tokens = tokenizer(prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    output = model.text_model(
        input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
    )
    return model.text_projection(output.pooler_output)


def l2_normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


def paired_cosine(image_embeds, text_embeds):
    """`[B]` cosine of each image embedding with the text embedding in the same row, computed in float32 (float64
    for a float64 model)."""
    return (l2_normalize(at_least_fp32(image_embeds)) * l2_normalize(at_least_fp32(text_embeds))).sum(dim=-1)


def at_least_fp32(x):
    """`x` in float32 when it is fp16/bf16, else as is (float32 or float64)."""
    return x if x.dtype.itemsize >= 4 else x.float()
