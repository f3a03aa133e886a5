"""Sampler overhead: images/s of DDIMSampler (log-probs stored) vs the plain diffusers pipeline call, and peak memory.

Both run on the same pipeline object (same components, DDIM scheduler, steps, guidance scale, eta, batch size, dtype
and device), alternating call by call (and which goes first) so background load hits both alike; the reported time
of each is the median over the repeats. `ratio` = our seconds per batch / diffusers' (target ≤ 1.05: recording a
policy's trajectory should cost nothing next to the UNet); `cpu_time_ratio` is the same with the process's CPU time,
the steadier number on a shared CPU; `best_ratio` / `best_cpu_time_ratio` compare the fastest calls.

Peak memory, measured in one extra call of each after the timed ones: on CUDA `torch.cuda.max_memory_allocated`
(reset before the call); on CPU the increase of the process's resident set size over its value at the start of
the call, sampled every millisecond by a thread (torch's CPU allocations are invisible to tracemalloc; memory
the allocator already holds from earlier calls does not show), plus the process's lifetime `ru_maxrss`.

Default model: the embedded `tiny-shapes` pipeline when it is built, else a random-weight SD pipeline of the same
size built in code (small); `--preset tiny|small|sd15` measures a random-weight pipeline of that size instead
(sd15: SD 1.5's shapes, for a GPU), `--preset sd3-tiny` the tests' tiny random SD3; `--pipeline` takes any name or
folder `diffrl.load_pipeline` accepts. A flow-matching pipeline (SD3 class) is measured with the `FlowSampler`
at noise level `--eta` (Flow-GRPO's SDE with log-probs; 0 = the ODE) against its own Euler sampler, which takes no
eta.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import threading
import time

import torch
from diffusers import DDIMScheduler

from diffrl.checks import check_device, positive
from diffrl.errors import UserError
from diffrl.files import write_json
from diffrl.models import model_family
from diffrl.pipelines import load_pipeline
from samplers import resolve_sampler_name
from samplers.ddim import DDIMSampler
from samplers.flow import FlowSampler
from samplers.testing import random_sd_pipeline, tiny_sd3_pipeline

PROMPTS = ["a red circle above a blue square", "two green triangles", "a small yellow star", "a purple ring"]
TARGET_RATIO = 1.05


def add_arguments(parser) -> None:
    parser.add_argument("--pipeline", help="pipeline name or folder (default: tiny-shapes if built, else --preset)")
    parser.add_argument(
        "--preset",
        default=None,
        choices=("tiny", "small", "sd15", "sd3-tiny"),
        help="measure a random-weight SD pipeline of this size instead of tiny-shapes (default: tiny-shapes; "
        "small when tiny-shapes is not built)",
    )
    parser.add_argument("--batch-size", type=positive, default=8, help="images per call (default: 8)")
    parser.add_argument("--steps", type=positive, default=20, help="denoising steps (default: 20)")
    parser.add_argument("--guidance-scale", type=float, default=5.0, help="CFG scale (default: 5.0)")
    parser.add_argument("--eta", type=float, default=1.0, help="DDIM eta (default: 1.0)")
    parser.add_argument("--repeats", type=positive, default=5, help="timed calls of each (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each first (default: 1)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("fp32", "fp16", "bf16"),
        help="weights dtype (default: fp16 on cuda, fp32 on cpu)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", help="also write the result as JSON to this file")


def run_sample_bench(args) -> int:
    """`diffrl bench sample`: print the measurement (and write it with `--out`). Returns 0."""
    result = measure(args)
    print(json.dumps(result, indent=2))
    ours, theirs = result["ours"], result["diffusers"]
    print(
        f"\nours {ours['images_per_s']:.2f} img/s, diffusers {theirs['images_per_s']:.2f} img/s, "
        f"ratio {result['ratio']:.3f} (CPU time {result['cpu_time_ratio']:.3f}, best calls {result['best_ratio']:.3f},"
        f" best CPU {result['best_cpu_time_ratio']:.3f}; target <= {TARGET_RATIO}); "
        f"peak memory ours {ours['peak_memory_mb']:.1f} MB, "
        f"diffusers {theirs['peak_memory_mb']:.1f} MB [{result['memory_kind']}]"
    )
    if args.out:
        write_json(args.out, result)
    return 0


def measure(args) -> dict:
    """Build the pipeline named by `args` and time both samplers on it; returns the result dict."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = check_device(args.device)
    dtype_name = args.dtype or ("fp16" if device.startswith("cuda") else "fp32")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    pipe, model = _load(args, dtype)
    pipe.to(device)
    result = measure_sample_throughput(
        pipe,
        batch_size=args.batch_size,
        num_steps=args.steps,
        guidance_scale=args.guidance_scale,
        eta=args.eta,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    return {"pipeline": model, "device": device, "dtype": dtype_name, "threads": torch.get_num_threads(), **result}


def _load(args, dtype):
    if args.pipeline:
        return load_pipeline(args.pipeline, dtype=dtype), args.pipeline
    if args.preset:
        return _random(args.preset, dtype), f"random-{args.preset}"
    try:
        return load_pipeline("tiny-shapes", dtype=dtype), "tiny-shapes"
    except UserError as error:  # not built into this install: a random pipeline of the same architecture
        print(f"tiny-shapes is not available ({error}); using random-small", file=sys.stderr)
        return _random("small", dtype), "random-small"


def _random(preset: str, dtype):
    pipe = tiny_sd3_pipeline() if preset == "sd3-tiny" else random_sd_pipeline(preset)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def measure_sample_throughput(
    pipe, *, batch_size: int, num_steps: int, guidance_scale: float, eta: float, repeats: int = 5, warmup: int = 1
) -> dict:
    """Time `DDIMSampler.sample` (trajectory and log-probs recorded) against `pipe(...)` with the same settings.

    The pipeline's scheduler is switched to a `DDIMScheduler` from its own config, so both run DDIM with `eta`. A
    flow-matching pipeline keeps its scheduler: `FlowSampler` at noise level `eta` against the pipeline's own Euler
    sampler (which takes no eta). Returns seconds per batch (median and all), images/s and peak memory of each, and
    their ratio.
    """
    flow = resolve_sampler_name(pipe) == "flow"
    if not flow:
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    family = model_family(pipe)
    device = family.denoiser.device
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
    sampler = FlowSampler() if flow else DDIMSampler()
    pipe_eta = {} if flow else {"eta": eta}
    if flow and pipe.config.get("_diffrl_max_sequence_length") is not None:
        # the T5 length the model was trained with, which FlowSampler feeds (tiny-shapes-flow: 0, no T5)
        pipe_eta["max_sequence_length"] = pipe.config["_diffrl_max_sequence_length"]
    calls = {"ours": 0, "diffusers": 0}

    def ours():
        seed = 1000 * calls["ours"]
        calls["ours"] += 1
        traj = sampler.sample(
            pipe,
            prompts,
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            eta=eta,
            seeds=list(range(seed, seed + batch_size)),
        )
        return traj.images

    def theirs():
        generator = torch.Generator(device).manual_seed(calls["diffusers"])
        calls["diffusers"] += 1
        return pipe(
            prompts,
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            output_type="pt",
            **pipe_eta,
        ).images

    runs = {"ours": ours, "diffusers": theirs}
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    peaks = {}
    with torch.no_grad():
        for _ in range(warmup):
            for run in runs.values():
                run()
        for repeat in range(repeats):
            # alternate which goes first, so warm caches and drifting background load favour neither
            order = list(runs.items()) if repeat % 2 == 0 else list(runs.items())[::-1]
            for name, run in order:
                seconds, cpu_seconds = _timed(run, device)
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
        for name, run in runs.items():  # memory in a call of its own: the RSS sampling thread would skew timings
            peaks[name] = _peak_memory(run, device)
    result = {}
    for name in runs:
        median = statistics.median(times[name])
        result[name] = {
            "seconds_per_batch": median,
            "images_per_s": batch_size / median,
            "best_seconds_per_batch": min(times[name]),
            "cpu_seconds_per_batch": statistics.median(cpu_times[name]),
            "best_cpu_seconds_per_batch": min(cpu_times[name]),
            "peak_memory_mb": peaks[name] / 2**20,
            "all_seconds": times[name],
        }
    cuda = device.type == "cuda"
    size = family.latent_shape(None, None)[1]
    return {
        "batch_size": batch_size,
        "num_steps": num_steps,
        "guidance_scale": guidance_scale,
        "eta": eta,
        "sampler": sampler.name,
        "image_size": size,
        "repeats": repeats,
        **result,
        "ratio": result["ours"]["seconds_per_batch"] / result["diffusers"]["seconds_per_batch"],
        # process CPU time: on a shared CPU it is steadier than wall time (other processes' load cancels out)
        "cpu_time_ratio": result["ours"]["cpu_seconds_per_batch"] / result["diffusers"]["cpu_seconds_per_batch"],
        # fastest call of each: the least disturbed by other processes
        "best_ratio": result["ours"]["best_seconds_per_batch"] / result["diffusers"]["best_seconds_per_batch"],
        "best_cpu_time_ratio": result["ours"]["best_cpu_seconds_per_batch"]
        / result["diffusers"]["best_cpu_seconds_per_batch"],
        "target_ratio": TARGET_RATIO,
        "memory_kind": "torch.cuda.max_memory_allocated"
        if cuda
        else "peak RSS increase over the call, sampled every 1 ms",
        "process_max_rss_mb": _max_rss_mb(),
    }


def _timed(run, device) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start


def _peak_memory(run, device) -> float:
    """Peak memory of one call in bytes (see the module docstring for what is measured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device))
    with _RssSampler() as sampler:
        run()
    return float(sampler.peak - sampler.start)


class _RssSampler:
    """Peak resident set size while the block runs, read from /proc/self/statm every millisecond."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page
        except OSError:  # not Linux: no sampling, the increase reads 0
            return 0

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def _max_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux
