"""What is trained and how it is saved: LoRA through peft or full fine-tuning of the UNet.

LoRA adapters are added with diffusers' public `unet.add_adapter(peft.LoraConfig(...))` and exported with the
pipeline class's `save_lora_weights`, so a fine-tuned result loads in plain diffusers with
`pipe.load_lora_weights(checkpoint_dir)`. Full fine-tuning exports the UNet with `save_pretrained`.

For exact resume a checkpoint also stores every trainable tensor under its own parameter name
(`trainable.safetensors`), which round-trips bit for bit without any key conversion.
"""

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffrl.errors import UserError
from diffrl.files import DamagedFile, load_safetensors, save_safetensors

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
TRAINABLE_NAME = "trainable.safetensors"
DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def setup_trainable(unet, *, use_lora: bool, lora_rank: int, lora_alpha: float, lora_target_modules) -> list:
    """Freeze the UNet, then add a LoRA adapter (or unfreeze everything) and return the trainable parameters.

    LoRA's B matrices start at zero (peft's "gaussian" init: A ~ N(0, 1/r), B = 0), so the fine-tuned model
    starts exactly at the pre-trained one and the first rollout's log-probs are the pre-trained policy's. peft
    creates and initialises the adapter in torch's default dtype; a float64 UNet's adapter is created in float64, so
    its initial values do not depend on the CPU (torch's float32 `normal_` has an AVX2-only kernel).
    """
    unet.requires_grad_(False)
    if use_lora:
        # peft, diffusers and torch.distributed.tensor take seconds to import: only the functions that use them pay,
        # so importing a trainer stays at torch's cost
        from peft import LoraConfig
        from peft.utils.error import NoMatchingPeftModuleError

        config = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            init_lora_weights="gaussian",
            target_modules=list(lora_target_modules),
            lora_dropout=0.0,  # dropout would make the recomputed log-prob differ from the rollout's (ratio != 1)
        )
        default_dtype = torch.get_default_dtype()
        if unet.dtype == torch.float64:
            torch.set_default_dtype(torch.float64)
        try:
            unet.add_adapter(config)
        except NoMatchingPeftModuleError:
            pass  # no trainable parameters: the one-line error below
        finally:
            torch.set_default_dtype(default_dtype)
    else:
        unet.requires_grad_(True)
    params = [p for p in unet.parameters() if p.requires_grad]
    if not params:
        raise UserError(
            f"no {type(unet).__name__} module matched lora_target_modules={list(lora_target_modules)}; "
            "name attention projections such as to_q, to_k, to_v, to_out.0"
        )
    return params


def setup_policy_weights(unet, model_cfg, *, use_lora: bool) -> list:
    """`setup_trainable` from a recipe's `model` group, as every trainer and bench sets up its policy: the
    trainable weights cast to fp32 (so they and AdamW's state stay fp32 when the frozen ones are fp16/bf16; float64
    ones stay float64), gradient checkpointing and compilation when the recipe asks for them. Returns the trainable parameters."""
    params = setup_trainable(unet, use_lora=use_lora, lora_rank=model_cfg.lora.rank, lora_alpha=model_cfg.lora.alpha,
                             lora_target_modules=model_cfg.lora.target_modules)
    for p in params:
        if p.dtype.itemsize < 4:
            p.data = p.data.float()
    if model_cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if model_cfg.compile:
        unet.compile()  # in place: the module (and its state_dict keys) stay as they are
    return params


def trainable_state_dict(module) -> dict:
    """Every parameter with `requires_grad`, by name, detached, on CPU, contiguous (for safetensors)."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in module.named_parameters() if p.requires_grad}


def tensor_mismatch(expected: dict, found: dict) -> str | None:
    """What keeps the tensors `found` (by name, read from a file) from being copied into `expected` (the tensors
    they restore, by the same names): a name missing or extra, another shape (`copy_` would broadcast a
    `[1]` or `[r]` tensor over a `[r, d]` one without a word), or integer/bool values for floating-point ones.
    `None` when they fit."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"has no tensor '{missing[0]}'{more}"
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"has a tensor '{extra[0]}' that the model does not{more}"
    for name, target in expected.items():
        value = found[name]
        if tuple(value.shape) != tuple(target.shape):
            return f"has tensor '{name}' of shape {list(value.shape)}, the model's is {list(target.shape)}"
        if value.dtype.is_floating_point != target.dtype.is_floating_point or value.dtype.is_complex:
            return f"has tensor '{name}' of dtype {value.dtype}, the model's is {target.dtype}"
    return None


def load_trainable_state_dict(module, state: dict) -> None:
    """Copy `state` (from `trainable_state_dict`) into the module's trainable parameters; names, shapes and the kind
    of dtype must match (`ValueError` naming the first tensor that does not). Under FSDP2 every process passes the
    full tensors and keeps its shard of each."""
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    problem = tensor_mismatch(params, state)
    if problem:
        raise ValueError(f"trainable weights do not match: the state {problem}")
    with torch.no_grad():
        for name, p in params.items():
            value = state[name].to(p.device, p.dtype)
            if hasattr(p, "device_mesh"):  # an FSDP2 shard (a DTensor): keep this process's part
                from torch.distributed.tensor import distribute_tensor  # deferred: see setup_trainable

                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value)


def save_trainable(module, directory: Path) -> None:
    save_safetensors(Path(directory) / TRAINABLE_NAME, trainable_state_dict(module))


def load_trainable(module, directory: Path) -> None:
    """Restore the trainable parameters from `directory/trainable.safetensors`; a file that does not fit them (a
    tensor missing, extra, of another shape or kind) is a `DamagedFile` naming it and the tensor."""
    path = Path(directory) / TRAINABLE_NAME
    state = load_safetensors(path)
    problem = tensor_mismatch({n: p for n, p in module.named_parameters() if p.requires_grad}, state)
    if problem:
        raise DamagedFile(path, f"{problem} (damaged, or written for another model or LoRA setting)")
    load_trainable_state_dict(module, state)


def export_weights(pipe, unet, directory: Path, *, use_lora: bool, state_dict: dict | None = None) -> None:
    """Write the weights users load: LoRA in diffusers' format, or the full denoiser (`directory/unet`, or
    `directory/transformer` for flow pipelines).

    `state_dict` (full tensors by parameter name, as `distributed.full_state_dict` gathers them under FSDP2, where
    the UNet itself holds only shards) replaces the UNet's own weights; with LoRA it needs only the adapter's.
    """
    directory = Path(directory)
    component = denoiser_name(pipe)
    if use_lora:
        from diffusers.utils import convert_state_dict_to_diffusers  # deferred: see setup_trainable
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(unet, state_dict=state_dict)
        if component == "unet":  # the UNet loaders read diffusers' key names; the transformer loaders read peft's
            layers = convert_state_dict_to_diffusers(layers)
        layers = {k: v.detach().to("cpu").contiguous() for k, v in layers.items()}
        # The adapter config (alpha, rank, targets) travels as metadata: without it diffusers would load the
        # layers with alpha = rank and silently rescale the update whenever lora_alpha != lora_rank.
        metadata = unet.peft_config["default"].to_dict()
        type(pipe).save_lora_weights(
            directory, **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": metadata},
            safe_serialization=True,
        )
    elif state_dict is None:
        unet.save_pretrained(directory / component, safe_serialization=True)
    else:  # what save_pretrained writes (config + one safetensors file), from the gathered full weights
        from diffusers.utils import SAFETENSORS_WEIGHTS_NAME  # deferred: see setup_trainable
        unet.save_config(directory / component)
        save_file(state_dict, str(directory / component / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})


def denoiser_name(pipe) -> str:
    """The pipeline component that is trained: `"unet"`, or `"transformer"` (SD3, FLUX)."""
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def adapter_disabled(unet):
    """Context manager running `unet` as the pre-trained model: its LoRA adapter off, restored on exit.

    DPOK's reference policy is the same network without the adapter, so no second copy of the UNet is kept.
    """
    @contextmanager
    def _off():
        unet.disable_adapters()
        try:
            yield unet
        finally:
            unet.enable_adapters()

    return _off()
