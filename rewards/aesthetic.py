"""LAION aesthetic predictor (Schuhmann et al. 2022, LAION-5B; "improved-aesthetic-predictor").

    e_i        = image_embeds_i / |image_embeds_i|        # CLIP ViT-L/14 projected image embedding, 768-d
    v2: score_i = MLP(e_i)                                # 768 -> 1024 -> 128 -> 64 -> 16 -> 1
    v1: score_i = Linear(768, 1)(e_i)

The v2 MLP has dropout between its linear layers and no activations (as published); scores lie roughly in
1-10 (SD 1.5 samples have a median near 5.6). Head files (not on the HF hub; pass them by path):

    v2: sac+logos+ava1-l14-linearMSE.pth   github.com/christophschuhmann/improved-aesthetic-predictor
    v1: sa_0_4_vit_l_14_linear.pth         github.com/LAION-AI/aesthetic-predictor

The backbone is `openai/clip-vit-large-patch14` through transformers (its vision tower and projection only).
Heads load with `torch.load(weights_only=True)`; the MLP runs in float32 as the published code does.
"""

from __future__ import annotations

from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from rewards.base import RewardOutput, check_inputs, resolve_device, score_in_batches, wants_grad
from rewards.clip_common import (
    check_preprocess_mode,
    hf_clip_image_embeds,
    hf_pixel_values,
    image_spec_from_processor,
    l2_normalize,
    load_hf_clip,
    load_hf_processor,
)
from rewards.loading import cached, freeze, load_torch_file
from rewards.registry import register_reward, torch_preprocess

HEAD_FILES = {"v2": "sac+logos+ava1-l14-linearMSE.pth", "v1": "sa_0_4_vit_l_14_linear.pth"}


def mlp_head(in_dim: int = 768):
    """The published preference MLP (LAION aesthetic v2; ImageReward uses the same layers).

    `Sequential(Linear(in, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1),
    Linear(64, 16), Linear(16, 1))`. The published files store it as an attribute `layers`, so their keys are
    `layers.{0,2,4,6,7}.{weight,bias}`; strip that prefix before `load_state_dict`.
    """
    from torch import nn

    return nn.Sequential(
        nn.Linear(in_dim, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )


def load_aesthetic_head(path: str, version: str):
    """The v1 or v2 head from a `.pth` state dict, frozen, float32, on CPU."""
    from torch import nn

    state = load_torch_file(path, reward="aesthetic", option="head")
    if not isinstance(state, dict) or not state:
        raise UserError(f"reward 'aesthetic': head={path!r} holds no state dict; expected {HEAD_FILES[version]}")
    if version == "v1":
        if set(state) != {"weight", "bias"}:
            hint = " (it looks like a v2 MLP head: pass version='v2')" if "layers.0.weight" in state else ""
            raise UserError(f"reward 'aesthetic': head={path!r} is not a v1 linear head (keys weight, bias){hint}")
        head = nn.Linear(state["weight"].shape[1], 1)
    else:
        if "layers.0.weight" not in state:
            hint = " (it looks like a v1 linear head: pass version='v1')" if set(state) == {"weight", "bias"} else ""
            raise UserError(f"reward 'aesthetic': head={path!r} is not a v2 MLP head (keys layers.*){hint}")
        head = mlp_head(state["layers.0.weight"].shape[1])
        state = {key.removeprefix("layers."): value for key, value in state.items()}
    try:
        head.load_state_dict({key: value.float() for key, value in state.items()})
    except RuntimeError as err:
        raise UserError(f"reward 'aesthetic': head={path!r} does not fit the {version} head: {err}".splitlines()[0])
    return freeze(head)


class AestheticReward:
    """LAION aesthetic score of each image (prompts are ignored); see the module docstring."""

    name = "aesthetic"
    higher_is_better = True

    def __init__(self, backbone_model, image_processor, head, *, preprocess="torch", batch_size=None):
        self.backbone = backbone_model
        self.image_processor = image_processor
        self.head = head
        self.preprocess = preprocess
        self.batch_size = batch_size
        self.differentiable = preprocess == "torch"
        self.spec = image_spec_from_processor(image_processor, reward="aesthetic") if preprocess == "torch" else None
        parameter = next(backbone_model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def _score(self, images, prompts):
        pixels = hf_pixel_values(
            images,
            mode=self.preprocess,
            image_processor=self.image_processor,
            spec=self.spec,
            device=self.device,
            dtype=self.dtype,
        )
        embeds = l2_normalize(hf_clip_image_embeds(self.backbone, pixels).float())
        return self.head(embeds).squeeze(-1)

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        import torch

        prompts = check_inputs(self.name, images, prompts, metadata)
        with torch.set_grad_enabled(self.differentiable and wants_grad(images)):
            scores = score_in_batches(self._score, images, prompts, self.batch_size)
        return RewardOutput(scores=scores.to(images.device), info={})


@register_reward("aesthetic", differentiable=torch_preprocess)
def aesthetic(
    head: str | None = None,
    backbone: str = "openai/clip-vit-large-patch14",
    version: str = "v2",
    preprocess: str = "torch",
    batch_size: int | None = None,
    device=None,
    dtype=None,
) -> AestheticReward:
    """LAION aesthetic predictor: an MLP (v2) or linear (v1) head on normalised CLIP ViT-L/14 image embeddings.

    Args:
        head (`str`):
            Path to the head file: `sac+logos+ava1-l14-linearMSE.pth` (v2) or `sa_0_4_vit_l_14_linear.pth` (v1).
        backbone (`str`, *optional*, defaults to `"openai/clip-vit-large-patch14"`):
            The transformers CLIP the head was trained on: hub id or local folder.
        version (`str`, *optional*, defaults to `"v2"`): `"v2"` (MLP) or `"v1"` (linear).
        preprocess (`str`, *optional*, defaults to `"torch"`): `"torch"` (differentiable) or `"processor"`.
        batch_size (`int`, *optional*): images per forward pass; all at once if `None`.
        device (`str`, *optional*): defaults to CUDA when available, else CPU.
        dtype (`str`, *optional*): backbone dtype; defaults to float32 (the head always runs in float32).
    """
    if version not in HEAD_FILES:
        raise UserError(f"reward 'aesthetic': version={version!r}; use 'v2' (MLP head) or 'v1' (linear head)")
    if head is None:
        raise UserError(
            f"reward 'aesthetic' needs head=<path to {HEAD_FILES[version]}> (LAION aesthetic predictor {version}; "
            "see github.com/christophschuhmann/improved-aesthetic-predictor)"
        )
    check_preprocess_mode("aesthetic", preprocess)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    clip = load_hf_clip(backbone, reward="aesthetic", device=device, dtype=dtype, option="backbone", vision_only=True)
    image_processor = load_hf_processor(backbone, reward="aesthetic", option="backbone", tokenizer=False)
    mlp = cached(
        ("aesthetic_head", str(head), version, str(device)), lambda: load_aesthetic_head(head, version).to(device)
    )
    if mlp_in_dim(mlp) != clip.config.projection_dim:
        raise UserError(
            f"reward 'aesthetic': head expects {mlp_in_dim(mlp)}-d embeddings but backbone {backbone!r} gives "
            f"{clip.config.projection_dim}-d; the published heads need openai/clip-vit-large-patch14"
        )
    return AestheticReward(clip, image_processor, mlp, preprocess=preprocess, batch_size=batch_size)


def mlp_in_dim(head) -> int:
    return (head[0] if hasattr(head, "__getitem__") else head).in_features
