"""Flow-matching sampling as a Gaussian policy over diffusers' SD3- and FLUX-class pipelines (Flow-GRPO's step).

Papers: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025, arXiv 2505.05470), eq. (9):
the reverse-time SDE that has the flow ODE's marginals, discretised with Euler–Maruyama, and σ_t = a·√(t/(1−t))
below it; Wang & Yu, "Coefficients-Preserving Sampling for Reinforcement Learning with Flow Matching" (CPS, 2025,
arXiv 2509.05952), whose step keeps the forward process's coefficients (1 − σ) on x0 and σ on the noise.

Notation (rectified flow, as diffusers' `FlowMatchEulerDiscreteScheduler`): x_σ = (1 − σ)·x0 + σ·ε, σ from 1
(noise) to 0 (data); the transformer predicts the velocity v = ε − x0; the model timestep is σ·1000.

Code name → paper notation (one step from σ to σ' = `sigma_next`, σ' < σ):
    sigma, sigma_next    t, t + Δt in the paper's time (Δt = `dt` = σ' − σ < 0)
    eta                  a, the noise level (Flow-GRPO: 0.7); 0 is the probability-flow ODE = diffusers' Euler step
    model_output         v_θ(x_t, t) after classifier-free guidance
    pred_x0              x̂0 = x − σ·v
    SDE (Flow-GRPO eq. 9):
      s                  σ_t = a·√(σ/(1 − σ))   (at σ = 1 the reference code uses 1 − σ' in the denominator; so do we)
      mean               μ = x·(1 + s²·dt/(2σ)) + v·(1 + s²·(1 − σ)/(2σ))·dt
      std                s·√(−dt)
    CPS:
      std                σ'·sin(a·π/2)
      mean               μ = (1 − σ')·x̂0 + √(σ'² − std²)·x̂1,  x̂1 = x + (1 − σ)·v the predicted noise
    std_dev_t            the reference code's name: the SDE's σ_t = s (std per √|Δt|), CPS's std; 0 on an ODE step
    prev_sample          x_σ' = μ + std·z, z ~ N(0, I)
    log_prob             mean over latent dims of log N(x_σ'; μ, std² I); 0 when std = 0 (see `samplers.base`).
                         CPS with `cps_log_prob="reference"`: −mean((x_σ' − μ)²), the reference code's convention

Both steps are written as μ = x_coef·x + v_coef·v with per-step scalars computed once in float32. With a = 0 both
reduce to x + dt·v, diffusers' Euler step, so `eta=0` reproduces the pipelines' own output. CPS's last step
(σ' = 0) has std 0: a point mass at x̂0. The SDE's last step is stochastic (std = a·σ at σ' = 0).

Log-prob conventions of a CPS step (`FlowSampler(cps_log_prob=...)`): `"gaussian"` (the default) is the Gaussian
log-density, as every other step here; `"reference"` is flow_grpo's `sde_step_with_logprob(sde_type="cps")`, the
squared distance alone, −mean((x_σ' − μ)²). They differ by more than a constant: gaussian = reference / (2·std²) −
log std − ½ log 2π, so a PPO log-ratio on the gaussian scale is 1/(2·std²) times the reference's (0.68× on the first
of 10 steps at a = 0.7 and shift 3, 7,900× on the ninth, the last stochastic one), and a clip range tuned on one
scale does not carry over to the other. Both conventions are tested against numbers from the reference code
(`tests/trainers/test_flow_grpo_parity.py`).

Differences from the reference code, on purpose: latents are kept unpacked (`[B, C, h, w]`) for FLUX too, so hooks,
rewards and the trajectory see the same shapes as for SD; they are packed into tokens only for the transformer call.

The schedule is the pipeline's: its scheduler config through `FlowMatchEulerDiscreteScheduler.set_timesteps`,
called as `StableDiffusion3Pipeline` (num_steps; μ from the image size when `use_dynamic_shifting`) or
`FluxPipeline` (σ = linspace(1, 1/T, T) with the resolution-dependent μ) call it (diffusers 0.42).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from diffrl.errors import UserError
from samplers.base import (
    GradPolicy,
    SamplerHook,
    StepOutput,
    Trajectory,
    check_trajectory,
    scalar32,
    step_dtype,
)
from samplers.conditioning import Conditioning, draw_noise, make_generators, module_dtype, step_noise
from samplers.ddim import step_etas
from samplers.loop import DenoisingLoop, decode_images

SDE_TYPES = ("sde", "cps")
CPS_LOG_PROBS = ("gaussian", "reference")  # the log-prob of a CPS step: Gaussian log-density, or flow_grpo's
CFG_GRADIENTS = ("both", "conditional")  # which CFG branches a recomputed step's gradient flows through


# ----------------------------------------------------------------------------------------------------------
# The step (pure math)


@dataclass(frozen=True)
class FlowConstants:
    """The scalars of one flow step from σ to σ' (float32 values as Python floats): μ = x_coef·x + v_coef·v."""

    sigma: float  # σ
    sigma_next: float  # σ'
    x_coef: float
    v_coef: float
    std: float  # 0 for a deterministic step
    std_dev_t: float = 0.0  # the reference code's std_dev_t: SDE σ_t = std / √|Δt|, CPS std (Flow-GRPO's KL uses it)


def sde_constants(sigma: float, sigma_next: float, eta: float) -> FlowConstants:
    """Flow-GRPO's SDE step (eq. 9) with noise level a = `eta`, in torch float32 scalar arithmetic."""
    if eta == 0:  # the ODE: exactly diffusers' Euler step x + dt·v
        dt = scalar32(lambda s, n: n - s, sigma, sigma_next)
        return FlowConstants(sigma, sigma_next, x_coef=1.0, v_coef=dt, std=0.0, std_dev_t=0.0)
    # σ/(1 − σ) is infinite at σ = 1; the reference code divides by 1 − σ' there instead
    denominator = sigma_next if sigma == 1 else sigma
    s = scalar32(lambda s, d: eta * (s / (1 - d)) ** 0.5, sigma, denominator)
    return FlowConstants(
        sigma,
        sigma_next,
        x_coef=scalar32(lambda s_t, sg, n: 1 + s_t**2 * (n - sg) / (2 * sg), s, sigma, sigma_next),
        v_coef=scalar32(lambda s_t, sg, n: (1 + s_t**2 * (1 - sg) / (2 * sg)) * (n - sg), s, sigma, sigma_next),
        std=scalar32(lambda s_t, sg, n: s_t * (sg - n) ** 0.5, s, sigma, sigma_next),
        std_dev_t=s,
    )


def cps_constants(sigma: float, sigma_next: float, eta: float) -> FlowConstants:
    """The coefficients-preserving step with noise level a = `eta`: std = σ'·sin(aπ/2),
    μ = (1 − σ')(x − σv) + √(σ'² − std²)(x + (1 − σ)v), written as x_coef·x + v_coef·v."""
    if eta == 0:
        return sde_constants(sigma, sigma_next, 0.0)
    std = scalar32(lambda n: n * math.sin(eta * math.pi / 2), sigma_next)
    c = scalar32(lambda n, sd: (n**2 - sd**2).clamp(min=0) ** 0.5, sigma_next, std)  # weight of x̂1
    return FlowConstants(
        sigma,
        sigma_next,
        x_coef=scalar32(lambda n, c: (1 - n) + c, sigma_next, c),
        v_coef=scalar32(lambda sg, n, c: -sg * (1 - n) + c * (1 - sg), sigma, sigma_next, c),
        std=std,
        std_dev_t=std,
    )


def flow_step(
    model_output: torch.Tensor,
    x_t: torch.Tensor,
    constants: FlowConstants,
    *,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One flow step as a Gaussian, in fp32 (pure function; see the module docstring for the math).

    Args:
        model_output (`torch.Tensor` `[B, C, h, w]`): the (guided) velocity v at x_t.
        x_t (`torch.Tensor` `[B, C, h, w]`): the current latents x_σ.
        constants (`FlowConstants`): from `sde_constants` or `cps_constants`.
        prev_sample (`torch.Tensor`, *optional*): score this x_σ' instead of drawing one.
        noise (`torch.Tensor`, *optional*): z for the draw; required when `prev_sample` is `None` and std > 0.
    """
    c = constants
    dtype = step_dtype(torch.promote_types(model_output.dtype, x_t.dtype))
    v, x = model_output.to(dtype), x_t.to(dtype)
    mean = c.x_coef * x + c.v_coef * v
    pred_x0 = x - c.sigma * v
    if prev_sample is None:
        if c.std > 0 and noise is None:
            raise ValueError("a stochastic flow step (eta > 0) needs `noise` or `prev_sample`")
        prev_sample = mean if c.std == 0 else mean + c.std * noise.to(mean)
    return StepOutput.gaussian(prev_sample, mean, c.std, pred_x0)


def cps_reference_log_prob(step: StepOutput) -> StepOutput:
    """`step` with flow_grpo's CPS "log-prob": −mean over latent dims of (x_σ' − μ)², the Gaussian's 1/(2·std²) and
    constants dropped (`sde_step_with_logprob(sde_type="cps")`); 0 on a deterministic step (std = 0), as
    `samplers.base.step_log_prob`. Pure function."""
    if float(step.std) == 0:
        return step
    squared = (step.prev_sample.detach().to(step.mean.dtype) - step.mean) ** 2
    return replace(step, log_prob=-squared.mean(dim=tuple(range(1, squared.ndim))))


# ----------------------------------------------------------------------------------------------------------
# The pipelines: which family, latent shapes, schedule, conditioning and the transformer call


def check_flow_pipeline(pipe) -> None:
    if getattr(pipe, "transformer", None) is None:
        raise UserError(f"the flow sampler needs a flow-matching pipeline with a transformer (SD3, FLUX class), "
                        f"not a {type(pipe).__name__}; use the ddim or lcm sampler")


def packs_latents(pipe) -> bool:
    """FLUX-class transformers take 2x2-packed latent tokens with rotary position ids (`axes_dims_rope`)."""
    return pipe.transformer.config.get("axes_dims_rope") is not None


def flow_latent_shape(pipe, height: int | None, width: int | None) -> tuple[tuple[int, int, int], int, int]:
    """`(C, h, w)` of the unpacked latents and the image `(H, W)`, with the pipeline's defaults."""
    config, scale = pipe.transformer.config, pipe.vae_scale_factor
    if packs_latents(pipe):
        height, width = height or pipe.default_sample_size * scale, width or pipe.default_sample_size * scale
        multiple, channels = 2 * scale, config.in_channels // 4
    else:
        height, width = height or config.sample_size * scale, width or config.sample_size * scale
        multiple, channels = scale * config.patch_size, config.in_channels
    if height % multiple or width % multiple:
        raise UserError(f"height and width must be multiples of {multiple} for this pipeline; got {height}x{width}")
    return (channels, height // scale, width // scale), height, width


def pack(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, h, w]` → FLUX tokens `[B, h/2·w/2, 4C]` (each token a 2x2 patch, channel-major)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack`."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """FLUX's position ids of the packed tokens `[h/2·w/2, 3]`: (0, row, column)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device=device, dtype=dtype)


def image_seq_len(pipe, latent_hw: tuple[int, int]) -> int:
    """The number of image tokens the transformer sees (what the resolution-dependent shift μ depends on)."""
    h, w = latent_hw
    patch = 2 if packs_latents(pipe) else pipe.transformer.config.patch_size
    return (h // patch) * (w // patch)


def set_timesteps_kwargs(scheduler_config, num_steps: int, seq_len: int, packed: bool) -> dict:
    """The arguments the SD3 / FLUX pipeline passes to `set_timesteps` for `seq_len` image tokens."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = scheduler_config
    kwargs: dict = {"num_inference_steps": num_steps}
    if packed:  # FluxPipeline: its own sigmas, always resolution-shifted
        if not config.get("use_flow_sigmas"):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        max_shift = 1.15
    elif config.get("use_dynamic_shifting"):  # StableDiffusion3Pipeline: μ only with dynamic shifting
        max_shift = 1.16
    else:
        return kwargs
    kwargs["mu"] = calculate_shift(
        seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )
    return kwargs


@dataclass(frozen=True)
class FlowSchedule:
    """σ_0 = 1 > ... > σ_T = 0 and the model timesteps of one (scheduler config, num_steps, size), on CPU."""

    timesteps: torch.Tensor  # [T] float32, σ·num_train_timesteps as diffusers feeds the transformer
    sigmas: tuple[float, ...]  # T + 1 values, float32 as the scheduler holds them
    _by_eta: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, scheduler_config, set_timesteps: dict) -> FlowSchedule:
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
        scheduler.set_timesteps(**set_timesteps)
        return cls(timesteps=scheduler.timesteps.to("cpu", torch.float32), sigmas=tuple(scheduler.sigmas.tolist()))

    def __len__(self) -> int:
        return len(self.timesteps)

    def index(self, t) -> int:
        matches = (self.timesteps == torch.as_tensor(t, dtype=torch.float32).cpu()).nonzero()
        if len(matches) == 0:
            raise ValueError(f"timestep {float(t)} is not in this schedule {self.timesteps.tolist()}")
        return int(matches[0])

    def constants(self, i: int, eta: float, sde_type: str) -> FlowConstants:
        key = (eta, sde_type)
        if key not in self._by_eta:
            make = sde_constants if sde_type == "sde" else cps_constants
            self._by_eta[key] = [make(s, n, eta) for s, n in zip(self.sigmas[:-1], self.sigmas[1:])]
        return self._by_eta[key][i]


def flow_uses_cfg(pipe, guidance_scale: float) -> bool:
    """SD3: classifier-free guidance (an unconditional batch half) iff scale > 1. FLUX: never; `guidance_scale` is
    the guidance-distilled transformer's embedded guidance (ignored without `guidance_embeds`), as in diffusers."""
    return guidance_scale > 1 and not packs_latents(pipe)


@torch.no_grad()
def encode_flow_conditioning(
    pipe,
    prompts: Sequence[str] | str | None,
    *,
    guidance_scale: float,
    negative_prompt: Sequence[str] | str | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    max_sequence_length: int | None = None,
) -> tuple[Conditioning, list[str]]:
    """Encode prompts with the pipeline's own `encode_prompt` (CLIP + T5 towers), without gradients. Each distinct
    (prompt, negative prompt) is encoded once and its rows repeated: a GRPO batch holds k copies of each prompt."""
    if prompts is None and prompt_embeds is None:
        raise UserError("pass prompts or prompt_embeds to the sampler")
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompt_embeds is None and negative_prompt_embeds is None and not isinstance(negative_prompt, str):
        pairs = list(zip(prompts, negative_prompt or [None] * len(prompts)))
        distinct = list(dict.fromkeys(pairs))
        if len(distinct) < len(pairs):
            cond, _ = encode_flow_conditioning(
                pipe, [p for p, _ in distinct], guidance_scale=guidance_scale,
                negative_prompt=None if negative_prompt is None else [n for _, n in distinct],
                max_sequence_length=max_sequence_length,
            )  # fmt: skip
            rows = torch.tensor([distinct.index(pair) for pair in pairs], device=cond.prompt_embeds.device)
            return cond.select(rows), list(prompts)
    batch = len(prompts) if prompts is not None else prompt_embeds.shape[0]
    if prompt_embeds is not None and pooled_prompt_embeds is None:
        raise UserError("a flow pipeline needs pooled_prompt_embeds along with prompt_embeds")
    if isinstance(negative_prompt, str):
        negative_prompt = [negative_prompt] * batch
    device = pipe.transformer.device
    text = None if prompt_embeds is not None else list(prompts)
    if max_sequence_length is None:  # the T5 length a model was trained with, when its folder says (tiny-shapes-flow)
        max_sequence_length = pipe.config.get("_diffrl_max_sequence_length")
    length = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if packs_latents(pipe):
        if negative_prompt is not None or negative_prompt_embeds is not None:
            raise UserError("FLUX-class pipelines guide through the transformer's guidance embedding; "
                            "negative prompts (true CFG) are not supported by the flow sampler yet")  # fmt: skip
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=text, prompt_2=None, device=device, num_images_per_prompt=1, prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds, **length,
        )  # fmt: skip
        cond = Conditioning(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
    else:
        guided = flow_uses_cfg(pipe, guidance_scale)
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=text, prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=guided, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds, **length,
        )  # fmt: skip
        cond = Conditioning(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative if guided else None,
            pooled_prompt_embeds=pooled,
            negative_pooled_prompt_embeds=negative_pooled if guided else None,
        )
    return cond.to(device), list(prompts) if prompts is not None else [""] * batch


def _transformer_kwargs(cond: Conditioning, dtype: torch.dtype) -> dict:
    """Text inputs of one transformer call ([unconditional; conditional] when guided), cached on `cond`."""
    cache = cond.__dict__.setdefault("_flow_kwargs", {})
    if dtype not in cache:
        if cond.guided:
            embeds = torch.cat([cond.negative_prompt_embeds, cond.prompt_embeds])
            pooled = torch.cat([cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds])
        else:
            embeds, pooled = cond.prompt_embeds, cond.pooled_prompt_embeds
        cache[dtype] = {"encoder_hidden_states": embeds.to(dtype), "pooled_projections": pooled.to(dtype)}
    return cache[dtype]


def flow_model_output(
    pipe, x: torch.Tensor, t: torch.Tensor, cond: Conditioning, guidance_scale: float, dtype: torch.dtype,
    *, detach_uncond: bool = False,
) -> torch.Tensor:
    """The velocity for latents `x` (`[N, C, h, w]`) at model timestep `t` (σ·1000; a scalar or `[N]`), after
    guidance, in fp32 (fp64 for a float64 model: `step_dtype`).

    SD3: one batched call on [x; x] with [unconditional; conditional] text when guided, v = v_u + s·(v_c − v_u);
    `detach_uncond` stops the gradient through v_u (same value; the gradient is s·∇v_c, flow_grpo's
    `compute_log_prob`). FLUX: `x` packed into tokens, timestep σ, the guidance scale embedded
    (guidance-distilled transformers).
    """
    transformer = pipe.transformer
    text = _transformer_kwargs(cond, dtype)
    model_input = x.to(dtype)
    t = t.expand(x.shape[0])  # one timestep for the batch, or one per sample
    if packs_latents(pipe):
        n, _, h, w = x.shape
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_scale, device=x.device, dtype=torch.float32)
        tokens = transformer(
            hidden_states=pack(model_input),
            timestep=t.to(dtype) / 1000,
            guidance=guidance,
            txt_ids=torch.zeros(text["encoder_hidden_states"].shape[1], 3, device=x.device, dtype=dtype),
            img_ids=image_ids(h, w, x.device, dtype),
            return_dict=False,
            **text,
        )[0]
        return unpack(tokens.to(step_dtype(tokens.dtype)), h, w)
    if cond.guided:
        model_input, t = torch.cat([model_input, model_input]), torch.cat([t, t])
    output = transformer(hidden_states=model_input, timestep=t, return_dict=False, **text)[0]
    output = output.to(step_dtype(output.dtype))
    if not cond.guided:
        return output
    uncond, conditional = output.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance_scale * (conditional - uncond)


# ----------------------------------------------------------------------------------------------------------
# The sampler


class FlowSampler:
    """Flow-matching sampling with Flow-GRPO's SDE (or CPS) step, step and log-prob recomputation, over a
    `StableDiffusion3Pipeline` or `FluxPipeline` (any pipeline with their transformer, VAE, `encode_prompt` and a
    `FlowMatchEulerDiscreteScheduler` config).

    `eta` is the noise level a: 0 is the ODE (diffusers' own Euler sampler), Flow-GRPO samples with 0.7; one value
    per step gives an SDE window (stochastic only there, as Flow-GRPO-Fast and MixGRPO). Per-sample generators,
    hooks and `GradPolicy` as in `DDIMSampler` (`samplers.base`). Latents are `[B, C, h, w]` for both families.

    Args:
        sde_type (`str`, defaults to `"sde"`): `"sde"` (Flow-GRPO eq. 9) or `"cps"` (coefficients-preserving).
            Recorded in the trajectory as the sampler name `"flow"` / `"flow_cps"`.
        cps_log_prob (`str`, defaults to `"gaussian"`): the log-prob of a CPS step: `"gaussian"`, the Gaussian
            log-density (as every other step); `"reference"`, flow_grpo's −mean((x − μ)²), whose PPO ratio a clip
            range published for the reference code means the same thing on (module docstring). No effect on SDE
            steps. Flow-GRPO sets it from `train.cps_log_prob`.
        cfg_gradient (`str`, defaults to `"both"`): which CFG branches a recomputed step's gradient flows through
            (`log_prob`): `"both"`, v = v_u + s·(v_c − v_u) as computed; `"conditional"`, the unconditional branch
            detached (flow_grpo's training step). The values are the same. Flow-GRPO sets it from
            `train.cfg_gradient`.
        noise_device (`str` or `torch.device`, *optional*): where per-sample generators live (the transformer's).
    """

    name = "flow"
    # capabilities: what callers read instead of testing the name
    per_step_eta = True  # the noise level a is a number or one value per step (SDE window)
    consistency = False
    flow = True
    # sampling defaults (diffusers' StableDiffusion3Pipeline: 28 steps, CFG 7.0, its deterministic Euler sampler;
    # FluxPipeline: 28 steps, embedded guidance 3.5, set by `adapt_defaults`)
    default_num_steps = 28
    default_guidance_scale = 7.0
    default_eta = 0.0
    FLUX_GUIDANCE_SCALE = 3.5

    def adapt_defaults(self, pipe) -> None:
        """A FLUX-class pipeline's guidance is the transformer's embedded guidance, 3.5 by default in diffusers,
        not SD3's CFG 7.0."""
        if packs_latents(pipe):
            self.default_guidance_scale = self.FLUX_GUIDANCE_SCALE

    def __init__(self, *, sde_type: str = "sde", cps_log_prob: str = "gaussian", cfg_gradient: str = "both",
                 noise_device=None):
        if sde_type not in SDE_TYPES:
            raise UserError(f"sde_type {sde_type!r} is not one of {SDE_TYPES}")
        if cps_log_prob not in CPS_LOG_PROBS:
            raise UserError(f"cps_log_prob {cps_log_prob!r} is not one of {CPS_LOG_PROBS}")
        self.sde_type = sde_type
        self.cps_log_prob = cps_log_prob
        if cfg_gradient not in CFG_GRADIENTS:
            raise UserError(f"cfg_gradient {cfg_gradient!r} is not one of {CFG_GRADIENTS}")
        self.cfg_gradient = cfg_gradient
        self.name = "flow" if sde_type == "sde" else "flow_cps"
        self.noise_device = noise_device
        self._schedules: dict = {}
        self._current: FlowSchedule | None = None

    def schedule(self, pipe, num_steps: int, latent_hw: tuple[int, int]) -> FlowSchedule:
        """The σ schedule for a pipeline, a step count and a latent size `(h, w)` (cached)."""
        config = pipe.scheduler.config
        kwargs = set_timesteps_kwargs(config, num_steps, image_seq_len(pipe, latent_hw), packs_latents(pipe))
        key = (json.dumps(dict(config), sort_keys=True, default=str), json.dumps(kwargs, default=str))
        if key not in self._schedules:
            self._schedules[key] = FlowSchedule.from_config(config, kwargs)
        self._current = self._schedules[key]
        return self._current

    def _step_at(self, schedule, i, model_output, x_t, *, eta, prev_sample=None, noise=None) -> StepOutput:
        constants = schedule.constants(i, eta, self.sde_type)
        step = flow_step(model_output, x_t, constants, prev_sample=prev_sample, noise=noise)
        if self.sde_type == "cps" and self.cps_log_prob == "reference":
            step = cps_reference_log_prob(step)
        return step

    def step_constants(self, pipe, traj: Trajectory, step_index: int) -> FlowConstants:
        """The `FlowConstants` of step `step_index` of `traj` (σ, σ', std, the reference's std_dev_t), from the
        pipeline's schedule for the trajectory's step count and size."""
        schedule = self.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:]))
        return schedule.constants(step_index, step_etas(traj.eta, traj.num_steps)[step_index], self.sde_type)

    def _step_fn(self, schedule: FlowSchedule, etas: Sequence[float]):
        return lambda model_output, i, x_t, prev_sample, noise: self._step_at(
            schedule, i, model_output, x_t, eta=etas[i], prev_sample=prev_sample, noise=noise
        )

    def draws_noise(self, schedule: FlowSchedule, etas: Sequence[float]) -> list[bool]:
        """Whether each step draws noise: wherever its std > 0 (a > 0; not CPS's last step)."""
        return [schedule.constants(i, e, self.sde_type).std > 0 for i, e in enumerate(etas)]

    def step(
        self,
        model_output: torch.Tensor,
        t,
        x_t: torch.Tensor,
        *,
        eta: float,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        noise: torch.Tensor | None = None,
        schedule: FlowSchedule | None = None,
    ) -> StepOutput:
        """One step from model timestep `t` (as `FlowMatchEulerDiscreteScheduler.step` at a = 0, plus mean, std,
        log-prob). `schedule` defaults to the last one built by `schedule`/`sample`; others as `DDIMSampler.step`."""
        schedule = schedule or self._current
        if schedule is None:
            raise ValueError("no schedule yet: call sampler.schedule(pipe, num_steps, (h, w)) or sample() first")
        i = schedule.index(t)
        if prev_sample is None and noise is None and schedule.constants(i, eta, self.sde_type).std > 0:
            noise = step_noise(generator, x_t)
        return self._step_at(schedule, i, model_output, x_t, eta=eta, prev_sample=prev_sample, noise=noise)

    def sample(
        self,
        pipe,
        prompts: Sequence[str] | str | None,
        *,
        num_steps: int,
        guidance_scale: float,
        eta: float | Sequence[float],
        generator=None,
        latents: torch.Tensor | None = None,
        hooks: Sequence[SamplerHook] = (),
        grad: GradPolicy | None = None,
        negative_prompt: Sequence[str] | str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        seeds: Sequence[int] | None = None,
        output: str = "images",
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int | None = None,
    ) -> Trajectory:
        """Sample a batch and record its trajectory.

        Args:
            pipe: a `StableDiffusion3Pipeline` or `FluxPipeline`.
            prompts (`list[str]`): one per sample (`None` with `prompt_embeds` and `pooled_prompt_embeds`).
            num_steps (`int`): denoising steps T.
            guidance_scale (`float`): SD3: the CFG scale (no CFG when ≤ 1); FLUX: the embedded guidance.
            eta (`float` or `Sequence[float]`): the noise level a ≥ 0, or one per step (SDE window).
            latents (`torch.Tensor` `[B, C, h, w]`, *optional*): start noise x_1, unpacked also for FLUX.
            max_sequence_length (`int`, *optional*): T5 tokens (default: the loaded folder's
                `_diffrl_max_sequence_length` (0 for tiny-shapes-flow), else the pipeline's: 256 SD3, 512 FLUX).
            Others: as `DDIMSampler.sample` (FLUX takes no negative prompt).
        """
        if num_steps < 1:
            raise UserError(f"num_steps must be >= 1, got {num_steps}")
        if output not in ("images", "latents"):
            raise UserError(f"output must be 'images' or 'latents', got {output!r}")
        etas = step_etas(eta, num_steps)
        check_flow_pipeline(pipe)
        transformer = pipe.transformer
        device, dtype = transformer.device, module_dtype(transformer)
        shape, height, width = flow_latent_shape(pipe, height, width)
        schedule = self.schedule(pipe, num_steps, shape[1:])
        cond, prompts = encode_flow_conditioning(
            pipe, prompts, guidance_scale=guidance_scale, negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds, negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
        )  # fmt: skip
        batch = len(cond)
        generators, seeds = make_generators(batch, seeds=seeds, generator=generator, device=self.noise_device or device)
        if latents is None:
            x_T = draw_noise(generators, shape, device, step_dtype(dtype))  # x_1 ~ N(0, I): σ_0 = 1 is pure noise
        else:
            if tuple(latents.shape) != (batch, *shape):
                raise UserError(f"latents must have shape {(batch, *shape)}, got {tuple(latents.shape)}")
            x_T = latents.to(device=device, dtype=step_dtype(dtype))
        timesteps_device = schedule.timesteps.to(device)

        def predict(x, i, c: Conditioning):
            return flow_model_output(pipe, x, timesteps_device[i], c, guidance_scale, dtype)

        loop = DenoisingLoop(
            sampler=self, pipe=pipe, timesteps=schedule.timesteps, predict_fn=predict,
            step_fn=self._step_fn(schedule, etas), cond=cond, prompts=prompts, generators=generators,
            draws_noise=self.draws_noise(schedule, etas), evals_per_row=2 if cond.guided else 1, hooks=hooks,
            grad=grad,
        )  # fmt: skip
        result = loop.run(x_T)
        images = decode_images(pipe, result.final_latents, grad) if output == "images" else None
        return Trajectory(
            latents=result.latents,
            timesteps=schedule.timesteps,
            log_probs=result.log_probs,
            prompts=result.prompts,
            seeds=seeds,
            guidance_scale=float(guidance_scale),
            eta=etas[0] if isinstance(eta, (int, float)) else etas,
            num_steps=num_steps,
            sampler=self.name,
            images=images,
            final_latents=result.final_latents,
            grad_steps=result.grad_steps,
            nfe=result.nfe,
            extras=result.extras,
            **result.cond.trajectory_fields(),
        )

    def log_prob(
        self,
        pipe,
        traj: Trajectory,
        step_index: int,
        *,
        indices: Sequence[int] | torch.Tensor | None = None,
        return_step: bool = False,
    ) -> torch.Tensor | StepOutput:
        """Recompute the log-prob of step `step_index` of `traj` under the pipeline's current weights: one batched
        transformer call, guided as in the rollout. Equals `traj.log_probs[:, step_index]` before any update.
        Arguments as `DDIMSampler.log_prob`; with `return_step` the `StepOutput` (mean and std for a KL)."""
        check_trajectory(traj, self.name, step_index)
        check_flow_pipeline(pipe)
        schedule = self.schedule(pipe, traj.num_steps, tuple(traj.latents.shape[-2:]))
        if not torch.equal(schedule.timesteps, traj.timesteps.cpu()):
            raise ValueError("the pipeline's scheduler gives other timesteps than the trajectory was sampled with")
        sub = traj if indices is None else traj.select(indices)
        transformer = pipe.transformer
        device, dtype = transformer.device, module_dtype(transformer)
        cond = Conditioning.from_trajectory(sub).to(device)
        if cond.guided != flow_uses_cfg(pipe, traj.guidance_scale):
            raise ValueError("the trajectory's guidance does not match this pipeline (CFG vs embedded guidance)")
        x_t = sub.latents[:, step_index].to(device)
        t = schedule.timesteps[step_index].to(device)
        velocity = flow_model_output(pipe, x_t, t, cond, traj.guidance_scale, dtype,
                                     detach_uncond=self.cfg_gradient == "conditional")
        eta = step_etas(traj.eta, traj.num_steps)[step_index]
        step = self._step_at(
            schedule, step_index, velocity, x_t, eta=eta, prev_sample=sub.latents[:, step_index + 1].to(device)
        )
        return step if return_step else step.log_prob
