"""Multi-process helpers (accelerate, DDP semantics) for trainers whose UNet is called through the pipeline.

The samplers call `pipe.unet` directly, so the UNet is never wrapped in `DistributedDataParallel` and DDP's
backward hooks never fire. Gradients are therefore averaged across processes explicitly, once per optimizer
step, by `all_reduce_gradients`. This is the fix for the known bug of earlier DDPO code, whose LoRA gradients
were never synchronised (each GPU trained on its own samples: the effective batch was per GPU, and the ranks'
weights drifted apart). After the mean, every rank holds the same gradient, clips it the same way and takes
the same AdamW step, so weights stay identical; `weights_fingerprint` lets tests check that.
"""

import torch

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
    import torch.distributed as dist

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
    from accelerate.utils import gather_object

    return list(gather_object(list(items)))


def weights_fingerprint(params) -> float:
    """A float64 checksum of parameters (sum of values and of values times their position); equal weights give
    equal fingerprints, and any single changed value changes it."""
    total = 0.0
    for i, p in enumerate(params):
        flat = p.detach().double().reshape(-1).cpu()
        positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        total += float(flat.sum()) + float((flat * positions).sum()) * (i + 1) * 1e-3
    return total
