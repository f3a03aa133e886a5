"""Named ShapesWorld prompt sets: fixed, deterministic lists of captions that recipes refer to by name
(`prompts.source: shapes:train`). `diffrl ls prompts` lists them.

- `train`: captions of the distribution the tiny generator was trained on;
- `heldout`: captions it never saw: held-out colour-shape pairs or held-out phrasings (see `world`);
- `<split>_<kind>` for kind in single, pair, count, relation, background: one caption kind only.
"""

from __future__ import annotations

import functools
import random

from diffrl.errors import UserError
from diffrl.shapes.world import KINDS, sample_captioned

_SIZES = {"train": 256, "heldout": 128}
_KIND_SIZE = 64


def _sets() -> dict[str, tuple[str, str | None, int]]:
    sets = {split: (split, None, n) for split, n in _SIZES.items()}
    for split in _SIZES:
        for kind in KINDS:
            sets[f"{split}_{kind}"] = (split, kind, _KIND_SIZE)
    return sets


def list_prompt_sets() -> dict[str, str]:
    """Name -> one-line description of every prompt set."""
    out = {}
    for name, (split, kind, _) in _sets().items():
        what = f"{kind} captions" if kind else "captions of every kind"
        out[name] = f"distinct {split} {what}"
    return out


@functools.cache
def get_prompt_set(name: str) -> list[str]:
    """The captions of prompt set `name` (a `shapes:` prefix is accepted); always the same list."""
    key = name.removeprefix("shapes:")
    sets = _sets()
    if key not in sets:
        import difflib

        close = difflib.get_close_matches(key, sets, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"unknown ShapesWorld prompt set '{key}'{hint} Known: {', '.join(sets)}")
    split, kind, n = sets[key]
    rng = random.Random(f"{split}/{kind}")
    seen: dict[str, None] = {}
    for _ in range(100 * n):
        if len(seen) == n:
            break
        seen.setdefault(sample_captioned(rng, split, kind)[1], None)
    return list(seen)
