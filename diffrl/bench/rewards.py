"""Rewards: images/s of each reward, scoring only and with a backward pass to the pixels, on random-weight models.

`--config tiny` (default) builds each reward's tiny random model in the published file layout in a temporary
folder and loads it through `get_reward`, exactly as a user's checkpoint would load. `--config real` builds the
published architectures (CLIP ViT-L/14, CLIP ViT-H/14 for PickScore, open_clip ViT-H-14 for HPS, BLIP ViT-L +
BERT for ImageReward) with random weights in memory, no download, and times the same reward objects; on a CPU
keep `--batch-size` small.

For every reward: one warm-up call, then `--repeats` timed calls on a batch of `--image-size` square images;
the reported time is the median. `grad` rows time forward + backward to the pixels (what DRaFT, guidance and
ReNO pay) for differentiable rewards. Images/s = batch size / median seconds per call. On a CPU shared with
other jobs, `--threads 1` avoids OpenMP threads waiting on each other (a tenfold slowdown for tiny models).
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffrl.checks import positive, resolve_dtype
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.training.rollout import sync_device
from rewards import get_reward, random_weights
from rewards.aesthetic import AestheticReward, mlp_head
from rewards.base import resolve_device
from rewards.clip_score import CLIPSimilarityReward
from rewards.hps import HPSReward
from rewards.imagereward import ImageRewardReward, build_imagereward_modules
from rewards.loading import freeze

ALL_REWARDS = ("jpeg_compressibility", "aesthetic", "clip_score", "pickscore", "hpsv2", "imagereward")
KNOWN_REWARDS = (*ALL_REWARDS, "hpsv21")  # hpsv21 has hpsv2's architecture: timed on request only
PROMPT = "a photo of a red cube on a wooden table"


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--rewards", default=",".join(ALL_REWARDS), help="comma-separated rewards (default: all built-in models)")
    add("--config", default="tiny", choices=("tiny", "real"), help="tiny random models, or published sizes (random)")
    add("--batch-size", type=positive, default=None, help="images per call (default: 8 tiny, 2 real)")
    add("--image-size", type=int, default=512, help="side of the square input images (default: 512)")
    add("--repeats", type=positive, default=3, help="timed calls per measurement (default: 3)")
    add("--no-grad-rows", action="store_true", help="skip the forward+backward measurements")
    add("--device", default=None, help="torch device (default: cuda if available)")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's; use 1 on a busy shared CPU)")
    add("--dtype", default=None, help="model dtype for the model rewards (default: float32)")
    add("--out", default=None, help="write the results as JSON here")


def _tiny_reward(name: str, folder: Path, device, dtype):
    if name == "jpeg_compressibility":
        return get_reward(name)
    if name in ("aesthetic", "clip_score", "pickscore"):
        clip = folder / "clip"
        if not clip.exists():
            random_weights.save_hf_clip(clip, "tiny")
        if name == "aesthetic":
            head = random_weights.save_aesthetic_head(folder / "head.pth")
            return get_reward(name, head=str(head), backbone=str(clip), device=device, dtype=dtype)
        return get_reward(name, model=str(clip), device=device, dtype=dtype)
    if name in ("hpsv2", "hpsv21"):
        return get_reward(name, device=device, dtype=dtype, **random_weights.save_hps(folder / name, "tiny"))
    if name == "imagereward":
        options = random_weights.save_imagereward(folder / "imagereward", "tiny")
        return get_reward(name, device=device, dtype=dtype, **options)
    raise ValueError(f"no tiny config for reward {name!r}")


def _real_reward(name: str, device, dtype):
    """The published architecture with random weights, wrapped in the same reward class the factory returns."""
    if name == "jpeg_compressibility":
        return get_reward(name)
    if name in ("aesthetic", "clip_score", "pickscore"):
        config = "vit-h-14" if name == "pickscore" else "vit-l-14"
        model, processor = random_weights.random_hf_clip(config, perturb=False)
        model = freeze(model.to(device, dtype))
        if name == "aesthetic":
            head = freeze(mlp_head(768)).to(device)
            return AestheticReward(model, processor.image_processor, head)
        return CLIPSimilarityReward(name, model, processor, scale="logit" if name == "pickscore" else "100")
    if name in ("hpsv2", "hpsv21"):
        import open_clip  # heavy, and only the HPS rows use it (rewards/hps.py defers it the same way)

        model, _ = random_weights.random_open_clip("ViT-H-14", perturb=False)
        return HPSReward(name, freeze(model.to(device, dtype)), open_clip.get_tokenizer("ViT-H-14"))
    if name == "imagereward":
        state, med_config = random_weights.random_imagereward_state("v1.0", perturb=False)
        vision, text, mlp = build_imagereward_modules(state, med_config, vision_heads=16)
        del state
        tokenizer = random_weights.bert_tokenizer()  # BERT's own vocabulary is a download; ids stay < 30524
        return ImageRewardReward(vision.to(device, dtype), text.to(device, dtype), mlp.to(device), tokenizer)
    raise ValueError(f"no real-size config for reward {name!r}")


def _scoring_call(reward, images, prompts, mode: str):
    """A no-argument call: score under no_grad (`"score"`) or score and backpropagate to the pixels (`"grad"`)."""
    def score():
        with torch.no_grad():
            reward(images, prompts)

    def score_and_backward():
        pixels = images.clone().requires_grad_(True)
        reward(pixels, prompts).scores.sum().backward()

    return score if mode == "score" else score_and_backward


def _median_seconds(call, repeats: int, device) -> float:
    call()  # warm-up: lazy inits, allocator, tokenizer caches
    sync_device(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rewards_bench(args, log=print) -> dict:
    """Measure every requested reward; returns `{"rows": [...], "device", "config", "batch_size", ...}`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype)
    batch = args.batch_size or (8 if args.config == "tiny" else 2)
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_REWARDS]
    if unknown or not names:
        what = f"unknown reward {unknown[0]!r}" if unknown else "no reward"
        raise UserError(f"diffrl bench rewards: {what} in --rewards; choose from {', '.join(KNOWN_REWARDS)}")
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, args.image_size, args.image_size, generator=generator).to(device)
    prompts = [PROMPT] * batch
    rows = []
    with tempfile.TemporaryDirectory(prefix="diffrl-bench-rewards-") as folder:
        for name in names:
            start = time.perf_counter()
            if args.config == "tiny":
                reward = _tiny_reward(name, Path(folder), device, dtype)
            else:
                reward = _real_reward(name, device, dtype)
            build_s = time.perf_counter() - start
            modes = ["score"] + (["grad"] if reward.differentiable and not args.no_grad_rows else [])
            for mode in modes:
                seconds = _median_seconds(_scoring_call(reward, images, prompts, mode), args.repeats, device)
                row = {
                    "reward": name,
                    "mode": mode,
                    "images_per_s": batch / seconds,
                    "s_per_call": seconds,
                    "build_s": build_s,
                }
                rows.append(row)
                log(f"{name:22s} {mode:5s} {row['images_per_s']:9.2f} images/s ({seconds:.3f} s per batch of {batch})")
            del reward
            gc.collect()
    return {
        "config": args.config,
        "device": str(device),
        "dtype": str(dtype),
        "batch_size": batch,
        "image_size": args.image_size,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }


def run_rewards_bench(args) -> int:
    """`diffrl bench rewards`: print images/s per reward (and per mode); write JSON with `--out`. Exit code 0."""
    start = time.perf_counter()
    result = rewards_bench(args, log=lambda line: print(line, file=sys.stderr))
    print(f"{'reward':22s} {'mode':5s} {'images/s':>9s}  s/batch")
    for row in result["rows"]:
        print(f"{row['reward']:22s} {row['mode']:5s} {row['images_per_s']:9.2f}  {row['s_per_call']:.3f}")
    print(
        f"config {result['config']}, batch {result['batch_size']} of {result['image_size']}px images, "
        f"{result['device']} ({result['torch_threads']} threads), {time.perf_counter() - start:.1f} s in total"
    )
    if args.out:
        write_json(args.out, result)
    return 0
