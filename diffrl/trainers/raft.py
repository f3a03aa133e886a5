"""RAFT: fine-tune on the model's own best samples with its ordinary denoising loss (Dong et al. 2023).

Paper: "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment", Dong, Xiong, Goyal et al., TMLR
2023, https://arxiv.org/abs/2304.06767. Diffusion reference code: OptimalScale/LMFlow, `experimental/RAFT-diffusion`
(SD256-RAFT.ipynb driving diffusers' train_text_to_image_lora.py).

Each round (the paper's Algorithm 1, one "stage"):
1. draw k samples per prompt from the current model;
2. score them with the reward and keep the best: the top `keep_per_prompt` of each prompt's k, or the top
   `keep_fraction` of the whole round (optionally only those with r >= `min_reward`);
3. fine-tune on the kept (prompt, x0) pairs with the model's own training loss — noise x0 to a random timestep t of
   the training schedule and regress the model's prediction onto ε (or v) — for `finetune_epochs` passes;
4. repeat with the fine-tuned model.
Any reward works (no gradients, no log-probs). Best-of-k selection tilts each prompt's distribution toward high
reward by at most log k − (k − 1)/k nats of KL per round (Beirami et al. 2024, arXiv 2401.01879), and the
fine-tuning step is supervised learning on those samples, so RAFT is stable but moves slowly; the kept set's reward
is the upper bound the model chases (log it).

Code names -> paper / diffusion notation:
    samples_per_prompt   K (the paper's k samples per prompt), `group_ids` = the prompt index of each sample
    rewards              r(x, y) of each sample
    kept                 the filtered set B of a stage
    x0                   the kept sample's clean latents (as sampled, not VAE-re-encoded)
    t                    a training timestep per kept sample, from the model family's forward process
                         (`family.process`): DDPM-UNets t ~ U{0..num_train_timesteps−1}, ᾱ_t = alphas_cumprod[t];
                         rectified flows σ from a uniform index into the scheduler's (shifted) training σ
    noise                ε ~ N(0, I);  x_t = √ᾱ_t x0 + √(1 − ᾱ_t) ε, or (1 − σ) x0 + σ ε  (`process.add_noise`)
    target               ε, or v = √ᾱ_t ε − √(1 − ᾱ_t) x0, per the scheduler's prediction_type; the velocity
                         ε − x0 for a flow  (`process.target`)
    model_pred           ε_θ(x_t, t, c) (or v_θ), conditional on the prompt — or on the empty prompt with
                         probability `uncond_fraction`
    ref_pred             the same prediction with the LoRA adapter off (the pre-trained model), for the optional
                         regulariser `reference_weight · ‖model_pred − ref_pred‖²`

Differences from the reference code, on purpose:
- LMFlow's notebook keeps each prompt's best of 10, then the best 8 of those 10 prompt winners (a global cut on top of
  the per-prompt one), re-encodes the kept PNGs with the VAE, and trains 80 steps at batch 8 per round (80 passes
  over 8 images, LoRA lr 9e-6, 10 rounds). Here selection is one of the two rules, x0 are the sampled latents
  themselves (no decode/encode round trip), and the passes per round are a setting (default 1).
- The prompt is dropped to the unconditional embedding with probability `uncond_fraction` (default 0.1, the rate SD
  was trained with), which LMFlow's script does not do: a LoRA trained on the conditional branch alone changes
  ε_c but not ε_u, and classifier-free guidance ε_u + s(ε_c − ε_u) multiplies that change by s (7.5 in SD).
- `reference_weight` (off by default, as in RAFT) adds an MSE to the pre-trained prediction on the same x_t.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import Conditioning
from diffrl.training.context import RunContext
from diffrl.training.distributed import gather_tensor
from diffrl.training.loop import RunningMean
from diffrl.training.rollout import local_slice
from diffrl.training.weights import adapter_disabled

__all__ = [
    "ADVANTAGE_DEFAULTS",
    "OPTIM_DEFAULTS",
    "RAFTConfig",
    "TrainConfig",
    "check",
    "check_train",
    "derived",
    "drop_prompts",
    "epoch_passes",
    "raft_loss",
    "select_kept",
    "train",
]

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group, algorithm-only: optimizer, schedule, clipping and accumulation are the
# top-level `optim` group's). Defaults: LMFlow's RAFT-diffusion notebook where it has one, else said why.
# ---------------------------------------------------------------------------------------------------------------

SELECTIONS = ("per_prompt", "global")
FITS = ("guided", "conditional")


@dataclass
class RAFTConfig:
    # K: samples drawn per prompt each round (in total over all processes: a prompt's K samples are ranked
    # together). 10 as in LMFlow's notebook; best-of-K moves each prompt's distribution by at most
    # log K − (K−1)/K ≈ 1.4 nats of KL per round
    samples_per_prompt: int = 10
    # per_prompt: keep each prompt's top `keep_per_prompt` (RAFT's Algorithm 1, best-of-K);
    # global: keep the top `keep_fraction` of all of a round's samples, whatever their prompt
    selection: Literal["per_prompt", "global"] = "per_prompt"
    keep_per_prompt: int = 1  # per_prompt only: samples kept per prompt (1 = the paper's argmax)
    # global only: fraction of the round's samples kept (ceil(fraction · N)); 0.1 keeps as many as per_prompt with K=10
    keep_fraction: float = 0.1
    # optional absolute acceptance threshold: a sample is kept only if also r >= min_reward (None = no threshold)
    min_reward: float | None = None
    batch_size: int = 8  # kept samples per fine-tuning micro-batch, per process (LMFlow: 8)
    # passes over the kept set per round. 1: each kept sample is fitted once per round, then fresh samples are drawn;
    # LMFlow's notebook makes 80 passes over its 8 kept images per round, fitting the model tightly to them
    finetune_epochs: int = 1
    # which prediction is regressed onto the kept samples. "guided": the one the sampler ran, ε_u + s·(ε_c − ε_u)
    # with the rollout's guidance scale and negative prompts (both branches trained, in one batched call), so the
    # guided model the next round samples from is fitted to the kept samples. "conditional": ε_c alone (RAFT's and
    # LMFlow's choice), with prompt dropping (`uncond_fraction`); CFG then multiplies the change by s
    fit: Literal["guided", "conditional"] = "guided"
    # conditional only: probability, per kept sample, to fine-tune on the unconditional (empty-prompt) embedding
    # instead of its prompt, so the update reaches ε_u as well as ε_c. 0.1: SD 1.x's training rate
    uncond_fraction: float = 0.1
    # weight of the regulariser mean ‖pred − ref_pred‖² to the adapter-off (pre-trained) prediction at the same x_t;
    # 0 = off (RAFT has none). In the units of the denoising MSE, so 1.0 weighs both alike
    reference_weight: float = 0.0


TrainConfig = RAFTConfig

# The shared `optim:` group's defaults: LMFlow's RAFT-diffusion run fine-tunes a LoRA with AdamW at lr 9e-6 (diffusers'
# train_text_to_image_lora.py: weight decay 1e-2, clip 1.0); small steps are what keeps supervised fine-tuning on
# the model's own samples from costing fidelity.
OPTIM_DEFAULTS = {"learning_rate": 9e-6, "weight_decay": 1e-2, "max_grad_norm": 1.0, "gradient_accumulation_steps": 1}
ADVANTAGE_DEFAULTS = None  # selection by rank, no advantages


def check_train(tc: RAFTConfig) -> None:
    """Refuse settings that do not make a RAFT run, with a one-line `UserError` naming the keys."""
    defaults = {f.name: f.default for f in fields(RAFTConfig)}
    if tc.selection not in SELECTIONS:
        raise UserError(f"train.selection must be one of {SELECTIONS}, got {tc.selection!r}")
    if tc.samples_per_prompt < 1 or tc.batch_size < 1 or tc.finetune_epochs < 1:
        raise UserError("train.samples_per_prompt, train.batch_size and train.finetune_epochs must be >= 1")
    if tc.selection == "per_prompt":
        if tc.keep_fraction != defaults["keep_fraction"]:
            raise UserError("train.keep_fraction applies to train.selection=global; with per_prompt set "
                            "train.keep_per_prompt")
        if not 1 <= tc.keep_per_prompt <= tc.samples_per_prompt:
            raise UserError(f"train.keep_per_prompt must be in 1..train.samples_per_prompt "
                            f"({tc.samples_per_prompt}), got {tc.keep_per_prompt}")
        if tc.keep_per_prompt == tc.samples_per_prompt and tc.min_reward is None:
            raise UserError(f"train.keep_per_prompt={tc.keep_per_prompt} keeps all {tc.samples_per_prompt} samples "
                            "of every prompt: nothing is selected; lower it or set train.min_reward")
    else:
        if tc.keep_per_prompt != defaults["keep_per_prompt"]:
            raise UserError("train.keep_per_prompt applies to train.selection=per_prompt; with global set "
                            "train.keep_fraction")
        if not 0 < tc.keep_fraction <= 1:
            raise UserError(f"train.keep_fraction must be in (0, 1], got {tc.keep_fraction}")
        if tc.keep_fraction == 1 and tc.min_reward is None:
            raise UserError("train.keep_fraction=1 keeps every sample: nothing is selected; lower it or set "
                            "train.min_reward")
    if tc.min_reward is not None and not math.isfinite(tc.min_reward):
        raise UserError(f"train.min_reward must be a finite number or null, got {tc.min_reward}")
    if tc.fit not in FITS:
        raise UserError(f"train.fit must be one of {FITS}, got {tc.fit!r}")
    if tc.fit == "guided" and tc.uncond_fraction != defaults["uncond_fraction"]:
        raise UserError("train.uncond_fraction applies to train.fit=conditional (the guided fit trains both "
                        "branches already); remove it or set train.fit=conditional")
    if not 0 <= tc.uncond_fraction < 1:
        raise UserError(f"train.uncond_fraction must be in [0, 1), got {tc.uncond_fraction}")
    if not (math.isfinite(tc.reference_weight) and tc.reference_weight >= 0):
        raise UserError(f"train.reference_weight must be >= 0, got {tc.reference_weight}")


# ---------------------------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------------------------


def select_kept(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    *,
    mode: str,
    keep_per_prompt: int = 1,
    keep_fraction: float = 0.1,
    min_reward: float | None = None,
) -> torch.Tensor:
    """Indices of the samples a RAFT round fine-tunes on.

    Ranking is by reward, highest first; ties are broken by the lower index (so the result does not depend on the
    sort's stability or on the device). Non-finite rewards (NaN, ±inf: a failed or broken score) are never kept.
    With `min_reward`, a sample is kept only if it also has `r >= min_reward` (compared in the rewards' dtype).

    - `"per_prompt"`: each group's (prompt's) top `keep_per_prompt` (fewer when the group has fewer eligible ones).
    - `"global"`: the top `ceil(keep_fraction · N)` of all N samples, N counting the non-finite ones too (they take
      up no place: the kept count only drops when fewer than that many are eligible).

    Args:
        rewards (`torch.Tensor` of shape `[N]`): one reward per sample.
        group_ids (`torch.Tensor` or `list[int]` of length N): the prompt index of each sample.
        mode (`str`): `"per_prompt"` or `"global"`.
        keep_per_prompt (`int`, *optional*, defaults to 1): per_prompt only.
        keep_fraction (`float`, *optional*, defaults to 0.1): global only, in (0, 1].
        min_reward (`float`, *optional*): acceptance threshold.

    Returns:
        `torch.Tensor` int64 `[M]` on CPU: the kept indices in increasing order (M may be 0).
    """
    values = rewards.detach().reshape(-1).cpu()
    values = values if values.is_floating_point() else values.double()
    groups = torch.as_tensor(group_ids).reshape(-1).tolist()
    if len(groups) != len(values):
        raise ValueError(f"got {len(values)} rewards but {len(groups)} group ids")
    ok = torch.isfinite(values)
    if min_reward is not None:  # in the rewards' dtype: min_reward=0.7 keeps a float32 reward of 0.7
        ok &= values >= torch.tensor(min_reward, dtype=values.dtype)
    r = values.double().tolist()
    eligible = [i for i in range(len(r)) if ok[i]]
    ranked = sorted(eligible, key=lambda i: (-r[i], i))  # best first; equal rewards: lower index first
    if mode == "per_prompt":
        if keep_per_prompt < 1:
            raise ValueError(f"keep_per_prompt must be >= 1, got {keep_per_prompt}")
        taken: dict[int, int] = {}
        kept = []
        for i in ranked:
            if taken.get(groups[i], 0) < keep_per_prompt:
                taken[groups[i]] = taken.get(groups[i], 0) + 1
                kept.append(i)
    elif mode == "global":
        if not 0 < keep_fraction <= 1:
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
        # round() first: 0.07 · 100 is 7.000000000000001 in floating point and must keep 7, not 8
        kept = ranked[: math.ceil(round(keep_fraction * len(r), 9))]
    else:
        raise ValueError(f"mode must be one of {SELECTIONS}, got {mode!r}")
    return torch.tensor(sorted(kept), dtype=torch.long)


def drop_prompts(
    prompt_embeds: torch.Tensor,
    uncond_embeds: torch.Tensor,
    *,
    fraction: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each row's prompt embedding by the unconditional one with probability `fraction` (independently).

    Args:
        prompt_embeds (`torch.Tensor` `[B, L, D]`): the kept samples' prompt embeddings.
        uncond_embeds (`torch.Tensor` `[1, L, D]` or `[B, L, D]`): the empty (or negative) prompt's embedding.
        fraction (`float`): drop probability in [0, 1].
        generator (`torch.Generator`, *optional*): for the draws (on CPU).

    Returns:
        `(embeds, dropped)`: embeddings `[B, L, D]` and the boolean mask `[B]` of dropped rows.
    """
    dropped = torch.rand(prompt_embeds.shape[0], generator=generator) < fraction
    mask = dropped.to(prompt_embeds.device).view(-1, *([1] * (prompt_embeds.ndim - 1)))
    embeds = torch.where(mask, uncond_embeds.to(prompt_embeds).expand_as(prompt_embeds), prompt_embeds)
    return embeds, dropped


def raft_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    *,
    ref_pred: torch.Tensor | None = None,
    reference_weight: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """RAFT's fine-tuning loss: the model's own denoising MSE on kept samples, plus an optional reference term.

    `loss = mean_i w_i · mse_i + reference_weight · mean_i ref_i` with `mse_i = mean_d (pred − target)²` and
    `ref_i = mean_d (pred − sg(ref_pred))²` (means over the C·h·w latent dims, as diffusers' training scripts do),
    computed in fp32. `w_i` = 1 without `weights` (plain RAFT); with them, e.g. reward weights, they enter as given
    (not renormalised). The reference prediction is a constant (detached).

    Args:
        model_pred (`torch.Tensor` `[B, C, h, w]`): the model's output at x_t (with its graph).
        target (`torch.Tensor` `[B, C, h, w]`): the family's `process.target(...)` for the same x0, ε and t.
        ref_pred (`torch.Tensor` `[B, C, h, w]`, *optional*): the pre-trained (adapter-off) output at the same x_t.
        reference_weight (`float`, *optional*, defaults to 0.0): weight of the reference term (needs `ref_pred`).
        weights (`torch.Tensor` `[B]`, *optional*): per-sample weights of the denoising term.

    Returns:
        `(loss, stats)`: the scalar loss and detached float64 diagnostics `denoise_mse` (unweighted mean of mse_i)
        and, with `ref_pred`, `reference_mse` (mean of ref_i).
    """
    if reference_weight and ref_pred is None:
        raise ValueError("reference_weight > 0 needs ref_pred (the adapter-off prediction at the same x_t)")
    dims = tuple(range(1, model_pred.ndim))
    pred = model_pred.float()
    mse = ((pred - target.float()) ** 2).mean(dim=dims)  # [B]
    denoise = mse.mean() if weights is None else (weights.to(mse) * mse).mean()
    stats = {"denoise_mse": mse.detach().double().mean()}
    loss = denoise
    if ref_pred is not None:
        ref = ((pred - ref_pred.detach().float()) ** 2).mean(dim=dims)  # [B]
        stats["reference_mse"] = ref.detach().double().mean()
        if reference_weight:
            loss = loss + reference_weight * ref.mean()
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks of a whole recipe (at load time): the `train:` group, and a prompt's K samples drawn in
    one sampling batch (they are ranked together)."""
    tc: RAFTConfig = cfg.train
    check_train(tc)
    if cfg.sample.batch_size % tc.samples_per_prompt:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be a multiple of train.samples_per_prompt "
                        f"({tc.samples_per_prompt}): a prompt's samples are drawn (and ranked) in one batch")


def kept_per_process(cfg, num_processes: int) -> int:
    """Kept samples per process and round when selection keeps as many as it may (`min_reward` can only lower it):
    per_prompt keeps `keep_per_prompt` of every prompt's K (prompts never straddle processes); global keeps
    ceil(fraction · N) of the N samples of all processes, which may fall unevenly: the busiest process's share."""
    tc = cfg.train
    local = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
    if tc.selection == "per_prompt":
        return local // tc.samples_per_prompt * tc.keep_per_prompt
    return min(local, math.ceil(tc.keep_fraction * local * num_processes))


def _micro_batches(cfg, num_processes: int) -> int:
    """Fine-tuning micro-batches per round, the same on every process (each must make the same optimizer steps):
    `finetune_epochs` passes over the largest kept share, rounded up to whole optimizer steps."""
    per_pass = -(-kept_per_process(cfg, num_processes) // cfg.train.batch_size)
    accumulation = cfg.optim.gradient_accumulation_steps
    return -(-per_pass * cfg.train.finetune_epochs // accumulation) * accumulation


def derived(cfg, num_processes: int) -> dict:
    steps = _micro_batches(cfg, num_processes) // cfg.optim.gradient_accumulation_steps
    tc, samples = cfg.train, cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * num_processes
    kept = (samples // tc.samples_per_prompt * tc.keep_per_prompt if tc.selection == "per_prompt"
            else math.ceil(tc.keep_fraction * samples))
    return {"kept_per_round": kept,  # at most (train.min_reward can lower it)
            "global_train_batch": cfg.train.batch_size * cfg.optim.gradient_accumulation_steps * num_processes,
            "optimizer_steps_per_epoch": steps, "total_optimizer_steps": steps * cfg.run.num_epochs}


def epoch_passes(cfg) -> dict:
    """Per process and round: one UNet forward + backward per fine-tuning micro-batch (plus an adapter-off forward
    with the reference regulariser), one AdamW step per optimizer step."""
    micro = _micro_batches(cfg, 1)
    return {"train_batch": cfg.train.batch_size, "fwd_bwd": micro,
            "reference": micro if cfg.train.reference_weight > 0 else 0,
            "adam": micro // cfg.optim.gradient_accumulation_steps}


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback=None) -> dict:
    """Fine-tune `cfg.model.pipeline` with RAFT against `cfg.reward` (any reward); write the run dir; return the final
    metrics. One epoch is one round: sample K per prompt, keep the best, fine-tune on them (`finetune_epochs`)."""
    tc: RAFTConfig = cfg.train
    check(cfg)
    ctx = RunContext.start(cfg, run_dir, trainer="raft", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=cfg.optim.gradient_accumulation_steps)
    if tc.fit == "conditional" and ctx.unet.config.get("addition_embed_type") is not None:
        raise UserError("train.fit=conditional fine-tunes on the text embedding alone; UNets with added "
                        "conditioning (SDXL) need train.fit=guided")
    ctx.load_state()
    device = ctx.accelerator.device
    # the unconditional (empty prompt) conditioning the prompt is dropped to (train.fit=conditional)
    uncond = model_family(ctx.pipe).encode([""], guidance_scale=1.0)[0].to(device)
    micro_batches = _micro_batches(cfg, ctx.accelerator.num_processes)

    for epoch, record in ctx.epochs():
        # ---- 1. K samples per prompt with the current model, scored (every process's rewards gathered)
        rollout = ctx.rollout(group_size=tc.samples_per_prompt)
        # ---- 2. the kept set: the best of each prompt (or of the round), the same decision on every process
        kept = select_kept(torch.as_tensor(rollout.all_rewards), torch.as_tensor(rollout.all_groups),
                           mode=tc.selection, keep_per_prompt=tc.keep_per_prompt, keep_fraction=tc.keep_fraction,
                           min_reward=tc.min_reward).numpy()
        mine = local_slice(ctx.accelerator, len(rollout.traj))
        local = kept[(kept >= mine.start) & (kept < mine.stop)] - mine.start
        traj = rollout.traj.to(device)
        # ---- 3. fine-tune on them with the model's own denoising loss
        start = time.perf_counter()
        ctx.unet.train()
        diag = _finetune(ctx, traj, local, uncond, micro_batches)
        ctx.unet.eval()
        kept_rewards = rollout.all_rewards[kept]
        stats = {"loss": diag.get("loss", float("nan")), "denoise_mse": diag.get("denoise_mse", float("nan")),
                 "reference_mse": diag.get("reference_mse", float("nan")),
                 "grad_norm": diag.get("grad_norm", float("nan")), "kl": None, "kept": len(kept),
                 "kept_reward_mean": float(np.mean(kept_rewards)) if len(kept) else float("nan"),
                 "kept_threshold": float(np.min(kept_rewards)) if len(kept) else float("nan"),
                 "kept_local_min": int(gather_tensor(ctx.accelerator, torch.tensor([len(local)])).min())}
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - start)
    return ctx.finish()


def _finetune(ctx, traj, local: np.ndarray, uncond: Conditioning, micro_batches: int) -> dict:
    """`micro_batches` micro-batches of the kept samples `local` (cycled; a process with none backpropagates a zero
    loss so every process steps alike), an optimizer step every `optim.gradient_accumulation_steps`."""
    tc, rng = ctx.cfg.train, ctx.rng
    family, device = model_family(ctx.pipe), ctx.accelerator.device
    process = family.process
    generator = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))  # t, ε and prompt drops of this round
    # the kept samples in fresh shuffles, as many passes as the micro-batches need (cycled when few were kept)
    passes = -(-micro_batches * tc.batch_size // len(local)) if len(local) else 1
    order = np.concatenate([rng.permutation(local) for _ in range(passes)])
    diag = RunningMean()
    for m in range(micro_batches):
        rows = torch.as_tensor(order[m * tc.batch_size: (m + 1) * tc.batch_size] if len(local) else [0])
        x0 = traj.latents[rows, -1].float()
        t = process.train_timesteps(len(rows), generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        x_t = process.add_noise(x0, noise, t)
        if tc.fit == "guided":  # the sampler's own guided prediction, with the rollout's conditioning
            cond, scale = Conditioning.from_trajectory(traj).select(rows), traj.guidance_scale
        else:
            cond, scale = _dropped_conditioning(traj, rows, uncond, tc.uncond_fraction, generator), 1.0
        with ctx.accelerator.autocast():
            pred = family.model_output(x_t, t, cond, scale)
            ref = None
            if tc.reference_weight > 0:
                with torch.no_grad(), adapter_disabled(family.denoiser):
                    ref = family.model_output(x_t, t, cond, scale)
        loss, stats = raft_loss(pred, process.target(x0, noise, t), ref_pred=ref,
                                reference_weight=tc.reference_weight)
        if not len(local):  # nothing kept here: a zero loss, so the collective step still matches
            loss = loss * 0.0
        else:
            diag.add({"loss": loss.detach(), **stats})
        ctx.accumulate(loss, m, diag)  # backward; an optimizer step every optim.gradient_accumulation_steps
    return diag.means()


def _dropped_conditioning(traj, rows: torch.Tensor, uncond: Conditioning, fraction: float,
                          generator: torch.Generator) -> Conditioning:
    """The kept samples' conditional text (no CFG half), each row dropped to the empty prompt's with probability
    `fraction` (`drop_prompts`); a flow family's pooled embedding is dropped with its row."""
    n = len(rows)
    embeds, dropped = drop_prompts(traj.prompt_embeds[rows].float(), uncond.prompt_embeds.expand(n, -1, -1),
                                   fraction=fraction, generator=generator)
    pooled = traj.pooled_prompt_embeds
    if pooled is not None:
        pooled = pooled[rows].float()
        pooled = torch.where(dropped.to(pooled.device).view(-1, 1), uncond.pooled_prompt_embeds.to(pooled), pooled)
    return Conditioning(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
