"""Steps of a policy-gradient epoch that do not depend on the algorithm: the optimizer step (with the cross-process
gradient mean, clipping and the NaN guard), evaluation, logging an epoch, and stopping a run cleanly."""

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from diffrl.pipelines import sampling_size
from diffrl.training import eval_cache
from diffrl.training.distributed import (
    all_reduce_gradients,
    deepspeed_engine,
    gather_list,
    gather_tensor,
    is_deepspeed,
    is_fsdp,
)
from diffrl.training.evaluation import EVAL_SEED, evaluate
from diffrl.training.guards import NanStepGuard, TrainingStopped
from diffrl.training.metrics import save_image_grid
from diffrl.training.state import TrainState, ema_weights, save_checkpoint


def optimizer_step(
    params, state: TrainState, *, accelerator, max_grad_norm: float, nan_guard: NanStepGuard, losses_finite: bool
) -> tuple[bool, float, bool]:
    """Average gradients over processes (unless FSDP did), clip, step AdamW + LR schedule + EMA, zero the gradients.

    A step whose loss or gradient norm is not finite is skipped (the weights stay as they were). Under fp16 the
    gradient scaler decides instead (it skips inf/NaN gradients and lowers its scale, as AMP is meant to). Under
    DeepSpeed the engine reduces, clips and steps, and skips a step whose gradient is not finite.

    Returns:
        `(stepped, grad_norm, stop)`: whether the weights changed, the pre-clip gradient norm, and whether the
        NaN guard says the run must stop.
    """
    if is_deepspeed(accelerator):
        return _deepspeed_step(params, state, accelerator=accelerator, nan_guard=nan_guard,
                               losses_finite=losses_finite)
    if not is_fsdp(accelerator):  # FSDP2 has already reduce-scattered (averaged) the gradients during backward
        all_reduce_gradients(params, accelerator)
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = float(accelerator.clip_grad_norm_(params, limit))
    if accelerator.scaler is not None:
        state.optimizer.step()
        stepped = losses_finite and not state.optimizer.step_was_skipped
        finite = losses_finite
    else:
        finite = losses_finite and math.isfinite(grad_norm)
        if finite:
            state.optimizer.step()
        stepped = finite
    state.optimizer.zero_grad(set_to_none=True)
    return stepped, grad_norm, _after_step(state, params, stepped=stepped, finite=finite, nan_guard=nan_guard)


def _deepspeed_step(params, state: TrainState, *, accelerator, nan_guard: NanStepGuard, losses_finite: bool):
    engine = deepspeed_engine(accelerator)
    engine.step()  # ZeRO's reduction, clipping to the recipe's max_grad_norm, AdamW, zeroed gradients
    stepped = bool(engine.was_step_applied())  # False when the gradient was not finite (the weights are untouched)
    norm = engine.get_global_grad_norm()
    grad_norm = float("nan") if norm is None else float(norm)
    return stepped, grad_norm, _after_step(state, params, stepped=stepped, finite=stepped and losses_finite,
                                           nan_guard=nan_guard)


def _after_step(state: TrainState, params, *, stepped: bool, finite: bool, nan_guard: NanStepGuard) -> bool:
    """LR schedule, EMA and counters after an optimizer step; returns whether the NaN guard stops the run."""
    if stepped:
        state.lr_scheduler.step()
        if state.ema is not None:
            state.ema.step(params)
        state.global_step += 1
    if not finite:
        state.nan_steps_total += 1
    return nan_guard.record(finite)


def stop_run(run_dir: Path, state: TrainState, *, pipe, accelerator, reason: str, keep: int) -> None:
    """Save the current (still good: no bad update was applied) weights as a checkpoint, then raise."""
    path = save_checkpoint(run_dir, state, pipe=pipe, accelerator=accelerator, keep=keep)
    raise TrainingStopped(f"training stopped at epoch {state.epoch + 1}: {reason}; last good checkpoint: {path}")


def run_evaluation(cfg, state: TrainState, *, pipe, sampler, reward, gold, prompts, accelerator, run_dir, epoch,
                   final: bool = False) -> dict:
    """Evaluate (with EMA weights when EMA is on) at the evaluation size (`sample.eval_height`, ...; 0 = the training
    size) and write images/eval-epoch-N.png; returns the eval metrics."""
    state.unet.eval()
    s = cfg.sample
    with ema_weights(state), sampling_size(pipe, height=s.eval_height, width=s.eval_width,
                                           num_frames=s.eval_num_frames):
        settings = {
            "prompts": prompts, "num_images": cfg.sample.eval_num_images,
            "num_steps": cfg.sample.eval_num_steps or cfg.sample.num_steps, "guidance_scale": cfg.sample.guidance_scale,
            "eta": cfg.sample.eta, "batch_size": cfg.sample.eval_batch_size or cfg.sample.batch_size,
            "negative_prompt": cfg.sample.negative_prompt,
        }
        key = base_eval_key_of_run(cfg, state, pipe, sampler, [reward, gold], settings, accelerator, epoch)
        cached = eval_cache.load(key) if key else None
        if cached is None:
            metrics, images, captions = evaluate(pipe=pipe, sampler=sampler, reward=reward, gold=gold,
                                                 accelerator=accelerator, **settings)
            if key:
                eval_cache.store(key, metrics, images, captions)
        else:
            metrics, images, captions = cached
            metrics = {**metrics, "eval_s": 0.0, "eval_cached": True}
    scores = metrics.pop("_eval_scores")
    proxy = metrics.pop("_eval_proxy_scores", None)
    if accelerator.is_main_process:  # the gold reward's per-image scores where there is one, else the reward's
        line = {"epoch": epoch, "final": final, "scores": scores}
        if proxy is not None:  # with a gold: the trained-on reward's per image as well
            line["proxy_scores"] = proxy
        with open(Path(run_dir) / "eval_scores.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
    n = min(cfg.log.grid_images, len(images)) if cfg.log.grid_images else 0
    per_process = -(-cfg.log.grid_images // accelerator.num_processes) if n else 0
    grid = _gather_grid(accelerator, images, captions, per_process)
    if accelerator.is_main_process and grid is not None and cfg.log.image_every:
        name = "eval-final.png" if final else f"eval-epoch-{epoch}.png"
        save_image_grid(Path(run_dir) / "images" / name, grid[0][: cfg.log.grid_images],
                        grid[1][: cfg.log.grid_images])
    return metrics


def base_eval_key_of_run(cfg, state: TrainState, pipe, sampler, rewards: list, settings: dict, accelerator,
                         epoch: int) -> str | None:
    """The `eval_cache` key of this evaluation when it evaluates the base model — epoch 0, no update yet, one
    process, `run.eval_cache` on, at most `eval_cache.MAX_IMAGES` grid images — else None (evaluate as always)."""
    if (not cfg.run.eval_cache or epoch != 0 or state.global_step != 0 or accelerator.num_processes != 1
            or cfg.log.grid_images > eval_cache.MAX_IMAGES):
        return None
    denoiser = state.unet
    simple = (str, int, float, bool, type(None))
    numerics = {
        "sampler": {k: v for k, v in vars(sampler).items() if isinstance(v, simple)} | {"class": type(sampler).__name__},
        "mixed_precision": cfg.model.mixed_precision, "dtype": cfg.model.dtype, "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(denoiser.device) if denoiser.device.type == "cuda" else "",
        "reward": asdict(cfg.reward), "eval_seed": EVAL_SEED,
    }
    return eval_cache.base_eval_key(pipe, denoiser, [r for r in rewards if r is not None], {**settings, **numerics})


def _gather_grid(accelerator, images: torch.Tensor, captions: list[str], per_process: int):
    """The first `per_process` images of every process, gathered in rank order (padded to equal counts)."""
    if per_process <= 0 or len(images) == 0:
        return None
    images = images[:per_process]
    captions = captions[:per_process]
    pad = per_process - len(images)
    if pad:
        images = torch.cat([images, images[-1:].expand(pad, *images.shape[1:])])
    valid = torch.tensor([True] * (per_process - pad) + [False] * pad)
    all_images = gather_tensor(accelerator, images)
    all_valid = gather_tensor(accelerator, valid)
    all_captions = gather_list(accelerator, captions + [""] * pad)
    keep = all_valid.nonzero().flatten().tolist()
    return all_images[keep], [all_captions[i] for i in keep]


def training_grid(accelerator, rollout, grid_images: int):
    """Images + "prompt | r=..." captions of the epoch's first samples (per process), gathered."""
    per_process = -(-grid_images // accelerator.num_processes)
    n = min(per_process, len(rollout.images))
    captions = [f"{p} | r={float(r):.3f}" for p, r in zip(rollout.traj.prompts[:n], rollout.rewards[:n])]
    return _gather_grid(accelerator, rollout.images[:n], captions, n)


def data_grid(accelerator, images: torch.Tensor, captions: list[str], grid_images: int):
    """An offline trainer's grid: the first images (with captions) of each process's training data, gathered."""
    per_process = -(-grid_images // accelerator.num_processes)
    n = min(per_process, len(images))
    return _gather_grid(accelerator, images[:n], captions[:n], n)


def reward_summary(rollout) -> dict:
    """reward_mean / reward_std over the epoch's finite rewards, per-component means, NaN count."""
    finite = rollout.finite
    rewards = rollout.all_rewards[finite]
    out = {
        "reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
        "reward_std": float(rewards.std()) if rewards.size else float("nan"),
        "nan_rewards": int((~finite).sum()),
    }
    for name, values in rollout.components.items():
        good = values[np.isfinite(values)]
        out[f"reward/{name}"] = float(good.mean()) if good.size else float("nan")
    return out


def write_epoch_images(cfg, run_dir: Path, curve, history: list[dict], record: dict, grid, epoch: int) -> None:
    """Main process: the sample grid (every `log.image_every` epochs) and a redraw of the reward curve including
    `record` (on the `CurvePlotter`'s thread). Called before the record's `wall_s` is taken, so an epoch's time
    includes its images."""
    if grid is not None and cfg.log.image_every and epoch % cfg.log.image_every == 0:
        save_image_grid(Path(run_dir) / "images" / f"epoch-{epoch}.png", grid[0][: cfg.log.grid_images],
                        grid[1][: cfg.log.grid_images])
    curve.request(history + [record])


class RunningMean:
    """Mean of scalar diagnostics over an epoch's backward passes (NaN-aware: counts only finite values)."""

    def __init__(self):
        self.sums, self.counts = {}, {}

    def add(self, values: dict) -> None:
        for k, v in values.items():
            v = float(v)
            if math.isfinite(v):
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}
