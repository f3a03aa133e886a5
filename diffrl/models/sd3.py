"""The SD3 family: Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`), an MMDiT rectified-flow transformer with
CLIP-L, CLIP-G and T5 text towers and classifier-free guidance as an unconditional batch half.

Differs from FLUX.1 (`flux.py`) in: unpacked latents patchified inside the transformer (`patch_size`), CFG with a
negative prompt instead of embedded guidance, and the schedule shift (static `shift`, μ only with
`use_dynamic_shifting`). The forward process and target are rectified flow's (`flow.RectifiedFlowProcess`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diffrl.errors import UserError
from diffrl.models.base import (
    SIZE_ARGUMENTS,
    Conditioning,
    SamplingSize,
    checked_size,
    combine_guidance,
    component_config,
    decode_latents,
    kl_vae_factor,
    prompt_list,
    prompt_strings,
    run_denoiser,
    step_dtype,
    with_uncond,
)
from diffrl.models.flow import (
    encode_distinct,
    rectified_flow_process,
    sequence_length,
    shifted_schedule_kwargs,
    transformer_denoiser,
)


def sampling_size(index: Mapping, transformer: Mapping, vae: Mapping, height: int | None = None,
                  width: int | None = None, num_frames: int | None = None, *,
                  keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The SD3 family's size rule, from the pipeline's (`index`: its config or model_index.json), the transformer's
    and the VAE's configs: each side the caller's, else the folder's `_diffrl_height` / `_diffrl_width`, else the
    transformer's `sample_size` × the VAE factor (`StableDiffusion3Pipeline.default_sample_size`); a multiple of
    the VAE factor × `patch_size` (what its `check_inputs` asks). `SD3Family.latent_shape` calls it with the loaded
    pipeline's configs, `diffrl.pipelines.check_sampling_size` with the folder's."""
    factor, patch = kl_vae_factor(vae), transformer["patch_size"]
    default = transformer["sample_size"] * factor
    return checked_size(index, height, width, num_frames, model=f"SD3 (VAE factor {factor} × patch size {patch})",
                        default=(default, default), multiple=factor * patch, keys=keys)


class SD3Family:
    name = "sd3"
    flow = True
    denoiser_class = "SD3Transformer2DModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)
    default_guidance_scale = 7.0  # StableDiffusion3Pipeline's CFG scale

    def __init__(self, pipe):
        self.pipe = pipe

    @staticmethod
    def matches(pipe) -> bool:
        return type(getattr(pipe, "transformer", None)).__name__ == "SD3Transformer2DModel"

    denoiser = property(transformer_denoiser)
    process = property(rectified_flow_process)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Classifier-free guidance (an unconditional batch half) iff scale > 1, as diffusers."""
        return guidance_scale > 1

    def latent_shape(self, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
        """`(C, h, w)` of the latents and the image `(H, W)`. Defaults: the folder's `_diffrl_height` and
        `_diffrl_width` where its model_index.json has them (`diffrl.pipelines`), else the transformer's `sample_size`'s;
        refused as `sampling_size` says."""
        pipe, config = self.pipe, self.pipe.transformer.config
        vae = component_config(pipe, "vae")
        height, width, _ = sampling_size(pipe.config, config, vae, height, width)
        scale = kl_vae_factor(vae)
        return (config.in_channels, height // scale, width // scale), height, width

    def schedule_kwargs(self, num_steps: int, latent_hw: tuple[int, int]) -> dict:
        """What `StableDiffusion3Pipeline` passes to `set_timesteps` (diffusers 0.42)."""
        patch = self.pipe.transformer.config.patch_size
        seq_len = (latent_hw[0] // patch) * (latent_hw[1] // patch)
        return shifted_schedule_kwargs(self.pipe.scheduler.config, num_steps, seq_len, flux_sigmas=False,
                                       max_shift=1.16)

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
        """Encode prompts with the pipeline's own `encode_prompt` (CLIP + T5 towers), without gradients; each
        distinct (prompt, negative prompt) once (`flow.encode_distinct`)."""
        prompts, batch = prompt_list(prompts, prompt_embeds)
        embeds_given = prompt_embeds is not None or negative_prompt_embeds is not None
        repeated = encode_distinct(self.encode, prompts, negative_prompt, embeds_given, guidance_scale=guidance_scale,
                                   max_sequence_length=max_sequence_length)
        if repeated is not None:
            return repeated
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise UserError("a flow pipeline needs pooled_prompt_embeds along with prompt_embeds")
        if isinstance(negative_prompt, str):
            negative_prompt = [negative_prompt] * batch
        device = self.pipe.transformer.device
        guided = self.uses_cfg(guidance_scale)
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=None if prompt_embeds is not None else list(prompts), prompt_2=None, prompt_3=None, device=device,
            num_images_per_prompt=1, do_classifier_free_guidance=guided, negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds, negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            **sequence_length(self.pipe, max_sequence_length),
        )  # fmt: skip
        cond = Conditioning(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative if guided else None,
            pooled_prompt_embeds=pooled,
            negative_pooled_prompt_embeds=negative_pooled if guided else None,
        )
        return cond.to(device), prompt_strings(prompts, batch)

    def model_output(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
        dtype: torch.dtype | None = None, *, detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The velocity for latents `x` (`[N, C, h, w]`) at model timestep `t` (σ·1000; a scalar or `[N]`) after
        CFG, in fp32: one batched call on [x; x] with [unconditional; conditional] text when guided,
        v = v_u + s·(v_c − v_u). `detach_uncond` (flow_grpo's `compute_log_prob`: no gradient through v_u) runs the
        two branches as separate calls, v_u's without a graph: the backward then covers half the batch. The
        rollout passes it too, so rollout and training make the same calls and their numbers agree exactly (a
        batch of 2N and two batches of N differ at float rounding)."""
        transformer = self.pipe.transformer
        dtype = dtype or transformer.dtype
        if cond.guided and detach_uncond:
            return self._separate_branches(x.to(dtype), t, cond, guidance_scale, dtype)
        text = cond.cached(("sd3", dtype), lambda: {
            "encoder_hidden_states": with_uncond(cond.negative_prompt_embeds, cond.prompt_embeds, cond.guided, dtype),
            "pooled_projections": with_uncond(cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds,
                                              cond.guided, dtype),
        })
        model_input = x.to(dtype)
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])  # one timestep for the batch, or one per sample
        if cond.guided:
            model_input, t = torch.cat([model_input, model_input]), torch.cat([t, t])
        output = run_denoiser(transformer, hidden_states=model_input, timestep=t, return_dict=False, **text)[0]
        return combine_guidance(output, cond.guided, guidance_scale, detach_uncond)

    def _separate_branches(self, x: torch.Tensor, t, cond: Conditioning, guidance_scale: float, dtype) -> torch.Tensor:
        transformer = self.pipe.transformer
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])

        def call(embeds, pooled):
            out = run_denoiser(transformer, hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(dtype),
                              pooled_projections=pooled.to(dtype), return_dict=False)[0]
            return out.to(step_dtype(out.dtype))

        with torch.no_grad():
            uncond = call(cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds)
        conditional = call(cond.prompt_embeds, cond.pooled_prompt_embeds)
        return uncond + guidance_scale * (conditional - uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.pipe, latents)
