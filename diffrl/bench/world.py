"""World: quality of the embedded ShapesWorld models (tiny-shapes, -lcm, VAE, CLIP, PickScore) by the verifier.

What it measures, each on fixed seeds so two runs of the same weights print the same numbers:

- `ground_truth` / `vae_roundtrip`: the verifier on rendered train + held-out scenes, and on the same images
  after the pipeline's VAE encodes and decodes them (a blurry VAE makes shapes unreadable; bar: ≥ 0.9);
- `tiny-shapes`: verifier score of DDIM samples (eta 0, `--steps` steps, CFG `--guidance-scale`) on every
  ShapesWorld prompt set of interest (bars: train_single ≥ 0.6, train ≥ 0.4, 0.2 ≤ heldout ≤ 0.7);
- `tiny-shapes-lcm`: the same with the LCM sampler at `--lcm-steps` steps (bar: within 0.1 of tiny-shapes);
- `tiny-shapes-flow`: the same with the flow sampler's ODE (diffusers' Euler) at `--flow-steps` steps and CFG
  `--flow-guidance-scale` (bars: train ≥ 0.5, 0.2 ≤ heldout ≤ 0.7);
- `tiny-shapes-clip`: held-out text→image top-1 retrieval in batches of 32 (bar: ≥ 0.9);
- `tiny-shapes-pickscore`: pairwise accuracy on fresh preference pairs (see `diffrl.shapes.train`).

A model that is not built is reported as such and skipped. Images per prompt set: the first `--prompts`
prompts of the set, `--images-per-prompt` seeds each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import CLIPModel

from diffrl.embedded import embedded_path, is_built
from diffrl.files import write_json
from diffrl.pipelines import load_pipeline
from diffrl.shapes.prompts import get_prompt_set
from diffrl.shapes.tokenizer import load_tokenizer
from diffrl.shapes.train import clip_retrieval, pairwise_accuracy
from diffrl.shapes.train_common import to_tensor
from diffrl.shapes.verifier import verify
from diffrl.shapes.world import sample_batch
from diffrl.training.metrics import save_image_grid
from samplers.ddim import DDIMSampler
from samplers.flow import FlowSampler
from samplers.lcm import LCMSampler

PROMPT_SETS = ("train", "train_single", "heldout", "heldout_single", "heldout_pair", "heldout_count",
               "heldout_relation", "heldout_background")
BARS = {"vae_roundtrip": (0.9, None), "train_single": (0.6, None), "train": (0.4, None), "heldout": (0.2, 0.7),
        "clip_retrieval": (0.9, None)}
FLOW_BARS = {"train": (0.5, None), "heldout": (0.2, 0.7)}  # tiny-shapes-flow's (the flow-models issue)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="DDIM steps for tiny-shapes (default 20)")
    parser.add_argument("--guidance-scale", type=float, default=7.5, help="CFG scale for tiny-shapes (default 7.5)")
    parser.add_argument("--lcm-steps", type=int, default=4, help="LCM steps (default 4)")
    parser.add_argument("--lcm-guidance-scale", type=float, default=2.5,
                        help="LCM guidance scale (default 2.5: inside the distilled range, scale - 1 in [0, 2])")
    parser.add_argument("--sd-pipeline", default="tiny-shapes", metavar="NAME_OR_DIR",
                        help="the pipeline measured as tiny-shapes, e.g. a rebuilt one before it replaces the shipped "
                        "weights (default tiny-shapes)")
    parser.add_argument("--lcm-pipeline", default="tiny-shapes-lcm", metavar="NAME_OR_DIR",
                        help="the pipeline measured as tiny-shapes-lcm (default tiny-shapes-lcm)")
    parser.add_argument("--flow-steps", type=int, default=20, help="flow ODE steps for tiny-shapes-flow (default 20)")
    parser.add_argument("--flow-guidance-scale", type=float, default=4.5,
                        help="CFG scale for tiny-shapes-flow (default 4.5)")
    parser.add_argument("--flow-pipeline", default="tiny-shapes-flow", metavar="NAME_OR_DIR",
                        help="the pipeline measured as tiny-shapes-flow (default tiny-shapes-flow)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts taken from each set (default 64)")
    parser.add_argument("--images-per-prompt", type=int, default=2, help="seeds per prompt (default 2)")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS), help="comma-separated ShapesWorld prompt sets")
    parser.add_argument("--batch-size", type=int, default=64, help="images per sampler call (default 64)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: vae,sd,lcm,flow,clip,pickscore")
    parser.add_argument("--grid", metavar="DIR", help="also write sample grids (prompt and verifier score under each "
                        "image) of each pipeline to DIR/<pipeline>.png: 8 train and 8 held-out prompts, seed 0")
    parser.add_argument("--out", help="also write the result as JSON to this file")


def run_world_bench(args) -> int:
    result = world_bench(args)
    print(json.dumps(result, indent=2))
    print("\n" + format_result(result))
    if args.out:
        write_json(args.out, result)
    return 0


def _deterministic(sampler) -> dict:
    """Sampling options for the sampler's deterministic mode: DDIM at eta 0, the flow ODE (a = 0); the LCM
    sampler's noise is fixed by its schedule (seeded, so still reproducible)."""
    return {} if sampler.consistency else {"eta": 0.0}


def verifier_scores(pipe, sampler, prompts: list[str], *, steps: int, guidance_scale: float, seeds_per_prompt: int,
                    batch_size: int) -> list[float]:
    """Verifier score of each sample (prompt i, seed k → seed i·n + k); DDIM at eta 0."""
    jobs = [(p, i * seeds_per_prompt + k) for i, p in enumerate(prompts) for k in range(seeds_per_prompt)]
    scores = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        with torch.no_grad():
            traj = sampler.sample(pipe, [p for p, _ in batch], num_steps=steps, guidance_scale=guidance_scale,
                                  seeds=[s for _, s in batch], **_deterministic(sampler))
        scores += verify(traj.images.float().clamp(0, 1), [p for p, _ in batch])[0].tolist()
    return scores


def write_grid(pipe, sampler, path: str, *, steps: int, guidance_scale: float) -> None:
    """A 4-column grid of 8 train and 8 held-out prompts (seed 0, eta 0), each captioned with its verifier score."""
    prompts = get_prompt_set("train")[:8] + get_prompt_set("heldout")[:8]
    with torch.no_grad():
        images = sampler.sample(pipe, prompts, num_steps=steps, guidance_scale=guidance_scale, seeds=[0] * len(prompts),
                                **_deterministic(sampler)).images.float().clamp(0, 1)
    scores = verify(images, prompts)[0].tolist()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    captions = [f"{'[held-out] ' * (i >= 8)}{p} | verifier {s:.2f}" for i, (p, s) in enumerate(zip(prompts, scores))]
    save_image_grid(Path(path), images, captions, columns=4)


def _mean(values) -> float:
    return round(sum(values) / len(values), 4)


def world_bench(args) -> dict:
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}

    if "vae" not in skip and is_built("tiny-shapes"):
        t0 = time.time()
        pipe = load_pipeline("tiny-shapes", device="cpu")
        a, ca, _ = sample_batch(4242, 256, "train")
        b, cb, _ = sample_batch(4243, 256, "heldout")
        x, captions = to_tensor(np.concatenate([a, b])), ca + cb
        with torch.no_grad():
            recon = (pipe.vae.decode(pipe.vae.encode(x * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
        result["ground_truth"] = round(verify(x, captions)[0].mean().item(), 4)
        result["vae_roundtrip"] = round(verify(recon, captions)[0].mean().item(), 4)
        result["vae_wall_s"] = round(time.time() - t0, 1)

    for name, source, part, sampler, steps, scale in (
        ("tiny-shapes", args.sd_pipeline, "sd", DDIMSampler(), args.steps, args.guidance_scale),
        ("tiny-shapes-lcm", args.lcm_pipeline, "lcm", LCMSampler(), args.lcm_steps, args.lcm_guidance_scale),
        ("tiny-shapes-flow", args.flow_pipeline, "flow", FlowSampler(), args.flow_steps, args.flow_guidance_scale),
    ):
        if part in skip:
            continue
        if source == name and not is_built(name):
            result[name] = "not built"
            continue
        pipe = load_pipeline(source, device="cpu")
        scores, t0 = {}, time.time()
        for prompt_set in sets:
            prompts = get_prompt_set(prompt_set)[: args.prompts]
            scores[prompt_set] = _mean(verifier_scores(pipe, sampler, prompts, steps=steps, guidance_scale=scale,
                                                       seeds_per_prompt=args.images_per_prompt,
                                                       batch_size=args.batch_size))
        result[name] = {"pipeline": source, "steps": steps, "guidance_scale": scale, "scores": scores,
                        "wall_s": round(time.time() - t0, 1)}
        if args.grid:
            write_grid(pipe, sampler, f"{args.grid}/{name}.png", steps=steps, guidance_scale=scale)

    if "clip" not in skip:
        result["clip_retrieval"] = _clip_retrieval() if is_built("tiny-shapes-clip") else "not built"
    if "pickscore" not in skip:
        result["pickscore_pair_accuracy"] = _pickscore_accuracy() if is_built("tiny-shapes-pickscore") else "not built"
    return result


def _clip_retrieval() -> float:
    path = embedded_path("tiny-shapes-clip")
    model = CLIPModel.from_pretrained(path, dtype=torch.float32)
    return round(clip_retrieval(model, load_tokenizer(path), split="heldout", batches=16, seed=5151), 4)


def _pickscore_accuracy() -> dict:
    path = embedded_path("tiny-shapes-pickscore")
    model, tokenizer = CLIPModel.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)
    out = {"heldout_pairs": round(pairwise_accuracy(model, tokenizer, seed=31_000), 4),
           "heldout_pairs_heldout_captions": round(pairwise_accuracy(model, tokenizer, seed=32_000,
                                                                     heldout_share=1.0), 4)}
    base_path = embedded_path("tiny-shapes-clip")
    base = CLIPModel.from_pretrained(base_path, dtype=torch.float32)
    out["tiny-shapes-clip_as_preference_model"] = round(pairwise_accuracy(base, tokenizer, seed=31_000), 4)
    return out


def _bar(key: str, value, bars: dict = BARS) -> str:
    if key not in bars or not isinstance(value, float):
        return ""
    lo, hi = bars[key]
    ok = value >= lo and (hi is None or value <= hi)
    want = f"≥ {lo}" if hi is None else f"{lo}–{hi}"
    return f"  (bar {want}: {'ok' if ok else 'MISSED'})"


def format_result(result: dict) -> str:
    lines = []
    for key in ("ground_truth", "vae_roundtrip", "clip_retrieval"):
        if key in result:
            lines.append(f"{key:<28} {result[key]}{_bar(key, result[key])}")
    for name in ("tiny-shapes", "tiny-shapes-lcm", "tiny-shapes-flow"):
        part = result.get(name)
        if isinstance(part, dict):
            lines.append(f"{name} ({part['steps']} steps, guidance {part['guidance_scale']}, {part['wall_s']} s):")
            for prompt_set, score in part["scores"].items():
                bars = {"tiny-shapes": BARS, "tiny-shapes-flow": FLOW_BARS}.get(name, {})
                bar = _bar(prompt_set, score, bars)
                lines.append(f"  {prompt_set:<26} {score:.3f}{bar}")
        elif part is not None:
            lines.append(f"{name}: {part}")
    sd, lcm = result.get("tiny-shapes"), result.get("tiny-shapes-lcm")
    if isinstance(sd, dict) and isinstance(lcm, dict):
        gaps = {k: round(lcm["scores"][k] - sd["scores"][k], 3) for k in sd["scores"] if k in lcm["scores"]}
        worst = max(abs(v) for v in gaps.values())
        lines.append(f"lcm - sd per set: {gaps} (bar |gap| ≤ 0.1: {'ok' if worst <= 0.1 else 'MISSED'})")
    if "pickscore_pair_accuracy" in result:
        lines.append(f"pickscore pairwise accuracy   {result['pickscore_pair_accuracy']}")
    return "\n".join(lines)
