"""The diffrl demo: a gradio app to generate and steer, compare base and fine-tuned models, score images, browse run
dirs and label preference pairs. `diffrl demo` starts it; `build_app()` returns the `gr.Blocks` for tests and embedding.

Pages (one tab each, every action also an API endpoint that `gradio_client` can call by its `api_name`):

- Generate / steer (`/generate`): a pipeline (embedded, local folder or cached hub id) with an optional LoRA, a method
  (plain sampling or best-of-N, FK, SVDD, reward guidance, ReNO) with its budget, rewards with one weight each; the
  images sorted by reward, NFE and seconds. x̂0 previews, FK's scored particle populations and ReNO's iterations
  stream into a second gallery while the request runs.
- Compare (`/compare`): a fine-tuned run against its base (or against another run) on the same prompts and seeds.
- Score (`/score`): every reward that can run here on uploaded images, with the verifier's per-clause verdicts.
- Runs (`/run`): a run dir's reward curves, metrics, sample grids by epoch and config.
- Label (`/label_load`, `/label_first`, ...): preference pairs from `diffrl pairs sample`, written back to
  `pairs.jsonl` at every click (keys 1 / 2 / T, arrows, S to skip, B to go back).

The work itself is in `engine.py` (no gradio), `runs.py` and `labels.py`. Model work runs in one gradio concurrency
group with a limit (`concurrency`, default 1): requests queue on the model instead of competing for it. Bad input
raises `gr.Error` with the one-line message the command line would print; the app keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import html
import inspect
import io
import json
import math
import os
import queue
import random
import re
import shutil
import tempfile
import threading
import time
import weakref
import zipfile
from pathlib import Path

# Before gradio is imported anywhere: no usage analytics and no version checks leave this machine.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import gradio as gr
import pandas as pd
from PIL import Image

from diffrl.errors import UserError
from diffrl.rundir import list_checkpoints
from diffrl.steering import method_config
from diffrl.steering.bounds import MAX_ITERATIONS, MAX_LATENT_ROWS, MAX_UPLOAD_BYTES
from rewards.registry import declared_differentiable

from . import labels as labels_io
from .engine import (
    BUDGET_SETTING,
    GUIDANCE_SCALE,
    GUIDED_FRACTION,
    METHODS,
    Engine,
    Report,
    combine,
    enlarge,
    list_pipelines,
    page_defaults,
    parse_seed,
)
from .runs import compare_defaults, find_runs, read_run

MODEL_QUEUE = "model"  # the concurrency group of every event that runs a model
STREAM_INTERVAL_S = 0.25  # at most this often a preview is pushed to the page
DEFAULT_PROMPT = "a red circle above a blue square"
DEFAULT_WEIGHTS = {"shapes_verifier": 1.0}
DEFAULT_STEPS = 20

# Galleries wrap their columns instead of clipping the last one (gradio's thumbnails keep a minimum width, so 4 or 8
# columns overflowed a narrow column: 7.x of 8 previews, 3 of 4 on a phone), and a caption wraps instead of being cut.
STYLE = """
<style>
.gallery-container .grid-container {
  grid-template-columns: repeat(auto-fill, minmax(max(96px, calc(100% / var(--grid-cols, 4) - 12px)), 1fr)) !important;
}
.gallery-container .thumbnail-item { min-width: 0 !important; }
/* Generate's and Compare's galleries grow with their images instead of scrolling inside a box of 55 % of the window
   (gradio's height="auto"): Compare's sides hold up to 64 images, and a person compares them at a glance; with
   images, no empty box below them (gradio keeps 320 px and more for an empty gallery's placeholder). The Runs page's
   grids, one per epoch, keep the box. */
:is(#gallery, #previews, #compare-left, #compare-right) .grid-wrap.fixed-height { max-height: none !important; }
:is(#gallery, #previews, #compare-left, #compare-right) .grid-wrap.fixed-height:has(.thumbnail-item) {
  min-height: 0 !important;
}
/* Generate's results and previews no narrower than 140 px (two columns in a phone's or a 900 px window's column):
   at 96 px a thumbnail's caption wrapped to two lines and covered a third of its image */
:is(#gallery, #previews) .grid-container {
  grid-template-columns: repeat(auto-fill, minmax(max(140px, calc(100% / var(--grid-cols, 4) - 12px)), 1fr)) !important;
}
/* the gallery's label floats over its box: start the first row below it, not under it */
:is(#gallery, #previews, #compare-left, #compare-right) .grid-wrap { padding-top: 32px !important; }
#generate-summary, #compare-summary { scroll-margin-top: 8px; }
.gallery-container .caption-label {
  white-space: normal !important; max-width: calc(100% - 8px) !important; overflow: visible !important;
  text-overflow: clip !important;
}
</style>
"""

# Keyboard shortcuts of the Label page: a key clicks the button with that elem_id while the Label tab is shown.
SHORTCUTS_JS = """
<script>
document.addEventListener("keydown", (event) => {
  const target = event.target;
  if (target && (target.tagName === "INPUT" || target.tagName === "TEXTAREA" || target.isContentEditable)) return;
  const keys = {"1": "label-first", "ArrowLeft": "label-first", "2": "label-second", "ArrowRight": "label-second",
                "t": "label-tie", "ArrowDown": "label-tie", "s": "label-skip", "b": "label-back"};
  const id = keys[event.key];
  const button = id && document.getElementById(id);
  if (!button || button.offsetParent === null) return;  // not on the Label tab
  event.preventDefault();
  button.click();
});
</script>
"""
HEAD = STYLE + SHORTCUTS_JS
# the element to the top of the window unless it is already well in view (on a phone the results are below the inputs)
SCROLL_TO_JS = """() => { const e = document.getElementById('ID'); const r = e.getBoundingClientRect();
  if (r.top < 0 || r.top > window.innerHeight - 240) e.scrollIntoView({block: 'start', behavior: 'smooth'}); }"""  # what `launch(head=...)` gets


def _error(e: BaseException) -> gr.Error:
    """A message for the page: a `UserError` as the command line prints it, anything else with its type."""
    if isinstance(e, UserError):
        return gr.Error(_toast_html(" ".join(str(e).split())), print_exception=False)
    return gr.Error(_toast_html(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"), print_exception=True)


def _toast_html(message: str) -> str:
    """`message` as the page's error toast shows it: the toast renders HTML, so `<name>` must be escaped (it was
    swallowed as a tag, cutting "(runs/<name>)" at "(runs/") and `code` spans become <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(message, quote=False))


def _on_page(function):
    """`function` with every exception shown in the page as a `gr.Error` (the app keeps serving)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the page says so and the next request runs
            raise _error(e) from None

    return wrapper


class Stopped(Exception):
    """The page's Stop button (or a closed page) ended the request; raised in the model thread at its next step."""


def _stream(work, progress):
    """Run `work(report)` in a thread; yield `("report", Report)` while it runs (at most every STREAM_INTERVAL_S, and
    the last one held back before the end), then `("done", value)`.

    gradio runs a generator handler in a worker thread of its own; the model work runs in another so that previews
    and the progress bar reach the page while it computes. Stop (gradio's `cancels=`) closes this generator at a
    yield: the model thread then stops at its next report (each sampler step) instead of running on unseen, holding
    the model while the next request starts.
    """
    reports: queue.Queue = queue.Queue()
    outcome: dict = {}
    stop = threading.Event()

    def report(item):
        if stop.is_set():
            raise Stopped("stopped")
        reports.put(item)

    def run():
        try:
            outcome["value"] = work(report)
        except Exception as e:  # noqa: BLE001 - handed to the page below
            outcome["error"] = e
        finally:
            reports.put(None)

    # a first yield before any work: from here on gradio holds this generator and Stop can close it
    yield "report", Report(0.0, "starting")
    thread = threading.Thread(target=run, daemon=True, name="diffrl-demo-work")
    try:
        thread.start()
        last_yield, pending = 0.0, None
        while True:
            item = reports.get()
            if item is None:
                break
            progress(item.fraction, desc=item.text)
            if time.monotonic() - last_yield >= STREAM_INTERVAL_S:
                last_yield, pending = time.monotonic(), None
                yield "report", item
            else:
                pending = item
        if pending is not None:  # the last report the throttle held back (e.g. ReNO's last iteration) still shows
            yield "report", pending
        thread.join()
    finally:
        stop.set()  # closed (Stop) or done: a thread still running ends at its next step
    if "error" in outcome:
        raise _error(outcome["error"])
    yield "done", outcome["value"]


def _json_scores(items) -> list[dict]:
    return [{"prompt": i.prompt, "seed": i.seed, "total": i.total, **i.scores} for i in items]


def _results_zip(files_dir: Path, name: str, sides: dict[str, list], about: dict) -> str:
    """A zip of `sides` (folder in the zip -> scored images, in the page's order) for download: each image's own
    pixels (not the page's enlargement) as `<folder>/<rank>-seed<seed>.png`, and `scores.json` with `about` and, per image, its file,
    prompt, seed, total and each reward's score. Returns its path (in `files_dir`, which the app may serve)."""
    out = Path(tempfile.mkdtemp(dir=files_dir)) / f"{name}.zip"
    records = {}
    with zipfile.ZipFile(out, "w") as archive:
        for folder, items in sides.items():
            records[folder or "images"] = []
            for rank, item in enumerate(items, 1):
                file = f"{folder + '/' if folder else ''}{rank:02d}-seed{item.seed}.png"
                buffer = io.BytesIO()
                (item.pixels if item.pixels is not None else item.image).save(buffer, format="PNG")
                archive.writestr(file, buffer.getvalue())
                records[folder or "images"].append({"file": file, **_json_scores([item])[0]})
        archive.writestr("scores.json", json.dumps({**about, **records}, indent=2) + "\n")
    return str(out)


# -- what the Generate page says and offers ----------------------------------------------------------------------------

GRADIENT_METHODS = ("guidance", "reno")  # they differentiate the reward
BUDGET_INFO = f"per image; 1 to {MAX_LATENT_ROWS} ({MAX_ITERATIONS} for ReNO's iterations)"
METHOD_HELP = {
    "plain": "Plain sampling, exactly as `diffrl sample`: the rewards only score and sort the images. Image i uses "
             "seed + i. Budget is not used.",
    "best-of-n": "Draw **budget** samples per image and keep the one with the best reward (NFE = budget × steps "
                 "per image).",
    "fk": "Feynman-Kac steering: **budget** particles per image, resampled by reward every `interval` steps "
          "(`lmbda` sets how hard the reward tilts them).",
    "svdd": "SVDD: at each step, **budget** candidate next steps per image; the best by the reward of its "
            "predicted image is kept.",
    "guidance": "Reward guidance: the gradient of a **differentiable** reward (a CLIP or PickScore one) nudges the "
                f"steps; `scale` sets how hard, `start`/`end` which steps. The page guides the last "
                f"{GUIDED_FRACTION:.0%} of the steps at scale {GUIDANCE_SCALE:g}: with the embedded CLIP on "
                "tiny-shapes that raised the CLIP score and kept the verifier, where `diffrl steer`'s defaults (scale "
                "1 on every step) degraded the images (docs/demo.md). Switching here weights such a reward and sets "
                "budget 1 (budget k keeps the best of k guided samples).",
    "reno": "ReNO: optimise the initial noise of a one-step model for **budget** iterations against a "
            "differentiable reward (the embedded LCM, 1 step, is set for you; other methods restore yours).",
}
CADS_HELP = ("Works with every method: the early, noisy steps see the prompt's embedding annealed toward noise and "
             "the last steps the prompt itself, for more varied images at high guidance (Sadat et al., ICLR 2024). "
             "'on' = tau1=0.6, tau2=0.9, noise_scale=0.25, mix=1; or type any of them (tau1=0.5, tau2=0.8), as "
             "diffrl sample --cads. Each image or particle draws its own condition noise from its seed; on "
             "tiny-shapes it varied plain (η = 0) samples and changed little under steering (docs/steering.md).")
# (prompt, method, images, budget, {reward label: weight}) — each shows one feature on the embedded models
EXAMPLES = [
    ("a red circle above a blue square", "plain", 4, 4, {"shapes_verifier": 1.0}),
    ("three purple triangles", "best-of-n", 4, 8, {"shapes_verifier": 1.0}),
    ("a green triangle left of a yellow circle", "fk", 4, 4, {"shapes_verifier": 1.0}),
    ("two blue squares", "svdd", 2, 8, {"shapes_verifier": 1.0}),
    ("a yellow circle on a black background", "reno", 2, 10, {"clip_score (tiny-shapes-clip)": 1.0}),
    ("a blue circle right of a red square", "guidance", 2, 1, {"clip_score (tiny-shapes-clip)": 1.0}),
    ("a red square", "best-of-n", 4, 8, {"shapes_verifier": 1.0, "jpeg_compressibility": 0.1}),
]


def method_help_text(method: str) -> str:
    """What `method` does and the keys its settings box takes, with their defaults."""
    text = METHOD_HELP.get(method, "")
    if method == "plain" or method not in BUDGET_SETTING:
        return text
    config = method_config(method)
    page = page_defaults(method, DEFAULT_STEPS)

    def shown(name):
        if name == BUDGET_SETTING[method]:
            return f"`{name}={getattr(config, name)}` (the budget)"
        if name == "start" and "start" in page:
            return f"`start=steps − {GUIDED_FRACTION:.0%} of them` ({page['start']} at {DEFAULT_STEPS} steps)"
        return f"`{name}={page.get(name, getattr(config, name))}`"

    return f"{text}  \nSettings (Advanced options): {', '.join(shown(f.name) for f in dataclasses.fields(config))}"


def _weight_parameter_names(labels: list[str]) -> list[str]:
    """A Python name per reward weight for the API page: `weight_shapes_verifier`, `weight_clip_score_tiny_shapes_clip`."""
    names = []
    for label in labels:
        name = "weight_" + re.sub(r"\W+", "_", label).strip("_").lower()
        while name in names:
            name += "_"
        names.append(name)
    return names


def _signature_with_weights(function, weight_names: list[str]):
    """`function`'s signature with its `*weight_values` spelled out as one named parameter per reward, so the API
    page and gradio_client name them (gradio calls the function positionally, which `*weight_values` still takes)."""
    signature = inspect.signature(function)
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=0.0)
                           for name in weight_names]
        elif parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            parameters.append(parameter.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
        else:
            parameters.append(parameter)
    return signature.replace(parameters=parameters)


def _differentiable_weights(labels: list[str], engine: Engine, weights: list[float]) -> list[float]:
    """`weights` as they are if a differentiable reward is weighted, else the first differentiable reward at 1 and
    the others at 0 (guidance and ReNO need gradients; the verifier and JPEG give none)."""
    table = engine.reward_table()

    def differentiable(label):
        spec = table[label]
        return declared_differentiable(spec["name"], dict(spec.get("kwargs") or {})) is True

    weighted = [label for label, w in zip(labels, weights) if w]
    if weighted and all(differentiable(label) for label in weighted):
        return list(weights)
    first = next((label for label in labels if differentiable(label)), None)
    if first is None:
        return list(weights)
    return [1.0 if label == first else 0.0 for label in labels]


def _example_weights(labels: list[str], weights: dict[str, float]) -> list[float]:
    return [weights.get(label, 0.0) for label in labels]


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) and math.isfinite(value) else value


def _breakdown(items, weights: dict[str, float]):
    """A table per image: rank, seed, total, and each weighted reward's raw score and, with several, its part of the
    total (`weight × (score − mean) / spread`, the header spelling out the numbers)."""
    combination = combine(weights)
    rows = []
    for rank, item in enumerate(items, 1):
        row = {"rank": rank, "seed": str(item.seed), "total": _round(item.total)}
        for label, value in item.scores.items():
            row[label] = _round(value)
            if len(item.scores) > 1:
                row[_term_header(combination, label)] = _round(combination.term(label, value))
        rows.append(row)
    return pd.DataFrame(rows)


def _term_header(combination, label: str) -> str:
    mean, spread = combination.stats[label]
    weight = combination.weights[label]
    return f"{weight:g} × {label}" if label in combination.raw else f"{weight:g} × ({label} − {mean:g}) / {spread:g}"


def _generation_summary(generation, method: str, weights: dict[str, float]) -> str:
    items = generation.items
    text = (f"**{len(items)} images**, {method}{' with CADS' if generation.info.get('cads') else ''}, "
            f"NFE {generation.nfe} "
            f"({generation.nfe / len(items):g} per image), {generation.seconds:.2f} s; "
            f"best reward {items[0].total:.4f}, mean {sum(i.total for i in items) / len(items):.4f}")
    combination = combine(weights)
    if len(combination.weights) > 1:  # say how the rewards were put on one scale, and what each term weighs here
        size = {label: sum(abs(combination.term(label, i.scores.get(label, 0.0))) for i in items)
                for label in combination.weights}
        whole = sum(size.values()) or 1.0
        shares = ", ".join(f"{label} {100 * value / whole:.0f}%" for label, value in size.items())
        standardised = [f"{label} {mean:g} ± {spread:g}" for label, (mean, spread) in combination.stats.items()
                        if label not in combination.raw]
        text += "  \n"
        if standardised:
            text += ("The total is Σ weight × (score − mean) / spread: each reward standardised by its mean ± spread "
                     f"on base tiny-shapes samples ({', '.join(standardised)}), so a weight means the same on each. ")
        if combination.raw:
            text += f"No measured spread for {', '.join(combination.raw)}: raw score × weight. "
        text += f"Each term's share of the total's size here: {shares}."
    return text


def _newest_trained(runs: list[str]) -> str | None:
    """The first of `runs` (newest first) with a checkpoint to compare, if any."""
    for run in runs:
        try:
            if list_checkpoints(Path(run)):
                return run
        except (OSError, ValueError):
            continue
    return None


GOLD_KEYS = ("eval_gold_mean",)  # series of the Runs page's second plot
CHOICE_WORDS = {0: "first is better (1)", 1: "second is better (2)", "tie": "tie (T)"}  # a pairs.jsonl choice, in words


def _run_summary(view) -> str:
    """The run, its checkpoints, and what it did: the proxy reward of the first and last epoch, and the held-out
    evaluation (proxy and gold) of the first and last evaluation."""
    def first_last(key):
        values = [(r.get("epoch"), r[key]) for r in view.metrics if isinstance(r.get(key), (int, float))]
        if not values:
            return None
        (e0, v0), (e1, v1) = values[0], values[-1]
        if len(values) == 1:
            return f"{v1:.4f} (epoch {e1})"
        return f"{v0:.4f} → {v1:.4f} (epoch {e0} → {e1}, {v1 - v0:+.4f})"

    text = (f"**{view.run_dir}**: {len(view.metrics)} metric records, checkpoints: "
            f"{', '.join(view.checkpoints) or 'none yet'}")
    for key, what in (("reward_mean", "trained-on reward"), ("eval_reward_mean", "held-out proxy reward"),
                      ("eval_gold_mean", "held-out gold reward")):
        line = first_last(key)
        if line:
            text += f"  \n{what} ({key}): **{line}**"
    return text


def _metrics_frame(metrics: list[dict]):
    """metrics.jsonl as a table: the columns most records have first (sparse eval columns last), floats rounded."""
    frame = pd.DataFrame(metrics)
    if frame.empty:
        return frame
    order = sorted(frame.columns, key=lambda c: (c != "epoch", -int(frame[c].notna().sum())))
    return frame[order].map(_round)


def build_app(engine: Engine | None = None, *, runs_root: str = "runs", concurrency: int = 1,
              files_dir: str | None = None) -> gr.Blocks:
    """The demo's `gr.Blocks`.

    Args:
        engine (`Engine`, *optional*): the model cache and work; a new one (CUDA if available) by default.
        runs_root (`str`, *optional*, defaults to `"runs"`): where the Runs and Compare pages look for run dirs.
        concurrency (`int`, *optional*, defaults to 1): model requests that may run at once; the rest queue.
        files_dir (`str`, *optional*): folder for files the page offers for download (scores.json); by default a new
            temporary folder, removed with the app (or when the process exits).
    """
    engine = engine or Engine()
    own_folder = None if files_dir else TempFolder(uploads=False)
    files_dir = Path(files_dir) if files_dir else own_folder.files
    reward_labels = list(engine.reward_table())
    pipelines = list_pipelines()
    model_event = {"concurrency_limit": concurrency, "concurrency_id": MODEL_QUEUE}

    # every hour, the files gradio made for this app (uploads, results) that are a day old go; all go when it stops
    with gr.Blocks(title="diffrl demo", analytics_enabled=False, delete_cache=(3600, 86400)) as app:
        gr.Markdown("# diffrl demo\nGenerate and steer with rewards, compare fine-tuned models, score images, "
                    "browse runs and label preference pairs. Everything runs here; nothing is downloaded.")
        # wrap: on a phone the tabs that do not fit go to a second row, not behind gradio's "More tabs" menu
        with gr.Tabs(overflow_behavior="wrap"):
            # -- Generate / steer -------------------------------------------------------------------------------
            with gr.Tab("Generate / steer", id="generate"):
                before_gradient = gr.State(None)  # the settings a gradient method replaced, restored on leaving it
                with gr.Row():
                    with gr.Column(scale=2):
                        prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", elem_id="prompt", lines=2)
                        method = gr.Radio(list(METHODS), value="plain", label="Method", elem_id="generate-method")
                        method_help = gr.Markdown(method_help_text("plain"), elem_id="method-help")
                        with gr.Row():
                            num_images = gr.Slider(1, 16, 4, step=1, label="Images", elem_id="generate-images")
                            budget = gr.Number(4, label="Budget", precision=0, minimum=1, elem_id="generate-budget",
                                               info=BUDGET_INFO)
                        with gr.Row():
                            generate_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn", scale=3)
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="generate-stop", scale=1)
                        with gr.Accordion("Rewards (one weight each; 0 = off)", open=True):
                            weights = [gr.Slider(-2, 2, DEFAULT_WEIGHTS.get(label, 0.0), step=0.05, label=label,
                                                 elem_id=f"weight-{i}") for i, label in enumerate(reward_labels)]
                        with gr.Accordion("Advanced options", open=False, elem_id="generate-advanced"):
                            pipeline = gr.Dropdown(pipelines, value=pipelines[0] if pipelines else None,
                                                   allow_custom_value=True, label="Pipeline",
                                                   elem_id="generate-pipeline",
                                                   info="embedded, a local diffusers folder or a cached hub id")
                            lora = gr.Textbox("", label=f"LoRA (optional): a run dir or LoRA folder under {runs_root}/",
                                              placeholder="runs/<name> or a LoRA folder",
                                              elem_id="generate-lora")
                            negative = gr.Textbox("", label="Negative prompt (optional)")
                            with gr.Row():
                                seed = gr.Number(0, label="Seed", precision=0, minimum=0, elem_id="generate-seed",
                                                 info="image i uses seed + i")
                                randomise = gr.Checkbox(False, label="Randomise seed")
                            with gr.Row():
                                steps = gr.Slider(1, 100, DEFAULT_STEPS, step=1, label="Steps",
                                                  elem_id="generate-steps")
                                guidance = gr.Slider(0, 15, 5.0, step=0.5, label="Guidance scale")
                            settings = gr.Textbox("", label="Method settings (key=value, ...)",
                                                  placeholder="lmbda=10, interval=5", elem_id="generate-settings",
                                                  info="the keys of each method are listed under Method")
                            cads = gr.Dropdown(["off", "on"], value="off", allow_custom_value=True,
                                               label="CADS (condition-annealed sampling)", info=CADS_HELP,
                                               elem_id="generate-cads")
                    with gr.Column(scale=3):
                        summary = gr.Markdown(elem_id="generate-summary")
                        gallery = gr.Gallery(label="Results, best reward first", columns=4, format="png",
                                             elem_id="gallery", object_fit="contain", height="auto")
                        breakdown = gr.Dataframe(headers=["rank", "seed", "total", *reward_labels[:1]],
                                                 label="Per image: the total and each reward's raw score (with "
                                                       "several: each one's part of the total)",
                                                 elem_id="generate-breakdown", interactive=False, wrap=True)
                        previews = gr.Gallery(label="While it runs: x̂0 previews, scored populations, iterations",
                                              columns=8, format="png", height="auto", elem_id="previews",
                                              object_fit="contain")
                        results_file = gr.File(label="Download: the images with their seeds and scores (zip)",
                                               elem_id="generate-download", interactive=False, height=64)
                        with gr.Accordion("Scores (JSON)", open=False):
                            scores_json = gr.JSON(label="Scores")

                def generate(pipeline, lora, prompt, negative, seed, randomise, steps, guidance, num_images, method,
                             budget, settings, cads, *weight_values,
                             progress=gr.Progress()):  # noqa: B008 - how gradio asks for a progress bar
                    weights_by_label = dict(zip(reward_labels, weight_values))
                    try:
                        seed = random.randrange(2**31) if randomise else parse_seed(seed)
                    except UserError as e:
                        raise _error(e) from None

                    def work(report):
                        return engine.generate(
                            pipeline=pipeline, lora=lora, prompt=prompt, negative_prompt=negative, seed=seed,
                            steps=steps, guidance_scale=guidance, num_images=num_images, method=method,
                            budget=budget or 1, settings=settings, weights=weights_by_label, report=report,
                            runs_root=runs_root, cads=cads)

                    nothing = gr.update()
                    for kind, value in _stream(work, progress):
                        if kind == "report":
                            yield (nothing, f"*{value.text}*", value.images or nothing, nothing, nothing, nothing,
                                   nothing)
                        else:
                            about = {"method": method, "nfe": value.nfe, "seconds": value.seconds, "seed": seed,
                                     "cads": value.info.get("cads")}
                            yield ([(i.image, i.caption()) for i in value.items],
                                   _generation_summary(value, method, weights_by_label), gr.update(),
                                   {**about, "images": _json_scores(value.items)}, seed,
                                   _breakdown(value.items, weights_by_label),
                                   _results_zip(files_dir, "generate", {"": value.items}, about))

                # the API page names each reward's weight by its reward (`weight_shapes_verifier`), not param_12
                weight_names = _weight_parameter_names(reward_labels)
                generate.__signature__ = _signature_with_weights(generate, weight_names)

                def method_defaults(method, saved, pipeline, steps, budget, *weight_values):
                    """ReNO and guidance need a differentiable reward (and ReNO a one-step model): switching to one
                    sets them and keeps what it replaced; switching back to another method restores it."""
                    help_text = method_help_text(method)
                    current = {"pipeline": pipeline, "steps": steps, "budget": budget, "weights": list(weight_values)}
                    if method in GRADIENT_METHODS:
                        saved = saved or current
                        changed = dict(current)
                        if method == "reno" and "tiny-shapes-lcm" in pipelines:
                            changed.update(pipeline="tiny-shapes-lcm", steps=1, budget=10)
                        elif method == "guidance":  # one guided sample per image, as its defaults were measured
                            changed.update(pipeline=saved["pipeline"], steps=saved["steps"], budget=1)
                        changed["weights"] = _differentiable_weights(reward_labels, engine, current["weights"])
                    elif saved is not None:
                        changed, saved = saved, None
                    else:
                        changed = current
                    return (help_text, saved, changed["pipeline"], changed["steps"], changed["budget"],
                            *changed["weights"])

                method.change(method_defaults, [method, before_gradient, pipeline, steps, budget, *weights],
                              [method_help, before_gradient, pipeline, steps, budget, *weights], api_name=False)
                # the results in view after the click (on a phone they are below the inputs)
                generate_btn.click(None, None, None, js=SCROLL_TO_JS.replace("ID", "generate-summary"),
                                   api_name=False)
                generate_event = generate_btn.click(
                    generate,
                    [pipeline, lora, prompt, negative, seed, randomise, steps, guidance, num_images, method, budget,
                     settings, cads, *weights],
                    [gallery, summary, previews, scores_json, seed, breakdown, results_file], api_name="generate",
                    show_progress_on=[gallery], **model_event)
                gr.Examples(
                    examples=[[prompt_text, method_name, n, b, *_example_weights(reward_labels, w)]
                              for prompt_text, method_name, n, b, w in EXAMPLES
                              if all(label in reward_labels for label in w)],
                    inputs=[prompt, method, num_images, budget, *weights], label="Examples (click one, then Generate)",
                    elem_id="generate-examples", examples_per_page=8,
                    example_labels=[f"{method_name}: {prompt_text}" for prompt_text, method_name, _, _, w in EXAMPLES
                                    if all(label in reward_labels for label in w)])


            # -- Compare --------------------------------------------------------------------------------------------
            with gr.Tab("Compare", id="compare"):
                with gr.Row():
                    with gr.Column(scale=2):
                        run_choices = find_runs(runs_root)
                        run_a = gr.Dropdown(run_choices, value=None, allow_custom_value=True,
                                            label=f"Fine-tuned run dir (or LoRA folder) under {runs_root}/",
                                            elem_id="compare-run")
                        run_b = gr.Dropdown(run_choices, value=None, allow_custom_value=True, elem_id="compare-run-b",
                                            label="Compare against run dir (empty: the base model)")
                        compare_pipeline = gr.Textbox("", label="Base pipeline (empty: the run's own)")
                        compare_prompts = gr.Textbox(f"{DEFAULT_PROMPT}\na green triangle", lines=3,
                                                     label="Prompts, one per line", elem_id="compare-prompts")
                        with gr.Row():
                            compare_n = gr.Slider(1, 8, 2, step=1, label="Images per prompt")
                            compare_seed = gr.Number(0, label="Seed", precision=0, minimum=0,
                                                     info="prompt i, image k: seed + i × images + k")
                        with gr.Row():
                            compare_steps = gr.Slider(1, 100, 20, step=1, label="Steps", elem_id="compare-steps")
                            compare_guidance = gr.Slider(0, 15, 5.0, step=0.5, label="Guidance scale")
                        with gr.Accordion("Rewards", open=False):
                            compare_weights = [gr.Slider(-2, 2, DEFAULT_WEIGHTS.get(label, 0.0), step=0.05,
                                                         label=label) for label in reward_labels]
                        with gr.Row():
                            compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn", scale=3)
                            compare_stop = gr.Button("Stop", variant="stop", elem_id="compare-stop", scale=1)
                    with gr.Column(scale=3):
                        compare_summary = gr.Markdown(elem_id="compare-summary")
                        with gr.Row():
                            left_gallery = gr.Gallery(label="Left: the base model (or the second run)", columns=2,
                                                      format="png", elem_id="compare-left", height="auto",
                                                      object_fit="contain")
                            right_gallery = gr.Gallery(label="Right: the fine-tuned run", columns=2, format="png",
                                                       elem_id="compare-right", height="auto", object_fit="contain")
                        slider = gr.ImageSlider(label="First prompt and seed: left | right", type="pil")
                        compare_table = gr.Dataframe(label="Per image", elem_id="compare-table", interactive=False)
                        compare_file = gr.File(label="Download: both sides' images with their seeds and scores (zip)",
                                               elem_id="compare-download", interactive=False, height=64)

                def compare(run_a, run_b, base, prompts, n, seed, steps, guidance, *weight_values,
                            progress=gr.Progress()):  # noqa: B008 - how gradio asks for a progress bar
                    def work(report):
                        return engine.compare(
                            run_dir=run_a, other_run_dir=run_b, pipeline=base, prompts=prompts, images_per_prompt=n,
                            seed=seed, steps=steps, guidance_scale=guidance,
                            weights=dict(zip(reward_labels, weight_values)), report=report, runs_root=runs_root)

                    nothing = gr.update()
                    for kind, value in _stream(work, progress):
                        if kind == "report":
                            yield f"*{value.text}*", nothing, nothing, nothing, nothing, nothing
                            continue
                        left, right = value["left_items"], value["right_items"]
                        text = (f"mean reward: **{value['left']}** {value['left_mean']:.4f}, "
                                f"**{value['right']}** {value['right_mean']:.4f} "
                                f"(difference {value['right_mean'] - value['left_mean']:+.4f}, {len(left)} images)")
                        table = pd.DataFrame([{k: _round(v) for k, v in row.items()} for row in value["rows"]])
                        yield (text,
                               [(i.image, i.caption()) for i in left],
                               [(i.image, i.caption()) for i in right],
                               (left[0].image, right[0].image),
                               table,
                               _results_zip(files_dir, "compare", {"left": left, "right": right},
                                            {"left": value["left"], "right": value["right"]}))

                def run_chosen(run, *weight_values):
                    """The chosen run's held-out prompts, evaluation steps and guidance, and its reward as the only
                    weight (when it runs here): Compare's defaults then show what the fine-tuning did."""
                    found = compare_defaults(run, runs_root)
                    weights_now = list(weight_values)
                    if found.get("reward") in reward_labels:
                        weights_now = [1.0 if label == found["reward"] else 0.0 for label in reward_labels]
                    return ("\n".join(found["prompts"]) if "prompts" in found else gr.update(),
                            found.get("steps", gr.update()), found.get("guidance", gr.update()), *weights_now)

                run_a.change(run_chosen, [run_a, *compare_weights],
                             [compare_prompts, compare_steps, compare_guidance, *compare_weights], api_name=False)
                compare.__signature__ = _signature_with_weights(compare, weight_names)
                compare_event = compare_btn.click(
                    compare,
                    [run_a, run_b, compare_pipeline, compare_prompts, compare_n, compare_seed, compare_steps,
                     compare_guidance, *compare_weights],
                    [compare_summary, left_gallery, right_gallery, slider, compare_table, compare_file],
                    api_name="compare",
                    show_progress_on=[left_gallery, right_gallery], **model_event)
                # Stop ends the request at its next step: the model thread checks for it (`_stream`). "Stopped." is
                # written after the cancel has completed: written with it, an update the request had already sent
                # could land after it and leave a progress line on the page (seen under load)
                for button, event, target in ((stop_btn, generate_event, summary),
                                              (compare_stop, compare_event, compare_summary)):
                    button.click(None, None, None, cancels=[event], api_name=False).then(
                        lambda: "*Stopped.*", None, target, api_name=False)

            # -- Score ----------------------------------------------------------------------------------------------
            with gr.Tab("Score", id="score"):
                with gr.Row():
                    with gr.Column():
                        score_files = gr.File(file_count="multiple", label="Images", type="filepath",
                                              elem_id="score-files")
                        score_prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt the images should match", elem_id="score-prompt")
                        score_rewards = gr.CheckboxGroup(reward_labels, value=reward_labels,
                                                         label="Rewards (those that can run here)")
                        score_btn = gr.Button("Score", variant="primary", elem_id="score-btn")
                    with gr.Column():
                        score_table = gr.Dataframe(label="Scores", elem_id="score-table", interactive=False)
                        score_verdicts = gr.Markdown(elem_id="score-verdicts")
                        with gr.Accordion("Verifier details (JSON)", open=False):
                            score_details = gr.JSON(label="Verifier: every clause of the prompt, per image")
                        score_file = gr.File(label="scores.json")

                @_on_page
                def score(files, prompt, chosen):
                    paths = [f if isinstance(f, str) else getattr(f, "name", f) for f in files or []]
                    rows, details, skipped = engine.score(paths, prompt, chosen)

                    out = Path(tempfile.mkdtemp(dir=files_dir)) / "scores.json"
                    records = [{**row, "prompt": prompt, "seed": None} for row in rows]
                    out.write_text(json.dumps(records, indent=2) + "\n")
                    notes = "".join(f"**{label} did not score:** {_toast_html(reason)}\n\n"
                                    for label, reason in skipped.items())
                    table = pd.DataFrame([{k: _round(v) for k, v in row.items()} for row in rows])
                    return table, notes + _verdicts(details), details, str(out)

                score_btn.click(score, [score_files, score_prompt, score_rewards],
                                [score_table, score_verdicts, score_details, score_file], api_name="score",
                                **model_event)

            # -- Runs -----------------------------------------------------------------------------------------------
            with gr.Tab("Runs", id="runs"):
                with gr.Row():
                    run_dir = gr.Dropdown(find_runs(runs_root), value=None, allow_custom_value=True, scale=4,
                                          label=f"Run dir (those under {runs_root}/; the page reads no other folder)",
                                          elem_id="run-dir")
                    refresh_btn = gr.Button("Refresh list", scale=1)
                    show_btn = gr.Button("Show", variant="primary", scale=1, elem_id="run-btn")
                run_summary = gr.Markdown(elem_id="run-summary")
                with gr.Row():
                    # the proxy (what the run trained on) and the gold reward (held out) on axes of their own: a
                    # PickScore proxy (~20) and a verifier gold (0 to 1) on one axis flatten the gold gain to a line
                    curve_plot = gr.LinePlot(x="epoch", y="value", color="series", label="Proxy reward per epoch",
                                             elem_id="run-curve")
                    gold_plot = gr.LinePlot(x="epoch", y="value", color="series", elem_id="run-gold-curve",
                                            label="Gold (held-out) reward per evaluation")
                with gr.Accordion("The trainer's reward_curve.png", open=False):
                    curve_image = gr.Image(label="reward_curve.png", type="pil")
                # three columns however few grids (gradio fits the columns to the images: two grids were each half
                # the page wide and cut off at the bottom of the gallery's box, their epoch captions with them)
                grids = gr.Gallery(label="Sample grids by epoch", columns=3, fit_columns=False, format="png",
                                   height="auto", elem_id="run-grids", object_fit="contain")
                metrics_table = gr.Dataframe(label="metrics.jsonl (densest columns first)", elem_id="run-metrics",
                                             interactive=False)
                config_code = gr.Code(label="config.yaml", language="yaml")

                @_on_page
                def show_run(path):
                    view = read_run(path, runs_root)
                    text = _run_summary(view)
                    columns = ["epoch", "value", "series"]
                    curve = pd.DataFrame([c for c in view.curve if c["series"] not in GOLD_KEYS], columns=columns)
                    gold = pd.DataFrame([c for c in view.curve if c["series"] in GOLD_KEYS], columns=columns)
                    png = Image.open(view.curve_png).convert("RGB") if view.curve_png else None
                    grid_images = [(Image.open(p).convert("RGB"), caption) for p, caption in view.grids]
                    return text, curve, png, grid_images, _metrics_frame(view.metrics), view.config, gold

                refresh_btn.click(lambda: gr.update(choices=find_runs(runs_root)), None, run_dir, api_name=False)
                run_outputs = [run_summary, curve_plot, curve_image, grids, metrics_table, config_code, gold_plot]
                # an error is the toast and one badge, not an "Error" over every plot and table
                show_btn.click(show_run, run_dir, run_outputs, api_name="run", show_progress_on=[run_summary])
                run_dir.input(show_run, run_dir, run_outputs, api_name=False, show_progress_on=[run_summary])

            # -- Label ----------------------------------------------------------------------------------------------
            with gr.Tab("Label", id="label"):
                with gr.Row():
                    pairs_dir = gr.Textbox(label="Pairs folder (written by `diffrl pairs sample --out`)", scale=4,
                                           elem_id="pairs-dir")
                    load_btn = gr.Button("Load", variant="primary", scale=1, elem_id="label-load")
                label_status = gr.Markdown(elem_id="label-status")
                label_prompt = gr.Markdown(elem_id="label-prompt")
                index = gr.Number(-1, visible=False, precision=0)
                with gr.Row():
                    first = gr.Image(label="1: first", type="pil", elem_id="label-image-first", height=280)
                    second = gr.Image(label="2: second", type="pil", elem_id="label-image-second", height=280)
                with gr.Row():
                    first_btn = gr.Button("First is better (1, ←)", elem_id="label-first")
                    tie_btn = gr.Button("Tie (T, ↓)", elem_id="label-tie")
                    second_btn = gr.Button("Second is better (2, →)", elem_id="label-second")
                with gr.Row():
                    back_btn = gr.Button("Back (B)", size="sm", elem_id="label-back")
                    skip_btn = gr.Button("Skip (S)", size="sm", elem_id="label-skip")

                def _show(path: Path, pairs: list[dict], at: int | None):
                    done = sum(p.get("choice") is not None for p in pairs)
                    status = f"**{done} of {len(pairs)} pairs labelled** in `{path}`"
                    if at is None:
                        return status + ". All done: D3PO trains from this file.", "", -1, None, None
                    pair = pairs[at]
                    images = []
                    for file in labels_io.image_paths(path, pair):
                        try:
                            with Image.open(file) as picture:
                                images.append(_enlarge(picture.convert("RGB")))
                        except OSError as e:
                            raise UserError(f"pair {at}: cannot read image {file}: {e.strerror or e}") from None
                    current = pair.get("choice")
                    prompt_text = (f"Pair {at + 1}/{len(pairs)} (seed {pair.get('seed')}): **{pair['prompt']}**"
                                   + (f" — labelled: **{CHOICE_WORDS.get(current, current)}**"
                                      if current is not None else ""))
                    return status, prompt_text, at, images[0], images[1]

                @_on_page
                def label_load(folder):
                    path = labels_io.pairs_path(folder)
                    pairs = labels_io.read_pairs(path)
                    return _show(path, pairs, labels_io.next_unlabelled(pairs))

                def label_action(action):
                    @_on_page
                    def act(folder, at):
                        path = labels_io.pairs_path(folder)
                        at = int(at if at is not None else -1)
                        if action == "back":
                            pairs = labels_io.read_pairs(path)
                            return _show(path, pairs, max(at - 1, 0) if at >= 0 else len(pairs) - 1)
                        if at < 0:
                            raise UserError("no pair is shown: load a pairs folder first (or all are labelled)")
                        if action == "skip":
                            pairs = labels_io.read_pairs(path)
                            return _show(path, pairs, labels_io.next_unlabelled(pairs, at + 1))
                        pairs = labels_io.set_choice(path, at, action)
                        return _show(path, pairs, labels_io.next_unlabelled(pairs, at + 1))

                    return act

                label_outputs = [label_status, label_prompt, index, first, second]
                load_btn.click(label_load, pairs_dir, label_outputs, api_name="label_load")
                pairs_dir.submit(label_load, pairs_dir, label_outputs, api_name=False)
                for button, action, name in ((first_btn, 0, "label_first"), (second_btn, 1, "label_second"),
                                             (tie_btn, "tie", "label_tie"), (skip_btn, "skip", "label_skip"),
                                             (back_btn, "back", "label_back")):
                    button.click(label_action(action), [pairs_dir, index], label_outputs, api_name=name)
        # the run lists as they are when a page opens (a run made after the server started appears on reload),
        # Compare preset to the newest run that has a checkpoint
        def refresh_runs():
            runs = find_runs(runs_root)
            return (gr.update(choices=runs, value=_newest_trained(runs)), gr.update(choices=runs),
                    gr.update(choices=runs))

        app.load(refresh_runs, None, [run_a, run_b, run_dir], api_name=False, show_progress="hidden")
    app.diffrl_temp = own_folder  # removed with the app
    return app


class TempFolder:
    """A temporary folder of one demo: `files` for what the pages offer for download and, with `uploads` (unless
    GRADIO_TEMP_DIR is set), gradio's upload folder. Removed by `cleanup()`, when this object is garbage, or when
    the process exits, whichever comes first: a stopped demo leaves no folder and no uploaded image behind."""

    def __init__(self, *, uploads: bool):
        self.path = Path(tempfile.mkdtemp(prefix="diffrl-demo-"))
        self.files = self.path / "files"
        self.files.mkdir()
        upload_env = None
        if uploads and not os.environ.get("GRADIO_TEMP_DIR"):
            upload_env = str(self.path / "uploads")  # gradio reads it when the app is built and at each request
            os.environ["GRADIO_TEMP_DIR"] = upload_env
        self._finalizer = weakref.finalize(self, _remove_folder, self.path, upload_env)

    def cleanup(self) -> None:
        self._finalizer()


def _remove_folder(path: Path, upload_env: str | None) -> None:
    if upload_env is not None and os.environ.get("GRADIO_TEMP_DIR") == upload_env:
        del os.environ["GRADIO_TEMP_DIR"]
    shutil.rmtree(path, ignore_errors=True)


def _verdicts(details: list[dict]) -> str:
    """The verifier's clause verdicts per image, as a readable list."""
    lines = []
    for entry in details:
        found = ", ".join(entry.get("objects") or []) or "nothing"
        lines += [f"**{entry['file']}** (found {found}; background {entry.get('background')})", ""]
        lines += [f"- {'✓' if clause['ok'] else '✗'} {clause['clause']}"
                  + (f" (found {clause['found']})" if "found" in clause else "") for clause in entry["clauses"]]
        lines.append("")
    return "\n".join(lines)


def _enlarge(picture):
    """Tiny images (32 px ShapesWorld samples) enlarged with nearest neighbour, like the generated ones."""
    return enlarge(picture, size=256)


def _theme():
    # System fonts only: the default theme would make every browser fetch fonts from the internet.
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "SFMono-Regular", "monospace"])


def launch(*, host: str = "127.0.0.1", port: int | None = 7860, share: bool = False, device: str | None = None,
           dtype: str = "fp32", runs_root: str = "runs", concurrency: int = 1, preload: str | None = "tiny-shapes",
           block: bool = True, quiet: bool = False):
    """Start the demo; returns `(app, local_url)` when `block` is False (tests), else serves until interrupted.

    Args:
        host (`str`, defaults to `"127.0.0.1"`): the address to bind; `0.0.0.0` serves the whole network.
        port (`int`, defaults to 7860): `None` picks a free one.
        share (`bool`, defaults to `False`): a public gradio.live link; only when asked.
        quiet (`bool`, defaults to `False`): print nothing (otherwise the address, and how to share it).
        preload (`str`, *optional*): a pipeline loaded in the background once the first page has rendered, so the
            first image is quick and the page is not held up by it.
    """
    if concurrency < 1:
        raise UserError(f"--concurrency must be at least 1, got {concurrency}")
    engine = Engine(device=device, dtype=dtype)
    folder = TempFolder(uploads=True)  # before the app is built: gradio reads its upload folder then
    try:
        app = build_app(engine, runs_root=runs_root, concurrency=concurrency, files_dir=str(folder.files))
        app.diffrl_temp = folder  # removed with the app, or when the process exits
        if preload and preload in list_pipelines():
            # Loaded once the first page has rendered, not at start: importing torch and diffusers and loading the
            # weights in a thread beside the server held the interpreter while the page's assets were served (a
            # cold start to a rendered page of 17-33 s). A request made before it is done waits for it, its
            # progress saying "loading <pipeline>" (the engine builds each pipeline once, under a lock).
            start_preload = _once(lambda: threading.Thread(target=_preload, args=(engine, preload), daemon=True,
                                                           name="diffrl-demo-preload").start())
            with app:
                app.load(start_preload, None, None, api_name=False, show_progress="hidden", queue=False)
        serve_queue(app, concurrency)
        _, local_url, share_url = app.launch(
            # quiet: gradio's own lines would tell a person to set `share=True` in `launch()`; ours name the flag
            server_name=host, server_port=port, share=share, prevent_thread_lock=True, quiet=True,
            allowed_paths=[str(folder.files)], theme=_theme(), head=HEAD, footer_links=["api"],
            ssr_mode=False, max_file_size=MAX_UPLOAD_BYTES,  # refused while it arrives, before it is stored
        )
    except BaseException:
        folder.cleanup()
        raise
    if not quiet:
        print(f"diffrl demo on {local_url}" + (f" and {share_url}" if share_url else "") + " (Ctrl+C to stop)",
              flush=True)
        if not share:
            print("For a public link (anyone who has it can use this machine's models): diffrl demo --share",
                  flush=True)
    if not block:
        return app, local_url
    try:
        app.block_thread()
    finally:
        app.close()
        folder.cleanup()


class _NoTimeEstimates(collections.defaultdict):
    """gradio's record of each event's past durations, which it never finds when it estimates: its estimate (the
    mean past duration of the same event, whatever its settings) said 17 s for a 47 s wait, since one Generate
    event covers a 1-step image and a 64-sample best-of-N. Without it the page shows the queue position and the time
    so far, and the request's own progress (step k of n) once it runs."""

    def __contains__(self, key) -> bool:
        return False


def serve_queue(app: gr.Blocks, concurrency: int = 1) -> gr.Blocks:
    """`app` with gradio's queue (`concurrency` model requests at once) and no time estimates on the page."""
    app.queue(default_concurrency_limit=concurrency)
    # gradio has no switch for this: its queue records durations in this mapping and estimates from what it finds
    app._queue.process_time_per_fn = _NoTimeEstimates(app._queue.process_time_per_fn.default_factory)
    return app


def _once(function):
    """`function`, called at most once however often (and from however many threads) the result is called."""
    lock, done = threading.Lock(), []

    def call():
        with lock:
            if not done:
                done.append(True)
                function()

    return call


def _preload(engine: Engine, name: str) -> None:
    try:
        engine.pipeline(name)
    except Exception as e:  # noqa: BLE001 - a failed preload is reported, and the first request will say why
        print(f"diffrl demo: could not preload {name}: {e}", flush=True)
