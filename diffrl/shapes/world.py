"""ShapesWorld: procedurally rendered scenes of coloured shapes, with captions.

A scene is a `Scene` (objects, an optional spatial relation, an optional background), drawn from a split
(`train` or `heldout`) by `sample_scene`, captioned by `caption`, and rendered by `render`. Everything is
deterministic given a seed. The verifier (`diffrl.shapes.verifier`) reads these captions back.

The held-out split is where reward fine-tuning and steering have headroom: it holds colour-shape pairs that
no `train` image shows (`HELDOUT_PAIRS`) and phrasings that no `train` caption uses (`HELDOUT_RELATION_WORDS`,
`HELDOUT_COUNT_WORDS`, "an image of ..."). The tiny text-to-image model is trained on `train` scenes only.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

# Object colours: far apart in RGB so that a blurry decoder still lands nearest the right name.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 220, 40),
    "purple": (150, 50, 200),
    "orange": (250, 140, 20),
}
# Backgrounds: black unless the caption names one.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "white": (245, 245, 245),
    "gray": (128, 128, 128),
    **{name: rgb for name, rgb in COLORS.items()},
}
DEFAULT_BACKGROUND = "black"
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")

# Colour-shape pairs that no training image shows: the generator must compose them.
HELDOUT_PAIRS = frozenset({("red", "triangle"), ("blue", "circle"), ("yellow", "square"), ("purple", "circle")})
# Phrasings that no training caption uses; each maps to the train phrasing it means.
HELDOUT_RELATION_WORDS = {"to the left of": "left of", "to the right of": "right of", "on top of": "above",
                          "beneath": "below"}
TRAIN_COUNT_WORDS = {2: "two", 3: "three"}
HELDOUT_COUNT_WORDS = {2: "a pair of", 3: "3"}

KINDS = ("single", "pair", "count", "relation", "background")


@dataclasses.dataclass(frozen=True)
class Scene:
    """What a caption says: objects as (colour, shape, count), an optional relation between the first two
    objects, and a background name (None means the default black, unmentioned)."""

    objects: tuple[tuple[str, str, int], ...]
    relation: str | None = None
    background: str | None = None
    kind: str = "single"


def _pairs(split: str) -> list[tuple[str, str]]:
    everything = [(c, s) for c in COLORS for s in SHAPES]
    if split == "train":
        return [p for p in everything if p not in HELDOUT_PAIRS]
    return everything


def sample_scene(rng: random.Random, split: str = "train", kind: str | None = None) -> Scene:
    """Draws a scene of `kind` (random if None) whose colour-shape pairs are allowed in `split`.

    In `heldout`, every scene contains at least one held-out pair or is captioned with a held-out phrasing
    (see `caption`), so no held-out caption was seen in training.
    """
    kind = kind or rng.choices(KINDS, weights=(3, 2, 2, 3, 2))[0]
    pairs = _pairs(split)
    if split == "heldout":
        # Half the held-out scenes hold a held-out pair; the other half get a held-out phrasing.
        pairs_first = sorted(HELDOUT_PAIRS) if rng.random() < 0.5 else pairs
    else:
        pairs_first = pairs
    c1, s1 = rng.choice(pairs_first)
    if kind == "single":
        return Scene(((c1, s1, 1),), kind=kind)
    if kind == "count":
        return Scene(((c1, s1, rng.choice((2, 3))),), kind=kind)
    if kind == "background":
        bg = rng.choice([b for b in BACKGROUNDS if b not in (c1, DEFAULT_BACKGROUND)])
        return Scene(((c1, s1, 1),), background=bg, kind=kind)
    while True:
        c2, s2 = rng.choice(pairs)
        if (c2, s2) != (c1, s1):
            break
    objects = ((c1, s1, 1), (c2, s2, 1))
    if rng.random() < 0.5:
        objects = objects[::-1]
    relation = rng.choice(RELATIONS) if kind == "relation" else None
    return Scene(objects, relation=relation, kind=kind)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(color: str, shape: str, count: int, count_words: dict[int, str]) -> str:
    if count == 1:
        return f"{article(color)} {color} {shape}"
    return f"{count_words[count]} {color} {shape}s"


def caption(scene: Scene, rng: random.Random | None = None, heldout_phrasing: bool = False) -> str:
    """The caption of `scene`; `heldout_phrasing` uses the phrasings no training caption uses."""
    rng = rng or random.Random(0)
    count_words = HELDOUT_COUNT_WORDS if heldout_phrasing else TRAIN_COUNT_WORDS
    nouns = [_noun(c, s, n, count_words) for c, s, n in scene.objects]
    if scene.relation is not None:
        words = scene.relation
        if heldout_phrasing:
            words = {v: k for k, v in HELDOUT_RELATION_WORDS.items()}[scene.relation]
        text = f"{nouns[0]} {words} {nouns[1]}"
    else:
        text = " and ".join(nouns)
    if scene.background is not None:
        text += f" on {article(scene.background)} {scene.background} background"
    if heldout_phrasing and scene.kind in ("single", "pair", "background"):
        text = "an image of " + text
    return text


def sample_captioned(rng: random.Random, split: str = "train", kind: str | None = None) -> tuple[Scene, str]:
    """A scene and its caption; held-out scenes without a held-out pair get a held-out phrasing."""
    scene = sample_scene(rng, split, kind)
    heldout_phrasing = split == "heldout" and not any((c, s) in HELDOUT_PAIRS for c, s, _ in scene.objects)
    return scene, caption(scene, rng, heldout_phrasing)


# ---------------------------------------------------------------------------------------------------------
# Rendering


def _shape_mask(shape: str, cx: float, cy: float, r: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Boolean mask of one shape on a (supersampled) pixel grid. r is the half-extent in pixels."""
    if shape == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= r**2
    if shape == "square":
        h = 0.85 * r  # a square of this half-side has about the same area as the circle of radius r
        return (np.abs(xs - cx) <= h) & (np.abs(ys - cy) <= h)
    if shape == "triangle":
        # Upward isosceles triangle: apex at the top, base at the bottom, base width 2.3 r.
        top, bottom, half = cy - 1.05 * r, cy + 0.95 * r, 1.15 * r
        frac = (ys - top) / (bottom - top)  # 0 at the apex, 1 at the base
        return (frac >= 0) & (frac <= 1) & (np.abs(xs - cx) <= half * frac)
    raise ValueError(f"unknown shape {shape!r}")


def _layout(scene: Scene, rng: random.Random, size: int) -> list[tuple[str, str, float, float, float]]:
    """Positions (colour, shape, cx, cy, r) in pixels that satisfy the scene, objects not overlapping."""
    instances = [(c, s) for c, s, n in scene.objects for _ in range(n)]
    lo_r, hi_r = 0.12 * size, 0.19 * size
    for _ in range(1000):
        placed = []
        for color, shape in instances:
            r = rng.uniform(lo_r, hi_r)
            cx, cy = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
            placed.append((color, shape, cx, cy, r))
        if any(
            # 1.25 r bounds every shape (a square's corner is at 1.2 r), plus a gap between objects.
            (a[2] - b[2]) ** 2 + (a[3] - b[3]) ** 2 < (1.25 * (a[4] + b[4]) + 0.06 * size) ** 2
            for i, a in enumerate(placed)
            for b in placed[i + 1 :]
        ):
            continue
        if scene.relation is not None and not relation_holds(scene.relation, placed[0][2:4], placed[1][2:4], size,
                                                             strict=True):
            continue
        return placed
    raise RuntimeError(f"could not lay out {scene} at size {size}")


def relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], size: int,
                   strict: bool = False) -> bool:
    """Whether centroid a is `relation` centroid b (image y grows downwards).

    The verifier asks for a displacement of at least 8% of the image along the relation's axis; the
    renderer (`strict`) also makes that axis dominate, so rendered scenes are unambiguous.
    """
    dx, dy = b[0] - a[0], b[1] - a[1]
    along, across = {"left of": (dx, dy), "right of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[relation]
    if strict:
        return along >= 0.25 * size and abs(across) <= 0.6 * along
    return along >= 0.08 * size


def render(scene: Scene, seed: int, size: int = 32, supersample: int = 4) -> np.ndarray:
    """Renders `scene` as uint8 [size, size, 3]; deterministic in (scene, seed, size).

    Shapes are drawn on a `supersample`-times finer grid and box-filtered down: mild anti-aliasing.
    Object colours get a small per-object jitter so that a model cannot key on exact RGB values.
    """
    rng = random.Random(seed)
    placed = _layout(scene, rng, size)
    n = size * supersample
    coords = (np.arange(n) + 0.5) / supersample
    xs, ys = np.meshgrid(coords, coords)
    bg = np.array(BACKGROUNDS[scene.background or DEFAULT_BACKGROUND], dtype=np.float32)
    canvas = np.broadcast_to(bg, (n, n, 3)).copy()
    for color, shape, cx, cy, r in placed:
        rgb = np.array(COLORS[color], dtype=np.float32) + np.array([rng.uniform(-12, 12) for _ in range(3)])
        canvas[_shape_mask(shape, cx, cy, r, xs, ys)] = np.clip(rgb, 0, 255)
    image = canvas.reshape(size, supersample, size, supersample, 3).mean(axis=(1, 3))
    return np.round(image).astype(np.uint8)


def sample_batch(seed: int, batch_size: int, split: str = "train", size: int = 32,
                 kind: str | None = None) -> tuple[np.ndarray, list[str], list[Scene]]:
    """`batch_size` random scenes: images uint8 [B, size, size, 3], captions, scenes. Deterministic in seed."""
    rng = random.Random(seed)
    images, captions, scenes = [], [], []
    for _ in range(batch_size):
        scene, text = sample_captioned(rng, split, kind)
        images.append(render(scene, rng.randrange(2**31), size))
        captions.append(text)
        scenes.append(scene)
    return np.stack(images), captions, scenes


def perturb_scene(scene: Scene, rng: random.Random) -> Scene:
    """A scene that breaks one thing `scene`'s caption asks for: an object's colour or shape, a count, the
    relation (objects swapped), the background, or a missing second object. Used to make preference pairs
    (`diffrl.shapes.train pickscore`); the verifier, not this function, decides which image is better."""
    objects = list(scene.objects)
    options = ["color", "shape"]
    if any(n > 1 for _, _, n in objects):
        options.append("count")
    if scene.relation is not None:
        options.append("relation")
    if scene.background is not None:
        options.append("background")
    if len(objects) == 2 and scene.relation is None:
        options.append("drop")
    what = rng.choice(options)
    i = rng.randrange(len(objects))
    color, shape, count = objects[i]
    if what == "color":
        objects[i] = (rng.choice([c for c in COLORS if c not in (color, scene.background)]), shape, count)
    elif what == "shape":
        objects[i] = (color, rng.choice([s for s in SHAPES if s != shape]), count)
    elif what == "count":
        objects[i] = (color, shape, {2: rng.choice((1, 3)), 3: rng.choice((1, 2))}[count])
    elif what == "relation":
        objects = objects[::-1]
    elif what == "background":
        colors = {c for c, _, _ in objects}
        background = rng.choice([b for b in BACKGROUNDS if b not in colors and b != scene.background])
        return dataclasses.replace(scene, background=background)
    else:
        objects = [objects[0]]
    if len(objects) == 2 and objects[0][:2] == objects[1][:2]:
        return perturb_scene(scene, rng)  # two identical objects would not be a pair scene any more
    return dataclasses.replace(scene, objects=tuple(objects))
