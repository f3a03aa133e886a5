"""ShapesWorld preference pairs: tiny-shapes samples ranked by the verifier (or any reward), written as a label file.

    python -m diffrl.pairs.shapes --out DIR --num-prompts 64      # any size, into DIR
    diffrl ls pairs                                               # the named sets and whether they are cached

For each prompt, `samples_per_prompt` images are drawn from the embedded `tiny-shapes` pipeline (DDIM, η = 1) from
one shared start noise x_T (the line's `seed`, as in every label file) with different step noise,
and scored with the `shapes_verifier` reward (the fraction of the caption's clauses the image satisfies), or the
setting's `reward` (`--reward`, e.g. `jpeg_compressibility`, the `train_jpeg` set). The pair
is the prompt's best and worst sample, in random order on the line; `choice` points at the best, or is "tie" when
every sample scored the same (a Diffusion-DPO run skips and counts those). The result is a label file
(`pairs.jsonl` plus `images/`; no `latents`: Diffusion-DPO needs only the images) and `meta.json` with the settings
that made it and each line's two scores.

Named sets (`train.pairs: shapes:NAME` in a recipe) are generated on first use into `~/.cache/diffrl/pairs/NAME`
(`$DIFFRL_CACHE/pairs/NAME` when set), written to a temporary folder and renamed, so an interrupted generation
leaves nothing half-made; a set is a pure function of its settings, so every machine makes the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diffrl.errors import UserError
from diffrl.pipelines import load_pipeline
from diffrl.shapes.prompts import get_prompt_set
from rewards import get_reward
from samplers import get_sampler


@dataclass(frozen=True)
class PairsSetting:
    prompts: str = "shapes:train"  # prompt set (`diffrl ls prompts`); its first `num_prompts` captions are used
    num_prompts: int = 256
    samples_per_prompt: int = 4  # K images per prompt; the pair is the best and the worst of them
    num_steps: int = 20  # DDIM steps (the tiny recipes' evaluation setting)
    guidance_scale: float = 5.0
    eta: float = 1.0
    seed: int = 0  # prompt i's shared x_T is drawn with seed + i; its image k's step noise with (seed + i)·K + k
    pipeline: str = "tiny-shapes"
    reward: str = "shapes_verifier"  # ranks each prompt's samples (any registered reward; higher is better)


# name -> (settings, description); `diffrl ls pairs` lists them
PAIR_SETS = {
    # 1024 images, about 3 CPU-minutes to make; every caption whose samples the verifier tells apart gives a pair
    "train": (PairsSetting(), "best vs worst of 4 tiny-shapes samples for each of the 256 shapes:train captions"),
    "train_small": (PairsSetting(num_prompts=16), "the same for the first 16 captions, for a quick look"),
    # the same images ranked by JPEG compressibility instead (a dense reward: no ties), DDPO's first task offline
    "train_jpeg": (PairsSetting(reward="jpeg_compressibility"),
                   "best vs worst of 4 tiny-shapes samples by JPEG compressibility, the 256 shapes:train captions"),
}


def cache_root() -> Path:
    return Path(os.environ.get("DIFFRL_CACHE") or Path.home() / ".cache" / "diffrl") / "pairs"


def check_set_name(name: str) -> None:
    if name not in PAIR_SETS:
        import difflib

        close = difflib.get_close_matches(name, list(PAIR_SETS), n=1)
        hint = f"; did you mean 'shapes:{close[0]}'?" if close else ""
        raise UserError(f"unknown ShapesWorld pairs set 'shapes:{name}'{hint} (known: "
                        f"{', '.join('shapes:' + n for n in PAIR_SETS)}; `diffrl ls pairs`)")


def list_pair_sets() -> dict[str, str]:
    """Name -> description, with where it is cached (or that it is generated on first use)."""
    out = {}
    for name, (setting, description) in PAIR_SETS.items():
        folder = cache_root() / name
        where = f"cached in {folder}" if _is_complete(folder, setting) else "generated on first use"
        out[f"shapes:{name}"] = f"{setting.num_prompts} captions ({description}; {where})"
    return out


FORMAT = 2  # 2: diffrl.pairs.labels label lines (one shared-x_T seed per pair), scores in meta.json


def _is_complete(folder: Path, setting: PairsSetting) -> bool:
    meta = folder / "meta.json"
    try:
        data = json.loads(meta.read_text()) if meta.is_file() else {}
        # a set made before `reward` was a setting was ranked by the verifier
        return data.get("format") == FORMAT and {"reward": "shapes_verifier", **data["setting"]} == asdict(setting)
    except (OSError, ValueError, KeyError):
        return False


def ensure_pairs_set(name: str) -> Path:
    """The folder of named set `name`, generated first when the cache lacks it (or holds other settings)."""
    check_set_name(name)
    setting, _ = PAIR_SETS[name]
    folder = cache_root() / name
    if not _is_complete(folder, setting):
        print(f"generating the ShapesWorld pairs set shapes:{name} into {folder} (once)", flush=True)
        make_pairs(folder, setting, replace=True)
    return folder


def make_pairs(out: str | Path, setting: PairsSetting, *, replace: bool = False, batch_size: int = 32) -> Path:
    """Generate a pairs set into `out` (atomically: a sibling temporary folder renamed at the end).

    Args:
        out (`str` or `Path`): the folder to create (must not exist unless `replace`).
        setting (`PairsSetting`): what to sample.
        replace (`bool`, *optional*, defaults to `False`): replace an existing `out`.
        batch_size (`int`, *optional*, defaults to 32): images per sampling batch.

    Returns:
        `Path`: `out`, holding `pairs.jsonl`, `images/` and `meta.json`.
    """
    import torch  # deferred with diffrl.models (which imports diffusers): `diffrl ls pairs` imports this module

    from diffrl.models import model_family

    out = Path(out)
    if out.exists() and not replace:
        raise UserError(f"{out} already exists; choose a new --out folder")
    prompts = get_prompt_set(setting.prompts.removeprefix("shapes:"))
    if not 1 <= setting.num_prompts <= len(prompts):
        raise UserError(f"num_prompts must be in 1..{len(prompts)} (the size of {setting.prompts}), "
                        f"got {setting.num_prompts}")
    if setting.samples_per_prompt < 2:
        raise UserError(f"samples_per_prompt must be >= 2 (a pair needs two images), got {setting.samples_per_prompt}")
    prompts = prompts[: setting.num_prompts]
    k = setting.samples_per_prompt
    pipe = load_pipeline(setting.pipeline)
    pipe.set_progress_bar_config(disable=True)
    sampler, ranker = get_sampler("auto", pipe), get_reward(setting.reward)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (tmp / "images").mkdir()
        jobs = [(i, j) for i in range(len(prompts)) for j in range(k)]  # (prompt, sample)
        shape = model_family(pipe).latent_shape(None, None)[0]
        scores: dict = {}
        start = time.perf_counter()
        for b in range(0, len(jobs), batch_size):
            batch = jobs[b: b + batch_size]
            # x_T of prompt i: a standard normal drawn by a CPU generator seeded with seed + i (a label line's `seed`)
            x_T = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(setting.seed + i))
                               for i, _ in batch])
            batch_prompts = [prompts[i] for i, _ in batch]
            with torch.no_grad():
                traj = sampler.sample(pipe, batch_prompts, num_steps=setting.num_steps,
                                      guidance_scale=setting.guidance_scale, eta=setting.eta,
                                      latents=x_T.to(pipe.unet.device),
                                      seeds=[(setting.seed + i) * k + j for i, j in batch])
                values = ranker(traj.images, batch_prompts, None).scores.tolist()
            for (i, j), image, value in zip(batch, traj.images, values):
                _save_png(image, tmp / "images" / f"{i:05d}_{j}.png")
                scores[i, j] = float(value)
            print(f"[pairs] {min(b + batch_size, len(jobs))}/{len(jobs)} images "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
        lines, order_rng = [], torch.Generator().manual_seed(setting.seed)
        counts, line_scores = {"pairs": 0, "ties": 0}, []
        for i, prompt in enumerate(prompts):
            values = [scores[i, j] for j in range(k)]
            best = max(range(k), key=lambda j: (values[j], -j))  # ties between samples: the lower index
            worst = min(range(k), key=lambda j: (values[j], j))
            worst = worst if worst != best else (best + 1) % k
            swap = bool(torch.randint(0, 2, (1,), generator=order_rng))  # the preferred image is not always first
            shown = [worst, best] if swap else [best, worst]
            tie = values[best] == values[worst]
            counts["ties" if tie else "pairs"] += 1
            lines.append({"prompt": prompt, "seed": setting.seed + i,
                          "images": [f"images/{i:05d}_{j}.png" for j in shown],
                          "choice": "tie" if tie else shown.index(best)})
            line_scores.append([values[j] for j in shown])
        (tmp / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        meta = {"format": FORMAT, "setting": asdict(setting), **counts, "scores": line_scores}  # scores: each line's two, in order
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[pairs] {counts['pairs']} pairs with a preference, {counts['ties']} ties -> {out / 'pairs.jsonl'}",
          flush=True)
    return out


def _save_png(image, path: Path) -> None:
    from PIL import Image

    array = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype("uint8")
    Image.fromarray(array).save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffrl.pairs.shapes",
                                     description="Generate ShapesWorld preference pairs ranked by the verifier.")
    parser.add_argument("--out", required=True, help="folder to create (pairs.jsonl, images/, meta.json)")
    defaults = PairsSetting()
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--prompts", default=defaults.prompts, help="a ShapesWorld prompt set (`diffrl ls prompts`)")
    parser.add_argument("--samples-per-prompt", type=int, default=defaults.samples_per_prompt)
    parser.add_argument("--num-steps", type=int, default=defaults.num_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--reward", default=defaults.reward,
                        help="the reward that ranks each prompt's samples (`diffrl ls rewards`; default the verifier)")
    args = parser.parse_args(argv)
    setting = PairsSetting(prompts=args.prompts, num_prompts=args.num_prompts,
                           samples_per_prompt=args.samples_per_prompt, num_steps=args.num_steps, seed=args.seed,
                           reward=args.reward)
    try:
        make_pairs(args.out, setting)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
