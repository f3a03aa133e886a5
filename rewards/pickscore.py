"""PickScore (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image
Generation"): a CLIP-H fine-tuned on human preferences between generated images.

    pickscore_i = exp(logit_scale) · cos(image_embeds_i, text_embeds_i)

with the model `yuvalkirstain/PickScore_v1` and, as published, the processor of
`laion/CLIP-ViT-H-14-laion2B-s32B-b79K` (224 px shortest-edge bicubic resize + crop, OpenAI mean/std,
prompts truncated to 77 tokens). Typical values are around 18-23. The scoring is `CLIPSimilarityReward`
(shared with `clip_score`) with `scale="logit"`.

`model` may also be a local folder or the embedded `tiny-shapes-pickscore` (a PickScore-style model trained
on ShapesWorld preferences); such a folder carries its own processor.
"""

from __future__ import annotations

from diffrl.checks import resolve_dtype
from rewards.base import resolve_device
from rewards.clip_common import check_preprocess_mode, load_hf_clip, load_hf_processor
from rewards.clip_score import CLIPSimilarityReward
from rewards.registry import register_reward, torch_preprocess

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@register_reward("pickscore", differentiable=torch_preprocess)
def pickscore(
    model: str = PICKSCORE_MODEL,
    processor: str | None = None,
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
) -> CLIPSimilarityReward:
    """PickScore: exp(logit_scale)·cos(image, prompt) under the PickScore CLIP-H.

    Args:
        model (`str`, *optional*, defaults to `"yuvalkirstain/PickScore_v1"`):
            Hub id, local folder, or embedded name (`tiny-shapes-pickscore`) of a transformers `CLIPModel`.
        processor (`str`, *optional*):
            Where the `CLIPProcessor` comes from. Defaults to `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` for the
            published model (as its authors do) and to `model` itself for any other model.
        preprocess (`str`, *optional*, defaults to `"torch"`): `"torch"` (differentiable) or `"processor"`.
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): model dtype; defaults to float32.
    """
    check_preprocess_mode("pickscore", preprocess)
    if processor is None:
        processor = PICKSCORE_PROCESSOR if model == PICKSCORE_MODEL else model
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    clip = load_hf_clip(model, reward="pickscore", device=device, dtype=dtype)
    proc = load_hf_processor(processor, reward="pickscore", option="processor")
    return CLIPSimilarityReward("pickscore", clip, proc, scale="logit", preprocess=preprocess, batch_size=batch_size)
