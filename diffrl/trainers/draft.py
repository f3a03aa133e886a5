"""DRaFT: fine-tune a diffusion model by backpropagating a differentiable reward through sampling (Clark et al. 2023).

Papers:
- "Directly Fine-Tuning Diffusion Models on Differentiable Rewards" (DRaFT, DRaFT-K, DRaFT-LV), Clark, Vicol, Swersky &
  Fleet, ICLR 2024, https://arxiv.org/abs/2309.17400.
- "Aligning Text-to-Image Diffusion Models with Reward Backpropagation" (AlignProp), Prabhudesai, Goyal, Pathak &
  Fragkiadaki 2023, https://arxiv.org/abs/2310.03739: the same gradient, with randomised truncation.

The objective is J(θ) = E_{c, x_T}[ r(sample(θ, c, x_T), c) ]: the sampler is a differentiable function of the
weights θ (DDIM, usually η = 0), so ∇_θ r is obtained by backpropagating through the sampling chain and the VAE
decoder (the reparameterisation, or "pathwise", gradient). The loss is −J: `draft_loss(rewards) = −mean(rewards)`.

Variants, by which steps' model calls keep their graph (`samplers.base.GradPolicy`):
    truncation="full"         DRaFT (paper Algorithm 1): every step.
    truncation="last", k=K    DRaFT-K: only the last K steps; earlier model outputs are constants (stop_grad).
                              A biased but far cheaper and, in the paper, better-behaved gradient:
                              K = 1 beat full DRaFT at equal steps (long chains make gradients explode).
    truncation="random_last"  AlignProp's randomised truncation: the last K steps, K ~ U{1, ..., k} drawn per batch.
    lv_samples=n > 0          DRaFT-LV (paper Algorithm 2; K = 1 only): x0 is sampled without any graph, then
                              re-noised n times to the input of the sampler's last step, x_1^i = α_1 x0 + σ_1 ε_i,
                              and each x_1^i is denoised in one step; the gradient is that of the mean of the n
                              rewards. n draws share one expensive chain, hence the lower variance (the paper: n = 2).

Code names -> paper notation (the paper writes the VP forward process as x_t = α_t x0 + σ_t ε, α_t² + σ_t² = 1):
    alpha_bar                   ᾱ_t = α_t²;  √ᾱ_t = α_t,  √(1 − ᾱ_t) = σ_t
    rewards                     r(x0, c), one per sample
    k                           K, the number of trailing sampling steps that keep a graph
    lv_samples                  n, DRaFT-LV's inner-loop count
    noise                       ε_i, i = 1..n  (`[n, B, C, h, w]`)
    timestep, alpha_bar in LV   t = 1 in the paper's indexing of the T sampling steps: the input timestep of the
                                sampler's LAST step (`final_step_noise_level`); model timestep 1 for SD's 50-step DDIM
    model_output                ε̂_θ(x_t, t, c) (or v̂ for v-prediction; diffusers calls either `noise_pred`)
    one_step_denoise            x̂0 = (x_t − σ_t ε̂) / α_t   (v: x̂0 = α_t x_t − σ_t v̂)

Differences from the reference code, on purpose:
- AlignProp's original code (mihirp1998/AlignProp, main.py, Oct 2023) draws the truncation point afresh at every
  step (`random.randint` inside the step loop), so each step's gradient is kept independently with probability
  (i + 1)/51 rather than as a suffix; its 2024 rewrite draws one point per batch from N(42, 5). Here K is drawn
  once per batch, uniform on 1..k, as the paper describes (`GradPolicy(keep="random_last")`).
- DRaFT-LV's one-step denoise returns x̂0 itself, as the paper's algorithm does (its last step lands on x0). A
  diffusers DDIM chain with `set_alpha_to_one=False` (SD 1.x) ends at ᾱ = alphas_cumprod[0] = 0.99915 instead;
  the two differ by 0.03·ε̂ of a nearly clean image, which the reward hardly sees.
- DRaFT-LV averages the n rewards (Algorithm 2 adds up the n gradients): the loss scale does not change with n.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from diffrl.errors import UserError
from diffrl.trainers.common.noising import add_noise
from samplers.base import GradPolicy, pred_x0_and_eps

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group, algorithm-only: optimizer, schedule, clipping and accumulation are the
# top-level `optim` group's). Defaults: the DRaFT paper's recommended variant (DRaFT-1) and both papers' code.
# ---------------------------------------------------------------------------------------------------------------

TRUNCATIONS = ("full", "last", "random_last")


@dataclass
class DRaFTConfig:
    # which sampling steps the reward gradient flows back through: "full" = all T (DRaFT), "last" = the last k
    # (DRaFT-K), "random_last" = the last K with K ~ U{1..k} per batch (AlignProp). Default last with k = 1: DRaFT-1,
    # the paper's best trade-off (higher reward than full DRaFT at the same number of steps, at 1/T of its backward)
    truncation: Literal["full", "last", "random_last"] = "last"
    # K, in sampling steps (not model timesteps); for random_last the largest K drawn (AlignProp's paper draws over
    # the whole chain, k = T). Must be 1 with truncation=full, where it has no meaning
    k: int = 1
    # DRaFT-LV's n: re-noised one-step denoisings of each final sample; 0 = off. Needs truncation=last and k = 1.
    # The paper uses n = 2 (each extra draw costs one UNet call + reward, not a sampling chain)
    lv_samples: int = 0
    # recompute each kept UNet call (and the VAE decode) during backward (`torch.utils.checkpoint`): the same
    # gradient with activation memory flat in K. Both papers train with it on (AlignProp's code: grad_checkpoint=True);
    # it costs one extra forward per kept step
    checkpointing: bool = True
    # prompts (= samples) per micro-batch, per process. Each is a differentiable sampling run that holds its kept
    # steps' graph until backward, so memory rather than statistics sets it; accumulation (optim group) makes up
    # the global batch
    batch_size: int = 4
    # loss = −reward_scale · mean(r) (the paper maximises r itself: 1). Under Adam a constant scale mostly cancels,
    # but it moves where gradient-norm clipping bites (AlignProp multiplies by 0.01 against a clip norm of 5)
    reward_scale: float = 1.0


TrainConfig = DRaFTConfig


def check(tc: DRaFTConfig, *, num_steps: int | None = None, reward_differentiable: bool | None = None) -> None:
    """Refuse settings that do not make a DRaFT run, with a one-line `UserError` naming the keys.

    Args:
        tc (`DRaFTConfig`): the `train:` group.
        num_steps (`int`, *optional*): the sampler's step count T, to check K against it.
        reward_differentiable (`bool`, *optional*): the reward's `differentiable` attribute.
    """
    if tc.truncation not in TRUNCATIONS:
        raise UserError(f"train.truncation must be one of {TRUNCATIONS}, got {tc.truncation!r}")
    if tc.k < 1:
        raise UserError(f"train.k must be >= 1 (the number of trailing steps that keep a graph), got {tc.k}")
    if tc.truncation == "full" and tc.k != 1:
        raise UserError(f"train.k={tc.k} has no effect with train.truncation=full (every step keeps its graph); "
                        "use truncation=last for DRaFT-K or drop train.k")
    if tc.lv_samples < 0:
        raise UserError(f"train.lv_samples must be >= 0 (0 = DRaFT-LV off), got {tc.lv_samples}")
    if tc.lv_samples > 0 and (tc.truncation != "last" or tc.k != 1):
        raise UserError(f"train.lv_samples={tc.lv_samples} (DRaFT-LV) re-noises the last step only: it needs "
                        f"train.truncation=last and train.k=1, got truncation={tc.truncation}, k={tc.k}")
    if tc.batch_size < 1:
        raise UserError(f"train.batch_size must be >= 1, got {tc.batch_size}")
    if not (math.isfinite(tc.reward_scale) and tc.reward_scale > 0):
        raise UserError(f"train.reward_scale must be a positive number, got {tc.reward_scale} "
                        "(to minimise a score, negate the reward instead)")
    if num_steps is not None and tc.truncation != "full" and tc.k > num_steps:
        raise UserError(f"train.k={tc.k} is more than the {num_steps} sampling steps (sample.num_steps); "
                        "use truncation=full to backpropagate through all of them")
    if reward_differentiable is False:
        raise UserError("DRaFT backpropagates through the reward, and this reward is not differentiable: "
                        "choose a differentiable reward or train with ddpo")


def grad_policy(tc: DRaFTConfig, *, decode: bool = True) -> GradPolicy:
    """The sampler's differentiable mode for this config (pass it as `sampler.sample(..., grad=...)`).

    With DRaFT-LV the rollout keeps no graph at all (`keep="none"`): Algorithm 2 samples x0 under stop-gradient and
    the gradient comes from `lv_reward`'s one-step denoisings only.

    Args:
        tc (`DRaFTConfig`): the `train:` group (assumed to have passed `check`).
        decode (`bool`, *optional*, defaults to `True`): backpropagate through the VAE decode (`False` for a reward
            computed on latents).
    """
    if tc.lv_samples > 0:
        return GradPolicy(keep="none")
    keep = {"full": "all", "last": "last", "random_last": "random_last"}[tc.truncation]
    return GradPolicy(keep=keep, k=tc.k, checkpoint=tc.checkpointing, decode=decode)


# ---------------------------------------------------------------------------------------------------------------
# Pure losses
# ---------------------------------------------------------------------------------------------------------------


def draft_loss(rewards: torch.Tensor, reward_scale: float = 1.0) -> tuple[torch.Tensor, dict]:
    """DRaFT's loss: the negative mean reward, `loss = −reward_scale · mean_i r_i`.

    Args:
        rewards (`torch.Tensor` of shape `[B]`): differentiable rewards of a batch (their graph reaches the weights).
        reward_scale (`float`, *optional*, defaults to 1.0): positive factor on the reward.

    Returns:
        `(loss, stats)`: the scalar loss and detached float64 diagnostics `reward_mean`, `reward_std` (population,
        so defined for B = 1), `reward_min`, `reward_max`.
    """
    loss = -reward_scale * rewards.float().mean()
    with torch.no_grad():
        r = rewards.detach().double()
        stats = {
            "reward_mean": r.mean(),
            "reward_std": r.std(correction=0),
            "reward_min": r.min(),
            "reward_max": r.max(),
        }
    return loss, stats


def one_step_denoise(
    x_t: torch.Tensor, model_output: torch.Tensor, alpha_bar: float | torch.Tensor, prediction_type: str = "epsilon"
) -> torch.Tensor:
    """The model's one-step estimate of the clean latents at noise level ᾱ.

    epsilon: `x̂0 = (x_t − √(1 − ᾱ) ε̂) / √ᾱ`; v_prediction: `x̂0 = √ᾱ x_t − √(1 − ᾱ) v̂`; sample: `x̂0 = output`.
    The samplers' own map (`samplers.base.pred_x0_and_eps`), here with ᾱ instead of its square roots.

    Args:
        x_t (`torch.Tensor` `[B, C, h, w]`): noisy latents.
        model_output (`torch.Tensor` `[B, C, h, w]`): the (guided) model output at `x_t`.
        alpha_bar (`float` or 0-d `torch.Tensor`): ᾱ_t of `x_t`'s timestep.
        prediction_type (`str`, *optional*, defaults to `"epsilon"`): the scheduler config's `prediction_type`.
    """
    alpha_bar = torch.as_tensor(alpha_bar, dtype=torch.float64)
    if alpha_bar.ndim != 0:
        raise ValueError("one_step_denoise takes one noise level for the batch (a number or a 0-d tensor)")
    pred_x0, _ = pred_x0_and_eps(
        model_output, x_t, math.sqrt(alpha_bar.item()), math.sqrt(1 - alpha_bar.item()), prediction_type
    )
    return pred_x0


def final_step_noise_level(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> tuple[int, float]:
    """Where DRaFT-LV re-noises to: the input of the sampler's last step (t = 1 in the paper's Algorithm 2).

    Args:
        timesteps (`torch.Tensor` `[T]`): the sampling run's model timesteps in sampling order
            (`Trajectory.timesteps`).
        alphas_cumprod (`torch.Tensor` `[num_train_timesteps]`): the scheduler's ᾱ table
            (`pipe.scheduler.alphas_cumprod`).

    Returns:
        `(timestep, alpha_bar)`: the model timestep of the last step and its ᾱ.
    """
    timestep = int(timesteps[-1])
    return timestep, float(alphas_cumprod[timestep])


def lv_reward(
    x0: torch.Tensor,
    noise: torch.Tensor,
    *,
    alpha_bar: float,
    timestep: int | torch.Tensor,
    predict_noise: Callable[[torch.Tensor, int | torch.Tensor], torch.Tensor],
    reward_fn: Callable[[torch.Tensor], torch.Tensor],
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """DRaFT-LV's reward (paper Algorithm 2): the mean over n re-noised, one-step-denoised copies of each sample.

    For i = 1..n: `x_t^i = √ᾱ · sg(x0) + √(1 − ᾱ) · ε_i`, `x̂0^i = one_step_denoise(x_t^i, predict_noise(x_t^i, t))`,
    and the result is `mean_i reward_fn(x̂0^i)`. `x0` is detached here (the algorithm samples it under
    stop-gradient), so the gradient of `draft_loss(lv_reward(...))` flows only through the n model calls; in
    expectation over ε it is the gradient of E_ε[r(x̂0(√ᾱ x0 + √(1 − ᾱ) ε))] (an unbiased estimate of it).

    Args:
        x0 (`torch.Tensor` `[B, C, h, w]`): the final latents of a rollout.
        noise (`torch.Tensor` `[n, B, C, h, w]`): the n standard-normal draws ε_i (the caller's generator).
        alpha_bar (`float`): ᾱ of the re-noising level; with `timestep`, from `final_step_noise_level`.
        timestep (`int` or 0-d `torch.Tensor`): the model timestep passed to `predict_noise`.
        predict_noise (`Callable`): `(x_t [B, C, h, w], timestep) -> model output [B, C, h, w]` with its graph to
            the weights (guided as in sampling, ε or v as the scheduler predicts).
        reward_fn (`Callable`): `(latents [B, C, h, w]) -> rewards [B]`, differentiable (decode + reward).
        prediction_type (`str`, *optional*, defaults to `"epsilon"`): the scheduler config's `prediction_type`.

    Returns:
        `torch.Tensor` `[B]`: the averaged rewards, with the graph of all n one-step denoisings.
    """
    if noise.ndim != x0.ndim + 1 or noise.shape[1:] != x0.shape or noise.shape[0] < 1:
        raise ValueError(f"noise must have shape [n, *x0.shape] with n >= 1; got {tuple(noise.shape)} "
                         f"for x0 {tuple(x0.shape)}")
    x0 = x0.detach()
    total = None
    for eps in noise:  # the paper's inner loop; one UNet call each
        x_t = add_noise(x0, eps.to(x0), alpha_bar)
        x0_hat = one_step_denoise(x_t, predict_noise(x_t, timestep), alpha_bar, prediction_type)
        rewards = reward_fn(x0_hat)
        total = rewards if total is None else total + rewards
    return total / noise.shape[0]
