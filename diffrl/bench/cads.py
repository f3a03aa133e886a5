"""CADS: image diversity and the verifier with and without condition-annealed sampling, plain or steered.

    diffrl bench cads --threads 1                                    # plain DDIM sampling, guidance 7.5 and 15
    diffrl bench cads --method fk --set num_particles=4 --guidance 7.5 --threads 1

For each guidance scale and each setting (no CADS, and CADS with `--cads`), `-n` images of each prompt. `--method
sample` (the default) draws them with the plain DDIM sampler (`samplers.cads.CADSHook`), image j of every prompt from
seed `--seed` + j, η = 0 unless `--eta`. A steering method (best-of-n, fk, svdd, guidance, reno; settings with `--set`)
steers all n images of prompt i in one `diffrl.steering.steer` call with seed `--seed` + i, on `--reward` (default
`shapes_verifier`), with the method's own η default (1 for DDIM, 0.7 for flow) unless `--eta`; CADS then keys each
particle's condition noise by its slot (`diffrl/steering/cads.py`). Both settings start from the same noise, so every
image of one has a twin in the other.

Diversity = per prompt, the mean over image pairs of the cosine distance 1 − cos between the tiny CLIP's image
embeddings (`tiny-shapes-clip`), averaged over prompts; alignment = the mean `shapes_verifier` score. Prints one
JSON line per row, then per guidance scale the CADS − none differences with the standard error of the paired
differences (diversity: per prompt; verifier: per image, same prompt and seed).
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch

from diffrl.bench import run_bench
from diffrl.checks import number, positive
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.pipelines import load_pipeline
from diffrl.prompts import load_prompts
from diffrl.steering import METHODS, method_config, steer
from diffrl.steering.cli import key_values
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
EMBEDDER = "tiny-shapes-clip"


def mean_pairwise_cosine_distance(embeds: torch.Tensor) -> float:
    """Mean of 1 − cos(e_i, e_j) over the pairs i < j of `embeds` `[N, D]`."""
    unit = torch.nn.functional.normalize(embeds.float(), dim=-1)
    pairs = list(itertools.combinations(range(len(unit)), 2))
    return sum(1.0 - float(unit[i] @ unit[j]) for i, j in pairs) / len(pairs)


def paired_mean_and_se(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a_i − b_i and its standard error (sample std / √n)."""
    diffs = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return float(diffs.mean()), float(diffs.std() / len(diffs) ** 0.5)


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--method", default="sample", choices=("sample", *METHODS),
        help="plain sampling (default) or a steering method")
    add("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
        help="a setting of the steering method, e.g. num_particles=4 (repeatable; values are YAML)")
    add("--reward", default="shapes_verifier", help="reward a steering method steers on (default shapes_verifier)")
    add("--pipeline", default="tiny-shapes", help="pipeline name or folder (default tiny-shapes)")
    add("-n", type=positive, default=8, help="images per prompt (default 8; at least 2)")
    add("--prompts", default=None, help="prompt source: a text file, shapes:SET or module:function (default: 4 "
        "fixed ShapesWorld prompts)")
    add("--num-prompts", type=positive, default=None, help="first N prompts of --prompts")
    add("--guidance", type=number(0), nargs="+", default=[7.5, 15.0], help="CFG scales (default 7.5 15)")
    add("--steps", type=positive, default=20, help="denoising steps (default 20)")
    add("--eta", type=number(0), default=None, help="DDIM η / flow noise level (default: 0 for sample, the steering "
        "default otherwise)")
    add("--cads", default="on", help="CADS settings as for diffrl sample --cads (default: on)")
    add("--seed", type=int, default=0, help="first seed (default 0)")
    add("--device", default=None, help="torch device (default cuda if available)")
    add("--threads", type=int, default=None, help="torch CPU threads")
    add("--out", default=None, help="also write the rows and differences as JSON here")


class Judge:
    """Embeds images with the tiny CLIP (diversity) and scores them with the ShapesWorld verifier."""

    def __init__(self, device):
        self.clip = load_hf_clip(EMBEDDER, reward="diversity").to(device)
        self.processor = load_hf_processor(EMBEDDER, reward="diversity")
        self.spec = image_spec_from_processor(self.processor.image_processor, reward="diversity")
        self.verifier = get_reward("shapes_verifier")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompt: str) -> tuple[float, list[float]]:
        """(diversity of `images` `[n, 3, H, W]` in [0, 1], verifier score of each)."""
        images = images.float().clamp(0, 1)
        pixels = hf_pixel_values(images, mode="torch", image_processor=self.processor.image_processor,
                                 spec=self.spec, device=images.device, dtype=torch.float32)
        diversity = mean_pairwise_cosine_distance(hf_clip_image_embeds(self.clip, pixels))
        return diversity, self.verifier(images, [prompt] * len(images), None).scores.float().tolist()


def cads_bench(args, log=print) -> dict:
    """Measure every (guidance scale, CADS off/on) row; returns `{"settings", "rows", "differences"}`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cads = parse_cads(args.cads)
    if args.n < 2:
        raise UserError("-n must be at least 2: diversity compares pairs of images of one prompt")
    prompts = load_prompts(args.prompts) if args.prompts else list(PROMPTS)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    settings = key_values(args.settings, "--set")
    if args.method == "sample":
        if settings:
            raise UserError("--set sets a steering method's settings; plain sampling (--method sample) has none")
    else:
        method_config(args.method, **settings)  # an unknown setting fails before the models load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = load_pipeline(args.pipeline, device=device)
    judge = Judge(device)
    sampler = get_sampler("auto", pipe)
    reward = get_reward(args.reward) if args.method != "sample" else None

    def images_of(prompt: str, index: int, guidance: float, config) -> tuple[torch.Tensor, dict]:
        if args.method == "sample":
            with torch.no_grad():
                traj = sampler.sample(pipe, [prompt] * args.n, num_steps=args.steps, guidance_scale=guidance,
                                      eta=0.0 if args.eta is None else args.eta,
                                      seeds=[args.seed + j for j in range(args.n)],
                                      hooks=[CADSHook(config)] if config is not None else [])
            return traj.images, {}
        images, _, info = steer(pipe, [prompt] * args.n, reward, args.method, num_steps=args.steps,
                                guidance_scale=guidance, eta=args.eta, seed=args.seed + index, cads=config,
                                **settings)
        return images, {"nfe_per_image": info["nfe_per_prompt"], "eta": info["eta"]}

    rows, measured = [], {}
    for guidance, config in itertools.product(args.guidance, (None, cads)):
        start = time.perf_counter()
        distances, scores, extra = [], [], {}
        for index, prompt in enumerate(prompts):
            images, extra = images_of(prompt, index, guidance, config)
            diversity, verified = judge(images, prompt)
            distances.append(diversity)
            scores.extend(verified)
        row = {"method": args.method, "guidance_scale": guidance,
               "cads": None if config is None else config.__dict__, "diversity": sum(distances) / len(distances),
               "diversity_per_prompt": distances, "verifier": sum(scores) / len(scores), "images": len(scores),
               **extra, "seconds": round(time.perf_counter() - start, 1)}
        log(json.dumps(row))
        rows.append(row)
        measured[guidance, config is not None] = (distances, scores)
    differences = []
    for guidance in args.guidance:
        (d0, s0), (d1, s1) = measured[guidance, False], measured[guidance, True]
        diff = {"method": args.method, "guidance_scale": guidance,
                "diversity_diff": paired_mean_and_se(d1, d0) if len(d0) > 1 else (d1[0] - d0[0], None),
                "verifier_diff": paired_mean_and_se(s1, s0)}
        log(json.dumps(diff))
        differences.append(diff)
    settings_out = {key: value for key, value in vars(args).items() if key != "cads"}
    return {"settings": {**settings_out, "cads": cads.__dict__, "prompts": prompts, "pipeline": args.pipeline},
            "rows": rows, "differences": differences}


def run_cads_bench(args) -> int:
    """`diffrl bench cads`: print the rows and differences (and write them with `--out`). Returns 0."""
    result = cads_bench(args, log=lambda line: print(line, flush=True))
    if args.out:
        write_json(args.out, result)
    return 0


def main(argv=None) -> int:
    """`python -m diffrl.bench.cads ARGS` = `diffrl bench cads ARGS` (kept for commands written before the verb)."""
    try:
        return run_bench("cads", sys.argv[1:] if argv is None else list(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
