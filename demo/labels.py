"""Preference labels: read the pairs `diffrl pairs sample` writes and write the choices D3PO trains from.

The file is `pairs.jsonl` in a folder, one pair per line, as `diffrl.pairs.labels` defines it (and checks it):

    {"prompt": "...", "seed": 3, "images": ["images/00003-0.png", "images/00003-1.png"], "choice": null, ...}

`images` are two paths relative to the file's folder; `choice` is `null` until labelled, then `0` (the first image
is preferred), `1` (the second) or `"tie"`. The other keys (`latents`) are written back as they were.

Every label rewrites the whole file atomically (a temporary file in the same folder, flushed to disk, then renamed
over the old one), so a crash or a kill leaves either the old file or the new one, never half of one. Labelling is
resumable: the page starts at the first pair without a choice. Each write re-reads the file under a lock and changes
one line's choice only, so two pages labelling the same file do not undo each other's labels.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

from diffrl.errors import UserError
from diffrl.pairs.labels import read_label_file

PAIRS_FILE = "pairs.jsonl"
CHOICES = (0, 1, "tie")

_LOCKS: dict[Path, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def pairs_path(folder_or_file: str) -> Path:
    """The pairs file of a folder (its `pairs.jsonl`), or the file itself."""
    text = (folder_or_file or "").strip()
    if not text:
        raise UserError("no pairs folder: give the folder `diffrl pairs sample --out` wrote (it holds pairs.jsonl)")
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / PAIRS_FILE
    if not path.is_file():
        raise UserError(f"{path} does not exist; give the folder `diffrl pairs sample --out` wrote")
    return path


def read_pairs(path: Path) -> list[dict]:
    """Every pair of the file as written (all keys kept), after `diffrl.pairs.labels.read_label_file` has checked
    every line (the format's one definition: keys, types, choices, that the images exist); a bad line is a
    `UserError`."""
    read_label_file(path)
    return [json.loads(text) for text in Path(path).read_text().splitlines() if text.strip()]


def image_paths(path: Path, pair: dict) -> list[Path]:
    """The two image files of a pair (relative to the pairs file's folder)."""
    return [Path(path).parent / image for image in pair["images"]]


def next_unlabelled(pairs: list[dict], start: int = 0) -> int | None:
    """Index of the first pair from `start` on (then from the top) whose choice is null; `None` when all are done."""
    order = list(range(start, len(pairs))) + list(range(min(start, len(pairs))))
    return next((i for i in order if pairs[i].get("choice") is None), None)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically: a temporary file in the same folder, fsynced, then renamed over it. A
    symlinked `path` is written through: the file it points to is replaced, and the link stays."""
    path = Path(os.path.realpath(path))
    mode = path.stat().st_mode & 0o777 if path.exists() else None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _lock(path: Path) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(Path(path).resolve(), threading.Lock())


def set_choice(path: Path, index: int, choice) -> list[dict]:
    """Set pair `index`'s choice (`0`, `1`, `"tie"` or `None` to undo) and rewrite the file; returns all pairs."""
    if choice not in (None, *CHOICES) or isinstance(choice, bool):
        raise UserError(f"a choice is 0, 1, \"tie\" or null, got {choice!r}")
    with _lock(path):
        pairs = read_pairs(path)
        if not 0 <= index < len(pairs):
            raise UserError(f"pair {index} does not exist: {path} holds {len(pairs)} pairs")
        pairs[index]["choice"] = choice
        write_atomic(path, "".join(json.dumps(pair) + "\n" for pair in pairs))
    return pairs
