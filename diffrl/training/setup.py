"""Building what every policy-gradient run needs from a `RunConfig`: accelerator, run dir, pipeline, sampler,
rewards, optimizer, LR schedule. Plain functions; each trainer calls them at the top of its `train()`."""

import math
import os
from pathlib import Path

import numpy as np

from diffrl.config import format_derived, package_versions, to_yaml
from diffrl.errors import UserError
from diffrl.files import write_text
from diffrl.pipelines import load_pipeline, set_sampling_size
from diffrl.training.metrics import tracker_kwargs
from rewards import get_reward, weighted_sum
from samplers import get_sampler

CONFIG_FILE = "config.yaml"


def make_accelerator(cfg, run_dir: Path, accelerator=None):
    """The `accelerate.Accelerator` of the run (DDP across processes; mixed precision from `model`)."""
    if accelerator is not None:
        return accelerator
    # torch, accelerate and diffusers are imported inside the functions that use them: the CLI writes a run's
    # config.yaml through this module (`write_run_config`) before anything loads torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    return Accelerator(
        mixed_precision=cfg.model.mixed_precision,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(Path(run_dir) / "logs")),
        **tracker_kwargs(cfg.log.tracker),
    )


def check_flow_sampler(sampler, cfg, method: str) -> None:
    """`method` trains a velocity on the flow-matching forward process (or its SDE): refuse a pipeline sampled by
    anything else, naming the trainers that take it."""
    if not sampler.flow:
        raise UserError(f"{method} trains flow-matching pipelines (SD3, FLUX class); {cfg.model.pipeline} is sampled "
                        f"by the '{sampler.name}' sampler: use the ddpo or raft trainer for it")


def check_distributed_type(accelerator, trainer: str, *, use_ema: bool = False) -> None:
    """Data parallelism (multi-GPU, multi-node, CPU; gradients averaged explicitly, see `diffrl.training.distributed`),
    accelerate's FSDP2 (the UNet sharded in place) or DeepSpeed ZeRO stage 1/2. FSDP1, ZeRO-3, DeepSpeed offloading
    or a DeepSpeed-built optimizer/scheduler, and Megatron-LM are refused."""
    kind = str(accelerator.distributed_type).split(".")[-1]
    if kind == "MEGATRON_LM":
        raise UserError(
            f"{trainer} runs data-parallel (accelerate's MULTI_GPU/MULTI_CPU/NO), FSDP2 or DeepSpeed ZeRO-1/2; "
            "distributed_type MEGATRON_LM is not supported: run `accelerate config` and pick one of those"
        )
    if kind == "DEEPSPEED":
        _check_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, trainer)
    if kind == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
        raise UserError(f"{trainer} does not support FSDP1 (it wraps the UNet the samplers call): set fsdp_version: 2 "
                        "in the accelerate config")
    if kind == "FSDP" and use_ema:
        raise UserError(f"{trainer}: optim.use_ema is not supported under FSDP; set optim.use_ema=false")
    if kind != "FSDP" and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # accelerate enables FSDP only on GPU-like devices; elsewhere it drops the FSDP config without a word
        raise UserError(f"the accelerate config asks for FSDP but accelerate chose distributed_type {kind} (it "
                        "enables FSDP on GPUs only): launch on GPUs, or pick a config without FSDP")


def _check_deepspeed_config(config: dict, trainer: str) -> None:
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2):
        why = ("partitions the UNet's weights, which the samplers call directly" if stage == 3 else
               "is plain data parallelism: pick multi-GPU in `accelerate config` instead")
        raise UserError(f"{trainer} supports DeepSpeed ZeRO stages 1 and 2; stage {stage} {why} (set zero_stage: 1 "
                        "or 2 in the accelerate config)")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise UserError(f"{trainer}: DeepSpeed {key} to '{device}' is not supported; set its device to none "
                            "in the accelerate config")
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise UserError(f"{trainer} builds AdamW and the LR schedule from the recipe (train.*); remove the "
                            f"'{key}' section from the DeepSpeed config")


def write_run_config(run_dir: Path, cfg, derived: dict) -> None:
    """Write the resolved config + derived numbers + package versions to `config.yaml` (main process), atomically;
    the one writer of a run's config.yaml."""
    write_text(Path(run_dir) / CONFIG_FILE, to_yaml(cfg, derived=derived, versions=package_versions()))


def print_derived(derived: dict, accelerator) -> None:
    if accelerator.is_main_process:
        print("derived numbers:\n" + format_derived(derived), flush=True)


def trainer_rng(seed: int, process_index: int) -> np.random.Generator:
    """The generator behind a process's prompt draws, per-sample seeds and shuffles (saved in checkpoints)."""
    return np.random.default_rng([seed, process_index])


def seed_everything(seed: int, process_index: int) -> None:
    """Seed Python, numpy and torch (process i with seed + i) for anything outside the trainer's generator."""
    from accelerate.utils import set_seed  # deferred: see make_accelerator

    set_seed(seed + process_index)


def load_policy_pipeline(cfg, accelerator):
    """Load the pipeline on this process's device with frozen weights in `model.mixed_precision`'s dtype (in
    `model.dtype` when that is "no"; a float64 pipeline also gets `cpu_independent_betas`)."""
    import torch  # deferred: see make_accelerator

    dtype = {"no": getattr(torch, cfg.model.dtype), "fp16": torch.float16, "bf16": torch.bfloat16}[
        cfg.model.mixed_precision]
    pipe = load_pipeline(cfg.model.pipeline, dtype=dtype, device=accelerator.device,
                         revision=cfg.model.revision or None)
    pipe.set_progress_bar_config(disable=True)
    # the recipe's size becomes the pipeline's default: every sampling of the run (rollouts, evaluation, grids,
    # DRaFT's graph) asks the family for its default size, so none of them needs to pass it
    set_sampling_size(pipe, height=cfg.sample.height, width=cfg.sample.width, num_frames=cfg.sample.num_frames)
    if dtype == torch.float64:
        pipe.scheduler = cpu_independent_betas(pipe.scheduler)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.requires_grad_(False)
    if cfg.model.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(cfg.model.cudnn_attention)  # process-wide; see ModelConfig
    if cfg.model.enable_xformers:
        pipe.enable_xformers_memory_efficient_attention()
    return pipe


def cpu_independent_betas(scheduler):
    """`scheduler` rebuilt with its "linear" or "scaled_linear" betas given as `trained_betas`, computed in Python
    floats (IEEE double, the same on every CPU) and rounded to float32 by diffusers as before. diffusers computes
    them with a float32 `torch.linspace`, whose last bits depend on the CPU's vector kernels; a float64 run's
    numbers must not. Other schedulers are returned as they are."""
    config = scheduler.config
    kind = config.get("beta_schedule")
    if config.get("trained_betas") is not None or kind not in ("linear", "scaled_linear"):
        return scheduler
    n, start, end = config.num_train_timesteps, config.beta_start, config.beta_end
    if kind == "scaled_linear":  # betas = linspace(√β_start, √β_end)²
        start, end = math.sqrt(start), math.sqrt(end)
    line = [start + (end - start) * i / (n - 1) for i in range(n)]
    betas = line if kind == "linear" else [b * b for b in line]
    return type(scheduler).from_config(config, trained_betas=betas)


# GPU kernels choose algorithms by batch shape, so a log-prob recomputed on a training minibatch differs from the
# rollout's by rounding: 1.2e-4 to 3.1e-4 nats/dim on tiny-shapes in fp32 with TF32 (H100), more in fp16/bf16.
GPU_LOGPROB_ATOL = 1e-3


def logprob_check_atol(cfg, atol: float, accelerator) -> float:
    """Tolerance of the first-inner-step check (ratio = 1): the recipe's `atol`, raised to `GPU_LOGPROB_ATOL` on
    CUDA with reduced-precision kernels (fp16/bf16 or TF32), where rounding alone would warn every epoch."""
    if accelerator.device.type == "cuda" and (cfg.model.mixed_precision != "no" or cfg.model.allow_tf32):
        return max(atol, GPU_LOGPROB_ATOL)
    return atol


def make_sampler(name: str, pipe):
    """The step policy: `"ddim"` (DDIM with eta), `"lcm"`, or `"auto"` (lcm for LCM pipelines, else ddim)."""
    return get_sampler(name, pipe)


def build_reward(cfg):
    """The training reward: `reward.name` or the weighted sum of `reward.components`."""
    if cfg.reward.name:
        return get_reward(cfg.reward.name, **cfg.reward.kwargs)
    return weighted_sum([{"name": c.name, "weight": c.weight, "kwargs": c.kwargs} for c in cfg.reward.components])


def build_gold_reward(cfg):
    """The held-out gold reward (evaluation only), or `None`."""
    if not cfg.reward.gold:
        return None
    return get_reward(cfg.reward.gold, **cfg.reward.gold_kwargs)


def make_optimizer(params, *, learning_rate, betas, weight_decay, eps):
    import torch  # deferred: see make_accelerator

    return torch.optim.AdamW(params, lr=learning_rate, betas=betas, weight_decay=weight_decay, eps=eps)


def make_lr_scheduler(optimizer, name: str, *, warmup_steps: int, total_steps: int):
    from diffusers.optimization import get_scheduler  # deferred: see make_accelerator

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1))


def num_train_timesteps(num_steps: int, fraction: float) -> int:
    """Denoising steps trained per trajectory: int(T · fraction), at least 1."""
    if not 0 < fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {fraction}")
    return max(1, int(num_steps * fraction))
