"""The Wan 2.1 / 2.2 A14B text-to-video family (`WanPipeline`): a rectified-flow video DiT over latents `[B, C, F', h, w]` (a
causal 3-D VAE: F' = (F − 1)/temporal + 1 latent frames), UMT5 text, and classifier-free guidance as two separate
transformer calls. Follows diffusers 0.42's `pipelines/wan/pipeline_wan.py` (`WanPipeline.__call__`).

Differs from the image families (`sd3.py`, `flux.py`) in:
- latents carry a frame axis and are never packed (the transformer's Conv3d patch embed is internal);
- the transformer is fed the raw timestep t = σ·1000 (SD3 too; FLUX's is divided by 1000);
- text: UMT5 hidden states cut to each prompt's length and zero-padded to `max_sequence_length` (512 in the
  pipeline's `__call__`, though `encode_prompt` defaults to 226), no pooled embedding, no mask;
- CFG whenever `guidance_scale > 1`, with `""` as the default negative prompt, computed as the pipeline does it:
  one conditional call, then one unconditional call (not one batch of both), v = v_u + s·(v_c − v_u);
- the schedule is a static shift: with the `FlowMatchEulerDiscreteScheduler` a folder ships, `set_timesteps(N)`
  exactly as the pipeline calls it (which shifts σ_min twice: `__init__` shifts the training σ, `set_timesteps` shifts
  its linspace again); with the `UniPCMultistepScheduler(use_flow_sigmas=True)` the released Wan 2.1 folders ship,
  the flow sampler steps Euler (or Flow-GRPO's SDE) on UniPC's own σ grid, `flow_shift`·σ/(1 + (`flow_shift` − 1)·σ)
  for σ = linspace(1, 1/1000, N + 1)[:-1] — the grid is UniPC's, the solver is not (UniPC is a 2nd-order multistep
  method, so its ODE output differs from ours);
- decoding returns frames `[B, F, 3, H, W]` in [0, 1] (the pipeline's `output_type="pt"`), so rewards get videos:
  score them with a per-frame reward aggregated over frames (`rewards.video`).

Wan 2.2 A14B (two experts): `model_output` picks the expert per sample as the pipeline does — `transformer` where
t ≥ `boundary_ratio`·1000, `transformer_2` below — with the one `guidance_scale` for both (the pipeline's default
`guidance_scale_2`). The trainers fine-tune `denoiser`, the high-noise `transformer` (as Flow-Factory's default
`target_components`); `transformer_2` is frozen (`requires_grad_(False)` when the family is built), so steps below
the boundary train nothing (a loss over them backpropagates zero). Wan 2.2 TI2V-5B (`expand_timesteps`, a per-token
timestep) is refused.

The forward process and target are rectified flow's (`flow.RectifiedFlowProcess`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from diffrl.errors import UserError
from diffrl.models.base import (
    SIZE_ARGUMENTS,
    Conditioning,
    SamplingSize,
    checked_size,
    component_config,
    module_dtype,
    prompt_list,
    prompt_strings,
    run_denoiser,
    step_dtype,
)
from diffrl.models.flow import (
    encode_distinct,
    rectified_flow_process,
    sequence_length,
    transformer_denoiser,
)

# `WanPipeline.__call__`'s defaults (diffusers 0.42): 480x832, 81 frames, 512 text tokens
DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES, DEFAULT_MAX_SEQUENCE_LENGTH = 480, 832, 81, 512


def vae_factors(vae: Mapping) -> tuple[int, int]:
    """`WanPipeline`'s `(vae_scale_factor_spatial, vae_scale_factor_temporal)` (diffusers 0.42): its VAE config's
    `scale_factor_spatial` and `scale_factor_temporal`, 8 and 4 without a VAE."""
    return (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) if vae else (8, 4)


def sampling_size(index: Mapping, transformer: Mapping, vae: Mapping, height: int | None = None,
                  width: int | None = None, num_frames: int | None = None, *,
                  keys: Sequence[str] = SIZE_ARGUMENTS) -> SamplingSize:
    """The Wan family's size rule, from the pipeline's (`index`: its config or model_index.json), the
    transformer's and the VAE's configs: each of height, width and frames the caller's, else the folder's
    `_diffrl_height` / `_diffrl_width` / `_diffrl_num_frames`, else the pipeline's 480x832, 81 frames; sides a
    multiple of the VAE's spatial factor × the transformer's patch, frames `temporal`·k + 1 (sizes `WanPipeline`
    would round with a warning are refused instead). `WanFamily.latent_shape` calls it with the loaded pipeline's
    configs, `diffrl.pipelines.check_sampling_size` with the folder's."""
    spatial, temporal = vae_factors(vae)
    patch = transformer["patch_size"][1]
    return checked_size(index, height, width, num_frames, model=f"Wan (VAE factor {spatial} × patch size {patch}, "
                        f"temporal factor {temporal})", default=(DEFAULT_HEIGHT, DEFAULT_WIDTH),
                        multiple=spatial * patch, temporal=temporal, default_frames=DEFAULT_NUM_FRAMES, keys=keys)


class WanFamily:
    name = "wan"
    flow = True
    video = True  # decode returns frames [B, F, 3, H, W]
    denoiser_class = "WanTransformer3DModel"  # what model_index.json names (`diffrl.models.size_rule`)
    sampling_size = staticmethod(sampling_size)
    default_guidance_scale = 5.0  # WanPipeline's CFG scale

    def __init__(self, pipe):
        if pipe.config.get("expand_timesteps"):
            raise UserError("Wan 2.2 TI2V (expand_timesteps: a per-token timestep) is not supported yet")
        if pipe.transformer is None:
            raise UserError("a Wan pipeline without `transformer` (the high-noise expert) is not supported")
        self.pipe = pipe
        # Wan 2.2 A14B: the low-noise expert denoises below this model timestep; it is not trained (frozen)
        self.boundary = None
        if getattr(pipe, "transformer_2", None) is not None and pipe.config.get("boundary_ratio") is not None:
            self.boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
            pipe.transformer_2.requires_grad_(False)

    @staticmethod
    def matches(pipe) -> bool:
        return type(pipe).__name__ == "WanPipeline"

    denoiser = property(transformer_denoiser)
    process = property(rectified_flow_process)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Classifier-free guidance iff scale > 1, as `WanPipeline.do_classifier_free_guidance`."""
        return guidance_scale > 1

    def latent_shape(self, height: int | None, width: int | None,
                     num_frames: int | None = None) -> tuple[tuple[int, int, int, int], int, int]:
        """`(C, F', h, w)` of the latents and the frame size `(H, W)`. Defaults: the folder's `_diffrl_height`,
        `_diffrl_width`, `_diffrl_num_frames` where its model_index.json has them, else the pipeline's 480x832, 81
        frames; refused as `sampling_size` says (sizes the pipeline would round with a warning are refused)."""
        pipe, vae = self.pipe, component_config(self.pipe, "vae")
        height, width, num_frames = sampling_size(pipe.config, pipe.transformer.config, vae, height, width, num_frames)
        spatial, temporal = vae_factors(vae)
        latent_frames = (num_frames - 1) // temporal + 1
        shape = (pipe.transformer.config.in_channels, latent_frames, height // spatial, width // spatial)
        return shape, height, width

    def schedule_kwargs(self, num_steps: int, latent_hw: tuple[int, int]) -> dict:
        """What `WanPipeline` passes to `set_timesteps` (N alone: a static shift, no μ); for a UniPC flow config, its
        shifted σ grid (module docstring). The size does not enter."""
        config = self.pipe.scheduler.config
        if "flow_shift" not in config:  # FlowMatchEulerDiscreteScheduler: exactly the pipeline's call
            return {"num_inference_steps": num_steps}
        if not config.get("use_flow_sigmas") or config.get("use_dynamic_shifting"):
            raise UserError(f"{config.get('_class_name', 'this scheduler')} without use_flow_sigmas (or with dynamic "
                            f"shifting) is not a Wan flow schedule the flow sampler can step")
        shift = config["flow_shift"]
        sigmas = np.linspace(1, 1 / config["num_train_timesteps"], num_steps + 1)[:-1]
        return {"num_inference_steps": num_steps, "sigmas": shift * sigmas / (1 + (shift - 1) * sigmas)}

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
        """Encode prompts with the pipeline's own `encode_prompt` (UMT5, zero-padded to `max_sequence_length`:
        the folder's `_diffrl_max_sequence_length`, else the pipeline's 512), without gradients; the negative prompt
        defaults to `""` under CFG; each distinct (prompt, negative prompt) once (`flow.encode_distinct`)."""
        prompts, batch = prompt_list(prompts, prompt_embeds)
        if pooled_prompt_embeds is not None or negative_pooled_prompt_embeds is not None:
            raise UserError("Wan pipelines have no pooled text embedding; pass prompt_embeds alone")
        embeds_given = prompt_embeds is not None or negative_prompt_embeds is not None
        repeated = encode_distinct(self.encode, prompts, negative_prompt, embeds_given, guidance_scale=guidance_scale,
                                   max_sequence_length=max_sequence_length)
        if repeated is not None:
            return repeated
        if isinstance(negative_prompt, str):
            negative_prompt = [negative_prompt] * batch
        device = self.pipe.transformer.device
        guided = self.uses_cfg(guidance_scale)
        length = sequence_length(self.pipe, max_sequence_length).get("max_sequence_length",
                                                                    DEFAULT_MAX_SEQUENCE_LENGTH)
        embeds, negative = self.pipe.encode_prompt(
            prompt=None if prompt_embeds is not None else list(prompts), negative_prompt=negative_prompt,
            do_classifier_free_guidance=guided, num_videos_per_prompt=1, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=length, device=device,
        )  # fmt: skip
        cond = Conditioning(prompt_embeds=embeds, negative_prompt_embeds=negative if guided else None)
        return cond.to(device), prompt_strings(prompts, batch)

    def model_output(
        self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float,
        dtype: torch.dtype | None = None, *, detach_uncond: bool = False,
    ) -> torch.Tensor:
        """The velocity for latents `x` (`[N, C, F', h, w]`) at model timestep `t` (σ·1000; a scalar or `[N]`) after
        CFG, in fp32: the transformer fed the raw t; when guided, a conditional then an unconditional call (as the
        pipeline: not one batch), v = v_u + s·(v_c − v_u); with `detach_uncond` v_u's call runs without a graph."""
        dtype = dtype or module_dtype(self.pipe.transformer)
        text = cond.cached(("wan", dtype), lambda: (
            cond.prompt_embeds.to(dtype),
            None if cond.negative_prompt_embeds is None else cond.negative_prompt_embeds.to(dtype),
        ))
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])  # one timestep for the batch, or one per sample
        if self.boundary is None:
            return self._guided(self.pipe.transformer, x.to(dtype), t, text, cond.guided, guidance_scale,
                                detach_uncond)
        # Wan 2.2: `transformer` where t >= boundary, `transformer_2` below (the pipeline's test), row by row
        high = t >= self.boundary
        if bool(high.all()):
            return self._guided(self.pipe.transformer, x.to(dtype), t, text, cond.guided, guidance_scale,
                                detach_uncond)
        if not bool(high.any()):
            low = self._guided(self.pipe.transformer_2, x.to(dtype), t, text, cond.guided, guidance_scale,
                               detach_uncond)
            return self._on_trained_graph(low)
        output = None
        for expert, rows in ((self.pipe.transformer, high), (self.pipe.transformer_2, ~high)):
            part_text = tuple(None if e is None else e[rows] for e in text)
            part = self._guided(expert, x[rows].to(dtype), t[rows], part_text, cond.guided, guidance_scale,
                                detach_uncond)
            output = part.new_zeros(x.shape) if output is None else output
            output = output.index_put((rows.nonzero()[:, 0],), part)
        return output

    def _on_trained_graph(self, output: torch.Tensor) -> torch.Tensor:
        """The frozen expert's output plus 0·(a trained weight) when autograd is on: a loss over low-noise steps only
        backpropagates (to zero) instead of failing, as `samplers.base.step_log_prob` does for deterministic steps."""
        trained = next((p for p in self.pipe.transformer.parameters() if p.requires_grad), None)
        if not torch.is_grad_enabled() or output.requires_grad or trained is None:
            return output
        # said once per process (the same warning from the same line): a DRaFT-K run whose last K steps are all
        # below the boundary would otherwise train nothing in silence
        warnings.warn(f"Wan 2.2: steps below t = {self.boundary:g} run the frozen low-noise expert (transformer_2); "
                      f"training through them changes nothing (diffrl fine-tunes the high-noise transformer only)",
                      stacklevel=2)
        return output + 0 * trained.reshape(-1)[0].to(output.dtype)

    @staticmethod
    def _guided(transformer, model_input, t, text, guided, guidance_scale, detach_uncond):
        """One expert's velocity after CFG: the conditional call, then the unconditional one (as the pipeline)."""

        def call(embeds):
            out = run_denoiser(transformer, hidden_states=model_input, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
            return out.to(step_dtype(out.dtype))

        conditional = call(text[0])
        if not guided:
            return conditional
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_uncond):
            uncond = call(text[1])
        return uncond + guidance_scale * (conditional - uncond)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames `[B, F, 3, H, W]` float32 in [0, 1], differentiably: x·std + mean per channel (as the pipeline:
        divided by 1/std), the 3-D VAE decode `[B, 3, F, H, W]`, frames moved before channels."""
        vae = self.pipe.vae
        config, vae_dtype = vae.config, module_dtype(vae)
        z = latents.to(vae_dtype)
        view = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(view).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(view).to(z.device, z.dtype)
        video = vae.decode(z / inverse_std + mean, return_dict=False)[0]
        return (video.to(step_dtype(video.dtype)).permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)
