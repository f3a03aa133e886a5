"""imagereward on a tiny random BLIP saved as `ImageReward.pt` with the published key names.

The reference reads the published keys itself, without `rewards.imagereward`'s key mapping or transformers'
BLIP classes: timm's `VisionTransformer` (BLIP's ViT is timm's, so the `blip.visual_encoder.*` keys load as
they are) and BERT with cross-attention written out below in plain torch from the `blip.text_encoder.*` keys,
then the MLP by hand and the published normalisation (r - 0.16717362830052426) / 1.0333394966054072.
"""

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms as T
from reward_testing import PROMPTS, quantised, sample_images, tiny_imagereward
from timm.models.vision_transformer import VisionTransformer
from transformers import AutoTokenizer

from diffrl.errors import UserError
from rewards import get_reward
from rewards.imagereward import split_imagereward_state_dict
from rewards.preprocess import CLIP_MEAN, CLIP_STD, to_pil
from rewards.random_weights import IMAGEREWARD_CONFIGS


def linear(state, prefix, x):
    return x @ state[prefix + ".weight"].T + state[prefix + ".bias"]


def layer_norm(state, prefix, x, eps):
    return F.layer_norm(x, x.shape[-1:], state[prefix + ".weight"], state[prefix + ".bias"], eps)


def attention(state, prefix, x, context, heads, additive_mask=None):
    q, k, v = (linear(state, f"{prefix}.{n}", y) for n, y in (("query", x), ("key", context), ("value", context)))
    b, n, d = q.shape
    split = lambda t: t.view(b, t.shape[1], heads, d // heads).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads)
    if additive_mask is not None:
        scores = scores + additive_mask
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, n, d)


def blip_text_cls(state, med, input_ids, attention_mask, image_embeds):
    """BLIP's BERT in 'multimodal' mode: bidirectional self-attention, cross-attention to all image tokens."""
    p, eps, heads = "blip.text_encoder.", med["layer_norm_eps"], med["num_attention_heads"]
    positions = torch.arange(input_ids.shape[1])
    x = (
        state[p + "embeddings.word_embeddings.weight"][input_ids]
        + state[p + "embeddings.position_embeddings.weight"][positions]
    )
    x = layer_norm(state, p + "embeddings.LayerNorm", x, eps)
    mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for i in range(med["num_hidden_layers"]):
        q = f"{p}encoder.layer.{i}."
        a = attention(state, q + "attention.self", x, x, heads, mask)
        x = layer_norm(
            state, q + "attention.output.LayerNorm", linear(state, q + "attention.output.dense", a) + x, eps
        )
        c = attention(state, q + "crossattention.self", x, image_embeds, heads)
        x = layer_norm(
            state, q + "crossattention.output.LayerNorm", linear(state, q + "crossattention.output.dense", c) + x, eps
        )
        h = F.gelu(linear(state, q + "intermediate.dense", x))
        x = layer_norm(state, q + "output.LayerNorm", linear(state, q + "output.dense", h) + x, eps)
    return x[:, 0]


def reference_scores(images, prompts, state=None):
    options = tiny_imagereward()
    state = state or torch.load(options["checkpoint"], weights_only=True)
    med = json.loads(Path(options["med_config"]).read_text())
    vision = IMAGEREWARD_CONFIGS["tiny"]["vision"]
    vit = VisionTransformer(
        **vision, qkv_bias=True, num_classes=0, global_pool="", norm_layer=partial(torch.nn.LayerNorm, eps=1e-6)
    ).eval()
    vit.load_state_dict(
        {k[len("blip.visual_encoder.") :]: v for k, v in state.items() if k.startswith("blip.visual_encoder.")}
    )
    # ImageReward's published image transform, on PIL images.
    transform = T.Compose(
        [
            T.Resize(224, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(224),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(options["tokenizer"])
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        image_embeds = vit.forward_features(torch.stack([transform(image) for image in to_pil(images)]))
        cls = blip_text_cls(state, med, tokens["input_ids"], tokens["attention_mask"], image_embeds)
        r = cls
        for i in (0, 2, 4, 6, 7):
            r = linear(state, f"mlp.layers.{i}", r)
    return (r.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


@pytest.fixture(scope="module")
def images():
    return quantised(sample_images(240, 320))


def test_imagereward_formula(images):
    expected = reference_scores(images, PROMPTS)
    exact = get_reward("imagereward", preprocess="processor", device="cpu", **tiny_imagereward())
    torch.testing.assert_close(exact(images, PROMPTS).scores, expected, atol=1e-5, rtol=1e-5)
    differentiable = get_reward("imagereward", device="cpu", **tiny_imagereward())
    scores = differentiable(images, PROMPTS).scores
    assert (scores - expected).abs().max() <= 0.01 * expected.std()  # torch path: 1% of the between-image spread


def test_tiny_model_lets_every_part_reach_the_score(images):
    # A tiny model whose score barely depends on a part cannot show that part is loaded right. Swapping two
    # vision LayerNorms, or the text self- and cross-attention output LayerNorms, must move the reference scores
    # far beyond the formula test's tolerance (atol 1e-5), and different images must score clearly differently.
    expected = reference_scores(images, PROMPTS)
    assert expected.std() > 0.05
    state = torch.load(tiny_imagereward()["checkpoint"], weights_only=True)
    v, t = "blip.visual_encoder.blocks.0.", "blip.text_encoder.encoder.layer.0."
    for a, b in (
        (v + "norm1.weight", v + "norm2.weight"),
        (t + "attention.output.LayerNorm.weight", t + "crossattention.output.LayerNorm.weight"),
    ):
        swapped = {**state, a: state[b], b: state[a]}
        assert (reference_scores(images, PROMPTS, swapped) - expected).abs().max() > 1e-3, a


def test_prompts_truncate_at_35_tokens(images):
    reward = get_reward("imagereward", preprocess="processor", device="cpu", **tiny_imagereward())
    # 40 and 60 words: both cut to [CLS] + 33 tokens + [SEP]; a 10-word prompt is not.
    long_a, long_b, short = "red " * 40, "red " * 60, "red " * 10
    scores = reward(images[:1].expand(3, -1, -1, -1), [long_a, long_b, short]).scores
    assert scores[0].item() == pytest.approx(scores[1].item(), abs=1e-6)
    assert abs(scores[0].item() - scores[2].item()) > 1e-4


def test_imagereward_gradients():
    reward = get_reward("imagereward", device="cpu", **tiny_imagereward())
    assert reward.differentiable and reward.higher_is_better
    images = sample_images(64, 64)[:2].requires_grad_(True)
    reward(images, PROMPTS[:2]).scores.sum().backward()
    assert torch.isfinite(images.grad).all() and (images.grad.abs().sum(dim=(1, 2, 3)) > 0).all()


def test_key_mapping_golden():
    state = {
        "blip.visual_encoder.cls_token": 1,
        "blip.visual_encoder.pos_embed": 2,
        "blip.visual_encoder.patch_embed.proj.weight": 3,
        "blip.visual_encoder.blocks.11.norm1.bias": 4,
        "blip.visual_encoder.blocks.3.attn.qkv.weight": 5,
        "blip.visual_encoder.blocks.3.attn.proj.bias": 6,
        "blip.visual_encoder.blocks.0.mlp.fc2.weight": 7,
        "blip.visual_encoder.norm.weight": 8,
        "blip.text_encoder.encoder.layer.2.crossattention.self.key.weight": 9,
        "blip.text_encoder.embeddings.position_ids": 10,
        "blip.vision_proj.weight": 11,
        "mlp.layers.6.bias": 12,
    }
    vision, text, mlp = split_imagereward_state_dict(state)
    assert vision == {
        "embeddings.class_embedding": 1,
        "embeddings.position_embedding": 2,
        "embeddings.patch_embedding.weight": 3,
        "encoder.layers.11.layer_norm1.bias": 4,
        "encoder.layers.3.self_attn.qkv.weight": 5,
        "encoder.layers.3.self_attn.projection.bias": 6,
        "encoder.layers.0.mlp.fc2.weight": 7,
        "post_layernorm.weight": 8,
    }
    assert text == {"encoder.layer.2.crossattention.self.key.weight": 9}
    assert mlp == {"6.bias": 12}
    with pytest.raises(UserError, match="unexpected keys"):
        split_imagereward_state_dict({"itm_head.weight": 0})


def test_imagereward_errors(tmp_path):
    with pytest.raises(UserError, match="is not a file"):
        get_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"))
    options = dict(tiny_imagereward())
    with pytest.raises(UserError, match="vision_heads=3 does not divide the ViT width 32"):
        get_reward("imagereward", device="cpu", **{**options, "vision_heads": 3})
    bad_med = tmp_path / "med_config.json"
    bad_med.write_text(json.dumps({**json.loads(Path(options["med_config"]).read_text()), "intermediate_size": 48}))
    with pytest.raises(UserError, match="the text weights do not fit the model"):
        get_reward("imagereward", device="cpu", **{**options, "med_config": str(bad_med)})
