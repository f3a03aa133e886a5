"""Random-weight pipelines at the released models' sizes, built in code on a device, for GPU benchmarks.

Nothing can be downloaded where diffrl is built, so speed and memory at the real size are measured on the released
architectures with random weights: the diffusers / transformers classes of SD3.5-Medium, FLUX.1-dev and Qwen-Image
with their published configs (`transformer/config.json`, `vae/config.json` and the text encoders' `config.json` of
stabilityai/stable-diffusion-3.5-medium, black-forest-labs/FLUX.1-dev and Qwen/Qwen-Image, as diffusers' and
transformers' own conversion scripts and model cards give them). Only what does not change a pass's cost is small:
the tokenizers are the tiny character / byte-level ones of `samplers.testing` (the ids fit the real vocabularies) and
Qwen2.5-VL's vision tower has one block (text-to-image prompts never run it).

`depth` shortens every tower to that many layers (widths stay real) so the same code runs on a CPU in seconds;
`depth=None` is the released depth. Modules are built in float32 on `device` (so buffers such as rotary tables are
computed as the released code computes them) and cast to `dtype` one at a time.
"""

from __future__ import annotations

import torch
from diffusers.utils import logging as diffusers_logging

from samplers.testing import tiny_t5_tokenizer, tiny_tokenizer
from samplers.testing_families import tiny_qwen2_tokenizer

PRESETS = ("sd35m", "flux1dev", "qwenimage")

# transformer/config.json of the released checkpoints
SD35M_TRANSFORMER = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}  # fmt: skip
FLUX1DEV_TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWENIMAGE_TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
# the 16-channel AutoencoderKL of SD3 and FLUX.1 (they differ in shift and scale only)
FLOW_VAE = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2,
    "latent_channels": 16, "sample_size": 1024, "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip
# text towers: CLIP ViT-L/14 and OpenCLIP bigG/14 text encoders, T5 v1.1 XXL encoder, Qwen2.5-VL-7B's language model
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "projection_dim": 768, "hidden_act": "quick_gelu"}  # fmt: skip
CLIP_BIGG = {"vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
             "num_attention_heads": 20, "projection_dim": 1280, "hidden_act": "gelu"}  # fmt: skip
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}  # fmt: skip
QWEN25_VL_7B_TEXT = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}  # fmt: skip


def random_real_pipeline(preset: str, *, device="cuda", dtype=torch.bfloat16, depth: int | None = None, seed: int = 0):
    """The random-weight pipeline of `preset` (one of `PRESETS`) on `device` in `dtype`; see the module docstring."""
    builders = {"sd35m": _sd35m, "flux1dev": _flux1dev, "qwenimage": _qwenimage}
    if preset not in builders:
        raise ValueError(f"unknown preset {preset!r}; use one of {PRESETS}")
    pipe = builders[preset](_Builder(device, dtype, seed), depth)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class _Builder:
    """Builds one module at a time in float32 on the device, seeded, then casts it (the fp32 copy of the largest
    module is the build's peak: 82 GB for Qwen-Image's transformer)."""

    def __init__(self, device, dtype, seed):
        self.device, self.dtype, self.seed, self.count = torch.device(device), dtype, seed, 0

    def __call__(self, make):
        self.count += 1
        torch.manual_seed(self.seed + self.count)
        with torch.device(self.device):
            module = make()
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # its note on `_keep_in_fp32_modules` (none in these classes)
        try:
            return module.to(self.dtype).eval()
        finally:
            diffusers_logging.set_verbosity(verbosity)


def _layers(real: int, depth: int | None) -> int:
    return real if depth is None else min(real, depth)


def _clip(config: dict, depth, *, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = dict(config, num_hidden_layers=_layers(config["num_hidden_layers"], depth))
    if not projection:
        config.pop("projection_dim")
    # the tiny tokenizer's <|startoftext|> / <|endoftext|> ids, which CLIP's pooling looks up
    text_config = CLIPTextConfig(**config, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return lambda: cls(text_config)


def _t5(depth):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(**dict(T5_XXL, num_layers=_layers(T5_XXL["num_layers"], depth)), decoder_start_token_id=0)
    return lambda: T5EncoderModel(config)


def _flow_vae(shift: float, scale: float):
    from diffusers import AutoencoderKL

    return lambda: AutoencoderKL(**FLOW_VAE, shift_factor=shift, scaling_factor=scale)


def _sd35m(build, depth):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    layers = _layers(SD35M_TRANSFORMER["num_layers"], depth)
    config = dict(SD35M_TRANSFORMER, num_layers=layers,
                  dual_attention_layers=[i for i in SD35M_TRANSFORMER["dual_attention_layers"] if i < layers])
    return StableDiffusion3Pipeline(
        transformer=build(lambda: SD3Transformer2DModel(**config)),
        vae=build(_flow_vae(0.0609, 1.5305)),
        text_encoder=build(_clip(CLIP_L, depth, projection=True)), tokenizer=tiny_tokenizer(),
        text_encoder_2=build(_clip(CLIP_BIGG, depth, projection=True)), tokenizer_2=tiny_tokenizer(),
        text_encoder_3=build(_t5(depth)), tokenizer_3=tiny_t5_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _flux1dev(build, depth):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    config = dict(FLUX1DEV_TRANSFORMER, num_layers=_layers(19, depth), num_single_layers=_layers(38, depth))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    return FluxPipeline(
        transformer=build(lambda: FluxTransformer2DModel(**config)),
        vae=build(_flow_vae(0.1159, 0.3611)),
        text_encoder=build(_clip(CLIP_L, depth, projection=False)), tokenizer=tiny_tokenizer(),
        text_encoder_2=build(_t5(depth)), tokenizer_2=tiny_t5_tokenizer(),
        scheduler=scheduler,
    )


def _qwenimage(build, depth):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    text = dict(QWEN25_VL_7B_TEXT, num_hidden_layers=_layers(28, depth))
    text_config = Qwen2_5_VLConfig(
        text_config={**text, "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [16, 24, 24]},
                     "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>")},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text["hidden_size"], "fullatt_block_indexes": [0]},
        vocab_size=text["vocab_size"], image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )  # fmt: skip
    config = dict(QWENIMAGE_TRANSFORMER, num_layers=_layers(60, depth))
    # Qwen/Qwen-Image's scheduler config (as samplers.testing_families' tiny one)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential", shift_terminal=0.02,
    )  # fmt: skip
    return QwenImagePipeline(
        transformer=build(lambda: QwenImageTransformer2DModel(**config)),
        vae=build(AutoencoderKLQwenImage),  # its defaults are Qwen-Image's VAE (base 96, z 16, its latent statistics)
        text_encoder=build(lambda: Qwen2_5_VLForConditionalGeneration(text_config)), tokenizer=tokenizer,
        scheduler=scheduler,
    )
