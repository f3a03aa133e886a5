"""The run configuration: typed groups, strict loading of YAML recipes and `key=value` overrides, range checks,
derived numbers, the run dir's `config.yaml`, and checks of what a config names.

A recipe is a YAML file with one section per group::

    trainer:   ddpo                                   # `diffrl ls trainers`, or a module path "my_pkg.my_trainer"
    run:       {name: "", output_dir: runs, seed: 0, num_epochs: 100, ...}
    model:     {pipeline: tiny-shapes, mixed_precision: "no", lora: {rank: 4, ...}, ...}
    sample:    {num_steps: 50, guidance_scale: 5.0, eta: 1.0, batch_size: 8, num_batches_per_epoch: 4, ...}
    reward:    {name: shapes_verifier, kwargs: {}}   # or components: [{name, weight, kwargs}, ...]
    prompts:   {source: "shapes:train"}
    log:       {tracker: tensorboard, image_every: 1}
    optim:     {learning_rate: 1e-4, ...}            # AdamW, LR schedule, clipping, accumulation, EMA
    advantage: {mode: per_prompt, ...}               # policy-gradient trainers only
    train:     {...}                                 # the trainer's own `TrainConfig` (algorithm-only fields)

The trainer module (`diffrl.trainers`, which states its contract) owns four things here: the `train` group's
dataclass, the defaults of the shared `optim` and `advantage` groups (its reference implementation's values; a
trainer without advantages has no `advantage` group), `check(cfg)`, its cross-field checks, and `derived(cfg, n)`, its
derived numbers. Config sits below the trainers in the layers and never imports them: `diffrl.trainers` hands the
name -> module lookup down (`diffrl.trainer_lookup`) when it is imported, which `import diffrl` does first.

`load_recipe` / `config_from_dict` load strictly: an unknown key, a value of the wrong type or a missing required
value is a `UserError` naming the key with its group path (`sample.num_stesp`) and, for unknown keys, the closest
valid one; a key that moved (`train.learning_rate` -> `optim.learning_rate`) names its new place. Nothing is coerced
except an int where a float is expected (and a command-line value where text is expected). Then `check_values`
applies the ranges in `VALUE_RANGES` and the rules `diffrl.checks` applies to every number, and the trainer's
`check(cfg)` runs, so `diffrl validate` reports everything `diffrl run` would before a run dir exists.
Whether the pipeline, rewards and prompts a config names exist, and whether the sampling size suits the pipeline, is
checked a layer above, beside what those checks look up (`diffrl.config_references.check_references`).

The trainer never changes a config value. Numbers that follow from the config and the process count (samples per
epoch, and the trainer's global batch and optimizer steps per epoch) come from `derived_numbers`; they are printed
at start and saved with the package versions beside the resolved config in the run dir's `config.yaml` (`to_yaml`;
`load_run_config` reads it back).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from diffrl import trainer_lookup
from diffrl.checks import check_config_numbers, check_number
from diffrl.errors import UserError
from diffrl.files import read_text
from diffrl.shipped_recipes import find_recipe

REQUIRED = "???"  # marks a required str field; a config that still holds it after loading is an error

# ---------------------------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunGroup:
    name: str = ""  # run dir name under output_dir; "" = <trainer>_<recipe>_<YYYYmmdd-HHMMSS>
    output_dir: str = "runs"  # folder that holds run dirs (relative to the working directory)
    seed: int = 0  # global seed; process i seeds with seed + i where it needs different noise
    num_epochs: int = 100  # epochs (one epoch = sample, score, train) to run in total, counted from epoch 0
    save_every: int = 10  # epochs between checkpoints; 0 = only at the end of the run
    eval_every: int = 0  # epochs between evaluations on prompts.eval_source (gold reward if set); 0 = never
    # also evaluate at the first epoch after every this many minutes of training (evaluations left out): spacing by
    # the clock, for trainers whose epochs differ in cost; 0 = off
    eval_every_minutes: float = 0.0
    # reuse the base model's epoch-0 evaluation from an earlier run with the same weights, settings, rewards and
    # software (~/.cache/diffrl/evals; diffrl.training.eval_cache says what the key covers); false = always sample
    eval_cache: bool = True
    resume: str = ""  # "" = start fresh; "latest" = the run dir's newest checkpoint; or a checkpoints/step-N path
    keep_checkpoints: int = 0  # newest checkpoints kept in checkpoints/; 0 = keep all
    max_nan_steps: int = 3  # consecutive optimizer steps with a non-finite loss/gradient that stop the run
    # at every evaluation, export the weights to best/ when the held-out score (the gold reward's, else the training
    # reward's) is the best so far; epoch 0 is the pre-trained model, so best/ is never worse than where training
    # started (load it with `diffrl sample --lora RUN_DIR/best`)
    keep_best: bool = False
    # end the run before an epoch that would take its training past this many minutes of wall-clock (evaluations
    # left out; judged by the last epoch's cost): the last epoch run is checkpointed and evaluated as the end;
    # 0 = no limit (run.num_epochs decides)
    max_train_minutes: float = 0.0


@dataclass
class LoraGroup:
    rank: int = 4  # LoRA rank r (dimension of the low-rank update)
    alpha: float = 4.0  # LoRA scaling numerator: the update is scaled by alpha / rank
    target_modules: list[str] = field(default_factory=lambda: ["to_k", "to_q", "to_v", "to_out.0"])  # UNet modules


@dataclass
class ModelGroup:
    pipeline: str = REQUIRED  # embedded name (tiny-shapes, tiny-shapes-lcm), local diffusers folder, or hub id
    revision: str = ""  # hub revision (branch, tag or commit) for a hub id; "" = the default branch
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"  # dtype of frozen weights and autocast; "no" = fp32
    # dtype of every weight and of the step math when mixed_precision is "no": float64 gives numbers that do not
    # depend on which CPU kernels (ISA, threads) computed them (tests/trainers/test_golden_weights.py)
    dtype: Literal["float32", "float64"] = "float32"
    full_finetune: bool = False  # train every UNet weight instead of a LoRA adapter (lora group then unused)
    lora: LoraGroup = field(default_factory=LoraGroup)  # the adapter trained when full_finetune is false
    gradient_checkpointing: bool = False  # recompute UNet activations in backward: less memory, ~30% slower
    allow_tf32: bool = True  # TF32 matmuls on Ampere+ GPUs (no effect on CPU)
    enable_xformers: bool = False  # xformers memory-efficient attention (CUDA only; needs the xformers extra)
    # PyTorch's cuDNN attention kernel (an SDPA backend); off by default because its backward crashed FLUX.1-dev
    # training with an illegal memory access (torch 2.11+cu130 on an H200) where the flash/efficient kernels ran
    cudnn_attention: bool = False
    # torch.compile the denoiser (`nn.Module.compile`, after the LoRA is attached): fewer Python and kernel-launch
    # costs per call, a one-off compile at each new call shape (a first epoch of 41-175 s on tiny-shapes on one CPU
    # core; needs a C++ compiler on a CPU). Its no-grad calls (the rollout) run in grad mode without keeping the
    # graph (`diffrl.models.base.run_denoiser`), so they use the training pass's graph and reproduce its outputs
    # exactly. Off by default: the compile is a large share of a 10-minute run
    compile: bool = False


@dataclass
class SampleGroup:
    num_steps: int = 50  # denoising steps per trajectory (T)
    guidance_scale: float = 5.0  # classifier-free guidance weight w; <= 1 disables guidance
    # DDIM eta: 0 = deterministic, 1 = DDPM-like noise (the RL step policy needs eta > 0); for the flow samplers
    # the noise level a (0 = the ODE, Flow-GRPO samples with 0.7)
    eta: float = 1.0
    batch_size: int = 8  # images per sampling batch, per process
    num_batches_per_epoch: int = 4  # sampling batches per epoch, per process
    negative_prompt: str = ""  # negative prompt for classifier-free guidance ("" = unconditional embedding)
    # image size in pixels of every image a run samples (rollouts, evaluation, grids); 0 = the model's default (the
    # folder's `_diffrl_height` / `_diffrl_width` in model_index.json, else the pipeline's sample size); a multiple
    # of what the model family needs (its VAE factor × patch size), checked before the run dir is made
    height: int = 0
    width: int = 0
    num_frames: int = 0  # video frames per sample (Wan: 4·k + 1); 0 = the model's default; image models take 0 only
    # "auto" = flow for SD3/FLUX-class pipelines, lcm for LatentConsistencyModelPipeline, else ddim; lcm_rlcm = lcm at
    # the timesteps RLCM's reference code picks (samplers.lcm.rlcm_timesteps)
    sampler: Literal["auto", "ddim", "lcm", "lcm_rlcm", "flow", "flow_cps"] = "auto"
    eval_num_steps: int = 0  # denoising steps for evaluation images; 0 = same as num_steps
    eval_batch_size: int = 0  # images per evaluation sampling batch, per process; 0 = batch_size
    # size of the held-out evaluation images only (rollouts, training grids and pairs keep height/width/num_frames);
    # each 0 = the training size's; checked against the model family like height/width/num_frames
    eval_height: int = 0
    eval_width: int = 0
    eval_num_frames: int = 0
    eval_num_images: int = 16  # evaluation images per evaluation, global (split across processes)
    # policy-gradient trainers recompute each rollout step's log-prob under the weights that sampled it before the
    # first update of an epoch; warn when it differs from the rollout's by more than this (nats per latent dim)
    logprob_check_atol: float = 1e-5


@dataclass
class OptimGroup:
    """AdamW, its LR schedule, gradient clipping, accumulation and EMA: the same keys for every trainer. A trainer
    module's `OPTIM_DEFAULTS` replaces these class defaults with its reference implementation's values."""

    learning_rate: float = 1e-4  # AdamW step size; the same on every process, not scaled by their number
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.999  # AdamW β2
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_epsilon: float = 1e-8  # AdamW ε
    lr_scheduler: str = "constant"  # diffusers.optimization.get_scheduler name (constant, linear, cosine, ...)
    lr_warmup_steps: int = 0  # optimizer steps of LR warm-up
    max_grad_norm: float = 1.0  # clip the global gradient norm (after the cross-process mean); <= 0: no clipping
    gradient_accumulation_steps: int = 1  # micro-batches (train.batch_size each, per process) per optimizer step
    use_ema: bool = False  # keep an EMA of the trainable weights (used for evaluation and exported weights)
    ema_decay: float = 0.9999  # EMA decay per optimizer step


@dataclass
class AdvantageGroup:
    """How a policy-gradient trainer turns rewards into advantages; trainers without advantages have no such group.
    A trainer module's `ADVANTAGE_DEFAULTS` replaces these class defaults."""

    # per_prompt: running per-prompt mean/std (batch stats below stat_min_count); group: k samples per prompt,
    # GRPO-style; batch: whole-epoch mean/std; none: raw reward
    mode: Literal["per_prompt", "group", "batch", "none"] = "per_prompt"
    clip_max: float = 5.0  # clip advantages to [-clip_max, clip_max]; <= 0: no clipping
    stat_buffer_size: int = 16  # per_prompt: rewards kept per prompt (global, all processes' samples)
    stat_min_count: int = 16  # per_prompt: rewards a prompt needs before its own statistics are used
    group_size: int = 1  # samples per prompt drawn together in a sampling batch (must divide sample.batch_size)
    group_std: Literal["group", "global", "none"] = "group"  # group mode: divide by group std / epoch std / 1
    # group mode: a group is "draw" = the k samples drawn together for one prompt, or "prompt" = every sample of
    # the epoch with the same prompt text (all processes; flow_grpo's stat tracker, cleared each epoch)
    group_by: Literal["draw", "prompt"] = "draw"
    # ε added to every std (reward units), so equal rewards give advantage 0; flow_grpo's stat tracker adds 1e-4,
    # visible when a group's std is small (a std of 0.005: advantages 2 % smaller than with 1e-6)
    std_eps: float = 1e-6
    # a group's samples start from the same x_T (DanceGRPO): the start noise decides much of a layout, so with it
    # shared, differences within a group come from the step noise the policy gradient credits
    shared_start_noise: bool = False


@dataclass
class RewardComponent:
    name: str = REQUIRED  # reward registry name (`diffrl ls rewards`) or "package.module:factory"
    weight: float = 1.0  # multiplier of this reward in the weighted sum (unitless)
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the reward factory


@dataclass
class RewardGroup:
    name: str = ""  # reward registry name or "package.module:factory"; leave "" when using `components`
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the reward factory
    components: list[RewardComponent] = field(default_factory=list)  # weighted sum of rewards instead of `name`
    gold: str = ""  # held-out reward scored at evaluation only (never trained on), to watch for reward hacking
    gold_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the gold reward factory


@dataclass
class PromptsGroup:
    # A list of prompts, a text file with one prompt per line, a ShapesWorld prompt set ("shapes:train"),
    # or "package.module:function" returning a list of prompts.
    source: str | list[str] = REQUIRED
    eval_source: str | list[str] = ""  # prompts for evaluation images, same forms; "" = same as source


@dataclass
class LogGroup:
    tracker: Literal["tensorboard", "wandb", "none"] = "tensorboard"  # where scalars go besides metrics.jsonl
    project: str = "diffrl"  # wandb project name (wandb only)
    image_every: int = 1  # epochs between sample grids written to images/epoch-N.png; 0 = never
    grid_images: int = 16  # images in each grid, global (taken from the first samples of the epoch)


@dataclass
class RunConfig:
    trainer: str = REQUIRED  # trainer name (`diffrl ls trainers`) or a module path "my_pkg.my_trainer"
    run: RunGroup = field(default_factory=RunGroup)
    model: ModelGroup = field(default_factory=ModelGroup)
    sample: SampleGroup = field(default_factory=SampleGroup)
    reward: RewardGroup = field(default_factory=RewardGroup)
    prompts: PromptsGroup = field(default_factory=PromptsGroup)
    log: LogGroup = field(default_factory=LogGroup)
    optim: OptimGroup = field(default_factory=OptimGroup)
    advantage: AdvantageGroup | None = None  # None for trainers without advantages (no ADVANTAGE_DEFAULTS)
    train: Any = None  # instance of the trainer module's TrainConfig dataclass


GROUPS = ("trainer", "run", "model", "sample", "reward", "prompts", "log", "optim", "advantage", "train")

# Keys that moved when the trainers were rebuilt on one run context: an old recipe gets a one-line error naming
# the new place (never a silent translation, so a recipe always says what it runs).
_OPTIM_KEYS = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler", "lr_warmup_steps",
               "max_grad_norm", "gradient_accumulation_steps", "use_ema", "ema_decay")
MOVED_KEYS = {
    **{f"train.{k}": f"optim.{k}" for k in _OPTIM_KEYS},
    "train.adam_weight_decay": "optim.weight_decay",
    "train.keep_checkpoints": "run.keep_checkpoints",
    "train.max_nan_steps": "run.max_nan_steps",
    "train.logprob_check_atol": "sample.logprob_check_atol",
    "train.advantage": "advantage.mode",
    "train.adv_clip_max": "advantage.clip_max",
    **{f"train.{k}": f"advantage.{k}" for k in ("stat_buffer_size", "stat_min_count", "group_size", "group_std",
                                                  "shared_start_noise")},
    "train.ratio_clip": "train.clip_range",
    "train.policy_batch_size": "train.batch_size",
}
SAVED_SECTIONS = ("derived", "versions")  # written into a run dir's config.yaml next to the config, not config

# ---------------------------------------------------------------------------------------------------------------
# Trainer lookup: filled from above by `diffrl.trainers` (diffrl.trainer_lookup; config never imports the trainers)
# ---------------------------------------------------------------------------------------------------------------


def trainer_table() -> dict[str, str]:
    """Trainer name -> module path: the registry `diffrl.trainers.TRAINERS`, as handed down."""
    return trainer_lookup.names()


def trainer_module(name: str) -> types.ModuleType:
    """The module that implements trainer `name` (checked against the trainer contract of `diffrl.trainers`)."""
    return trainer_lookup.find(name)


# ---------------------------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `1e-4` is a float (not a string) and only true/false are booleans, so
    `mixed_precision: no` stays the string "no" instead of PyYAML's YAML 1.1 `False`; dates stay strings."""


_YAML11_ONLY = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = f" line {e.problem_mark.line + 1}" if getattr(e, "problem_mark", None) else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{origin}:{where}: not valid YAML ({problem})") from None


def _read_yaml_file(path: Path) -> dict:
    data = parse_yaml(read_text(path, "recipe"), str(path))
    if data is None:
        raise UserError(f"{path} is empty; a recipe needs at least `trainer:` and `model.pipeline`")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe is a mapping of groups ({', '.join(GROUPS)}), got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any, str]:
    """`"sample.batch_size=4"` -> (["sample", "batch_size"], 4, "4"); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override '{text}' is not key=value (for example sample.batch_size=4)")
    return key.split("."), parse_yaml(raw, f"override '{text}'") if raw.strip() else "", raw


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, dict[str, str]]:
    """Set each dotted `key=value` in the raw recipe dict. Returns the dict and {dotted key: raw text}."""
    raw_texts = {}
    for text in overrides:
        path, value, raw = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_list_index(part, node, path[: i + 1])]
                continue
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]
        if isinstance(node, list):
            node[_list_index(path[-1], node, path)] = value
        else:
            node[path[-1]] = value
        raw_texts[".".join(path)] = raw
    return data, raw_texts


def _list_index(part: str, node: list, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override key '{'.'.join(path)}': '{part}' is not an index of a list of length {len(node)}")
    return int(part)


# ---------------------------------------------------------------------------------------------------------------
# Strict conversion of raw data into dataclasses
# ---------------------------------------------------------------------------------------------------------------


class _Origin:
    """Says where a value came from (the recipe file or the command line) in error messages."""

    def __init__(self, source: str, override_texts: dict[str, str]):
        self.source = source
        self.override_texts = override_texts

    def of(self, path: str) -> str:
        for key in self.override_texts:
            if path == key or path.startswith(key + ".") or key.startswith(path + "."):
                return "from the command line"
        return f"in {self.source}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + (
            " or null" if type(None) in typing.get_args(tp) else "")
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _value_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(name: str, valid, leaf_paths: dict[str, list[str]] | None = None, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    if leaf_paths and name in leaf_paths:  # the right key in the wrong group: sample.learning_rate
        return f"; did you mean '{leaf_paths[name][0]}'?"
    return ""


class _Converter:
    def __init__(self, origin: _Origin, raw_texts: dict[str, str], leaf_paths: dict[str, list[str]]):
        self.origin = origin
        self.raw_texts = raw_texts
        self.leaf_paths = leaf_paths  # leaf name -> full paths in the schema, for cross-group suggestions

    def fail(self, path: str, what: str) -> typing.NoReturn:
        raise UserError(f"{what} ({self.origin.of(path)})")

    def dataclass(self, cls: type, data: Any, path: str, defaults: dict | None = None) -> Any:
        """`cls` from the mapping `data`; fields it does not set take `defaults` (a trainer's), else the class's."""
        if dataclasses.is_dataclass(data) and isinstance(data, cls):
            data = dataclasses.asdict(data)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.fail(path, f"'{path}' must be a mapping of {cls.__name__} fields, got {_value_repr(data)}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                full = f"{path}.{key}" if path else str(key)
                prefix = f"{path}." if path else ""
                hint = _did_you_mean(str(key), names, self.leaf_paths, prefix)
                self.fail(full, f"unknown key '{full}'{hint}")
        kwargs = dict(defaults or {})
        for name in names:
            if name in data:
                full = f"{path}.{name}" if path else name
                kwargs[name] = self.value(hints[name], data[name], full)
        return cls(**kwargs)

    def value(self, tp: Any, value: Any, path: str) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return value
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, value, path)
        if origin in (Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            errors = []
            for arg in (a for a in args if a is not type(None)):
                try:
                    return self.value(arg, value, path)
                except UserError as e:
                    errors.append(e)
            self.fail(path, f"{path} must be {_type_name(tp)}, got {_value_repr(value)} ({type(value).__name__})")
        if origin is Literal:
            if value in args and type(value) is type(next(a for a in args if a == value)):
                return value
            hint = _did_you_mean(str(value), [str(a) for a in args]) if isinstance(value, str) else ""
            self.fail(path, f"{path} must be one of {_type_name(tp)}, got {_value_repr(value)}{hint}")
        if origin is list:
            if not isinstance(value, (list, tuple)):
                self.fail(path, f"{path} must be a list ({_type_name(tp)}), got {_value_repr(value)}")
            return [self.value(args[0] if args else Any, v, f"{path}.{i}") for i, v in enumerate(value)]
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                self.fail(path, f"{path} must be a mapping, got {_value_repr(value)} ({type(value).__name__})")
            val_tp = args[1] if len(args) == 2 else Any
            return {str(k): self.value(val_tp, v, f"{path}.{k}") for k, v in value.items()}
        if tp is bool:
            if isinstance(value, bool):
                return value
        elif tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif tp is str:
            if isinstance(value, str):
                return value
            if path in self.raw_texts and not isinstance(value, (dict, list)) and value is not None:
                return self.raw_texts[path].strip()  # `run.name=2024` on the command line means the text
        else:
            if isinstance(value, tp):
                return value
        self.fail(path, f"{path} must be {_type_name(tp)}, got {_value_repr(value)} ({type(value).__name__})")


def convert_value(tp: Any, value: Any, path: str, source: str) -> Any:
    """`value` checked strictly against the type annotation `tp` (as recipe values are), floats finite; a
    `UserError` naming `path` and `source` otherwise."""
    converted = _Converter(_Origin(source, {}), {}, {}).value(tp, value, path)
    if isinstance(converted, float):
        check_number(path, converted)
    return converted


def _schema_leaf_paths(cls: type, prefix: str = "") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        full = f"{prefix}.{f.name}" if prefix else f.name
        out.setdefault(f.name, []).append(full)
        if dataclasses.is_dataclass(hints[f.name]):
            for leaf, paths in _schema_leaf_paths(hints[f.name], full).items():
                out.setdefault(leaf, []).extend(paths)
    return out


def _missing(obj: Any, path: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        full = f"{path}.{f.name}" if path else f.name
        if isinstance(value, str) and value == REQUIRED:
            out.append(full)
        elif dataclasses.is_dataclass(value):
            out += _missing(value, full)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    out += _missing(item, f"{full}.{i}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def config_from_dict(data: dict, overrides: list[str] = (), source: str = "the recipe") -> RunConfig:
    """Strictly build a `RunConfig` from a raw dict (as read from YAML) plus `key=value` overrides.

    Args:
        data (`dict`): the recipe's groups.
        overrides (`list[str]`, *optional*): dotted `key=value` strings applied on top, values read as YAML.
        source (`str`, *optional*): where `data` came from, for error messages.

    Returns:
        `RunConfig` with `train` an instance of the trainer's `TrainConfig`.

    Raises:
        `UserError`: unknown key (with the closest valid one), wrong type, missing required value, bad value.
    """
    data, raw_texts = apply_overrides(_deep_copy(data), list(overrides))
    origin = _Origin(source, raw_texts)
    trainer = data.get("trainer", REQUIRED)
    if trainer == REQUIRED and "method" in data:
        raise UserError(f"{source} is a steering recipe (it has `method:`, no `trainer:`); run it with "
                        "`diffrl steer --recipe`")
    if trainer == REQUIRED:
        raise UserError(f"missing required key 'trainer' ({origin.of('trainer')}); one of: "
                        f"{', '.join(trainer_table()) or 'none installed'}")
    if not isinstance(trainer, str):
        raise UserError(f"trainer must be str, got {_value_repr(trainer)} ({origin.of('trainer')})")
    module = trainer_module(trainer)
    train_cls = module.TrainConfig
    _check_moved_keys(data, origin, train_cls)
    leaf_paths = _schema_leaf_paths(RunConfig)
    for leaf, paths in _schema_leaf_paths(train_cls, "train").items():
        leaf_paths.setdefault(leaf, []).extend(paths)
    conv = _Converter(origin, raw_texts, leaf_paths)
    train_data, optim_data, advantage_data = data.pop("train", None), data.pop("optim", None), data.pop("advantage", None)
    cfg = conv.dataclass(RunConfig, data, "")
    cfg.optim = conv.dataclass(OptimGroup, optim_data, "optim", defaults=module.OPTIM_DEFAULTS)
    if module.ADVANTAGE_DEFAULTS is None:
        if advantage_data is not None:
            raise UserError(f"trainer '{trainer}' computes no advantages; remove the advantage group "
                            f"({origin.of('advantage')})")
    else:
        cfg.advantage = conv.dataclass(AdvantageGroup, advantage_data, "advantage",
                                       defaults=module.ADVANTAGE_DEFAULTS)
    cfg.train = conv.dataclass(train_cls, train_data, "train")
    missing = _missing(cfg)
    if missing:
        raise UserError(f"missing required key '{missing[0]}' ({origin.of(missing[0])}); set it in the recipe "
                        f"or pass {missing[0]}=...")
    check_values(cfg)
    module.check(cfg)  # the trainer's own cross-field checks, before any run dir exists
    return cfg


def _check_moved_keys(data: dict, origin: _Origin, train_cls: type) -> None:
    train_fields = {f.name for f in dataclasses.fields(train_cls)}
    for old, new in MOVED_KEYS.items():
        group, key = old.split(".")
        if isinstance(data.get(group), dict) and key in data[group] and key not in train_fields:
            raise UserError(f"'{old}' has moved to '{new}'; rename it ({origin.of(old)})")


def load_recipe(path_or_name: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """Load a recipe strictly: a YAML path or a shipped recipe's short name (`ddpo/tiny_shapes_verifier`).

    Args:
        path_or_name (`str` or `os.PathLike`): a YAML file, or a name listed by `diffrl ls recipes`.
        overrides (`list[str]`, *optional*): `key=value` strings, e.g. `["train.learning_rate=1e-4"]`.

    Returns:
        `RunConfig`.
    """
    path = find_recipe(path_or_name)
    return config_from_dict(_read_yaml_file(path), overrides, source=str(path))


def load_run_config(run_dir: str | os.PathLike) -> RunConfig:
    """The resolved config saved in a run dir's `config.yaml` (its `derived` and `versions` sections dropped)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run dir (no config.yaml); run dirs are made by `diffrl run`")
    data = _read_yaml_file(path)
    for section in SAVED_SECTIONS:
        data.pop(section, None)
    return config_from_dict(data, source=str(path))


# A bound on every per-process batch size, not a memory estimate (that would need the model, the resolution and the
# device): 4096 latents or images at once, the bound steering uses too, is past what any GPU holds for an SD-class
# model and far below the sizes that fail with an allocator traceback (1e9), so a typo is one line before any run
# dir exists; a batch below it that does not fit is torch's out-of-memory error.
MAX_BATCH_SIZE = 4096
MAX_LORA_RANK = 4096
MAX_IMAGE_SIDE = 4096  # pixels; = diffrl.steering.bounds.MAX_IMAGE_SIDE (checked equal in test_bad_inputs_bounds)
MAX_NUM_FRAMES = 1025  # sample.num_frames: 12x Wan's 81, far past what it was trained on
SIZE_KEYS = ("sample.height", "sample.width", "sample.num_frames")  # the keys a size error names
EVAL_SIZE_KEYS = ("sample.eval_height", "sample.eval_width", "sample.eval_num_frames")
MAX_EVAL_IMAGES = 100_000  # = diffrl.steering.bounds.MAX_IMAGES_PER_CALL (checked equal in test_bad_inputs_bounds)

# Ranges of config values beyond the rules every number follows (floats finite, int fields >= 0; see
# `diffrl.checks`): dotted key -> `check_number` bounds. Keys of groups a trainer does not have are skipped.
VALUE_RANGES = {
    **{key: {"low": 0, "low_open": True} for key in ("run.num_epochs", "sample.num_steps",
                                   "sample.num_batches_per_epoch",
                                   "optim.gradient_accumulation_steps", "advantage.group_size")},
    # a LoRA's matrices are rank × the layer's width: rank 10**8 on the 32-wide test UNet allocated without end; the
    # widest layer LoRA targets in diffrl's models is 3072 (FLUX), and a rank beyond a layer's width adds nothing
    "model.lora.rank": {"low": 0, "low_open": True, "high": MAX_LORA_RANK},
    # evaluation images are generated and scored like `diffrl sample`'s, their scores kept: the same bound
    "sample.eval_num_images": {"high": MAX_EVAL_IMAGES},
    "sample.batch_size": {"low": 0, "low_open": True, "high": MAX_BATCH_SIZE},
    # a side past any model's training size: a typo fails before sampling, not as an out-of-memory error
    **{key: {"high": MAX_IMAGE_SIDE} for key in ("sample.height", "sample.width", "sample.eval_height",
                                                  "sample.eval_width")},
    **{key: {"high": MAX_NUM_FRAMES} for key in ("sample.num_frames", "sample.eval_num_frames")},
    **{key: {"high": MAX_BATCH_SIZE} for key in ("train.batch_size", "train.value_batch_size",
                                                  "sample.eval_batch_size")},
    # AdamW steps above 1 wreck the weights in one update (LoRA rates are ~1e-5 to 1e-3)
    "optim.learning_rate": {"low": 0, "low_open": True, "high": 1},
    "train.value_learning_rate": {"low": 0, "low_open": True, "high": 1},
    "optim.adam_epsilon": {"low": 0, "low_open": True},
    "run.seed": {"low": 0, "high": 2**32 - 1},  # accelerate's set_seed seeds numpy, which takes < 2**32
    "model.lora.alpha": {"low": 0, "low_open": True},
    **{key: {"low": 0} for key in ("sample.eta", "sample.guidance_scale", "optim.weight_decay",
                                   "sample.logprob_check_atol", "run.max_train_minutes", "run.eval_every_minutes")},
    **{f"optim.{key}": {"low": 0, "high": 1, "high_open": True} for key in ("adam_beta1", "adam_beta2", "ema_decay")},
}


def check_values(cfg: RunConfig) -> None:
    """Range checks that types alone cannot express. Raises `UserError` naming the key."""
    check_config_numbers(cfg, VALUE_RANGES)
    if not cfg.model.pipeline.strip():
        raise UserError("model.pipeline is empty; name an embedded model (tiny-shapes), a local folder or a hub id")
    if cfg.model.dtype != "float32" and cfg.model.mixed_precision != "no":
        raise UserError(f"model.dtype={cfg.model.dtype} needs model.mixed_precision=no (got "
                        f"'{cfg.model.mixed_precision}'); mixed precision computes in fp16/bf16")
    if bool(cfg.reward.name) == bool(cfg.reward.components):
        raise UserError("the reward group needs exactly one of reward.name (one reward) or reward.components "
                        "(a weighted list of {name, weight, kwargs})")
    if cfg.reward.components and all(c.weight == 0 for c in cfg.reward.components):
        raise UserError("every reward.components weight is 0, so the reward is 0 for every image and nothing is "
                        "learned; give at least one component a non-zero weight")
    if cfg.prompts.source in ("", []):
        raise UserError("prompts.source is empty; give a list of prompts, a text file, shapes:SET or module:function")
    if cfg.run.name and (Path(cfg.run.name).name != cfg.run.name or cfg.run.name in (".", "..")):
        raise UserError(f"run.name '{cfg.run.name}' must be a plain folder name; put the parent in run.output_dir")


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


# ---------------------------------------------------------------------------------------------------------------
# Derived numbers, YAML out, versions
# ---------------------------------------------------------------------------------------------------------------


def derived_numbers(cfg: RunConfig, num_processes: int = 1) -> dict[str, int]:
    """Numbers that follow from the config and the number of processes; the trainer uses these, never edits cfg.

    `samples_per_epoch` (global) = `sample.batch_size` × `sample.num_batches_per_epoch` × processes, and whatever
    the trainer's `derived(cfg, num_processes)` adds (its global batch and optimizer steps per epoch).

    Raises:
        `UserError`: the trainer cannot run the config on that many processes (e.g. an epoch's samples do not split
            into whole optimizer steps).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    per_process = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
    out = {
        "num_processes": num_processes,
        "samples_per_epoch_per_process": per_process,
        "samples_per_epoch": per_process * num_processes,
        "total_samples": per_process * num_processes * cfg.run.num_epochs,
    }
    out.update(trainer_module(cfg.trainer).derived(cfg, num_processes))
    return out


def minibatch_numbers(cfg: RunConfig, num_processes: int, *, batch_size: int, passes: int = 1) -> dict[str, int]:
    """Derived numbers of a trainer that splits each epoch's samples into micro-batches of `batch_size` (per
    process) and takes an optimizer step every `optim.gradient_accumulation_steps` of them, `passes` times over.

    Raises:
        `UserError`: an epoch's samples do not split into whole optimizer steps.
    """
    per_process = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
    per_step = batch_size * cfg.optim.gradient_accumulation_steps
    if per_step <= 0:
        raise UserError(f"train.batch_size × optim.gradient_accumulation_steps must be > 0, got {per_step}")
    if per_process % per_step:
        raise UserError(
            f"samples per process per epoch (sample.batch_size × sample.num_batches_per_epoch = {per_process}) "
            f"is not a multiple of train.batch_size × optim.gradient_accumulation_steps = {per_step}")
    steps = per_process // per_step * passes
    return {"global_train_batch": per_step * num_processes, "optimizer_steps_per_epoch": steps,
            "total_optimizer_steps": steps * cfg.run.num_epochs}


def to_dict(cfg: RunConfig) -> dict:
    """Plain nested dict of the config (the `train` group included)."""
    out = dataclasses.asdict(cfg)
    out["train"] = dataclasses.asdict(cfg.train) if dataclasses.is_dataclass(cfg.train) else cfg.train
    if cfg.advantage is None:
        del out["advantage"]
    return out


def to_yaml(cfg: RunConfig, derived: dict | None = None, versions: dict | None = None) -> str:
    """The resolved config as YAML (loadable by `config_from_dict`), optionally followed by derived numbers and
    package versions (sections that `load_run_config` skips)."""
    data = to_dict(cfg)
    if derived is not None:
        data["derived"] = dict(derived)
    if versions is not None:
        data["versions"] = dict(versions)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def package_versions() -> dict[str, str]:
    """Versions of Python and of the packages a run depends on, plus the git commit of a source checkout."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("diffrl", "torch", "torchvision", "diffusers", "transformers", "accelerate", "peft",
                 "open-clip-torch", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    repo = Path(__file__).resolve().parent.parent
    if (repo / ".git").exists():
        try:
            git = ["git", "-C", str(repo)]
            commit = subprocess.run([*git, "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                                    timeout=5).stdout.strip()
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], check=False,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            if commit:
                out["git_commit"] = commit + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def format_derived(derived: dict) -> str:
    """One line per derived number, for printing at the start of a run."""
    width = max(len(k) for k in derived)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in derived.items())


# ---------------------------------------------------------------------------------------------------------------
# Prompt length (checked where prompts are read: diffrl.config_references, diffrl.pairs)
# ---------------------------------------------------------------------------------------------------------------

# Text encoders read the first 77 (CLIP) to 512 (T5) tokens and truncate the rest; a prompt this long is no caption
# (a file read as one line, a paste gone wrong) and would cost its length in every tokenizer call and log line.
MAX_PROMPT_CHARS = 10_000


def check_prompt_length(prompt: str, where: str) -> None:
    """A `UserError` for a prompt longer than `MAX_PROMPT_CHARS` characters (a longer-than-the-tokenizer prompt
    below it is fine: it is truncated)."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise UserError(f"{where} is {len(prompt)} characters, more than the bound of {MAX_PROMPT_CHARS} (text "
                        f"encoders read at most 512 tokens); shorten it")
