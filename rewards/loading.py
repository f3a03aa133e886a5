"""Finding reward-model weights (embedded name, local path, hub cache, hub) and caching loaded models.

Weights are looked up in this order, and a miss is a one-line `UserError` within seconds:

1. an embedded ShapesWorld model name (`tiny-shapes-clip`, ...), resolved by `diffrl.embedded`;
2. an existing local file or folder;
3. a Hugging Face hub id already in the local cache (loaded with `local_files_only=True`, no network);
4. the hub itself, but only after one quick request (`model_info`, no retries) shows it is reachable and
   the repository exists. With `HF_HUB_OFFLINE=1`, or when the hub cannot be reached, step 4 fails at once
   with a message naming the id, the option to pass a local copy, and how to download it.

Without step 4's probe, `huggingface_hub` would retry an unreachable hub for about 25 s per file.

Loaded models are cached per process (`cached`), keyed by what was loaded, device and dtype, so building the
same reward twice (a trainer and its evaluator, or every `weighted_sum` term) loads the weights once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from diffrl.embedded import embedded_path, is_embedded
from diffrl.errors import UserError
from diffrl.hub import hub_offline

T = TypeVar("T")

_MODEL_CACHE: dict[tuple, Any] = {}


def cached(key: tuple, build: Callable[[], T]) -> T:
    """The object built by `build()` for `key`, built once per process."""
    if key not in _MODEL_CACHE:
        _MODEL_CACHE[key] = build()
    return _MODEL_CACHE[key]


def clear_model_cache() -> None:
    """Forget every cached reward model (frees their memory once no reward holds them)."""
    _MODEL_CACHE.clear()


def freeze(module):
    """Eval mode and no parameter gradients: reward models are fixed; gradients only flow to the pixels."""
    module.eval()
    module.requires_grad_(False)
    return module


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' load reports and progress bars (e.g. the unused text tower of a vision-only load)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or name.endswith((".pt", ".pth", ".bin", ".safetensors", ".json", ".ckpt"))
    )


def local_source(name: str, *, reward: str, option: str) -> Path | None:
    """The local path `name` means (embedded name or existing path), or `None` if it is a hub id.

    Raises `UserError` if `name` is clearly a path (starts with `/`, `./`, `~`, ends in `.pt`, ...) that does
    not exist, rather than asking the hub about it.
    """
    if is_embedded(name):
        return embedded_path(name)
    path = Path(name).expanduser()
    if path.exists():
        return path
    if _looks_like_path(name):
        raise UserError(f"reward '{reward}': {option}={name!r} does not exist; give an existing file or folder")
    return None


def ensure_hub_reachable(repo_id: str, *, reward: str, option: str, what: str = "") -> None:
    """One quick request (no retries) to tell 'offline', 'unreachable' and 'no such repo' apart, as UserErrors."""
    item = f"{what} from '{repo_id}'" if what else f"'{repo_id}'"
    get_it = f"download it where the hub is reachable (`hf download {repo_id}{' ' + what if what else ''}`)"
    if hub_offline():
        raise UserError(
            f"reward '{reward}': {item} is not in the local Hugging Face cache and the hub is offline "
            f"(HF_HUB_OFFLINE=1); {get_it} or pass {option}=<local path>"
        )
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(repo_id, timeout=10)
    except GatedRepoError as err:
        raise UserError(
            f"reward '{reward}': '{repo_id}' is gated on the hub; accept its terms and log in (`hf auth login`) "
            f"or pass {option}=<local path>"
        ) from err
    except RepositoryNotFoundError as err:
        raise UserError(
            f"reward '{reward}': no model '{repo_id}' on the hub (or it is private: log in with `hf auth login`); "
            f"check {option}= or pass a local path"
        ) from err
    except Exception as err:  # connection refused, DNS failure, timeout, proxy errors: all mean unreachable
        raise UserError(
            f"reward '{reward}': {item} is not in the local Hugging Face cache and the hub cannot be reached "
            f"({type(err).__name__}); {get_it} or pass {option}=<local path>"
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_pretrained(load: Callable[[str, bool], T], name: str, *, reward: str, option: str) -> T:
    """Load with `load(path_or_repo_id, local_files_only)`, trying local sources and the cache before the hub.

    Args:
        load (`Callable[[str, bool], T]`):
            e.g. `lambda src, local: CLIPModel.from_pretrained(src, local_files_only=local)`.
        name (`str`): embedded name, local folder or hub id.
        reward (`str`): reward name, for messages.
        option (`str`): the factory option the user set `name` through, for messages (`"model"`, `"backbone"` ...).
    """
    source = local_source(name, reward=reward, option=option)
    if source is not None:
        try:
            return load(str(source), True)
        except (OSError, ValueError) as err:
            raise UserError(f"reward '{reward}': cannot load {option}={name!r}: {_first_line(err)}") from err
    try:
        return load(name, True)
    except OSError:
        pass  # not (completely) in the cache: maybe the hub has it
    ensure_hub_reachable(name, reward=reward, option=option)
    try:
        return load(name, False)
    except (OSError, ValueError) as err:
        raise UserError(f"reward '{reward}': cannot load {option}={name!r} from the hub: {_first_line(err)}") from err


def hub_file(repo_id: str, filename: str, *, reward: str, option: str) -> Path:
    """Local path of `filename` in hub repo `repo_id`: from the cache, else downloaded after a reachability probe."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    ensure_hub_reachable(repo_id, reward=reward, option=option, what=filename)
    try:
        return Path(hf_hub_download(repo_id, filename))
    except Exception as err:
        raise UserError(
            f"reward '{reward}': cannot download {filename} from '{repo_id}': {_first_line(err)}; "
            f"pass {option}=<local path>"
        ) from err


def load_torch_file(path: Path, *, reward: str, option: str, weights_only: bool = True) -> dict:
    """`torch.load(path, weights_only=...)` on CPU, with a `UserError` for a missing or unreadable file.

    `weights_only=True` (the default) refuses pickled code, so a checkpoint cannot run anything when loaded.
    """
    import pickle

    import torch

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"reward '{reward}': {option}={str(path)!r} is not a file")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        hint = "; if you trust the file, pass weights_only=False" if weights_only and reward != "aesthetic" else ""
        raise UserError(
            f"reward '{reward}': cannot read {option}={str(path)!r} as a torch checkpoint "
            f"(weights_only={weights_only}): {_first_line(err)}{hint}"
        ) from err
