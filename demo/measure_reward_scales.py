"""Measure the typical spread of each embedded reward: the scale the demo divides it by when several rewards are
weighted (`engine.REWARD_SCALES`).

    OMP_NUM_THREADS=1 taskset -c 0 python demo/measure_reward_scales.py --num-prompts 64 --seeds 0 1

Draws the first `--num-prompts` prompts of `shapes:heldout` with plain sampling on the embedded `tiny-shapes`, at
the Generate page's defaults (20 steps, guidance 5, the sampler's default η), one image per prompt and seed, and
prints each embedded reward's mean and standard deviation over those images. The standard deviation is the scale: a
weight of 1 then moves the total by about as much for one reward as for another.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from diffrl.pipelines import load_pipeline
from diffrl.shapes.prompts import get_prompt_set
from rewards.registry import get_reward
from samplers import get_sampler

from .engine import EMBEDDED_REWARDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=5.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pipe = load_pipeline("tiny-shapes", device="cpu")
    sampler = get_sampler("auto", pipe)
    prompts = get_prompt_set("heldout")[: args.num_prompts]
    rewards = {label: get_reward(spec["name"], **dict(spec.get("kwargs") or {}))
               for label, spec in EMBEDDED_REWARDS.items()}
    scores = {label: [] for label in rewards}
    for seed in args.seeds:
        with torch.no_grad():
            images = sampler.sample(pipe, prompts, num_steps=args.steps, guidance_scale=args.guidance_scale,
                                    eta=sampler.default_eta, seeds=[seed * len(prompts) + i for i in
                                                                   range(len(prompts))]).images.float().clamp(0, 1)
            for label, reward in rewards.items():
                scores[label] += reward(images, prompts, None).scores.float().tolist()
    print(f"{len(scores['shapes_verifier'])} images: {args.num_prompts} shapes:heldout prompts x {len(args.seeds)} "
          f"seeds, {args.steps} steps, guidance {args.guidance_scale}, η {sampler.default_eta}")
    print("| reward | mean | std (the scale) |\n|---|---|---|")
    for label, values in scores.items():
        print(f"| {label} | {statistics.fmean(values):.4g} | {statistics.stdev(values):.4g} |")


if __name__ == "__main__":
    main()
