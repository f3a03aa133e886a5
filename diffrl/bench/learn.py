"""Learning: the table a user chooses a trainer from — held-out verifier gain, KL drift and reward per unit of
compute of every trainer on tiny-shapes at the same budget.

Each row (`ROWS`: a trainer variant = its shipped tiny-shapes recipe + overrides: DDPO on the verifier itself; DPOK
on the tiny CLIP score; DRaFT-LV (the README's first command), DRaFT-1, DRaFT-2 and AlignProp on the tiny PickScore,
each with the verifier as gold; RAFT on the verifier) runs for ceil(budget / samples per epoch) epochs, or for
`--minutes` of training wall-clock (`run.max_train_minutes`: the same clock for every row, evaluations left out).
The held-out prompts (`shapes:heldout`, captions the model never saw) are scored by the verifier with fixed seeds
(the gold reward where the recipe trains on a proxy) before the first update, every `--eval-every` epochs and after
the last update. Each run reports

- before / after / gain of the held-out verifier score, with its standard error (`eval_gold_std` or
  `eval_reward_std` over the images / √images, the two evaluations taken as independent) and the paired one (the
  per-image differences of the same prompts and seeds, `eval_scores.jsonl`: whether these images got better), and
  the trained-on (proxy) reward's held-out mean before / after, with its paired standard error (`proxy_scores` of
  `eval_scores.jsonl`);
- KL drift: Σ_t KL_t (closed-form Gaussian KL per step, per latent dim) of the final policy to the pre-trained model
  (the same UNet with its LoRA adapter off) along held-out trajectories sampled by the final policy;
- reward per unit of compute: the samples drawn and the training wall-clock spent (evaluations left out) by the
  first evaluated policy whose held-out score reaches a fixed target (`--target-score`, else the pre-trained score
  + `--target-gain`). Its resolution is the evaluation spacing: a run that reaches the target between two
  evaluations is credited at the later one.

Rows `ROW-jpeg` (not run by default): the same trainers trained on and scored by JPEG compressibility on the
held-out captions, a dense reward (DDPO's first task) that shows whether a trainer moves a reward at all at this
budget where the sparse verifier does not; compressibility is hackable (blank images are the smallest files), so
look at the before/after grid too.

Levers (`--sweep NAME=V1,V2,...`, repeatable): one lever varied at a time away from the recipe, every value a full
run at the same sample budget; the recipe itself runs once as the baseline row (a value equal to the recipe's is
not run twice).

    timestep_fraction   train.timestep_fraction (DDPO): fraction of each trajectory's denoising steps trained
    group_size          advantage.group_size = k samples per prompt with group-relative advantages (k = 1: no group
                        to compare within, so batch-normalised advantages)
    advantage           advantage.mode: per_prompt | group | batch | none
    train_steps         sample.num_steps while training; evaluation keeps the recipe's sample.eval_num_steps

Any recipe key also works as a lever (`--sweep train.clip_range=1e-4,1e-3`). Evaluation (prompts, images, steps,
seeds) is pinned to the baseline's for every run, so all scores and the target are on one scale.

Target (checked and printed for every trainer): a held-out verifier gain >= 0.10 within 10 minutes of training
(evaluation time left out) on a 2-core CPU: the bar of the README's first command.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from diffrl.bench.common import load_bench_recipe, peak_memory, run_trainer, temp_workdir
from diffrl.config import load_recipe, to_dict
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.models import model_family
from diffrl.prompts import load_prompts
from diffrl.rundir import latest_checkpoint
from diffrl.training import setup
from diffrl.training.evaluation import EVAL_SEED, paired_gain
from diffrl.training.metrics import eval_curve, read_metrics
from diffrl.training.reference import step_kl_to_reference
from diffrl.training.weights import load_trainable, setup_trainable

TARGET_GAIN = 0.10  # the first command's bar (the trainers issue): +0.10 held-out within 10 minutes
TARGET_SECONDS = 600.0
# the DRaFT rows' reward, the tiny PickScore (dense, differentiable), with the rule-based verifier as the gold
PICKSCORE = ["reward.name=pickscore", "reward.kwargs={model: tiny-shapes-pickscore}", "reward.gold=shapes_verifier"]
# the table's rows: a trainer variant = a shipped tiny-shapes recipe + overrides (data, overridable with --recipe)
ROWS = {
    "ddpo": ("ddpo/tiny_shapes_verifier", []),
    "dpok": ("dpok/tiny_shapes_clip", []),
    "draft-lv": ("draft/tiny_shapes_pickscore", []),  # the README's first command (DRaFT-LV, n = 2)
    "draft-1": ("draft/tiny_shapes_pickscore", ["train.lv_samples=0"]),
    "draft-2": ("draft/tiny_shapes_pickscore", ["train.lv_samples=0", "train.k=2"]),
    "alignprop": ("alignprop/tiny_shapes_pickscore", []),
    "raft": ("raft/tiny_shapes_verifier", []),
    "rlcm": ("rlcm/tiny_shapes_lcm_verifier", []),  # DDPO's objective over the 4-step LCM sampler
    "d3po": ("d3po/tiny_shapes_verifier", []),
    "diffusion_dpo": ("diffusion_dpo/tiny_shapes_pairs", []),  # offline: its "samples" are pairs
    "flow_grpo": ("flow_grpo/tiny_shapes_flow_verifier", []),  # tiny-shapes-flow (rectified flow, SD3 class)
    # trained on the dense tiny PickScore instead of the sparse verifier it is scored by (bench gradient: on the
    # verifier half of the groups tie and one optimizer step's gradient has an expected cosine of 0.07 with the true one)
    "flow_grpo-pickscore": ("flow_grpo/tiny_shapes_flow_verifier", PICKSCORE),
    "diffusion_nft": ("diffusion_nft/tiny_shapes_flow_verifier", []),
    "diffusion_nft-pickscore": ("diffusion_nft/tiny_shapes_flow_verifier", PICKSCORE),
    "awm": ("awm/tiny_shapes_flow_verifier", []),  # advantage-weighted flow matching, tiny-shapes-flow
    "adjoint_matching": ("adjoint_matching/tiny_shapes_flow_clip", []),  # memoryless SOC, differentiable CLIP score
    # the same recipe on the DRaFT rows' reward (differentiable; JPEG is not)
    "adjoint_matching-pickscore": ("adjoint_matching/tiny_shapes_flow_clip", PICKSCORE),
    "prdp": ("prdp/tiny_shapes_verifier", []),  # reward-difference regression over pairs of one prompt's chains
    "pxpo": ("pxpo/tiny_shapes_verifier_map", []),  # DDPO with the verifier's per-pixel feedback map
    "seppo": ("seppo/tiny_shapes_verifier", []),  # winners rendered from the captions vs reference-checkpoint samples
}
DEFAULT_ROWS = list(ROWS)
# The same trainers on a dense reward, JPEG compressibility (DDPO's first task), trained on and scored by it on the
# held-out captions (no gold): whether each trainer moves *a* reward at this budget, apart from whether the sparse,
# discrete verifier shows it. The DRaFT family and Adjoint Matching need a differentiable reward and have no JPEG row:
# whether they move their own reward is the trained-on (proxy) reward's held-out gain and its paired se.
JPEG = ["reward.name=jpeg_compressibility", "reward.kwargs={}", "reward.gold="]
# offline: pairs ranked by the same reward (SePPO reads only each pair's preferred image: its winners)
JPEG_PAIRS = {"diffusion_dpo": ["train.pairs=shapes:train_jpeg"], "seppo": ["train.pairs=shapes:train_jpeg"]}
ROWS.update({f"{row}-jpeg": (recipe, overrides + JPEG + JPEG_PAIRS.get(row, []))
             for row, (recipe, overrides) in list(ROWS.items())
             if row in ("ddpo", "dpok", "raft", "rlcm", "d3po", "diffusion_dpo", "flow_grpo", "diffusion_nft",
                        "awm", "prdp", "pxpo", "seppo")})
RECIPES = {row: recipe for row, (recipe, _) in ROWS.items()}
UNLIMITED_EPOCHS = 100_000  # --minutes without --budget: the clock ends each run
AUTO_EVALUATIONS = 4  # --eval-every 0: evaluations spread over the run (epoch 0 included), plus the final one


def _group_size(k: str) -> list[str]:
    return [f"advantage.group_size={k}", f"advantage.mode={'group' if int(k) > 1 else 'batch'}"]


# lever name -> recipe overrides for one of its values
LEVERS = {
    "timestep_fraction": lambda v: [f"train.timestep_fraction={v}"],
    "group_size": _group_size,
    "advantage": lambda v: [f"advantage.mode={v}"],
    "train_steps": lambda v: [f"sample.num_steps={v}"],
}


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--trainers", default=",".join(DEFAULT_ROWS),
        help=f"comma-separated rows (trainer variants) to run (default {','.join(DEFAULT_ROWS)}; also "
             f"{','.join(r for r in ROWS if r not in DEFAULT_ROWS)}: the same trainers on JPEG compressibility)")
    add("--budget", type=int, default=None,
        help="samples (trajectories) each run may draw (default 512; with --minutes: no sample limit)")
    add("--minutes", type=float, default=None,
        help="minutes of training (evaluations left out) each run may take (run.max_train_minutes); the same "
             "wall-clock budget for every row")
    add("--eval-images", type=int, default=64, help="held-out images per evaluation (default 64)")
    add("--eval-prompts", default="shapes:heldout", help="held-out prompt source (default shapes:heldout)")
    add("--eval-every", type=int, default=0,
        help=f"epochs between held-out evaluations (default 0: {AUTO_EVALUATIONS} spread over the run; with "
             f"--minutes, every --minutes/{AUTO_EVALUATIONS} minutes of training)")
    add("--target-score", type=float, default=None,
        help="held-out score whose samples and wall-clock to reach are reported (default: pre-trained score + "
             "--target-gain)")
    add("--target-gain", type=float, default=0.10, help="target above the pre-trained score (default 0.10)")
    add("--kl-images", type=int, default=16,
        help="held-out trajectories for the KL drift of each final policy (default 16; 0 = skip)")
    add("--sweep", action="append", default=[], metavar="LEVER=V1,V2,...",
        help=f"vary one lever ({', '.join(LEVERS)}, or any recipe key), repeatable")
    add("--recipe", dest="recipes", action="append", default=[], metavar="TRAINER=RECIPE",
        help=f"a row's recipe instead of its default ({', '.join(f'{k}: {v}' for k, v in RECIPES.items())})")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="recipe override for every trainer, repeatable")
    add("--set-for", action="append", default=[], metavar="ROW:KEY=VALUE",
        help="recipe override for one row, repeatable (e.g. dpok:train.policy_steps=2)")
    add("--pipeline", default=None, help="pipeline instead of the recipes' tiny-shapes")
    add("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add("--keep", default=None, help="keep the run dirs under this (new or empty) folder (default: a temporary one)")
    add("--out", default=None, help="also write the result as JSON here")


def run_learn_bench(args) -> int:
    """`diffrl bench learn`: print the table and the targets; write JSON with `--out`. Exit code 0."""
    result = learn_bench(args, log=lambda line: print(line, file=sys.stderr))
    print(format_result(result))
    if args.out:
        write_json(args.out, result)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Plan: which runs, with which overrides
# ---------------------------------------------------------------------------------------------------------------


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """`"NAME=V1,V2"` -> `(NAME, ["V1", "V2"])`; NAME is a lever of `LEVERS` or a dotted recipe key."""
    name, sep, values = spec.partition("=")
    name = name.strip()
    values = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not values or (name not in LEVERS and "." not in name):
        raise UserError(f"--sweep {spec!r}: expected LEVER=V1,V2,... with LEVER one of {', '.join(LEVERS)} or a "
                        "recipe key such as train.clip_range")
    return name, values


def lever_overrides(name: str, value: str) -> list[str]:
    """The recipe overrides that set lever `name` to `value`."""
    return LEVERS[name](value) if name in LEVERS else [f"{name}={value}"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def plan_runs(args, trainers: list[str], root: Path) -> list[dict]:
    """Every run of the bench, its recipe loaded (so a bad lever or value fails before any training).

    Returns one dict per row: trainer, lever, value, recipe, overrides, cfg, run_dir, and `same_as` (the run dir of
    an earlier row with the identical resolved config, which is not run again)."""
    sweeps = [parse_sweep(s) for s in args.sweep]
    recipes, per_trainer = dict(RECIPES), {t: [] for t in trainers}
    for spec in args.recipes:
        trainer, sep, recipe = spec.partition("=")
        if not sep or trainer not in per_trainer:
            raise UserError(f"--recipe {spec!r}: expected TRAINER=RECIPE with TRAINER one of {', '.join(trainers)}")
        recipes[trainer] = recipe
    for spec in args.set_for:
        trainer, sep, override = spec.partition(":")
        if not sep or trainer not in per_trainer:
            raise UserError(f"--set-for {spec!r}: expected TRAINER:KEY=VALUE with TRAINER one of "
                            f"{', '.join(trainers)}")
        per_trainer[trainer].append(override)
    rows, seen = [], {}
    for trainer in trainers:
        recipe = recipes[trainer]
        # the row's own variant, then every row's, then this row's: the more specific override wins
        base = list(ROWS[trainer][1]) + list(args.overrides) + per_trainer[trainer]
        baseline = load_recipe(recipe, base)
        # evaluation pinned to the baseline's, whatever a lever changes (e.g. sample.num_steps)
        pinned = [f"prompts.eval_source={args.eval_prompts}", f"sample.eval_num_images={args.eval_images}",
                  f"sample.eval_num_steps={baseline.sample.eval_num_steps or baseline.sample.num_steps}"]
        plan = [("baseline", "", [])] + [(n, v, lever_overrides(n, v)) for n, values in sweeps for v in values]
        for lever, value, extra in plan:
            overrides = base + extra + pinned
            cfg = load_recipe(recipe, overrides)
            key = json.dumps(to_dict(cfg), sort_keys=True, default=str)
            name = f"learn-{trainer}-" + ("baseline" if lever == "baseline" else _slug(f"{lever}-{value}"))
            rows.append({"trainer": trainer, "lever": lever, "value": value, "recipe": recipe,
                         "overrides": overrides, "cfg": cfg, "run_dir": root / name, "same_as": seen.get(key)})
            seen.setdefault(key, root / name)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Reading a run: held-out score against compute
# ---------------------------------------------------------------------------------------------------------------


def paired_se(run_dir: Path, key: str = "scores") -> float | None:
    """Standard error of the gain from the run's first and last evaluations' per-image scores (`eval_scores.jsonl`:
    the same held-out prompts and seeds each time, so the gain is a paired difference); None for a run without.
    `key="proxy_scores"`: the trained-on reward's, written beside the gold's (None where the run had no gold)."""
    path = Path(run_dir) / "eval_scores.jsonl"
    if not path.exists():
        return None
    evals = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(evals) < 2 or key not in evals[0] or key not in evals[-1]:
        return None
    return paired_gain(evals[0][key], evals[-1][key])[1]


def first_reaching(points: list[dict], target: float) -> dict | None:
    """The first point of `eval_curve` whose score is >= `target`, or None."""
    return next((p for p in points if p["score"] is not None and p["score"] >= target), None)


def kl_drift(cfg, checkpoint: Path, *, prompts: list[str], num_images: int, num_steps: int) -> float | None:
    """Mean over held-out trajectories of Σ_t KL_t between the checkpoint's policy and the pre-trained one.

    Trajectories are sampled by the fine-tuned policy with the evaluation's prompts and seeds, always with η = 1 (the
    DDPM-like step policies; a flow model's SDE at noise level a = 1; a trainer that samples with η = 0 has no step distribution to compare, and one scale
    for every trainer keeps the column comparable); KL_t is DPOK's
    closed-form step KL (`diffrl.training.reference.step_kl_to_reference`: per latent dim, the reference being the same UNet with the
    LoRA adapter off). Uses the raw trained weights (not EMA). None for a full fine-tune (no adapter to switch off).
    """
    if cfg.model.full_finetune or num_images <= 0:
        return None
    accelerator = Accelerator(mixed_precision=cfg.model.mixed_precision)
    pipe = setup.load_policy_pipeline(cfg, accelerator)
    network = model_family(pipe).denoiser  # the UNet, or a flow pipeline's transformer
    setup_trainable(network, use_lora=True, lora_rank=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha,
                    lora_target_modules=cfg.model.lora.target_modules)
    load_trainable(network, checkpoint)
    network.eval()
    sampler = setup.make_sampler(cfg.sample.sampler, pipe)
    totals = []
    for start in range(0, num_images, cfg.sample.batch_size):
        idx = list(range(start, min(start + cfg.sample.batch_size, num_images)))
        batch_prompts = [prompts[i % len(prompts)] for i in idx]
        negative = [cfg.sample.negative_prompt] * len(idx) if cfg.sample.negative_prompt else None
        with torch.no_grad(), accelerator.autocast():
            traj = sampler.sample(pipe, batch_prompts, num_steps=num_steps, guidance_scale=cfg.sample.guidance_scale,
                                  eta=1.0, seeds=[EVAL_SEED + i for i in idx], negative_prompt=negative)
            per_step = [step_kl_to_reference(pipe, sampler, traj, j)[1] for j in range(traj.num_steps)]
        totals.append(torch.stack(per_step, dim=1).double().sum(dim=1).cpu())  # [b]: Σ_t KL_t
    return float(torch.cat(totals).mean())


# ---------------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------------


def learn_bench(args, log=print) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    unknown = sorted(set(trainers) - set(ROWS))
    if unknown:
        raise UserError(f"--trainers: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.minutes is not None and not (args.minutes > 0 and math.isfinite(args.minutes)):
        raise UserError(f"--minutes must be a positive number, got {args.minutes}")
    budget = args.budget if args.budget is not None else (None if args.minutes else 512)
    rows = []
    with temp_workdir() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        plan = plan_runs(args, trainers, root)
        taken = [str(p["run_dir"]) for p in plan if p["same_as"] is None and p["run_dir"].exists()]
        if taken:
            raise UserError(f"--keep {root}: {taken[0]} already exists (metrics would mix); pick a new folder")
        done: dict[Path, dict] = {}
        for i, p in enumerate(plan):
            label = f"{p['trainer']} {p['lever']}" + (f"={p['value']}" if p["value"] else "")
            if p["same_as"] is not None:
                log(f"[{i + 1}/{len(plan)}] {label}: the same config as {p['same_as'].name}, not run again")
                rows.append({**done[p["same_as"]], "lever": p["lever"], "value": p["value"],
                             "same_as": p["same_as"].name})
                continue
            cfg0 = p["cfg"]
            per_epoch = cfg0.sample.batch_size * cfg0.sample.num_batches_per_epoch
            epochs = UNLIMITED_EPOCHS if budget is None else max(1, math.ceil(budget / per_epoch))
            eval_minutes = 0.0
            if args.eval_every > 0:
                eval_every = args.eval_every
            elif args.minutes and budget is None:  # by the clock: epochs of different trainers differ in cost
                eval_every, eval_minutes = 0, args.minutes / AUTO_EVALUATIONS
            else:
                eval_every = max(1, math.ceil(epochs / AUTO_EVALUATIONS))
            run_dir = p["run_dir"]
            overrides = p["overrides"] + [
                f"run.num_epochs={epochs}", f"run.eval_every={eval_every}", "run.save_every=0", "log.tracker=none",
                f"run.name={run_dir.name}", f"run.output_dir={root}",
                f"run.max_train_minutes={args.minutes or 0}", f"run.eval_every_minutes={eval_minutes}",
            ]
            cfg, pipeline = load_bench_recipe(p["recipe"], overrides, args.pipeline, root / "models", log=log)
            size = f"{epochs} epochs × {per_epoch} samples" if budget is not None else f"{per_epoch} samples an epoch"
            clock = f", {args.minutes:g} min of training at most" if args.minutes else ""
            log(f"[{i + 1}/{len(plan)}] {label}: {size}{clock} on {pipeline}")
            start = time.perf_counter()
            run_trainer(cfg, run_dir)
            wall = time.perf_counter() - start
            records = read_metrics(run_dir)
            epoch_records = [r for r in records if not r.get("final")]
            curve = eval_curve(records)
            row = {
                "trainer": p["trainer"], "lever": p["lever"], "value": p["value"], "same_as": None,
                "recipe": p["recipe"], "overrides": p["overrides"], "pipeline": pipeline,
                "epochs": len(epoch_records),
                "samples_per_epoch": per_epoch, "samples": epoch_records[-1]["samples_seen"],
                "eval_every": eval_every, "eval_every_minutes": eval_minutes, "before": curve[0]["score"], "after": curve[-1]["score"],
                "gain": curve[-1]["score"] - curve[0]["score"], "wall_s": wall,
                "gain_se": (math.hypot(curve[0]["score_se"], curve[-1]["score_se"])
                            if None not in (curve[0].get("score_se"), curve[-1].get("score_se")) else None),
                "gain_paired_se": paired_se(run_dir),
                "proxy_gain_paired_se": paired_se(run_dir, "proxy_scores"),  # the trained-on reward's, with a gold
                "train_wall_s": curve[-1]["train_wall_s"], "curve": curve,
                "train_reward_first": epoch_records[0].get("reward_mean"),
                "train_reward_last": epoch_records[-1].get("reward_mean"),
                "train_kl_last": epoch_records[-1].get("kl"),
                "kl_drift": kl_drift(cfg, latest_checkpoint(run_dir), prompts=load_prompts(cfg.prompts.eval_source),
                                     num_images=args.kl_images, num_steps=cfg.sample.eval_num_steps),
            }
            done[run_dir] = row
            rows.append(row)
    return summarise(rows, args, threads=torch.get_num_threads(), memory=peak_memory())


def summarise(rows: list[dict], args, *, threads: int, memory: dict) -> dict:
    """Attach the fixed target and each row's samples / training wall-clock to reach it; the issue's targets."""
    # rows evaluate with their own recipe's sampler (DDPO's and DPOK's at eta 1, the others' at eta 0), so their
    # pre-trained scores differ: without --target-score each row's target is its own pre-trained score + the gain
    pretrained = rows[0]["before"] if rows else float("nan")
    target = args.target_score if args.target_score is not None else pretrained + args.target_gain
    for row in rows:
        row["target_score"] = args.target_score if args.target_score is not None else row["before"] + args.target_gain
        hit = first_reaching(row["curve"], row["target_score"])
        row["to_target"] = None if hit is None else {"samples": hit["samples"], "train_wall_s": hit["train_wall_s"],
                                                     "epoch": hit["epoch"]}
    # the first command's bar, per row: an evaluated policy at least TARGET_GAIN above the row's own pre-trained score
    # after at most TARGET_SECONDS of training (a clock-limited run overshoots by its last epoch, so the end of the
    # run is not what is judged: the first evaluation that meets the gain is)
    targets = {}
    for r in rows:
        if r["lever"] != "baseline":
            continue
        hit = next((p for p in r["curve"] if p["score"] is not None
                    and p["score"] - r["before"] >= TARGET_GAIN - 1e-12 and p["train_wall_s"] <= TARGET_SECONDS), None)
        targets[r["trainer"]] = {"gain": r["gain"], "train_wall_s": r["train_wall_s"], "wall_s": r["wall_s"],
                                 "target_gain": TARGET_GAIN, "target_seconds": TARGET_SECONDS, "met": hit is not None,
                                 "met_at_s": None if hit is None else hit["train_wall_s"]}
    return {"rows": rows, "budget": args.budget, "minutes": args.minutes, "eval_images": args.eval_images,
            "eval_prompts": args.eval_prompts,
            "kl_images": args.kl_images, "target_score": target, "pretrained_score": pretrained,
            "target_from": ("--target-score" if args.target_score is not None
                            else f"each row's pre-trained + {args.target_gain}"),
            "threads": threads, "targets": targets, **memory}


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"


def _proxy(row: dict) -> str:
    """The trained-on reward's held-out mean before → after, where it differs from the score (a proxy reward), and
    the paired standard error of that gain where the run wrote the proxy's per-image scores."""
    first, last = row["curve"][0], row["curve"][-1]
    if first.get("proxy") is None or first["proxy"] == first["score"]:
        return "-"
    se = row.get("proxy_gain_paired_se")
    return f"{first['proxy']:.3g}→{last['proxy']:.3g}" + ("" if se is None else f" ±{se:.2g}")


def format_result(result: dict) -> str:
    header = (f"{'trainer':7s} {'lever':18s} {'value':>10s} {'samples':>7s} {'before':>7s} {'after':>7s} "
              f"{'gain':>8s} {'± se':>6s} {'paired':>6s} {'proxy (± paired)':>23s} {'KL drift':>9s} {'train s':>8s} {'samples→T':>9s} "
              f"{'s→T':>7s}")
    lines = [header]
    for r in result["rows"]:
        hit = r["to_target"] or {}
        lines.append(
            f"{r['trainer']:7s} {r['lever']:18s} {r['value']:>10s} {r['samples']:7d} {r['before']:7.4f} "
            f"{r['after']:7.4f} {r['gain']:+8.4f} {_fmt(r.get('gain_se'), '.3f', 6)} "
            f"{_fmt(r.get('gain_paired_se'), '.3f', 6)} "
            f"{_proxy(r):>23s} {_fmt(r['kl_drift'], '.4g', 9)} {r['train_wall_s']:8.1f} "
            f"{_fmt(hit.get('samples'), 'd', 9)} {_fmt(hit.get('train_wall_s'), '.1f', 7)}"
            + (f"  (= {r['same_as']})" if r.get("same_as") else ""))
    per_row = result["target_from"].startswith("each row")
    target = result["target_from"] if per_row else f"held-out score {result['target_score']:.4f} (--target-score)"
    lines.append("± se: the gain's standard error treating the two evaluations as independent; paired: from the "
                 "per-image differences of the same prompts and seeds (the test of whether these images got better)")
    lines.append(f"T = {target}; samples→T / s→T: "
                 "samples and training seconds (evaluations left out) of the first evaluated policy at or above T, "
                 "'-' = not reached")
    if result["rows"]:
        pipelines = ", ".join(dict.fromkeys(row["pipeline"] for row in result["rows"]))  # each once, in row order
        lines.append(f"pipeline: {pipelines}; {result['threads']} threads; "
                     f"peak RSS {result['peak_rss_mb']:.0f} MB")
    for trainer, t in result["targets"].items():
        verdict = "met" if t["met"] else "NOT met"
        when = f" (at {t['met_at_s']:.0f} s)" if t["met"] else ""
        lines.append(f"{trainer}: held-out gain {t['gain']:+.4f} in {t['train_wall_s']:.0f} s of training "
                     f"({t['wall_s']:.0f} s with evaluations); target >= +{t['target_gain']} within "
                     f"{t['target_seconds']:.0f} s: {verdict}{when}")
    return "\n".join(lines)
