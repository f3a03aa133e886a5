"""The `diffrl` command line.

Each verb is one function decorated with `@verb(name, help, args)`: the decorator registers its argparse
arguments and the function runs it. Adding a verb means writing one such function.

Bad input (a `UserError`, bad arguments, a missing file) prints one line on stderr and exits with code 2;
`--debug` shows the traceback instead. So does running out of memory (a size within the bounds that this machine
cannot hold): the line names the setting to lower and, for a run, the checkpoint to go on from. Nothing heavy (torch, diffusers) is imported until a verb needs it, so
`diffrl --help` is fast. Multi-process training goes through accelerate: `accelerate launch -m diffrl.cli run ...`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from diffrl import __version__, checks, files
from diffrl.bench import list_benches, run_bench
from diffrl.demo_loader import demo_module
from diffrl.embedded import EMBEDDED_MODELS, is_built, is_pipeline
from diffrl.errors import UserError
from diffrl.rundir import (
    checkpoint_step,
    latest_checkpoint,
    pipeline_of_run,
    run_config_of,
    sampling_size_of_run,
)
from diffrl.shipped_recipes import list_recipes
from diffrl.steering.bounds import MAX_IMAGES_PER_CALL, MAX_NUM_STEPS, MAX_ROWS_PER_CALL, check_at_most
from diffrl.steering.cli import add_steer_arguments, steer_cli
from samplers import SAMPLERS, get_sampler  # SAMPLERS: name -> "module:Class" (`--sampler`, `diffrl ls samplers`)

# Only modules that load none of YAML, numpy, huggingface_hub and torch are imported up here; the verbs import the
# others inside their functions, each saying why, so `diffrl --help` and a bad argument answer without them
# (tests/test_cli.py checks that importing this module loads none of diffrl.config, yaml, numpy and torch).

EXIT_USER_ERROR = 2

LIST_TOPICS = ("trainers", "rewards", "samplers", "recipes", "pipelines", "prompts", "pairs")


class _ArgumentError(UserError):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and becomes exit code 2 in `main`)."""

    def error(self, message):
        raise _ArgumentError(f"{self.prog}: error: {message} (see `{self.prog} --help`)")

    def add_argument(self, *flags, **kwargs):
        # no flag takes NaN, infinity or a negative count: plain float/int types get diffrl.checks' versions
        kwargs["type"] = {float: checks.finite, int: checks.non_negative}.get(kwargs.get("type"), kwargs.get("type"))
        if kwargs["type"] is None:
            del kwargs["type"]
        return super().add_argument(*flags, **kwargs)


def arg(*flags, **kwargs):
    """One `add_argument` call, written where a verb is declared."""
    return flags, kwargs


VERBS: dict[str, tuple[str, list | Callable, Callable]] = {}


def verb(name: str, help: str, args: list | Callable = ()):
    """Register `function(args) -> int | None` as the verb `name`.

    `args` is a list of `arg(...)` declarations, or a function `add_arguments(parser)` (for verbs whose options
    are declared next to their implementation in another module).
    """

    def register(function):
        VERBS[name] = (help, args if callable(args) else list(args), function)
        return function

    return register


# ---------------------------------------------------------------------------------------------------------------
# run / resume / validate
# ---------------------------------------------------------------------------------------------------------------

OVERRIDES = arg("overrides", nargs="*", metavar="key=value",
                help="config overrides, e.g. optim.learning_rate=1e-4 sample.batch_size=4 (values are YAML)")


def _world() -> tuple[int, int]:
    """(process index, number of processes) as set by `accelerate launch` / torchrun; (0, 1) otherwise."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@verb("run", "train: load a recipe, make a run dir, run the trainer", [
    arg("recipe", help="a recipe YAML file or a shipped recipe name (see `diffrl ls recipes`)"),
    OVERRIDES,
])
def cmd_run(args) -> int:
    from diffrl import config  # loads YAML: see the note on the imports at the top

    cfg = config.load_recipe(args.recipe, args.overrides)
    rank, world = _world()
    derived = config.derived_numbers(cfg, world)
    _check_references(cfg)
    module = config.trainer_module(cfg.trainer)
    run_dir, lock = _make_run_dir(cfg, Path(args.recipe).stem, derived, rank, world)
    with lock:
        if rank == 0:
            # status on stdout, so stderr holds an error alone (the trainer prints the derived numbers as it starts)
            print(f"run dir: {run_dir}", flush=True)
        return _train(module, cfg, run_dir, resume=False)


@verb("resume", "continue a run from its newest checkpoint", [
    arg("run_dir", help="a run dir made by `diffrl run` (holds config.yaml and checkpoints/)"),
])
def cmd_resume(args) -> int:
    from diffrl import config  # loads YAML

    run_dir = Path(args.run_dir)
    cfg = config.load_run_config(run_dir)
    _check_references(cfg)
    rank, world = _world()
    with _lock_for_all(run_dir, rank, world):  # one writer: a second resume (or a run still going) is one line
        found = latest_checkpoint(run_dir)
        # this run dir's own newest checkpoint, even if the run itself started from another run's checkpoint
        cfg.run.resume = "latest" if found else ""
        if rank == 0:
            # a run that stopped before its first checkpoint starts again from epoch 0 in its own run dir
            print(f"resuming {run_dir} from {found.name}" if found else
                  f"{run_dir} has no checkpoint yet: starting it again from epoch 0", flush=True)
        return _train(config.trainer_module(cfg.trainer), cfg, run_dir, resume=found is not None)


def _check_references(cfg) -> None:
    """What `run`, `resume` and `validate` check before a run dir exists, beyond the recipe's own values: what the
    config names (`diffrl.config_references.check_references`) and a D3PO label file's chains against the pipeline
    (`diffrl.pairs.labels.check_labels_fit_pipeline`: a layer above config)."""
    from diffrl.config_references import check_references  # imports diffrl.prompts, which loads numpy
    from diffrl.pairs.labels import check_labels_fit_pipeline  # loads YAML

    check_references(cfg)
    check_labels_fit_pipeline(cfg)


def _broadcast_error(error: str | None, world: int) -> str | None:
    """Process 0's error (or None) on every process, so all stop together on a check only process 0 makes."""
    if world > 1:
        from accelerate import PartialState
        from accelerate.utils import broadcast_object_list

        PartialState()
        error = broadcast_object_list([error], from_process=0)[0]
    return error


def _lock_for_all(run_dir: Path, rank: int, world: int):
    """Process 0 takes the run dir's writer lock (`files.lock_run_dir`); every process stops if it is held."""
    lock, error = contextlib.nullcontext(), None
    if rank == 0:
        try:
            lock = files.lock_run_dir(run_dir)
        except UserError as e:
            error = str(e)
    error = _broadcast_error(error, world)
    if error:
        raise UserError(error)
    return lock


def _make_run_dir(cfg, recipe_stem: str, derived: dict, rank: int, world: int):
    """Create the run dir, take its writer lock and write config.yaml on process 0 before any model loads; all
    processes get its path. Returns `(run_dir, lock)`: leaving `lock` (a context manager) releases the run dir."""
    from diffrl.training.setup import CONFIG_FILE, write_run_config  # loads numpy, YAML and PIL

    name = cfg.run.name or f"{cfg.trainer.rsplit('.', 1)[-1]}_{recipe_stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    error, lock = None, contextlib.nullcontext()
    if rank == 0:
        run_dir = Path(cfg.run.output_dir) / name

        def refuse_existing():
            if (run_dir / CONFIG_FILE).exists():
                files.check_run_dir_unlocked(run_dir)  # a run of it still going is named as such
                raise UserError(f"run dir {run_dir} already exists; continue it with `diffrl resume {run_dir}` or "
                                "start a new one with run.name=NEW_NAME")

        try:
            refuse_existing()
            cfg.run.name = name
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = files.lock_run_dir(run_dir)  # two runs of one name started together: the second stops here
            try:
                refuse_existing()  # made by a run that took the lock and ended since the first look
                write_run_config(run_dir, cfg, derived)
            except BaseException:
                lock.__exit__(None, None, None)  # releases it (a no-op where there is no lock)
                raise
        except OSError as e:
            error = f"cannot write run dir {run_dir}: {e.strerror or e}"
        except UserError as e:
            error = str(e)
    if world > 1:  # every process must use process 0's name (timestamps differ) and stop on its error
        from accelerate import PartialState
        from accelerate.utils import broadcast_object_list

        PartialState()
        name, error = broadcast_object_list([name, error], from_process=0)
        cfg.run.name = name
    if error:
        raise UserError(error)
    return Path(cfg.run.output_dir) / name, lock


def _train(module, cfg, run_dir: Path, resume: bool) -> int:
    """Train, then (process 0) print the run's summary: what happened, where its results are, what to run next.
    The epochs' metrics are in the run dir's metrics.jsonl, so they are not printed."""
    from diffrl.training.console import run_summary  # imports torch: only the verbs that train pay for it

    start = time.perf_counter()
    try:
        module.train(cfg, run_dir, resume=resume)
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        raise UserError(_run_out_of_memory(e, cfg, run_dir)) from e  # --debug shows where it ran out
    if _world()[0] == 0:
        print(run_summary(run_dir, cfg, wall_s=time.perf_counter() - start, resumed=resume), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# out of memory: a size the bounds allow (config.MAX_BATCH_SIZE, steering.bounds) that this machine cannot hold
# ---------------------------------------------------------------------------------------------------------------

_OUT_OF_MEMORY = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory",
                  "alloc_failed")  # CUDA / MPS, torch's CPU allocator, errno 12, cuBLAS / cuDNN workspaces


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` says the machine ran out of memory: Python's `MemoryError`, torch's `OutOfMemoryError` (CUDA), or
    a `RuntimeError` from an allocator (torch's CPU allocator, MPS, cuBLAS / cuDNN workspaces)."""
    if isinstance(e, MemoryError):
        return True
    if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    return isinstance(e, RuntimeError) and any(words in str(e).lower() for words in _OUT_OF_MEMORY)


def _what_ran_out(e: BaseException) -> str:
    """The first sentence of an out-of-memory error (torch's CUDA message runs to several lines of advice)."""
    import re

    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"^\[enforce fail at [^\]]*\] \w+\. ", "", text)  # c10's prefix: "[enforce fail at alloc_cpu.cpp:117] data. "
    for end in (". ", "; "):
        if end in text[:300]:
            text = text[: text.index(end, 0, 300)]
            break
    return text if len(text) <= 200 else text[:199] + "…"


def _run_out_of_memory(e: BaseException, cfg, run_dir: Path) -> str:
    """One line for a run that ran out of memory: the per-process batch sizes to lower, with their values now, and
    how to go on from what the run dir already holds (checkpoints are written atomically, so they are whole)."""
    import dataclasses

    sizes = [f"sample.batch_size (now {cfg.sample.batch_size}; sampling)",
             (f"sample.num_batches_per_epoch (now {cfg.sample.num_batches_per_epoch}; an epoch's samples are "
              "kept for training)")]
    train = {f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(cfg.train)} if cfg.train else {}
    sizes += [f"train.{k} (now {v})" for k, v in train.items() if k.endswith("batch_size")]
    memory = ("" if cfg.model.gradient_checkpointing else
              "; model.gradient_checkpointing=true trades time for memory")
    keep = (" (lower train.batch_size and raise optim.gradient_accumulation_steps to keep the optimizer's batch)"
            if "batch_size" in train else "")
    newest = latest_checkpoint(run_dir)
    if newest is None:
        after = f"{run_dir} has no checkpoint yet: start a new run with the smaller size"
    else:
        after = (f"{run_dir} keeps its checkpoints (newest {newest.name}): go on from it in a new run with "
                 f"run.resume={newest} and the smaller size")
    return (f"out of memory during the run ({_what_ran_out(e)}): lower {', '.join(sizes[:-1])} or {sizes[-1]}, "
            f"per process{keep}"
            f"{memory}; {after}")


# Of the verbs that do not train: what sets how much one call holds in memory.
_MEMORY_OPTIONS = {
    "sample": lambda a: f"lower --batch-size (now {a.batch_size})",
    "steer": lambda a: ("lower --rows-per-call (latent rows per model call), --prompts-per-call or the method's "
                        "sizes in --set (num_samples, num_particles, num_candidates)"),
    "pairs": lambda a: f"lower --batch-size (now {a.batch_size or 'sample.batch_size / 2'} pairs per batch)",
    "score": lambda a: f"score fewer images per call (now {len(a.images)})",
    "bench": lambda a: "lower the benchmark's batch sizes (see `diffrl bench NAME -h`)",
    "export": lambda a: "free memory (another process?) and export again",
}


def _out_of_memory(e: BaseException, args) -> str:
    option = _MEMORY_OPTIONS.get(getattr(args, "verb", None))
    return f"out of memory ({_what_ran_out(e)})" + (f": {option(args)}" if option else "")


@verb("validate", "check a recipe (types, keys, names it refers to) and print it resolved", [
    arg("recipe", help="a recipe YAML file or a shipped recipe name"),
    OVERRIDES,
    arg("--num-processes", type=int, default=None,
        help="processes to compute derived numbers for (defaults to WORLD_SIZE or 1)"),
])
def cmd_validate(args) -> int:
    from diffrl import config  # loads YAML

    cfg = config.load_recipe(args.recipe, args.overrides)
    world = args.num_processes if args.num_processes is not None else _world()[1]
    if world < 1:
        raise UserError(f"--num-processes must be >= 1, got {world}")
    derived = config.derived_numbers(cfg, world)
    _check_references(cfg)
    print(config.to_yaml(cfg, derived=derived), end="")
    print(f"# {args.recipe}: OK", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------------------------------------------


def _module_summary(module_path: str) -> str:
    """First docstring line of a module, read from its source without importing it."""
    try:
        spec = importlib.util.find_spec(module_path)
    except ModuleNotFoundError:
        return ""
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    return _summary(ast.get_docstring(ast.parse(Path(spec.origin).read_text())))


def _summary(doc: str | None, width: int = 100) -> str:
    """A docstring's first paragraph on one line, cut to `width` characters."""
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def _ls_trainers():
    from diffrl.config import trainer_table  # loads YAML

    return [(name, _module_summary(module)) for name, module in sorted(trainer_table().items())]


def _ls_rewards():
    from rewards.registry import get_reward_factory, list_rewards  # loads YAML (through diffrl.config)

    out = []
    for name in list_rewards():
        out.append((name, _summary(inspect.getdoc(get_reward_factory(name)))))
    return out


def _ls_samplers():
    out = []
    for name, target in SAMPLERS.items():
        module = target.partition(":")[0]
        if importlib.util.find_spec(module) is not None:
            out.append((name, f"{target}  {_module_summary(module)}".rstrip()))
    return out


def _ls_recipes():
    # builds its evidence tables (dataclasses) at import, about 9 ms of CPU that `diffrl --help` need not pay
    from diffrl.verification import LEGEND, MARKS_HEADER, recipe_marks

    rows = [(name, f"{recipe_marks(name)}  {path}") for name, path in list_recipes().items()]
    return [("", f"{MARKS_HEADER}  path"), *rows, ("", LEGEND)] if rows else []


def _ls_pipelines():
    out = []
    for name, (_, what, rebuild) in EMBEDDED_MODELS.items():
        if is_pipeline(name):
            out.append((name, f"{what} (embedded{'' if is_built(name) else f'; not built: {rebuild}'})"))
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir().repos
    except (CacheNotFound, OSError):  # no cache folder yet: nothing cached to list
        repos = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type == "model" and any(f.file_name == "model_index.json"
                                             for rev in repo.revisions for f in rev.files):
            out.append((repo.repo_id, f"hub pipeline in the local cache ({repo.size_on_disk_str})"))
    return out


def _ls_prompts():
    if importlib.util.find_spec("diffrl.shapes.prompts") is None:
        return []
    from diffrl.shapes.prompts import get_prompt_set, list_prompt_sets  # optional (checked above); loads numpy

    return [(f"shapes:{name}", f"{len(get_prompt_set(name))} prompts ({description})")
            for name, description in list_prompt_sets().items()]


def _ls_pairs():
    if importlib.util.find_spec("diffrl.pairs.shapes") is None:
        return []
    from diffrl.pairs.shapes import list_pair_sets  # optional (checked above); loads numpy

    return list(list_pair_sets().items())


@verb("ls", "list trainers, rewards, samplers, recipes, pipelines, prompt sets or preference-pair sets", [
    arg("topic", nargs="?", choices=LIST_TOPICS, help="what to list (default: everything)"),
])
def cmd_ls(args) -> int:
    for topic in [args.topic] if args.topic else LIST_TOPICS:
        rows = globals()[f"_ls_{topic}"]()
        if not args.topic:
            print(f"{topic}:")
        width = max((len(name) for name, _ in rows), default=0)
        for name, text in rows:
            print(f"{'  ' if not args.topic else ''}{name:<{width}}  {text}".rstrip())
        if not rows:
            print(f"{'  ' if not args.topic else ''}(none)")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# sample / score
# ---------------------------------------------------------------------------------------------------------------


REWARD_ARG = arg("--reward-arg", action="append", default=[], metavar="KEY=VALUE",
                 help="an option of the reward factory, e.g. model=tiny-shapes-clip (repeatable; one --reward only)")


def _read_prompts(args) -> list[str]:
    if bool(args.prompt) == bool(args.prompts):
        raise UserError("give either --prompt TEXT (repeatable) or --prompts FILE")
    if args.prompt:
        if not all(p.strip() for p in args.prompt):
            raise UserError("--prompt is empty")
        return list(args.prompt)
    if not Path(args.prompts).is_file():
        raise UserError(f"prompt file {args.prompts} does not exist")
    from diffrl.prompts import load_prompts  # loads numpy

    try:
        return load_prompts(args.prompts)
    except UserError as e:
        raise UserError(f"--prompts: {e}") from None


def _check_rewards(names: list[str], kwargs: dict) -> None:
    from rewards.registry import check_reward_options  # loads YAML (through diffrl.config)

    for name in names:
        check_reward_options(name, kwargs)


SIZE_FLAGS = {"height": "--height", "width": "--width", "num_frames": "--num-frames"}


def _size_of_run(args, run_config: dict) -> dict[str, int]:
    """--height, --width, --num-frames, each defaulting to the `--lora` run's sample.height / sample.width /
    sample.num_frames (the size it was trained at), else 0 = the pipeline's default."""
    return sampling_size_of_run(run_config, {key: getattr(args, key) for key in SIZE_FLAGS}, SIZE_FLAGS)


@verb("sample", "generate images (optionally with a trained LoRA) and score them", [
    arg("--pipeline", help="embedded name, local diffusers folder or hub id (default: the --lora run's model)"),
    arg("--lora", help="a run dir (newest checkpoint) or a LoRA folder saved with save_lora_weights"),
    arg("--prompt", action="append", help="a prompt (repeat for several)"),
    arg("--prompts", metavar="FILE", help="a text file with one prompt per line"),
    arg("-n", "--num-images", dest="n", type=checks.positive, default=1, help="images per prompt (default 1)"),
    arg("--out", required=True, help="folder for the PNGs and scores.json (created)"),
    arg("--reward", action="append", default=[], help="reward name or package.module:factory (repeatable)"),
    REWARD_ARG,
    arg("--steps", type=checks.positive, help="denoising steps (default: the sampler's; 50 for DDIM, 4 for LCM)"),
    arg("--guidance-scale", type=checks.number(0), help="CFG weight (default: the sampler's; 7.5 DDIM, 8.5 LCM)"),
    arg("--eta", type=checks.number(0), help="DDIM eta (default 0: deterministic; LCM takes only 1)"),
    arg("--seed", type=checks.seed, default=0, help="seed of the first image; image i uses seed + i (default 0)"),
    arg("--batch-size", type=checks.positive, default=4, help="images per batch (default 4)"),
    arg("--negative-prompt", default=None, help="negative prompt for classifier-free guidance"),
    arg("--sampler", choices=["auto", *SAMPLERS], default="auto", help="default: lcm for LCM pipelines, else ddim"),
    arg("--height", type=checks.positive, help="image height in pixels (default: the --lora run's sample.height, "
        "else the pipeline's)"),
    arg("--width", type=checks.positive, help="image width in pixels (default: the --lora run's sample.width, "
        "else the pipeline's)"),
    arg("--num-frames", dest="num_frames", type=checks.positive,
        help="video frames (default: the --lora run's sample.num_frames, else the pipeline's)"),
    arg("--device", type=checks.device_arg, default=None, help="torch device (default: cuda if available, else cpu)"),
    arg("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="weight dtype (default fp32)"),
    arg("--cads", metavar="SETTINGS", help="condition-annealed sampling: 'on' (defaults) or any of "
        "tau1=0.6,tau2=0.9,noise_scale=0.25,mix=1,seed=0 (samplers/cads.py)"),
])
def cmd_sample(args) -> int:
    prompts = _read_prompts(args)
    if args.lora and not Path(args.lora).exists():
        raise UserError(f"--lora {args.lora} does not exist")
    run_config = run_config_of(args.lora)
    pipeline = args.pipeline or pipeline_of_run(run_config)
    if not pipeline:
        raise UserError("--pipeline is required (it can be left out only when --lora is a run dir or a folder in one, "
                        "e.g. RUN_DIR/best)")
    size = _size_of_run(args, run_config)
    from diffrl.pipelines import (  # loads huggingface_hub
        check_sampling_size,
        find_trained_weights,
        load_pipeline,
        read_scheduler_config,
        resolve_pipeline_name,
        set_sampling_size,
    )

    resolve_pipeline_name(pipeline)  # a bad name fails here, before torch is imported
    check_sampling_size(pipeline, **size, keys=tuple(SIZE_FLAGS.values()))
    if args.steps:
        checks.check_num_steps("--steps", args.steps, read_scheduler_config(pipeline))
        check_at_most("--steps", args.steps, MAX_NUM_STEPS)
    check_at_most("--batch-size", args.batch_size, MAX_ROWS_PER_CALL)
    if len(prompts) * args.n > MAX_IMAGES_PER_CALL:
        raise UserError(f"{len(prompts)} prompt{'s' * (len(prompts) != 1)} × -n {args.n} = {len(prompts) * args.n} images, more than the bound "
                        f"of {MAX_IMAGES_PER_CALL} for one call; sample fewer (several calls with their own --out "
                        "and --seed)")
    checks.check_seeds("--seed", args.seed, len(prompts) * args.n)
    reward_kwargs = _reward_kwargs(args)
    _check_rewards(args.reward, reward_kwargs)
    lora_weights = find_trained_weights(args.lora)[1] if args.lora else None
    device = checks.check_device(args.device)
    cads = None
    if args.cads is not None:
        from samplers.cads import parse_cads  # imports torch: only when asked for

        cads = parse_cads(args.cads)
    out = files.fresh_out_dir(args.out)

    # once the checks above pass: torch, tqdm, the rewards (YAML through diffrl.config) and CADS' hook (torch)
    import torch
    from tqdm.auto import tqdm

    from rewards.combine import check_prompts
    from rewards.registry import get_reward
    from samplers import CADSHook

    pipe = load_pipeline(pipeline, dtype=args.dtype, device=device, lora=args.lora or None)
    set_sampling_size(pipe, **size)
    sampler = get_sampler(args.sampler, pipe)
    steps = args.steps or sampler.default_num_steps
    guidance = sampler.default_guidance_scale if args.guidance_scale is None else args.guidance_scale
    eta = sampler.default_eta if args.eta is None else args.eta
    rewards = [get_reward(name, **reward_kwargs) for name in args.reward]
    for reward in rewards:  # a prompt a reward cannot read fails now, not after the sampling
        check_prompts(reward, prompts)

    jobs = [(p, args.seed + i * args.n + k) for i, p in enumerate(prompts) for k in range(args.n)]
    records = []
    # disable=None: a bar on a terminal, none when stderr is a file or pipe
    with tqdm(total=len(jobs), desc="sampling", unit="img", disable=None) as bar:
        for start in range(0, len(jobs), args.batch_size):
            batch = jobs[start : start + args.batch_size]
            batch_prompts, seeds = [p for p, _ in batch], [s for _, s in batch]
            kwargs = {"negative_prompt": args.negative_prompt} if args.negative_prompt is not None else {}
            with torch.no_grad():
                hooks = [CADSHook(cads)] if cads is not None else []
                traj = sampler.sample(pipe, batch_prompts, num_steps=steps, guidance_scale=guidance, eta=eta,
                                      seeds=seeds, hooks=hooks, **kwargs)
                images = traj.images.float().clamp(0, 1)
                columns = {}  # reward name (and each per-image entry of its info) -> [B] values
                for reward in rewards:
                    result = reward(images, batch_prompts, None)
                    columns[reward.name] = result.scores.float().cpu().tolist()
                    columns.update({key: value.float().cpu().tolist() for key, value in result.info.items()
                                    if isinstance(value, torch.Tensor) and value.shape == (len(batch),)})
            for j, (prompt, seed) in enumerate(batch):
                file = f"{start + j:05d}.png"
                files.save_png(out / file, images[j])
                records.append({"file": file, "prompt": prompt, "seed": seed,
                                **{key: values[j] for key, values in columns.items()}})
            bar.update(len(batch))
    settings = {"pipeline": pipeline, "lora": args.lora, "lora_weights": str(lora_weights) if lora_weights else None,
                "lora_step": checkpoint_step(lora_weights), "sampler": sampler.name, "num_steps": steps,
                "guidance_scale": guidance, "eta": eta, "negative_prompt": args.negative_prompt,
                "height": int(images.shape[-2]), "width": int(images.shape[-1]),
                "rewards": args.reward, "reward_kwargs": reward_kwargs,
                "cads": dataclasses.asdict(cads) if cads is not None else None}
    files.write_json(out / "scores.json", records)
    files.write_json(out / "settings.json", settings)
    summary = ", ".join(f"{r.name} mean {sum(rec[r.name] for rec in records) / len(records):.4g}" for r in rewards)
    print(f"wrote {len(records)} images, scores.json and settings.json to {out}" + (f" ({summary})" * bool(summary)))
    return 0


def _reward_kwargs(args) -> dict:
    """`--reward-arg key=value` options (values read as YAML) for the reward factory."""
    from diffrl.config import parse_yaml  # loads YAML

    kwargs = {}
    for text in args.reward_arg:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--reward-arg '{text}' is not key=value (for example model=tiny-shapes-clip)")
        kwargs[key.strip()] = parse_yaml(value, f"--reward-arg '{text}'")
    if kwargs and len(args.reward) != 1:
        raise UserError("--reward-arg needs exactly one --reward (its options would apply to every reward)")
    return kwargs


@verb("score", "score image files with a reward", [
    arg("--reward", required=True, help="reward name (`diffrl ls rewards`) or package.module:factory"),
    REWARD_ARG,
    arg("--prompt", required=True, help="the prompt every image is scored against"),
    arg("--out", default="scores.json", help="where to write the scores (default: scores.json)"),
    arg("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)"),
])
def cmd_score(args) -> int:
    args.reward = [args.reward]
    kwargs = _reward_kwargs(args)
    missing = [path for path in args.images if not Path(path).is_file()]
    if missing:
        raise UserError(f"image {missing[0]} does not exist")
    if any(Path(image).resolve() == Path(args.out).resolve() for image in args.images):
        raise UserError(f"--out {args.out} is one of the images to score and would be overwritten; "
                        "give another file, e.g. --out scores.json")
    _check_rewards(args.reward, kwargs)
    from rewards.score_cli import score_images  # loads YAML (through the reward registry)

    files.check_out_file(args.out)

    score_images(args.reward[0], args.prompt, args.images, out_path=args.out, **kwargs)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# export (the logic lives in diffrl.export)
# ---------------------------------------------------------------------------------------------------------------


@verb("export", "export a run's weights as a folder plain diffusers loads, with a model card (README.md)", [
    arg("run_dir", help="a run dir made by `diffrl run`"),
    arg("--best", action="store_true",
        help="export best/ (the weights with the best held-out score) instead of the newest checkpoint"),
    arg("--out", required=True, help="the folder to write (new or empty)"),
    arg("--with-base", action="store_true",
        help="also copy the base pipeline into base/ (always done for an embedded base such as tiny-shapes)"),
    arg("--push-to-hub", metavar="REPO", help="then upload the folder to this hub repo (created if missing)"),
])
def cmd_export(args) -> int:
    from diffrl.export import export_run, push_to_hub  # loads torch and diffusers

    result = export_run(args.run_dir, args.out, best=args.best, with_base=args.with_base, repo=args.push_to_hub)
    weights = "LoRA" if result["kind"] == "lora" else f"full pipeline (trained {result['kind']})"
    base = ", base/ (the base pipeline)" if result["with_base"] else ""
    print(f"wrote {result['out']}: {weights}{base}, README.md (model card)")
    if args.push_to_hub:
        print(f"uploaded to {push_to_hub(result['out'], args.push_to_hub)}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# steer (options and logic live in diffrl.steering.cli)
# ---------------------------------------------------------------------------------------------------------------


@verb("steer", "steer sampling against a reward (best-of-N, FK, SVDD, reward guidance, ReNO)", add_steer_arguments)
def cmd_steer(args) -> int:
    return steer_cli(args)


# ---------------------------------------------------------------------------------------------------------------
# pairs (options and logic live in diffrl.pairs.labels, beside the label file format)
# ---------------------------------------------------------------------------------------------------------------


def _pairs_arguments(parser) -> None:
    from diffrl.pairs.labels import add_pairs_arguments  # loads YAML: only `diffrl --help` and `diffrl pairs` need it

    add_pairs_arguments(parser)


@verb("pairs", "preference pairs for D3PO: `pairs sample RECIPE --out DIR` draws pairs to label", _pairs_arguments)
def cmd_pairs(args) -> int:
    from diffrl.pairs.labels import pairs_cli  # loads YAML

    return pairs_cli(args)


# ---------------------------------------------------------------------------------------------------------------
# demo (the app lives in demo/; gradio is imported only here)
# ---------------------------------------------------------------------------------------------------------------


@verb("demo", "start the Gradio demo: generate, steer, compare, score, browse runs, label pairs", [
    arg("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 serves your network)"),
    arg("--port", type=checks.whole(1, high=65535), default=7860, help="port, 1 to 65535 (default 7860)"),
    arg("--share", action="store_true", help="also make a public gradio.live link (off unless asked)"),
    arg("--runs-dir", default="runs", help="where the Runs and Compare pages list run dirs (default runs)"),
    arg("--concurrency", type=checks.positive, default=1, help="model requests run at once; others queue (default 1)"),
    arg("--device", type=checks.device_arg, default=None, help="torch device (default: cuda if available, else cpu)"),
    arg("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="pipeline weights dtype (default fp32)"),
])
def cmd_demo(args) -> int:
    _check_bindable(args.host, args.port)
    demo_module("app").launch(host=args.host, port=args.port, share=args.share, device=args.device,
                              dtype=args.dtype, runs_root=args.runs_dir, concurrency=args.concurrency)
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Bind `host:port` once before gradio starts: gradio reports a host it cannot bind as a uvicorn log line plus a
    misleading 'Cannot find empty port' error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        raise UserError(f"cannot serve the demo on --host {host} --port {port}: {e.strerror or e}; use an address of "
                        "this machine (127.0.0.1, or 0.0.0.0 for every interface) and a free port") from None


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------


@verb("bench", "run a benchmark (`diffrl bench` lists them)", [
    arg("name", nargs="?", help="benchmark name"),
    arg("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see `diffrl bench NAME -h`)"),
])
def cmd_bench(args) -> int:
    if not args.name:
        benches = list_benches()
        width = max((len(n) for n in benches), default=0)
        for name, summary in benches.items():
            print(f"{name:<{width}}  {summary}".rstrip())
        if not benches:
            print("(no benchmarks installed)")
        return 0
    return run_bench(args.name, args.bench_args, parser_class=_Parser)


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks instead of one-line errors")
    parser = _Parser(prog="diffrl", description="Fine-tune and steer diffusion models against rewards.",
                     epilog="Run `diffrl VERB --help` for a verb's options.")
    parser.add_argument("--version", action="version", version=f"diffrl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    for name, (help, args, function) in VERBS.items():
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", parents=[debug])
        if callable(args):
            args(p)
        else:
            for flags, kwargs in args:
                p.add_argument(*flags, **kwargs)
        p.set_defaults(handler=function)
    return parser


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("diffrl", "samplers", "rewards"):
        log = logging.getLogger(name)
        if not log.handlers:
            log.addHandler(handler)
        log.setLevel(logging.INFO)


MAX_MESSAGE = 1000  # characters of an error line; a longer one (a 10k-character prompt quoted) is cut


def _quiet_deepspeed() -> None:
    """DeepSpeed logs which accelerator it picked ("Setting accelerator to CPU ...") to stdout the first time
    anything imports it (transformers does when it loads a model), into a command's output. Drop those records
    below ERROR; its other messages stay."""
    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.filename != "real_accelerator.py"

    logging.getLogger("DeepSpeed").addFilter(keep)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `diffrl` script. Returns the exit code (0 ok, 2 bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    args = None
    _quiet_deepspeed()
    try:
        args = build_parser().parse_args(argv)
        debug = args.debug
        _setup_logging()
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # the reader left (`diffrl ls | head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1
    except (UserError, OSError) as e:
        if debug:  # the whole traceback, and still the exit code of bad input
            import traceback

            traceback.print_exc()
            return EXIT_USER_ERROR
        if isinstance(e, UserError):
            message = " ".join(str(e).split())
        else:  # an OSError no code turned into a UserError: a missing file, a full or read-only disk
            message = " ".join((f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")).split())
        if len(message) > MAX_MESSAGE:
            message = f"{message[: MAX_MESSAGE - 40]}… ({len(message)} characters, cut)"
        print(message if isinstance(e, _ArgumentError) else f"diffrl: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("diffrl: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:  # a size within the bounds that this machine cannot hold
        if not is_out_of_memory(e):
            raise
        if debug:
            import traceback

            traceback.print_exc()
        else:
            print(f"diffrl: error: {_out_of_memory(e, args)}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
