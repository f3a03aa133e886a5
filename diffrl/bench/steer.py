"""Steering: mean reward vs model evaluations (NFE) for each method at matched budgets, with wall time.

For every method and budget k (default 1, 2, 4, 8) the held-out prompts are steered with the same seeds, and the
table reports per method and k: NFE and reward evaluations per prompt, the steered reward, the evaluation reward
(the ShapesWorld verifier by default; gradient methods steer on a differentiable reward and are judged by it too),
wall time and the overhead outside model, decode, reward and backward calls (split into the sampler's own step
math, which plain sampling pays too, and the method's own work). Budgets: best-of-n draws k samples, FK runs k
particles, SVDD draws k candidates per step, guidance runs k chains guided over the second half of the steps and
keeps the best, ReNO runs `--reno-iterations-per-k`·k generations of its one/few-step model — by default as many as
match the others' k·T model evaluations per prompt (k·50 one-step iterations at 50 DDIM steps; k = 1 is the paper's
50).

NFE counts one per latent row and model call; a classifier-free-guidance pair counts once, so a DDIM evaluation
with CFG costs two UNet rows where the LCM's w-embedded evaluation costs one.

Targets (checked and printed): FK with k = 4 gains ≥ 0.1 evaluation reward over k = 1; every method's overhead
(all of it, sampler steps included) is ≤ 10% of its wall time.
"""

from __future__ import annotations

import sys
import time

import torch

from diffrl.checks import check_device, positive
from diffrl.config import parse_yaml
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.pipelines import load_pipeline
from diffrl.prompts import load_prompts
from diffrl.steering import METHODS, steer
from rewards import get_reward

VALUE_METHODS = ("best-of-n", "fk", "svdd")
GRAD_METHODS = ("guidance", "reno")
TARGET_FK_GAIN = 0.1
TARGET_OVERHEAD = 0.10


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--pipeline", default="tiny-shapes", help="pipeline for best-of-n, fk, svdd, guidance (default tiny-shapes)")
    add("--lcm-pipeline", default="tiny-shapes-lcm", help="one/few-step pipeline for reno (default tiny-shapes-lcm)")
    add("--reward", default="shapes_verifier", help="reward the value methods steer on (default shapes_verifier)")
    add("--reward-arg", action="append", default=[], metavar="KEY=VALUE", help="option of --reward's factory")
    add("--grad-reward", default="clip_score", help="differentiable reward for guidance and reno (default clip_score)")
    add("--grad-reward-arg", action="append", default=None, metavar="KEY=VALUE",
        help="option of --grad-reward's factory (default: model=tiny-shapes-clip device=--device)")
    add("--eval-reward", default=None, help="reward every method is judged by (default: --reward)")
    add("--eval-reward-arg", action="append", default=[], metavar="KEY=VALUE", help="option of --eval-reward")
    add("--prompts", default="shapes:heldout", help="prompt source (default shapes:heldout)")
    add("--num-prompts", type=int, default=32, help="first N prompts (default 32; 0 = all)")
    add("--methods", default=",".join(VALUE_METHODS + GRAD_METHODS), help="comma-separated methods")
    add("--budgets", default="1,2,4,8", help="comma-separated budgets k (default 1,2,4,8)")
    add("--steps", type=positive, default=50, help="DDIM steps (default 50)")
    add("--guidance-scale", type=float, default=5.0, help="CFG scale (default 5)")
    add("--lcm-steps", type=int, default=1, help="LCM steps per ReNO generation (default 1)")
    add("--lcm-guidance-scale", type=float, default=5.0, help="LCM w-embedding scale (default 5)")
    add("--reno-iterations-per-k", type=int, default=None,
        help="ReNO iterations per unit of budget (default: steps / lcm-steps, the others' NFE per unit)")
    add("--guidance-scale-grad", type=float, default=1.0, help="guidance strength γ (default 1)")
    add("--guidance-start", type=int, default=None,
        help="first guided step index (default: steps / 2; guiding the noisiest steps through a blurry x̂0 mostly "
             "degrades the samples)")
    add("--lmbda", type=float, default=10.0, help="FK λ (default 10)")
    add("--fk-interval", type=int, default=10, help="FK scoring interval in steps (default 10)")
    add("--prompts-per-call", type=int, default=8, help="prompts steered together (default 8)")
    add("--rows-per-call", type=int, default=0, help="rows per UNet/reward call (default 0 = all)")
    add("--seed", type=int, default=0, help="seed of the first prompt batch (default 0)")
    add("--device", default=None, help="torch device (default cuda if available)")
    add("--out", default=None, help="write the results as JSON here")


def _kwargs(texts) -> dict:
    out = {}
    for text in texts or []:
        key, sep, value = text.partition("=")
        if not sep:
            raise UserError(f"'{text}' is not KEY=VALUE")
        out[key.strip()] = parse_yaml(value, text)
    return out


def method_settings(method: str, k: int, args) -> dict:
    """The method's settings at budget k (see the module docstring)."""
    if method == "best-of-n":
        return {"num_samples": k}
    if method == "fk":
        return {"num_particles": k, "lmbda": args.lmbda, "interval": args.fk_interval, "start": args.fk_interval}
    if method == "svdd":
        return {"num_candidates": k}
    if method == "guidance":
        start = args.steps // 2 if args.guidance_start is None else args.guidance_start
        return {"num_samples": k, "scale": args.guidance_scale_grad, "start": start}
    if method == "reno":
        return {"iterations": reno_iterations_per_k(args) * k}
    raise ValueError(method)


def reno_iterations_per_k(args) -> int:
    """ReNO generations per unit of budget: given, or matched to the T model evaluations a DDIM chain spends."""
    if args.reno_iterations_per_k is not None:
        return args.reno_iterations_per_k
    return max(args.steps // max(args.lcm_steps, 1), 1)


def steer_bench(args, log=print) -> dict:
    """Run the benchmark; returns `{"rows": [...], "targets": {...}}` (one row per method and budget)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    prompts = load_prompts(args.prompts)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    device = check_device(args.device)

    reward = get_reward(args.reward, **_kwargs(args.reward_arg))
    # the embedded CLIP by default, on the pipelines' device (a reward would otherwise pick CUDA whenever it exists)
    grad_kwargs = (_kwargs(args.grad_reward_arg) if args.grad_reward_arg is not None
                   else {"model": "tiny-shapes-clip", "device": device})
    grad_reward = get_reward(args.grad_reward, **grad_kwargs) if set(methods) & set(GRAD_METHODS) else None
    eval_reward = get_reward(args.eval_reward, **_kwargs(args.eval_reward_arg)) if args.eval_reward else reward
    pipe = load_pipeline(args.pipeline, device=device) if set(methods) - {"reno"} else None
    lcm = load_pipeline(args.lcm_pipeline, device=device) if "reno" in methods else None

    rows = []
    for method in methods:
        for k in budgets:
            steered, evaluated, infos = [], [], []
            for batch_index, start in enumerate(range(0, len(prompts), args.prompts_per_call)):
                batch = prompts[start : start + args.prompts_per_call]
                common = {"seed": args.seed + batch_index, "batch_size": args.rows_per_call or None}
                if method == "reno":
                    common.update(num_steps=args.lcm_steps, guidance_scale=args.lcm_guidance_scale)
                else:
                    # η: the steering process's default (DDIM 1.0; a flow model's SDE noise level 0.7)
                    common.update(num_steps=args.steps, guidance_scale=args.guidance_scale)
                used = grad_reward if method in GRAD_METHODS else reward
                images, scores, info = steer(lcm if method == "reno" else pipe, batch, used, method,
                                             **common, **method_settings(method, k, args))
                with torch.no_grad():
                    judged = eval_reward(images, batch, None).scores if eval_reward is not used else scores
                steered += scores.float().cpu().tolist()
                evaluated += judged.float().cpu().tolist()
                infos.append(info)
            wall = sum(i["wall_s"] for i in infos)
            overhead = sum(i["overhead_s"] for i in infos)
            row = {
                "method": method, "k": k, "steer_reward": used.name, "eval_reward": eval_reward.name,
                "eta": infos[0].get("eta"),
                "nfe_per_prompt": sum(i["nfe"] for i in infos) / len(prompts),
                "reward_evals_per_prompt": sum(i["reward_evals"] for i in infos) / len(prompts),
                "steered_mean": sum(steered) / len(steered), "eval_mean": sum(evaluated) / len(evaluated),
                "wall_s": wall, "model_s": sum(i["model_s"] for i in infos),
                "reward_s": sum(i["reward_s"] + i["decode_s"] for i in infos),
                "backward_s": sum(i["backward_s"] for i in infos), "overhead_s": overhead,
                "step_s": sum(i["step_s"] for i in infos),
                "overhead_frac": overhead / wall if wall > 0 else 0.0,
                "method_frac": sum(i["method_s"] for i in infos) / wall if wall > 0 else 0.0,
            }
            rows.append(row)
            log(_format_row(row))

    targets = {}
    fk = {r["k"]: r["eval_mean"] for r in rows if r["method"] == "fk"}
    if 1 in fk and 4 in fk:
        gain = fk[4] - fk[1]
        targets["fk_k4_gain_over_k1"] = {"value": gain, "target": TARGET_FK_GAIN, "met": gain >= TARGET_FK_GAIN}
    worst = max(rows, key=lambda r: r["overhead_frac"]) if rows else None
    if worst is not None:
        targets["max_overhead_frac"] = {
            "value": worst["overhead_frac"], "where": f"{worst['method']} k={worst['k']}",
            "target": TARGET_OVERHEAD, "met": worst["overhead_frac"] <= TARGET_OVERHEAD,
        }
    settings = {key: value for key, value in vars(args).items() if key != "func"}
    return {"rows": rows, "targets": targets, "settings": settings, "num_prompts": len(prompts), "device": device}


HEADER = (f"{'method':<10} {'k':>2} {'NFE/prompt':>10} {'rew.ev/pr':>9} {'steered':>8} {'eval':>7} {'wall s':>8} "
          f"{'ovh %':>6} {'meth %':>6}")


def _format_row(r: dict) -> str:
    return (f"{r['method']:<10} {r['k']:>2} {r['nfe_per_prompt']:>10.1f} {r['reward_evals_per_prompt']:>9.1f} "
            f"{r['steered_mean']:>8.4f} {r['eval_mean']:>7.4f} {r['wall_s']:>8.2f} {100 * r['overhead_frac']:>6.1f} "
            f"{100 * r['method_frac']:>6.1f}")


def run_steer_bench(args) -> int:
    """`diffrl bench steer`: print the table and the targets; write JSON with `--out`. Exit code 0."""
    start = time.perf_counter()
    print(HEADER, file=sys.stderr)
    result = steer_bench(args, log=lambda line: print(line, file=sys.stderr))
    print("\n" + HEADER)
    for row in result["rows"]:
        print(_format_row(row))
    for name, target in result["targets"].items():
        where = f" ({target['where']})" if "where" in target else ""
        verdict = "met" if target["met"] else "NOT met"
        print(f"{name}: {target['value']:.4f}{where}, target {target['target']}: {verdict}")
    print(f"{result['num_prompts']} prompts on {result['device']}, {time.perf_counter() - start:.1f} s in total")
    if args.out:
        write_json(args.out, result)
    return 0
