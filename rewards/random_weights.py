"""Random-weight reward models with the published architectures, saved in the published file formats.

Nothing here downloads anything. Tests build the `"tiny"` configs, save them to a temporary folder exactly as
the published checkpoints are laid out (a transformers folder, a `.pth` head with the published keys, an
open_clip state dict under `state_dict`, `ImageReward.pt` with BLIP's key names) and load them through the
same `get_reward(...)` users call. The benchmark also builds the real-size configs (copied from the published
`config.json` / open_clip / BLIP configs) to time them without the weights.

Every parameter is perturbed with its own noise after initialisation, so no two tensors of the same shape are
equal (fresh LayerNorms are all ones): a key mapped to the wrong place changes the score.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

from rewards.aesthetic import mlp_head
from rewards.imagereward import MED_CONFIG, text_config
from rewards.loading import quiet_transformers

# transformers CLIPConfig sizes. "vit-l-14": openai/clip-vit-large-patch14 (the aesthetic backbone and the
# clip_score default); "vit-h-14": laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore_v1 has the same config).
HF_CLIP_CONFIGS = {
    "tiny": {
        "text": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
        },
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "image_size": 224,
            "patch_size": 32,
            "hidden_act": "quick_gelu",
        },
        "projection_dim": 768,  # the published aesthetic heads take 768-d embeddings
        "num_merges": 2000,
    },
    "vit-l-14": {
        "text": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
        },
        "vision": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "image_size": 224,
            "patch_size": 14,
            "hidden_act": "quick_gelu",
        },
        "projection_dim": 768,
        "num_merges": None,
    },
    "vit-h-14": {
        "text": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "max_position_embeddings": 77,
            "hidden_act": "gelu",
        },
        "vision": {
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_attention_heads": 16,
            "num_hidden_layers": 32,
            "image_size": 224,
            "patch_size": 14,
            "hidden_act": "gelu",
        },
        "projection_dim": 1024,
        "num_merges": None,
    },
}

# open_clip model configs. "ViT-H-14" is open_clip's built-in config (what HPS v2 / v2.1 fine-tune).
OPEN_CLIP_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}

# BLIP ViT + BERT sizes. "v1.0": ImageReward v1.0 (ViT-L/16 and BLIP's med_config.json).
IMAGEREWARD_CONFIGS = {
    "tiny": {
        # Noise on every tensor. Fresh BLIP layers pass the image to the [CLS] score only weakly: with the default
        # 0.02, scores of different images differed by ~0.007 and swapping two vision LayerNorms moved them by 2e-5
        # (below the formula test's tolerance); with 0.1 they differ by ~0.16 and the swap moves them by 1e-2.
        "perturb_scale": 0.1,
        "vision": {"embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0, "patch_size": 16, "img_size": 224},
        "text": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    },
    "v1.0": {
        "vision": {
            "embed_dim": 1024,
            "depth": 24,
            "num_heads": 16,
            "mlp_ratio": 4.0,
            "patch_size": 16,
            "img_size": 224,
        },
        "text": {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "max_position_embeddings": 512,
        },
    },
}

_TINY_TEXT = (
    "a an the of and on in with to photo picture painting image drawing cat dog red green blue yellow cube "
    "sphere ball circle square triangle big small left right above below next table tree sky house car"
)
TINY_WORDS = _TINY_TEXT.split()  # the tiny BERT vocabulary's whole words


def perturb_(module, seed: int, scale: float = 0.02):
    """Add N(0, scale²) noise to every floating parameter and buffer, so equal-shaped tensors differ."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_floating_point():
                tensor.add_(scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
    return module


def spread_linear_(module, seed: int):
    """Re-draw every `Linear` weight as N(0, 1/fan_in) and bias as N(0, 0.1²): a random preference head then maps
    unit-scale features to scores of order 1 that differ clearly between images (default inits give ~1e-2)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                fan_in = layer.weight.shape[1]
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / fan_in**0.5)
                layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=generator))
    return module


@functools.lru_cache(maxsize=4)
def _clip_vocab_and_merges(num_merges: int | None) -> tuple[dict, list]:
    """CLIP's BPE vocabulary (from the file open-clip-torch ships), optionally cut to the first merges."""
    import open_clip

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(path) as file:
        merges = file.read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = merges[:num_merges] if num_merges else merges
    byte_chars = list(_bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}, merges


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2/CLIP's reversible map from bytes to printable characters.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def clip_tokenizer(num_merges: int | None = None):
    """A transformers `CLIPTokenizer` on CLIP's BPE (all 49,408 tokens, or fewer merges for tiny models)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges(num_merges)
    return CLIPTokenizer(vocab=dict(vocab), merges=[tuple(m.split()) for m in merges], model_max_length=77)


def clip_image_processor(size: int = 224):
    """The published CLIP image processor settings: shortest edge `size`, bicubic, centre crop, OpenAI mean/std."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def random_hf_clip(config: str = "tiny", seed: int = 0, *, perturb: bool = True):
    """(CLIPModel with random weights, CLIPProcessor) for `HF_CLIP_CONFIGS[config]`.

    `perturb=False` skips the per-tensor noise (only timing benchmarks want that: it is slow at real sizes).
    """
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    cfg = HF_CLIP_CONFIGS[config]
    tokenizer = clip_tokenizer(cfg["num_merges"])
    text = dict(
        cfg["text"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    clip_config = CLIPConfig(text_config=text, vision_config=cfg["vision"], projection_dim=cfg["projection_dim"])
    torch.manual_seed(seed)
    model = CLIPModel(clip_config).eval()
    if perturb:
        perturb_(model, seed + 1)
    processor = CLIPProcessor(image_processor=clip_image_processor(cfg["vision"]["image_size"]), tokenizer=tokenizer)
    return model, processor


def save_hf_clip(folder, config: str = "tiny", seed: int = 0, *, with_processor: bool = True) -> Path:
    """Save a random CLIP as a transformers folder (model, and its processor unless `with_processor=False`)."""
    folder = Path(folder)
    model, processor = random_hf_clip(config, seed)
    with quiet_transformers():
        model.save_pretrained(folder)
        if with_processor:
            processor.save_pretrained(folder)
    return folder


def random_aesthetic_head(version: str = "v2", in_dim: int = 768, seed: int = 0) -> dict:
    """A state dict with the published keys: v2 `layers.{0,2,4,6,7}.*` (MLP), v1 `weight`/`bias` (linear)."""
    import torch

    torch.manual_seed(seed)
    head = mlp_head(in_dim) if version == "v2" else torch.nn.Linear(in_dim, 1)
    spread_linear_(head, seed + 1)
    state = head.state_dict()
    return {f"layers.{key}": value for key, value in state.items()} if version == "v2" else dict(state)


def save_aesthetic_head(path, version: str = "v2", in_dim: int = 768, seed: int = 0) -> Path:
    import torch

    path = Path(path)
    torch.save(random_aesthetic_head(version, in_dim, seed), path)
    return path


def random_open_clip(architecture: str = "tiny", seed: int = 0, *, perturb: bool = True):
    """(open_clip CLIP with random weights, its model config dict): `"tiny"` or a built-in name like ViT-H-14."""
    import torch
    from open_clip import CLIP, get_model_config

    cfg = OPEN_CLIP_TINY if architecture == "tiny" else get_model_config(architecture)
    torch.manual_seed(seed)
    model = CLIP(**cfg).eval()
    return (perturb_(model, seed + 1) if perturb else model), cfg


def save_hps(folder, architecture: str = "tiny", seed: int = 0, filename: str = "HPS_v2_compressed.pt") -> dict:
    """Write an HPS-style checkpoint (`{"state_dict": ...}`) and, for `"tiny"`, an open_clip config folder.

    Returns the `get_reward("hpsv2", ...)` options that load it: `checkpoint` and `architecture`.
    """
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, cfg = random_open_clip(architecture, seed)
    checkpoint = folder / filename
    torch.save({"epoch": 1, "name": "random", "state_dict": model.state_dict()}, checkpoint)
    if architecture == "tiny":
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
        architecture = str(folder)
    return {"checkpoint": str(checkpoint), "architecture": architecture}


def bert_tokenizer(words=TINY_WORDS):
    """A small uncased WordPiece `BertTokenizer` with BERT's special tokens and whole words plus letters."""
    from transformers import BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(words))
    tokens += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-" if c not in tokens]
    tokens += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    return BertTokenizer(vocab={token: i for i, token in enumerate(tokens)})


def random_imagereward_state(
    config: str = "tiny", seed: int = 0, vocab_size: int = 30524, *, perturb: bool = True
) -> tuple[dict, dict]:
    """(state dict with `ImageReward.pt`'s key names, med_config dict) with random weights.

    The ViT comes from timm's `VisionTransformer` (BLIP's ViT is timm's, so its keys are the published ones),
    the text encoder from `BlipTextModel` (named like BLIP's `med.py` BERT), the head from `mlp_head`.
    """
    from functools import partial

    import torch
    from timm.models.vision_transformer import VisionTransformer
    from transformers import BlipTextModel

    cfg = IMAGEREWARD_CONFIGS[config]
    torch.manual_seed(seed)
    vit = VisionTransformer(
        **cfg["vision"], qkv_bias=True, num_classes=0, global_pool="", norm_layer=partial(torch.nn.LayerNorm, eps=1e-6)
    )
    med_config = {**MED_CONFIG, **cfg["text"], "vocab_size": vocab_size}
    if vocab_size != MED_CONFIG["vocab_size"]:  # a small vocabulary: BLIP's [DEC] (bos) is its second-to-last token
        med_config.update(bos_token_id=vocab_size - 2, sep_token_id=3, eos_token_id=3)
    text = BlipTextModel(text_config(med_config, cfg["vision"]["embed_dim"]), add_pooling_layer=False)
    mlp = mlp_head(cfg["text"]["hidden_size"])
    if perturb:
        perturb_(vit, seed + 1, cfg.get("perturb_scale", 0.02))
        perturb_(text, seed + 2, cfg.get("perturb_scale", 0.02))
    spread_linear_(mlp, seed + 3)
    state = {f"blip.visual_encoder.{k}": v for k, v in vit.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.layers.{k}": v for k, v in mlp.state_dict().items()})
    # Present in the published file, unused by the score.
    state["blip.vision_proj.weight"] = torch.randn(256, cfg["vision"]["embed_dim"])
    state["blip.text_proj.weight"] = torch.randn(256, cfg["text"]["hidden_size"])
    return state, med_config


def save_imagereward(folder, config: str = "tiny", seed: int = 0) -> dict:
    """Write `ImageReward.pt`, `med_config.json` and a tokenizer folder; returns the `get_reward` options."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = bert_tokenizer()
    state, med_config = random_imagereward_state(config, seed, vocab_size=len(tokenizer) + 2)  # + [DEC], [ENC]
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(med_config))
    tokenizer.save_pretrained(folder / "tokenizer")
    heads = IMAGEREWARD_CONFIGS[config]["vision"]["num_heads"]
    return {
        "checkpoint": str(folder / "ImageReward.pt"),
        "med_config": str(folder / "med_config.json"),
        "tokenizer": str(folder / "tokenizer"),
        "vision_heads": heads,
    }
