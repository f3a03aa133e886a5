"""tiny-shapes-flow: a diffusers `StableDiffusion3Pipeline` (rectified flow, an MMDiT transformer) on ShapesWorld.

    python -m diffrl.shapes.train flow

What it shares with tiny-shapes: the VAE's weights (saved again with `shift_factor` 0.0, which SD3's decode needs as
a number) and tiny-shapes-clip's text tower, here as a `CLIPTextModelWithProjection` (SD3 reads the penultimate
hidden states and the projected pooled embedding). SD3 has two CLIP towers; both are that one tower: the folder
stores it once and says so in `model_index.json` (`_diffrl_shared_components`, which diffrl's loader reads; in plain
diffusers pass `text_encoder_2=pipe_text_encoder, tokenizer_2=tokenizer`). There is no T5 (`text_encoder_3` None)
and no T5 tokens: the model is trained with `max_sequence_length=0` (recorded as `_diffrl_max_sequence_length`, which
diffrl's flow sampler uses; plain diffusers needs `pipe(..., max_sequence_length=0)`, since its default of 256 zero
tokens is context the transformer never saw).

Objective (Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024, eqs. 1-3
and §3.1): x_σ = (1 − σ)·x0 + σ·ε, the transformer predicts v = ε − x0 at timestep σ·1000, plain MSE; σ drawn from
the logit-normal (0, 1) the paper found best (rf/lognorm(0.00, 1.00)). Caption dropout to the empty prompt's
embeddings trains the unconditional branch classifier-free guidance needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffrl.shapes.tokenizer import load_tokenizer
from diffrl.shapes.train_common import diffusers_version, encoded_train_set, run_loop, save_fp16

# The flow model's size: 8x8 latents in 64 tokens (patch 1), 5 joint-attention blocks of width 128 (4 heads).
FLOW_TRANSFORMER = {
    "sample_size": 8, "patch_size": 1, "in_channels": 4, "out_channels": 4, "num_layers": 5,
    "attention_head_dim": 32, "num_attention_heads": 4, "joint_attention_dim": 256, "caption_projection_dim": 128,
    "pooled_projection_dim": 256, "pos_embed_max_size": 8, "qk_norm": "rms_norm",
}
# σ schedule: no shift (SD3's shift 3.0 is for 4096-token images; 64 tokens need none).
FLOW_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 1.0}
MAX_SEQUENCE_LENGTH = 0  # T5 tokens: none (there is no T5)
SHARED_COMPONENTS = {"text_encoder_2": "text_encoder", "tokenizer_2": "tokenizer"}


def make_flow_transformer():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**FLOW_TRANSFORMER)


def flow_text_parts(clip_dir: Path, vae_dir: Path):
    """The frozen tokenizer, text tower (with projection) and VAE (shift_factor 0.0) of tiny-shapes-flow."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPModel, CLIPTextModelWithProjection

    clip = CLIPModel.from_pretrained(clip_dir, dtype=torch.float32)
    config = clip.config.text_config
    config.projection_dim = clip.config.projection_dim  # the text config alone would default to 512
    text_encoder = CLIPTextModelWithProjection(config)
    text_encoder.text_model.load_state_dict(clip.text_model.state_dict())
    text_encoder.text_projection.load_state_dict(clip.text_projection.state_dict())
    vae = AutoencoderKL.from_pretrained(vae_dir, dtype=torch.float32)
    vae.register_to_config(shift_factor=0.0)
    return load_tokenizer(clip_dir), text_encoder.eval().requires_grad_(False), vae.eval().requires_grad_(False)


def assemble_pipeline(transformer, vae, text_encoder, tokenizer):
    """A `StableDiffusion3Pipeline` of these parts, the text tower serving as both CLIP towers."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler.from_config(FLOW_SCHEDULER_CONFIG),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder, tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
    )


def train_flow(args):
    import torch
    from diffusers.training_utils import EMAModel

    tokenizer, text_encoder, vae = flow_text_parts(Path(args.clip_dir), Path(args.vae_dir))
    torch.manual_seed(args.seed)
    transformer = make_flow_transformer()
    pipe = assemble_pipeline(transformer, vae, text_encoder, tokenizer)

    @torch.no_grad()
    def encode_text(captions):
        # The pipeline's own encoder, so training sees exactly what sampling feeds the transformer.
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, device=torch.device("cpu"),
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=MAX_SEQUENCE_LENGTH)
        return {"embeds": embeds.half(), "pooled": pooled.half()}

    data = encoded_train_set(args, vae, tokenizer, text_encoder, encode_text=encode_text, tag="-flow")
    empty = {k: v.float() for k, v in encode_text([""]).items()}
    ema = EMAModel(transformer.parameters(), decay=args.ema_decay, use_ema_warmup=True)

    def step_fn(step, gen):
        idx = torch.randint(0, len(data["mean"]), (args.batch_size,), generator=gen)
        mean, std = data["mean"][idx].float(), data["std"][idx].float()
        x0 = (mean + std * torch.randn(mean.shape, generator=gen)) * vae.config.scaling_factor  # shift_factor 0
        caption = data["caption_index"][idx]
        embeds, pooled = data["embeds"][caption].float(), data["pooled"][caption].float()
        drop = torch.rand(len(x0), generator=gen) < args.cond_dropout
        embeds = torch.where(drop[:, None, None], empty["embeds"].expand_as(embeds), embeds)
        pooled = torch.where(drop[:, None], empty["pooled"].expand_as(pooled), pooled)
        sigma = torch.sigmoid(torch.randn(len(x0), generator=gen))  # logit-normal(0, 1)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        pred = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds,
                           pooled_projections=pooled, return_dict=False)[0]
        mse = (pred - (noise - x0)).pow(2).mean()
        return {"loss": mse}

    ema_state = {
        "load": lambda s: ema.load_state_dict(s["ema"]),
        "save": lambda s: s.update(ema=ema.state_dict()),
        "after_step": lambda: ema.step(transformer.parameters()),
    }

    def export():
        ema.copy_to(transformer.parameters())
        save_flow_pipeline(transformer, vae, text_encoder, tokenizer, Path(args.out))

    run_loop(args, "flow", {"transformer": transformer}, list(transformer.parameters()), step_fn, export, ema_state)


def save_flow_pipeline(transformer, vae, text_encoder, tokenizer, out: Path):
    """Writes tiny-shapes-flow's folder: fp16 weights, the text tower once (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler


    out.mkdir(parents=True, exist_ok=True)
    for sub, module in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)):
        save_fp16(module, out / sub)
    tokenizer.save_pretrained(out / "tokenizer")
    FlowMatchEulerDiscreteScheduler.from_config(FLOW_SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    index = {
        "_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers_version(),
        "_diffrl_shared_components": SHARED_COMPONENTS, "_diffrl_max_sequence_length": MAX_SEQUENCE_LENGTH,
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "text_encoder_3": [None, None],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": [None, None], "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
