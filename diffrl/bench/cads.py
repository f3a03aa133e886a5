"""CADS's diversity and alignment on the embedded ShapesWorld model: `python -m diffrl.bench.cads [--threads 1]`.

For each guidance scale and each setting (plain DDIM sampling, and with `samplers.cads.CADSHook`), `-n` images of each
prompt from seeds 0..n−1 (the same start noise for both settings). Diversity = per prompt, the mean over image pairs
of the cosine distance 1 − cos between the tiny CLIP's image embeddings (`tiny-shapes-clip`), averaged over
prompts; alignment = the mean `shapes_verifier` score. Prints one JSON line per row, then per guidance scale the
CADS − plain differences with the standard error of the paired (same prompt and seed) per-image differences.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from diffrl.pipelines import load_pipeline
from rewards.clip_common import (
    hf_clip_image_embeds,
    hf_pixel_values,
    image_spec_from_processor,
    load_hf_clip,
    load_hf_processor,
)
from rewards.registry import get_reward
from samplers import get_sampler
from samplers.cads import CADSHook, parse_cads

PROMPTS = ["a red circle", "two green triangles", "a blue square left of a yellow circle", "a purple triangle"]


def mean_pairwise_cosine_distance(embeds: torch.Tensor) -> float:
    """Mean of 1 − cos(e_i, e_j) over the pairs i < j of `embeds` `[N, D]`."""
    unit = torch.nn.functional.normalize(embeds.float(), dim=-1)
    pairs = list(itertools.combinations(range(len(unit)), 2))
    return sum(1.0 - float(unit[i] @ unit[j]) for i, j in pairs) / len(pairs)


def paired_mean_and_se(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a_i − b_i and its standard error (sample std / √n)."""
    diffs = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return float(diffs.mean()), float(diffs.std() / len(diffs) ** 0.5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=8, help="images per prompt (default 8)")
    parser.add_argument("--guidance", type=float, nargs="+", default=[7.5, 15.0], help="CFG scales (default 7.5 15)")
    parser.add_argument("--steps", type=int, default=20, help="DDIM steps (default 20)")
    parser.add_argument("--cads", default="on", help="CADS settings as for diffrl sample --cads (default: on)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cads = parse_cads(args.cads)
    pipe = load_pipeline("tiny-shapes")
    sampler = get_sampler("ddim", pipe)
    verifier = get_reward("shapes_verifier")
    clip = load_hf_clip("tiny-shapes-clip", reward="diversity")
    processor = load_hf_processor("tiny-shapes-clip", reward="diversity")
    spec = image_spec_from_processor(processor.image_processor, reward="diversity")
    rows = {}
    for guidance, hooks in itertools.product(args.guidance, ([], [CADSHook(cads)])):
        start = time.perf_counter()
        distances, scores = [], []
        for prompt in PROMPTS:
            with torch.no_grad():
                traj = sampler.sample(pipe, [prompt] * args.n, num_steps=args.steps, guidance_scale=guidance, eta=0.0,
                                      seeds=list(range(args.n)), hooks=hooks)
                images = traj.images.float().clamp(0, 1)
                pixels = hf_pixel_values(images, mode="torch", image_processor=processor.image_processor, spec=spec,
                                         device=images.device, dtype=torch.float32)
                distances.append(mean_pairwise_cosine_distance(hf_clip_image_embeds(clip, pixels)))
                scores.extend(verifier(images, [prompt] * args.n, None).scores.float().tolist())
        row = {"guidance_scale": guidance, "cads": cads.__dict__ if hooks else None,
               "diversity": sum(distances) / len(distances), "diversity_per_prompt": distances,
               "verifier": sum(scores) / len(scores), "images": len(scores),
               "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        rows[guidance, bool(hooks)] = (distances, scores)
    for guidance in args.guidance:
        (d0, s0), (d1, s1) = rows[guidance, False], rows[guidance, True]
        print(json.dumps({"guidance_scale": guidance, "diversity_diff": paired_mean_and_se(d1, d0),
                          "verifier_diff": paired_mean_and_se(s1, s0)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
