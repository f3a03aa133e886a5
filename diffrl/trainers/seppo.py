"""SePPO: Semi-Policy Preference Optimization for diffusion alignment (Zhang, Lan, Han et al. 2024).

Paper: "SePPO: Semi-Policy Preference Optimization for Diffusion Alignment", arXiv:2410.05255 v1 (Oct 2024; its v2
is retitled "Self-Sampling Preference Optimization", SSPO, whose abstract says it switches from DPO to SFT where a
generated sample is likely a winner; this module follows v1). The authors' repository, github.com/DwanZhang-AI/SePPO
at 101b711 (files README.md, test.py, valid_scores.py), holds evaluation scripts and a released checkpoint but no
training code, and the paper's full text was not at hand when this was written. What follows is built from the
paper's abstract and from public reviews of it that restate its equations and settings (two consolidated reviews
found in public repositories; the submission's reviews are mirrored at paperhub.cn/paper/5CHcmVzbAz): its Eq. 7/14
loss, the Eq. 8 sign, Algorithm 1's `ref ~ U(0, k−1)`, K = 7 checkpoints saved every 30 updates, batch 2048 with 256
accumulation steps on 8 GPUs. Where those sources leave a choice open the choice is a setting and says so below; no
number here was checked against the authors' code.

The idea. Only "winning" images are given (the paper: Pick-a-Pic's preferred images, the rejected ones thrown away;
no reward model, no pairs). A previous checkpoint θ_ref of the policy is the reference model AND generates, for each
winner's prompt, an on-policy "reference sample" x^ref that stands in for the losing image. The loss is Diffusion-DPO's
(Wallace et al. 2023, eq. 14) on the pair (x^w, x^ref) with θ_ref as π_ref, except that the reference sample's term
carries a sign s chosen per pair by the anchor-based adaptive flipper (AAF):

    Δ^w   = ‖ε − ε_θ(x_t^w, t)‖² − ‖ε − ε_ref(x_t^w, t)‖²         (the winner, the "anchor")
    Δ^ref = ‖ε − ε_θ(x_t^ref, t)‖² − ‖ε − ε_ref(x_t^ref, t)‖²     (the reference sample, same t and ε)
    s     = −1 if ‖ε − ε_ref(x_t^w, t)‖² < ‖ε − ε_θ(x_t^w, t)‖²  else +1          (AAF, the paper's Eq. 8)
    L     = −mean log σ(−½β (Δ^w − s·Δ^ref))

s = +1 is Diffusion-DPO with x^ref as the loser. s = −1 happens when the reference model denoises the winning anchor
better than the policy does: the reference is then the better model, its sample is likely a winner too, and the loss
pushes the policy to fit both (−½β(Δ^w + Δ^ref)). The direction of Eq. 8 (the reference sample is treated as a winner
when the REFERENCE has the lower error on the anchor) is read from the reviews' description and the paper's Theorem
1 as they state it ("lower expected error implies better predictions"), not from the equation's own text; `aaf=false`
gives s = +1 always (the paper's "w/o AAF" ablation; SPIN-Diffusion's rule). s is a decision, not differentiated.

Reference-model selection (Sec. 4.1 and Algorithm 1): checkpoints θ_0 (the pre-trained model), θ_1, ... are saved
as training goes; iteration k trains θ_k from θ_{k−1} against a reference drawn from θ_0..θ_{k−1}: `random`
(`ref ~ U(0, k−1)`, the paper's choice), `first` (always θ_0: plain iterative DPO against the pre-trained model) or
`last` (θ_{k−1}: SPIN-Diffusion's choice). Here an iteration is an epoch of `steps_per_epoch` optimizer steps (the
paper: 30 updates), and θ_k is the trainable weights at the start of epoch k.

Code names -> paper notation:
    latents_w, latents_ref  x0^w (VAE latent of the winning image), x0^ref (of the reference model's sample)
    timesteps, noise        t ~ U{0..T−1} and ε ~ N(0, I), shared by the two images of a pair (`family.process`)
    model_mse_*, ref_mse_*  ‖ε − ε_θ(x_t, t)‖², ‖ε − ε_ref(x_t, t)‖² (mean over latent dims; v / x0 / flow targets
                            per the family's `process.target`, as Diffusion-DPO here)
    sign                    s of the AAF (±1 per pair);  `aaf_rate` = fraction with s = −1 (the paper's Fig. 3)
    beta                    β with T·ω(λ_t) and ½ folded in, as Diffusion-DPO's `--beta_dpo`
    ReferencePool           the saved checkpoints θ_0 .. θ_{k−1};  max_references  K
    reference_choice        ref = [0, k−1] (`random`), 0 (`first`), k − 1 (`last`)

Where the winners come from (`train.pairs`):
- a pairs source (a label file such as `diffrl pairs sample` writes, a Pick-a-Pic parquet file or folder, a hub id,
  or `shapes:NAME`): the PREFERRED image of every decided pair is a winner, the other image is never read (the paper's
  setting);
- empty: the prompt set alone (`prompts.source`). Winners are then the ShapesWorld renders of the prompts' captions
  (the world draws an image that satisfies each caption, a fresh layout per draw): the world's own data, in place of
  human-preferred images. Prompts outside the ShapesWorld grammar are a `UserError` (give a pairs source instead).
Neither reads a reward: the recipe's reward (and `reward.gold`) only score the held-out evaluations.

Differences from the paper, on purpose (or where the paper could not be read):
- LoRA by default; the pool keeps a copy of the trainable tensors per checkpoint (K LoRA copies; with
  model.full_finetune, K copies of the whole network). θ_0 is never dropped; past K the oldest other one is.
- The reference samples are drawn with the run's sampler settings (`sample.num_steps`, `guidance_scale`, `eta`), one
  per winner per micro-batch, and VAE-encoded like the winners (a latent drawn from the posterior of the decoded
  image); the paper's sampling settings for them are unknown.
- No prompt dropout and no flips (Diffusion-DPO's code drops 20% of captions; whether SePPO's does is unknown).
- β defaults to Diffusion-DPO's 5000 (SePPO builds on that code base; its own β was not in the sources).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import module_dtype
from diffrl.pairs.datasets import check_pairs_source, load_pairs
from diffrl.prompts import load_prompts
from diffrl.shapes.verifier import parse_caption
from diffrl.shapes.world import Scene, render

# the winners' VAE latents are encoded as Diffusion-DPO encodes its images (resize, crop, posterior)
from diffrl.trainers.diffusion_dpo import _to_tensor, encode_posterior, image_stream_setup, pair_errors
from diffrl.trainers.diffusion_dpo import derived as dpo_derived
from diffrl.training.context import RunContext
from diffrl.training.loop import RunningMean
from diffrl.training.old_policy import swapped_in

__all__ = [
    "ADVANTAGE_DEFAULTS",
    "OPTIM_DEFAULTS",
    "ReferencePool",
    "SePPOConfig",
    "TrainConfig",
    "aaf_sign",
    "check",
    "choose_reference",
    "derived",
    "epoch_passes",
    "seppo_loss",
    "train",
]

REFERENCE_CHOICES = ("random", "first", "last")

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults: the paper's where the sources give them, else Diffusion-DPO's.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SePPOConfig:
    # the winning images: a pairs source whose preferred images are the winners (a label file or a folder holding
    # pairs.jsonl, a Pick-a-Pic parquet file or folder, a hub dataset id, or shapes:NAME); empty = the ShapesWorld
    # renders of prompts.source's captions (the prompt set alone)
    pairs: str = ""
    batch_size: int = 1  # winners per micro-batch, per process (each gets one reference sample)
    # optimizer steps per epoch = per SePPO iteration: a checkpoint joins the reference pool at the start of each
    # epoch (the paper saves one every 30 updates)
    steps_per_epoch: int = 30
    beta: float = 5000.0  # β with T, ω(λ_t) and ½ folded in, as Diffusion-DPO's --beta_dpo (SePPO's own: unknown)
    max_references: int = 7  # K: checkpoints kept in the pool, θ_0 included (the paper's K = 7)
    # which checkpoint is the reference of an epoch: random = uniform over the pool (the paper's ref ~ U(0, k−1)),
    # first = θ_0 (the pre-trained model), last = the newest (the weights at the epoch's start; SPIN-Diffusion's)
    reference_choice: Literal["random", "first", "last"] = "random"
    aaf: bool = True  # the anchor-based adaptive flipper; false = every reference sample is a loser (the ablation)


TrainConfig = SePPOConfig

# The shared `optim:` group: Diffusion-DPO's (SePPO's code base): AdamW, weight decay 1e-2, clip 1.0, a constant rate
# after a linear warm-up; the paper's batch of 2048 on 8 GPUs with 256 accumulation steps is one winner per micro-batch
# per GPU, as `gradient_accumulation_steps: 256` with batch_size 1 on 8 processes.
OPTIM_DEFAULTS = {"learning_rate": 1e-5, "weight_decay": 1e-2, "max_grad_norm": 1.0,
                  "gradient_accumulation_steps": 256, "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 0}
ADVANTAGE_DEFAULTS = None  # no reward, no advantages: winners and the reference's own samples are the signal


# ---------------------------------------------------------------------------------------------------------------
# Pure math
# ---------------------------------------------------------------------------------------------------------------


def aaf_sign(model_mse_w: torch.Tensor, ref_mse_w: torch.Tensor) -> torch.Tensor:
    """The anchor-based adaptive flipper: per pair, −1 where the reference model denoises the winning anchor strictly
    better than the policy (`ref_mse_w < model_mse_w`: its sample is taken as a winner too), else +1 (a loser; ties,
    e.g. θ = θ_ref, count as losers).

    Args:
        model_mse_w, ref_mse_w (`torch.Tensor` of shape `[B]`): the policy's and the reference's squared error on the
            winners (no gradient is taken through the sign).

    Returns:
        `torch.Tensor` `[B]` float, ±1.
    """
    worse = ref_mse_w.detach() < model_mse_w.detach()
    return 1.0 - 2.0 * worse.to(model_mse_w.dtype)


def seppo_loss(
    model_pred: torch.Tensor,
    ref_pred: torch.Tensor,
    target: torch.Tensor,
    beta: float,
    *,
    aaf: bool = True,
) -> tuple[torch.Tensor, dict]:
    """SePPO's loss for a batch of (winner, reference sample) pairs (see the module docstring).

    Rows `[:B]` are the winners, rows `[B:]` the reference samples, pair i being rows i and B + i (noised with the
    same t and ε). With `mse` the mean over latent dims of `(pred − target)²`, `Δ = mse_θ − mse_ref` per row and `s`
    from `aaf_sign` (all +1 when `aaf` is off):

        loss = −mean_i log σ(−½β (Δ^w_i − s_i·Δ^ref_i))

    With `aaf=False` this is `diffusion_dpo_loss` with the reference samples as the rejected images.

    Args:
        model_pred (`torch.Tensor` of shape `[2B, C, h, w]`): the policy's outputs (with their graph).
        ref_pred (`torch.Tensor` of shape `[2B, C, h, w]`): the reference checkpoint's outputs at the same inputs.
        target (`torch.Tensor` of shape `[2B, C, h, w]`): the denoising target (ε, v, x0 or a flow's velocity).
        beta (`float`): β.
        aaf (`bool`, *optional*, defaults to `True`): use the adaptive flipper.

    Returns:
        `(loss, stats)`: the scalar loss and detached float64 diagnostics: `aaf_rate` (fraction of pairs with s = −1),
        `implicit_acc` (fraction with a positive argument), `reward_margin` (the mean argument of log σ),
        `model_mse`, `ref_mse` (means over both rows of every pair), `winner_gain` (mean −Δ^w: how much better than
        the reference the policy denoises the winners).
    """
    model_mse, ref_mse = pair_errors(model_pred, ref_pred, target, "winner rows, then reference-sample rows")  # [2B]
    model_w, model_ref = model_mse.chunk(2)
    ref_w, ref_ref = ref_mse.chunk(2)
    sign = aaf_sign(model_w, ref_w) if aaf else torch.ones_like(model_w)
    inside = -0.5 * beta * ((model_w - ref_w) - sign * (model_ref - ref_ref))  # [B]
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        stats = {"aaf_rate": (sign < 0).double().mean(), "implicit_acc": (inside > 0).double().mean(),
                 "reward_margin": inside.double().mean(), "model_mse": model_mse.double().mean(),
                 "ref_mse": ref_mse.double().mean(), "winner_gain": (ref_w - model_w).double().mean()}
    return loss, stats


def choose_reference(ages: list[int], choice: str, rng: np.random.Generator) -> int:
    """The pool slot whose checkpoint is an epoch's reference.

    Args:
        ages (`list[int]`): per slot, the epoch whose starting weights it holds (0 = θ_0), or −1 for an empty slot.
        choice (`str`): `random` (uniform over the filled slots, one `rng.integers` draw), `first` (the lowest age:
            θ_0) or `last` (the highest: the newest checkpoint).
        rng (`np.random.Generator`): the draw's generator (the same on every process).

    Returns:
        `int`: the slot index.
    """
    filled = [i for i, age in enumerate(ages) if age >= 0]
    if not filled:
        raise ValueError("the reference pool is empty")
    if choice == "random":
        return filled[int(rng.integers(len(filled)))]
    if choice == "first":
        return min(filled, key=lambda i: ages[i])
    if choice == "last":
        return max(filled, key=lambda i: ages[i])
    raise ValueError(f"unknown reference choice {choice!r} (one of {', '.join(REFERENCE_CHOICES)})")


def slot_to_replace(ages: list[int]) -> int:
    """Where the next checkpoint goes: the first empty slot, else the oldest one that is not θ_0 (age 0 stays)."""
    for i, age in enumerate(ages):
        if age < 0:
            return i
    candidates = [i for i, age in enumerate(ages) if age > 0]
    if not candidates:  # K = 1: only θ_0, which stays
        return -1
    return min(candidates, key=lambda i: ages[i])


class ReferencePool(torch.nn.Module):
    """The saved checkpoints θ_0 .. θ_{k−1}: K slots, each a copy of the trainable tensors, with the epoch it was
    taken at (`ages`, −1 = empty). A module, so checkpoints save and resume it (`RunContext.load_state(extra_modules=)`).
    Slot 0 starts with the weights it is built from (θ_0)."""

    def __init__(self, params: list, max_references: int):
        super().__init__()
        self.num_params = len(params)
        for slot in range(max_references):
            for i, p in enumerate(params):
                self.register_buffer(f"s{slot}_p{i}", p.detach().clone())
        ages = torch.full((max_references,), -1, dtype=torch.long)
        ages[0] = 0
        self.register_buffer("ages", ages)

    def tensors(self, slot: int) -> list:
        return [getattr(self, f"s{slot}_p{i}") for i in range(self.num_params)]

    @torch.no_grad()
    def add(self, params: list, epoch: int) -> None:
        """Keep the current weights as the checkpoint of epoch `epoch` (replacing the oldest past θ_0 when full)."""
        slot = slot_to_replace(self.ages.tolist())
        if slot < 0:
            return
        for kept, p in zip(self.tensors(slot), params):
            kept.copy_(p.detach())
        self.ages[slot] = epoch

    @contextmanager
    def active(self, slot: int, params: list):
        """Run the network with slot `slot`'s weights in place of the trainable ones (no gradient); restore on exit.
        Under autocast, give it an autocast region of its own (see `diffrl.training.old_policy.OldPolicy.active`)."""
        with swapped_in(params, self.tensors(slot)):
            yield


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback=None) -> dict:
    """Fine-tune `cfg.model.pipeline` with SePPO on winning images (`cfg.train.pairs`, or the ShapesWorld renders of
    the prompt set); write the run dir; return the final metrics. `cfg.reward` (and `reward.gold`) score the held-out
    evaluation only. Arguments as `diffrl.trainers.diffusion_dpo.train` (`cfg.train` is a `SePPOConfig`)."""
    tc: SePPOConfig = cfg.train
    check(cfg)
    pairs = load_pairs(tc.pairs) if tc.pairs else None  # before the run context: a bad dataset fails in seconds
    ctx = RunContext.start(cfg, run_dir, trainer="seppo", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=2 * tc.batch_size,
                           backwards_per_step=cfg.optim.gradient_accumulation_steps)
    pool = ReferencePool(ctx.params, tc.max_references)  # slot 0: θ_0, the starting weights
    ctx.load_state(extra_modules={"reference_pool": pool})
    data = WinnerBatches(ctx, pairs)
    if ctx.accelerator.is_main_process:
        print(f"winners: {data.describe()}", flush=True)

    for epoch, record in ctx.epochs():
        start = time.perf_counter()
        # ---- 1. this iteration's checkpoint joins the pool; the reference is drawn from it (the same on every rank)
        if epoch > 0:
            pool.add(ctx.params, epoch)
        slot = choose_reference(pool.ages.tolist(), tc.reference_choice, np.random.default_rng([cfg.run.seed, epoch]))

        # ---- 2. winners vs the reference checkpoint's own samples, the AAF deciding which side each pair trains
        ctx.unet.train()
        stats = seppo_epoch(ctx, data, pool, slot, epoch)
        ctx.unet.eval()
        ctx.state.samples_seen += ctx.derived["samples_per_epoch"]
        stats.update(kl=None, reference_epoch=int(pool.ages[slot]), pool_size=int((pool.ages >= 0).sum()))

        # ---- 3. log, checkpoint
        ctx.end_epoch(record, None, stats, train_s=time.perf_counter() - start, grid=data.grid(epoch))
    return ctx.finish()


def seppo_epoch(ctx, data: WinnerBatches, pool: ReferencePool, slot: int, epoch: int) -> dict:
    """`steps_per_epoch × gradient_accumulation_steps` micro-batches of winners, an optimizer step every
    `gradient_accumulation_steps`. Per micro-batch: the reference checkpoint samples one image per winner's prompt and
    gives its predictions on both images; then the policy's, with gradient. Returns the epoch's mean diagnostics."""
    tc: SePPOConfig = ctx.cfg.train
    sample = ctx.cfg.sample
    family, device = model_family(ctx.pipe), ctx.accelerator.device
    process, network = family.process, family.denoiser
    scale = sample.guidance_scale  # embedded guidance of a FLUX-class transformer; other families ignore it here
    # t, ε, render layouts, posterior draws and sampling seeds of this epoch (from the checkpointed trainer generator)
    generator = torch.Generator().manual_seed(int(ctx.rng.integers(0, 2**62)))
    diag = RunningMean()
    micro_batches = tc.steps_per_epoch * ctx.cfg.optim.gradient_accumulation_steps
    for m, indices in enumerate(data.epoch_indices(epoch, micro_batches)):
        latents_w, prompts, conditioning = data.batch(indices, generator)  # [b, C, h, w], b captions
        b = len(prompts)
        seeds = torch.randint(0, 2**62, (b,), generator=generator).tolist()
        timesteps = process.train_timesteps(b, generator).to(device).repeat(2)
        noise = torch.randn(latents_w.shape, generator=generator).to(device).repeat(2, 1, 1, 1)  # shared ε
        # the reference checkpoint, swapped in: its samples, then its predictions (an autocast region of its own)
        with pool.active(slot, ctx.params), torch.no_grad():
            network.eval()  # sampled as evaluation samples (no dropout), then back to training mode
            with ctx.accelerator.autocast():
                images = ctx.sampler.sample(ctx.pipe, prompts, num_steps=sample.num_steps,
                                            guidance_scale=sample.guidance_scale, eta=sample.eta, seeds=seeds,
                                            negative_prompt=[sample.negative_prompt] * b if sample.negative_prompt
                                            else None).images  # [b, 3, H, W] in [0, 1]
            network.train()
            latents_ref = data.encode(images * 2 - 1, generator)
            x0 = torch.cat([latents_w, latents_ref])
            x_t = process.add_noise(x0, noise, timesteps).to(module_dtype(network))
            with ctx.accelerator.autocast():
                ref_pred = family.model_output(x_t, timesteps, conditioning, scale)
        with ctx.accelerator.autocast():
            model_pred = family.model_output(x_t, timesteps, conditioning, scale)
        loss, stats = seppo_loss(model_pred, ref_pred, process.target(x0, noise, timesteps), tc.beta, aaf=tc.aaf)
        data.keep_for_grid(images)
        diag.add({"loss": loss.detach(), **stats})
        ctx.accumulate(loss, m, diag)  # backward; an optimizer step every optim.gradient_accumulation_steps
    means = diag.means()
    return {key: means.get(key, float("nan")) for key in
            ("loss", "aaf_rate", "implicit_acc", "reward_margin", "winner_gain", "model_mse", "ref_mse",
             "grad_norm", "nan_losses")}


def caption_scene(caption: str) -> Scene:
    """A ShapesWorld scene that satisfies `caption` (its clauses; a count of 1, "at least one", draws one)."""
    clauses = parse_caption(caption)
    return Scene(objects=clauses.objects, relation=clauses.relation, background=clauses.background)


class WinnerBatches:
    """The winners as the network sees them: a stream of indices (pairs of a dataset, or captions of the prompt set)
    split over processes, a function of (run.seed, position) so a resumed run draws the same; images encoded by the
    pipeline's VAE (a dataset image's posterior cached), captions encoded."""

    def __init__(self, ctx, pairs):
        self.ctx, self.pairs, self.cfg = ctx, pairs, ctx.cfg
        self.pipe, self.device, self.height, self.width, self._encode_conditioning = image_stream_setup(ctx)
        self.prompts = pairs.prompts if pairs is not None else list(ctx.train_prompts)
        self._posteriors: dict = {}  # dataset pair -> (mean, std) [C, h, w] of its preferred image
        # the last micro-batch's winner indices, captions, winner images ([-1, 1]; None: read from the dataset) and
        # reference samples ([0, 1])
        self._last: tuple = ([], [], None, None)

    def describe(self) -> str:
        if self.pairs is None:
            return f"ShapesWorld renders of {len(self.prompts)} captions of {self.cfg.prompts.source}"
        return (f"the preferred images of {len(self.pairs)} pairs of {self.pairs.source} (skipped: "
                f"{self.pairs.skipped['tie']} ties, {self.pairs.skipped['unlabelled']} unlabelled)")

    def epoch_indices(self, epoch: int, micro_batches: int):
        """This process's indices for each micro-batch of epoch `epoch`: consecutive blocks of an endless sequence of
        shuffles of the winners (shuffle p from `default_rng([run.seed, p])`)."""
        accelerator, b = self.ctx.accelerator, self.cfg.train.batch_size
        per_step, n = b * accelerator.num_processes, len(self.prompts)
        start = epoch * micro_batches * per_step
        for m in range(micro_batches):
            positions = start + m * per_step + accelerator.process_index * b + np.arange(b)
            shuffles = {p: np.random.default_rng([self.cfg.run.seed, p]).permutation(n) for p in set(positions // n)}
            yield np.array([shuffles[p // n][p % n] for p in positions], dtype=np.int64)

    def batch(self, indices, generator: torch.Generator):
        """`(latents_w, prompts, conditioning)` for winners `indices`: latents drawn from the images' posteriors, and
        the conditioning of `[2b]` rows (the winners' captions, then the same for the reference samples)."""
        prompts = [self.prompts[int(i)] for i in indices]
        if self.pairs is not None:
            means, stds = zip(*(self._posterior(int(i)) for i in indices))
            mean, std = torch.stack(means).to(self.device), torch.stack(stds).to(self.device)
            latents = mean + std * torch.randn(mean.shape, generator=generator).to(self.device)
            images = None
        else:  # the world draws each caption afresh: a new layout (and colour jitter) per draw
            seeds = torch.randint(0, 2**31, (len(prompts),), generator=generator).tolist()
            images = torch.stack([self._tensor(Image.fromarray(render(caption_scene(p), seed, self.height)))
                                  for p, seed in zip(prompts, seeds)]).to(self.device)
            latents = self.encode(images, generator)
        self._last = ([int(i) for i in indices], prompts, images, None)
        cond = self._encode_conditioning(prompts)
        return latents.float(), prompts, _repeat_rows(cond)

    def encode(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A latent drawn from the VAE posterior of each image (`[N, 3, H, W]` in [-1, 1])."""
        with torch.no_grad():
            mean, std = encode_posterior(self.pipe, images.to(self.device))
        return mean + std * torch.randn(mean.shape, generator=generator).to(mean.device)

    def _tensor(self, image) -> torch.Tensor:
        return _to_tensor(image, self.height, self.width, False)

    def _posterior(self, index: int):
        if index not in self._posteriors:
            preferred = self.pairs.images(index)[0]
            with torch.no_grad():
                mean, std = encode_posterior(self.pipe, self._tensor(preferred)[None].to(self.device))
            self._posteriors[index] = (mean[0].cpu(), std[0].cpu())
        return self._posteriors[index]

    def keep_for_grid(self, reference_images: torch.Tensor) -> None:
        self._last = (*self._last[:3], reference_images.detach().float().cpu())

    def grid(self, epoch: int):
        """The last micro-batch's winners and reference samples with their captions, for `images/epoch-N.png`;
        None when no grid is due."""
        log = self.cfg.log
        if not (log.image_every and log.grid_images and epoch % log.image_every == 0):
            return None
        indices, prompts, winners, references = self._last
        if winners is None:
            winners = torch.stack([self._tensor(self.pairs.images(i)[0]) for i in indices])
        images, captions = [], []
        for i, prompt in enumerate(prompts):
            images += [winners[i].cpu() / 2 + 0.5, references[i]]
            captions += [f"{prompt} | winner", f"{prompt} | reference sample"]
        return torch.stack(images).clamp(0, 1), captions


def _repeat_rows(cond):
    """The conditioning of b winners as 2b network rows: the winners' b, then the reference samples' b."""
    return replace(cond, **{f.name: None if getattr(cond, f.name) is None else getattr(cond, f.name).repeat(
        2, *([1] * (getattr(cond, f.name).ndim - 1))) for f in fields(cond)})


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks at load time (so `diffrl validate` reports them): the settings, and the winners' source
    (a pairs source read and checked, or every training prompt a ShapesWorld caption). Raises `UserError`."""
    tc: SePPOConfig = cfg.train
    if tc.batch_size < 1 or tc.steps_per_epoch < 1:
        raise UserError("train.batch_size and train.steps_per_epoch must be >= 1")
    if not (math.isfinite(tc.beta) and tc.beta > 0):
        raise UserError(f"train.beta must be > 0, got {tc.beta} (Diffusion-DPO's published value is 5000)")
    if tc.max_references < 1:
        raise UserError(f"train.max_references must be >= 1 (the pool keeps θ_0 at least), got {tc.max_references}")
    if tc.reference_choice not in REFERENCE_CHOICES:
        raise UserError(f"train.reference_choice must be one of {', '.join(REFERENCE_CHOICES)}, "
                        f"got {tc.reference_choice!r}")
    if tc.pairs:
        check_pairs_source(tc.pairs)
        return
    for prompt in load_prompts(cfg.prompts.source):
        try:
            parse_caption(prompt)
        except UserError:
            raise UserError(f"train.pairs is empty, so the winners are ShapesWorld renders of the prompts, but "
                            f"'{prompt[:60]}' of prompts.source is not a ShapesWorld caption; give train.pairs (a "
                            "label file, Pick-a-Pic or shapes:NAME) for other prompts") from None


def derived(cfg, num_processes: int) -> dict:
    """Winners per optimizer step and epoch. A winner (with the reference sample drawn for it) is SePPO's training
    sample, so `samples_per_epoch` counts winners; as many reference images are sampled. The same counts as
    Diffusion-DPO's pairs (one micro-batch of `train.batch_size` per backward, `train.steps_per_epoch` steps)."""
    return dpo_derived(cfg, num_processes)


def epoch_passes(cfg) -> dict:
    """Per process and epoch, per micro-batch: the reference checkpoint's sampling of one image per winner
    (`sample.num_steps` guided forwards of b rows, about one `train_batch` each with CFG) and its forward over both
    images, the policy's forward + backward over both; one AdamW step per optimizer step."""
    micro = cfg.train.steps_per_epoch * cfg.optim.gradient_accumulation_steps
    return {"train_batch": 2 * cfg.train.batch_size, "fwd_bwd": micro,
            "reference": micro * (1 + cfg.sample.num_steps), "adam": cfg.train.steps_per_epoch}
