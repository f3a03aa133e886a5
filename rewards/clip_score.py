"""CLIP score: how well an image matches its prompt under a CLIP model (Hessel et al. 2021, "CLIPScore";
Radford et al. 2021, "CLIP").

    cos_i              = cosine(image_embeds_i, text_embeds_i)      (see `rewards.clip_common`)
    scale="100"        : clip_score_i = 100 · cos_i                 (torchmetrics `CLIPScore`, before its clamp)
    scale="logit"      : clip_score_i = exp(logit_scale) · cos_i    (the model's own logit, as in PickScore)
    clamp=True         : max(clip_score_i, 0)                       per image; torchmetrics clamps the batch mean
                                                                    max(mean_i clip_score_i, 0), the same for B = 1

Any transformers `CLIPModel` works: a hub id, a local folder, or the embedded `tiny-shapes-clip`. The default
is `openai/clip-vit-large-patch14`, torchmetrics' default. Differentiable with `preprocess="torch"`.
"""

from __future__ import annotations

from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from rewards.base import RewardOutput, check_inputs, resolve_device, score_in_batches, wants_grad
from rewards.clip_common import (
    at_least_fp32,
    check_preprocess_mode,
    hf_clip_image_embeds,
    hf_clip_text_embeds,
    hf_pixel_values,
    image_spec_from_processor,
    load_hf_clip,
    load_hf_processor,
    paired_cosine,
)
from rewards.registry import register_reward, torch_preprocess

SCALES = ("100", "logit")


class CLIPSimilarityReward:
    """`factor · cos(image, prompt)` under a transformers CLIP; used by `clip_score` and `pickscore`.

    Args:
        name (`str`): registry name of the factory that built it.
        model: a frozen `CLIPModel`.
        processor: its `CLIPProcessor` (tokenizer + image processor).
        scale (`str`): `"100"` or `"logit"` (factor exp(logit_scale)).
        clamp (`bool`): clamp scores at 0 from below.
        preprocess (`str`): `"torch"` (differentiable) or `"processor"` (the HF image processor on uint8 PIL).
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
    """

    higher_is_better = True

    def __init__(self, name, model, processor, *, scale="100", clamp=False, preprocess="torch", batch_size=None):
        self.name = name
        self.model = model
        self.processor = processor
        self.scale = scale
        self.clamp = clamp
        self.preprocess = preprocess
        self.batch_size = batch_size
        self.differentiable = preprocess == "torch"
        self.spec = (
            image_spec_from_processor(processor.image_processor, reward=name) if preprocess == "torch" else None
        )
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def factor(self):
        if self.scale == "logit":
            return at_least_fp32(self.model.logit_scale).exp()
        return 100.0

    def _score(self, images, prompts):
        pixels = hf_pixel_values(
            images,
            mode=self.preprocess,
            image_processor=self.processor.image_processor,
            spec=self.spec,
            device=self.device,
            dtype=self.dtype,
        )
        image_embeds = hf_clip_image_embeds(self.model, pixels)
        text_embeds = hf_clip_text_embeds(self.model, self.processor.tokenizer, prompts, self.device)
        scores = self.factor() * paired_cosine(image_embeds, text_embeds)
        return scores.clamp(min=0) if self.clamp else scores

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        import torch

        prompts = check_inputs(self.name, images, prompts, metadata)
        with torch.set_grad_enabled(self.differentiable and wants_grad(images)):
            scores = score_in_batches(self._score, images, prompts, self.batch_size)
        return RewardOutput(scores=scores.to(images.device), info={})


@register_reward("clip_score", differentiable=torch_preprocess)
def clip_score(
    model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None,
    scale: str = "100",
    clamp: bool = False,
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
) -> CLIPSimilarityReward:
    """CLIP score of each image with its prompt: 100·cos (or exp(logit_scale)·cos with `scale="logit"`).

    Args:
        model (`str`, *optional*, defaults to `"openai/clip-vit-large-patch14"`):
            A transformers `CLIPModel`: hub id, local folder, or embedded name (`tiny-shapes-clip`).
        processor (`str`, *optional*):
            Where to load the `CLIPProcessor` from; defaults to `model`.
        scale (`str`, *optional*, defaults to `"100"`): `"100"` or `"logit"`.
        clamp (`bool`, *optional*, defaults to `False`):
            Report max(score, 0) per image (torchmetrics `clip_score` clamps the batch mean; equal for one image).
        preprocess (`str`, *optional*, defaults to `"torch"`):
            `"torch"`: differentiable resize/crop/normalise in torch. `"processor"`: the HF image processor on
            uint8 PIL images (the published path; not differentiable).
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): model dtype (`float32`, `float16`, `bfloat16`); defaults to float32.
    """
    if scale not in SCALES:
        raise UserError(f"reward 'clip_score': scale={scale!r}; use '100' (100·cos) or 'logit' (exp(logit_scale)·cos)")
    check_preprocess_mode("clip_score", preprocess)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    clip = load_hf_clip(model, reward="clip_score", device=device, dtype=dtype)
    proc = load_hf_processor(processor or model, reward="clip_score", option="processor" if processor else "model")
    return CLIPSimilarityReward(
        "clip_score", clip, proc, scale=scale, clamp=clamp, preprocess=preprocess, batch_size=batch_size
    )
