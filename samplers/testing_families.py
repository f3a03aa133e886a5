"""Tiny random-weight pipelines of the families issue 26 adds, built in code: Qwen-Image, FLUX.2 and Wan 2.x
text-to-video, for tests (tests/models/) and benchmarks (`samplers.random_real` builds the released sizes from them).

Nothing is downloaded: every tokenizer is made here (a byte-level BPE whose merges are learned, deterministically,
from a few sentences with the `tokenizers` trainer; Wan's UMT5 uses the character T5 tokenizer of
`samplers.testing`), every model is the diffusers / transformers class of the real checkpoint with a handful of
channels, seeded. The saved folders are ~1-3 MB and load with `diffrl.load_pipeline(folder)` or plain
`DiffusionPipeline.from_pretrained(folder)`.

- `tiny_qwenimage_pipeline(folder=None, seed=0)`: `QwenImagePipeline` = `QwenImageTransformer2DModel` (patch 2),
  `AutoencoderKLQwenImage` (4 latent channels, spatial factor 4, non-trivial `latents_mean`/`latents_std`),
  `Qwen2_5_VLForConditionalGeneration` (2 text layers, tiny vision tower) with a `Qwen2Tokenizer` whose prompt
  template prefix is 34 tokens long, as the real tokenizer's (the pipeline drops exactly 34), and
  FlowMatchEulerDiscreteScheduler with Qwen-Image's dynamic shift settings.
- `tiny_flux2_pipeline(folder=None, seed=0)`: `Flux2Pipeline` = `Flux2Transformer2DModel` (embedded guidance),
  `AutoencoderKLFlux2` (4 latent channels, 2x2 patchified to 16, BatchNorm statistics set to non-trivial values),
  a 30-layer `Mistral3ForConditionalGeneration` (the pipeline stacks hidden states 10, 20 and 30 by default, so
  the default call works) and a `PixtralProcessor` with a Mistral-style chat template.
- `tiny_wan_pipeline(folder=None, seed=0, two_experts=False)`: `WanPipeline` = `WanTransformer3DModel`,
  `AutoencoderKLWan` (temporal factor 2, spatial factor 4; the real one 4 and 8), `UMT5EncoderModel`; `two_experts=True` adds
  `transformer_2` and `boundary_ratio` as Wan 2.2 A14B.

`TINY_CALL[family]`: the small call kwargs (height, width, frames, sequence length) that fit each tiny pipeline;
`tiny_family(family, folder, seed)` builds and saves one by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from samplers.testing import tiny_t5_tokenizer

FAMILIES = ("qwenimage", "flux2", "wan")

# small call kwargs that fit the tiny pipelines (the real defaults are 1024 px / 81 frames)
TINY_CALL = {
    "qwenimage": {"height": 32, "width": 32},  # latents [B, 1, 4, 8, 8] -> 16 tokens of 16 channels
    "flux2": {"height": 32, "width": 32, "max_sequence_length": 64},  # latents [B, 16, 8, 8] -> 64 tokens
    "wan": {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": 32},  # latents [B, 4, 3, 8, 8]
}

_WORDS = (
    "a photo of the cat dog horse bird car tree house city street mountain river sea beach sky sun moon star "
    "red green blue yellow black white orange purple pink brown gray small large big tiny old young happy sad "
    "running jumping sitting standing flying swimming dancing painting picture drawing portrait landscape night "
    "day morning evening winter summer spring autumn snow rain forest garden flower flowers field person man "
    "woman child children people group two three four five one in on with and at by under over near next to "
    "circle square triangle shape shapes color colors is are an its"
)

# the byte-level pre-tokenizer regex of Qwen2 (transformers' tokenization_qwen2.PRETOKENIZE_REGEX)
_QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _byte_bpe(corpus: list[str], special_tokens: list[str] = (), vocab_size: int = 1024):
    """(vocab, merges, tokenizer) of a byte-level BPE learned from `corpus`: all 256 bytes, then merges until every
    word of the corpus is one token. Deterministic (same corpus, same vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus * 2, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges, tok


# ----------------------------------------------------------------------------------------------------------------
# Qwen-Image

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
QWEN_IMAGE_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)


def tiny_qwen2_tokenizer():
    """A `Qwen2Tokenizer` (byte-level BPE, Qwen2's pre-tokenizer, the Qwen chat special tokens) whose merges make the
    Qwen-Image prompt template's prefix 34 tokens, as `QwenImagePipeline.prompt_template_encode_start_idx` expects."""
    from transformers import Qwen2Tokenizer

    corpus = [QWEN_IMAGE_TEMPLATE_PREFIX.replace("<|im_start|>", "").replace("<|im_end|>", ""), "system user assistant",
              _WORDS]  # fmt: skip
    vocab, merges, _ = _byte_bpe(corpus)
    vocab = {k: v for k, v in vocab.items()}
    for token in QWEN_SPECIAL:  # ids after the BPE vocabulary, as in the real tokenizer
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_tokens(QWEN_SPECIAL[1:], special_tokens=True)
    return tokenizer


def tiny_qwen2_5_vl(tokenizer, hidden_size: int, seed: int):
    """A `Qwen2_5_VLForConditionalGeneration` with 2 text layers (mrope) and a 1-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
            "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [1, 1, 2]},
            "rope_theta": 1000000.0, "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
        },
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
        vocab_size=len(tokenizer), image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwenimage_pipeline(folder=None, seed: int = 0):
    """A tiny random `QwenImagePipeline`; saved to `folder` when given."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = tiny_qwen2_tokenizer()
    text_encoder = tiny_qwen2_5_vl(tokenizer, hidden_size=16, seed=seed + 1)
    torch.manual_seed(seed + 2)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.8, 2.0, 1.2],
    ).eval()  # fmt: skip
    # Qwen/Qwen-Image's scheduler config: exponential time shift, mu from calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, time_shift_type="exponential", shift_terminal=0.02,
    )  # fmt: skip
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    return _finish(pipe, folder)


# ----------------------------------------------------------------------------------------------------------------
# FLUX.2

# the special tokens of Mistral-Small-3.1's tekken tokenizer, at their real ids 0..18
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                   "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]  # fmt: skip

# Mistral-Small-3.1's layout ([SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]) for text content; images are not
# placed (the tiny processor serves text-to-image prompts, which is all Flux2Pipeline encodes without upsampling)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tiny_pixtral_processor():
    """A `PixtralProcessor`: a byte-level BPE tokenizer with Mistral's special tokens (pad `<pad>` = 11, `[IMG]` =
    10), a `PixtralImageProcessor` and a Mistral-style chat template."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    _, _, tok = _byte_bpe([SYSTEM_MESSAGE, _WORDS], special_tokens=MISTRAL_SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=131072, extra_special_tokens={},
    )  # fmt: skip
    tokenizer.add_tokens(MISTRAL_SPECIAL[3:], special_tokens=True)
    image_processor = PixtralImageProcessor(patch_size=14, size={"longest_edge": 56})
    return PixtralProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14, spatial_merge_size=2,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )  # fmt: skip


def tiny_mistral3(processor, hidden_size: int, num_layers: int, seed: int):
    """A `Mistral3ForConditionalGeneration` with `num_layers` text layers and a 1-layer Pixtral vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = processor.tokenizer
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    config = Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": hidden_size, "head_dim": 8,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 2048, "rope_theta": 1000000000.0,
            "sliding_window": None, "rms_norm_eps": 1e-5, **special,
        },
        vision_config={
            "model_type": "pixtral", "hidden_size": 16, "head_dim": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "image_size": 56, "patch_size": 14,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, **special,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).eval()


def tiny_flux2_pipeline(folder=None, seed: int = 0):
    """A tiny random `Flux2Pipeline` (FLUX.2-dev layout: embedded guidance, Mistral-3 text stack); saved to `folder`
    when given."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    processor = tiny_pixtral_processor()
    text_hidden = 16
    text_encoder = tiny_mistral3(processor, hidden_size=text_hidden, num_layers=30, seed=seed + 1)
    torch.manual_seed(seed + 2)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * text_hidden, timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 4)  # latent statistics a trained VAE would have, not 0 and 1
    vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=generator))
    # FLUX.2-dev's released scheduler config (mu comes from the pipeline's compute_empirical_mu)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )  # fmt: skip
    pipe = Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor, transformer=transformer
    )
    return _finish(pipe, folder)


# ----------------------------------------------------------------------------------------------------------------
# Wan 2.1 / 2.2 text-to-video


def tiny_umt5_encoder(vocab_size: int, d_model: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, feed_forward_proj="gated-gelu",
    )  # fmt: skip
    return UMT5EncoderModel(config).eval()


def tiny_wan_pipeline(folder=None, seed: int = 0, *, two_experts: bool = False, scheduler: str = "euler"):
    """A tiny random `WanPipeline` (Wan 2.1 T2V layout; `two_experts=True`: Wan 2.2 A14B's high-noise `transformer`
    and low-noise `transformer_2` switched at `boundary_ratio` 0.875); saved to `folder` when given.

    `scheduler="euler"`: `FlowMatchEulerDiscreteScheduler(shift=5.0)`, the ODE a flow sampler steps (the default, so
    a sampler's ODE can be compared with the pipeline's output); `"unipc"`: the scheduler the released
    Wan2.1-T2V-1.3B-Diffusers folder ships, `UniPCMultistepScheduler` with flow sigmas and `flow_shift=3.0`."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    tokenizer = tiny_t5_tokenizer()
    text_encoder = tiny_umt5_encoder(len(tokenizer), 32, seed + 1)

    def transformer(k):
        torch.manual_seed(seed + 2 + 10 * k)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).eval()  # fmt: skip

    torch.manual_seed(seed + 3)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.8, 2.0, 1.2], scale_factor_temporal=2,
        scale_factor_spatial=4,
    ).eval()  # fmt: skip
    if scheduler == "unipc":
        noise_scheduler = UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
            solver_order=2, solver_type="bh2", final_sigmas_type="zero",
        )  # fmt: skip
    elif scheduler == "euler":  # Wan's sample_shift for T2V is 5.0 in the Wan repo (3.0 suggested for 480p)
        noise_scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    else:
        raise ValueError(f"scheduler must be 'euler' or 'unipc', got {scheduler!r}")
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=noise_scheduler, transformer=transformer(0),
        transformer_2=transformer(1) if two_experts else None, boundary_ratio=0.875 if two_experts else None,
    )  # fmt: skip
    return _finish(pipe, folder)


# ----------------------------------------------------------------------------------------------------------------

BUILDERS = {"qwenimage": tiny_qwenimage_pipeline, "flux2": tiny_flux2_pipeline, "wan": tiny_wan_pipeline}


def tiny_family(family: str, folder, seed: int = 0, **kwargs) -> Path:
    """Build the tiny pipeline of `family` (one of FAMILIES) and save it to `folder`; returns the folder."""
    BUILDERS[family](folder, seed, **kwargs)
    return Path(folder)


def _finish(pipe, folder):
    pipe.set_progress_bar_config(disable=True)
    if folder is not None:
        pipe.save_pretrained(folder)
    return pipe


def folder_size(folder) -> int:
    """Bytes under `folder`."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
