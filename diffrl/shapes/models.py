"""Architectures of the tiny ShapesWorld models: the same classes as the real ones, at a tiny size.

- `tiny-shapes-clip`: a transformers `CLIPModel` (ViT image tower over 32x32 images, patch 4).
- `tiny-shapes`: a diffusers `StableDiffusionPipeline`: `AutoencoderKL` (32x32 RGB <-> 8x8x4 latents),
  `UNet2DConditionModel` (cross-attention on the CLIP text tower's hidden states), `DDIMScheduler`.
- `tiny-shapes-lcm`: the same UNet with a guidance-scale embedding (`time_cond_proj_dim`), distilled.
"""

from __future__ import annotations

IMAGE_SIZE = 32
TEXT_WIDTH = 128
# CLIP's image normalisation (so the CLIP-family reward preprocessing applies unchanged).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# The noise schedule of Stable Diffusion 1.x, kept so every SD code path applies unchanged.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1, "prediction_type": "epsilon",
}


def clip_config(vocab_size: int, bos_token_id: int, eos_token_id: int):
    from transformers import CLIPConfig

    text = {"vocab_size": vocab_size, "hidden_size": TEXT_WIDTH, "intermediate_size": 4 * TEXT_WIDTH,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 24,
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}
    vision = {"image_size": IMAGE_SIZE, "patch_size": 4, "hidden_size": 128, "intermediate_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_channels": 3}
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=128)


def image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                              image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD), resample=3)


def make_vae():
    from diffusers import AutoencoderKL

    # Three blocks -> two downsamplings: 32x32 pixels <-> 8x8 latents (vae_scale_factor 4).
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=IMAGE_SIZE, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64), norm_num_groups=16,
    )


def make_unet(time_cond_proj_dim: int | None = None):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 4, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(48, 96, 96),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_WIDTH, attention_head_dim=4, norm_num_groups=16,
        time_cond_proj_dim=time_cond_proj_dim,
    )
