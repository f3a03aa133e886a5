"""A run's LoRA with lora_alpha != lora_rank keeps its scale alpha / rank through export and loading.

peft applies a LoRA layer as W x + (alpha / r) · B A x. The export (`export_weights`, diffusers'
`save_lora_weights` format) must carry alpha, or a loader falls back to alpha = r and silently applies B A with
scale 1. Here r = 2, alpha = 8 (scale 4); A and B are set to values chosen in the test, and the expected UNet is
the base UNet with every target weight replaced by W + 4 · B @ A, computed here from those values.
"""

import pytest
import torch

from diffrl.pipelines import load_pipeline
from diffrl.training.weights import DEFAULT_LORA_TARGETS, export_weights, setup_trainable
from samplers.testing import tiny_sd_pipeline

RANK, ALPHA = 2, 8.0
SCALE = ALPHA / RANK  # 4
LAYER = "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0"  # one projection checked by hand (has a bias)


def unet_out(unet):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    ehs = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, 10, ehs).sample


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(pipeline folder, exported LoRA folder, {layer: (A, B)}, the trained UNet's output) for a rank-2, alpha-8
    LoRA whose A and B are set here."""
    root = tmp_path_factory.mktemp("lora-alpha")
    pipe_dir = root / "tiny-sd"
    pipe = tiny_sd_pipeline(pipe_dir)  # saved there and loaded back
    setup_trainable(pipe.unet, use_lora=True, lora_rank=RANK, lora_alpha=ALPHA,
                    lora_target_modules=DEFAULT_LORA_TARGETS)
    g = torch.Generator().manual_seed(1)
    factors = {}
    with torch.no_grad():
        for name, module in pipe.unet.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight  # [r, in], [out, r]
                a.copy_(torch.randn(a.shape, generator=g) * 0.5)
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)  # nonzero, unlike the trained-from-zero init
                factors[name] = (a.clone(), b.clone())
    assert LAYER in factors and len(factors) == 4 * 8  # to_q, to_k, to_v, to_out.0 in 8 attention blocks
    lora_dir = root / "lora"
    export_weights(pipe, pipe.unet, lora_dir, use_lora=True)
    return pipe_dir, lora_dir, factors, unet_out(pipe.unet)


def merged_unet(pipe_dir, factors, scale):
    """The base UNet with W <- W + scale · B @ A in every LoRA target, written out without peft."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(pipe_dir / "unet")
    with torch.no_grad():
        for name, (a, b) in factors.items():
            unet.get_submodule(name).weight += scale * b @ a
    return unet


def load_with_diffrl(pipe_dir, lora_dir):
    return load_pipeline(pipe_dir, lora=lora_dir)


def load_with_diffusers(pipe_dir, lora_dir):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir)
    pipe.load_lora_weights(lora_dir)
    return pipe


@pytest.mark.parametrize("loader", [load_with_diffrl, load_with_diffusers])
def test_lora_alpha_survives_export_and_loading(exported, loader):
    pipe_dir, lora_dir, factors, trained_out = exported
    unet = loader(pipe_dir, lora_dir).unet

    # One projection by hand: y = x Wᵀ + b + 4 · x Aᵀ Bᵀ, W and b from the base folder, A and B set above.
    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(pipe_dir / "unet").get_submodule(LAYER)
    a, b = factors[LAYER]
    x = torch.randn(3, 5, base.in_features, generator=torch.Generator().manual_seed(2))
    expected = x @ base.weight.T + base.bias + SCALE * (x @ a.T) @ b.T
    with torch.no_grad():
        layer_out = unet.get_submodule(LAYER)(x)
    torch.testing.assert_close(layer_out, expected, atol=1e-5, rtol=1e-5)

    # The whole UNet: equal to the base with every target merged at scale 4, and so to the trained UNet.
    expected_out = unet_out(merged_unet(pipe_dir, factors, SCALE))
    scale_one_out = unet_out(merged_unet(pipe_dir, factors, 1.0))
    assert (expected_out - scale_one_out).abs().max() > 0.1  # alpha dropped would be far outside the tolerance
    torch.testing.assert_close(unet_out(unet), expected_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(trained_out, expected_out, atol=1e-4, rtol=1e-4)
