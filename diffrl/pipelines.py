"""Load a diffusers pipeline from an embedded name, a local folder or a hub id, optionally with a trained LoRA.

`load_pipeline` is the one place diffrl turns a model name into a pipeline, so the CLI, the trainers, the steering
methods and the demo all accept the same names:

- an embedded ShapesWorld model (`tiny-shapes`, `tiny-shapes-lcm`), shipped inside diffrl;
- a local diffusers folder (anything `DiffusionPipeline.from_pretrained` reads: a `model_index.json` plus one
  folder per component);
- a hub id (`stable-diffusion-v1-5/stable-diffusion-v1-5`), read from the local Hugging Face cache first and
  downloaded only when the hub is reachable. Offline (`HF_HUB_OFFLINE=1`, or no route to the hub) an uncached id
  fails at once with a message, instead of waiting on network retries.

A folder may hold only some components (tiny-shapes-lcm keeps just its UNet and scheduler). The rest come from
another pipeline: the embedded table below says which for embedded names, and any folder can name its own in
`model_index.json` under `"_diffrl_components_from"` (an embedded name, or a folder path relative to it).
diffusers ignores keys that start with "_", so such a folder still loads in plain diffusers when the missing
components are passed in. Two more such keys: `"_diffrl_shared_components"` maps a component to another of the same
folder that serves as both (tiny-shapes-flow's one CLIP tower is SD3's two), and `"_diffrl_max_sequence_length"`
is the T5 token count a flow model was trained with (registered on the loaded pipeline's config, where the flow
sampler reads it); `"_diffrl_height"`, `"_diffrl_width"` and `"_diffrl_num_frames"`, registered the same way, set a
video folder's default sampling size (the Wan family reads them). Components the index lists as `[null, null]` are
passed as None (SD3's absent T5).

Stable Diffusion's safety checker is not loaded: it is a separate 1.2 GB CLIP model that blacks out images, which
would corrupt rewards. The loader logs that it is off.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import threading
import warnings
from pathlib import Path
from urllib.parse import urlparse

from diffrl.checks import check_device, resolve_dtype
from diffrl.embedded import EMBEDDED_MODELS, embedded_path, is_embedded, is_pipeline
from diffrl.errors import UserError
from diffrl.files import load_safetensors, read_json
from diffrl.hub import hub_offline
from diffrl.rundir import find_trained_weights

logger = logging.getLogger(__name__)

# Embedded pipelines whose folders hold only some components: name -> embedded pipeline giving the rest.
EMBEDDED_COMPONENTS_FROM = {"tiny-shapes-lcm": "tiny-shapes"}

COMPONENTS_FROM_KEY = "_diffrl_components_from"
SHARED_COMPONENTS_KEY = "_diffrl_shared_components"
MAX_SEQUENCE_LENGTH_KEY = "_diffrl_max_sequence_length"
# the default sampling size of a folder: height, width, frames (every family's latent_shape reads them); a recipe's
# sample.height / sample.width / sample.num_frames replace them on the loaded pipeline (`set_sampling_size`)
SIZE_KEYS = ("_diffrl_height", "_diffrl_width", "_diffrl_num_frames")
HUB_PROBE_TIMEOUT_S = 3.0  # seconds to wait for a TCP connection to the hub before calling it unreachable
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_pipeline(name_or_path, *, dtype=None, device=None, lora=None, revision: str | None = None):
    """Load a diffusers pipeline.

    Args:
        name_or_path (`str` or `os.PathLike`):
            An embedded name (`tiny-shapes`, `tiny-shapes-lcm`), a local diffusers folder, or a hub id.
        dtype (`torch.dtype` or `str`, *optional*):
            Weight dtype: a `torch.dtype` or a name `diffrl.checks.resolve_dtype` accepts ("fp32", "fp16", "bf16",
            ...). Defaults to float32.
        device (`str` or `torch.device`, *optional*):
            Device to move the pipeline to. Defaults to leaving it on the CPU.
        lora (`str` or `os.PathLike`, *optional*):
            A run dir (its newest checkpoint is used) or a folder with LoRA weights saved in diffusers'
            `save_lora_weights` format. A checkpoint of a full fine-tune (a `unet/` folder) replaces the UNet.
        revision (`str`, *optional*):
            Hub revision (branch, tag or commit) for a hub id.

    Returns:
        The pipeline (`StableDiffusionPipeline`, `LatentConsistencyModelPipeline`, ... as its folder says), with
        progress bars off, no safety checker, on `device`.

    Raises:
        `UserError`: unknown name, missing folder, a hub id that is not cached while the hub is offline or
        unreachable, a LoRA path that holds no weights, a device this machine does not have.
    """
    torch_dtype = resolve_dtype(dtype)
    if device is not None:  # an unknown device, or CUDA without a GPU, fails before any weights load
        device = check_device(device)
    kind, where = resolve_pipeline_name(name_or_path)
    with _quiet_loading():
        if kind == "embedded":
            name = str(name_or_path)
            pipe = _load_folder(embedded_path(name), torch_dtype, components_from=EMBEDDED_COMPONENTS_FROM.get(name))
        elif kind == "folder":
            pipe = _load_folder(where, torch_dtype)
        else:
            pipe = _load_folder(_hub_folder(str(where), revision), torch_dtype)
        if lora is not None:
            load_lora_into(pipe, lora)
    pipe.set_progress_bar_config(disable=True)
    if device is not None:
        pipe.to(device)
    return pipe


def resolve_pipeline_name(name_or_path) -> tuple[str, Path | str]:
    """What a pipeline name refers to, without loading anything: `("embedded", folder)`, `("folder", folder)` or
    `("hub", repo_id)`.

    Raises:
        `UserError`: an embedded model that is not built, a missing folder, a folder without model_index.json,
        or a name that is none of these.
    """
    name = str(name_or_path)
    path = Path(name).expanduser()
    if is_embedded(name):
        return "embedded", embedded_path(name)
    if path.exists():
        _read_model_index(path)
        return "folder", path
    if name.startswith((".", "/", "~")) or name.endswith(("/", os.sep)):
        raise UserError(f"pipeline folder {name} does not exist")
    if _HUB_ID.match(name):
        return "hub", name
    import difflib

    close = difflib.get_close_matches(name, list(EMBEDDED_MODELS), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UserError(f"unknown pipeline '{name}': not an embedded model ({', '.join(_embedded_pipelines())}), "
                    f"not an existing folder, not a hub id (org/name); {hint}`diffrl ls pipelines` lists them")


def _embedded_pipelines() -> list[str]:
    return [name for name in EMBEDDED_MODELS if is_pipeline(name)]


@contextlib.contextmanager
def _quiet_loading():
    """Turn off diffusers' and transformers' loading progress bars for the duration, then restore them."""
    from diffusers.utils import logging as d_logging
    from transformers.utils import logging as t_logging

    d_was, t_was = d_logging.is_progress_bar_enabled(), t_logging.is_progress_bar_enabled()
    d_logging.disable_progress_bar()
    t_logging.disable_progress_bar()
    try:
        yield
    finally:
        if d_was:
            d_logging.enable_progress_bar()
        if t_was:
            t_logging.enable_progress_bar()


def _read_model_index(folder: Path) -> dict:
    index = folder / "model_index.json"
    if not index.is_file():
        what = "a file" if folder.is_file() else "a folder without model_index.json"
        raise UserError(f"{folder} is {what}, not a diffusers pipeline folder; a single-file checkpoint can be "
                        "converted with diffusers' `<Pipeline>.from_single_file(path).save_pretrained(folder)`")
    index_data = read_json(index, "pipeline index")
    if not isinstance(index_data, dict):
        raise UserError(f"{index} is not a diffusers model index (a JSON object of components)")
    _check_component_libraries(index, index_data)
    return index_data


def _check_component_libraries(index_file: Path, index: dict) -> None:
    """Refuse a component whose library diffusers would not load from a folder.

    A model index names a (library, class) per component, and loading imports that library: a folder naming its own
    `payload` module would run it. diffusers loads only its loadable libraries (diffusers, transformers, …) and its
    own pipeline modules (`stable_diffusion` for SD's safety checker); so does diffrl, checked before any import.
    """
    from diffusers import pipelines
    from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES

    for name, (library, class_name) in _components(index).items():
        pipeline_module = isinstance(library, str) and library.isidentifier() and getattr(
            getattr(pipelines, library, None), "__name__", None) == f"diffusers.pipelines.{library}"
        if library not in LOADABLE_CLASSES and not pipeline_module:
            raise UserError(f"{index_file}: component '{name}' names the library {library!r}, which diffusers does "
                            f"not load components from ({', '.join(sorted(LOADABLE_CLASSES))} or a diffusers "
                            "pipeline module); diffrl imports no module a model folder names")
        if not isinstance(class_name, str):
            raise UserError(f"{index_file}: component '{name}' has class {class_name!r}, not a class name")


def _components(index: dict) -> dict:
    return {k: v for k, v in index.items()
            if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == 2 and v[0] is not None}


def _lending_folder(folder: Path, index: dict, missing: list[str], components_from: str | None) -> Path:
    """The pipeline folder that lends a partial folder its `missing` components."""
    source = components_from or index.get(COMPONENTS_FROM_KEY)
    if not source:
        raise UserError(f"pipeline folder {folder} has no {', '.join(missing)} folder(s) and does not say where "
                        f"they come from (`{COMPONENTS_FROM_KEY}` in model_index.json)")
    return embedded_path(source) if is_embedded(source) else (folder / source).resolve()


def check_pipeline(name_or_path, *, revision: str | None = None) -> dict | None:
    """Check a pipeline without loading weights: its folder, model index, every component's folder (or the folder
    that lends it) and config file. Returns the UNet's config, or None for a hub id that is not in the local cache
    (loading it is then the first thing a run does).

    Raises:
        `UserError`: what `load_pipeline` would fail on before reading weights.
    """
    kind, where = _local_folder(name_or_path, revision)
    if where is None:
        return None
    name = str(name_or_path)
    return _check_folder(where, EMBEDDED_COMPONENTS_FROM.get(name) if kind == "embedded" else None)


def _local_folder(name_or_path, revision: str | None) -> tuple[str, Path | None]:
    """(kind, folder on this machine) of a pipeline name; the folder is None for a hub id not in the local cache."""
    kind, where = resolve_pipeline_name(name_or_path)
    if kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(where), "model_index.json", revision=revision)
        if not isinstance(cached, str):
            return kind, None
        where = Path(cached).parent
    return kind, Path(where)


def read_scheduler_config(name_or_path, *, revision: str | None = None) -> dict | None:
    """The pipeline's scheduler config, read without loading anything (from the folder that lends the scheduler, for
    a partial folder). `None` for a hub id not in the local cache, or a pipeline without a scheduler config."""
    return _read_component_config(name_or_path, "scheduler", "scheduler_config.json", revision)


def _read_component_config(name_or_path, component: str, file_name: str, revision: str | None) -> dict | None:
    """A component's config file, read without loading anything (from the lending folder for a partial folder);
    `None` where there is none on this machine."""
    kind, folder = _local_folder(name_or_path, revision)
    if folder is None:
        return None
    if not (folder / component).is_dir():
        lender = EMBEDDED_COMPONENTS_FROM.get(str(name_or_path)) if kind == "embedded" else None
        index = _read_model_index(folder)
        if not (lender or index.get(COMPONENTS_FROM_KEY)):
            return None  # check_pipeline names what is missing
        folder = _lending_folder(folder, index, [component], lender)
    file = folder / component / file_name
    return read_json(file, f"{component} config") if file.is_file() else None


def sampling_configs(name_or_path, *, revision: str | None = None) -> tuple[str, dict, dict, dict] | None:
    """What a family's size rule reads, from a pipeline's files without loading anything: `(denoiser class, model
    index, denoiser config, VAE config)`, each config completed with its class's defaults as diffusers' `from_config`
    completes it (a saved config may leave out keys such as SD3's `patch_size`), so the rule sees what the loaded
    pipeline's configs hold. None for a hub id not in the local cache or a folder without a UNet or transformer."""
    _, folder = _local_folder(name_or_path, revision)
    if folder is None:
        return None
    index = _read_model_index(folder)
    components = _components(index)
    component = next((k for k in ("unet", "transformer") if k in components), None)
    if component is None:
        return None
    configs = []
    for name in (component, "vae"):
        config = _read_component_config(name_or_path, name, "config.json", revision)
        if config is None:
            if name == component:
                return None
            config = {}  # no VAE: the families' rules take diffusers' defaults for a pipeline without one
        configs.append(_with_class_defaults(components.get(name, (None, None))[1], config))
    return components[component][1], index, *configs


def _with_class_defaults(class_name: str | None, config: dict) -> dict:
    """`config` completed with the `__init__` defaults of the diffusers class `class_name` (one diffusers exports;
    nothing a folder names is imported from anywhere else)."""
    import diffusers  # deferred: as in check_sampling_size

    cls = getattr(diffusers, class_name, None) if isinstance(class_name, str) and class_name.isidentifier() else None
    if not isinstance(cls, type):
        return config
    parameters = inspect.signature(cls.__init__).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return {**defaults, **config}


def check_sampling_size(name_or_path, *, height: int, width: int, num_frames: int, revision: str | None = None,
                        keys=("sample.height", "sample.width", "sample.num_frames")):
    """Check a sampling size (0 = the model's default) against the pipeline's model family without loading weights:
    the family's own size rule (`<family>.sampling_size`, which its `latent_shape` calls on the loaded pipeline) on
    the configs `sampling_configs` reads. Returns the resolved `SamplingSize`, or None where the configs are not on
    this machine (an uncached hub id: the family refuses a bad size at the first sample) or no family has the
    denoiser.

    Raises:
        `UserError`: the family's one line, naming `keys` (`sample.height`, ...; `--height`, ... for flags).
    """
    # deferred: diffrl.models loads torch and diffusers, and this module is imported by what runs before torch
    # loads (the CLI writes config.yaml through diffrl.training.setup first)
    from diffrl.models import size_rule

    configs = sampling_configs(name_or_path, revision=revision)
    rule = size_rule(configs[0]) if configs is not None else None
    if rule is None:
        return None
    _, index, denoiser, vae = configs
    return rule(index, denoiser, vae, height, width, num_frames, keys=keys)


def unet_latent_size(name_or_path, *, height: int = 0, width: int = 0,
                     revision: str | None = None) -> tuple[int, int] | None:
    """`(h, w)` of the latents a UNet pipeline samples at `height` x `width` (0 = the folder's `_diffrl_height` /
    `_diffrl_width`, else the UNet's `sample_size`), from its configs without loading weights, by the UNet family's
    size rule as `UNetFamily.latent_shape` gives it once loaded; None where the configs do not say."""
    # deferred: as in check_sampling_size
    from diffrl.models import kl_vae_factor

    size = check_sampling_size(name_or_path, height=height, width=width, num_frames=0, revision=revision)
    if size is None:
        return None
    factor = kl_vae_factor(sampling_configs(name_or_path, revision=revision)[3])
    return size.height // factor, size.width // factor


def set_sampling_size(pipe, *, height: int = 0, width: int = 0, num_frames: int = 0) -> None:
    """Make a size the loaded pipeline's default, as a folder's `_diffrl_height` / `_diffrl_width` /
    `_diffrl_num_frames` would (every family's `latent_shape` reads them); 0 leaves that one as it is. diffrl's
    sampling then uses it wherever no size is passed: rollouts, evaluation, grids, DRaFT's graph, pairs."""
    values = {key: value for key, value in zip(SIZE_KEYS, (height, width, num_frames)) if value}
    if values:
        pipe.register_to_config(**values)


@contextlib.contextmanager
def sampling_size(pipe, *, height: int = 0, width: int = 0, num_frames: int = 0):
    """`set_sampling_size` for the duration of a `with` block, then the pipeline's config as it was (held-out
    evaluation at `sample.eval_height` / `eval_width` / `eval_num_frames` while rollouts keep the training size);
    all 0 changes nothing."""
    before = pipe._internal_dict  # diffusers' ConfigMixin keeps the config here; register_to_config replaces it
    set_sampling_size(pipe, height=height, width=width, num_frames=num_frames)
    try:
        yield
    finally:
        pipe._internal_dict = before


def _check_folder(folder: Path, components_from: str | None) -> dict | None:
    index = _read_model_index(folder)
    components = {k: v for k, v in _components(index).items() if k != "safety_checker"}
    shared = _shared_components(folder, index)
    missing = [k for k in components if not (folder / k).is_dir() and k not in shared]
    unet_config = None
    for k in components:
        if k in missing:
            continue
        configs = [c for c in ("config.json", "scheduler_config.json") if (folder / k / c).is_file()]
        for c in configs:
            data = read_json(folder / k / c, f"{k} config")
            if k == "unet":
                unet_config = data
    if missing:
        lent = _check_folder(_lending_folder(folder, index, missing, components_from), None)
        if "unet" in missing:
            unet_config = lent
    if "unet" in components and unet_config is None:
        raise UserError(f"pipeline folder {folder} has no unet/config.json")
    return unet_config


def check_lora_targets(unet_config: dict, target_modules, pipeline: str) -> None:
    """Every LoRA target must name modules of the UNet that peft can adapt (matched as peft matches a list: the
    module name equals the target or ends with "." + target). Builds the UNet on the meta device: no weights."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    config = {k: v for k, v in unet_config.items() if not k.startswith("_")}
    try:
        with init_empty_weights():
            unet = UNet2DConditionModel.from_config(config)
    except (TypeError, ValueError) as e:
        raise UserError(f"the UNet config of {pipeline} does not build a UNet2DConditionModel "
                        f"({str(e).splitlines()[0]})") from None
    supported = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    modules = dict(unet.named_modules())
    for target in target_modules:
        matched = [n for n in modules if n == target or n.endswith(f".{target}")]
        if not matched:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
            import difflib

            close = difflib.get_close_matches(target, leaves, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(f"model.lora.target_modules: '{target}' matches no module of the UNet of {pipeline}; "
                            f"{hint}attention projections are to_q, to_k, to_v, to_out.0")
        bad = next((n for n in matched if not isinstance(modules[n], supported)), None)
        if bad is not None:
            raise UserError(f"model.lora.target_modules: '{target}' matches {bad}, a {type(modules[bad]).__name__}, "
                            "which LoRA cannot adapt; name Linear or Conv layers (to_q, to_k, to_v, to_out.0)")


def _load_folder(folder: Path, torch_dtype, components_from: str | None = None):
    from diffusers import DiffusionPipeline

    index = _read_model_index(folder)
    components = _components(index)
    kwargs = {}
    if "safety_checker" in components:
        kwargs.update(safety_checker=None, requires_safety_checker=False)
        logger.info("safety checker disabled (it is a separate model that would black out images and skew rewards)")
    for k, v in index.items():  # components the index says are absent (SD3 without T5): diffusers wants them named
        if not k.startswith("_") and v in ([None, None], (None, None)):
            kwargs.setdefault(k, None)
    shared = _shared_components(folder, index)
    for k, source in shared.items():
        if not (folder / k).is_dir():
            kwargs[k] = _load_component(folder / source, components[source], torch_dtype)
    missing = [k for k in components if k not in kwargs and not (folder / k).is_dir()]
    if missing:
        base_folder = _lending_folder(folder, index, missing, components_from)
        base = _load_folder(base_folder, torch_dtype)
        for k in missing:
            if getattr(base, k, None) is None:
                raise UserError(f"pipeline folder {folder} lacks '{k}' and {base_folder} has none to lend")
            kwargs[k] = getattr(base, k)
    try:
        pipe = DiffusionPipeline.from_pretrained(folder, **_dtype_kwarg(torch_dtype), **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load pipeline folder {folder}: {str(e).splitlines()[0]}") from e
    for k, source in shared.items():  # one module, not two copies of it
        if not (folder / k).is_dir():
            setattr(pipe, k, getattr(pipe, source))
    for key in (MAX_SEQUENCE_LENGTH_KEY, *SIZE_KEYS):
        if key in index:
            pipe.register_to_config(**{key: int(index[key])})
    return pipe


def _shared_components(folder: Path, index: dict) -> dict:
    """`_diffrl_shared_components` of a model index: component -> the component of the same folder it shares."""
    shared = index.get(SHARED_COMPONENTS_KEY) or {}
    components = _components(index)
    if not isinstance(shared, dict) or any(s not in components or not (folder / s).is_dir() for s in shared.values()):
        raise UserError(f"{folder / 'model_index.json'}: {SHARED_COMPONENTS_KEY} must map components to other "
                        f"components of the same folder; got {shared!r}")
    return shared


def _load_component(path: Path, library_class, torch_dtype):
    """One component folder by its model-index entry (library, class), as diffusers would load it."""
    import diffusers
    import torch
    import transformers

    library, class_name = library_class
    # only these two: the index was checked against diffusers' loadable libraries, and no name read from a file
    # reaches importlib
    modules = {"diffusers": diffusers, "transformers": transformers}
    if library not in modules or not hasattr(modules[library], class_name):
        raise UserError(f"{path.parent / 'model_index.json'}: a shared component must be a diffusers or transformers "
                        f"class, got {library}.{class_name}")
    cls = getattr(modules[library], class_name)
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        return cls.from_pretrained(path, **_dtype_kwarg(torch_dtype) if library == "diffusers" else
                                   {"dtype": torch_dtype} if torch_dtype is not None else {})
    return cls.from_pretrained(path)


def _dtype_kwarg(torch_dtype) -> dict:
    """`dtype=` on diffusers that renamed `torch_dtype` (and warn about the old name), `torch_dtype=` before."""
    from diffusers.utils import deprecation_utils

    renamed = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    return {"dtype": torch_dtype} if renamed else {"torch_dtype": torch_dtype}


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint opens within `timeout` seconds (DNS included)."""
    import socket

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    result = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _hub_folder(repo_id: str, revision: str | None) -> Path:
    """The local snapshot folder of a hub pipeline: from the cache, or downloaded when the hub is reachable."""
    from diffusers import DiffusionPipeline
    from huggingface_hub.errors import LocalEntryNotFoundError

    how = (f"download it where the hub is reachable (it is then cached), or pass a local diffusers folder "
           f"(`huggingface-cli download {repo_id} --local-dir DIR` on a machine with access)")
    # Components diffrl never loads are not downloaded either (see _load_folder).
    skip = {"safety_checker": None}
    try:
        return Path(DiffusionPipeline.download(repo_id, revision=revision, local_files_only=True, **skip))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if hub_offline():
        raise UserError(f"pipeline '{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                        f"{how}")
    if not hub_reachable():
        raise UserError(f"pipeline '{repo_id}' is not in the local Hugging Face cache and the hub is unreachable; "
                        f"{how}")
    try:
        return Path(DiffusionPipeline.download(repo_id, revision=revision, **skip))
    except Exception as e:  # the hub's own errors: repo not found, gated, revision not found
        raise UserError(f"cannot download pipeline '{repo_id}': {str(e).splitlines()[0]}") from e


# ---------------------------------------------------------------------------------------------------------------
# LoRA / fine-tuned weights
# ---------------------------------------------------------------------------------------------------------------


def load_lora_into(pipe, path) -> None:
    """Load trained weights found by `find_trained_weights(path)` into `pipe` (LoRA via `load_lora_weights`).

    A LoRA that does not fit `pipe` is one `UserError`, never a traceback or a warning on stderr, for every caller
    (`diffrl sample`, `diffrl steer`, the demo): keys for components `pipe` does not have beside keys for ones it has
    (the count that match is named), keys that match no module, a file diffusers or peft cannot map (only the A or
    only the B matrices: an `IndexError`), and adapter layers whose weights the file lacks (peft leaves them on the
    meta device, a traceback when the pipeline moves).
    """
    kind, where = find_trained_weights(path)
    hint = "pass an earlier checkpoint folder (checkpoints/step-N) instead"
    if kind in ("unet", "transformer"):
        current = getattr(pipe, kind, None)
        if current is None:
            raise UserError(f"{where} holds a full {kind}, but {type(pipe).__name__} has none")
        for weights in sorted(where.glob("*.safetensors")):
            load_safetensors(weights, hint)  # a truncated file is a one-line error naming it, not a traceback
        pipe.register_modules(**{kind: type(current).from_pretrained(where, **_dtype_kwarg(current.dtype))})
        return
    keys = []
    if where.suffix == ".safetensors":
        keys = list(load_safetensors(where, hint))
    _check_lora_components(pipe, where, keys)
    from diffusers.utils import logging as d_logging
    from transformers.utils import logging as t_logging

    verbosities = d_logging.get_verbosity(), t_logging.get_verbosity()
    # else it warns that a UNet-only LoRA has no text-encoder keys, and logs a failed load (then raised, below) on
    # several lines; the text encoder notes the keys it skips; peft warns of the keys it names before failing
    d_logging.set_verbosity(d_logging.CRITICAL)
    t_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe.load_lora_weights(str(where.parent), weight_name=where.name, adapter_name="diffrl")
    except (ValueError, KeyError, RuntimeError) as e:
        lines = str(e).splitlines()
        detail = "; ".join([lines[0].strip().rstrip(":"), *[line.strip() for line in lines if "size mismatch" in line][:1]])
        raise UserError(f"cannot load LoRA {where} into {type(pipe).__name__}: {detail}") from e
    except Exception as e:  # whatever else diffusers or peft raise on a file they cannot map (IndexError, ...)
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"cannot load LoRA {where} into {type(pipe).__name__}: {type(e).__name__}"
                        + (f": {detail}" if detail else "") + "; is it a LoRA of this model, saved with "
                        "save_lora_weights?") from e
    finally:
        d_logging.set_verbosity(verbosities[0])
        t_logging.set_verbosity(verbosities[1])
    if not any("diffrl" in names for names in pipe.get_list_adapters().values()):
        # diffusers skips keys that name no component of this pipeline (a UNet LoRA given to a flow pipeline, or
        # the reverse) without an error: sampling would silently use the base model
        prefixes = sorted({key.split(".")[0] for key in keys})
        named = f" (its weights are for: {', '.join(prefixes)})" if prefixes else ""
        raise UserError(f"LoRA {where} matches no module of {type(pipe).__name__}{named}; it was trained on another "
                        "kind of model: pass the pipeline it was trained on")
    empty = [f"{name}.{param}" for name, module in pipe.components.items() if hasattr(module, "named_parameters")
             for param, value in module.named_parameters() if value.is_meta]
    if empty:
        raise UserError(f"LoRA {where} does not fit {type(pipe).__name__}: {len(empty)} adapter weights it declares "
                        f"are not in its file (e.g. {empty[0]}); is it a LoRA of this model, saved with "
                        "save_lora_weights?")


def _check_lora_components(pipe, where: Path, keys: list[str]) -> None:
    """A `UserError` when some of a diffusers-format LoRA's keys name a component of `pipe` (`unet.…`,
    `text_encoder.…`) and others name one it lacks (`transformer.…` in a UNet LoRA): diffusers would load the first
    and drop the rest without a word. A file none of whose keys name a component is left to diffusers (another
    format it converts, or the "matches no module" error after loading)."""
    components = {name for name, module in pipe.components.items() if module is not None}
    matched = [key for key in keys if key.split(".")[0] in components]
    if 0 < len(matched) < len(keys):
        ours = ", ".join(sorted({key.split(".")[0] for key in matched}))
        other = ", ".join(sorted({key.split(".")[0] for key in keys} - components))
        raise UserError(f"LoRA {where}: only {len(matched)} of its {len(keys)} keys match {type(pipe).__name__} "
                        f"({ours}); the other {len(keys) - len(matched)} are for {other}, which it has not: is it a "
                        "LoRA of this model?")
