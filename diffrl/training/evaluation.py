"""Held-out evaluation: fixed prompts and fixed seeds, scored by the training reward and an optional gold reward.

Image i (of `num_images`, global) uses prompt `eval_prompts[i % len(eval_prompts)]` and seed `EVAL_SEED + i`, and
process r draws the images i with i % processes == r; so the same images are scored at every evaluation and for
any number of processes, and the curves over a run compare like with like. Evaluation uses its own per-sample
generators and never touches the trainer's generator, so it does not change the training trajectory either.
If the training reward rises while the gold reward stalls or falls, the policy is exploiting the training reward.
"""

import time

import numpy as np
import torch

from diffrl.training.distributed import gather_list, gather_tensor
from diffrl.training.rollout import score_images

EVAL_SEED = 1_000_003


def evaluate(
    *,
    pipe,
    sampler,
    reward,
    gold,
    prompts: list[str],
    num_images: int,
    num_steps: int,
    guidance_scale: float,
    eta: float,
    batch_size: int,
    negative_prompt: str,
    accelerator,
) -> tuple[dict, torch.Tensor, list[str]]:
    """Sample and score the evaluation set. Returns `(metrics, images, captions)`; images are this process's.

    Metrics: eval_reward_mean/std and, with a gold reward, eval_gold_mean/std; NaN scores are left out.
    """
    start = time.perf_counter()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, num_images, world))
    # every process runs the same number of batches (padded with a repeat) so the gathers below line up
    per_process = -(-num_images // world)
    padded = mine + [mine[-1] if mine else 0] * (per_process - len(mine))
    scores, golds, images, local_prompts = [], [], [], []
    for start_i in range(0, len(padded), batch_size):
        idx = padded[start_i: start_i + batch_size]
        batch_prompts = [prompts[i % len(prompts)] for i in idx]
        negative = [negative_prompt] * len(idx) if negative_prompt else None
        with torch.no_grad(), accelerator.autocast():
            traj = sampler.sample(pipe, batch_prompts, num_steps=num_steps, guidance_scale=guidance_scale, eta=eta,
                                  seeds=[EVAL_SEED + i for i in idx], negative_prompt=negative)
        s, _ = score_images(reward, traj.images, batch_prompts)
        scores.append(s)
        if gold is not None:
            golds.append(score_images(gold, traj.images, batch_prompts)[0])
        images.append(traj.images.detach().float().cpu())
        local_prompts += batch_prompts
    valid = torch.tensor([j < len(mine) for j in range(len(padded))], dtype=torch.bool)
    all_valid, all_scores = gather_tensor(accelerator, valid), gather_tensor(accelerator, torch.cat(scores))
    metrics = _summary("eval_reward", all_scores, all_valid)
    if gold is not None:
        # the trained-on (proxy) reward's per image too, so its gain gets a paired standard error as the gold's does
        metrics["_eval_proxy_scores"] = image_order(all_scores, num_images, world)
        all_scores = gather_tensor(accelerator, torch.cat(golds))
        metrics.update(_summary("eval_gold", all_scores, all_valid))
    metrics["eval_s"] = time.perf_counter() - start
    # the gold's (else the reward's) per image, in global image order, for paired before/after comparisons
    # (`eval_scores.jsonl`, `paired_gain`)
    metrics["_eval_scores"] = image_order(all_scores, num_images, world)
    local_scores = torch.cat(scores)
    captions = [f"{p} | r={float(s):.3f}" for p, s in zip(local_prompts, local_scores)]
    keep = valid.nonzero().flatten()
    return metrics, torch.cat(images)[keep], [captions[i] for i in keep.tolist()]


def image_order(gathered: torch.Tensor, num_images: int, world: int) -> list[float]:
    """Per-image values gathered in rank order (each process's padded list of its images i ≡ rank mod world) back in
    global image order 0 .. num_images − 1; the padding is dropped."""
    per_process = len(gathered) // world
    return [float(gathered[(i % world) * per_process + i // world]) for i in range(num_images)]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean gain and its standard error from per-image scores of the same images (same prompt and seed) before and
    after: the paired difference d_i = after_i − before_i, se = sd(d)/√n with the sample sd. The same seeds make the
    two evaluations' errors correlated, so this se is the test of "did these images get better", smaller than
    √(se_before² + se_after²), which treats them as independent. NaN scores drop their pair."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if len(before) != len(after):
        raise ValueError(f"paired scores need the same images: {len(before)} before, {len(after)} after")
    d = d[np.isfinite(d)]
    if d.size < 2:
        return float(d.mean()) if d.size else float("nan"), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))


def _summary(prefix: str, values: torch.Tensor, valid: torch.Tensor) -> dict:
    values = values[valid].numpy()
    finite = values[np.isfinite(values)]
    return {
        f"{prefix}_mean": float(finite.mean()) if finite.size else float("nan"),
        f"{prefix}_std": float(finite.std()) if finite.size else float("nan"),
        f"{prefix}_nan": int(values.size - finite.size),
        f"{prefix}_n": int(finite.size),  # images scored: the mean's standard error is std / √n
    }


def gather_captions(accelerator, captions: list[str]) -> list[str]:
    return gather_list(accelerator, captions)
