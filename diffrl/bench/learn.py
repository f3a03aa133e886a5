"""Learning: held-out ShapesWorld verifier score before/after DDPO and DPOK on tiny-shapes at a fixed sample budget.

Each trainer runs its tiny-shapes recipe (DDPO: ddpo/tiny_shapes_verifier; DPOK: dpok/tiny_shapes_clip with the
reward switched to the verifier, so both optimise the same thing) for ceil(budget / samples per epoch) epochs.
The held-out prompts (`shapes:heldout`, captions the model never saw) are evaluated with fixed seeds before the
first update and after the last, with the verifier; the gain is the difference. Wall time covers the whole run
(sampling, scoring, training, both evaluations).

Target (checked and printed): DDPO gains >= 0.15 held-out verifier score within 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

TARGET_GAIN = 0.15
TARGET_SECONDS = 600.0
RECIPES = {"ddpo": "ddpo/tiny_shapes_verifier", "dpok": "dpok/tiny_shapes_clip"}
# what makes the DPOK recipe optimise (and be judged by) the same verifier as DDPO
DPOK_TO_VERIFIER = ["reward.name=shapes_verifier", "reward.kwargs={}", "reward.gold="]


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--trainers", default="ddpo,dpok", help="comma-separated trainers to run (default ddpo,dpok)")
    add("--budget", type=int, default=512, help="samples (trajectories) each trainer may draw (default 512)")
    add("--eval-images", type=int, default=64, help="held-out images per evaluation (default 64)")
    add("--eval-prompts", default="shapes:heldout", help="held-out prompt source (default shapes:heldout)")
    add("--ddpo-recipe", default=RECIPES["ddpo"], help=f"DDPO recipe (default {RECIPES['ddpo']})")
    add("--dpok-recipe", default=RECIPES["dpok"], help=f"DPOK recipe (default {RECIPES['dpok']}, reward -> verifier)")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="recipe override for every trainer, repeatable")
    add("--set-ddpo", action="append", default=[], metavar="KEY=VALUE", help="recipe override for DDPO only")
    add("--set-dpok", action="append", default=[], metavar="KEY=VALUE", help="recipe override for DPOK only")
    add("--pipeline", default=None, help="pipeline instead of the recipes' tiny-shapes")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add("--keep", default=None, help="keep the run dirs under this folder (default: a temporary folder)")
    add("--out", default=None, help="also write the result as JSON here")


def run_learn_bench(args) -> int:
    """`diffrl bench learn`: print one line per trainer and the target; write JSON with `--out`. Exit code 0."""
    result = learn_bench(args, log=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def learn_bench(args, log=print) -> dict:
    import torch

    from diffrl.config import load_recipe
    from diffrl.errors import UserError
    from diffrl.trainers.common.bench import load_bench_recipe, peak_memory, run_trainer, temp_workdir
    from diffrl.trainers.common.metrics import read_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    unknown = sorted(set(trainers) - set(RECIPES))
    if unknown:
        raise UserError(f"--trainers: unknown {unknown}; choose from {', '.join(RECIPES)}")
    rows = []
    with temp_workdir() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for trainer in trainers:
            recipe = args.ddpo_recipe if trainer == "ddpo" else args.dpok_recipe
            per_trainer = list(args.set_ddpo if trainer == "ddpo" else DPOK_TO_VERIFIER + list(args.set_dpok))
            probe = load_recipe(recipe, per_trainer + list(args.overrides))
            per_epoch = probe.sample.batch_size * probe.sample.num_batches_per_epoch
            epochs = max(1, math.ceil(args.budget / per_epoch))
            overrides = per_trainer + list(args.overrides) + [
                f"run.num_epochs={epochs}", f"run.eval_every={epochs}", "run.save_every=0", "log.tracker=none",
                f"run.name=learn-{trainer}", f"run.output_dir={root}", f"prompts.eval_source={args.eval_prompts}",
                f"sample.eval_num_images={args.eval_images}",
            ]
            cfg, label = load_bench_recipe(recipe, overrides, args.pipeline, root / "models", log=log)
            log(f"{trainer}: {epochs} epochs × {per_epoch} samples on {label}")
            start = time.perf_counter()
            run_trainer(cfg, root / f"learn-{trainer}")
            wall = time.perf_counter() - start
            records = read_metrics(root / f"learn-{trainer}")
            before = next(r for r in records if r.get("epoch") == 0)["eval_reward_mean"]
            after = next(r for r in records if r.get("final"))["eval_reward_mean"]
            rows.append({"trainer": trainer, "recipe": recipe, "pipeline": label, "epochs": epochs,
                         "samples": epochs * per_epoch, "before": before, "after": after, "gain": after - before,
                         "wall_s": wall,
                         "train_reward_first": records[0].get("reward_mean"),
                         "train_reward_last": [r for r in records if not r.get("final")][-1].get("reward_mean")})
    ddpo = next((r for r in rows if r["trainer"] == "ddpo"), None)
    target = None
    if ddpo is not None:
        target = {"gain": ddpo["gain"], "wall_s": ddpo["wall_s"], "target_gain": TARGET_GAIN,
                  "target_seconds": TARGET_SECONDS,
                  "met": ddpo["gain"] >= TARGET_GAIN and ddpo["wall_s"] <= TARGET_SECONDS}
    return {"rows": rows, "budget": args.budget, "eval_images": args.eval_images, "eval_prompts": args.eval_prompts,
            "threads": torch.get_num_threads(), "target": target, **peak_memory()}


def format_result(result: dict) -> str:
    lines = [f"{'trainer':8s} {'samples':>8s} {'before':>8s} {'after':>8s} {'gain':>8s} {'wall s':>8s}  pipeline"]
    for r in result["rows"]:
        lines.append(f"{r['trainer']:8s} {r['samples']:8d} {r['before']:8.4f} {r['after']:8.4f} {r['gain']:+8.4f} "
                     f"{r['wall_s']:8.1f}  {r['pipeline']}")
    t = result["target"]
    if t is not None:
        verdict = "met" if t["met"] else "NOT met"
        lines.append(f"DDPO held-out gain {t['gain']:+.4f} in {t['wall_s']:.0f} s; target >= +{t['target_gain']} "
                     f"within {t['target_seconds']:.0f} s: {verdict}")
    return "\n".join(lines)
