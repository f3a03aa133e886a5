"""`diffrl steer`: steer a pipeline against a reward and write the images, scores.json and settings.json.

    diffrl steer --pipeline tiny-shapes --method fk --reward shapes_verifier --prompts shapes:heldout --out out/fk
    diffrl steer --recipe steer/tiny-shapes_verifier_fk --out out/fk --set num_particles=8
    diffrl steer --pipeline tiny-shapes-flow --method fk --reward shapes_verifier --prompts shapes:heldout --out o/f
    diffrl steer --recipe steer/tiny-shapes_verifier_fk --cads tau1=0.6,tau2=0.9 --out out/fk-cads

`add_steer_arguments(parser)` declares the options and `steer_cli(args)` runs them; the command-line module only
wires the verb. Flags override the recipe's values; `--set KEY=VALUE` sets one of the method's settings. A
flow-matching pipeline (SD3, FLUX class, e.g. tiny-shapes-flow) steers with the flow sampler's steps; `--eta` is then
its noise level a (0.7 by default). `--cads` (or the recipe's `cads:`) adds condition-annealed sampling to any method,
each particle with its own condition noise (`diffrl/steering/cads.py`); `--cads off` turns a recipe's off.

scores.json follows the shared per-image format of `diffrl sample` (file, prompt, seed, one key per reward), plus
the method and the evaluations spent on each image (`nfe`, `reward_evals`); settings.json holds the resolved
settings and the whole accounting (NFE, reward evaluations, time split).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diffrl import checks, files
from diffrl.errors import UserError
from diffrl.rundir import run_config_of, sampling_size_of_run
from diffrl.steering import method_config, resolve_reward, steer
from diffrl.steering.bounds import MAX_NUM_STEPS, check_at_most, check_call_rows
from samplers import SAMPLERS

METHOD_CHOICES = ("best-of-n", "fk", "svdd", "guidance", "reno")
SIZE_FLAGS = {"height": "--height", "width": "--width"}  # images only: steering takes no frame count


def add_steer_arguments(parser) -> None:
    """Add the options of `diffrl steer` to an `argparse.ArgumentParser`."""
    add = parser.add_argument
    add("--recipe", help="a steering recipe (YAML file or shipped name such as steer/tiny-shapes_verifier_fk)")
    add("--pipeline", help="embedded name (tiny-shapes, tiny-shapes-flow), local diffusers folder or hub id")
    add("--lora", help="a run dir (newest checkpoint) or a LoRA folder to load into the pipeline")
    add("--method", choices=METHOD_CHOICES, help="steering method")
    add("--reward", action="append", default=None,
        help="reward name or package.module:factory (repeatable: several make a weighted sum)")
    add("--reward-weight", action="append", type=checks.finite, default=None, metavar="W",
        help="weight of each --reward, in order (default 1 each)")
    add("--reward-arg", action="append", default=[], metavar="KEY=VALUE",
        help="an option of the reward factory, e.g. model=tiny-shapes-clip (repeatable; one --reward only)")
    add("--prompt", action="append", default=None, help="a prompt (repeatable)")
    add("--prompts", metavar="SOURCE", help="a text file (one prompt per line), shapes:SET or module:function")
    add("--num-prompts", type=checks.positive, default=None, help="use only the first N prompts")
    add("--out", required=True, help="folder for the PNGs, scores.json and settings.json (created)")
    add("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
        help="a setting of the method, e.g. num_particles=8 or lmbda=10 (repeatable; values are YAML)")
    add("--height", type=checks.positive, default=None,
        help="image height in pixels (default: the recipe's, else the --lora run's sample.height, else the pipeline's)")
    add("--width", type=checks.positive, default=None,
        help="image width in pixels (default: the recipe's, else the --lora run's sample.width, else the pipeline's)")
    add("--steps", type=checks.positive, default=None,
        help="denoising steps (default: 50 DDIM, 4 LCM, 28 flow; ReNO 1, or 4 on flow)")
    add("--guidance-scale", type=checks.number(0), default=None,
        help="CFG scale (default: 7.5 DDIM, 8.5 LCM, 7.0 flow)")
    add("--eta", type=checks.number(0), default=None,
        help="DDIM eta or the flow SDE's noise level (default 1 DDIM, 0.7 flow; FK and SVDD need eta > 0)")
    add("--sampler", choices=["auto", *SAMPLERS], default=None,
        help="default: flow for SD3/FLUX pipelines, lcm for LCM pipelines, else ddim")
    add("--negative-prompt", default=None, help="negative prompt for classifier-free guidance")
    add("--cads", metavar="SETTINGS", default=None,
        help="condition-annealed sampling in every model call: 'on' (defaults), 'off', or any of "
        "tau1=0.6,tau2=0.9,noise_scale=0.25,mix=1,seed=0 (as diffrl sample --cads)")
    add("--seed", type=checks.seed, default=None, help="seed of the first prompt batch; batch i uses seed + i (default 0)")
    add("--prompts-per-call", type=checks.positive, default=None, help="prompts steered together (default 4)")
    add("--rows-per-call", type=checks.positive, default=None,
        help="latent rows per model/reward call (default: all)")
    add("--device", type=checks.device_arg, default=None, help="torch device (default: cuda if available, else cpu)")
    add("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help="weights dtype (default fp32)")


def key_values(texts, flag: str) -> dict:
    """`KEY=VALUE` texts of a repeated option (`flag` names it in the one-line error) as a dict, values read as YAML."""
    # diffrl.config loads YAML, which `import diffrl.cli` (importing this module at its top) does not
    from diffrl.config import parse_yaml

    out = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} '{text}' is not KEY=VALUE")
        out[key.strip()] = parse_yaml(value, f"{flag} '{text}'")
    return out


def resolve_recipe(args):
    """The recipe (from `--recipe`, else empty) with every given flag on top, validated."""
    # imports samplers.cads, which loads torch
    from diffrl.steering.recipe import SteerRecipe, load_steer_recipe, recipe_from_dict

    recipe = load_steer_recipe(args.recipe) if args.recipe else SteerRecipe()
    data = dataclasses.asdict(recipe)
    for flag, key in (("pipeline", "pipeline"), ("lora", "lora"), ("method", "method"), ("dtype", "dtype"),
                      ("num_prompts", "num_prompts"), ("seed", "seed"), ("prompts_per_call", "prompts_per_call"),
                      ("rows_per_call", "rows_per_call"), ("cads", "cads")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    for flag, key in (("steps", "num_steps"), ("guidance_scale", "guidance_scale"), ("eta", "eta"),
                      ("sampler", "sampler"), ("negative_prompt", "negative_prompt")):
        if getattr(args, flag) is not None:
            data["sample"][key] = getattr(args, flag)
    if args.prompt and args.prompts:
        raise UserError("give either --prompt TEXT (repeatable) or --prompts SOURCE, not both")
    if args.prompt:
        data["prompts"] = list(args.prompt)
    elif args.prompts:
        data["prompts"] = args.prompts
    reward_kwargs = key_values(args.reward_arg, "--reward-arg")
    if args.reward:
        weights = args.reward_weight or [1.0] * len(args.reward)
        if len(weights) != len(args.reward):
            raise UserError(f"got {len(weights)} --reward-weight for {len(args.reward)} --reward; give one each")
        if reward_kwargs and len(args.reward) != 1:
            raise UserError("--reward-arg needs exactly one --reward (its options would apply to every reward)")
        if len(args.reward) == 1 and weights == [1.0]:
            data["reward"] = {"name": args.reward[0], "kwargs": reward_kwargs}
        else:
            data["reward"] = [{"name": n, "weight": w} for n, w in zip(args.reward, weights)]
    elif reward_kwargs or args.reward_weight:
        raise UserError("--reward-arg and --reward-weight need --reward")
    data["steer"] = {**data["steer"], **key_values(args.settings, "--set")}
    for key, flag in (("method", "--method"), ("pipeline", "--pipeline"), ("prompts", "--prompt/--prompts"),
                      ("reward", "--reward")):
        if data[key] in ("", [], None):
            raise UserError(f"no {key}: pass {flag} or a --recipe that sets it")
    # a run's weights are steered at the size the run trained at, as `diffrl sample --lora RUN` samples them:
    # --height/--width, else the recipe's sample.height/width, else the run's, else the pipeline's (0)
    given = {key: getattr(args, key) or data["sample"][key] or None for key in SIZE_FLAGS}
    data["sample"].update(sampling_size_of_run(run_config_of(data["lora"]), given, SIZE_FLAGS))
    return recipe_from_dict(data, source="the command line" if not args.recipe else f"{args.recipe} + flags")


def load_recipe_prompts(recipe) -> list[str]:
    from diffrl.prompts import load_prompts  # loads numpy

    prompts = load_prompts(recipe.prompts)
    return prompts[: recipe.num_prompts] if recipe.num_prompts else prompts


def run_recipe(recipe, out: Path, *, device=None, log=print) -> list[dict]:
    """Steer every prompt of a recipe in batches and write images, scores.json and settings.json into `out`."""
    # loaded when a recipe runs: pipelines (huggingface_hub), the recipe module (torch), the rewards (YAML)
    from diffrl.pipelines import load_pipeline
    from diffrl.steering.recipe import reward_spec_to_args
    from rewards.combine import check_prompts

    prompts = load_recipe_prompts(recipe)
    device = checks.check_device(device)
    pipe = load_pipeline(recipe.pipeline, dtype=recipe.dtype, device=device, lora=recipe.lora or None)
    reward_spec, weights = reward_spec_to_args(recipe.reward)
    reward = resolve_reward(reward_spec, weights)
    check_prompts(reward, prompts)  # a prompt the reward cannot read fails before any sampling
    s = recipe.sample
    common = {
        "num_steps": s.num_steps or None, "guidance_scale": s.guidance_scale, "eta": s.eta,
        "sampler": None if s.sampler == "auto" else s.sampler, "negative_prompt": s.negative_prompt or None,
        "height": s.height or None, "width": s.width or None, "batch_size": recipe.rows_per_call or None,
    }
    records, infos = [], []
    for batch_index, start in enumerate(range(0, len(prompts), recipe.prompts_per_call)):
        batch = prompts[start : start + recipe.prompts_per_call]
        seed = recipe.seed + batch_index
        images, scores, info = steer(pipe, batch, reward, recipe.method, seed=seed, cads=recipe.cads, **common,
                                     **recipe.steer)
        infos.append(info)
        for j, prompt in enumerate(batch):
            file = f"{start + j:05d}.png"
            files.save_png(out / file, images[j])
            records.append({
                "file": file, "prompt": prompt, "seed": seed, reward.name: float(scores[j]), "method": recipe.method,
                "nfe": info["nfe_per_prompt"], "reward_evals": info["reward_evals_per_prompt"],
            })
        log(f"steered {start + len(batch)}/{len(prompts)} prompts ({recipe.method}): "
            f"mean {reward.name} {float(scores.float().mean()):.4g}, nfe/prompt {info['nfe_per_prompt']:g}")
    files.write_json(out / "scores.json", records)
    settings = {
        "recipe": _plain(recipe), "accounting": _merge_accounting(infos), "per_call": [_jsonable(i) for i in infos]
    }
    files.write_json(out / "settings.json", settings)
    return records


def steer_cli(args) -> int:
    """Run `diffrl steer` from parsed arguments (see `add_steer_arguments`). Returns the exit code."""
    recipe = resolve_recipe(args)
    from diffrl.pipelines import check_sampling_size, read_scheduler_config, resolve_pipeline_name  # huggingface_hub

    resolve_pipeline_name(recipe.pipeline)  # a bad name fails before torch loads
    check_sampling_size(recipe.pipeline, height=recipe.sample.height, width=recipe.sample.width, num_frames=0,
                        keys=("--height (sample.height)", "--width (sample.width)", "num_frames"))
    if recipe.sample.num_steps:
        checks.check_num_steps("--steps (sample.num_steps)", recipe.sample.num_steps,
                               read_scheduler_config(recipe.pipeline))
        check_at_most("--steps (sample.num_steps)", recipe.sample.num_steps, MAX_NUM_STEPS)
    prompts = load_recipe_prompts(recipe)
    check_call_rows(recipe.method, method_config(recipe.method, **recipe.steer),
                    min(recipe.prompts_per_call, len(prompts)), fewer="a smaller --prompts-per-call")
    batches = -(-len(prompts) // recipe.prompts_per_call)
    checks.check_seeds("--seed (seed)", recipe.seed, batches)
    device = checks.check_device(args.device)
    out = files.fresh_out_dir(args.out)
    # progress on stdout: stderr holds only an error, as one line
    records = run_recipe(recipe, out, device=device, log=lambda text: print(text, flush=True))
    key = next(k for k in records[0] if k not in ("file", "prompt", "seed", "method", "nfe", "reward_evals"))
    mean = sum(r[key] for r in records) / len(records)
    print(f"wrote {len(records)} images, scores.json and settings.json to {out} ({key} mean {mean:.4g})")
    return 0


def _plain(recipe) -> dict:
    import dataclasses

    return dataclasses.asdict(recipe)


def _jsonable(info: dict) -> dict:
    out = {}
    for key, value in info.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        out[key] = value
    return out


def _merge_accounting(infos: list[dict]) -> dict:
    """Totals over the calls of one run: evaluations and seconds add up; per-prompt numbers are averaged."""
    totals = {k: sum(i[k] for i in infos) for k in ("nfe", "nfe_grad", "reward_evals", "reward_grad_evals",
                                                    "backward_passes", "num_prompts", "wall_s", "model_s",
                                                    "decode_s", "reward_s", "backward_s", "overhead_s", "step_s",
                                                    "method_s")}
    prompts = max(totals["num_prompts"], 1)
    totals["nfe_per_prompt"] = totals["nfe"] / prompts
    totals["reward_evals_per_prompt"] = totals["reward_evals"] / prompts
    totals["overhead_frac"] = totals["overhead_s"] / totals["wall_s"] if totals["wall_s"] > 0 else 0.0
    return totals
