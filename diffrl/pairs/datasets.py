"""Datasets of preference pairs (a prompt, two images, which one people or a reward preferred) for offline trainers.

Three layouts, named by one string (a recipe's `train.pairs`):

- a **label file**: JSONL, one pair a line, `{"prompt", "seed", "images": [path, path], "choice": 0 | 1 | "tie" |
  null}` (`diffrl.pairs.labels`: the format `diffrl pairs sample` writes, the demo labels and D3PO reads; the `latents`
  D3PO needs are not needed here). A folder that holds a `pairs.jsonl` is that file;
- **Pick-a-Pic** (Kirstain et al. 2023, the `yuvalkirstain/pickapic_v2` layout): parquet with columns `caption`,
  `jpg_0`, `jpg_1` (encoded image bytes) and `label_0` (1: image 0 preferred, 0: image 1, 0.5: a tie). A parquet
  file, or a folder of them (searched recursively; when some file names start with `train-`, only those: the hub
  snapshot keeps every split in one `data/` folder);
- **`shapes:NAME`**: a ShapesWorld pairs set, generated in-project on first use (`diffrl.pairs.shapes`).

A pair whose choice is "tie" (or Pick-a-Pic's 0.5) or null (unlabelled) is skipped and counted, never guessed. A
malformed label file is a `UserError` naming the file and line, raised by `check_pairs_source` when a recipe loads,
before anything is written.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from PIL import Image

from diffrl.errors import UserError
from diffrl.pairs import labels
from diffrl.pairs.shapes import check_set_name, ensure_pairs_set

LABEL_FILE = "pairs.jsonl"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class PreferencePairs:
    """The usable (strictly preferred) pairs of a dataset, in file order, preferred image first.

    Args:
        prompts (`list[str]`): the caption of each pair.
        source (`str`): what the recipe named, for messages.
        skipped (`dict[str, int]`): pairs left out and why (`tie`, `unlabelled`).
    """

    prompts: list[str]
    source: str
    skipped: dict = field(default_factory=dict)
    _paths: list = field(default_factory=list)  # label file: (preferred path, rejected path) per pair
    _rows: list = field(default_factory=list)  # parquet: (file, row group, row, preferred column) per pair
    _cache: dict = field(default_factory=dict)  # parquet: the last row group read

    def __len__(self) -> int:
        return len(self.prompts)

    def images(self, index: int):
        """`(preferred, rejected)` PIL RGB images of pair `index`."""
        if self._paths:
            return tuple(_open_image(path) for path in self._paths[index])
        file, group, row, first = self._rows[index]
        table = self._row_group(file, group)
        columns = ("jpg_0", "jpg_1") if first == 0 else ("jpg_1", "jpg_0")
        return tuple(Image.open(io.BytesIO(table[c][row].as_py())).convert("RGB") for c in columns)

    def order(self, rng: np.random.Generator) -> np.ndarray:
        """One pass over every pair in a random order. Pick-a-Pic is read a row group at a time, so its row groups
        come in random order and the pairs within each are shuffled: no pass re-reads a row group per pair."""
        if self._paths:
            return rng.permutation(len(self))
        groups: dict = {}
        for i, (file, group, _, _) in enumerate(self._rows):
            groups.setdefault((file, group), []).append(i)
        blocks = list(groups.values())
        return np.concatenate([rng.permutation(blocks[b]) for b in rng.permutation(len(blocks))]).astype(np.int64)

    def _row_group(self, file: str, group: int):
        key = (file, group)
        if key not in self._cache:
            import pyarrow.parquet as pq  # optional (diffrl[pickapic]): `_import_pyarrow` checked it at opening

            self._cache.clear()
            self._cache[key] = pq.ParquetFile(file).read_row_group(group, columns=["jpg_0", "jpg_1"])
        return self._cache[key]


def _open_image(path: Path):
    with Image.open(path) as image:
        return image.convert("RGB")


# ---------------------------------------------------------------------------------------------------------------
# Label files (JSONL)
# ---------------------------------------------------------------------------------------------------------------


def read_label_file(path: str | Path) -> PreferencePairs:
    """The labelled pairs of a label file, checked line by line by `labels.read_label_file` (the format's one
    definition, shared with D3PO and the demo's Label page: every line a pair, every image present, readable and
    inside the file's folder, every choice valid).

    Raises:
        `UserError`: `FILE:LINE: what is wrong` for the first bad line, or a file with no labelled pair.
    """
    prompts, paths, skipped = [], [], {"tie": 0, "unlabelled": 0}
    pairs = labels.read_label_file(path)
    labels.check_some_labelled(path, pairs)  # the check D3PO makes: a file of ties and unlabelled pairs trains nothing
    for pair in pairs:
        if pair.choice is None:
            skipped["unlabelled"] += 1
        elif pair.choice == "tie":
            skipped["tie"] += 1
        else:
            prompts.append(pair.prompt)
            paths.append((pair.images[pair.choice], pair.images[1 - pair.choice]))
    return PreferencePairs(prompts=prompts, source=str(path), skipped=skipped, _paths=paths)


# ---------------------------------------------------------------------------------------------------------------
# Pick-a-Pic (parquet)
# ---------------------------------------------------------------------------------------------------------------

PICKAPIC_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0")


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.rglob("*.parquet"))
    train = [f for f in files if f.name.startswith("train-")]
    return train or files


def _import_pyarrow():
    try:
        import pyarrow.parquet as pq  # optional (diffrl[pickapic]): the one place that says how to install it
    except ModuleNotFoundError:
        raise UserError("reading Pick-a-Pic parquet files needs pyarrow: pip install 'diffrl[pickapic]'") from None
    return pq


def check_parquet(path: Path) -> list[Path]:
    """The parquet files of a Pick-a-Pic source, each with the four columns; a `UserError` naming the first that
    lacks one."""
    pq = _import_pyarrow()
    files = _parquet_files(path)
    if not files:
        raise UserError(f"{path}: no .parquet file in this folder (Pick-a-Pic layout: caption, jpg_0, jpg_1, "
                        "label_0) and no pairs.jsonl")
    for file in files:
        try:
            names = set(pq.read_schema(file).names)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            raise UserError(f"{file}: not a readable parquet file ({type(e).__name__})") from None
        missing = [c for c in PICKAPIC_COLUMNS if c not in names]
        if missing:
            raise UserError(f"{file}: no column '{missing[0]}'; a Pick-a-Pic file has {', '.join(PICKAPIC_COLUMNS)}")
    return files


def read_pickapic(path: str | Path) -> PreferencePairs:
    """The decided pairs of a Pick-a-Pic parquet file or folder (captions and labels read now, images on demand).
    `label_0` = 1 prefers image 0, 0 prefers image 1; 0.5 (no preference) is a tie, skipped as the reference does."""
    pq = _import_pyarrow()
    prompts, rows, skipped = [], [], {"tie": 0, "unlabelled": 0}
    for file in check_parquet(Path(path)):
        handle = pq.ParquetFile(file)
        for group in range(handle.num_row_groups):
            table = handle.read_row_group(group, columns=["caption", "label_0"])
            for row, (caption, label) in enumerate(zip(table["caption"].to_pylist(), table["label_0"].to_pylist())):
                if label in (0, 1):
                    prompts.append(caption or "")
                    rows.append((str(file), group, row, 0 if label == 1 else 1))
                elif label is None:
                    skipped["unlabelled"] += 1
                else:
                    skipped["tie"] += 1
    if not prompts:
        raise UserError(f"{path}: no decided pair (label_0 of 0 or 1) to train on")
    return PreferencePairs(prompts=prompts, source=str(path), skipped=skipped, _rows=rows)


# ---------------------------------------------------------------------------------------------------------------
# Resolving a `train.pairs` string
# ---------------------------------------------------------------------------------------------------------------


def _kind(source: str) -> str:
    if source.startswith("shapes:"):
        return "shapes"
    path = Path(source).expanduser()
    if path.is_dir():
        return "jsonl" if (path / LABEL_FILE).is_file() else "parquet"
    if path.suffix == ".parquet":
        return "parquet"
    if path.is_file() or path.suffix in (".jsonl", ".json") or source.startswith((".", "/", "~")):
        return "jsonl"
    if _HUB_ID.match(source):
        return "hub"
    return "jsonl"


def check_pairs_source(source: str) -> None:
    """Load-time check of a `train.pairs` string, so `diffrl validate` and `diffrl run` stop before anything is
    written: a label file is read and checked line by line, a parquet source for its columns, a ShapesWorld set
    for its name. A hub dataset id is only resolved when training starts (like a hub pipeline)."""
    kind = _kind(source)
    if kind == "shapes":
        check_set_name(source.removeprefix("shapes:"))
    elif kind == "hub":
        return
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"train.pairs: {path} does not exist; give a label file (JSONL), a Pick-a-Pic parquet "
                            "file or folder, a hub dataset id or shapes:NAME (`diffrl ls pairs`)")
        if kind == "jsonl":
            read_label_file(path / LABEL_FILE if path.is_dir() else path)
        else:
            check_parquet(path)


def load_pairs(source: str) -> PreferencePairs:
    """The pairs a `train.pairs` string names (a ShapesWorld set is generated into the cache on first use; a hub
    dataset id is looked up in the local hub cache, or downloaded where the hub is reachable)."""
    kind = _kind(source)
    if kind == "shapes":
        return read_label_file(ensure_pairs_set(source.removeprefix("shapes:")) / LABEL_FILE)
    if kind == "hub":
        return read_pickapic(_hub_dataset(source))
    path = Path(source).expanduser()
    if kind == "jsonl":
        return read_label_file(path / LABEL_FILE if path.is_dir() else path)
    return read_pickapic(path)


def _hub_dataset(repo_id: str) -> Path:
    """The local snapshot of a hub dataset's training parquet files."""
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["*train-*.parquet"]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:  # offline, unknown, no access
        raise UserError(f"train.pairs: hub dataset '{repo_id}' is not in the local hub cache and cannot be "
                        f"downloaded ({type(e).__name__}); download it elsewhere and set train.pairs to its folder"
                        ) from None
