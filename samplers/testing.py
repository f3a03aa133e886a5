"""Tiny random-weight pipelines of the real architectures, built in code, for tests and benchmarks.

No weights can be downloaded where diffrl is built and tested, so every code path that runs a real
Stable Diffusion, SDXL or LCM checkpoint is exercised on these: the same diffusers classes
(`UNet2DConditionModel`, `AutoencoderKL`, `CLIPTextModel`, `CLIPTokenizer`, `DDIMScheduler`,
`LCMScheduler`) with a handful of channels. The tokenizer has a handmade character-level vocabulary
(every letter, digit and a little punctuation, as a word piece and as a word end), so any lowercase
English prompt tokenizes without unknown tokens.

Everything is seeded: the same `seed` gives the same weights on every machine.
"""

import string

import torch

# Scheduler settings of the Stable Diffusion 1.x release (scaled-linear betas, steps_offset=1,
# set_alpha_to_one=False), so the tiny pipelines step through the same schedule as the real ones.
SD_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}


def tiny_tokenizer(model_max_length: int = 77):
    """A `CLIPTokenizer` with a 86-entry character vocabulary (no merges)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits + ".,!?'-":
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def _text_config(vocab_size: int, hidden_size: int, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    kwargs = {} if projection_dim is None else {"projection_dim": projection_dim}
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        **kwargs,
    )


def tiny_vae(seed: int = 0, block_out_channels=(8, 16)):
    """`AutoencoderKL` with 4 latent channels; `vae_scale_factor = 2 ** (len(block_out_channels) - 1)`."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_out_channels),
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    )


def tiny_unet(
    seed: int = 0,
    *,
    sample_size: int = 8,
    block_out_channels=(16, 32),
    cross_attention_dim: int = 32,
    time_cond_proj_dim: int | None = None,
    **extra,
):
    """`UNet2DConditionModel` with one cross-attention down/up block; `extra` goes to the config (SDXL keys)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=tuple(block_out_channels),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=4,
        norm_num_groups=8,
        time_cond_proj_dim=time_cond_proj_dim,
        **extra,
    )


def tiny_sd_components(
    seed: int = 0,
    *,
    sample_size: int = 8,
    unet_channels=(16, 32),
    text_hidden_size: int = 32,
    time_cond_proj_dim: int | None = None,
    scheduler: str = "ddim",
    prediction_type: str = "epsilon",
) -> dict:
    """Components of a tiny random `StableDiffusionPipeline` (keyword arguments of its constructor).

    Args:
        seed (`int`, defaults to 0): seeds every module's initialisation.
        sample_size (`int`, defaults to 8): latent side; images are `2 * sample_size` pixels square.
        unet_channels (`tuple[int, int]`): UNet `block_out_channels`.
        text_hidden_size (`int`, defaults to 32): CLIP text width, also the UNet's `cross_attention_dim`.
        time_cond_proj_dim (`int`, *optional*): set (e.g. 32) for an LCM-style UNet with a guidance embedding.
        scheduler (`str`, defaults to `"ddim"`): `"ddim"` or `"lcm"`.
        prediction_type (`str`, defaults to `"epsilon"`): `"epsilon"`, `"v_prediction"` or `"sample"`.
    """
    from diffusers import DDIMScheduler, LCMScheduler
    from transformers import CLIPTextModel

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(_text_config(len(tokenizer), text_hidden_size)).eval()
    schedulers = {  # the scheduler each sampler expects, configured as the SD 1.x / LCM checkpoints ship them
        "ddim": lambda: DDIMScheduler(**SD_SCHEDULER_CONFIG, prediction_type=prediction_type),
        "lcm": lambda: LCMScheduler(**{**SD_SCHEDULER_CONFIG, "steps_offset": 0}, prediction_type=prediction_type,
                                    original_inference_steps=50),
    }
    if scheduler not in schedulers:
        raise ValueError(f"unknown scheduler {scheduler!r}; use one of {', '.join(schedulers)}")
    noise_scheduler = schedulers[scheduler]()
    return {
        "unet": tiny_unet(
            seed + 2,
            sample_size=sample_size,
            block_out_channels=unet_channels,
            cross_attention_dim=text_hidden_size,
            time_cond_proj_dim=time_cond_proj_dim,
        ).eval(),
        "vae": tiny_vae(seed + 3).eval(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": noise_scheduler,
        "safety_checker": None,
        "feature_extractor": None,
        "image_encoder": None,
        "requires_safety_checker": False,
    }


def _round_trip(pipe, tmp_path):
    """Save `pipe` to `tmp_path` and load it back through diffusers' own loader, as users load real ones."""
    if tmp_path is None:
        return pipe
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    absent = {k: None for k, v in pipe.components.items() if v is None}  # diffusers wants them named (SD3 sans T5)
    return type(pipe).from_pretrained(tmp_path, **absent)


def tiny_sd_pipeline(tmp_path=None, seed: int = 0, **kwargs):
    """A tiny random `StableDiffusionPipeline` with a `DDIMScheduler` (SD 1.x schedule), on CPU, fp32.

    With `tmp_path`, the pipeline is saved there and loaded back with `from_pretrained`. `kwargs` go to
    `tiny_sd_components`.
    """
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**tiny_sd_components(seed, **kwargs))
    pipe = _round_trip(pipe, tmp_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_lcm_pipeline(tmp_path=None, seed: int = 0, **kwargs):
    """A tiny random `LatentConsistencyModelPipeline` (UNet with a 32-d guidance embedding, `LCMScheduler`)."""
    from diffusers import LatentConsistencyModelPipeline

    kwargs = {"time_cond_proj_dim": 32, **kwargs}
    pipe = LatentConsistencyModelPipeline(**tiny_sd_components(seed, scheduler="lcm", **kwargs))
    pipe = _round_trip(pipe, tmp_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_pipeline(tmp_path=None, seed: int = 0, sample_size: int = 8):
    """A tiny random `StableDiffusionXLPipeline`: two CLIP text encoders, a `text_time` UNet, DDIM."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(_text_config(len(tokenizer), 16)).eval()
    torch.manual_seed(seed + 4)
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(len(tokenizer), 16, projection_dim=16)).eval()
    addition_time_embed_dim = 8
    unet = tiny_unet(
        seed + 2,
        sample_size=sample_size,
        cross_attention_dim=32,  # hidden states of both encoders, concatenated
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        # pooled text embedding (projection_dim) + 6 micro-conditioning numbers, each embedded
        projection_class_embeddings_input_dim=16 + 6 * addition_time_embed_dim,
        transformer_layers_per_block=1,
    ).eval()
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(seed + 3).eval(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tiny_tokenizer(),
        unet=unet,
        scheduler=DDIMScheduler(**{**SD_SCHEDULER_CONFIG, "timestep_spacing": "leading"}),
        force_zeros_for_empty_prompt=True,
    )
    pipe = _round_trip(pipe, tmp_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Random pipelines by size, for benchmarks: "tiny" is the test pipeline (16x16 images), "small" is the size of
# the embedded tiny-shapes model (32x32 images), "sd15" has Stable Diffusion 1.5's UNet, VAE and text-encoder
# shapes (512x512 images, ~1.1B parameters; meant for a GPU).
RANDOM_PRESETS = ("tiny", "small", "sd15")


def random_sd_pipeline(preset: str = "small", seed: int = 0):
    """A random-weight `StableDiffusionPipeline` (DDIM scheduler, SD 1.x schedule) of the given size preset."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    if preset == "tiny":
        return tiny_sd_pipeline(seed=seed)
    if preset == "small":
        return tiny_sd_pipeline(seed=seed, sample_size=16, unet_channels=(32, 64), text_hidden_size=64)
    if preset != "sd15":
        raise ValueError(f"unknown preset {preset!r}; use one of {RANDOM_PRESETS}")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    text_config = _text_config(len(tokenizer), 768)
    text_config.intermediate_size, text_config.num_hidden_layers, text_config.num_attention_heads = 3072, 12, 12
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=4,
        sample_size=512,
        scaling_factor=0.18215,
    )
    pipe = StableDiffusionPipeline(
        unet=unet.eval(),
        vae=vae.eval(),
        text_encoder=CLIPTextModel(text_config).eval(),
        tokenizer=tokenizer,
        scheduler=DDIMScheduler(**SD_SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ----------------------------------------------------------------------------------------------------------
# Flow-matching pipelines (SD3 and FLUX class): a small transformer, a tiny VAE, tiny CLIP and T5 text towers


def tiny_t5_tokenizer():
    """A `T5Tokenizer` (unigram) over single characters and word-initial characters; no unknown tokens for
    lowercase English prompts."""
    from transformers import T5Tokenizer

    chars = string.ascii_lowercase + string.digits + ".,!?'-"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_t5_encoder(vocab_size: int, d_model: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0,
    )  # fmt: skip
    return T5EncoderModel(config).eval()


def tiny_flow_vae(seed: int, latent_channels: int):
    """`AutoencoderKL` as SD3/FLUX configure theirs (no quant convs, a shift and a scale), 2x downsampling."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    ).eval()  # fmt: skip


def tiny_sd3_pipeline(tmp_path=None, seed: int = 0, *, sample_size: int = 8, shift: float = 3.0, t5: bool = True,
                      patch_size: int = 1):
    """A tiny random `StableDiffusion3Pipeline`: `SD3Transformer2DModel`, two CLIP towers with projection, a T5
    tower (`t5=False` leaves it out and the pipeline feeds zeros; diffusers then loads the saved folder only when
    given `text_encoder_3=None, tokenizer_3=None`) and the SD3 scheduler (`shift` 3.0). `patch_size` 2 is the
    released models' (1 keeps the tiny latents one token per cell)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    clip_tokenizer = tiny_tokenizer()
    towers = []
    for k in range(2):
        torch.manual_seed(seed + 10 + k)
        towers.append(CLIPTextModelWithProjection(_text_config(len(clip_tokenizer), 16, projection_dim=16)).eval())
    t5_tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(seed + 2)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=patch_size, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
        pos_embed_max_size=32,
    ).eval()  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=tiny_flow_vae(seed + 3, 4),
        text_encoder=towers[0],
        tokenizer=clip_tokenizer,
        text_encoder_2=towers[1],
        tokenizer_2=tiny_tokenizer(),
        text_encoder_3=tiny_t5_encoder(len(t5_tokenizer), 32, seed + 4) if t5 else None,
        tokenizer_3=t5_tokenizer if t5 else None,
    )
    pipe = _round_trip(pipe, tmp_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipeline(tmp_path=None, seed: int = 0, *, guidance_embeds: bool = True):
    """A tiny random `FluxPipeline`: `FluxTransformer2DModel` (with the FLUX.1-dev guidance embedding unless
    `guidance_embeds=False`, as FLUX.1-schnell), a CLIP tower (pooled), a T5 tower, FLUX's dynamically shifted
    scheduler. 16x16 images by default are `height=width=16`: latents `[B, 4, 8, 8]`, packed to 16 tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    clip_tokenizer = tiny_tokenizer()
    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(_text_config(len(clip_tokenizer), 16)).eval()
    t5_tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),
    ).eval()  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=tiny_flow_vae(seed + 3, 4),
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=tiny_t5_encoder(len(t5_tokenizer), 32, seed + 4),
        tokenizer_2=t5_tokenizer,
    )
    pipe = _round_trip(pipe, tmp_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
