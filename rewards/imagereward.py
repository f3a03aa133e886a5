"""ImageReward v1.0 (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation"), implemented natively on transformers' BLIP pieces.

The published model is BLIP (ViT-L/16 image encoder + a BERT text encoder with cross-attention to the image
tokens) with an MLP head on the text encoder's [CLS] output:

    v_i      = ViT-L(x_i)                                   # [N+1, 1024] image tokens after the final LayerNorm
    h_i      = BERT(tokens(prompt_i) | cross-attn to v_i)   # bidirectional self-attention, [CLS] at position 0
    r_i      = MLP(h_i[0])                                  # 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (no activations)
    score_i  = (r_i - 0.16717362830052426) / 1.0333394966054072

Tokens: `bert-base-uncased` (plus BLIP's `[DEC]`/`[ENC]` special tokens, unused here), padded and truncated
to 35. Images: resize shortest side 224 (bicubic), centre crop 224 (torchvision rounding), OpenAI mean/std.

Why native: the `image-reward` package pins timm==0.6.13 (downgrading ours) and imports helpers that
transformers 5 removed (`apply_chunking_to_forward` and friends from `modeling_utils`), so it cannot be
imported beside our pins. `ImageReward.pt` (hub `THUDM/ImageReward`) is a flat state dict; its keys map onto
`BlipVisionModel` / `BlipTextModel` / our MLP as in `split_imagereward_state_dict`. Vision sizes are read from
the tensor shapes (only the head count is not in the shapes: 16 for ViT-L); text sizes come from BLIP's
`med_config.json` (built-in published values unless `med_config=` is given).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from rewards.aesthetic import mlp_head
from rewards.base import RewardOutput, check_inputs, resolve_device, score_in_batches, wants_grad
from rewards.clip_common import check_preprocess_mode
from rewards.loading import cached, freeze, hub_file, load_pretrained, load_torch_file
from rewards.preprocess import ImageSpec, preprocess, to_pil
from rewards.registry import register_reward, torch_preprocess

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_TEXT_LENGTH = 35
IMAGE_SPEC = ImageSpec(size=224, crop=224, mode="shortest", crop_rounding="round")

# BLIP's med_config.json as ImageReward ships it (BERT-base with cross-attention; 30522 + [DEC] + [ENC] tokens).
MED_CONFIG = {
    "vocab_size": 30524,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
}

_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.fc([12])\.", r"encoder.layers.\1.mlp.fc\2."),
    (r"^norm\.", "post_layernorm."),
]
# Parts of the published file the score does not use: BLIP's contrastive projections and buffers.
_UNUSED = (r"^blip\.(vision_proj|text_proj)\.", r"position_ids$")


def _rename_vision(key: str) -> str | None:
    for pattern, replacement in _VISION_RENAMES:
        if re.search(pattern, key):
            return re.sub(pattern, replacement, key)
    return None


def split_imagereward_state_dict(state: dict) -> tuple[dict, dict, dict]:
    """Map `ImageReward.pt` keys onto (BlipVisionModel, BlipTextModel, MLP `Sequential`) state dicts.

    `blip.visual_encoder.*` (timm-style ViT) -> BlipVisionModel names; `blip.text_encoder.*` -> BlipTextModel
    (same names); `mlp.layers.*` -> `Sequential` indices. Unused parts (BLIP's `vision_proj`, `text_proj`,
    `position_ids` buffers) are dropped; any other key raises `UserError`.
    """
    vision, text, mlp, unknown = {}, {}, {}, []
    for key, value in state.items():
        if any(re.search(pattern, key) for pattern in _UNUSED):
            continue
        if key.startswith("blip.visual_encoder."):
            new = _rename_vision(key[len("blip.visual_encoder.") :])
            if new is None:
                unknown.append(key)
            else:
                vision[new] = value
        elif key.startswith("blip.text_encoder."):
            text[key[len("blip.text_encoder.") :]] = value
        elif key.startswith("mlp.layers."):
            mlp[key[len("mlp.layers.") :]] = value
        else:
            unknown.append(key)
    if unknown:
        raise UserError(
            f"reward 'imagereward': unexpected keys in the checkpoint, e.g. {unknown[:3]}; is it ImageReward.pt?"
        )
    return vision, text, mlp


def vision_config_from_state(vision: dict, num_heads: int):
    """A `BlipVisionConfig` matching the tensor shapes of a BLIP ViT state dict (heads are not in the shapes)."""
    from transformers import BlipVisionConfig

    try:
        hidden = vision["embeddings.class_embedding"].shape[-1]
        patch = vision["embeddings.patch_embedding.weight"].shape[-1]
        positions = vision["embeddings.position_embedding"].shape[1]
        intermediate = vision["encoder.layers.0.mlp.fc1.weight"].shape[0]
    except KeyError as err:
        raise UserError(
            f"reward 'imagereward': the checkpoint lacks vision weight {err}; is it ImageReward.pt?"
        ) from err
    if num_heads < 1 or hidden % num_heads:
        raise UserError(
            f"reward 'imagereward': vision_heads={num_heads} does not divide the ViT width {hidden} (ViT-L: 16)"
        )
    layers = 1 + max(int(k.split(".")[2]) for k in vision if k.startswith("encoder.layers."))
    grid = round((positions - 1) ** 0.5)
    return BlipVisionConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=1e-6,  # timm ViT in BLIP: partial(nn.LayerNorm, eps=1e-6)
    )


def text_config(med_config: dict, encoder_width: int):
    """A `BlipTextConfig` for BLIP's BERT with cross-attention (`is_decoder=True` builds the cross-attention)."""
    from transformers import BlipTextConfig

    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "layer_norm_eps",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
    )
    return BlipTextConfig(
        **{key: med_config[key] for key in keys if key in med_config},
        encoder_hidden_size=encoder_width,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def build_imagereward_modules(state: dict, med_config: dict, vision_heads: int):
    """(BlipVisionModel, BlipTextModel, MLP) loaded from an ImageReward state dict, frozen, on CPU."""
    from transformers import BlipTextModel, BlipVisionModel

    vision_state, text_state, mlp_state = split_imagereward_state_dict(state)
    vision_cfg = vision_config_from_state(vision_state, vision_heads)
    vision = BlipVisionModel(vision_cfg)
    text = BlipTextModel(text_config({**MED_CONFIG, **med_config}, vision_cfg.hidden_size), add_pooling_layer=False)
    mlp = mlp_head(mlp_state["0.weight"].shape[1]) if "0.weight" in mlp_state else None
    if mlp is None:
        raise UserError("reward 'imagereward': the checkpoint has no mlp.layers.* head; is it ImageReward.pt?")
    for part, module, part_state in (
        ("vision", vision, vision_state),
        ("text", text, text_state),
        ("mlp", mlp, mlp_state),
    ):
        try:
            module.load_state_dict({k: v.float() for k, v in part_state.items()}, strict=True)
        except RuntimeError as err:
            raise UserError(
                f"reward 'imagereward': the {part} weights do not fit the model ({str(err).splitlines()[0]}); "
                "check med_config= and vision_heads="
            ) from err
    return freeze(vision), freeze(text), freeze(mlp)


def load_bert_tokenizer(name: str):
    """BLIP's tokenizer: BERT uncased plus `[DEC]` as bos and `[ENC]` as an extra special token."""

    def load(source, local_only):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=local_only)

    tokenizer = load_pretrained(load, name, reward="imagereward", option="tokenizer")
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    return tokenizer


class ImageRewardReward:
    """ImageReward v1.0 score of each image with its prompt; see the module docstring."""

    name = "imagereward"
    higher_is_better = True

    def __init__(self, vision, text, mlp, tokenizer, *, preprocess="torch", batch_size=None):
        self.vision = vision
        self.text = text
        self.mlp = mlp
        self.tokenizer = tokenizer
        self.preprocess = preprocess
        self.batch_size = batch_size
        self.differentiable = preprocess == "torch"
        parameter = next(vision.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def pixel_values(self, images):
        if self.preprocess == "torch":
            return preprocess(images.to(self.device), IMAGE_SPEC).to(self.dtype)
        import torch
        from torchvision import transforms

        # The published transform: Resize(224, BICUBIC) and CenterCrop(224) on PIL, ToTensor, Normalize.
        pipeline = transforms.Compose(
            [
                transforms.Resize(IMAGE_SPEC.size, interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.CenterCrop(IMAGE_SPEC.crop),
                transforms.ToTensor(),
                transforms.Normalize(IMAGE_SPEC.mean, IMAGE_SPEC.std),
            ]
        )
        return torch.stack([pipeline(image) for image in to_pil(images)]).to(self.device, self.dtype)

    def _score(self, images, prompts):
        import torch

        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=MAX_TEXT_LENGTH, return_tensors="pt"
        )
        image_embeds = self.vision(pixel_values=self.pixel_values(images)).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        text_out = self.text(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        )
        rewards = self.mlp(text_out.last_hidden_state[:, 0].float()).squeeze(-1)
        return (rewards - REWARD_MEAN) / REWARD_STD

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        import torch

        prompts = check_inputs(self.name, images, prompts, metadata)
        with torch.set_grad_enabled(self.differentiable and wants_grad(images)):
            scores = score_in_batches(self._score, images, prompts, self.batch_size)
        return RewardOutput(scores=scores.to(images.device), info={})


@register_reward("imagereward", differentiable=torch_preprocess)
def imagereward(
    checkpoint: str | None = None,
    med_config: str | None = None,
    tokenizer: str = "bert-base-uncased",
    vision_heads: int = 16,
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
    weights_only: bool = True,
) -> ImageRewardReward:
    """ImageReward v1.0: BLIP image-text encoder + MLP, normalised as (r - 0.16717) / 1.03334.

    Args:
        checkpoint (`str`, *optional*):
            Path to `ImageReward.pt`; defaults to that file of hub repo `THUDM/ImageReward` (cache first).
        med_config (`str`, *optional*):
            Path to BLIP's `med_config.json` (text encoder sizes); defaults to the published values.
        tokenizer (`str`, *optional*, defaults to `"bert-base-uncased"`): hub id or folder of the BERT tokenizer.
        vision_heads (`int`, *optional*, defaults to 16): attention heads of the ViT (16 for BLIP ViT-L).
        preprocess (`str`, *optional*, defaults to `"torch"`):
            `"torch"` (differentiable) or `"processor"` (the published torchvision transform on uint8 PIL).
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): dtype of the BLIP encoders; defaults to float32 (the MLP runs in float32).
        weights_only (`bool`, *optional*, defaults to `True`):
            Load the checkpoint with `torch.load(weights_only=True)`; set `False` only for a file you trust.
    """
    check_preprocess_mode("imagereward", preprocess)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    if checkpoint is None:
        path = hub_file(IMAGEREWARD_REPO, IMAGEREWARD_FILE, reward="imagereward", option="checkpoint")
    else:
        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise UserError(
                f"reward 'imagereward': checkpoint={checkpoint!r} is not a file; pass the path of ImageReward.pt"
            )
    med = {}
    if med_config is not None:
        try:
            med = json.loads(Path(med_config).expanduser().read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"reward 'imagereward': cannot read med_config={med_config!r}: {err}") from err

    def build():
        state = load_torch_file(path, reward="imagereward", option="checkpoint", weights_only=weights_only)
        vision, text, mlp = build_imagereward_modules(state, med, vision_heads)
        return vision.to(device, dtype), text.to(device, dtype), mlp.to(device)

    tok = cached(("bert_tokenizer", tokenizer), lambda: load_bert_tokenizer(tokenizer))  # first: it fails fastest
    vision, text, mlp = cached(
        ("imagereward", str(path), json.dumps(med, sort_keys=True), vision_heads, str(device), str(dtype)), build
    )
    return ImageRewardReward(vision, text, mlp, tok, preprocess=preprocess, batch_size=batch_size)
