"""The ShapesWorld verifier: does an image show what its caption says? A GenEval in miniature.

A caption is parsed into clauses (`parse_caption`): each named object exists (or, for "two red circles",
exactly that many exist), the relation between the first two objects holds, the background has the named
colour. The image is read by pixel analysis (`analyse`):

1. background = per-channel median of the border pixels;
2. each pixel is explained as a mix α·c + (1−α)·background of one object colour c (anti-aliased and blurred
   edges are such mixes); it belongs to c when α ≥ 0.5 and the residual is small;
3. connected components per colour (8-connected), tiny ones dropped;
4. shape from four descriptors (fill of the bounding box, share of area in its top half, kurtosis, centroid
   height), by the nearest of three calibrated prototypes;
5. centroids for relations, with the same rule the renderer uses (`world.relation_holds`).

The score is the fraction of clauses satisfied, in [0, 1]; `info` lists every clause and its verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from diffrl.errors import UserError
from diffrl.files import shorten
from diffrl.shapes.world import (
    BACKGROUNDS,
    COLORS,
    HELDOUT_RELATION_WORDS,
    RELATIONS,
    SHAPES,
    relation_holds,
    sample_batch,
)

COUNT_WORDS = {"one": 1, "a": 1, "an": 1, "two": 2, "three": 3, "four": 4, "1": 1, "2": 2, "3": 3, "4": 4,
               "a pair of": 2}
RELATION_WORDS = {**{r: r for r in RELATIONS}, **HELDOUT_RELATION_WORDS, "under": "below", "over": "above"}
PREFIXES = ("an image of ", "a photo of ", "a picture of ", "an illustration of ")

_COLOR = "|".join(COLORS)
_SHAPE = "|".join(SHAPES)
_COUNT = "|".join(sorted((re.escape(w) for w in COUNT_WORDS), key=len, reverse=True))
_NOUN = rf"(?:{_COUNT}) (?:{_COLOR}) (?:{_SHAPE})s?"
_NOUN_RE = re.compile(rf"^({_COUNT}) ({_COLOR}) ({_SHAPE})(s?)$")
_REL = "|".join(sorted((re.escape(w) for w in RELATION_WORDS), key=len, reverse=True))
_CAPTION_RE = re.compile(
    rf"^(?P<a>{_NOUN})(?:(?: and (?P<b>{_NOUN}))|(?: (?P<rel>{_REL}) (?P<c>{_NOUN})))?"
    rf"(?: on (?:a|an) (?P<bg>{'|'.join(BACKGROUNDS)}) background)?$"
)


@dataclasses.dataclass(frozen=True)
class Clauses:
    objects: tuple[tuple[str, str, int], ...]  # (colour, shape, count); count 1 means "at least one"
    relation: str | None
    background: str | None

    def __len__(self):
        return len(self.objects) + (self.relation is not None) + (self.background is not None)


@functools.lru_cache(maxsize=4096)
def parse_caption(text: str) -> Clauses:
    """Clauses of a ShapesWorld caption; a `UserError` for text outside the ShapesWorld grammar."""
    t = re.sub(r"[^a-z0-9 ]", " ", text.lower())
    t = re.sub(r"\s+", " ", t).strip()
    for prefix in PREFIXES:
        t = t.removeprefix(prefix)
    m = _CAPTION_RE.match(t)
    if m is None:
        raise UserError(
            f"shapes_verifier cannot read the prompt '{shorten(text)}': it understands ShapesWorld captions such as "
            "'two red circles' or 'a blue square left of a yellow triangle on a white background' "
            "(see `diffrl ls prompts`)"
        )
    nouns = [m.group(k) for k in ("a", "b", "c") if m.group(k)]
    objects = []
    for noun in nouns:
        count_word, color, shape, _ = _NOUN_RE.match(noun).groups()
        count = COUNT_WORDS[count_word]
        objects.append((color, shape, count))
    relation = RELATION_WORDS[m.group("rel")] if m.group("rel") else None
    return Clauses(tuple(objects), relation, m.group("bg"))


# ---------------------------------------------------------------------------------------------------------
# Pixel analysis (batched in torch)


# Shape descriptors (see `shape_features`) and their per-class means and spreads, measured on rendered
# ground truth, clean, blurred and noisy (`python -m diffrl.shapes.verifier --calibrate`).
FEATURES = ("fill", "top", "kurtosis", "ycentre")
PROTOTYPES = {
    "circle": ((0.789, 0.470, 2.063, 0.501), (0.047, 0.040, 0.049, 0.030)),
    "square": ((0.968, 0.468, 1.878, 0.501), (0.044, 0.033, 0.065, 0.030)),
    "triangle": ((0.588, 0.262, 2.418, 0.637), (0.047, 0.037, 0.030, 0.030)),
}


def shape_features(hard, coverage) -> tuple[float, ...]:
    """Descriptors of one component: hard mask [H, W] bool (coverage >= 0.5) and coverage [H, W] in [0, 1]
    restricted to the component grown by a pixel.

    - fill: hard area over bounding-box area (square ~1, circle ~pi/4, triangle ~1/2);
    - top: share of the hard area in the upper half of the box (an upward triangle has ~1/4);
    - kurtosis: coverage-weighted 4th standardised moment along x and y, averaged (a uniform square 1.8, a
      disc 2.0, a triangle more) — robust to noise because every pixel counts by its coverage;
    - ycentre: coverage-weighted centroid height within the box, 0 top .. 1 bottom.
    """
    import torch

    ys, xs = torch.nonzero(hard, as_tuple=True)
    y0, y1, x0, x1 = ys.min().item(), ys.max().item() + 1, xs.min().item(), xs.max().item() + 1
    bw, bh = x1 - x0, y1 - y0
    fill = len(ys) / (bw * bh)
    top = (ys.float() + 0.5 < y0 + bh / 2).float().mean().item()
    h, w = coverage.shape
    gy, gx = torch.meshgrid(torch.arange(h, dtype=torch.float32) + 0.5, torch.arange(w, dtype=torch.float32) + 0.5,
                            indexing="ij")
    m = coverage.sum().clamp_min(1e-6)
    cx, cy = (coverage * gx).sum() / m, (coverage * gy).sum() / m
    kurt = []
    for g, c in ((gx, cx), (gy, cy)):
        var = (coverage * (g - c) ** 2).sum() / m
        kurt.append(((coverage * (g - c) ** 4).sum() / m / var.clamp_min(1e-6) ** 2).item())
    ycentre = ((cy - y0) / bh).item()
    return fill, top, sum(kurt) / 2, ycentre


def classify_shape(features) -> tuple[str, float]:
    """Nearest prototype in standardised descriptor space: (shape, distance)."""
    best, best_d = None, float("inf")
    for shape, (mean, std) in PROTOTYPES.items():
        d = sum(((f - m) / s) ** 2 for f, m, s in zip(features, mean, std)) ** 0.5
        if d < best_d:
            best, best_d = shape, d
    return best, best_d


def _label_components(masks):
    """8-connected components of boolean masks [N, H, W] -> int labels [N, H, W] (0 = none), by min-label
    propagation with max-pooling (vectorised over the batch; at most H*W/2 iterations, usually ~H)."""
    import torch
    import torch.nn.functional as F

    n, h, w = masks.shape
    big = h * w + 1
    idx = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, h, w).expand(n, h, w)
    labels = torch.where(masks, idx, torch.full_like(idx, big))
    for _ in range(h * w):
        pooled = -F.max_pool2d(-labels.unsqueeze(1), 3, stride=1, padding=1).squeeze(1)
        new = torch.where(masks, torch.minimum(labels, pooled), labels)
        if torch.equal(new, labels):
            break
        labels = new
    return torch.where(masks, labels, torch.zeros_like(labels)).long()


@dataclasses.dataclass
class Detection:
    color: str
    shape: str
    centroid: tuple[float, float]  # (x, y) in pixels
    area: float
    shape_distance: float  # standardised distance to the chosen shape's prototype
    features: tuple[float, ...] = ()  # see `shape_features`
    mask: object = None  # [H, W] bool torch tensor: the component's pixels (coverage >= 0.5)


def analyse(images, min_area_frac: float = 12 / 1024, residual_max: float = 70.0):
    """Reads objects and background from images [B, 3, H, W] in [0, 1].

    Returns (detections per image, background name per image, background RGB per image).
    """
    import torch
    import torch.nn.functional as F

    images = images.detach().float().cpu().clamp(0, 1) * 255.0
    b, _, h, w = images.shape
    pix = images.permute(0, 2, 3, 1)  # [B, H, W, 3]
    border = torch.cat([pix[:, 0], pix[:, -1], pix[:, 1:-1, 0], pix[:, 1:-1, -1]], dim=1)  # [B, P, 3]
    bg = border.median(dim=1).values  # [B, 3]

    palette = torch.tensor(list(COLORS.values()), dtype=torch.float32)  # [K, 3]
    d = palette[None] - bg[:, None]  # [B, K, 3]
    rel = pix[:, :, :, None, :] - bg[:, None, None, None, :]  # [B, H, W, 1, 3]
    alpha = ((rel * d[:, None, None]).sum(-1) / d.pow(2).sum(-1).clamp_min(1.0)[:, None, None]).clamp(0, 1)
    residual = (rel - alpha[..., None] * d[:, None, None]).norm(dim=-1)  # [B, H, W, K]
    # A colour too close to the background cannot be told apart from it: never assign it.
    usable = (d.norm(dim=-1) > 60.0)[:, None, None]  # [B, 1, 1, K]
    ok = (alpha >= 0.5) & (residual <= residual_max) & usable
    residual = torch.where(ok, residual, torch.full_like(residual, float("inf")))
    best = residual.argmin(dim=-1)  # [B, H, W]
    assigned = torch.isfinite(residual.min(dim=-1).values)

    names = list(COLORS)
    masks = torch.stack([assigned & (best == k) for k in range(len(names))], dim=1)  # [B, K, H, W]
    labels = _label_components(masks.view(-1, h, w)).view(b, len(names), h, w)

    detections: list[list[Detection]] = [[] for _ in range(b)]
    min_area = min_area_frac * h * w
    for i in range(b):
        for k in range(len(names)):
            lab = labels[i, k]
            ids = torch.unique(lab)
            for comp in ids[ids > 0].tolist():
                hard = lab == comp
                if hard.sum() < min_area:
                    continue
                grown = F.max_pool2d(hard[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0
                coverage = torch.where(grown, alpha[i, :, :, k], torch.zeros(()))
                features = shape_features(hard, coverage)
                shape, dist = classify_shape(features)
                ys, xs = torch.nonzero(hard, as_tuple=True)
                centroid = (xs.float().mean().item() + 0.5, ys.float().mean().item() + 0.5)
                detections[i].append(Detection(names[k], shape, centroid, float(hard.sum()), dist, features, hard))

    bg_palette = torch.tensor(list(BACKGROUNDS.values()), dtype=torch.float32)
    bg_names = [list(BACKGROUNDS)[j] for j in torch.cdist(bg, bg_palette).argmin(dim=1).tolist()]
    return detections, bg_names, bg


def check(clauses: Clauses, detections: list[Detection], background: str, size: int) -> list[dict]:
    """Verdict on each clause given what `analyse` found in one image."""
    verdicts = []
    found = {}
    for color, shape, count in clauses.objects:
        hits = [d for d in detections if d.color == color and d.shape == shape]
        found.setdefault((color, shape), hits)
        ok = len(hits) >= 1 if count == 1 else len(hits) == count
        want = "at least 1" if count == 1 else f"exactly {count}"
        verdicts.append({"clause": f"{want} {color} {shape}", "ok": ok, "found": len(hits)})
    if clauses.relation is not None:
        (ca, sa, _), (cb, sb, _) = clauses.objects[:2]
        ok = any(relation_holds(clauses.relation, a.centroid, bb.centroid, size)
                 for a in found[(ca, sa)] for bb in found[(cb, sb)])
        verdicts.append({"clause": f"{ca} {sa} {clauses.relation} {cb} {sb}", "ok": ok})
    if clauses.background is not None:
        verdicts.append({"clause": f"{clauses.background} background", "ok": background == clauses.background,
                         "found": background})
    return verdicts


def verify(images, prompts: list[str]):
    """Scores [B] in [0, 1] (fraction of clauses satisfied) and per-image details."""
    import torch

    clauses = [parse_caption(p) for p in prompts]
    detections, bg_names, _ = analyse(images)
    size = images.shape[-1]
    scores, details = [], []
    for c, dets, bg in zip(clauses, detections, bg_names):
        verdicts = check(c, dets, bg, size)
        scores.append(sum(v["ok"] for v in verdicts) / len(verdicts))
        details.append({"clauses": verdicts,
                        "objects": [f"{d.color} {d.shape} at ({d.centroid[0]:.0f},{d.centroid[1]:.0f})"
                                    for d in dets],
                        "background": bg})
    return torch.tensor(scores, dtype=torch.float32), details


def feedback_map(clauses: Clauses, detections: list[Detection], verdicts: list[dict], height: int, width: int):
    """Per-pixel feedback [H, W] float32 in [-1, 1] from one image's clause verdicts (`check`) — PXPO's dense reward.

    Each clause's verdict counts +1 (satisfied) or -1 (violated) on the pixels it is about:
    - a detected object's pixels: the mean verdict of the clauses that name it (its colour-shape clause — a count
      clause such as "two red circles" names every red circle — and the relation clause when the object is one of
      the relation's two nouns); an object that no clause names (a wrong colour or shape) is -1;
    - every other pixel ("background"): the mean verdict of the background clause, if any, and of each object clause
      with no matching detection (-1: the missing object is the background's fault, so an empty canvas is not
      rewarded); 0 when there is neither.
    """
    import torch

    n_objects = len(clauses.objects)
    named = [(color, shape) for color, shape, _ in clauses.objects]
    sign = [1.0 if v["ok"] else -1.0 for v in verdicts]
    out = torch.zeros(height, width)
    covered = torch.zeros(height, width, dtype=torch.bool)
    for d in detections:
        votes = [sign[k] for k in range(n_objects) if named[k] == (d.color, d.shape)]
        if clauses.relation is not None and (d.color, d.shape) in named[:2]:
            votes.append(sign[n_objects])
        out[d.mask] = sum(votes) / len(votes) if votes else -1.0
        covered |= d.mask
    found = {(d.color, d.shape) for d in detections}
    votes = [-1.0 for k in range(n_objects) if named[k] not in found]
    if clauses.background is not None:
        votes.append(sign[-1])
    if votes:
        out[~covered] = sum(votes) / len(votes)
    return out


def verify_maps(images, prompts: list[str]):
    """Per-pixel feedback maps [B, H, W] (`feedback_map`), the verifier's scores [B] and per-image details."""
    import torch

    clauses = [parse_caption(p) for p in prompts]
    detections, bg_names, _ = analyse(images)
    h, w = images.shape[-2:]
    maps, scores, details = [], [], []
    for c, dets, bg in zip(clauses, detections, bg_names):
        verdicts = check(c, dets, bg, w)
        maps.append(feedback_map(c, dets, verdicts, h, w))
        scores.append(sum(v["ok"] for v in verdicts) / len(verdicts))
        details.append({"clauses": verdicts, "background": bg})
    return torch.stack(maps), torch.tensor(scores, dtype=torch.float32), details


def calibrate(n: int = 600, seed: int = 7) -> dict:
    """Per-shape mean and std of the descriptors on rendered single objects, clean, blurred and noisy."""
    import torch
    import torch.nn.functional as F

    imgs, _, scenes = sample_batch(seed, n, "train", kind="single")
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255
    gen = torch.Generator().manual_seed(seed)
    kernel = torch.tensor([0.25, 0.5, 0.25])
    kernel = (kernel[:, None] * kernel[None]).expand(3, 1, 3, 3)
    blurred = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    noisy = (x + 0.05 * torch.randn(x.shape, generator=gen)).clamp(0, 1)
    feats = {s: [] for s in SHAPES}
    for variant in (x, blurred, noisy):
        detections, _, _ = analyse(variant)
        for scene, dets in zip(scenes, detections):
            if len(dets) == 1:
                feats[scene.objects[0][1]].append(dets[0].features)
    return {s: (np.mean(f, axis=0).round(3).tolist(), np.std(f, axis=0).round(3).tolist()) for s, f in feats.items()}


if __name__ == "__main__":
    import json
    import sys

    if "--calibrate" in sys.argv:
        print(json.dumps(calibrate(), indent=1))
