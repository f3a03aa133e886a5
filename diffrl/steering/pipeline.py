"""A UNet diffusers pipeline (SD 1.x/2.x/XL, LCM) as a `DenoisingProcess`, built on the samplers' public pieces.

Flow-matching pipelines (SD3, FLUX) have their own process, `flow_process.FlowProcess`; `steer` picks by the
pipeline's sampler.

Text conditioning, the guided UNet call and VAE decoding come from the model family (`diffrl.models.unet`), the
DDIM / LCM step math from `samplers` (`DDIMSampler.step` / `LCMSampler.step`), so a steered
chain takes exactly the steps a plain `DDIMSampler.sample` takes. Steering itself lives in the method files and only
sees the `DenoisingProcess` interface.

The process works in ε-space whatever the checkpoint predicts: `predict` converts a v- or x0-prediction to ε̂ and the
step is built from the scheduler config with `prediction_type="epsilon"`, which is the same step. Reward guidance can
then shift ε̂ for every parameterisation alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.steering.cads import ParticleCADS
from samplers import get_sampler
from samplers.base import pred_x0_and_eps
from samplers.cads import CADSConfig, cads_settings


class SamplerSteps:
    """The sampler's own step, x̂0, VAE decoding and the per-row conditioning (with CADS where asked), shared by the
    UNet and flow processes (`self.sampler`, `self.schedule`, `self.num_steps`, `self.eta`, `self.family`, `self.cond`,
    `self.device`, `self.pipe`, `self.cads` (a `ParticleCADS` or None) and an empty `self._cond_cache` set by the
    process)."""

    @property
    def stochastic(self) -> bool:
        """Whether any step adds noise (needed by FK and SVDD: otherwise copies and candidates never differ)."""
        return any(self.sampler.draws_noise(self.schedule, (self.eta,) * self.num_steps))

    def step(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor, *, generator=None):
        t = self.schedule.timesteps[step_index]
        return self.sampler.step(model_output, t, latents, eta=self.eta, generator=generator, schedule=self.schedule)

    def pred_x0(self, model_output: torch.Tensor, step_index: int, latents: torch.Tensor) -> torch.Tensor:
        # scoring x_t itself as the "next" sample draws no noise; only x̂0 is used
        t = self.schedule.timesteps[step_index]
        step = self.sampler.step(model_output, t, latents, eta=self.eta, prev_sample=latents, schedule=self.schedule)
        return step.pred_x0

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.family.decode(latents)

    @property
    def particle_noise(self) -> bool:
        """Whether the model call draws noise per particle (CADS): `predict` then needs each row's slot."""
        return self.cads is not None

    def _cads_times(self) -> list[float]:
        """Each step's normalised time t ∈ [0, 1] for CADS's γ(t), as `CADSHook` reads it (flow timesteps are σ·1000)."""
        num_train = self.pipe.scheduler.config.num_train_timesteps
        return [float(t) / num_train for t in self.schedule.timesteps]

    def _conditioning(self, cond: torch.Tensor, step_index: int, particles: torch.Tensor | None = None):
        # Particles keep their rows' prompts for a whole run, so the same `cond` comes back every step; the selected
        # `Conditioning` caches its denoiser inputs, so keeping it saves the concatenations too.
        key = tuple(cond.tolist())
        if key not in self._cond_cache:
            if len(self._cond_cache) > 8:
                self._cond_cache.clear()
            self._cond_cache[key] = self.cond.select(cond.to(self.device))
        selected = self._cond_cache[key]
        if self.cads is None:
            return selected
        if particles is None:  # row i is particle i of the call
            particles = torch.arange(len(cond))
        return self.cads.conditioning(selected, step_index, particles)



class PipelineProcess(SamplerSteps):
    """The `DenoisingProcess` of a Stable Diffusion (1.x/2.x/XL) or LCM pipeline for a fixed list of prompts.

    Args:
        pipe: a diffusers pipeline with `unet`, `vae`, `scheduler` and `encode_prompt`.
        prompts (`list[str]`): one per condition; rows of a batch pick theirs by index.
        sampler (`str`, *optional*): a sampler name (`samplers.SAMPLERS`); defaults to the pipeline's
            (`samplers.resolve_sampler_name`).
        num_steps (`int`): denoising steps.
        guidance_scale (`float`): classifier-free guidance scale (DDIM) or the LCM w-embedding's scale.
        eta (`float`, defaults to 1.0): η, for samplers that take one (`per_step_eta`; the LCM step's noise is fixed
            by its schedule).
        negative_prompt (`str` or `list[str]`, *optional*): for the unconditional half of CFG.
        height, width (`int`, *optional*): image size; defaults to the UNet's sample size.
        cads (`CADSConfig`, *optional*; or its `--cads` text or a mapping): condition-annealed sampling in every
            model call, each particle with its own condition noise (`diffrl.steering.cads`).
        seed (`int`, defaults to 0): keys CADS's condition noise with each row's particle slot (`steer` passes its
            own seed).
    """

    default_eta = 1.0  # what `steer` uses when the caller gives no eta: not DDIM's default 0, FK and SVDD need noise
    reno_num_steps = 1  # ReNO's default chain: a one-step model (LCM)

    def __init__(
        self,
        pipe,
        prompts: Sequence[str],
        *,
        sampler: str | None = None,
        num_steps: int,
        guidance_scale: float,
        eta: float = 1.0,
        negative_prompt=None,
        height: int | None = None,
        width: int | None = None,
        cads: CADSConfig | str | dict | None = None,
        seed: int = 0,
    ):
        self.sampler = get_sampler(sampler or "auto", pipe)  # also checks the pipeline suits it
        if num_steps < 1:
            raise UserError(f"num_steps must be at least 1, got {num_steps}")
        if eta < 0:
            raise UserError(f"eta must be ≥ 0, got {eta}")
        if self.sampler.consistency and negative_prompt is not None:
            raise UserError("LCM pipelines guide through the UNet's w-embedding and take no negative prompt")
        self.pipe, self.family = pipe, model_family(pipe)
        self.guidance_scale = float(guidance_scale)
        self.eta = float(eta) if self.sampler.per_step_eta else self.sampler.default_eta
        self.device = pipe.unet.device
        self.shape, self.height, self.width = self.family.latent_shape(height, width)
        self.cond, _ = self.family.encode(
            list(prompts), guidance_scale=guidance_scale, height=self.height, width=self.width,
            negative_prompt=negative_prompt,
        )
        # ε-space: the same step, whatever the checkpoint's prediction type (see the module docstring)
        self.prediction_type = pipe.scheduler.config.get("prediction_type", "epsilon")
        config = {**pipe.scheduler.config, "prediction_type": "epsilon"}
        self.schedule = self.sampler.schedule(config, num_steps)
        self.num_steps = len(self.schedule.timesteps)
        self.timesteps = self.schedule.timesteps.to(self.device)
        self._cond_cache: dict = {}
        cads = cads_settings(cads)
        self.cads = None if cads is None else ParticleCADS(cads, seed, self._cads_times())

    def alpha_bar(self, step_index: int) -> float:
        return self.schedule.alphas_cumprod[step_index]

    def guidance_coefficient(self, step_index: int) -> float:
        """c_t = √(1 − ᾱ_t): adding γ·∇r to the score shifts ε̂ by −γ·c_t·∇r (`guidance.py`)."""
        return (1 - self.alpha_bar(step_index)) ** 0.5

    def initial_latents(self, cond: torch.Tensor, generator=None) -> torch.Tensor:
        # init_noise_sigma is 1 for DDIM and LCM
        device = generator.device if generator is not None else self.device
        noise = torch.randn((len(cond), *self.shape), generator=generator, device=device, dtype=torch.float32)
        return noise.to(self.device)

    def predict(self, latents: torch.Tensor, step_index: int, cond: torch.Tensor, particles=None) -> torch.Tensor:
        """ε̂ at x_t for each row; `particles` (`[N]`, *optional*): each row's particle slot, for CADS (row i = slot i
        by default)."""
        scale = self.guidance_scale if self.cond.guided else 1.0
        t = self.timesteps[step_index]
        conditioning = self._conditioning(cond, step_index, particles)
        output = self.family.model_output(latents, t, conditioning, scale, self.pipe.unet.dtype)
        if self.prediction_type == "epsilon":
            return output
        a = self.alpha_bar(step_index)
        _, eps = pred_x0_and_eps(output, latents.float(), a**0.5, (1 - a) ** 0.5, self.prediction_type)
        return eps

