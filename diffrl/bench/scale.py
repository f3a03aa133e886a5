"""Real-size models: Flow-GRPO epochs of random-weight SD3.5-Medium, FLUX.1-dev or Qwen-Image, peak memory and images/s.

The pipeline is `samplers.random_real`'s: the released architecture and size (transformer, VAE and text towers) with
random weights, built on the device, so no checkpoint is needed. The trainer is the published-settings recipe of the
preset (`recipes/flow_grpo/<...>.yaml`: sampler, steps, guidance, noise level, SDE window, LoRA targets and rank,
micro-batch, bf16), run through `diffrl.trainers.flow_grpo.train` as `diffrl run` runs it, with these changes,
each printed in the result: one prompt's group of `--images` images per epoch (micro-batches of the recipe's size,
or of the largest divisor of `--images` below it; one optimizer step per epoch), the image size if `--size` is
given (else the recipe's `sample.height`/`sample.width`), gradient checkpointing on (`--no-checkpointing` leaves
the recipe's setting), a reward that needs no weights (`jpeg_compressibility`; the published ones load their own
models, and a reward's cost is not what this measures), no EMA, no evaluation and no checkpoints between epochs.

The first epoch is warm-up (kernels chosen, allocator filled); the others are timed from the trainer's own
`metrics.jsonl` (`wall_s`, `rollout_s`, `reward_s`, `train_s`). `images_per_s` is images sampled and trained per
epoch over the epoch's wall time on this one device. Peak memory is CUDA's max allocated during training (the
build's float32 copies are reset before), beside the memory the weights take.

    python -m diffrl.cli bench scale --preset qwenimage --out qwen.json        # on a GPU
    python -m diffrl.cli bench scale --preset sd35m --depth 1 --size 64 --device cpu --dtype fp32   # a CPU check
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from diffrl.bench.common import NO_EVALUATION, run_trainer, temp_workdir
from diffrl.checks import resolve_dtype
from diffrl.config import load_recipe
from diffrl.files import write_json
from diffrl.training.metrics import read_metrics
from samplers.random_real import random_real_pipeline

# where the trainer's setup looks up `load_pipeline` (bound at its import): the bench hands its pipeline over there
LOADER = "diffrl.training.setup.load_pipeline"
RECIPES = {"sd35m": "flow_grpo/sd35m_pickscore", "flux1dev": "flow_grpo/flux_dev_pickscore",
           "qwenimage": "flow_grpo/qwen_image_pickscore"}  # fmt: skip


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--preset", choices=sorted(RECIPES), required=True, help="the released model to build with random weights")
    add("--recipe", default=None, help="recipe (default: the preset's published-settings Flow-GRPO recipe)")
    add("--images", type=int, default=8, help="images per epoch, all of one prompt (one group; default 8)")
    add("--size", type=int, default=None, help="image height and width in pixels (default: the recipe's size)")
    add("--epochs", type=int, default=2, help="epochs; the first is warm-up (default 2)")
    add("--depth", type=int, default=None, help="layers per tower (default: the released depth)")
    add("--no-checkpointing", action="store_true", help="leave gradient checkpointing as the recipe has it")
    add("--device", default=None, help="device (default cuda when available)")
    add("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weight dtype (default bf16)")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    add("--out", default=None, help="also write the result as JSON here")


def run_scale_bench(args) -> int:
    result = scale_bench(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return 0


def bench_overrides(args, recipe_cfg) -> list[str]:
    """The recipe changes the bench makes (see the module docstring), as `key=value` strings."""
    micro = max(k for k in range(1, min(recipe_cfg.train.batch_size, args.images) + 1) if args.images % k == 0)
    precision = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[args.dtype]
    out = [f"run.num_epochs={args.epochs}", *NO_EVALUATION, f"run.save_every={args.epochs + 1}",
           "log.image_every=0", "log.tracker=none", f"sample.batch_size={args.images}",
           "sample.num_batches_per_epoch=1", f"advantage.group_size={args.images}", f"train.batch_size={micro}",
           f"optim.gradient_accumulation_steps={max(1, args.images // micro)}", "optim.use_ema=false",
           "reward.name=jpeg_compressibility", "reward.components=[]", f"model.mixed_precision={precision}",
           "model.dtype=float32"]  # fmt: skip
    if args.size:
        out += [f"sample.height={args.size}", f"sample.width={args.size}"]
    if not args.no_checkpointing:
        out.append("model.gradient_checkpointing=true")
    return out + list(args.overrides)


def scale_bench(args, log=print) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe = args.recipe or RECIPES[args.preset]
    overrides = bench_overrides(args, load_recipe(recipe))
    cfg = load_recipe(recipe, overrides)
    cfg.model.pipeline = f"random-{args.preset}"  # a label: the pipeline below is handed to the trainer
    cuda = device.type == "cuda"
    start = time.perf_counter()
    pipe = random_real_pipeline(args.preset, device=device, dtype=resolve_dtype(args.dtype), depth=args.depth)
    build_s = time.perf_counter() - start
    sizes = {name: sum(p.numel() for p in module.parameters())
             for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    weights_mb = torch.cuda.memory_allocated(device) / 2**20 if cuda else None
    log(f"built random {args.preset} in {build_s:.0f} s: " + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in sizes.items()))

    def handed_over(*_args, **_kwargs):  # the trainer's `load_pipeline` call gets the pipeline built above
        return pipe

    with temp_workdir() as work, mock.patch(LOADER, handed_over):
        run_dir = Path(work) / "run"
        run_trainer(cfg, run_dir)
        records = [r for r in read_metrics(run_dir) if "wall_s" in r]
    timed = records[1:] or records
    median = {key: statistics.median(r.get(key, 0.0) for r in timed)
              for key in ("wall_s", "rollout_s", "reward_s", "train_s")}
    images = args.images
    result = {
        "preset": args.preset, "recipe": recipe, "overrides": overrides, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "dtype": args.dtype, "size": [cfg.sample.height, cfg.sample.width],
        "cudnn_attention": cfg.model.cudnn_attention, "depth": args.depth or "released", "images_per_epoch": images,
        "num_steps": cfg.sample.num_steps, "guidance_scale": cfg.sample.guidance_scale,
        "lora_rank": cfg.model.lora.rank, "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "parameters": sizes, "build_s": build_s, "epochs_timed": len(timed),
        "epoch_s": median, "images_per_s": images / median["wall_s"],
        "rollout_images_per_s": images / median["rollout_s"] if median["rollout_s"] else None,
        "train_images_per_s": images / median["train_s"] if median["train_s"] else None,
        "epochs": [{k: r.get(k) for k in ("epoch", "wall_s", "rollout_s", "reward_s", "train_s", "loss")}
                   for r in records],
    }  # fmt: skip
    if cuda:
        result["weights_mb"] = weights_mb
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return result
