"""`diffrl export`: a run's trained weights as a folder that plain diffusers loads, with a model card, optionally
pushed to the Hugging Face hub.

The folder holds

- for a LoRA run, `pytorch_lora_weights.safetensors` in diffusers' format: the run's own export, copied byte for
  byte (its adapter metadata carries alpha and rank, so diffusers scales the update as the run did), loaded with
  `pipe.load_lora_weights(folder)` on the base pipeline;
- for a full fine-tune, a complete diffusers pipeline folder (the base with the trained UNet or transformer), loaded
  with `DiffusionPipeline.from_pretrained(folder)`;
- `base/`, the complete base pipeline saved with `save_pretrained`, for a LoRA run on an embedded base (always) or
  on any base with `--with-base`. An embedded model (`tiny-shapes`, ...) has no hub id and lives inside the diffrl
  package, and a partial one (`tiny-shapes-lcm`) borrows components through diffrl's loader: without the copy the
  LoRA would load only where diffrl is installed. The copy is about 20 MB (fp32), so a tiny-shapes result is shared
  whole. A hub base is named in the card's metadata instead, and a local folder base (possibly gigabytes) is
  copied only when asked;
- `README.md`, the model card (huggingface_hub's `ModelCard`): base model, license, trainer and its settings, reward
  and gold reward, samples seen, held-out results (start, best, final) with standard errors, the reward curve and
  the before/after grid (copied to `images/`), how to load the weights;
- `recipe.yaml`, the run's resolved config with its name and output folder reset to the defaults, so
  `diffrl run recipe.yaml` trains it again.

Which weights: the run's newest `checkpoints/step-N`, or with `--best` its `best/` (written when `run.keep_best` is
set: the weights with the best held-out score). Bad input fails before anything is written; the folder is assembled
in a hidden sibling of `--out` and renamed into place when complete (as checkpoints are), so a failure half way
leaves nothing under `--out`.
"""

from __future__ import annotations

import copy
import importlib.metadata
import inspect
import math
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import diffusers
import yaml
from diffusers.utils import logging as d_logging
from huggingface_hub import HfApi, ModelCard, ModelCardData, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from diffrl import config, files
from diffrl.errors import UserError
from diffrl.hub import hub_offline
from diffrl.pipelines import (
    MAX_SEQUENCE_LENGTH_KEY,
    _quiet_loading,
    find_trained_weights,
    hub_reachable,
    load_pipeline,
    resolve_pipeline_name,
    set_sampling_size,
)
from diffrl.prompts import load_prompts
from diffrl.rundir import latest_checkpoint
from diffrl.training.evaluation import EVAL_SEED, paired_gain
from diffrl.training.state import BEST_DIR, read_best
from diffrl.training.weights import LORA_WEIGHT_NAME

CARD = "README.md"
RECIPE = "recipe.yaml"
BASE_DIR = "base"
# run-dir image -> name in the export's images/ folder
IMAGES = {"reward_curve.png": "reward_curve.png", "images/before-after.png": "before-after.png"}


@dataclass
class Base:
    """The pipeline a run trained on, as far as the export needs it."""

    name: str  # model.pipeline of the run: an embedded name, a local folder or a hub id
    kind: str  # "embedded", "folder" or "hub"
    revision: str = ""  # hub revision ("" = default branch)
    class_name: str | None = None  # the pipeline class of its model_index.json, when readable
    license: str | None = None  # None = unknown
    license_name: str | None = None  # with license "other": its name and link, as the base's card gives them
    license_link: str | None = None
    license_source: str = ""  # where the license was read
    none_components: list[str] = field(default_factory=list)  # required components listed [null, null] (SD3's T5)
    max_sequence_length: int | None = None  # `_diffrl_max_sequence_length` of a flow model


@dataclass
class Evaluation:
    """One held-out evaluation of a run (a metrics.jsonl record with eval_* keys)."""

    epoch: int
    final: bool
    samples_seen: int  # samples the evaluated weights were trained on (an epoch's evaluation runs before its training)
    metrics: dict
    scores: list[float] | None  # per image, eval_scores.jsonl (the gold reward's where there is one)


@dataclass
class HeldOut:
    """Start, best and final held-out evaluations and the paired gains over the start."""

    key: str  # "eval_gold" or "eval_reward": the score `best` and the gains are about
    start: Evaluation
    best: Evaluation
    final: Evaluation
    best_kept: bool  # best/ holds the best evaluation's weights (run.keep_best)
    gains: dict[str, tuple[float, float, int]]  # "best" / "final" -> (mean gain, paired se, images)


# ---------------------------------------------------------------------------------------------------------------
# reading a run
# ---------------------------------------------------------------------------------------------------------------


def resolve_weights(run_dir: Path, best: bool) -> tuple[Path, str, Path]:
    """The folder of the weights to export, their kind ("lora", "unet" or "transformer") and file or folder.

    Raises:
        `UserError`: not a run dir, no checkpoint yet, `best` without best/.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run dir {run_dir} does not exist")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not a run dir (no config.yaml); run dirs are made by `diffrl run`")
    if best:
        source = run_dir / BEST_DIR
        if read_best(run_dir) is None:
            raise UserError(f"--best: {run_dir} has no {BEST_DIR}/ (it is written at evaluations when the run sets "
                            "run.keep_best=true); leave out --best to export the newest checkpoint")
    else:
        source = latest_checkpoint(run_dir)
        if source is None:
            raise UserError(f"{run_dir} has no trained weights yet (no checkpoints/step-N); wait for the first "
                            "checkpoint (run.save_every) or the end of the run")
    kind, where = find_trained_weights(source)
    return source, kind, where


def weights_state(source: Path, run_dir: Path) -> dict:
    """epoch / global_step / samples_seen of the exported weights (best.json for best/, else trainer_state.json)."""
    if source.name == BEST_DIR:
        return read_best(run_dir)
    state = files.read_json(source / "trainer_state.json", "checkpoint state")
    return {k: state[k] for k in ("epoch", "global_step", "samples_seen") if k in state}


def describe_base(name: str, revision: str = "") -> Base:
    """What the card says about the base pipeline; reads only small files (model_index.json, a model card)."""
    kind, where = resolve_pipeline_name(name)
    base = Base(name=name, kind=kind, revision=revision)
    index, card = None, None
    if kind in ("embedded", "folder"):
        index = files.read_json(Path(where) / "model_index.json", "pipeline index")
        card = Path(where) / "README.md"
    else:
        cached = try_to_load_from_cache(name, "model_index.json", revision=revision or None)
        if isinstance(cached, str):
            index = files.read_json(cached, "pipeline index")
        card = _hub_card(name, revision)
    if kind == "embedded":
        # the embedded models are trained in-project and ship inside the diffrl distribution, under its license
        base.license = _distribution_license()
        base.license_source = "the diffrl distribution's license, which ships these weights"
    elif card is not None and Path(card).is_file():
        try:
            data = ModelCard.load(card).data
            base.license, base.license_name, base.license_link = (data.get(k) for k in ("license", "license_name",
                                                                                          "license_link"))
            base.license_source = "the base model's card"
        except (ValueError, OSError, yaml.YAMLError):  # a README without valid metadata: the license stays unknown
            base.license = None
    if isinstance(index, dict):
        base.class_name = index.get("_class_name")
        if index.get(MAX_SEQUENCE_LENGTH_KEY) is not None:
            base.max_sequence_length = int(index[MAX_SEQUENCE_LENGTH_KEY])
        optional = set(getattr(_pipeline_class(base.class_name), "_optional_components", []) or [])
        base.none_components = [k for k, v in index.items() if not k.startswith("_") and k not in optional
                                and isinstance(v, list) and v == [None, None]
                                and k not in ("safety_checker", "feature_extractor")]
    return base


def _hub_card(repo_id: str, revision: str) -> str | None:
    """The hub model card of `repo_id` from the local cache, or downloaded where the hub is reachable; None if
    neither (the license is then unknown)."""
    cached = try_to_load_from_cache(repo_id, CARD, revision=revision or None)
    if isinstance(cached, str):
        return cached
    if hub_offline() or not hub_reachable():
        return None
    try:
        return hf_hub_download(repo_id, CARD, revision=revision or None)
    except (HfHubHTTPError, OSError, ValueError):  # gated, no README: the license stays unknown
        return None


def _distribution_license() -> str | None:
    try:
        meta = importlib.metadata.metadata("diffrl")
    except importlib.metadata.PackageNotFoundError:
        return None
    value = meta.get("License-Expression") or meta.get("License")
    return value.lower() if value else None


def _pipeline_class(class_name: str | None):
    if not class_name:
        return None
    return getattr(diffusers, class_name, None)


def read_evaluations(run_dir: Path) -> list[Evaluation]:
    """The run's held-out evaluations, in order, from metrics.jsonl with their per-image scores (eval_scores.jsonl;
    a later line for the same evaluation, written again after a resume, wins)."""
    records = files.read_jsonl(Path(run_dir) / "metrics.jsonl", "metrics file")
    per_image = {(r["epoch"], bool(r.get("final"))): r["scores"]
                 for r in files.read_jsonl(Path(run_dir) / "eval_scores.jsonl", "per-image scores file")}
    out, seen = [], 0
    for record in records:
        final = bool(record.get("final"))
        if record.get("eval_reward_mean") is not None:
            samples = record["samples_seen"] if final else seen
            out.append(Evaluation(epoch=record["epoch"], final=final, samples_seen=samples, metrics=record,
                                  scores=per_image.get((record["epoch"], final))))
        if not final:
            seen = record.get("samples_seen", seen)
    return out


def held_out(evaluations: list[Evaluation], best_record: dict | None) -> HeldOut | None:
    """Start (the first evaluation), best and final (the last) evaluations and the paired gains of the gold reward
    (else the trained-on reward) over the start; None for a run that never evaluated.

    The best is the evaluation best/ was saved at (`best_record`, from best.json) when the run kept one, else the
    first evaluation with the highest mean score.
    """
    if not evaluations:
        return None
    key = "eval_gold" if any(e.metrics.get("eval_gold_mean") is not None for e in evaluations) else "eval_reward"
    start, final = evaluations[0], evaluations[-1]
    best = None
    if best_record is not None:
        best = next((e for e in evaluations if e.epoch == best_record["epoch"]), None)
    kept = best is not None
    if best is None:
        best = max(evaluations, key=lambda e: _finite_or(e.metrics.get(f"{key}_mean"), -math.inf))
    gains = {}
    for name, e in (("best", best), ("final", final)):
        if e is not start and start.scores is not None and e.scores is not None:
            gain, se = paired_gain(start.scores, e.scores)
            pairs = sum(math.isfinite(a) and math.isfinite(b) for a, b in zip(start.scores, e.scores))
            gains[name] = (gain, se, pairs)
    return HeldOut(key=key, start=start, best=best, final=final, best_kept=kept, gains=gains)


def _finite_or(value, default: float) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else default


def mean_se(metrics: dict, prefix: str) -> tuple[float | None, float | None]:
    """An evaluation's mean and its standard error std / √n (`std` over the n images, as metrics.jsonl stores it)."""
    mean, std, n = (metrics.get(f"{prefix}_{k}") for k in ("mean", "std", "n"))
    se = std / math.sqrt(n) if isinstance(std, (int, float)) and n else None
    return mean, se


# ---------------------------------------------------------------------------------------------------------------
# the model card
# ---------------------------------------------------------------------------------------------------------------


def fmt(value, spec: str = ".4g") -> str:
    """A number as the card prints it: means with 4 significant digits, standard errors (`spec` ".2g") with 2;
    "n/a" for a missing or NaN value."""
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def fmt_mean_se(mean, se) -> str:
    return f"{fmt(mean)} ± {fmt(se, '.2g')}"


def fmt_gain(gain: float, se: float) -> str:
    return f"{fmt(gain, '+.4g')} ± {fmt(se, '.2g')}"


def _reward_text(name: str, kwargs: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return f"`{name}`" + (f" ({args})" if args else "")


def reward_description(cfg) -> str:
    if cfg.reward.components:
        return " + ".join(f"{c.weight:g} × {_reward_text(c.name, c.kwargs)}" for c in cfg.reward.components)
    return _reward_text(cfg.reward.name, cfg.reward.kwargs)


def _trainer_summary(name: str) -> str:
    """The first paragraph of the trainer module's docstring (its name and paper) on one line."""
    module = config.trainer_module(name)
    return " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())


def _first_prompt(cfg) -> str:
    """A held-out prompt for the card's example; user functions ("pkg.module:function") are not run for it."""
    source = cfg.prompts.eval_source or cfg.prompts.source
    if isinstance(source, str) and ":" in source and not source.startswith("shapes:"):
        return "a prompt"
    try:
        prompts = load_prompts(source)
    except UserError:
        return "a prompt"
    return prompts[0] if prompts else "a prompt"


def _results_section(results: HeldOut | None, cfg, reward: str, gold: str, exported: str) -> list[str]:
    if results is None:
        return ["## Held-out results", "",
                "This run made no held-out evaluation (`run.eval_every` and `run.eval_every_minutes` were 0).", ""]
    steps = cfg.sample.eval_num_steps or cfg.sample.num_steps
    source = cfg.prompts.eval_source or cfg.prompts.source
    sampler = "sampler" if cfg.sample.sampler == "auto" else f"`{cfg.sample.sampler}` sampler"
    how = (f"{cfg.sample.eval_num_images} images of the held-out prompts `{source}`, image i with prompt i (cycling "
           f"through them) and seed {EVAL_SEED} + i: the same images at every evaluation ({steps} steps, guidance "
           f"{cfg.sample.guidance_scale:g}, eta {cfg.sample.eta:g}, diffrl's {sampler}{_eval_size_note(cfg)}). Mean ± "
           "standard error (std over the images / √n).")
    lines = ["## Held-out results", "", how, ""]
    header = "| evaluation | epoch | samples seen |" + (f" gold {gold} |" if gold else "") + f" reward {reward} |"
    lines += [header, "|---|---:|---:|" + "---:|" * (1 + bool(gold))]
    rows = [("start", results.start), ("best", results.best), ("final", results.final)]
    for name, e in rows:
        label = name + (" (exported)" if name == exported else "")
        cells = [label, str(e.epoch), str(e.samples_seen)]
        for prefix in (["eval_gold"] if gold else []) + ["eval_reward"]:
            mean, se = mean_se(e.metrics, prefix)
            cells.append(fmt_mean_se(mean, se))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    what = f"gold reward {gold}" if results.key == "eval_gold" else f"reward {reward}"
    if results.gains:
        lines += [(f"Gain of the {what} over the start, paired by image (mean and standard error of the per-image "
                   "differences, same prompts and seeds):"), ""]
        for name in ("best", "final"):
            if name in results.gains:
                gain, se, n = results.gains[name]
                lines.append(f"- start → {name}: {fmt_gain(gain, se)} ({n} images)")
        lines.append("")
    if results.best is results.start:
        lines += ["The best evaluation is the start: training did not beat the pre-trained model on the held-out "
                  "score" + (", so best/ holds the starting weights." if results.best_kept else "."), ""]
    if not results.best_kept:
        lines += ["The run did not keep its best weights (`run.keep_best` was off): the best row is for reference.",
                  ""]
    return lines


def _usage_section(base: Base, kind: str, with_base: bool, repo: str | None, cfg, prompt: str) -> list[str]:
    folder = f'snapshot_download("{repo}")' if repo else '"path/to/this/folder"'
    steps = cfg.sample.eval_num_steps or cfg.sample.num_steps
    call = [f"num_inference_steps={steps}", f"guidance_scale={cfg.sample.guidance_scale:g}"]
    cls = _pipeline_class(base.class_name)
    takes_eta = cls is not None and "eta" in inspect.signature(cls.__call__).parameters
    if takes_eta:
        call.append(f"eta={cfg.sample.eta:g}")
    if base.max_sequence_length is not None:
        call.append(f"max_sequence_length={base.max_sequence_length}")
    call += [f"{key}={value}" for key, value in _run_size(cfg).items()]  # the size it was trained at
    call.append(f"generator=torch.Generator().manual_seed({EVAL_SEED})")
    load_kwargs = "".join(f", {k}=None" for k in base.none_components)
    code = ["```python", "import torch", "from diffusers import DiffusionPipeline"]
    if repo:
        code.append("from huggingface_hub import snapshot_download")
    code.append("")
    if kind == "lora":
        if with_base:
            code += [f"folder = {folder}",
                     f'pipe = DiffusionPipeline.from_pretrained(f"{{folder}}/{BASE_DIR}"{load_kwargs})',
                     "pipe.load_lora_weights(folder)"]
        else:
            base_ref = f'"{base.name}"' + (f', revision="{base.revision}"' if base.revision else "")
            target = f'"{repo}"' if repo else '"path/to/this/folder"'
            code += [f"pipe = DiffusionPipeline.from_pretrained({base_ref}{load_kwargs})",
                     f"pipe.load_lora_weights({target})"]
    else:
        code += [f"pipe = DiffusionPipeline.from_pretrained({folder}{load_kwargs})"]
    code += [f'image = pipe("{prompt}", {", ".join(call)}).images[0]', "```"]
    lines = ["## How to use", ""]
    if kind == "lora" and with_base:
        why = (f"`{base.name}` is embedded in diffrl (no hub id), so " if base.kind == "embedded" else "")
        lines += [(f"{why}`{BASE_DIR}/` holds the complete base pipeline; plain diffusers loads it and the LoRA "
                   "(no diffrl needed):"), ""]
    elif kind == "lora":
        lines += [f"Load the base pipeline `{base.name}` and this LoRA in plain diffusers:", ""]
    else:
        lines += ["This folder is a complete diffusers pipeline (the base with the fine-tuned weights):", ""]
    lines += code + [""]
    if base.none_components:
        lines += [f"The base has no {' or '.join(base.none_components)}: diffusers needs them passed as None.", ""]
    if base.max_sequence_length is not None:
        lines += [f"It was trained with max_sequence_length={base.max_sequence_length} (text tokens of its T5).", ""]
    if cls is not None and not takes_eta and cfg.sample.eta > 0:
        lines += [(f"`{base.class_name}` has no `eta`: it samples deterministically, where the held-out evaluation "
                   f"above drew its images with diffrl's sampler at eta {cfg.sample.eta:g}."), ""]
    if kind == "lora":
        pipeline = base.name if base.kind != "folder" else "BASE_FOLDER"
        lines += ["With diffrl installed: `diffrl sample --pipeline " + pipeline +
                  " --lora path/to/this/folder --prompt \"...\" --out samples`.", ""]
    return lines


def model_card(*, cfg, base: Base, kind: str, source_label: str, state: dict, results: HeldOut | None,
               exported_eval: str | None, images: list[str], with_base: bool, repo: str | None, trainer: str,
               derived: dict, versions: dict, prompt: str):
    """The model card (huggingface_hub `ModelCard`) of an export: metadata plus the text described in the module
    docstring."""
    lora = kind == "lora"
    tags = ["diffrl", "diffusers", "text-to-image", cfg.trainer] + (["lora"] if lora else ["full-finetune"])
    hub_base = {"base_model": base.name, "base_model_relation": "adapter" if lora else "finetune"}
    named = {k: v for k, v in (("license_name", base.license_name), ("license_link", base.license_link)) if v}
    data = ModelCardData(library_name="diffusers", pipeline_tag="text-to-image", tags=tags, license=base.license,
                         **named, **(hub_base if base.kind == "hub" else {}))
    reward = reward_description(cfg)
    gold = _reward_text(cfg.reward.gold, cfg.reward.gold_kwargs) if cfg.reward.gold else ""
    lines = _intro_section(cfg, base, kind, reward, gold, trainer, source_label, state, exported_eval)
    lines += _results_section(results, cfg, reward, gold, exported_eval)
    lines += _images_section(images)
    lines += _usage_section(base, kind, with_base, repo, cfg, prompt)
    lines += _training_section(cfg, kind, reward, gold, derived, versions)
    lines += _license_section(base)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _lora_text(cfg) -> str:
    lora = cfg.model.lora
    return f"rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(lora.target_modules)}"


def _intro_section(cfg, base: Base, kind: str, reward: str, gold: str, trainer: str, source_label: str, state: dict,
                   exported_eval: str | None) -> list[str]:
    what = f"A LoRA ({_lora_text(cfg)})" if kind == "lora" else f"The fully fine-tuned {kind}"
    revision = f" at revision `{base.revision}`" if base.revision else ""
    base_text = {"embedded": f"`{base.name}`, a model embedded in diffrl (ShapesWorld: trained in-project, no hub id)",
                 "hub": f"[`{base.name}`](https://huggingface.co/{base.name}){revision}",
                 "folder": f"the local pipeline folder `{base.name}`"}[base.kind]
    watched = f", with {gold} as the held-out gold reward (scored at evaluations, never trained on)" if gold else ""
    which = f" (the weights of the {exported_eval} evaluation below)" if exported_eval else ""
    steps, samples = state.get("global_step", "n/a"), state.get("samples_seen", "n/a")
    return [f"# {cfg.run.name}: {cfg.trainer} on {base.name}", "",
            f"{what} of {base_text}, trained with diffrl's **{cfg.trainer}** trainer to raise the reward {reward}"
            + f"{watched}.", "",
            f"Trainer: {trainer}", "",
            f"Exported weights: `{source_label}` of the run, after {steps} optimizer step{'' if steps == 1 else 's'} and "
            + f"**{samples} samples "
            + f"seen**{which}.", ""]


def _images_section(images: list[str]) -> list[str]:
    if not images:
        return []
    lines = [("Reward curve (training reward and held-out evaluations), and held-out images before training (left) "
             "and after the final epoch (right), same prompts and seeds:"), ""]
    if "reward_curve.png" in images:
        lines += ["![reward curve](images/reward_curve.png)", ""]
    if "before-after.png" in images:
        lines += ["![held-out images before and after training](images/before-after.png)", ""]
    return lines


def _training_section(cfg, kind: str, reward: str, gold: str, derived: dict, versions: dict) -> list[str]:
    minutes = f" (at most {cfg.run.max_train_minutes:g} minutes of training)" if cfg.run.max_train_minutes else ""
    ema = f", EMA {cfg.optim.ema_decay:g}" if cfg.optim.use_ema else ""
    sample = cfg.sample
    settings = [("trainer", cfg.trainer),
                ("weights trained", f"LoRA {_lora_text(cfg)}" if kind == "lora" else "full fine-tune"),
                ("reward", reward), ("gold reward", gold or "none"),
                ("training prompts", f"`{cfg.prompts.source}`"),
                ("epochs", f"{cfg.run.num_epochs}{minutes}"),
                ("samples per epoch", str(derived.get("samples_per_epoch", "n/a"))),
                ("sampling", f"{sample.num_steps} steps, guidance {sample.guidance_scale:g}, eta {sample.eta:g}"
                             + "".join(f", {key} {value}" for key, value in _run_size(cfg).items())),
                ("optimizer", (f"AdamW, learning rate {cfg.optim.learning_rate:g}, {cfg.optim.lr_scheduler} "
                              f"schedule{ema}")),
                ("mixed precision", cfg.model.mixed_precision),
                ("processes", str(derived.get("num_processes", "n/a")))]
    lines = ["## Training", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in settings] + [""]
    train_group = config.to_dict(cfg).get("train") or {}
    if train_group:
        lines += [f"The `{cfg.trainer}` trainer's own settings (`train:`):", "", "```yaml",
                  yaml.safe_dump(train_group, sort_keys=False).rstrip(), "```", ""]
    lines += [(f"The whole recipe is [`{RECIPE}`]({RECIPE}), the run's resolved config: `diffrl run {RECIPE}` trains "
              "it again."), ""]
    if versions:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", ""]
    return lines


def _license_section(base: Base) -> list[str]:
    if base.license:
        named = ", ".join(v for v in (base.license_name, base.license_link) if v)
        text = f"`{base.license}`" + (f" ({named})" if named else "") + f", from {base.license_source}."
    else:
        text = ("Unknown: the base model's license could not be read (no model card with a license in the local "
                "cache or folder). Check it before sharing: these weights are a derivative of the base model.")
    return ["## License", "", text, ""]


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def check_out_dir(out: Path) -> None:
    """`--out` must be a new or empty folder (an export never mixes with other files)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a new folder for the export")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} already holds files; give a new or empty folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"cannot write --out {out}: {parent} is a file, not a folder")
            break


def check_repo_id(repo: str) -> None:
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        reason = str(e).splitlines()[0]
        raise UserError(f"--push-to-hub {files.shorten(repo)} is not a hub repo id: {reason}") from None


def export_run(run_dir, out, *, best: bool = False, with_base: bool = False, repo: str | None = None) -> dict:
    """Write the export folder of a run (see the module docstring).

    Args:
        run_dir (`str` or `os.PathLike`): a run dir made by `diffrl run`.
        out (`str` or `os.PathLike`): the folder to write (new or empty).
        best (`bool`, *optional*, defaults to `False`): export best/ instead of the newest checkpoint.
        with_base (`bool`, *optional*, defaults to `False`): copy the base pipeline into `base/` (always done for an
            embedded base; LoRA runs only).
        repo (`str`, *optional*): the hub repo the folder is meant for, named in the card's loading code.

    Returns:
        `dict` with `out`, `kind` ("lora", "unet" or "transformer"), `files` (names written, relative to `out`).

    Raises:
        `UserError`: before writing anything for bad input; a failure while writing removes the partial folder.
    """
    run_dir, out = Path(run_dir), Path(out)
    source, kind, where = resolve_weights(run_dir, best)
    check_out_dir(out)
    if repo is not None:
        check_repo_id(repo)
    cfg = config.load_run_config(run_dir)
    saved = config.parse_yaml(files.read_text(run_dir / "config.yaml", "run config"), str(run_dir / "config.yaml"))
    base = describe_base(cfg.model.pipeline, cfg.model.revision)
    if kind != "lora" and with_base:
        raise UserError("--with-base: this run trained full weights, and their export is already a complete pipeline")
    with_base = kind == "lora" and (with_base or base.kind == "embedded")
    if kind == "lora" and where.suffix == ".safetensors":
        files.load_safetensors(where, "export another checkpoint")  # a truncated file fails here, not when loaded
    state = weights_state(source, run_dir)
    results = held_out(read_evaluations(run_dir), read_best(run_dir))
    exported_eval = _exported_evaluation(results, best, state)
    images = [name for path, name in IMAGES.items() if (run_dir / path).is_file()]
    card = model_card(cfg=cfg, base=base, kind=kind, source_label=str(source.relative_to(run_dir)), state=state,
                      results=results, exported_eval=exported_eval, images=images, with_base=with_base, repo=repo,
                      trainer=_trainer_summary(cfg.trainer), derived=saved.get("derived") or {},
                      versions=saved.get("versions") or {}, prompt=_first_prompt(cfg))
    recipe = _rerunnable_recipe(cfg)

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with files.writing(f"--out {out}"):
            tmp.mkdir(parents=True)
            if kind == "lora":
                files.write_bytes(tmp / LORA_WEIGHT_NAME, where.read_bytes())
                if with_base:
                    _save_pipeline(cfg, tmp / BASE_DIR, lora=None)
            else:  # the base pipeline with the trained denoiser, saved whole
                _save_pipeline(cfg, tmp, lora=source)
            if images:
                (tmp / "images").mkdir()
            for path, name in IMAGES.items():
                if name in images:
                    files.write_bytes(tmp / "images" / name, (run_dir / path).read_bytes())
            files.write_text(tmp / RECIPE, recipe)
            files.write_text(tmp / CARD, str(card))
            if out.is_dir():
                out.rmdir()  # empty (checked above); rename cannot replace a folder on every platform
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {"out": out, "kind": kind, "files": written, "with_base": with_base}


def _exported_evaluation(results: HeldOut | None, best: bool, state: dict) -> str | None:
    """Which row of the results table the exported weights are: "best" for best/, "final" for the newest checkpoint
    when the final evaluation saw the same number of samples, else None."""
    if results is None:
        return None
    if best:
        return "best" if results.best_kept else None
    return "final" if results.final.final and results.final.samples_seen == state.get("samples_seen") else None


def _rerunnable_recipe(cfg) -> str:
    """The resolved config with the run's name and output folder reset, so it trains again anywhere."""
    cfg = copy.deepcopy(cfg)
    cfg.run.name, cfg.run.output_dir, cfg.run.resume = "", "runs", ""
    return config.to_yaml(cfg)


def _eval_size_note(cfg) -> str:
    """", at H×W px (rollouts at H'×W' px)" where held-out evaluation has a size of its own (sample.eval_height,
    ...; frames too for a video model), else ""."""
    s = cfg.sample
    train = (s.height, s.width, s.num_frames)
    held_out = (s.eval_height or s.height, s.eval_width or s.width, s.eval_num_frames or s.num_frames)
    if held_out == train:
        return ""

    def size(height, width, frames):
        sides = "×".join(str(side) if side else "the model's default" for side in (height, width)) + " px"
        return sides + (f", {frames} frames" if frames else "")

    return f", at {size(*held_out)} (rollouts at {size(*train)})"


def _run_size(cfg) -> dict[str, int]:
    """The recipe's sample.height / width / num_frames that are set (0 = the model's default is left out)."""
    return {key: getattr(cfg.sample, key) for key in ("height", "width", "num_frames") if getattr(cfg.sample, key)}


def _save_pipeline(cfg, folder: Path, *, lora: Path | None) -> None:
    """The run's base pipeline (with the trained weights of a full fine-tune from `lora`) saved whole, fp32; the run's
    size goes into its model_index.json (`_diffrl_height`, ...), so diffrl samples the folder at that size."""
    pipe = load_pipeline(cfg.model.pipeline, revision=cfg.model.revision or None, lora=lora)
    set_sampling_size(pipe, **_run_size(cfg))
    verbosity = d_logging.get_verbosity()
    d_logging.set_verbosity_error()  # else it warns that SD3's absent T5 (None) "cannot be saved"
    try:
        with _quiet_loading():  # transformers' "Writing model shards" bars
            pipe.save_pretrained(folder, safe_serialization=True)
    finally:
        d_logging.set_verbosity(verbosity)
    _drop_local_paths(folder)


def _drop_local_paths(folder: Path) -> None:
    """Remove `_name_or_path` from the saved configs: diffusers records the folder the model was loaded from (this
    machine's install path), which a shared folder should not carry and no loader needs."""
    for path in sorted(folder.rglob("*.json")):
        data = files.read_json(path, "saved config")
        if isinstance(data, dict) and "_name_or_path" in data:
            del data["_name_or_path"]
            files.write_json(path, data)


def push_to_hub(out: Path, repo: str) -> str:
    """Upload the export folder to the hub repo `repo` (created if missing). Returns the repo URL.

    Raises:
        `UserError`: the hub is switched off or unreachable (one line; the folder stays), or the hub refuses.
    """
    later = f"the export is kept in {out}; upload it later with `hf upload {repo} {out}`"
    if hub_offline():
        raise UserError(f"--push-to-hub {repo}: not uploaded, HF_HUB_OFFLINE is set; {later}")
    if not hub_reachable():
        raise UserError(f"--push-to-hub {repo}: not uploaded, the hub is unreachable; {later}")
    api = HfApi()
    try:
        url = api.create_repo(repo, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo, repo_type="model", folder_path=str(out),
                          commit_message="diffrl export")
    except Exception as e:  # the hub's own refusals: no token, no write access, a name taken
        raise UserError(f"--push-to-hub {repo}: upload failed ({str(e).splitlines()[0]}); {later}") from e
    return str(url)
