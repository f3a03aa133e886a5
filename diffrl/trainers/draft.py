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
    truncation="random_last"  AlignProp's paper: the last K steps, K ~ U{1, ..., k} drawn per batch.
    truncation="normal_cutoff" AlignProp's code (the default of its current training script): a cut-off step b drawn
                              per batch, b = ⌊z⌋ with z ~ N(42, 5) redrawn until 1 ≤ b < T; the last K = T − b steps
                              keep their graph (on 50 steps K is 1..49, mean 9.09). See `normal_cutoff_pmf`.
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
- AlignProp's truncation has had three forms. The paper: K uniform over the chain, once per batch
  (`truncation=random_last`). Its first code (mihirp1998/AlignProp, main.py, Oct 2023) drew the cut-off afresh at
  every step (`random.randint` inside the step loop), so each step's gradient was kept independently with
  probability (i + 1)/51 rather than as a suffix: not offered here. Its current code (sd_pipeline.py,
  `pipeline_step_with_grad`, at b22918a) draws one cut-off b per batch from N(42, 5) as above, on the same
  suffix-of-the-chain rule as diffrl (steps i ≥ b keep the UNet output's graph): `truncation=normal_cutoff`, whose
  numbers equal that code's (tests/trainers/test_alignprop_parity.py). That code never keeps all T steps (b ≥ 1).
- `cutoff_mean`/`cutoff_std` are in steps of a 50-step chain, the reference's only setting; on T steps both are
  multiplied by T/50 (b keeps its place as a fraction of the chain: 0.84 ± 0.10), so a 10-step chain keeps a
  similar share (K = 1..9, mean 2.23). The reference uses N(42, 5) whatever T is: on 20 steps its redraw loop needs
  about 2·10⁵ draws per batch (P(z < 20) = 5·10⁻⁶), on 10 steps about 10¹⁰. On 50 steps the two are the same.
- DRaFT-LV's one-step denoise returns x̂0 itself, as the paper's algorithm does (its last step lands on x0). A
  diffusers DDIM chain with `set_alpha_to_one=False` (SD 1.x) ends at ᾱ = alphas_cumprod[0] = 0.99915 instead;
  the two differ by 0.03·ε̂ of a nearly clean image, which the reward hardly sees.
- DRaFT-LV averages the n rewards (Algorithm 2 adds up the n gradients): the loss scale does not change with n.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import Conditioning
from diffrl.models.unet import add_noise
from diffrl.training.context import RunContext
from diffrl.training.loop import RunningMean
from diffrl.training.rollout import draw_batch, gather_rollout
from rewards.registry import declared_differentiable, differentiable_rewards
from samplers.base import GradPolicy, pred_x0_and_eps

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group, algorithm-only: optimizer, schedule, clipping and accumulation are the
# top-level `optim` group's). Defaults: the DRaFT paper's recommended variant (DRaFT-1) and both papers' code.
# ---------------------------------------------------------------------------------------------------------------

TRUNCATIONS = ("full", "last", "random_last", "normal_cutoff")
# the chain length `cutoff_mean` / `cutoff_std` are given for: AlignProp's 50 DDIM steps
CUTOFF_REFERENCE_STEPS = 50


@dataclass
class DRaFTConfig:
    # which sampling steps the reward gradient flows back through: "full" = all T (DRaFT), "last" = the last k
    # (DRaFT-K), "random_last" = the last K with K ~ U{1..k} per batch (AlignProp's paper), "normal_cutoff" = the
    # last K = T − b with the cut-off b ~ ⌊N(cutoff_mean, cutoff_std)⌋ in [1, T) per batch (AlignProp's code).
    # Default last with k = 1: DRaFT-1, the paper's best trade-off (higher reward than full DRaFT at the same number
    # of steps, at 1/T of its backward)
    truncation: Literal["full", "last", "random_last", "normal_cutoff"] = "last"
    # K, in sampling steps (not model timesteps); for random_last the largest K drawn (AlignProp's paper draws over
    # the whole chain, k = T). Must be 1 with truncation=full or normal_cutoff, where it has no meaning
    k: int = 1
    # normal_cutoff only: mean and std of the cut-off step b, in steps of a 50-step chain (scaled by T/50 on T
    # steps). AlignProp's code: N(42, 5), so on 50 steps the last 50 − b = 1..49 steps (mean 9.09) keep a graph
    cutoff_mean: float = 42.0
    cutoff_std: float = 5.0
    # DRaFT-LV's n: re-noised one-step denoisings of each final sample; 0 = off. Needs truncation=last and k = 1.
    # The paper uses n = 2 (each extra draw costs one UNet call + reward, not a sampling chain)
    lv_samples: int = 0
    # recompute each kept UNet call (and the VAE decode) during backward (`torch.utils.checkpoint`): the same
    # gradient with activation memory flat in K. Both papers train with it on (AlignProp's code: grad_checkpoint=True);
    # it costs one extra forward per kept step
    checkpointing: bool = True
    # loss = −reward_scale · mean(r) (the paper maximises r itself: 1). Under Adam a constant scale mostly cancels,
    # but it moves where gradient-norm clipping bites (AlignProp multiplies by 0.01 against a clip norm of 5)
    reward_scale: float = 1.0


TrainConfig = DRaFTConfig

# The shared `optim:` group's defaults: AlignProp's code and DRaFT's paper train LoRA with AdamW at lr 1e-3 ... 3e-4
# with a small gradient-norm clip; 3e-4 and clip 1.0 here (the paper's DRaFT-1 SD runs use 3e-4 on rank-8 LoRA),
# weight decay 1e-2 as AlignProp's AdamW. One micro-batch (sample.batch_size prompts) per optimizer step.
OPTIM_DEFAULTS = {"learning_rate": 3e-4, "weight_decay": 1e-2, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
ADVANTAGE_DEFAULTS = None  # a pathwise gradient: no advantages


def check_train(tc: DRaFTConfig, *, num_steps: int | None = None, reward_differentiable: bool | None = None) -> None:
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
    if tc.truncation == "normal_cutoff" and tc.k != 1:
        raise UserError(f"train.k={tc.k} has no effect with train.truncation=normal_cutoff (K = T − b follows "
                        "from the drawn cut-off b); set train.cutoff_mean / train.cutoff_std or drop train.k")
    if (tc.cutoff_mean, tc.cutoff_std) != (42.0, 5.0) and tc.truncation != "normal_cutoff":
        raise UserError(f"train.cutoff_mean / train.cutoff_std apply to train.truncation=normal_cutoff, not "
                        f"{tc.truncation}; set truncation=normal_cutoff or drop them")
    if not (math.isfinite(tc.cutoff_std) and 0 < tc.cutoff_std <= CUTOFF_REFERENCE_STEPS):
        raise UserError(f"train.cutoff_std must be in (0, {CUTOFF_REFERENCE_STEPS}] steps of a 50-step chain "
                        f"(AlignProp: 5), got {tc.cutoff_std}")
    if not (math.isfinite(tc.cutoff_mean) and 0 < tc.cutoff_mean < CUTOFF_REFERENCE_STEPS):
        raise UserError(f"train.cutoff_mean must be in (0, {CUTOFF_REFERENCE_STEPS}) steps of a 50-step chain "
                        f"(AlignProp: 42), got {tc.cutoff_mean}")
    if tc.lv_samples < 0:
        raise UserError(f"train.lv_samples must be >= 0 (0 = DRaFT-LV off), got {tc.lv_samples}")
    if tc.lv_samples > 0 and (tc.truncation != "last" or tc.k != 1):
        raise UserError(f"train.lv_samples={tc.lv_samples} (DRaFT-LV) re-noises the last step only: it needs "
                        f"train.truncation=last and train.k=1, got truncation={tc.truncation}, k={tc.k}")
    if not (math.isfinite(tc.reward_scale) and tc.reward_scale > 0):
        raise UserError(f"train.reward_scale must be a positive number, got {tc.reward_scale} "
                        "(to minimise a score, negate the reward instead)")
    if num_steps is not None and tc.truncation == "normal_cutoff":
        if num_steps < 2:
            raise UserError(f"train.truncation=normal_cutoff needs at least 2 sampling steps (a cut-off in "
                            f"1..T−1), got sample.num_steps={num_steps}; use truncation=last")
        if tc.cutoff_mean * num_steps / CUTOFF_REFERENCE_STEPS < 1:
            raise UserError(f"train.cutoff_mean={tc.cutoff_mean} (scaled by {num_steps}/{CUTOFF_REFERENCE_STEPS}) "
                            f"falls before the first cut-off step on {num_steps} sampling steps; use at least "
                            f"{CUTOFF_REFERENCE_STEPS / num_steps:g}")
    if num_steps is not None and tc.truncation != "full" and tc.k > num_steps:
        raise UserError(f"train.k={tc.k} is more than the {num_steps} sampling steps (sample.num_steps); "
                        "use truncation=full to backpropagate through all of them")
    if reward_differentiable is False:
        raise UserError("DRaFT backpropagates through the reward, and this reward is not differentiable: "
                        "choose a differentiable reward or train with ddpo")


def grad_policy(
    tc: DRaFTConfig, *, decode: bool = True, num_steps: int | None = None, generator: torch.Generator | None = None
) -> GradPolicy:
    """The sampler's differentiable mode for one batch (pass it as `sampler.sample(..., grad=...)`).

    With DRaFT-LV the rollout keeps no graph at all (`keep="none"`): Algorithm 2 samples x0 under stop-gradient and
    the gradient comes from `lv_reward`'s one-step denoisings only. With `truncation=normal_cutoff` K is drawn here
    (`draw_normal_cutoff`), so call this once per batch; random_last's K is drawn by the sampler.

    Args:
        tc (`DRaFTConfig`): the `train:` group (assumed to have passed `check`).
        decode (`bool`, *optional*, defaults to `True`): backpropagate through the VAE decode (`False` for a reward
            computed on latents).
        num_steps (`int`, *optional*): the sampling steps T; needed by `truncation=normal_cutoff`.
        generator (`torch.Generator`, *optional*): for normal_cutoff's draw; defaults to torch's global generator.
    """
    if tc.lv_samples > 0:
        return GradPolicy(keep="none")
    if tc.truncation == "normal_cutoff":
        if num_steps is None:
            raise ValueError("truncation=normal_cutoff draws K from the number of sampling steps: pass num_steps")
        k = draw_normal_cutoff(num_steps, tc.cutoff_mean, tc.cutoff_std, generator)
        return GradPolicy(keep="last", k=k, checkpoint=tc.checkpointing, decode=decode)
    keep = {"full": "all", "last": "last", "random_last": "random_last"}[tc.truncation]
    return GradPolicy(keep=keep, k=tc.k, checkpoint=tc.checkpointing, decode=decode)


def _scaled_cutoff(num_steps: int, mean: float, std: float) -> tuple[float, float]:
    """N(mean, std) of a 50-step chain moved to `num_steps` steps (the same fraction of the chain)."""
    scale = num_steps / CUTOFF_REFERENCE_STEPS
    return mean * scale, std * scale


def normal_cutoff_pmf(num_steps: int, mean: float = 42.0, std: float = 5.0) -> torch.Tensor:
    """The distribution of K, the number of trailing steps that keep a graph, under `truncation=normal_cutoff`.

    With μ, σ = `mean`, `std` scaled by T/50: the cut-off is b = ⌊z⌋ for z ~ N(μ, σ) conditioned on 1 ≤ z < T (the
    reference redraws until its `int(z)` lies in [1, T), the same event), and K = T − b, so

        P(K = k) = (Φ((T − k + 1 − μ)/σ) − Φ((T − k − μ)/σ)) / (Φ((T − μ)/σ) − Φ((1 − μ)/σ)),  k = 1..T−1,

    and P(K = T) = 0 (the first step never keeps a graph).

    Args:
        num_steps (`int`): the sampling steps T (at least 2).
        mean (`float`, *optional*, defaults to 42.0): μ in steps of a 50-step chain.
        std (`float`, *optional*, defaults to 5.0): σ in steps of a 50-step chain.

    Returns:
        `torch.Tensor` float64 `[T]`: entry k − 1 is P(K = k).
    """
    mu, sigma = _scaled_cutoff(num_steps, mean, std)
    edges = torch.arange(1, num_steps + 1, dtype=torch.float64)  # cut-offs b = 1..T−1 cover [b, b + 1)
    cdf = torch.special.ndtr((edges - mu) / sigma)  # Φ at 1, 2, ..., T
    per_cutoff = (cdf[1:] - cdf[:-1]) / (cdf[-1] - cdf[0])  # [T − 1]: P(b = 1), ..., P(b = T − 1)
    return torch.cat([per_cutoff.flip(0), torch.zeros(1, dtype=torch.float64)])  # K = T − b


def draw_normal_cutoff(
    num_steps: int, mean: float = 42.0, std: float = 5.0, generator: torch.Generator | None = None
) -> int:
    """One draw of K (see `normal_cutoff_pmf`): z ~ N(μ, σ) redrawn until 1 ≤ z < T, K = T − ⌊z⌋.

    Args:
        num_steps (`int`): the sampling steps T (at least 2).
        mean (`float`, *optional*, defaults to 42.0), std (`float`, *optional*, defaults to 5.0): μ, σ in steps of a
            50-step chain (`check_train` keeps μ·T/50 in [1, T), so a draw is accepted at least about a third of
            the time).
        generator (`torch.Generator`, *optional*): defaults to torch's global generator.

    Returns:
        `int`: K in 1..T−1.
    """
    mu, sigma = _scaled_cutoff(num_steps, mean, std)
    for _ in range(10_000):
        z = mu + sigma * float(torch.randn((), generator=generator, dtype=torch.float64))
        if 1 <= z < num_steps:
            return num_steps - math.floor(z)
    raise RuntimeError(f"no cut-off in [1, {num_steps}) after 10,000 draws from N({mu}, {sigma})")


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
    renoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    denoise: Callable[[torch.Tensor], torch.Tensor],
    reward_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """DRaFT-LV's reward (paper Algorithm 2): the mean over n re-noised, one-step-denoised copies of each sample.

    For i = 1..n: `x_t^i = renoise(sg(x0), ε_i)`, `x̂0^i = denoise(x_t^i)`, and the result is
    `mean_i reward_fn(x̂0^i)`. `x0` is detached here (the algorithm samples it under stop-gradient), so the gradient
    of `draft_loss(lv_reward(...))` flows only through the n model calls; in expectation over ε it is the gradient of
    E_ε[r(x̂0(x_t))] (an unbiased estimate of it).

    Args:
        x0 (`torch.Tensor` `[B, C, h, w]`): the final latents of a rollout.
        noise (`torch.Tensor` `[n, B, C, h, w]`): the n standard-normal draws ε_i (the caller's generator).
        renoise (`Callable`): `(x0, ε) -> x_t`, the forward process to the re-noising level (DDPM:
            √ᾱ x0 + √(1 − ᾱ) ε with ᾱ from `final_step_noise_level`; a flow: (1 − σ) x0 + σ ε).
        denoise (`Callable`): `x_t -> x̂0`, the model's one-step estimate with its graph to the weights (guided as
            in sampling; DDPM: `one_step_denoise` of the model output; a flow: x_t − σ·v).
        reward_fn (`Callable`): `(latents [B, C, h, w]) -> rewards [B]`, differentiable (decode + reward).

    Returns:
        `torch.Tensor` `[B]`: the averaged rewards, with the graph of all n one-step denoisings.
    """
    if noise.ndim != x0.ndim + 1 or noise.shape[1:] != x0.shape or noise.shape[0] < 1:
        raise ValueError(f"noise must have shape [n, *x0.shape] with n >= 1; got {tuple(noise.shape)} "
                         f"for x0 {tuple(x0.shape)}")
    x0 = x0.detach()
    total = None
    for eps in noise:  # the paper's inner loop; one model call each
        rewards = reward_fn(denoise(renoise(x0, eps.to(x0))))
        total = rewards if total is None else total + rewards
    return total / noise.shape[0]


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks of a whole recipe (at load time, so `diffrl validate` reports them): the `train:` group,
    the epoch split into optimizer steps, and every reward term differentiable (as its factory declares; a reward
    that declares nothing is checked once built)."""
    check_train(cfg.train, num_steps=cfg.sample.num_steps)
    if cfg.sample.num_batches_per_epoch % cfg.optim.gradient_accumulation_steps:
        raise UserError(f"sample.num_batches_per_epoch ({cfg.sample.num_batches_per_epoch}) must be a multiple of "
                        f"optim.gradient_accumulation_steps ({cfg.optim.gradient_accumulation_steps}): DRaFT trains "
                        "on every sampling batch")
    terms = [(cfg.reward.name, cfg.reward.kwargs)] if cfg.reward.name else [
        (c.name, c.kwargs) for c in cfg.reward.components]
    for name, kwargs in terms:
        if declared_differentiable(name, kwargs) is False:
            raise UserError(f"DRaFT backpropagates through the reward and '{name}' is not differentiable; use one of "
                            f"{', '.join(differentiable_rewards())} (or a trainer for any reward: raft, ddpo)")


def derived(cfg, num_processes: int) -> dict:
    """Every sampling batch is a micro-batch: `sample.batch_size` differentiable samples per process."""
    steps = cfg.sample.num_batches_per_epoch // cfg.optim.gradient_accumulation_steps
    return {"global_train_batch": cfg.sample.batch_size * cfg.optim.gradient_accumulation_steps * num_processes,
            "optimizer_steps_per_epoch": steps, "total_optimizer_steps": steps * cfg.run.num_epochs}


def epoch_passes(cfg) -> dict:
    """Per process and epoch: each sampling batch's chain is the rollout; on top, its kept steps' backward (about
    one forward + backward per kept step, with checkpointing one more forward) and, for DRaFT-LV, n guided calls
    with their backward; one AdamW step per optimizer step."""
    tc, s = cfg.train, cfg.sample
    kept = {"full": s.num_steps, "last": tc.k, "random_last": (tc.k + 1) / 2}.get(tc.truncation)
    if tc.truncation == "normal_cutoff":  # the expected K
        pmf = normal_cutoff_pmf(s.num_steps, tc.cutoff_mean, tc.cutoff_std)
        kept = float((pmf * torch.arange(1, s.num_steps + 1)).sum())
    per_batch = tc.lv_samples if tc.lv_samples else kept
    return {"train_batch": s.batch_size, "fwd_bwd": s.num_batches_per_epoch * per_batch,
            "adam": s.num_batches_per_epoch // cfg.optim.gradient_accumulation_steps}


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback: Callable | None = None) -> dict:
    """Fine-tune `cfg.model.pipeline` with DRaFT against a differentiable `cfg.reward`; write the run dir; return the
    final metrics.

    Each epoch draws `sample.num_batches_per_epoch` batches of `sample.batch_size` prompts (and seeds) per process;
    each batch is sampled with the kept steps' graph (`grad_policy`), scored, and backpropagated; an optimizer step
    follows every `optim.gradient_accumulation_steps` batches.

    Args:
        cfg (`RunConfig`): the resolved recipe (`cfg.train` is a `DRaFTConfig`).
        run_dir (`Path`): the run dir (created if needed; must be writable).
        resume (`bool`, *optional*, defaults to `False`): continue from the newest checkpoint in `run_dir`.
        accelerator (`accelerate.Accelerator`, *optional*): defaults to one built from the config.
        step_callback (`Callable`, *optional*): called once before training and after every optimizer step.

    Returns:
        `dict`: the last epoch's metrics, plus the final evaluation when `run.eval_every > 0`.
    """
    tc: DRaFTConfig = cfg.train
    check(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="draft", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=cfg.sample.batch_size,
                           backwards_per_step=cfg.optim.gradient_accumulation_steps)
    if not ctx.reward.differentiable:  # a user reward that declared nothing at load time
        check_train(tc, reward_differentiable=False)
    ctx.load_state()

    for epoch, record in ctx.epochs():
        diag, batches, train_s = RunningMean(), [], 0.0
        for b in range(cfg.sample.num_batches_per_epoch):
            # ---- 1. sample with the kept steps' graph, score differentiably, backpropagate
            start = time.perf_counter()
            ctx.unet.train()
            policy = grad_policy(tc, num_steps=cfg.sample.num_steps)  # normal_cutoff: K drawn per batch
            traj, rewards = _sample_and_score(ctx, policy)
            loss, _ = draft_loss(rewards, tc.reward_scale)
            forward_s = time.perf_counter() - start
            start = time.perf_counter()
            ctx.accumulate(loss, b, diag)  # backward; an optimizer step every optim.gradient_accumulation_steps
            diag.add({"loss": loss.detach(), "kept_steps": float(len(traj.grad_steps or []))})
            batches.append((traj, rewards.detach(), forward_s))
            train_s += time.perf_counter() - start
        ctx.unet.eval()
        # ---- 2. log, checkpoint
        means = diag.means()
        stats = {"loss": means.get("loss", float("nan")), "grad_norm": means.get("grad_norm", float("nan")),
                 "kl": None, "kept_steps": means.get("kept_steps", float("nan"))}
        ctx.end_epoch(record, _as_rollout(ctx, batches), stats, train_s=train_s)
    return ctx.finish()


def _sample_and_score(ctx, policy: GradPolicy):
    """One batch of the trainer's prompt/seed stream sampled under `policy` and its rewards `[B]` with their graph
    (DRaFT-LV: the mean reward of the re-noised one-step denoisings of the detached samples)."""
    tc, s = ctx.cfg.train, ctx.cfg.sample
    prompts, seeds = draw_batch(ctx.train_prompts, s.batch_size, 1, ctx.rng)
    negative = [s.negative_prompt] * s.batch_size if s.negative_prompt else None
    with ctx.accelerator.autocast():
        traj = ctx.sampler.sample(ctx.pipe, prompts, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                                  eta=s.eta, seeds=seeds, negative_prompt=negative, grad=policy)
        if not tc.lv_samples:
            return traj, ctx.reward(traj.images, prompts, None).scores
        family, device = model_family(ctx.pipe), ctx.accelerator.device
        cond = Conditioning.from_trajectory(traj).to(device)
        renoise, denoise = lv_maps(ctx, traj, lambda x, t: family.model_output(x, t, cond, s.guidance_scale))
        generator = torch.Generator().manual_seed(int(seeds[0]) % 2**63)  # re-noising draws, reproducible per batch
        noise = torch.randn((tc.lv_samples, *traj.latents[:, -1].shape), generator=generator)
        rewards = lv_reward(traj.latents[:, -1].to(device), noise.to(device), renoise=renoise, denoise=denoise,
                            reward_fn=lambda latents: ctx.reward(family.decode(latents), prompts, None).scores)
    return traj, rewards


def lv_maps(ctx, traj, predict: Callable):
    """DRaFT-LV's re-noising and one-step denoising at the input of the rollout's last step (the paper's t = 1):
    a DDPM-UNet re-noises to that step's ᾱ and inverts its ε/v/x0 prediction; a flow to that step's σ
    (x_t = (1 − σ) x0 + σ ε) and predicts x̂0 = x_t − σ·v. `predict(x_t, t)` is the guided model output."""
    device = ctx.accelerator.device
    t = traj.timesteps[-1].to(device)
    if ctx.sampler.flow:
        sigma = ctx.sampler.schedule(ctx.pipe, traj.num_steps, tuple(traj.latents.shape[-2:])).sigmas[-2]
        return (lambda x0, eps: (1 - sigma) * x0 + sigma * eps), (lambda x: x - sigma * predict(x, t))
    timestep, alpha_bar = final_step_noise_level(traj.timesteps, ctx.pipe.scheduler.alphas_cumprod)
    prediction_type = ctx.pipe.scheduler.config.get("prediction_type", "epsilon")
    t = torch.tensor(timestep, device=device)
    return (lambda x0, eps: add_noise(x0, eps, alpha_bar)), \
        (lambda x: one_step_denoise(x, predict(x, t), alpha_bar, prediction_type))


def _as_rollout(ctx, batches: list):
    """The epoch's samples as a `Rollout` (detached), for the shared logging: rewards, grid, timings."""
    keep = ctx.grid_images_per_process
    trajs, rewards, kept = [], [], []
    for traj, scores, _ in batches:
        if traj.images is not None and sum(len(k) for k in kept) < keep:
            kept.append(traj.images[: keep - sum(len(k) for k in kept)].detach().float().cpu())
        traj.images = None
        traj.latents = traj.latents.detach()
        trajs.append(traj)
        rewards.append(scores.double().cpu())
    rollout_s = sum(f for _, _, f in batches)
    return ctx.count(gather_rollout(trajs, rewards, {}, kept, group_size=1, accelerator=ctx.accelerator,
                                    rollout_s=rollout_s, reward_s=0.0))
