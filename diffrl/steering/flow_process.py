"""A flow-matching pipeline (SD3, FLUX class) as a `DenoisingProcess`, built on `samplers.flow`'s public pieces.

The schedule (`FlowSampler.schedule`) and the step (`FlowSampler.step`, i.e. `flow_step` with the schedule's
constants at noise level `eta`) are the flow sampler's; the text conditioning (which reads the T5 length a model was
trained with from the pipeline config), the guided transformer call and the decoding are the model family's
(`diffrl.models`), as in `FlowSampler.sample`, so a steered chain takes
exactly the steps `FlowSampler.sample` takes (tested against it, and at eta = 0 against diffusers' pipelines).
Steering itself lives in the method files and only sees the `DenoisingProcess` interface.

Notation (as `samplers.flow`): x_σ = (1 − σ)·x0 + σ·ε with σ from 1 (noise) to 0 (data); the model output is the
velocity v = ε − x0 after guidance; x̂0 = x − σ·v (FK's and SVDD's look-ahead rewards score it); `eta` is Flow-GRPO's
noise level a, 0 being the probability-flow ODE (deterministic: FK and SVDD refuse it, through `stochastic`).
Reward guidance shifts v by −γ·σ/(1 − σ)·∇_x r, the velocity form of the score shift that `guidance.py` derives
(`guidance_coefficient`; 0 at σ = 1, the first step). The chain is differentiable end to end (transformer, step,
VAE), so ReNO optimises x_1 through a few ODE or SDE steps. Latents stay unpacked `[N, C, h, w]` for FLUX too.

Random draws: one generator gives x_1 and then each stochastic step's noise for all rows at once, as in the UNet
process, where `FlowSampler.sample` keeps one generator per sample; the two draw identically for a one-row call (and
need no draws at eta = 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.errors import UserError
from diffrl.models.base import module_dtype
from diffrl.steering.cads import ParticleCADS
from diffrl.steering.guidance import velocity_guidance_coefficient
from diffrl.steering.pipeline import SamplerSteps
from samplers import get_sampler
from samplers.cads import CADSConfig, cads_settings
from samplers.flow import flow_family

DEFAULT_ETA = 0.7  # not FlowSampler's default (the ODE): FK and SVDD need step noise; Flow-GRPO samples with a = 0.7


class FlowProcess(SamplerSteps):
    """The `DenoisingProcess` of a `StableDiffusion3Pipeline` or `FluxPipeline` for a fixed list of prompts.

    Args:
        pipe: a flow-matching pipeline (transformer, VAE, `encode_prompt`, a `FlowMatchEulerDiscreteScheduler`).
        prompts (`list[str]`): one per condition; rows of a batch pick theirs by index.
        sampler (`str`, *optional*): `"flow"` (Flow-GRPO's SDE step) or `"flow_cps"` (coefficients-preserving);
            defaults to the pipeline's (`"flow"`).
        num_steps (`int`): denoising steps.
        guidance_scale (`float`): SD3: the classifier-free guidance scale (none when ≤ 1); FLUX: the embedded
            guidance of guidance-distilled transformers.
        eta (`float`, defaults to 0.7): the noise level a ≥ 0 (Flow-GRPO's 0.7); 0 is the deterministic ODE.
        negative_prompt (`str` or `list[str]`, *optional*): SD3 only, for the unconditional half of CFG.
        height, width (`int`, *optional*): image size; defaults to the pipeline's.
        max_sequence_length (`int`, *optional*): T5 tokens; defaults as `FlowSampler.sample` (the loaded folder's
            `_diffrl_max_sequence_length`, else the pipeline's).
        cads (`CADSConfig`, *optional*; or its `--cads` text or a mapping): condition-annealed sampling in every
            model call, each particle with its own condition noise (`diffrl.steering.cads`; t is σ).
        seed (`int`, defaults to 0): keys CADS's condition noise with each row's particle slot (`steer` passes its
            own seed).
    """

    default_eta = DEFAULT_ETA  # what `steer` uses when the caller gives no eta
    reno_num_steps = 4  # ReNO's default chain: a few steps of a model that is not one-step (it backpropagates all)

    def __init__(
        self,
        pipe,
        prompts: Sequence[str],
        *,
        sampler: str | None = None,
        num_steps: int,
        guidance_scale: float,
        eta: float = DEFAULT_ETA,
        negative_prompt=None,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int | None = None,
        cads: CADSConfig | str | dict | None = None,
        seed: int = 0,
    ):
        self.family = flow_family(pipe)
        self.sampler = get_sampler(sampler or "auto", pipe)  # also checks the pipeline suits it
        if num_steps < 1:
            raise UserError(f"num_steps must be at least 1, got {num_steps}")
        if eta < 0:
            raise UserError(f"eta must be ≥ 0, got {eta}")
        self.pipe = pipe
        self.guidance_scale = float(guidance_scale)
        self.eta = float(eta)
        self.device = self.family.denoiser.device
        self.dtype = module_dtype(self.family.denoiser)
        self.shape, self.height, self.width = self.family.latent_shape(height, width)
        self.schedule = self.sampler.schedule(pipe, num_steps, self.shape[1:])
        self.num_steps = len(self.schedule)
        self.timesteps = self.schedule.timesteps.to(self.device)
        self.cond, _ = self.family.encode(
            list(prompts), guidance_scale=guidance_scale, negative_prompt=negative_prompt,
            max_sequence_length=max_sequence_length,
        )
        self._cond_cache: dict = {}
        cads = cads_settings(cads)
        self.cads = None if cads is None else ParticleCADS(cads, seed, self._cads_times())

    def sigma(self, step_index: int) -> float:
        """σ of x_t at `step_index` (1 at step 0: pure noise)."""
        return self.schedule.sigmas[step_index]

    def guidance_coefficient(self, step_index: int) -> float:
        """c_t = σ/(1 − σ): adding γ·∇r to the score shifts v by −γ·c_t·∇r (`guidance.py`; 0 at σ = 1)."""
        return velocity_guidance_coefficient(self.sigma(step_index))

    def initial_latents(self, cond: torch.Tensor, generator=None) -> torch.Tensor:
        # x_1 ~ N(0, I): σ_0 = 1 is pure noise (as FlowSampler.sample draws it)
        device = generator.device if generator is not None else self.device
        noise = torch.randn((len(cond), *self.shape), generator=generator, device=device, dtype=torch.float32)
        return noise.to(self.device)

    def predict(self, latents: torch.Tensor, step_index: int, cond: torch.Tensor, particles=None) -> torch.Tensor:
        """The guided velocity at x_t for each row; `particles` (`[N]`, *optional*): each row's particle slot, for
        CADS (row i = slot i by default)."""
        t = self.timesteps[step_index]
        conditioning = self._conditioning(cond, step_index, particles)
        return self.family.model_output(latents, t, conditioning, self.guidance_scale, self.dtype)
