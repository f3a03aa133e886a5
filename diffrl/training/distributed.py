"""Multi-process helpers (accelerate, DDP semantics) for trainers whose UNet is called through the pipeline.

The samplers call `pipe.unet` directly, so the UNet is never wrapped in `DistributedDataParallel` and DDP's
backward hooks never fire. Gradients are therefore averaged across processes explicitly, once per optimizer
step, by `all_reduce_gradients`. This is the fix for the known bug of earlier DDPO code, whose LoRA gradients
were never synchronised (each GPU trained on its own samples: the effective batch was per GPU, and the ranks'
weights drifted apart). After the mean, every rank holds the same gradient, clips it the same way and takes
the same AdamW step, so weights stay identical; `weights_fingerprint` lets tests check that.

Under accelerate's FSDP2 (`distributed_type: FSDP`, `fsdp_version: 2`) the UNet is sharded instead: `fully_shard`
works in place (the module keeps its class, `pipe.unet` stays the same object, so the samplers need no change) and
turns every parameter into a `DTensor` shard whose gradient FSDP reduce-scatters (mean over processes) during
backward. `all_reduce_gradients` is then skipped for the UNet; checkpoints gather full tensors (`full_state_dict`).
FSDP1 is refused: it wraps the UNet in a new `FullyShardedDataParallel` object that the samplers, peft's adapter
switches and diffusers' LoRA export would all have to reach through.

Under accelerate's DeepSpeed (ZeRO stage 1 or 2) the UNet and AdamW go to `deepspeed.initialize`: the engine wraps
the UNet but the samplers keep calling the module itself (ZeRO-1/2 leave every weight whole on every process; only
the optimizer state, and at stage 2 the gradients, are partitioned). ZeRO's gradient hooks sit on the parameters, so
they fire whichever way the forward was called. The trainers call backward many times per optimizer step (per
minibatch and denoising step), so `policy_backward` tells the engine which backward is the last one before the step
(where ZeRO reduces) and stops it from rescaling the loss (the trainers already divide it); `optimizer_step` then
calls `engine.step()`, which clips to the recipe's `max_grad_norm`, steps and skips a step whose gradient is not
finite. ZeRO-3 (weights partitioned: the samplers' direct calls would see empty shards) and offloading are refused.
"""

import torch
import torch.distributed as dist

# Gradients are averaged in flat buckets of about this many elements (few collective calls, bounded memory).
BUCKET_NUMEL = 25_000_000


def all_reduce_gradients(params, accelerator) -> None:
    """Replace each parameter's `.grad` by its mean over processes (no-op with one process).

    A parameter without a gradient on this rank contributes zeros, so all ranks enter the same collectives.
    """
    if accelerator.num_processes == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in params:
        bucket.append(p)
        size += p.numel()
        if size >= BUCKET_NUMEL:
            _reduce_bucket(bucket, accelerator)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, accelerator)


def _reduce_bucket(bucket, accelerator) -> None:
    flat = torch.cat([p.grad.reshape(-1).float() for p in bucket])
    flat = accelerator.reduce(flat, reduction="mean")
    offset = 0
    for p in bucket:
        n = p.numel()
        p.grad.copy_(flat[offset: offset + n].view_as(p.grad).to(p.grad.dtype))
        offset += n


def broadcast_parameters(params, accelerator) -> None:
    """Copy rank 0's values of `params` to every process (what DDP does when it wraps a model). Needed because
    each process seeds differently (different noise per process), so freshly initialised LoRA matrices differ."""
    if accelerator.num_processes == 1:
        return
    with torch.no_grad():
        for p in params:
            data = p.data.to(accelerator.device)
            dist.broadcast(data, src=0)
            p.data.copy_(data)


def gather_tensor(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a per-process tensor (same shape on every rank) over processes, in rank order, on CPU."""
    if accelerator.num_processes == 1:
        return tensor.detach().cpu()
    return accelerator.gather(tensor.detach().to(accelerator.device).contiguous()).cpu()


def gather_list(accelerator, items: list) -> list:
    """Concatenate per-process Python lists over processes, in rank order."""
    if accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object  # deferred: importing a trainer loads torch, not accelerate

    return list(gather_object(list(items)))


def weights_fingerprint(params) -> float:
    """A float64 checksum of parameters (sum of values and of values times their position); equal weights give
    equal fingerprints, and any single changed value changes it. Under FSDP2 a collective (gathers each shard)."""
    total = 0.0
    for i, p in enumerate(params):
        flat = full_tensor(p.detach()).double().reshape(-1).cpu()  # an FSDP2 shard: the gathered whole
        positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        total += float(flat.sum()) + float((flat * positions).sum()) * (i + 1) * 1e-3
    return total


def is_fsdp(accelerator) -> bool:
    """Whether accelerate shards the model (FSDP); trainers accept only FSDP2 (`setup.check_distributed_type`)."""
    return str(accelerator.distributed_type).split(".")[-1] == "FSDP"


def is_deepspeed(accelerator) -> bool:
    """Whether accelerate runs DeepSpeed; trainers accept ZeRO stages 1 and 2 (`setup.check_distributed_type`)."""
    return str(accelerator.distributed_type).split(".")[-1] == "DEEPSPEED"


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of this run, 0 without DeepSpeed."""
    if not is_deepspeed(accelerator):
        return 0
    return int(accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"])


def deepspeed_engine(accelerator):
    """The `DeepSpeedEngine` that `prepare_policy` made for the UNet."""
    return accelerator.deepspeed_engine_wrapped.engine


def prepare_policy(unet, params: list, optimizer, accelerator, *, micro_batch_size: int = 1,
                   backwards_per_step: int = 1, max_grad_norm: float = 0.0):
    """`accelerator.prepare` the optimizer (DDP style), or under FSDP2 / DeepSpeed the UNet and the optimizer together.

    Under DeepSpeed the config's batch and clipping entries are set from the recipe first (whatever the accelerate
    config says: the recipe owns them): `micro_batch_size` rows per backward, `backwards_per_step` backward calls per
    optimizer step, gradient clipping at `max_grad_norm` (0: none). Returns `(optimizer, params)`: under FSDP2
    `fully_shard` replaces every parameter by a `DTensor` shard (and accelerate points the optimizer at them), so the
    trainable parameters are listed again from the UNet.
    """
    if is_deepspeed(accelerator):
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
        config["gradient_accumulation_steps"] = backwards_per_step
        config["train_batch_size"] = micro_batch_size * backwards_per_step * accelerator.num_processes
        config["gradient_clipping"] = float(max_grad_norm) if max_grad_norm > 0 else 0.0
        if config.get("bf16", {}).get("enabled") is True:  # skip non-finite steps in bf16 too, as in fp32 and fp16
            config["bf16"]["check_grad_overflow"] = True
        # accelerate adopts DeepSpeed's count at prepare, warning of a "mismatch" if its own differs: give it the count
        # (the trainers never use accelerate's accumulation: policy_backward marks each step's last backward)
        accelerator.gradient_accumulation_steps = backwards_per_step
        engine, optimizer = accelerator.prepare(unet, optimizer)
        if engine.module is not unet:
            raise RuntimeError("DeepSpeed's engine does not hold the pipeline's UNet; the samplers would bypass it")
        return optimizer, params
    if not is_fsdp(accelerator):
        return accelerator.prepare(optimizer), params
    prepared, optimizer = accelerator.prepare(unet, optimizer)
    if prepared is not unet:  # FSDP2 is in place; a wrapper would bypass the samplers' `pipe.unet` calls
        raise RuntimeError("accelerate's FSDP2 returned a new module instead of sharding the UNet in place")
    return optimizer, [p for p in unet.parameters() if p.requires_grad]


def policy_backward(loss: torch.Tensor, accelerator, *, last: bool) -> None:
    """`accelerator.backward(loss)`; under DeepSpeed the engine's backward, told whether this is the optimizer step's
    last one (`last`: ZeRO reduces there) and without its division by the accumulation count (the trainers divide)."""
    if not is_deepspeed(accelerator):
        accelerator.backward(loss)
        return
    engine = deepspeed_engine(accelerator)
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss, scale_wrt_gas=False)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every process must call it), or `t` itself."""
    if not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor  # after is_available(): slow to import, absent without distributed

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(module, accelerator, *, trainable_only: bool) -> dict:
    """The module's state dict (or only its trainable parameters) as full CPU tensors on the main process, `{}`
    elsewhere. A collective under FSDP: every process calls it; tensors are gathered one at a time."""
    keep = {n for n, p in module.named_parameters() if p.requires_grad} if trainable_only else None
    out = {}
    for name, t in module.state_dict().items():
        if keep is not None and name not in keep:
            continue
        t = full_tensor(t.detach())
        if accelerator.is_main_process:
            out[name] = t.to("cpu").contiguous().clone()
    return out


def full_optimizer_state_dict(module, optimizer) -> dict:
    """The optimizer's state with full tensors, keyed by parameter name, on the main process (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # FSDP2 only; slow

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(module, getattr(optimizer, "optimizer", optimizer), options=options)


def load_full_optimizer_state_dict(module, optimizer, state: dict) -> None:
    """Inverse of `full_optimizer_state_dict`; every process passes the full state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict  # FSDP2 only; slow

    set_optimizer_state_dict(module, getattr(optimizer, "optimizer", optimizer), optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
