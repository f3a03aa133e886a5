"""The base model's held-out evaluation, kept and reused across runs.

Before its first update a run's policy is the loaded model: a LoRA starts with B = 0, so the adapter adds exactly
zero, and held-out evaluation draws fixed prompts with fixed seeds. The epoch-0 evaluation therefore depends only
on the model's weights, the evaluation's settings, the rewards, the software and the device — every run of a
recipe (and every `diffrl bench learn` row of one pipeline) recomputes the same 256 images. This module keeps that
result in `~/.cache/diffrl/evals/` (`cache_dir`) under a key over all of those, and a run whose
key matches reads it instead of sampling again.

The key hashes the values of every weight the evaluation runs (the denoiser without its adapter, the VAE, the
text encoders, each reward's modules), so a changed file, a fine-tuned folder under the same name or an adapter
that does not start at zero never hits; the settings, prompts, reward configuration, dtype, device type and the
torch, diffusers and diffrl versions are in it too. Only single-process runs read or write it (a multi-process
run's images are split over processes). Files are JSON and safetensors: nothing in the cache runs code.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import diffrl

# the images kept with a cached evaluation, for the run's grid (log.grid_images is at most this many to hit)
MAX_IMAGES = 64
COMPONENTS = ("unet", "transformer", "transformer_2", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def cache_dir() -> Path | None:
    """`$DIFFRL_EVAL_CACHE` (None when it is `off`: nothing read or written), else `$DIFFRL_CACHE/evals`, else
    `~/.cache/diffrl/evals`."""
    own = os.environ.get("DIFFRL_EVAL_CACHE", "")
    if own == "off":
        return None
    return Path(own) if own else Path(os.environ.get("DIFFRL_CACHE") or Path.home() / ".cache" / "diffrl") / "evals"


def _hash_module(h, module: torch.nn.Module, *, skip_adapter: bool) -> bool:
    """Feed every tensor of `module`'s state dict (names, dtypes, shapes, bytes) to `h`; adapter tensors are left
    out when `skip_adapter`. Returns False when an adapter's up-projection is not all zeros (its output is not the
    base model's)."""
    for name, tensor in module.state_dict().items():
        if skip_adapter and "lora_" in name:
            if "lora_B" in name and bool(tensor.detach().ne(0).any()):
                return False
            continue
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return True


def _reward_modules(obj, depth: int = 0, seen: set | None = None) -> list[torch.nn.Module]:
    """The torch modules a reward object holds (its scoring models; composite rewards' components too)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return []
    return [m for item in items for m in _reward_modules(item, depth + 1, seen)]


def base_eval_key(pipe, denoiser, rewards: list, settings: dict) -> str | None:
    """The key of this evaluation of the base model, or None when the policy is not the base model (an adapter
    whose up-projection is not zero). `settings`: everything else the evaluation depends on, JSON-serialisable."""
    h = hashlib.sha256()
    configs = {name: _config_dict(getattr(getattr(pipe, name, None), "config", None))
               for name in ("scheduler", *COMPONENTS)}
    meta = {"settings": settings, "torch": torch.__version__, "diffusers": version("diffusers"),
            "diffrl": diffrl.__version__, "device": denoiser.device.type, "pipeline": dict(pipe.config),
            "configs": configs}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name in COMPONENTS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            h.update(name.encode())
            if not _hash_module(h, module, skip_adapter=module is denoiser):
                return None
    for reward in rewards:
        for module in _reward_modules(reward):
            _hash_module(h, module, skip_adapter=False)
    return h.hexdigest()


def _config_dict(config) -> dict:
    """A diffusers FrozenDict or a transformers config as a plain dict ({} for none)."""
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def load(key: str) -> tuple[dict, torch.Tensor, list[str]] | None:
    """`(metrics, images, captions)` stored under `key`, or None (absent or unreadable: then it is recomputed)."""
    if cache_dir() is None:
        return None
    folder = cache_dir() / key
    try:
        record = json.loads((folder / "eval.json").read_text())
        images = load_file(str(folder / "images.safetensors"))["images"]
    except (OSError, ValueError, KeyError):
        return None
    return record["metrics"], images, record["captions"]


def store(key: str, metrics: dict, images: torch.Tensor, captions: list[str]) -> None:
    """Write the evaluation under `key` (a temporary folder renamed into place: a reader sees all of it or none)."""
    if cache_dir() is None:
        return
    folder = cache_dir() / key
    if folder.exists():
        return
    tmp = folder.with_name(f".{key}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({"images": images[:MAX_IMAGES].contiguous()}, str(tmp / "images.safetensors"))
    (tmp / "eval.json").write_text(json.dumps({"metrics": metrics, "captions": captions[:MAX_IMAGES]}))
    try:
        tmp.rename(folder)
    except OSError:  # another run stored it first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
