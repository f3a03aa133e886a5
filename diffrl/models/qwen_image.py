"""The Qwen-Image family (`QwenImagePipeline`): a rectified-flow MMDiT (`QwenImageTransformer2DModel`) over 2x2-packed
latent tokens, a Qwen2.5-VL text encoder, and "true" classifier-free guidance whose guided prediction is rescaled to
the conditional prediction's per-token norm.

Follows diffusers 0.42's `pipelines/qwenimage/pipeline_qwenimage.py`. What differs from the other flow families:
- text: the last hidden state of Qwen2.5-VL on a chat template, its first 34 (system) tokens dropped, each batch
  padded to its longest prompt with a mask (`Conditioning.prompt_embeds_mask`; the transformer is given None when
  a batch has no padding, as the pipeline does). No pooled embedding;
- guidance: two transformer calls (conditional, unconditional) as the pipeline makes them, then
  v = u + s·(c − u) rescaled per token to ‖c‖: v·‖c‖/‖v‖, the norms over each packed token's 4C channels.
  `detach_uncond` stops the gradient through u only; c reaches the output through both the combination and ‖c‖.
  diffusers guides only when a negative prompt is given (`true_cfg_scale` > 1); here, as for SD3, guidance runs
  iff the scale is > 1 and the negative prompt defaults to "" (pass " ", the model card's, in a recipe);
- schedule: σ = linspace(1, 1/T, T) and μ = calculate_shift(seq_len) with the scheduler config's constants (Qwen-Image:
  256, 8192, 0.5, 0.9); the config's exponential time shift and `shift_terminal` are the scheduler's own;
- latents: unpacked `[B, C, h, w]` here (C = 16 on the real model), packed as FLUX.1's tokens only for the transformer
  (the pipeline's `latents=` and `output_type="latent"` are the packed `[B, h/2·w/2, 4C]`); the VAE is a video VAE:
  de-normalised per channel (x·std + mean), decoded as one frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diffrl.errors import UserError
from diffrl.models.base import (
    SIZE_ARGUMENTS,
    Conditioning,
    SamplingSize,
    component_config,
    module_dtype,
    prompt_list,
    prompt_strings,
    run_denoiser,
    step_dtype,
)
from diffrl.models.flow import encode_distinct, rectified_flow_process, sequence_length, transformer_denoiser
from diffrl.models.flux import pack, packed_latent_shape, packed_sampling_size, packed_schedule_kwargs, unpack

CALL_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s text length (its encode_prompt's own default is 1024)


def guide_renormalised(conditional: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG on packed outputs `[N, tokens, 4C]`: v = u + s·(c − u), then v·‖c‖/‖v‖ per token."""
    combined = uncond + scale * (conditional - uncond)
    return combined * (conditional.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


def vae_factor(vae: Mapping) -> int:
    """`QwenImagePipeline.vae_scale_factor` (diffusers 0.42): 2^len(temperal_downsample) of its VAE, 8 without
    one."""
    return 2 ** len(vae["temperal_downsample"]) if vae else 8


def sampling_size(index: Mapping, transformer: Mapping, vae: Mapping, height: int | None = None,
                  width: int | None = None, num_frames: int | None = None, *,
                  keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The Qwen-Image family's size rule from the pipeline's (`index`: its config or model_index.json), the
    transformer's and the VAE's configs (`flux.packed_sampling_size` with `vae_factor`). `QwenImageFamily.
    latent_shape` calls it with the loaded pipeline's configs, `diffrl.pipelines.check_sampling_size` with the
    folder's."""
    return packed_sampling_size(index, vae_factor(vae), "Qwen-Image", height, width, num_frames, keys)


class QwenImageFamily:
    name = "qwen_image"
    flow = True
    denoiser_class = "QwenImageTransformer2DModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)
    default_guidance_scale = 4.0  # QwenImagePipeline's true_cfg_scale

    def __init__(self, pipe):
        if type(pipe).__name__ != "QwenImagePipeline":
            raise UserError(f"{type(pipe).__name__} is not supported: diffrl runs Qwen-Image text-to-image "
                            "(QwenImagePipeline) only")  # fmt: skip
        if pipe.transformer.config.guidance_embeds:
            raise UserError("a guidance-distilled Qwen-Image transformer (guidance_embeds) is not supported yet")
        self.pipe = pipe

    @staticmethod
    def matches(pipe) -> bool:
        return type(getattr(pipe, "transformer", None)).__name__ == "QwenImageTransformer2DModel"

    denoiser = property(transformer_denoiser)
    process = property(rectified_flow_process)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """True CFG (an unconditional call per step) iff scale > 1."""
        return guidance_scale > 1

    def latent_shape(self, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
        """`(C, h, w)` of the unpacked latents and the image `(H, W)`. Defaults: the folder's `_diffrl_height` and
        `_diffrl_width` where its model_index.json has them (`diffrl.pipelines`), else `default_sample_size`'s (1024);
        refused as `sampling_size` says."""
        pipe, vae = self.pipe, component_config(self.pipe, "vae")
        size = sampling_size(pipe.config, pipe.transformer.config, vae, height, width)
        return packed_latent_shape(pipe, size, vae_factor(vae))

    def schedule_kwargs(self, num_steps: int, latent_hw: tuple[int, int]) -> dict:
        """What `QwenImagePipeline` passes to `set_timesteps`: σ = linspace(1, 1/T, T) and μ from the token count."""
        return packed_schedule_kwargs(self.pipe.scheduler.config, num_steps, latent_hw)

    @torch.no_grad()
    def encode(
        self,
        prompts: Sequence[str] | str | None,
        *,
        guidance_scale: float,
        height: int | None = None,
        width: int | None = None,
        negative_prompt: Sequence[str] | str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        max_sequence_length: int | None = None,
    ) -> tuple[Conditioning, list[str]]:
        """Encode prompts with the pipeline's own `encode_prompt` (Qwen2.5-VL), without gradients; each distinct
        (prompt, negative prompt) once. Precomputed `prompt_embeds` are taken as all text (no padding)."""
        prompts, batch = prompt_list(prompts, prompt_embeds)
        if pooled_prompt_embeds is not None or negative_pooled_prompt_embeds is not None:
            raise UserError("Qwen-Image has no pooled text embedding; pass prompt_embeds only")
        embeds_given = prompt_embeds is not None or negative_prompt_embeds is not None
        repeated = encode_distinct(self.encode, prompts, negative_prompt, embeds_given, guidance_scale=guidance_scale,
                                   max_sequence_length=max_sequence_length)
        if repeated is not None:
            return repeated
        device = self.pipe.transformer.device
        length = sequence_length(self.pipe, max_sequence_length) or {"max_sequence_length": CALL_MAX_SEQUENCE_LENGTH}
        embeds, mask = self._encode(None if prompt_embeds is not None else list(prompts), prompt_embeds, length)
        negative = negative_mask = None
        if self.uses_cfg(guidance_scale):
            if isinstance(negative_prompt, str) or negative_prompt is None:
                negative_prompt = [negative_prompt or ""] * batch
            given = negative_prompt_embeds is not None
            negative, negative_mask = self._encode(None if given else list(negative_prompt), negative_prompt_embeds,
                                                   length)
        cond = Conditioning(prompt_embeds=embeds, negative_prompt_embeds=negative, prompt_embeds_mask=mask,
                            negative_prompt_embeds_mask=negative_mask)
        return cond.to(device), prompt_strings(prompts, batch)

    def _encode(self, prompts, embeds, length: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """`(embeds [B, L, D], mask [B, L] int64)`; the pipeline returns no mask for an unpadded batch."""
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.pipe.transformer.device,
                                               num_images_per_prompt=1, prompt_embeds=embeds, **length)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask.long()

    def model_output(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
        dtype: torch.dtype | None = None, *, detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The velocity for latents `x` (`[N, C, h, w]`) at model timestep `t` (σ·1000; a scalar or `[N]`), in fp32:
        `x` packed into tokens, the transformer fed σ; when guided, the unconditional call and the renormalised
        combination (`guide_renormalised`). With `detach_uncond` the unconditional call runs without a graph."""
        transformer = self.pipe.transformer
        dtype = dtype or transformer.dtype
        text = cond.cached(("qwen_image", dtype), lambda: {
            "conditional": _text_kwargs(cond.prompt_embeds, cond.prompt_embeds_mask, dtype),
            "uncond": _text_kwargs(cond.negative_prompt_embeds, cond.negative_prompt_embeds_mask, dtype),
        })
        n, _, h, w = x.shape
        tokens = pack(x.to(dtype))
        timestep = torch.as_tensor(t, device=x.device).expand(n).to(dtype) / 1000

        def call(kwargs):
            out = run_denoiser(transformer, hidden_states=tokens, timestep=timestep, guidance=None, img_shapes=[[(1, h // 2, w // 2)]] * n,
                              return_dict=False, **kwargs)[0]
            return out.to(step_dtype(out.dtype))

        output = call(text["conditional"])
        if cond.guided:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_uncond):
                uncond = call(text["uncond"])
            output = guide_renormalised(output, uncond, guidance_scale)
        return unpack(output, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images `[B, 3, H, W]` in [0, 1], differentiably: x·std + mean per channel (the pipeline's `x / (1/std)`),
        decoded as a one-frame video, frame 0."""
        vae = self.pipe.vae
        config = vae.config
        view = (1, config.z_dim, 1, 1)
        mean = torch.tensor(config.latents_mean).view(view).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(view).to(latents.device, latents.dtype)
        z = latents / inverse_std + mean
        image = vae.decode(z[:, :, None].to(module_dtype(vae)), return_dict=False)[0][:, :, 0]
        return (image.to(step_dtype(image.dtype)) / 2 + 0.5).clamp(0, 1)


def _text_kwargs(embeds: torch.Tensor | None, mask: torch.Tensor | None, dtype) -> dict | None:
    """The transformer's text arguments; the mask is None for a batch without padding, as the pipeline passes it."""
    if embeds is None:
        return None
    if mask is not None and bool(mask.all()):
        mask = None
    return {"encoder_hidden_states": embeds.to(dtype), "encoder_hidden_states_mask": mask}
