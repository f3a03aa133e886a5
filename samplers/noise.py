"""What the samplers share around the UNet: text conditioning, the guided model call, noise and decoding.

Plain functions over a diffusers pipeline's public API (`encode_prompt`, `get_guidance_scale_embedding`,
`unet`, `vae`), used by `DDIMSampler` and `LCMSampler` alike so both condition, guide, draw noise and
decode identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from diffrl.errors import UserError
from samplers.base import step_dtype


@dataclass
class Conditioning:
    """Per-sample conditioning of a batch, as the UNet consumes it (each tensor has B rows).

    Args:
        prompt_embeds (`[B, L, D]`): text encoder hidden states of the prompts.
        negative_prompt_embeds (`[B, L, D]`, *optional*): of the negative prompts; present iff CFG is used.
        pooled_prompt_embeds, negative_pooled_prompt_embeds (`[B, P]`), add_time_ids (`[B, 6]`): SDXL only.
        timestep_cond (`[B, D]`, *optional*): guidance-scale embedding for UNets with `time_cond_proj_dim`.
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    add_time_ids: torch.Tensor | None = None
    timestep_cond: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance runs (an unconditional half in every UNet call)."""
        return self.negative_prompt_embeds is not None

    def select(self, rows: torch.Tensor) -> Conditioning:
        return replace(self, **{f.name: _index(getattr(self, f.name), rows) for f in fields(self)})

    def to(self, device) -> Conditioning:
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})

    @classmethod
    def from_trajectory(cls, traj) -> Conditioning:
        return cls(**{f.name: getattr(traj, f.name) for f in fields(cls)})

    def trajectory_fields(self) -> dict:
        """The same tensors as keyword arguments of `Trajectory` (its field names match)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def unet_kwargs(self, dtype: torch.dtype) -> dict:
        """Keyword arguments of `unet(...)` for one guided call: [unconditional; conditional] when guided.

        Cached per dtype on this object, so the concatenations happen once per batch, not once per step.
        """
        cache = self.__dict__.setdefault("_unet_kwargs", {})
        if dtype not in cache:
            cache[dtype] = self._build_unet_kwargs(dtype)
        return cache[dtype]

    def _build_unet_kwargs(self, dtype: torch.dtype) -> dict:
        guided = self.guided

        def both(negative, positive):
            if positive is None:
                return None
            return (torch.cat([negative, positive]) if guided else positive).to(dtype)

        kwargs = {"encoder_hidden_states": both(self.negative_prompt_embeds, self.prompt_embeds)}
        if self.timestep_cond is not None:
            kwargs["timestep_cond"] = both(self.timestep_cond, self.timestep_cond)
        if self.add_time_ids is not None:
            kwargs["added_cond_kwargs"] = {
                "text_embeds": both(self.negative_pooled_prompt_embeds, self.pooled_prompt_embeds),
                "time_ids": both(self.add_time_ids, self.add_time_ids),
            }
        return kwargs


def _index(value, rows):
    return None if value is None else value[rows.to(value.device)]


def _move(value, device):
    return None if value is None else value.to(device)


def denoiser(pipe):
    """The pipeline's denoising network: its `unet` (SD 1.x/2.x/XL, LCM) or its `transformer` (SD3, FLUX)."""
    unet = getattr(pipe, "unet", None)
    return unet if unet is not None else pipe.transformer


def module_dtype(module) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (diffusers' `.dtype` property walks every module)."""
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def uses_cfg(pipe, guidance_scale: float) -> bool:
    """diffusers' rule: guidance runs as an unconditional batch half iff scale > 1 and the UNet has no w-embedding."""
    return guidance_scale > 1 and pipe.unet.config.time_cond_proj_dim is None


def is_sdxl(pipe) -> bool:
    """SDXL-style UNets take pooled text embeddings and size micro-conditioning (`added_cond_kwargs`)."""
    return pipe.unet.config.get("addition_embed_type") == "text_time"


def _rows(tensor: torch.Tensor | None, batch: int, name: str) -> torch.Tensor | None:
    """Broadcast a one-row precomputed embedding (e.g. the cached empty prompt) to `batch` rows."""
    if tensor is None or tensor.shape[0] == batch:
        return tensor
    if tensor.shape[0] == 1:
        return tensor.expand(batch, *tensor.shape[1:])
    raise UserError(f"{name} has {tensor.shape[0]} rows but the batch has {batch}; pass one row or one per sample")


@torch.no_grad()
def encode_conditioning(
    pipe,
    prompts: Sequence[str] | str | None,
    *,
    guidance_scale: float,
    height: int,
    width: int,
    negative_prompt: Sequence[str] | str | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
) -> tuple[Conditioning, list[str]]:
    """Encode prompts with the pipeline's own `encode_prompt` (or take precomputed embeddings).

    The text encoder runs without gradients: the samplers train the denoiser, not the text encoder.
    Returns the conditioning on the UNet's device and the prompt strings (`""` for embedding-only input).
    """
    if prompts is None and prompt_embeds is None:
        raise UserError("pass prompts or prompt_embeds to the sampler")
    if isinstance(prompts, str):
        prompts = [prompts]
    batch = len(prompts) if prompts is not None else prompt_embeds.shape[0]
    if prompts is not None and prompt_embeds is not None and len(prompts) != prompt_embeds.shape[0]:
        raise UserError(f"got {len(prompts)} prompts but prompt_embeds has {prompt_embeds.shape[0]} rows")
    if isinstance(negative_prompt, str):
        negative_prompt = [negative_prompt] * batch
    if negative_prompt is not None and len(negative_prompt) != batch:
        raise UserError(f"got {len(negative_prompt)} negative prompts for {batch} prompts; pass one or one per prompt")
    device = pipe.unet.device
    guided = uses_cfg(pipe, guidance_scale)
    negative_prompt_embeds = _rows(negative_prompt_embeds, batch, "negative_prompt_embeds")
    negative_pooled_prompt_embeds = _rows(negative_pooled_prompt_embeds, batch, "negative_pooled_prompt_embeds")
    text = None if prompt_embeds is not None else list(prompts)
    common = {
        "device": device,
        "num_images_per_prompt": 1,
        "do_classifier_free_guidance": guided,
        "negative_prompt": negative_prompt,
        "prompt_embeds": prompt_embeds,
        "negative_prompt_embeds": negative_prompt_embeds,
    }
    cond = Conditioning(prompt_embeds=None)
    if is_sdxl(pipe):
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=text,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            **common,
        )
        # SDXL micro-conditioning at its defaults: original size = target size = (H, W), crop (0, 0)
        time_ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=embeds.dtype, device=device)
        cond = Conditioning(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative if guided else None,
            pooled_prompt_embeds=pooled,
            negative_pooled_prompt_embeds=negative_pooled if guided else None,
            add_time_ids=time_ids.expand(batch, -1),
        )
    else:
        embeds, negative = pipe.encode_prompt(prompt=text, **common)
        cond = Conditioning(prompt_embeds=embeds, negative_prompt_embeds=negative if guided else None)
    cond = cond.to(device)
    if pipe.unet.config.time_cond_proj_dim is not None:
        # LCM-style UNets take the guidance scale as an embedding of w = scale - 1 instead of a CFG batch
        w = torch.full((batch,), guidance_scale - 1.0)
        embedding = pipe.get_guidance_scale_embedding(w, embedding_dim=pipe.unet.config.time_cond_proj_dim)
        cond.timestep_cond = embedding.to(device=device, dtype=torch.float32)
    return cond, list(prompts) if prompts is not None else [""] * batch


def guided_unet_output(
    unet,
    x: torch.Tensor,
    t: torch.Tensor,
    unet_kwargs: dict,
    guidance_scale: float,
    guided: bool,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The model output for latents `x` (`[N, C, h, w]`) after classifier-free guidance, in fp32 (fp64 for a
    float64 model).

    One batched UNet call on [x; x] with [unconditional; conditional] embeddings when `guided`;
    ε̂ = ε_u + s·(ε_c − ε_u). The UNet runs in `dtype` (default: its parameters' dtype); the result is upcast
    so the step math is fp32 (`step_dtype`).
    """
    model_input = x.to(dtype or module_dtype(unet))
    if guided:
        model_input = torch.cat([model_input, model_input])
    output = unet(model_input, t, return_dict=False, **unet_kwargs)[0]
    output = output.to(step_dtype(output.dtype))
    if not guided:
        return output
    uncond, cond = output.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


def make_generators(
    batch: int, *, seeds: Sequence[int] | None, generator, device
) -> tuple[list[torch.Generator], list[int] | None]:
    """One `torch.Generator` per sample, so a sample's noise never depends on the batch it is in.

    `seeds` → generators on `device` seeded with them; a list of generators → used as is (seeds unknown);
    a single generator → per-sample seeds drawn from it; nothing → seeds drawn from torch's global RNG
    (reproducible under `torch.manual_seed`, and recorded in the trajectory).
    """
    if seeds is not None and generator is not None:
        raise UserError("pass either seeds or generator to the sampler, not both")
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise UserError(f"got {len(generator)} generators for a batch of {batch}; pass one per sample")
        return list(generator), None
    if seeds is None:
        drawn = torch.randint(0, 2**62, (batch,), generator=generator, device=getattr(generator, "device", "cpu"))
        seeds = drawn.tolist()
    seeds = [int(s) for s in seeds]
    if len(seeds) != batch:
        raise UserError(f"got {len(seeds)} seeds for a batch of {batch}; pass one per sample")
    return [torch.Generator(device=device).manual_seed(s) for s in seeds], seeds


def draw_noise(generators: Sequence[torch.Generator], shape: Sequence[int], device,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal `[B, *shape]` in `dtype`, row i from `generators[i]` (as diffusers' `randn_tensor` with a
    list). A float64 run draws float64 noise: torch's CPU float32 `randn` has an AVX2-only kernel, so float32 noise
    depends on the CPU."""
    rows = [torch.randn((1, *shape), generator=g, device=g.device, dtype=dtype) for g in generators]
    return torch.cat(rows).to(device)


def step_noise(generator, x_t: torch.Tensor) -> torch.Tensor:
    """z `[B, C, h, w]` in `step_dtype(x_t.dtype)` for one `step()` call: row i from `generator[i]` given a list,
    else one batch draw."""
    dtype = step_dtype(x_t.dtype)
    if isinstance(generator, (list, tuple)):
        return draw_noise(generator, x_t.shape[1:], x_t.device, dtype)
    device = generator.device if generator is not None else x_t.device
    return torch.randn(x_t.shape, generator=generator, device=device, dtype=dtype).to(x_t.device)


def decode_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """VAE-decode latents to images `[B, 3, H, W]` float32 (float64 from a float64 VAE) in [0, 1], differentiably
    (grad mode is the caller's).

    Undoes the latent normalisation the way the pipelines do: `latents_mean`/`latents_std` where the VAE
    config has them (SDXL-style), else division by `scaling_factor` and addition of `shift_factor` if set.
    """
    vae = pipe.vae
    config = vae.config
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is not None and std is not None:
        view = (1, -1) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(mean, device=latents.device).view(view)
        std = torch.tensor(std, device=latents.device).view(view)
        z = latents * std / config.scaling_factor + mean
    else:
        z = latents / config.scaling_factor
        if config.get("shift_factor") is not None:
            z = z + config.shift_factor
    image = vae.decode(z.to(module_dtype(vae)), return_dict=False)[0]
    return (image.to(step_dtype(image.dtype)) / 2 + 0.5).clamp(0, 1)


def latent_shape(pipe, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
    """`(C, h, w)` of the latents and the image `(H, W)`; defaults from the UNet's `sample_size`."""
    size = pipe.unet.config.sample_size
    size_h, size_w = (size, size) if isinstance(size, int) else size
    height = height or size_h * pipe.vae_scale_factor
    width = width or size_w * pipe.vae_scale_factor
    if height % pipe.vae_scale_factor or width % pipe.vae_scale_factor:
        raise UserError(f"height and width must be multiples of {pipe.vae_scale_factor}; got {height}x{width}")
    shape = (pipe.unet.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    return shape, height, width
