"""Preference pairs for D3PO: the label file format, reading it strictly, and drawing pairs to label.

A label file is JSONL, one pair of images per line (blank lines are ignored)::

    {"prompt": "a red circle", "seed": 81, "images": ["images/00000-0.png", "images/00000-1.png"],
     "choice": null, "latents": "latents/00000.safetensors"}

- `prompt` (non-empty string, at most `diffrl.config.MAX_PROMPT_CHARS` characters): the caption both images were drawn for.
- `seed` (integer): the seed of the pair's shared start noise x_T (a standard normal of the latent shape drawn by
  `torch.Generator("cpu").manual_seed(seed)`); both images start from it and differ only by their step noise.
- `images` (two strings): the two images, paths relative to the label file's folder, which they must stay in (no
  absolute path, no `..` or symlink leading out of it): a label file names no other file of the machine. Each is an
  image PIL reads, of at most PIL's decompression-bomb bound of pixels.
- `choice`: `0` or `1` = which image is preferred; `"tie"` = neither; `null` = not labelled yet. D3PO skips ties and
  unlabelled pairs (and counts them).
- `latents` (string, optional for labelling, required to train): a safetensors file (relative like the images)
  holding the two denoising chains, so D3PO can recompute every step's log-prob under the current weights:
  `latents` float32 `[2, T+1, C, h, w]` (x_T ... x_0 of image 0 and image 1), `timesteps` int64 `[T]`, `log_probs`
  float32 `[2, T]` (under the sampling policy), and metadata `num_steps`, `guidance_scale`, `eta`,
  `negative_prompt`, `pipeline`, `lora`, `sample_seeds` (the two chains' step-noise seeds, JSON).

Any other key, a missing key, a value of the wrong type, a missing file, a file that is not an image, a path leading
out of the folder or a choice out of range is an error that names the file and the line. To train on (D3PO's
`check_pair_settings`, Diffusion-DPO's `check_pairs_source`), the file must also hold at least one labelled pair; D3PO
batches a file's images, so they must share one size, and replays their chains through the recipe's pipeline, so
they must have been drawn with its sample settings and fit its UNet and scheduler (`check_pairs_fit_pipeline`, run
by `diffrl validate` and `diffrl run` before a run dir exists). `diffrl pairs sample RECIPE --out DIR` writes `DIR/pairs.jsonl` (every `choice` null),
`DIR/images/` and `DIR/latents/`; a person (or the demo's Label page) then sets each `choice`, and a D3PO recipe
with `train.preference: labels` and `train.labels: DIR/pairs.jsonl` trains from it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from diffrl import files
from diffrl.config import _read_yaml_file, check_prompt_length, load_recipe
from diffrl.errors import UserError
from diffrl.pipelines import (
    check_pipeline,
    load_pipeline,
    read_scheduler_config,
    set_sampling_size,
    unet_latent_size,
)
from diffrl.shipped_recipes import find_recipe
from diffrl.steering.bounds import MAX_IMAGES_PER_CALL, MAX_ROWS_PER_CALL, check_at_most
from samplers import get_sampler

KEYS = ("prompt", "seed", "images", "choice", "latents")
REQUIRED_KEYS = ("prompt", "seed", "images", "choice")
CHOICES = (0, 1, "tie", None)


@dataclass(frozen=True)
class LabelledPair:
    """One line of a label file, checked. Paths are resolved against the label file's folder.

    Args:
        line (`int`): 1-based line number in the file.
        prompt (`str`), seed (`int`): as in the file.
        images (`tuple[Path, Path]`): the two images.
        choice (`int`, `str` or `None`): 0, 1, "tie" or None (unlabelled).
        latents (`Path`, *optional*): the chains' safetensors file.
        image_sizes (`tuple`, *optional*): `(width, height)` of each image.
    """

    line: int
    prompt: str
    seed: int
    images: tuple[Path, Path]
    choice: int | str | None
    latents: Path | None = None
    image_sizes: tuple = field(default=(), compare=False)  # (width, height) of each image, read from its header

    @property
    def preferred(self) -> int | None:
        """0 or 1 for a labelled preference; None for a tie or an unlabelled pair."""
        return self.choice if self.choice in (0, 1) else None


def read_label_file(path: str | Path, *, need_latents: bool = False) -> list[LabelledPair]:
    """Read and check a label file (see the module docstring for the format).

    Args:
        path (`str` or `Path`): the JSONL file.
        need_latents (`bool`, *optional*, defaults to `False`): every line must name an existing `latents` file
            (training needs the chains; labelling does not).

    Returns:
        `list[LabelledPair]` in file order.

    Raises:
        `UserError`: "FILE:LINE: what is wrong" for the first bad line; a missing or empty file.
    """
    path = Path(path)
    if path.is_dir():
        hint = f"; it has {path / 'pairs.jsonl'}" if (path / "pairs.jsonl").is_file() else ""
        raise UserError(f"label file {path} is a folder; give the label file in it{hint}")
    if not path.is_file():
        raise UserError(f"label file {path} does not exist; draw pairs to label with `diffrl pairs sample RECIPE "
                        "--out DIR` (it writes DIR/pairs.jsonl)")
    root = path.parent
    pairs = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read label file {path}: {e}") from None
    for number, text in enumerate(lines, start=1):
        if text.strip():
            pairs.append(_parse_line(text, f"{path}:{number}", number, root, need_latents))
    if not pairs:
        raise UserError(f"label file {path} holds no pairs")
    return pairs


def check_some_labelled(path, pairs: list[LabelledPair]) -> None:
    """A `UserError` when no pair of the file is labelled 0 or 1 (ties and unlabelled pairs are skipped, so a
    trainer would run its epochs on nothing)."""
    if not any(pair.preferred is not None for pair in pairs):
        ties = sum(pair.choice == "tie" for pair in pairs)
        raise UserError(f"{path}: no labelled pair (choice 0 or 1) to train on; {ties} ties, "
                        f"{len(pairs) - ties} unlabelled: label some pairs first")


def _check_one_size(path: Path, pairs: list[LabelledPair]) -> None:
    first = pairs[0].image_sizes[0]
    for pair in pairs:
        for given, size in zip(pair.images, pair.image_sizes):
            if size != first:
                raise UserError(f"{path}:{pair.line}: image {given.relative_to(path.parent)} is {size[0]}x{size[1]} pixels but line "
                                f"{pairs[0].line}'s are {first[0]}x{first[1]}; D3PO batches a label file's images, "
                                "which `diffrl pairs sample` makes at one size")


def _parse_line(text: str, where: str, number: int, root: Path, need_latents: bool) -> LabelledPair:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}: column {e.colno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: a line is a JSON object with {', '.join(REQUIRED_KEYS)}, got {type(data).__name__}")
    for key in data:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (keys: {', '.join(KEYS)})"
            raise UserError(f"{where}: unknown key '{key}'{hint}")
    for key in REQUIRED_KEYS:
        if key not in data:
            raise UserError(f"{where}: missing key '{key}'")
    prompt, seed, images, choice = data["prompt"], data["seed"], data["images"], data["choice"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: prompt must be a non-empty string, got {files.shorten(repr(prompt))}")
    check_prompt_length(prompt, f"{where}: prompt")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{where}: seed must be an integer, got {seed!r}")
    if not (isinstance(images, list) and len(images) == 2 and all(isinstance(p, str) and p for p in images)):
        raise UserError(f"{where}: images must be a list of two paths, got {images!r}")
    resolved = tuple(_inside(root, p, where, "image") for p in images)
    for given, file in zip(images, resolved):
        if not file.is_file():
            raise UserError(f"{where}: image {given} does not exist (looked for {file})")
    sizes = tuple(_image_size(file, given, where) for given, file in zip(images, resolved))
    if choice not in CHOICES or isinstance(choice, (bool, float)):  # 0 == False == 0.0 in Python
        raise UserError(f"{where}: choice must be 0, 1, \"tie\" or null, got {json.dumps(choice)}")
    latents = data.get("latents")
    if latents is not None:
        if not isinstance(latents, str) or not latents:
            raise UserError(f"{where}: latents must be a path, got {latents!r}")
        latents_path = _inside(root, latents, where, "latents file")
        if not latents_path.is_file():
            raise UserError(f"{where}: latents file {latents} does not exist (looked for {latents_path})")
        latents = latents_path
    elif need_latents:
        raise UserError(f"{where}: no 'latents' file; D3PO recomputes log-probs from the pair's denoising chains, "
                        "which `diffrl pairs sample` saves")
    return LabelledPair(line=number, prompt=prompt, seed=seed, images=resolved, choice=choice, latents=latents,
                        image_sizes=sizes)


def _inside(root: Path, given: str, where: str, what: str) -> Path:
    """`root / given` for a relative path that stays inside `root` once `..` and symlinks are resolved; a
    `UserError` otherwise (a label file names only files of its own folder)."""
    if Path(given).is_absolute():
        raise UserError(f"{where}: {what} {files.shorten(given)} is an absolute path; give it relative to the label "
                        f"file's folder {root}")
    path = root / given
    if not path.resolve().is_relative_to(root.resolve()):
        raise UserError(f"{where}: {what} {files.shorten(given)} leads out of the label file's folder {root} (to "
                        f"{files.shorten(path.resolve())}); keep the images and latents inside that folder")
    return path


def _image_size(file: Path, given: str, where: str) -> tuple[int, int]:
    """`(width, height)` of an image file, read and checked without decoding its pixels: a file that is not an
    image, or one beyond PIL's decompression-bomb bound, is a `UserError`."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                size = image.size
                image.verify()  # the whole file read and checked (PNG chunk CRCs), still no pixels decoded
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise UserError(f"{where}: image {files.shorten(given)} has more pixels than PIL's bound against "
                        f"decompression bombs ({Image.MAX_IMAGE_PIXELS}); resize it") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UserError(f"{where}: image {files.shorten(given)} is not an image PIL can read ({e})") from None
    return size


def check_pair_settings(path: str | Path, pairs: list[LabelledPair], sample_cfg) -> None:
    """The pairs can train D3PO with the recipe's `sample` group: at least one is labelled 0 or 1, their images
    share one size (they are batched), and every pair's chains were sampled with the recipe's `num_steps`,
    `guidance_scale`, `eta` (and `negative_prompt`, where the metadata has it) and hold what `load_pairs_trajectory` reads: `latents [2, T+1, C, h, w]`,
    `timesteps [T]`, `log_probs [2, T]` (floating point but the timesteps) and metadata numbers that are numbers
    (reads only the safetensors headers). Raises `UserError` naming the file and line."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    check_some_labelled(path, pairs)
    _check_one_size(path, pairs)

    want = {"num_steps": sample_cfg.num_steps, "guidance_scale": float(sample_cfg.guidance_scale),
            "eta": float(sample_cfg.eta)}
    steps = sample_cfg.num_steps
    for pair in pairs:
        where = f"{path}:{pair.line}"
        try:
            with safe_open(str(pair.latents), framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
                found = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in keys & set(_CHAINS)}
        except (OSError, SafetensorError) as e:  # a truncated or foreign file
            raise UserError(f"{where}: cannot read latents file {pair.latents} ({e})") from None
        if set(_CHAINS) - keys:
            raise UserError(f"{where}: latents file {pair.latents} lacks latents/timesteps/log_probs; make it with "
                            "`diffrl pairs sample`")
        got = {key: _meta_number(meta, key, int if key == "num_steps" else float, where, pair.latents)
               for key in want}
        for key, value in want.items():
            if got[key] != value:
                raise UserError(f"{where}: the pair was sampled with {key}={got[key]} but the recipe has "
                                f"sample.{key}={value}; use the settings the pairs were drawn with")
        if "negative_prompt" in meta and meta["negative_prompt"] != sample_cfg.negative_prompt:
            raise UserError(f"{where}: the pair was sampled with negative_prompt "
                            f"{files.shorten(repr(meta['negative_prompt']))} but the recipe has sample.negative_prompt "
                            f"{files.shorten(repr(sample_cfg.negative_prompt))}; use the settings the pairs were "
                            "drawn with")
        shape = found["latents"][0]
        if len(shape) != 5 or shape[0] != 2 or shape[1] != steps + 1:
            raise UserError(f"{where}: latents in {pair.latents} have shape {shape}, expected "
                            f"[2, {steps + 1}, C, h, w]")
        for key, expected in (("timesteps", [steps]), ("log_probs", [2, steps])):
            if list(found[key][0]) != expected:
                raise UserError(f"{where}: {key} in {pair.latents} have shape {found[key][0]}, expected {expected}")
        for key in ("latents", "log_probs"):
            if found[key][1] not in _FLOAT_DTYPES:
                raise UserError(f"{where}: {key} in {pair.latents} are {found[key][1]}, not floating point")
        _sample_seeds(meta, where, pair.latents)


def check_pairs_fit_pipeline(path: str | Path, pairs: list[LabelledPair], cfg, unet_config: dict | None,
                             scheduler_config: dict | None) -> None:
    """The pairs' chains fit the recipe's pipeline, as `load_pairs_trajectory` needs once training starts: latents
    of the shape its UNet denoises (`[C, h, w]` per step: the UNet config's `in_channels`, and the latent size of the
    recipe's `sample.height` x `sample.width`, else the folder's size, else the UNet's `sample_size`) and the timesteps its sampler gives for `sample.num_steps` (from the scheduler config), and a
    pipeline with a UNet (the chains are replayed through `pipe.unet`). Reads the latents files' headers and their
    `timesteps` only. `unet_config` / `scheduler_config` as `diffrl.pipelines.check_pipeline` /
    `read_scheduler_config` give them (`None` for a hub id not in the local cache: the run's first step checks).
    Raises `UserError` naming the file and line."""
    from safetensors import safe_open

    path = Path(path)
    if scheduler_config and "FlowMatch" in str(scheduler_config.get("_class_name", "")):
        raise UserError(f"train.labels: D3PO from labels replays the pairs' chains through a UNet; model.pipeline "
                        f"{cfg.model.pipeline} is a flow-matching pipeline without one (train it with "
                        "train.preference=reward, or give a UNet pipeline)")
    shape = None
    if unet_config is not None and isinstance(unet_config.get("in_channels"), int):
        size = unet_latent_size(cfg.model.pipeline, height=cfg.sample.height, width=cfg.sample.width,
                                revision=cfg.model.revision or None)
        shape = (unet_config["in_channels"], *size) if size is not None else None
    timesteps = _pipeline_timesteps(cfg, unet_config, scheduler_config)
    for pair in pairs:
        where = f"{path}:{pair.line}"
        with safe_open(str(pair.latents), framework="pt") as f:  # readable: check_pair_settings opened it
            found = tuple(f.get_slice("latents").get_shape()[2:])
            saved = f.get_tensor("timesteps") if timesteps is not None else None
        if shape is not None and found != shape:
            raise UserError(f"{where}: latents in {pair.latents} are {list(found)} per step, but the UNet of "
                            f"model.pipeline {cfg.model.pipeline} denoises {list(shape)}: the pairs come from "
                            "another model; draw them with this one (`diffrl pairs sample`)")
        if timesteps is not None and saved.long().tolist() != timesteps:
            raise UserError(f"{where}: the pair was sampled at timesteps {_short_list(saved.long().tolist())}, but "
                            f"the scheduler of model.pipeline {cfg.model.pipeline} gives "
                            f"{_short_list(timesteps)} for sample.num_steps={cfg.sample.num_steps}: the pairs come "
                            "from another model or scheduler; draw them with this one (`diffrl pairs sample`)")


def check_labels_fit_pipeline(cfg) -> None:
    """A D3PO recipe's label file (`train.labels`, with `train.preference=labels`) against its pipeline, as
    `check_pairs_fit_pipeline` checks it, reading the pipeline's configs (no weights). `diffrl validate`, `run` and
    `resume` call it after `check_references`; a recipe without a label file passes."""
    labels = getattr(cfg.train, "labels", "")
    if not labels:
        return
    revision = cfg.model.revision or None
    unet_config = check_pipeline(cfg.model.pipeline, revision=revision)  # check_references has checked it
    check_pairs_fit_pipeline(labels, read_label_file(labels, need_latents=True), cfg, unet_config,
                             read_scheduler_config(cfg.model.pipeline, revision=revision))


def _pipeline_timesteps(cfg, unet_config: dict | None, scheduler_config: dict | None) -> list[int] | None:
    """The timesteps the recipe's sampler takes on the pipeline for `sample.num_steps` (computed from the scheduler
    config, no weights loaded); `None` where that config is unknown. "auto" picks as `samplers.resolve_sampler_name`
    does for a UNet pipeline: lcm for a UNet with a guidance embedding or an LCM scheduler, else ddim."""
    if not scheduler_config:
        return None
    name = cfg.sample.sampler
    if name == "auto":
        lcm = ((unet_config or {}).get("time_cond_proj_dim") is not None
               or "LCM" in str(scheduler_config.get("_class_name", "")))
        name = "lcm" if lcm else "ddim"
    sampler = get_sampler(name)
    if sampler.flow:
        return None
    return sampler.schedule(scheduler_config, cfg.sample.num_steps).timesteps.long().tolist()


def _short_list(values: list, shown: int = 6) -> str:
    return str(values) if len(values) <= shown else f"[{', '.join(map(str, values[:shown]))}, … ({len(values)})]"


_CHAINS = ("latents", "timesteps", "log_probs")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names


def _meta_number(meta: dict, key: str, kind: type, where: str, file: Path):
    """`kind(meta[key])` of a latents file's metadata (safetensors metadata values are strings), or a `UserError`."""
    if key not in meta:
        raise UserError(f"{where}: latents file {file} has no '{key}' in its metadata; make it with "
                        "`diffrl pairs sample`")
    try:
        return kind(meta[key])
    except ValueError:
        raise UserError(f"{where}: latents file {file} has {key}={files.shorten(repr(meta[key]))} in its metadata, "
                        f"not {'an integer' if kind is int else 'a number'}; make it with `diffrl pairs sample`"
                        ) from None


def _sample_seeds(meta: dict, where: str, file: Path) -> list[int]:
    """The two chains' step-noise seeds of a latents file's metadata (JSON `[int, int]`), or a `UserError`."""
    text = meta.get("sample_seeds", "[0, 0]")
    try:
        seeds = json.loads(text)
    except json.JSONDecodeError:
        seeds = None
    if not (isinstance(seeds, list) and len(seeds) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds)):
        raise UserError(f"{where}: latents file {file} has sample_seeds={files.shorten(repr(text))} in its metadata, "
                        "not a JSON list of two seeds >= 0; make it with `diffrl pairs sample`")
    return seeds


def load_pairs_trajectory(pairs: list[LabelledPair], pipe, sampler, sample_cfg):
    """The `Trajectory` of `len(pairs)` pairs (rows 2i, 2i+1 = pair i's images 0 and 1) from their saved chains,
    conditioned on their prompts as the sampler would (same guidance, same negative prompt), on the UNet's device."""
    # torch, and diffrl.models (diffusers), when chains are read: `diffrl --help` imports this module for its arguments
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from diffrl.models import model_family
    from samplers.base import Trajectory

    family = model_family(pipe)
    shape, height, width = family.latent_shape(None, None)
    timesteps = sampler.schedule(pipe, sample_cfg.num_steps).timesteps
    latents, log_probs, seeds = [], [], []
    for pair in pairs:
        tensors = load_file(str(pair.latents))
        with safe_open(str(pair.latents), framework="pt") as f:
            meta = f.metadata() or {}
        where = f"{pair.latents} (line {pair.line})"
        if tuple(tensors["latents"].shape[2:]) != tuple(shape):
            raise UserError(f"{where}: latents of shape {tuple(tensors['latents'].shape[2:])} per step, but "
                            f"this pipeline makes {tuple(shape)}: the pairs come from another model")
        if not torch.equal(tensors["timesteps"].long().cpu(), timesteps.long().cpu()):
            raise UserError(f"{where}: sampled on other timesteps than this pipeline's scheduler gives; the pairs "
                            "come from another model or scheduler")
        latents.append(tensors["latents"].float())
        log_probs.append(tensors["log_probs"].float())
        seeds += _sample_seeds(meta, f"{pair.latents} (line {pair.line})", pair.latents)
    prompts = [p.prompt for p in pairs for _ in range(2)]
    negative = [sample_cfg.negative_prompt] * len(prompts) if sample_cfg.negative_prompt else None
    cond, prompts = family.encode(prompts, guidance_scale=sample_cfg.guidance_scale, height=height, width=width,
                                  negative_prompt=negative)
    return Trajectory(latents=torch.cat(latents).to(pipe.unet.device), timesteps=timesteps,
                      log_probs=torch.cat(log_probs), prompts=prompts, seeds=seeds,
                      guidance_scale=float(sample_cfg.guidance_scale), eta=float(sample_cfg.eta),
                      num_steps=sample_cfg.num_steps, sampler=sampler.name, **cond.trajectory_fields())


def load_pair_images(pairs: list[LabelledPair]):
    """`[2N, 3, H, W]` float images in [0, 1] of the pairs (rows 2i, 2i+1 = pair i's images 0 and 1)."""
    import numpy as np
    import torch
    from PIL import Image

    arrays = [np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
              for pair in pairs for path in pair.images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# `diffrl pairs sample`
# ---------------------------------------------------------------------------------------------------------------


def add_pairs_arguments(parser) -> None:
    parser.add_argument("action", choices=["sample"], help="sample: draw pairs to label with the current policy")
    parser.add_argument("recipe", help="a recipe (its model, sample and prompts groups), e.g. d3po/tiny_shapes_labels")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="recipe overrides (values are YAML)")
    parser.add_argument("--out", required=True, help="folder for pairs.jsonl, images/ and latents/ (created)")
    parser.add_argument("-n", "--num-pairs", dest="num_pairs", type=int, default=16, help="pairs to draw (16)")
    parser.add_argument("--lora", default=None, help="the current policy: a run dir or a LoRA folder (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draws and noise (default 0)")
    parser.add_argument("--batch-size", type=int, default=None, help="pairs per sampling batch (default: "
                        "sample.batch_size / 2)")


def pairs_cli(args) -> int:
    check_at_most("--num-pairs", args.num_pairs, MAX_IMAGES_PER_CALL // 2)  # two images (and chains) a pair
    if args.lora and not Path(args.lora).exists():
        raise UserError(f"--lora {args.lora} does not exist")
    cfg = load_recipe(args.recipe, [*args.overrides, *_labels_off(args.recipe)])
    out = Path(args.out)
    if (out / "pairs.jsonl").exists():
        raise UserError(f"{out / 'pairs.jsonl'} already exists (it may hold labels); choose another --out")
    if args.batch_size is not None:
        check_at_most("--batch-size", args.batch_size, MAX_ROWS_PER_CALL // 2)  # two chains a pair
    batch = args.batch_size or max(1, cfg.sample.batch_size // 2)
    # imported here: diffrl.prompts (under it) loads numpy, and `diffrl --help` imports this module for its arguments
    from diffrl.config_references import check_references

    check_references(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to --out {out}: {e.strerror or e}") from None
    # one writer per folder: two draws into one --out would overwrite each other's images and chains under one name,
    # and the label file written last would pair images with another draw's chains
    with files.lock_run_dir(out, "(a `diffrl pairs sample` into it); give another --out"):
        if (out / "pairs.jsonl").exists():  # written by a draw that held the folder and ended since the first look
            raise UserError(f"{out / 'pairs.jsonl'} already exists (it may hold labels); choose another --out")
        with files.writing(f"to --out {out}"):
            (out / "images").mkdir(exist_ok=True)
            (out / "latents").mkdir(exist_ok=True)
        lines = sample_pairs(cfg, out, num_pairs=args.num_pairs, lora=args.lora, seed=args.seed, batch_pairs=batch)
    print(f"wrote {len(lines)} pairs to {out / 'pairs.jsonl'} (choice: null); label them (0, 1 or \"tie\") and "
          f"train with train.preference=labels train.labels={out / 'pairs.jsonl'}")
    return 0


def _labels_off(recipe: str) -> list[str]:
    """Overrides that let a D3PO labels recipe be loaded before its label file exists (drawing the pairs to label
    is how that file is made)."""
    data = _read_yaml_file(find_recipe(recipe))
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    return ["train.preference=reward", "train.labels="] if train.get("preference") == "labels" else []


def sample_pairs(cfg, out: Path, *, num_pairs: int, lora: str | None, seed: int, batch_pairs: int) -> list[dict]:
    """Draw `num_pairs` pairs with the recipe's pipeline (plus `lora`), sampler, sampling settings and training
    prompts: each pair is one prompt, one shared x_T (from the pair's seed), two chains with their own step noise.
    Writes the images, the chains and `pairs.jsonl` (written last, so a failure leaves no half label file)."""
    # numpy (also through diffrl.prompts) and torch (also through the rollout) when pairs are drawn, not on `--help`
    import numpy as np
    import torch

    from diffrl.prompts import load_prompts
    from diffrl.training.rollout import shared_group_noise

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = load_pipeline(cfg.model.pipeline, device=device, lora=lora)
    pipe.set_progress_bar_config(disable=True)
    # the recipe's size, as training uses it (D3PO recomputes log-probs of these chains at that size)
    set_sampling_size(pipe, height=cfg.sample.height, width=cfg.sample.width, num_frames=cfg.sample.num_frames)
    sampler = get_sampler(cfg.sample.sampler, pipe)
    prompts = load_prompts(cfg.prompts.source)
    rng = np.random.default_rng(seed)
    sample = cfg.sample
    lines = []
    for start in range(0, num_pairs, batch_pairs):
        n = min(batch_pairs, num_pairs - start)
        picks = [prompts[i] for i in rng.integers(0, len(prompts), size=n)]
        pair_seeds = rng.integers(0, 2**62, size=n).tolist()
        chain_seeds = rng.integers(0, 2**62, size=2 * n).tolist()
        batch_prompts = [p for p in picks for _ in range(2)]
        negative = [sample.negative_prompt] * (2 * n) if sample.negative_prompt else None
        with torch.no_grad():
            traj = sampler.sample(pipe, batch_prompts, num_steps=sample.num_steps,
                                  guidance_scale=sample.guidance_scale, eta=sample.eta, seeds=chain_seeds,
                                  negative_prompt=negative, latents=shared_group_noise(pipe, pair_seeds, 2))
        images = traj.images.float().clamp(0, 1).cpu()
        for k in range(n):
            index = start + k
            names = [f"images/{index:05d}-{i}.png" for i in range(2)]
            for i, name in enumerate(names):
                files.save_png(out / name, images[2 * k + i])
            meta = {"num_steps": str(sample.num_steps), "guidance_scale": str(float(sample.guidance_scale)),
                    "eta": str(float(sample.eta)), "negative_prompt": sample.negative_prompt,
                    "pipeline": cfg.model.pipeline, "lora": lora or "",
                    "sample_seeds": json.dumps(chain_seeds[2 * k: 2 * k + 2])}
            latents_name = f"latents/{index:05d}.safetensors"
            files.save_safetensors(out / latents_name, {
                "latents": traj.latents[2 * k: 2 * k + 2].float().cpu().contiguous(),
                "timesteps": traj.timesteps.long().cpu().contiguous(),
                "log_probs": traj.log_probs[2 * k: 2 * k + 2].float().cpu().contiguous()}, metadata=meta)
            lines.append({"prompt": picks[k], "seed": int(pair_seeds[k]), "images": names, "choice": None,
                          "latents": latents_name})
    files.write_text(out / "pairs.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
    return lines
