"""Diffusion-DPO: direct preference optimisation on a fixed dataset of preference pairs (Wallace et al. 2023).

Paper: "Diffusion Model Alignment Using Direct Preference Optimization", Wallace, Dang, Rafailov, Zhou, Lou,
Purushwalkam, Ermon, Xiong, Joty, Naik, CVPR 2024, https://arxiv.org/abs/2311.12908. Reference code:
SalesforceAIResearch/DiffusionDPO, `train.py` (`--train_method dpo`) with `launchers/sd15.sh` and `sdxl.sh`.

DPO's objective (Rafailov et al. 2023) needs log π_θ(x0|c)/π_ref(x0|c), intractable for a diffusion model. The paper
bounds it with the ELBO, moves the expectation over the reverse chain outside log σ by Jensen (eq. 12), replaces the
reverse process by the forward one q(x_{1:T}|x0) (eq. 13), and reaches eq. 14:

    L(θ) = −E_{(x0^w, x0^l) ~ D, t ~ U(0,T), x_t^w ~ q(x_t^w|x0^w), x_t^l ~ q(x_t^l|x0^l)} log σ(−βT ω(λ_t) (
              ‖ε^w − ε_θ(x_t^w, t)‖² − ‖ε^w − ε_ref(x_t^w, t)‖² − (‖ε^l − ε_θ(x_t^l, t)‖² − ‖ε^l − ε_ref(x_t^l, t)‖²)))

i.e. the preferred image must be denoised better, relative to the reference, than the rejected one. The reference
code (and this file) draws ONE t and ONE ε per pair (ε^w = ε^l), takes ω(λ_t) = 1, averages the squared errors over
latent dimensions and folds T and a factor ½ into β:

    inside = −½ β ((mse_θ^w − mse_ref^w) − (mse_θ^l − mse_ref^l)),    loss = −mean log σ(inside)

so `beta` means what `--beta_dpo` means there (5000 for SD 1.5 and SDXL). At the start the LoRA adapter is the
identity, θ = ref, `inside` = 0 and the loss is log 2 for every pair.

Code names -> paper notation:
    latents_w, latents_l   x0^w, x0^l: VAE latents of the preferred / rejected image (sampled from the posterior)
    timesteps              t ~ U{0..num_train_timesteps−1}, shared by the two images of a pair (`family.process`)
    noise                  ε ~ N(0, I), shared: x_t^w = √ᾱ_t x0^w + √(1−ᾱ_t) ε, x_t^l likewise
    model_mse_w/_l         ‖ε − ε_θ(x_t, t, c)‖² (mean over latent dims; v or x0 targets per prediction_type)
    ref_mse_w/_l           the same with the LoRA adapter off: the pre-trained model, no second UNet in memory
    beta                   β (T·ω(λ_t)·2 folded in, as `--beta_dpo`)
    implicit_acc           fraction of pairs with inside > 0: the implicit reward already ranks them right

Differences from the reference code, on purpose:
- LoRA with the adapter-off reference instead of a full fine-tune beside a frozen copy (memory: one UNet). The
  recipes keep the published β, batch (2048 pairs per step) and warm-up; their learning rate is a LoRA one, since the
  published 2.048e-5 (1e-8 × 2048 with `--scale_lr`) is a full-fine-tuning rate.
- Images are encoded once and cached (`cache_latents`): the posterior's mean and std are kept per image and flip,
  and a fresh latent is drawn from them each time, which is what re-encoding with `latent_dist.sample()` gives.
- AdamW for SDXL too (the reference switches to Adafactor there to save memory).
- Any `prediction_type` (ε, v, x0) through the scheduler's own target; the reference asserts ε.
- Any model family (`diffrl.models`): on a rectified flow (SD3, FLUX.1) t is σ·1000 from the family's forward
  process, x_t = (1 − σ) x0 + σ ε and the squared errors are those of the velocity ε − x0 (the flow-matching loss in
  place of ε's, as Flow-DPO does); the reference code covers UNets only, so β for a flow has no published value.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from diffrl.config import REQUIRED
from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.base import module_dtype
from diffrl.pairs.datasets import check_pairs_source, load_pairs
from diffrl.training.context import RunContext
from diffrl.training.loop import RunningMean
from diffrl.training.weights import adapter_disabled

__all__ = [
    "ADVANTAGE_DEFAULTS",
    "OPTIM_DEFAULTS",
    "DiffusionDPOConfig",
    "TrainConfig",
    "check",
    "derived",
    "diffusion_dpo_loss",
    "epoch_passes",
    "train",
]

# ---------------------------------------------------------------------------------------------------------------
# Config (the recipe's `train:` group). Defaults: the reference code's SD 1.5 launcher where it has one.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DiffusionDPOConfig:
    # the preference pairs: a JSONL label file (or a folder holding pairs.jsonl), a Pick-a-Pic parquet file or
    # folder, a hub dataset id (yuvalkirstain/pickapic_v2), or a ShapesWorld set shapes:NAME (`diffrl ls pairs`)
    pairs: str = REQUIRED
    batch_size: int = 1  # pairs per micro-batch, per process (the reference: 1 per GPU, 128 micro-batches per step)
    # optimizer steps per epoch: an epoch is the unit of logging, evaluation and checkpoints (run.save_every)
    # here, not a pass over the data; the pairs are drawn from shuffled passes over the set, one after the other
    steps_per_epoch: int = 500  # the reference checkpoints every 500 of its 2000 SD 1.5 steps
    beta: float = 5000.0  # β of eq. 14 with T, ω(λ_t) and ½ folded in, as the reference's --beta_dpo
    # probability, per pair, of training on the empty prompt instead of its caption (the reference's
    # --proportion_empty_prompts default), so the update reaches the unconditional branch CFG subtracts
    uncond_fraction: float = 0.2
    random_flip: bool = True  # flip a pair's two images together, at random (the reference's default hflip)
    # encode each image once (per flip) and keep the VAE posterior's mean and std: the VAE then runs once per image
    # per run. Memory: 2 × 4 × h × w floats per image and flip (512 px: 32 KiB); turn off for very large sets
    cache_latents: bool = True


TrainConfig = DiffusionDPOConfig

# The shared `optim:` group: AdamW with the reference's betas, weight decay 1e-2, clip 1.0, a constant rate after a
# linear warm-up (its `constant_with_warmup`, 500 steps for SD 1.5), 128 micro-batches per step.
OPTIM_DEFAULTS = {"learning_rate": 1e-5, "weight_decay": 1e-2, "max_grad_norm": 1.0,
                  "gradient_accumulation_steps": 128, "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 500}
ADVANTAGE_DEFAULTS = None  # no rewards, no advantages: the labels are the signal


# ---------------------------------------------------------------------------------------------------------------
# Pure loss
# ---------------------------------------------------------------------------------------------------------------


def pair_errors(model_pred: torch.Tensor, ref_pred: torch.Tensor, target: torch.Tensor, rows: str):
    """Per-row squared errors `[2B]` (means over the non-batch dims, fp32) of the model's and the reference's
    outputs against the target: the terms of Diffusion-DPO's loss and of SePPO's. `rows` names the two halves for
    the error when the row count is odd."""
    if model_pred.shape[0] % 2:
        raise ValueError(f"model_pred holds pairs ({rows}); got {model_pred.shape[0]} rows")
    dims = tuple(range(1, model_pred.ndim))
    target = target.float()
    model_mse = (model_pred.float() - target).pow(2).mean(dim=dims)
    ref_mse = (ref_pred.detach().float() - target).pow(2).mean(dim=dims)
    return model_mse, ref_mse


def diffusion_dpo_loss(
    model_pred: torch.Tensor,
    ref_pred: torch.Tensor,
    target: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict]:
    """Diffusion-DPO's loss (eq. 14, in the reference code's scaling) for a batch of pairs.

    Rows `[:B]` are the preferred images, rows `[B:]` the rejected ones, pair i being rows i and B + i (noised with
    the same t and ε).

    Args:
        model_pred (`torch.Tensor` of shape `[2B, C, h, w]`): the trained model's outputs (with their graph).
        ref_pred (`torch.Tensor` of shape `[2B, C, h, w]`): the reference model's outputs at the same inputs.
        target (`torch.Tensor` of shape `[2B, C, h, w]`): the denoising target (ε, or v / x0).
        beta (`float`): β.

    Returns:
        `(loss, stats)`: `−mean_i log σ(−½β((mse_θ^w − mse_ref^w) − (mse_θ^l − mse_ref^l)))` and detached
        float64 diagnostics: `implicit_acc` (fraction with a positive argument), `model_mse`, `ref_mse` (means over
        both images), `reward_margin` (the mean argument of log σ: β-scaled implicit reward of w minus that of l).
    """
    model_mse, ref_mse = pair_errors(model_pred, ref_pred, target, "preferred rows, then rejected rows")
    model_w, model_l = model_mse.chunk(2)
    ref_w, ref_l = ref_mse.chunk(2)
    inside = -0.5 * beta * ((model_w - ref_w) - (model_l - ref_l))  # [B]
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        stats = {"implicit_acc": (inside > 0).double().mean(), "model_mse": model_mse.double().mean(),
                 "ref_mse": ref_mse.double().mean(), "reward_margin": inside.double().mean()}
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------
# The trainer contract
# ---------------------------------------------------------------------------------------------------------------


def check(cfg) -> None:
    """Cross-field checks at load time (so `diffrl validate` reports them); the pairs source is read and checked
    here too, so a malformed label file stops the run before any run dir is made."""
    tc: DiffusionDPOConfig = cfg.train
    if tc.batch_size < 1 or tc.steps_per_epoch < 1:
        raise UserError("train.batch_size and train.steps_per_epoch must be >= 1")
    if not (math.isfinite(tc.beta) and tc.beta > 0):
        raise UserError(f"train.beta must be > 0, got {tc.beta} (the reference uses 5000 for SD 1.5 and SDXL)")
    if not 0 <= tc.uncond_fraction < 1:
        raise UserError(f"train.uncond_fraction must be in [0, 1), got {tc.uncond_fraction}")
    if cfg.model.full_finetune:
        raise UserError("Diffusion-DPO's reference model is the UNet with its LoRA adapter off; with "
                        "model.full_finetune there is no adapter to turn off: set model.full_finetune=false")
    check_pairs_source(tc.pairs)


def derived(cfg, num_processes: int) -> dict:
    """Pairs per optimizer step and epoch. A pair is Diffusion-DPO's training sample, so `samples_per_epoch` counts
    pairs (each a preferred and a rejected image), not images sampled: this trainer samples only to evaluate."""
    tc, accumulation = cfg.train, cfg.optim.gradient_accumulation_steps
    per_step = tc.batch_size * accumulation * num_processes
    return {"samples_per_epoch_per_process": tc.batch_size * accumulation * tc.steps_per_epoch,
            "samples_per_epoch": per_step * tc.steps_per_epoch,
            "total_samples": per_step * tc.steps_per_epoch * cfg.run.num_epochs,
            "global_train_batch": per_step, "optimizer_steps_per_epoch": tc.steps_per_epoch,
            "total_optimizer_steps": tc.steps_per_epoch * cfg.run.num_epochs}


def epoch_passes(cfg) -> dict:
    """Per process and epoch: a UNet forward + backward and an adapter-off forward over both images of every
    pair of each micro-batch, one AdamW step per optimizer step."""
    micro = cfg.train.steps_per_epoch * cfg.optim.gradient_accumulation_steps
    return {"train_batch": 2 * cfg.train.batch_size, "fwd_bwd": micro, "reference": micro,
            "adam": cfg.train.steps_per_epoch}


def train(cfg, run_dir, *, resume: bool = False, accelerator=None, step_callback=None) -> dict:
    """Fine-tune `cfg.model.pipeline` with Diffusion-DPO on `cfg.train.pairs`; write the run dir; return the final
    metrics. `cfg.reward` (and `reward.gold`) score the held-out evaluation only: the pairs' labels are the signal.

    Args:
        cfg (`RunConfig`): the resolved recipe (`cfg.train` is a `DiffusionDPOConfig`).
        run_dir (`Path`): the run dir.
        resume (`bool`, *optional*, defaults to `False`): continue from the newest checkpoint.
        accelerator (`accelerate.Accelerator`, *optional*): defaults to one built from the config.
        step_callback (`Callable`, *optional*): called before training and after every optimizer step.

    Returns:
        `dict`: the last epoch's metrics, plus the final evaluation when `run.eval_every > 0`.
    """
    tc: DiffusionDPOConfig = cfg.train
    check(cfg)
    pairs = load_pairs(tc.pairs)  # before the run context: a bad or unreachable dataset fails in seconds
    ctx = RunContext.start(cfg, run_dir, trainer="diffusion_dpo", resume=resume or bool(cfg.run.resume),
                           accelerator=accelerator, step_callback=step_callback, micro_batch_size=tc.batch_size,
                           backwards_per_step=cfg.optim.gradient_accumulation_steps)
    ctx.load_state()
    if ctx.accelerator.is_main_process:
        print(f"{len(pairs)} pairs from {pairs.source} (skipped: {pairs.skipped['tie']} ties, "
              f"{pairs.skipped['unlabelled']} unlabelled)", flush=True)
    data = PairBatches(ctx, pairs)

    for epoch, record in ctx.epochs():
        start = time.perf_counter()
        ctx.unet.train()
        stats = dpo_epoch(ctx, data, epoch)
        ctx.unet.eval()
        ctx.state.samples_seen += ctx.derived["samples_per_epoch"]
        stats.update(kl=None, pairs=len(pairs), ties_skipped=pairs.skipped["tie"],
                     unlabelled_skipped=pairs.skipped["unlabelled"])
        ctx.end_epoch(record, None, stats, train_s=time.perf_counter() - start, grid=data.grid(epoch))
    return ctx.finish()


def dpo_epoch(ctx, data: PairBatches, epoch: int) -> dict:
    """`steps_per_epoch × gradient_accumulation_steps` micro-batches of pairs, an optimizer step every
    `gradient_accumulation_steps`. Returns the epoch's mean diagnostics."""
    tc: DiffusionDPOConfig = ctx.cfg.train
    family, device = model_family(ctx.pipe), ctx.accelerator.device
    process, network = family.process, family.denoiser
    # the guidance a FLUX-class transformer embeds (as it samples); no CFG half is run, so other families ignore it
    scale = ctx.cfg.sample.guidance_scale
    # t, ε, flips, prompt drops and posterior draws of this epoch (seeded from the checkpointed trainer generator)
    generator = torch.Generator().manual_seed(int(ctx.rng.integers(0, 2**62)))
    diag = RunningMean()
    micro_batches = tc.steps_per_epoch * ctx.cfg.optim.gradient_accumulation_steps
    for m, indices in enumerate(data.epoch_indices(epoch, micro_batches)):
        latents_w, latents_l, conditioning = data.batch(indices, generator)  # [b, C, h, w] each
        b = len(indices)
        timesteps = process.train_timesteps(b, generator).to(device).repeat(2)
        noise = torch.randn(latents_w.shape, generator=generator).to(device).repeat(2, 1, 1, 1)  # shared ε
        x0 = torch.cat([latents_w, latents_l])
        x_t = process.add_noise(x0, noise, timesteps).to(module_dtype(network))
        with ctx.accelerator.autocast():
            model_pred = family.model_output(x_t, timesteps, conditioning, scale)
            with torch.no_grad(), adapter_disabled(network):
                ref_pred = family.model_output(x_t, timesteps, conditioning, scale)
        loss, stats = diffusion_dpo_loss(model_pred, ref_pred, process.target(x0, noise, timesteps), tc.beta)
        diag.add({"loss": loss.detach(), **stats})
        ctx.accumulate(loss, m, diag)  # backward; an optimizer step every optim.gradient_accumulation_steps
    means = diag.means()
    return {key: means.get(key, float("nan")) for key in
            ("loss", "implicit_acc", "reward_margin", "model_mse", "ref_mse", "grad_norm", "nan_losses")}


def image_stream_setup(ctx):
    """What a stream of training images needs of the run: the pipeline, the device, the sampling size (height,
    width) and the prompt encoder (unguided conditioning at that size). Diffusion-DPO's pairs and SePPO's winners."""
    pipe = ctx.pipe
    family = model_family(pipe)
    _, height, width = family.latent_shape(None, None)

    def encode(prompts):
        return family.encode(prompts, guidance_scale=1.0, height=height, width=width)[0]

    return pipe, ctx.accelerator.device, height, width, encode


class PairBatches:
    """The pairs as the UNet sees them: a shuffled stream of pair indices split over processes, images encoded by
    the pipeline's VAE (posterior mean and std cached per image and flip), captions encoded with the empty-prompt
    drop. The stream is a function of (run.seed, epoch), so a resumed run draws the same pairs."""

    def __init__(self, ctx, pairs):
        self.ctx, self.pairs, self.cfg = ctx, pairs, ctx.cfg
        self.pipe, self.device, self.height, self.width, self._encode_conditioning = image_stream_setup(ctx)
        self.empty = self._encode_conditioning([""])
        self._latents: dict = {}  # (pair, flipped) -> (mean, std) [2, C, h, w] each, preferred first
        self._last: list = []  # the last micro-batch's pairs, for the epoch grid

    def epoch_indices(self, epoch: int, micro_batches: int):
        """This process's pair indices for each micro-batch of epoch `epoch`."""
        accelerator, b = self.ctx.accelerator, self.cfg.train.batch_size
        per_step = b * accelerator.num_processes  # global pairs per micro-batch
        start, count = epoch * micro_batches * per_step, micro_batches * per_step
        stream = self._stream(start, count)
        for m in range(micro_batches):
            chunk = stream[m * per_step: (m + 1) * per_step]
            yield chunk[accelerator.process_index * b: (accelerator.process_index + 1) * b]

    def _stream(self, start: int, count: int) -> np.ndarray:
        """Global positions start..start+count of the pair stream: pass p is the set in the order drawn from
        generator (run.seed, p), the same on every process."""
        n, out = len(self.pairs), []
        for p in range(start // n, (start + count - 1) // n + 1):
            order = self.pairs.order(np.random.default_rng([self.cfg.run.seed, p]))
            lo, hi = max(start - p * n, 0), min(start + count - p * n, n)
            out.append(order[lo:hi])
        return np.concatenate(out)

    def batch(self, indices, generator: torch.Generator):
        """`(latents_w, latents_l, conditioning)` for the pairs `indices`: latents drawn from the cached posteriors
        (a pair's two images flipped together), the conditioning `[2b]` rows (the pair's caption twice, or the empty
        prompt for both images with probability `uncond_fraction`)."""
        tc = self.cfg.train
        b = len(indices)
        flips = (torch.rand(b, generator=generator) < 0.5).tolist() if tc.random_flip else [False] * b
        means, stds = zip(*(self._posterior(int(i), flip) for i, flip in zip(indices, flips)))
        mean, std = torch.stack(means).to(self.device), torch.stack(stds).to(self.device)  # [b, 2, C, h, w]
        latents = mean + std * torch.randn(mean.shape, generator=generator).to(self.device)
        self._last = list(zip([int(i) for i in indices], flips))
        prompts = [self.pairs.prompts[int(i)] for i in indices]
        drop = torch.rand(b, generator=generator) < tc.uncond_fraction
        cond = self._encode_conditioning(prompts)
        cond = _drop_prompts(cond, self.empty, drop.to(self.device))
        return latents[:, 0].float(), latents[:, 1].float(), _repeat_rows(cond)

    def _posterior(self, index: int, flip: bool):
        key = (index, flip)
        if key in self._latents:
            return self._latents[key]
        images = [_to_tensor(image, self.height, self.width, flip) for image in self.pairs.images(index)]
        with torch.no_grad():
            mean, std = encode_posterior(self.pipe, torch.stack(images).to(self.device))
        value = (mean.cpu(), std.cpu())
        if self.cfg.train.cache_latents:
            self._latents[key] = value
        return value

    def grid(self, epoch: int):
        """Images and captions of this epoch's last micro-batch of pairs (preferred, then rejected), for
        `images/epoch-N.png`; None when no grid is due."""
        log = self.cfg.log
        if not (log.image_every and log.grid_images and epoch % log.image_every == 0):
            return None
        images, captions = [], []
        for index, flip in self._last:
            for image, role in zip(self.pairs.images(index), ("preferred", "rejected")):
                images.append(_to_tensor(image, self.height, self.width, flip) / 2 + 0.5)
                captions.append(f"{self.pairs.prompts[index]} | {role}")
        return torch.stack(images), captions


def encode_posterior(pipe, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of `images` (`[N, 3, H, W]` in [-1, 1]) in the UNet's latent space: `(mean, std)`, each
    `[N, C, h, w]` fp32. The inverse of `diffrl.models.base.decode_latents`' normalisation (per-channel
    `latents_mean`/`latents_std` where the VAE config has them, else `scaling_factor` and `shift_factor`): an affine
    map, so the posterior stays Gaussian with its mean mapped and its std scaled."""
    vae = pipe.vae
    config = vae.config
    dist = vae.encode(images.to(module_dtype(vae))).latent_dist
    mean, std = dist.mean.float(), dist.std.float()
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        view = (1, -1, 1, 1)
        shift = torch.tensor(config.latents_mean, device=mean.device).view(view)
        scale = config.scaling_factor / torch.tensor(config.latents_std, device=mean.device).view(view)
    else:
        shift, scale = config.get("shift_factor") or 0.0, config.scaling_factor
    return (mean - shift) * scale, std * scale


def _to_tensor(image, height: int, width: int, flip: bool) -> torch.Tensor:
    """A PIL image as the reference prepares it: shorter side resized to the target (bilinear), centre crop,
    optional horizontal flip; `[3, H, W]` in [-1, 1]."""
    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if size != image.size:
        image = image.resize(size, Image.BILINEAR)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    image = image.crop((left, top, left + width, top + height))
    if flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    return array * 2 - 1


def _drop_prompts(cond, empty, drop: torch.Tensor):
    """`cond` with the rows where `drop` is set replaced by the empty prompt's conditioning."""
    def mix(value, empty_value):
        if value is None:
            return None
        mask = drop.reshape(-1, *([1] * (value.ndim - 1)))
        return torch.where(mask, empty_value.expand_as(value), value)

    return replace(cond, prompt_embeds=mix(cond.prompt_embeds, empty.prompt_embeds),
                   pooled_prompt_embeds=mix(cond.pooled_prompt_embeds, empty.pooled_prompt_embeds))


def _repeat_rows(cond):
    """The conditioning of b pairs as 2b UNet rows: the preferred images' b, then the rejected images' b."""
    return replace(cond, **{f.name: None if getattr(cond, f.name) is None else getattr(cond, f.name).repeat(
        2, *([1] * (getattr(cond, f.name).ndim - 1))) for f in fields(cond)})
