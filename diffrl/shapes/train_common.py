"""What the ShapesWorld training scripts share: seeded batches, the resumable training loop (`run_loop`), the
encoded train set the UNet, LCM and flow models draw from, and fp16 export.

`diffrl.shapes.train` (CLIP, VAE, UNet, PickScore and the command line), `diffrl.shapes.flow_train` and
`diffrl.shapes.lcm_distill` import it; it imports none of them, so the scripts form no import circle.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from diffrl.shapes.tokenizer import load_tokenizer
from diffrl.shapes.world import sample_batch


def _torch():
    """torch, imported on first use: `diffrl.bench.world` imports these helpers without training anything."""
    import torch

    return torch


def batch_seed(seed: int, step: int, stream: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + stream * 104_729) % (2**31)


def to_tensor(images: np.ndarray):
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [0, 1]."""
    torch = _torch()
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Checkpointer:
    """Atomic save/resume of a dict of state_dicts under work_dir/state.pt."""

    def __init__(self, work_dir: Path):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.work_dir / "state.pt"

    def load(self):
        if self.path.exists():
            return _torch().load(self.path, map_location="cpu", weights_only=False)
        return None

    def save(self, state: dict):
        tmp = self.path.with_suffix(".tmp")
        _torch().save(state, tmp)
        os.replace(tmp, self.path)

    def log(self, record: dict):
        with open(self.work_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def run_loop(args, name, modules, params, step_fn, export_fn, extra_state=None):
    """The shared loop: resume, step, log, checkpoint, export. `step_fn(step, gen) -> dict of floats`."""
    torch = _torch()
    ckpt = Checkpointer(args.work_dir)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start = 0
    state = ckpt.load()
    if state is not None and not args.fresh:
        for key, module in modules.items():
            module.load_state_dict(state[key])
        opt.load_state_dict(state["optimizer"])
        if extra_state is not None:
            extra_state["load"](state)
        start = state["step"]
        print(f"[{name}] resumed at step {start} from {ckpt.path}", flush=True)
    t0, last = time.time(), time.time()
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=min(200, args.steps // 10 + 1))
        gen = torch.Generator().manual_seed(batch_seed(args.seed, step, 1))
        losses = step_fn(step, gen)
        loss = losses.pop("loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if extra_state is not None:
            extra_state["after_step"]()
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            record = {"step": done, "loss": round(loss.item(), 5), **{k: round(float(v), 5) for k, v in losses.items()},
                      "lr": opt.param_groups[0]["lr"], "s_per_step": round((time.time() - last) / args.log_every, 3),
                      "elapsed_s": round(time.time() - t0, 1)}
            last = time.time()
            ckpt.log(record)
            print(f"[{name}] {json.dumps(record)}", flush=True)
        if done % args.save_every == 0 or done == args.steps:
            state = {key: module.state_dict() for key, module in modules.items()}
            state.update(optimizer=opt.state_dict(), step=done)
            if extra_state is not None:
                extra_state["save"](state)
            ckpt.save(state)
    export_fn()
    print(f"[{name}] exported to {args.out}", flush=True)


def save_fp16(model, folder: Path):
    """save_pretrained with fp16 storage (half the bytes). The config still says float32: transformers loads a
    model in its config's dtype when none is asked for, and a pipeline whose text encoder alone came up in fp16
    fails on its first call in plain diffusers (`from_pretrained(folder)` with no dtype)."""
    copy.deepcopy(model).cpu().half().save_pretrained(folder, safe_serialization=True)
    config = Path(folder) / "config.json"
    data = json.loads(config.read_text())
    for key in ("dtype", "torch_dtype"):
        if data.get(key) == "float16":
            data[key] = "float32"
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tokenize(tokenizer, captions):
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def frozen_parts(clip_dir: Path, vae_dir: Path, tokenizer_dir: Path | None = None):
    torch = _torch()
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    text_encoder = CLIPTextModel.from_pretrained(clip_dir, dtype=torch.float32).eval().requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(vae_dir, dtype=torch.float32).eval().requires_grad_(False)
    return load_tokenizer(tokenizer_dir or clip_dir), text_encoder, vae


def _render_train_chunk(job: tuple[int, int]):
    images, captions, _ = sample_batch(job[0], job[1], "train")
    return images, captions


def encoded_train_set(args, vae, tokenizer, text_encoder, encode_text=None, tag: str = "") -> dict:
    """A fixed set of `args.cache_size` train scenes, encoded once: VAE posterior mean and std per image (fp16)
    and the text-encoder hidden states of each distinct caption (`embeds`; or the dict of per-caption tensors
    `encode_text(captions)` returns, for models conditioned otherwise; `tag` then names the cache file). The UNet and the LCM student train on draws
    from it, so a step costs one UNet pass instead of render + VAE encode + text encode (about 1.5x faster).
    Built in chunks and kept in the work dir; a resumed run reloads it."""
    torch = _torch()
    device = next(vae.parameters()).device
    path = Path(args.work_dir) / f"train_set{tag}-{args.seed}-{args.cache_size}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True)
    chunk, means, stds, captions = 256, [], [], []
    jobs = [(batch_seed(args.seed, i, 4), min(chunk, args.cache_size - i * chunk))
            for i in range(math.ceil(args.cache_size / chunk))]
    # Rendering is numpy work, a pure function of the seed: worker processes render chunks in order while this
    # process encodes them, so the set is the same whatever the number of workers.
    workers = max(1, min(len(jobs), (os.cpu_count() or 1) - 1))
    with torch.no_grad(), ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, (images, caps) in enumerate(pool.map(_render_train_chunk, jobs)):
            dist = vae.encode(to_tensor(images).to(device) * 2 - 1).latent_dist
            means.append(dist.mean.half().cpu())
            stds.append(dist.std.half().cpu())
            captions += caps
            if (i + 1) % 40 == 0:
                print(f"[data] encoded {len(captions)}/{args.cache_size} train scenes", flush=True)
        distinct = sorted(set(captions))
        index = {c: k for k, c in enumerate(distinct)}
        if encode_text is None:
            def encode_text(texts):
                return {"embeds": text_encoder(tokenize(tokenizer, texts).to(device))[0]}
        chunks = [encode_text(distinct[k:k + 512]) for k in range(0, len(distinct), 512)]
        text = {key: torch.cat([c[key].cpu() for c in chunks]) for key in chunks[0]}
    data = {"mean": torch.cat(means), "std": torch.cat(stds), **text,
            "caption_index": torch.tensor([index[c] for c in captions])}
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)
    print(f"[data] {args.cache_size} scenes, {len(distinct)} distinct captions -> {path}", flush=True)
    return data


def draw_encoded(data: dict, batch_size: int, scaling_factor: float, gen):
    """A batch of (latents, caption embeddings) from `encoded_train_set`, latents sampled from each posterior."""
    torch = _torch()
    idx = torch.randint(0, len(data["mean"]), (batch_size,), generator=gen)
    mean, std = data["mean"][idx].float(), data["std"][idx].float()
    latents = (mean + std * torch.randn(mean.shape, generator=gen)) * scaling_factor
    return latents, data["embeds"][data["caption_index"][idx]]


def diffusers_version() -> str:
    import diffusers

    return diffusers.__version__
