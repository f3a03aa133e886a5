"""Measure reward guidance with the embedded CLIP on the embedded `tiny-shapes` model: how the CLIP score and the
verifier move against unguided sampling with the same noise, for each setting asked for.

    OMP_NUM_THREADS=1 taskset -c 0 python -m demo.measure_guidance --num-prompts 32 --seeds 0 1 \
        --setting scale=1 --setting scale=1,start=10 ...

Each setting runs `steer(method="guidance")` on `--num-prompts` prompts of `shapes:heldout`, all prompts
in one call per seed (`seed` seeds the start and step noise), and the same call at `scale=0` is the baseline: the same
process, sampler, η and noise, so each image pairs with its unguided twin and the difference is guidance's alone.
Printed per setting: mean CLIP score and verifier before → after, the mean paired difference and its standard error
(std of the per-image differences / √n), and the share of images whose verifier fell. The demo's guidance defaults
(`engine.METHOD_DEFAULTS`) are the setting chosen from this table; docs/demo.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from diffrl.pipelines import load_pipeline
from diffrl.shapes.prompts import get_prompt_set
from diffrl.steering import steer
from rewards.registry import get_reward


def paired(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean of after − before and its standard error (sample std of the differences / √n)."""
    diffs = [a - b for a, b in zip(after, before)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var / n)


def parse_setting(text: str) -> dict:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if key.strip() in ("start", "end") else float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--skip-prompts", type=int, default=0, help="start after this many shapes:heldout prompts")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=5.0, help="CFG scale (the demo's default)")
    parser.add_argument("--setting", action="append", default=[], help="guidance settings, e.g. scale=1,start=10")
    parser.add_argument("--out", help="write the per-image scores here (JSON)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pipe = load_pipeline("tiny-shapes", device="cpu")
    clip = get_reward("clip_score", model="tiny-shapes-clip")
    verifier = get_reward("shapes_verifier")
    prompts = get_prompt_set("heldout")[args.skip_prompts : args.skip_prompts + args.num_prompts]

    def run(setting: dict) -> dict:
        clip_scores, verdicts = [], []
        for seed in args.seeds:
            images, _, _ = steer(pipe, prompts, clip, "guidance", num_steps=args.steps,
                                 guidance_scale=args.guidance_scale, seed=seed, num_samples=1, **setting)
            with torch.no_grad():
                clip_scores += clip(images, prompts, None).scores.tolist()
                verdicts += verifier(images, prompts, None).scores.tolist()
        return {"clip": clip_scores, "verifier": verdicts}

    started = time.perf_counter()
    base = run({"scale": 0.0})
    results = {"baseline": base}
    print(f"{len(base['clip'])} images (shapes:heldout prompts {args.skip_prompts + 1}-"
          f"{args.skip_prompts + len(prompts)} x seeds {args.seeds}), "
          f"{args.steps} steps, CFG {args.guidance_scale}; baseline (scale=0): CLIP {mean(base['clip']):.2f}, "
          f"verifier {mean(base['verifier']):.3f}  [{time.perf_counter() - started:.0f} s]")
    print("| setting | CLIP before → after | CLIP diff ± se | verifier before → after | verifier diff ± se "
          "| verifier fell |")
    print("|---|---|---|---|---|---|")
    for text in args.setting:
        started = time.perf_counter()
        setting = parse_setting(text)
        after = run(setting)
        results[text] = after
        c, c_se = paired(base["clip"], after["clip"])
        v, v_se = paired(base["verifier"], after["verifier"])
        fell = sum(a < b for a, b in zip(after["verifier"], base["verifier"])) / len(base["verifier"])
        print(f"| {text} | {mean(base['clip']):.2f} → {mean(after['clip']):.2f} | {c:+.2f} ± {c_se:.2f} "
              f"| {mean(base['verifier']):.3f} → {mean(after['verifier']):.3f} | {v:+.3f} ± {v_se:.3f} "
              f"| {100 * fell:.0f}% |  [{time.perf_counter() - started:.0f} s]", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "prompts": prompts, "scores": results}, f, indent=1)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    main()
