"""Preference pairs for D3PO: the label file format, reading it strictly, and drawing pairs to label.

A label file is JSONL, one pair of images per line (blank lines are ignored)::

    {"prompt": "a red circle", "seed": 81, "images": ["images/00000-0.png", "images/00000-1.png"],
     "choice": null, "latents": "latents/00000.safetensors"}

- `prompt` (non-empty string): the caption both images were drawn for.
- `seed` (integer): the seed of the pair's shared start noise x_T (a standard normal of the latent shape drawn by
  `torch.Generator("cpu").manual_seed(seed)`); both images start from it and differ only by their step noise.
- `images` (two strings): the two images, paths relative to the label file's folder (or absolute).
- `choice`: `0` or `1` = which image is preferred; `"tie"` = neither; `null` = not labelled yet. D3PO skips ties and
  unlabelled pairs (and counts them).
- `latents` (string, optional for labelling, required to train): a safetensors file (relative like the images)
  holding the two denoising chains, so D3PO can recompute every step's log-prob under the current weights:
  `latents` float32 `[2, T+1, C, h, w]` (x_T ... x_0 of image 0 and image 1), `timesteps` int64 `[T]`, `log_probs`
  float32 `[2, T]` (under the sampling policy), and metadata `num_steps`, `guidance_scale`, `eta`,
  `negative_prompt`, `pipeline`, `lora`, `sample_seeds` (the two chains' step-noise seeds, JSON).

Any other key, a missing key, a value of the wrong type, a missing file or a choice out of range is an error that
names the file and the line. `diffrl pairs sample RECIPE --out DIR` writes `DIR/pairs.jsonl` (every `choice` null),
`DIR/images/` and `DIR/latents/`; a person (or the demo's Label page) then sets each `choice`, and a D3PO recipe
with `train.preference: labels` and `train.labels: DIR/pairs.jsonl` trains from it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from diffrl import files
from diffrl.errors import UserError

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
    """

    line: int
    prompt: str
    seed: int
    images: tuple[Path, Path]
    choice: int | str | None
    latents: Path | None = None

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
        raise UserError(f"{where}: prompt must be a non-empty string, got {prompt!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{where}: seed must be an integer, got {seed!r}")
    if not (isinstance(images, list) and len(images) == 2 and all(isinstance(p, str) and p for p in images)):
        raise UserError(f"{where}: images must be a list of two paths, got {images!r}")
    resolved = tuple(root / p for p in images)
    for given, file in zip(images, resolved):
        if not file.is_file():
            raise UserError(f"{where}: image {given} does not exist (looked for {file})")
    if choice not in CHOICES or isinstance(choice, (bool, float)):  # 0 == False == 0.0 in Python
        raise UserError(f"{where}: choice must be 0, 1, \"tie\" or null, got {json.dumps(choice)}")
    latents = data.get("latents")
    if latents is not None:
        if not isinstance(latents, str) or not latents:
            raise UserError(f"{where}: latents must be a path, got {latents!r}")
        latents_path = root / latents
        if not latents_path.is_file():
            raise UserError(f"{where}: latents file {latents} does not exist (looked for {latents_path})")
        latents = latents_path
    elif need_latents:
        raise UserError(f"{where}: no 'latents' file; D3PO recomputes log-probs from the pair's denoising chains, "
                        "which `diffrl pairs sample` saves")
    return LabelledPair(line=number, prompt=prompt, seed=seed, images=resolved, choice=choice, latents=latents)


def check_pair_settings(path: str | Path, pairs: list[LabelledPair], sample_cfg) -> None:
    """Every pair's chains were sampled with the recipe's `num_steps`, `guidance_scale` and `eta` (reads only the
    safetensors headers). Raises `UserError` naming the file and line."""
    from safetensors import SafetensorError, safe_open

    want = {"num_steps": sample_cfg.num_steps, "guidance_scale": float(sample_cfg.guidance_scale),
            "eta": float(sample_cfg.eta)}
    for pair in pairs:
        where = f"{path}:{pair.line}"
        try:
            with safe_open(str(pair.latents), framework="pt") as f:
                meta, keys = f.metadata() or {}, set(f.keys())
                shape = f.get_slice("latents").get_shape() if "latents" in keys else None
        except (OSError, SafetensorError) as e:  # a truncated or foreign file
            raise UserError(f"{where}: cannot read latents file {pair.latents} ({e})") from None
        if shape is None or {"timesteps", "log_probs"} - keys:
            raise UserError(f"{where}: latents file {pair.latents} lacks latents/timesteps/log_probs; make it with "
                            "`diffrl pairs sample`")
        got = {"num_steps": int(meta.get("num_steps", -1)), "guidance_scale": float(meta.get("guidance_scale", "nan")),
               "eta": float(meta.get("eta", "nan"))}
        for key, value in want.items():
            if got[key] != value:
                raise UserError(f"{where}: the pair was sampled with {key}={got[key]} but the recipe has "
                                f"sample.{key}={value}; use the settings the pairs were drawn with")
        if len(shape) != 5 or shape[0] != 2 or shape[1] != sample_cfg.num_steps + 1:
            raise UserError(f"{where}: latents in {pair.latents} have shape {shape}, expected "
                            f"[2, {sample_cfg.num_steps + 1}, C, h, w]")


def load_pairs_trajectory(pairs: list[LabelledPair], pipe, sampler, sample_cfg):
    """The `Trajectory` of `len(pairs)` pairs (rows 2i, 2i+1 = pair i's images 0 and 1) from their saved chains,
    conditioned on their prompts as the sampler would (same guidance, same negative prompt), on the UNet's device."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from samplers.base import Trajectory
    from samplers.conditioning import encode_conditioning, latent_shape

    shape, height, width = latent_shape(pipe, None, None)
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
        seeds += json.loads(meta.get("sample_seeds", "[0, 0]"))
    prompts = [p.prompt for p in pairs for _ in range(2)]
    negative = [sample_cfg.negative_prompt] * len(prompts) if sample_cfg.negative_prompt else None
    cond, prompts = encode_conditioning(pipe, prompts, guidance_scale=sample_cfg.guidance_scale, height=height,
                                        width=width, negative_prompt=negative)
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
    from diffrl.config import load_recipe

    if args.num_pairs < 1:
        raise UserError(f"--num-pairs must be >= 1, got {args.num_pairs}")
    if args.lora and not Path(args.lora).exists():
        raise UserError(f"--lora {args.lora} does not exist")
    cfg = load_recipe(args.recipe, [*args.overrides, *_labels_off(args.recipe)])
    out = Path(args.out)
    if (out / "pairs.jsonl").exists():
        raise UserError(f"{out / 'pairs.jsonl'} already exists (it may hold labels); choose another --out")
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    batch = args.batch_size or max(1, cfg.sample.batch_size // 2)
    from diffrl.config import check_references

    check_references(cfg)
    try:
        (out / "images").mkdir(parents=True, exist_ok=True)
        (out / "latents").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to --out {out}: {e.strerror or e}") from None
    lines = sample_pairs(cfg, out, num_pairs=args.num_pairs, lora=args.lora, seed=args.seed, batch_pairs=batch)
    print(f"wrote {len(lines)} pairs to {out / 'pairs.jsonl'} (choice: null); label them (0, 1 or \"tie\") and "
          f"train with train.preference=labels train.labels={out / 'pairs.jsonl'}")
    return 0


def _labels_off(recipe: str) -> list[str]:
    """Overrides that let a D3PO labels recipe be loaded before its label file exists (drawing the pairs to label
    is how that file is made)."""
    from diffrl.config import _read_yaml_file
    from diffrl.shipped_recipes import find_recipe

    data = _read_yaml_file(find_recipe(recipe))
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    return ["train.preference=reward", "train.labels="] if train.get("preference") == "labels" else []


def sample_pairs(cfg, out: Path, *, num_pairs: int, lora: str | None, seed: int, batch_pairs: int) -> list[dict]:
    """Draw `num_pairs` pairs with the recipe's pipeline (plus `lora`), sampler, sampling settings and training
    prompts: each pair is one prompt, one shared x_T (from the pair's seed), two chains with their own step noise.
    Writes the images, the chains and `pairs.jsonl` (written last, so a failure leaves no half label file)."""
    import numpy as np
    import torch

    from diffrl.pipelines import load_pipeline
    from diffrl.prompts import load_prompts
    from diffrl.training.rollout import shared_group_noise
    from samplers import get_sampler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = load_pipeline(cfg.model.pipeline, device=device, lora=lora)
    pipe.set_progress_bar_config(disable=True)
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
