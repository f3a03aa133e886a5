"""A small CLIP BPE tokenizer for ShapesWorld, cut from the CLIP vocabulary that open-clip-torch ships.

The full CLIP vocabulary has 49,408 tokens; a token-embedding table that size would be most of the tiny
models' weight budget. We keep the 512 byte-level base tokens (so any text still tokenizes), the merges that
the ShapesWorld vocabulary (and a list of common words) actually uses, in their original order, and the two
special tokens. A word in that list tokenizes to exactly the tokens the full CLIP tokenizer gives it, under
other ids. The result is an ordinary transformers `CLIPTokenizer` (vocab.json + merges.txt).
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

from diffrl.shapes.world import BACKGROUNDS, HELDOUT_COUNT_WORDS, HELDOUT_RELATION_WORDS, SHAPES

# Words the tokenizer must know whole: ShapesWorld captions plus common prompt words.
EXTRA_WORDS = (  # noqa: SIM905 (a list literal of 70 words would not read better)
    "a an the of and on in with to top beneath below above left right next pair one two three four 1 2 3 4 "
    "image photo picture drawing background object shape shapes circle circles square squares triangle "
    "triangles red green blue yellow purple orange black white gray grey pink cyan brown big small large tiny "
    "many several some no is are there near far middle center corner"
).split()

MAX_LENGTH = 24  # tokens incl. start/end; the longest ShapesWorld caption has 15


@functools.lru_cache(maxsize=1)
def _byte_unicode() -> dict[int, str]:
    # GPT-2/CLIP's reversible map from bytes to printable unicode characters.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _clip_merges() -> list[tuple[str, str]]:
    import open_clip

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(path) as f:
        lines = f.read().decode("utf-8").split("\n")
    # Same slice as CLIP's own tokenizer: the header line, then 49152 - 256 - 2 merges.
    return [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[tuple[str, str]]:
    """The merges CLIP's BPE applies to `word`, in order."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    used = []
    while len(parts) > 1:
        pairs = [(parts[i], parts[i + 1]) for i in range(len(parts) - 1)]
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        used.append(best)
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return used


def build_tokenizer_files(folder: str | Path, words=None) -> Path:
    """Writes vocab.json, merges.txt and tokenizer_config.json for a reduced CLIP tokenizer to `folder`."""
    words = set(words or ()) | set(EXTRA_WORDS) | set(BACKGROUNDS) | set(SHAPES) | {s + "s" for s in SHAPES}
    for phrase in list(HELDOUT_RELATION_WORDS) + list(HELDOUT_COUNT_WORDS.values()):
        words |= set(phrase.split())
    merges = _clip_merges()
    ranks = {m: i for i, m in enumerate(merges)}
    byte_map = _byte_unicode()
    needed = set()
    for word in sorted(words):
        needed.update(_bpe("".join(byte_map[b] for b in word.encode("utf-8")), ranks))
    kept = [m for m in merges if m in needed]

    base = list(byte_map.values())
    tokens = base + [t + "</w>" for t in base] + ["".join(m) for m in kept] + ["<|startoftext|>", "<|endoftext|>"]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in kept), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CLIPTokenizer", "model_max_length": MAX_LENGTH, "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
    }, indent=2))
    return folder


def load_tokenizer(folder: str | Path):
    """A transformers `CLIPTokenizer` from `folder` (built with `build_tokenizer_files`)."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    if (folder / "vocab.json").exists():
        return CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"),
                             model_max_length=MAX_LENGTH)
    return CLIPTokenizer.from_pretrained(folder)  # a saved tokenizer (tokenizer.json)
