"""The forward (noising) process and the model's own training target, as pure functions of tensors.

Variance-preserving diffusion as diffusers' DDPM-family schedulers define it (Ho et al. 2020, eq. 4; Salimans & Ho
2022, §4 for v): with ᾱ_t = `alphas_cumprod[t]`,

    x_t = √ᾱ_t · x0 + √(1 − ᾱ_t) · ε                       (`DDPMScheduler.add_noise`)
    v   = √ᾱ_t · ε  − √(1 − ᾱ_t) · x0                      (`DDPMScheduler.get_velocity`)

Used by trainers that noise clean latents themselves: RAFT's denoising loss on its kept samples and DRaFT-LV's
re-noising of a final sample. The inverse map (x̂0 from a model output) is `samplers.base.pred_x0_and_eps`.
"""

from __future__ import annotations

import torch

from samplers.base import PREDICTION_TYPES


def _coefficients(alpha_bar: float | torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """√ᾱ and √(1 − ᾱ) shaped to broadcast against `like` `[B, ...]`: a number or 0-d tensor applies to every row,
    a `[B]` tensor gives one ᾱ per row."""
    alpha_bar = torch.as_tensor(alpha_bar, device=like.device).to(like.dtype)
    if alpha_bar.ndim == 1:
        alpha_bar = alpha_bar.reshape(-1, *([1] * (like.ndim - 1)))
    elif alpha_bar.ndim > 1:
        raise ValueError(f"alpha_bar must be a number, a 0-d tensor or one value per row [B]; got {alpha_bar.shape}")
    return alpha_bar.sqrt(), (1 - alpha_bar).sqrt()


def add_noise(x0: torch.Tensor, noise: torch.Tensor, alpha_bar: float | torch.Tensor) -> torch.Tensor:
    """Noise clean latents to level ᾱ: `x_t = √ᾱ · x0 + √(1 − ᾱ) · ε`.

    Args:
        x0 (`torch.Tensor` of shape `[B, C, h, w]`): clean latents (gradients flow through, if they carry any).
        noise (`torch.Tensor` of the same shape): ε ~ N(0, I).
        alpha_bar (`float` or `torch.Tensor` 0-d or `[B]`): ᾱ_t, e.g. `scheduler.alphas_cumprod[timesteps]`.

    Returns:
        `torch.Tensor` `[B, C, h, w]`: x_t, in `x0`'s dtype.
    """
    sqrt_alpha, sqrt_beta = _coefficients(alpha_bar, x0)
    return sqrt_alpha * x0 + sqrt_beta * noise


def denoising_target(
    x0: torch.Tensor, noise: torch.Tensor, alpha_bar: float | torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """What the model is trained to output at x_t = `add_noise(x0, noise, alpha_bar)`.

    `"epsilon"`: ε; `"v_prediction"`: v = √ᾱ · ε − √(1 − ᾱ) · x0; `"sample"`: x0 — the three
    `scheduler.config.prediction_type` values of diffusers.

    Args:
        x0 (`torch.Tensor` `[B, C, h, w]`), noise (`torch.Tensor` `[B, C, h, w]`), alpha_bar: as in `add_noise`.
        prediction_type (`str`): the scheduler config's `prediction_type`.

    Returns:
        `torch.Tensor` `[B, C, h, w]`: the regression target (no graph is added beyond that of `x0` and `noise`).
    """
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        sqrt_alpha, sqrt_beta = _coefficients(alpha_bar, x0)
        return sqrt_alpha * noise - sqrt_beta * x0
    if prediction_type == "sample":
        return x0
    raise ValueError(f"prediction_type {prediction_type!r} is not one of {PREDICTION_TYPES}")
