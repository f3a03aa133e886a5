"""What the demo does, without any gradio: generate and steer, compare two models, score images, read run dirs.

The gradio layer (`app.py`) only lays out the page and streams what this module reports. Everything here calls the
functions the command line calls: `load_pipeline` and the sampler's `sample` as `diffrl sample` does, `steer` as
`diffrl steer` does, the reward registry and `rewards.score_cli.load_images` as `diffrl score` does, and
`find_trained_weights` / `read_metrics` for run dirs. Nothing is written anywhere but the temporary folder the caller
gives for downloadable files.

One `Engine` per process holds the loaded pipelines (a small LRU, since a real model is gigabytes) and the built
rewards. Callers serialise model work (the app puts every model event in one gradio concurrency group); the cache
has its own lock so that two pages loading at once still build each model once.

torch, and the samplers that import it with diffusers, are imported inside the functions that use them: `diffrl demo`
serves the page before they load (they take seconds; the first page, not the import, starts loading the default
pipeline: see `app.launch`).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from PIL import Image

from diffrl import checks, rundir
from diffrl.cli import _ls_pipelines
from diffrl.config import parse_yaml
from diffrl.embedded import is_built
from diffrl.errors import UserError
from diffrl.pipelines import find_trained_weights, load_pipeline, resolve_pipeline_name
from diffrl.steering import method_config, resolve_reward, steer
from diffrl.steering.bounds import (
    MAX_DEMO_IMAGES,
    MAX_IMAGE_SIDE,
    MAX_NUM_STEPS,
    MAX_UPLOAD_BYTES,
    MAX_UPLOAD_FILES,
    MAX_UPLOAD_PIXELS,
    check_at_most,
    check_call_rows,
)
from rewards.combine import check_prompts
from rewards.registry import get_reward
from rewards.score_cli import load_images

from .runs import under_runs_root

METHODS = ("plain", "best-of-n", "fk", "svdd", "guidance", "reno")
# The setting of each steering method that the page's one "budget" number sets (the rest go in "settings").
BUDGET_SETTING = {
    "best-of-n": "num_samples",
    "fk": "num_particles",
    "svdd": "num_candidates",
    "guidance": "num_samples",
    "reno": "iterations",
}
# Reward guidance as the page runs it unless its settings box says otherwise: the reward gradient on the last
# GUIDED_FRACTION of the steps only, at scale GUIDANCE_SCALE. With the embedded CLIP on tiny-shapes, `diffrl steer`'s
# own defaults (scale 1 on every step) lowered both the CLIP score and the verifier; these raised the CLIP score and
# kept the verifier (docs/demo.md has the measurement, `python -m demo.measure_guidance` reruns it).
GUIDANCE_SCALE = 2.0
GUIDED_FRACTION = 0.15
PREVIEW_SIZE = 128  # images smaller than this are enlarged (nearest neighbour) for the page
MAX_PREVIEWS = 8  # rows decoded for an intermediate preview

# Rewards that always run here: the embedded ShapesWorld ones and the pixel-only JPEG size.
EMBEDDED_REWARDS = {
    "shapes_verifier": {"name": "shapes_verifier"},
    "clip_score (tiny-shapes-clip)": {"name": "clip_score", "kwargs": {"model": "tiny-shapes-clip"}},
    "pickscore (tiny-shapes-pickscore)": {"name": "pickscore", "kwargs": {"model": "tiny-shapes-pickscore"}},
    "jpeg_compressibility": {"name": "jpeg_compressibility"},
}
# Each embedded reward's mean and spread (standard deviation) over plain samples of the embedded tiny-shapes: 64
# held-out prompts x 2 seeds at the Generate page's defaults (`python -m demo.measure_reward_scales`; docs/demo.md has
# the table). With several rewards weighted the total standardises each by them (`combine`), so that a weight of 1
# moves the total as much on one reward as on another: raw, PickScore's spread is 8 times the verifier's, CLIP's 50.
REWARD_STATS = {
    "shapes_verifier": (0.53, 0.40),
    "clip_score (tiny-shapes-clip)": (71.1, 21.4),
    "pickscore (tiny-shapes-pickscore)": (11.8, 3.1),
    "jpeg_compressibility": (-1.08, 0.144),
}
# Real reward models with default weights, and the hub files that must already be on disk to offer them: the demo
# never downloads a reward model (other weights can be scored with `diffrl score --reward-arg`).
REAL_REWARDS = {
    "clip_score": ({"name": "clip_score"}, [("openai/clip-vit-large-patch14", "config.json")]),
    "pickscore": ({"name": "pickscore"}, [("yuvalkirstain/PickScore_v1", "config.json"),
                                           ("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "preprocessor_config.json")]),
    "hpsv2": ({"name": "hpsv2"}, [("xswu/HPSv2", "HPS_v2_compressed.pt")]),
    "hpsv21": ({"name": "hpsv21"}, [("xswu/HPSv2", "HPS_v2.1_compressed.pt")]),
    "imagereward": ({"name": "imagereward"}, [("THUDM/ImageReward", "ImageReward.pt"),
                                               ("bert-base-uncased", "vocab.txt")]),
}


def _cached_on_disk(repo_id: str, filename: str) -> bool:
    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except (OSError, ValueError):  # a malformed cache folder or repo id means "not there", not a broken page
        return False


def available_rewards() -> dict[str, dict]:
    """Label -> reward spec (`{"name", "kwargs"}`) of every reward that can run here without a download."""
    table = {}
    for label, spec in EMBEDDED_REWARDS.items():
        model = (spec.get("kwargs") or {}).get("model")
        if model is None or is_built(model):
            table[label] = spec
    for label, (spec, files) in REAL_REWARDS.items():
        if all(_cached_on_disk(repo, name) for repo, name in files):
            table[label] = spec
    return table


def list_pipelines() -> list[str]:
    """Embedded pipelines that are built, then hub pipelines in the local cache (as `diffrl ls pipelines`)."""
    return [name for name, what in _ls_pipelines() if "not built" not in what]


def pipeline_of_run(run_dir: str) -> str:
    """A run dir's `model.pipeline` (the base its LoRA was trained on)."""
    try:
        pipeline = rundir.pipeline_of_run(rundir.run_config_of(run_dir))
    except UserError:
        pipeline = None
    if not pipeline:
        raise UserError(f"{run_dir} is not a run dir with a config.yaml that names model.pipeline; "
                        "give the pipeline too")
    return pipeline


def run_size(lora: str | None, height: int | None = None, width: int | None = None) -> dict[str, int | None]:
    """The size to draw a run's LoRA at: `height` / `width` where given, else the run's training size (its
    sample.height / sample.width, as `diffrl sample --lora RUN` takes it); None for the pipeline's own."""
    size = rundir.sampling_size_of_run(rundir.run_config_of(lora), {"height": height, "width": width},
                                       {"height": "a height", "width": "a width"})
    return {key: value or None for key, value in size.items()}  # 0: the pipeline's own


def model_image(image):
    """`[3, H, W]` tensor in [0, 1] -> PIL image of the model's own pixels (what `diffrl sample` saves)."""
    array = (image.detach().float().cpu().clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    return Image.fromarray(array)


def display_image(image, size: int = PREVIEW_SIZE):
    """`[3, H, W]` tensor in [0, 1] -> PIL image, enlarged with nearest neighbour to about `size` when it is tiny."""
    return enlarge(model_image(image), size)


def enlarge(picture, size: int = PREVIEW_SIZE):
    """A PIL image enlarged by a whole factor with nearest neighbour to about `size` when it is smaller."""
    factor = max(1, size // max(picture.size))
    if factor > 1:
        picture = picture.resize((picture.width * factor, picture.height * factor), Image.NEAREST)
    return picture


@dataclass
class Combination:
    """How the page's reward weights make one total.

    One weighted reward: the total is its score × its weight, as `diffrl steer --reward` steers on it. Several: each
    is standardised by its `REWARD_STATS` (mean, spread) before it is weighted,

        total = Σ weight · (score − mean) / spread,

    so that weights compare across rewards; one without measured stats (a real model's) enters raw, as mean 0 and
    spread 1, and `raw` names it. Steering runs on Σ (weight / spread) · score (`acting_weights`): the means shift
    every total by the same constant (`offset`), which no method's choice or gradient depends on.
    """

    weights: dict[str, float]  # label -> the page's weight (the non-zero ones)
    stats: dict[str, tuple[float, float]]  # label -> (mean, spread) it is standardised by; (0, 1) = as it is
    raw: list[str]  # of several weighted rewards, those without measured stats

    @property
    def acting_weights(self) -> dict[str, float]:
        """What each raw score is multiplied by in the sum the methods steer on."""
        return {label: w / self.stats[label][1] for label, w in self.weights.items()}

    @property
    def offset(self) -> float:
        """The steered sum minus the total (the same for every image)."""
        return sum(w * self.stats[label][0] / self.stats[label][1] for label, w in self.weights.items())

    def term(self, label: str, score: float) -> float:
        """`label`'s part of the total for its raw `score`."""
        mean, spread = self.stats[label]
        return self.weights[label] * (score - mean) / spread


def combine(weights: dict[str, float]) -> Combination:
    """The `Combination` of the page's weights (label -> weight; 0 = off)."""
    chosen = {label: float(w) for label, w in weights.items() if w}
    if len(chosen) == 1:
        return Combination(chosen, {label: (0.0, 1.0) for label in chosen}, [])
    return Combination(chosen, {label: REWARD_STATS.get(label, (0.0, 1.0)) for label in chosen},
                       [label for label in chosen if label not in REWARD_STATS])


@dataclass
class Report:
    """What a long request tells the page while it runs: progress in [0, 1], a line of text, preview images."""

    fraction: float
    text: str
    images: list = field(default_factory=list)  # PIL images


@dataclass
class Scored:
    """One generated image with its scores: `scores[label]` each reward's raw score, `total` their `Combination`."""

    image: object  # PIL image as shown (tiny outputs enlarged)
    prompt: str
    seed: int
    total: float
    scores: dict[str, float]
    pixels: object = None  # PIL image of the model's own pixels (the downloads hold these)

    def caption(self) -> str:
        """Short enough for a gallery thumbnail: the reward first, then the seed (the per-reward breakdown is in the
        page's table)."""
        return f"{self.total:.3f} · seed {self.seed}"


@dataclass
class Generation:
    items: list[Scored]  # sorted by total reward, best first
    nfe: int  # model evaluations (a classifier-free-guidance pair counts once)
    seconds: float
    info: dict


def page_defaults(method: str, steps: int) -> dict:
    """The settings the page gives `method` at `steps` steps where they differ from `diffrl steer`'s (typed settings
    win): reward guidance at `GUIDANCE_SCALE` on the last `GUIDED_FRACTION` of the steps (at least one)."""
    if method == "guidance":
        return {"scale": GUIDANCE_SCALE, "start": steps - max(1, round(GUIDED_FRACTION * steps))}
    return {}


def parse_settings(text: str) -> dict:
    """`key=value` pairs (one per line or separated by commas; values are YAML), as `diffrl steer --set`."""
    settings = {}
    for item in (text or "").replace(",", "\n").splitlines():
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"method setting '{item.strip()}' is not key=value (for example lmbda=10)")
        settings[key.strip()] = parse_yaml(value.strip(), f"method setting '{item.strip()}'")
    return settings


def parse_cads_setting(text: str | None):
    """The page's CADS box as a `CADSConfig`, or None for off: `"off"` or nothing (off), `"on"` (the defaults) or
    any of `tau1=0.6,tau2=0.9,noise_scale=0.25,mix=1,seed=0`, as `diffrl sample --cads` takes it."""
    text = (text or "").strip()
    if text in ("", "off"):
        return None
    from samplers.cads import parse_cads  # deferred: samplers.cads imports torch

    return parse_cads(text)


def parse_seed(value) -> int:
    """A seed from the page: a whole number in 0..2**64 - 1 (what a torch generator takes), else a `UserError`."""
    if value is None or value == "":
        return 0
    try:
        number = value if isinstance(value, int) else float(value)  # an int stays exact (2**64 - 1 is no float)
        whole = int(number)
    except (TypeError, ValueError, OverflowError):  # not a number, NaN or infinite
        raise UserError(f"seed must be a whole number from 0 to {checks.MAX_SEED}, got {value}") from None
    if whole != number or not 0 <= whole <= checks.MAX_SEED:
        shown = f"{float(number):g}" if abs(number) >= 1e20 or whole != number else str(whole)
        raise UserError(f"seed must be a whole number from 0 to {checks.MAX_SEED} (the largest seed torch takes), "
                        f"got {shown}")
    return whole


class _Watched:
    """A steering `DenoisingProcess` that reports what the method does: x̂0 previews as the chain runs, and every
    batch the method decodes to score (FK's particle population at each scheduled step, ReNO's iterations)."""

    def __init__(self, process, report: Callable[[Report], None], label: str, total_decodes: int | None):
        self._process = process
        self._report = report
        self._label = label
        self._total_decodes = total_decodes
        self._decodes = 0
        self._last_step = -1
        self._every = max(1, process.num_steps // 4)  # about four previews: each costs a VAE decode

    def __getattr__(self, name):
        return getattr(self._process, name)

    def step(self, model_output, step_index, latents, *, generator=None):
        out = self._process.step(model_output, step_index, latents, generator=generator)
        if step_index != self._last_step:  # SVDD steps every candidate: report each step index once
            self._last_step = step_index
            fraction = (step_index + 1) / self.num_steps
            if self._total_decodes:
                fraction = min(self._decodes / self._total_decodes, 1.0)
            images = []
            if step_index % self._every == 0 and step_index < self.num_steps - 1:
                import torch  # deferred: see the module docstring

                with torch.no_grad():
                    decoded = self._process.decode(out.pred_x0[:MAX_PREVIEWS].detach())
                images = [display_image(x) for x in decoded]
            text = f"{self._label}: step {step_index + 1}/{self.num_steps}"
            self._report(Report(fraction, text + (" (x̂0 preview)" if images else ""), images))
        return out

    def decode(self, latents):
        images = self._process.decode(latents)
        self._decodes += 1
        fraction = min(self._decodes / self._total_decodes, 1.0) if self._total_decodes else max(
            (self._last_step + 1) / self.num_steps, 0.0)
        what = f"iteration {self._decodes}" if self._total_decodes else f"scored population {self._decodes}"
        self._report(Report(fraction, f"{self._label}: {what} ({len(latents)} samples)",
                            [display_image(x) for x in images[: 4 * MAX_PREVIEWS]]))
        return images


class Engine:
    """The loaded models of one demo process, and the work the pages ask for.

    Args:
        device (`str`, *optional*): torch device; CUDA when available, else CPU.
        dtype (`str`, *optional*, defaults to `"fp32"`): pipeline weights dtype.
        max_pipelines (`int`, *optional*, defaults to 3): pipelines kept loaded (base and fine-tuned for Compare,
            plus one).
    """

    def __init__(self, device: str | None = None, dtype: str = "fp32", max_pipelines: int = 3):
        self.device = device
        self.dtype = dtype
        self.max_pipelines = max_pipelines
        self._pipes: OrderedDict[tuple, object] = OrderedDict()
        self._rewards: dict[str, object] = {}
        self._lock = threading.Lock()
        self._reward_table: dict[str, dict] | None = None

    # -- models -----------------------------------------------------------------------------------------------

    def _device(self) -> str:
        if self.device is None:
            import torch  # deferred: see the module docstring

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def pipeline(self, name: str, lora: str | None = None):
        """The pipeline `name` (embedded, folder or cached hub id), with the LoRA of a run dir or folder if given."""
        name = (name or "").strip()
        lora = (lora or "").strip() or None
        if lora and not name:
            name = pipeline_of_run(lora)
        if not name:
            raise UserError("no pipeline: pick one (tiny-shapes) or type a local folder or hub id")
        kind, where = resolve_pipeline_name(name)  # a bad name fails here, before anything loads
        if kind == "hub" and not _cached_on_disk(str(where), "model_index.json"):
            raise UserError(f"pipeline '{name}' is not in the local Hugging Face cache and the demo downloads "
                            f"nothing; fetch it first (`hf download {name}`) or give a local folder")
        if lora:
            find_trained_weights(lora)  # a run dir without checkpoints fails here
        key = (name, str(Path(lora).resolve()) if lora else None, self._device(), self.dtype)
        with self._lock:
            if key in self._pipes:
                self._pipes.move_to_end(key)
                return self._pipes[key]
            pipe = load_pipeline(name, dtype=self.dtype, device=self._device(), lora=lora)
            self._pipes[key] = pipe
            while len(self._pipes) > self.max_pipelines:
                self._pipes.popitem(last=False)
            return pipe

    def reward_table(self) -> dict[str, dict]:
        if self._reward_table is None:
            self._reward_table = available_rewards()
        return self._reward_table

    def reward(self, weights: dict[str, float]):
        """`(reward, combination)`: the sum the methods steer on, of the rewards with a non-zero weight, each times
        its acting weight (`Combination`; one reward alone at weight 1 is itself), and how the total is made."""
        table = self.reward_table()
        combination = combine(weights)
        if not combination.weights:
            raise UserError("every reward weight is 0: give at least one reward a non-zero weight")
        unknown = [label for label in combination.weights if label not in table]
        if unknown:
            raise UserError(f"reward '{unknown[0]}' cannot run here; choose from {', '.join(table)}")
        acting = combination.acting_weights
        key = json.dumps(sorted(acting.items()))
        with self._lock:
            if key not in self._rewards:
                specs = [{**table[label], "label": label} for label in acting]
                if len(specs) == 1 and list(acting.values()) == [1.0]:
                    specs = [{k: v for k, v in specs[0].items() if k != "label"}]
                self._rewards[key] = resolve_reward(specs, list(acting.values()))
            return self._rewards[key], combination

    def _score(self, reward, combination: Combination, images, prompts: list[str]):
        """(total `[B]`, per-label raw scores `{label: [B]}`) for images `[B, 3, H, W]` in [0, 1]."""
        import torch  # deferred: see the module docstring

        with torch.no_grad():
            out = reward(images, prompts, None)
        steered = out.scores.detach().float().cpu().tolist()
        per_label = {}
        for label in combination.weights:
            value = out.info.get(label)  # a weighted sum logs each term's raw score; a reward alone is its score
            per_label[label] = value.float().cpu().tolist() if isinstance(value, torch.Tensor) else steered
        return [value - combination.offset for value in steered], per_label

    # -- Generate / steer -------------------------------------------------------------------------------------

    def generate(
        self,
        *,
        pipeline: str,
        lora: str | None,
        prompt: str,
        negative_prompt: str | None,
        seed: int,
        steps: int,
        guidance_scale: float,
        num_images: int,
        method: str,
        budget: int,
        settings: str,
        weights: dict[str, float],
        report: Callable[[Report], None] = lambda r: None,
        runs_root: str | None = None,
        height: int | None = None,
        width: int | None = None,
        cads: str | None = None,
    ) -> Generation:
        """Generate `num_images` images for one prompt, plainly or steered, scored and sorted by reward. With
        `runs_root`, the LoRA (a run dir or LoRA folder) must be a folder under it, as on the Compare page. The size:
        `height` / `width` where given, else a run's LoRA's training size (its sample.height / sample.width, as
        `diffrl sample --lora RUN` takes it), else the pipeline's. `cads`: condition-annealed sampling in every model
        call, as `diffrl sample --cads` / `diffrl steer --cads` take it (`"off"`, `"on"`, `"tau1=0.5,tau2=0.8"`)."""
        lora = (lora or "").strip() or None
        if lora and runs_root is not None:
            # where it is, and that it exists, before anything is read from it (`pipeline_of_run` reads config.yaml)
            path = under_runs_root(lora, runs_root, "Generate")
            if not path.is_dir():
                raise UserError(f"LoRA {lora} " + ("is not a folder" if path.exists() else "does not exist"))
            lora = str(path)
        prompt = (prompt or "").strip()
        if not prompt:
            raise UserError("the prompt is empty: type what to draw")
        if method not in METHODS:
            raise UserError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
        steps, num_images, budget = int(steps), int(num_images), int(budget)
        if steps < 1 or num_images < 1 or budget < 1:
            raise UserError(f"steps, images and budget must be at least 1, got {steps}, {num_images}, {budget}")
        check_at_most("steps", steps, MAX_NUM_STEPS)  # the bounds of `diffrl steer` (diffrl/steering/bounds.py)
        check_at_most("images", num_images, MAX_DEMO_IMAGES)
        if guidance_scale is None or guidance_scale < 0 or math.isnan(guidance_scale):
            raise UserError(f"guidance scale must be >= 0, got {guidance_scale}")
        seed = parse_seed(seed)
        checks.check_seeds("seed", seed, num_images)  # image i uses seed + i
        for key, value in (("height", height), ("width", width)):
            if value is not None:
                checks.check_number(key, value, low=1, high=MAX_IMAGE_SIDE)
        size = run_size(lora, height, width)
        negative_prompt = (negative_prompt or "").strip() or None
        cfg = parse_settings(settings)
        cads_config = parse_cads_setting(cads)  # a bad setting fails before loading
        if method != "plain":
            cfg = {BUDGET_SETTING[method]: budget, **page_defaults(method, steps), **cfg}
            config = method_config(method, **cfg)  # unknown settings and sizes beyond the bounds fail before loading
            check_call_rows(method, config, num_images, fewer="fewer images")
        reward, combination = self.reward(weights)
        check_prompts(reward, [prompt])
        if method in ("guidance", "reno") and not reward.differentiable:
            raise UserError(f"{method} needs a differentiable reward and the chosen one is not (shapes_verifier and "
                            "jpeg are not); weight a CLIP or PickScore reward instead, or use best-of-n, fk or svdd")
        report(Report(0.0, f"loading {pipeline or lora}"))
        pipe = self.pipeline(pipeline, lora)
        checks.check_num_steps("steps", steps, dict(pipe.scheduler.config))
        prompts = [prompt] * num_images
        started = time.perf_counter()
        if method == "plain":
            seeds = [seed + i for i in range(num_images)]  # as `diffrl sample`: image i uses seed + i
            images, info = self._sample(pipe, prompts, seeds, steps, guidance_scale, negative_prompt, report,
                                        size, cads_config)
            nfe = steps * num_images
        else:
            # one steering call per image, image i from seed + i: as `diffrl steer --prompts-per-call 1`, each image
            # is reproducible from the seed in its caption
            chunks, nfe, info = [], 0, {}
            seeds = [seed + i for i in range(num_images)]
            total_decodes = cfg[BUDGET_SETTING["reno"]] if method == "reno" else None
            for i, image_seed in enumerate(seeds):
                def image_report(r: Report, i=i):
                    report(Report((i + r.fraction) / num_images,
                                  (f"image {i + 1}/{num_images}, " if num_images > 1 else "") + r.text, r.images))

                def watch(process, image_report=image_report):
                    return _Watched(process, image_report, method, total_decodes)

                images, _, info = steer(pipe, [prompt], reward, method, num_steps=steps,
                                        guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                                        seed=image_seed, process_wrapper=watch, cads=cads_config, **size, **cfg)
                chunks.append(images.float().clamp(0, 1))
                nfe += int(info["nfe"])
            import torch  # deferred: see the module docstring

            images = torch.cat(chunks)
        seconds = time.perf_counter() - started
        total, per_label = self._score(reward, combination, images, prompts)
        items = [Scored(display_image(images[i]), prompt, seeds[i], total[i],
                        {label: values[i] for label, values in per_label.items()}, model_image(images[i]))
                 for i in range(len(prompts))]
        items.sort(key=lambda item: -item.total if math.isfinite(item.total) else math.inf)
        return Generation(items, nfe, seconds, info)

    def _sample(self, pipe, prompts, seeds, steps, guidance_scale, negative_prompt, report, size, cads=None):
        """Plain sampling exactly as `diffrl sample` does it: the pipeline's own sampler and its default eta, each
        image drawn from its own seed, with CADS if `cads` (a `CADSConfig`) is given, as `diffrl sample --cads`.
        Returns (images `[B, 3, H, W]` in [0, 1], settings)."""
        import torch  # deferred: see the module docstring

        from samplers import CADSHook, StepHook, get_sampler  # deferred: samplers' classes import torch and diffusers

        sampler = get_sampler("auto", pipe)
        every = max(1, steps // 4)  # about four previews: each costs a VAE decode

        def preview(ctx):
            images = []
            if ctx.step_index % every == 0 and ctx.step_index < ctx.num_steps - 1:
                images = [display_image(x) for x in ctx.decode(ctx.step.pred_x0[:MAX_PREVIEWS])]
            report(Report((ctx.step_index + 1) / ctx.num_steps,
                          f"step {ctx.step_index + 1}/{ctx.num_steps}" + (" (x̂0 preview)" if images else ""),
                          images))

        kwargs = {"negative_prompt": negative_prompt} if negative_prompt is not None else {}
        hooks = (StepHook(after=preview), *([CADSHook(cads)] if cads is not None else []))
        with torch.no_grad():
            traj = sampler.sample(pipe, prompts, num_steps=steps, guidance_scale=guidance_scale,
                                  eta=sampler.default_eta, seeds=seeds, hooks=hooks, **size, **kwargs)
        info = {"sampler": sampler.name, "num_steps": steps, "guidance_scale": guidance_scale,
                "eta": sampler.default_eta, "cads": asdict(cads) if cads is not None else None}
        return traj.images.float().clamp(0, 1), info

    # -- Compare ----------------------------------------------------------------------------------------------

    def compare(
        self,
        *,
        run_dir: str,
        other_run_dir: str | None,
        pipeline: str | None,
        prompts: str,
        images_per_prompt: int,
        seed: int,
        steps: int,
        guidance_scale: float,
        weights: dict[str, float],
        report: Callable[[Report], None] = lambda r: None,
        runs_root: str | None = None,
    ) -> dict:
        """Base (or a second run) vs a fine-tuned run on the same prompts and seeds, each image scored. Each run
        draws at the size it trained at (its sample.height / sample.width), the base model at the fine-tuned run's.

        Returns `{"left": label, "right": label, "rows": [...], "left_items": [Scored], "right_items": [Scored],
        "left_mean": float, "right_mean": float}`; row `i` holds prompt, seed and both sides' rewards. With
        `runs_root`, both run dirs (or LoRA folders) must be folders under it, as on the Runs page.
        """
        run_dir = (run_dir or "").strip()
        other = (other_run_dir or "").strip() or None
        if not run_dir:
            raise UserError("no run dir: give the fine-tuned run dir (or a LoRA folder) to compare")
        prompt_list = [p.strip() for p in (prompts or "").splitlines() if p.strip()]
        if not prompt_list:
            raise UserError("no prompts: type one prompt per line")
        n, steps = int(images_per_prompt), int(steps)
        if n < 1 or steps < 1:
            raise UserError(f"images per prompt and steps must be at least 1, got {n} and {steps}")
        check_at_most("steps", steps, MAX_NUM_STEPS)
        check_at_most(f"prompts × images per prompt ({len(prompt_list)} × {n})", len(prompt_list) * n,
                      MAX_DEMO_IMAGES)
        for what, text in (("run dir", run_dir), ("second run dir", other)):
            if text is None:
                continue
            # where it is, and that it exists, before anything is read from it (`pipeline_of_run` reads config.yaml)
            path = Path(text).expanduser() if runs_root is None else under_runs_root(text, runs_root, "Compare")
            if not path.is_dir():
                raise UserError(f"{what} {text} " + ("is not a folder" if path.exists() else "does not exist"))
            if what == "run dir":
                run_dir = str(path)
            else:
                other = str(path)
        base = (pipeline or "").strip() or pipeline_of_run(other or run_dir)
        reward, combination = self.reward(weights)
        # each run at the size it trained at (as Generate and `diffrl sample --lora` draw it); the base model at the
        # fine-tuned run's, so that both sides of a pair start from the same noise
        sides = [(other or f"base ({base})", other, run_size(other or run_dir)), (run_dir, run_dir, run_size(run_dir))]
        seed = parse_seed(seed)
        checks.check_seeds("seed", seed, len(prompt_list) * n)
        check_prompts(reward, prompt_list)
        jobs = [(p, seed + i * n + k) for i, p in enumerate(prompt_list) for k in range(n)]
        results = []
        for index, (label, lora, size) in enumerate(sides):
            report(Report(index / 2, f"loading {label}"))
            pipe = self.pipeline(base, lora)
            checks.check_num_steps("steps", steps, dict(pipe.scheduler.config))

            def side_report(r: Report, index=index, label=label):
                report(Report((index + r.fraction) / 2, f"{label}: {r.text}", r.images))

            images = self._sample_jobs(pipe, jobs, steps, guidance_scale, side_report, size)
            total, per_label = self._score(reward, combination, images, [p for p, _ in jobs])
            results.append([Scored(display_image(images[j]), p, s, total[j],
                                   {label: values[j] for label, values in per_label.items()}, model_image(images[j]))
                            for j, (p, s) in enumerate(jobs)])
        left, right = results
        rows = [{"prompt": a.prompt, "seed": a.seed, "left": a.total, "right": b.total, "difference": b.total - a.total}
                for a, b in zip(left, right)]
        return {"left": sides[0][0], "right": sides[1][0], "rows": rows, "left_items": left, "right_items": right,
                "left_mean": sum(i.total for i in left) / len(left),
                "right_mean": sum(i.total for i in right) / len(right)}

    def _sample_jobs(self, pipe, jobs, steps, guidance_scale, report, size):
        """Plain sampling of (prompt, seed) jobs in batches of 8; an image depends only on its prompt and seed."""
        import torch  # deferred: see the module docstring

        chunks = []
        for start in range(0, len(jobs), 8):
            batch = jobs[start : start + 8]

            def batch_report(r: Report, done=start, size=len(batch)):  # noqa: B008 (bound now, on purpose)
                report(Report((done + r.fraction * size) / len(jobs), r.text, r.images))

            images, _ = self._sample(pipe, [p for p, _ in batch], [s for _, s in batch], steps, guidance_scale, None,
                                     batch_report, size)
            chunks.append(images)
        return torch.cat(chunks)

    # -- Score ------------------------------------------------------------------------------------------------

    def score(self, paths: list[str], prompt: str, labels: list[str] | None = None):
        """Every reward that can run here (or `labels`) on each image file against `prompt`.

        Returns `(rows, details, skipped)`: per image `{"file", <label>: score, ...}` (files by their original
        name; `None` for a skipped reward), per image the verifier's per-clause verdicts (`{"file", "clauses",
        "objects", "background"}`, when `shapes_verifier` ran), and `{label: reason}` of the rewards that cannot read
        `prompt` (the others still score; all failing is a `UserError`).
        """
        import torch  # deferred: see the module docstring

        prompt = (prompt or "").strip()
        if not paths:
            raise UserError("no images: upload one or more image files")
        if not prompt:
            raise UserError("the prompt is empty: type the prompt the images should match")
        table = self.reward_table()
        labels = list(labels or table)
        unknown = [label for label in labels if label not in table]
        if unknown:
            raise UserError(f"reward '{unknown[0]}' cannot run here; choose from {', '.join(table)}")
        rewards = {}
        for label in labels:
            with self._lock:
                key = json.dumps([label])
                if key not in self._rewards:
                    spec = table[label]
                    self._rewards[key] = get_reward(spec["name"], **dict(spec.get("kwargs") or {}))
                rewards[label] = self._rewards[key]
        names = {str(path): _original_name(path) for path in paths}
        try:
            check_uploads(paths)  # every file's bytes and pixels (from its header) before any is decoded
        except UserError as e:
            raise UserError(_rename(str(e), names)) from None
        # a reward that reads the prompt and cannot read this one (the verifier: "a cat wearing sunglasses") is left
        # out with its reason; the others still score
        skipped = {}
        for label in list(rewards):
            try:
                check_prompts(rewards[label], [prompt])
            except UserError as e:
                skipped[label] = " ".join(str(e).split())
                del rewards[label]
        if not rewards:
            raise UserError("; ".join(f"{label}: {reason}" for label, reason in skipped.items()))
        rows, details = [], []
        for path in paths:  # one image decoded at a time: a request holds one image's tensor
            try:
                (image,) = load_images([str(path)])  # `diffrl score`'s reading and decompression-bomb check
            except UserError as e:
                raise UserError(_rename(str(e), names)) from None
            row = {"file": names[str(path)]}
            for label in labels:
                if label in skipped:
                    row[label] = None
                    continue
                with torch.no_grad():
                    out = rewards[label](image, [prompt], None)
                row[label] = float(out.scores[0])
                if "details" in out.info:
                    details.append({"file": row["file"], **out.info["details"][0]})
            rows.append(row)
        return rows, details, skipped


def _original_name(path) -> str:
    """The name a file had on the uploader's machine: gradio keeps it as the last part of its upload path
    (`<temp>/<hash>/<name>`)."""
    return Path(str(path)).name


def _rename(message: str, names: dict[str, str]) -> str:
    """`message` with each upload's temporary path replaced by its original name."""
    for path, name in sorted(names.items(), key=lambda item: -len(item[0])):
        message = message.replace(path, name)
    return message


def check_uploads(paths: list) -> None:
    """Refuse, before decoding any, more than `MAX_UPLOAD_FILES` files, a file over `MAX_UPLOAD_BYTES`, or an image
    over `MAX_UPLOAD_PIXELS` (read from its header; a file PIL cannot open gets `diffrl score`'s message)."""
    if len(paths) > MAX_UPLOAD_FILES:
        raise UserError(f"{len(paths)} images uploaded; score at most {MAX_UPLOAD_FILES} at once")
    for path in paths:
        name = Path(path).name
        if not Path(path).is_file():
            load_images([str(path)])  # its one-line message for a missing file
        size = os.path.getsize(path)
        if size > MAX_UPLOAD_BYTES:
            raise UserError(f"image {name} is {size} bytes, more than the bound of {MAX_UPLOAD_BYTES} "
                            f"({MAX_UPLOAD_BYTES // 2**20} MiB); resize it first")
        try:
            with warnings.catch_warnings():  # the bound below is tighter than PIL's warning
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(path) as image:
                    width, height = image.size
        except Exception:  # not an image, or over twice PIL's bound: `diffrl score` says which
            load_images([str(path)])
            raise
        if width * height > MAX_UPLOAD_PIXELS:
            raise UserError(f"image {name} is {width}x{height} = {width * height} pixels, more than the bound of "
                            f"{MAX_UPLOAD_PIXELS} ({MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE}); resize it first")
