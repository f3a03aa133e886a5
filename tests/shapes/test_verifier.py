"""The ShapesWorld verifier: parsing, pixel analysis, and its accuracy on ground truth."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffrl.errors import UserError
from diffrl.shapes import world
from diffrl.shapes.verifier import Clauses, analyse, parse_caption, verify


def _tensor(images):
    return torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2).float() / 255


def _blur(x, sigma):
    r = torch.arange(-2, 3).float()
    k = torch.exp(-(r**2) / (2 * sigma**2))
    k = k / k.sum()
    return F.conv2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), (k[:, None] * k[None]).expand(3, 1, 5, 5), groups=3)


@pytest.fixture(scope="module")
def ground_truth():
    images, captions, _ = world.sample_batch(5, 256, "train")
    held, held_captions, _ = world.sample_batch(6, 128, "heldout")
    return _tensor(np.concatenate([images, held])), captions + held_captions


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a red circle", Clauses((("red", "circle", 1),), None, None)),
        ("three blue squares", Clauses((("blue", "square", 3),), None, None)),
        ("a pair of green triangles", Clauses((("green", "triangle", 2),), None, None)),
        ("an image of an orange square and a purple circle",
         Clauses((("orange", "square", 1), ("purple", "circle", 1)), None, None)),
        ("a yellow triangle to the right of a red square",
         Clauses((("yellow", "triangle", 1), ("red", "square", 1)), "right of", None)),
        ("A blue circle on top of a green square.", Clauses((("blue", "circle", 1), ("green", "square", 1)), "above", None)),
        ("a red circle on a white background", Clauses((("red", "circle", 1),), None, "white")),
    ],
)
def test_parse_caption(text, expected):
    assert parse_caption(text) == expected
    assert len(expected) == len(expected.objects) + (expected.relation is not None) + (expected.background is not None)


def test_unreadable_caption_is_a_user_error():
    with pytest.raises(UserError, match="shapes_verifier cannot read"):
        parse_caption("a photo of an astronaut riding a horse")


def test_hand_drawn_scene():
    # A 10x10 red square at x 2..11, y 10..19 and a filled blue disc of radius 5 centred at (24, 15).
    img = np.zeros((32, 32, 3), np.uint8)
    img[10:20, 2:12] = (220, 40, 40)
    yy, xx = np.mgrid[0:32, 0:32] + 0.5
    img[(xx - 24) ** 2 + (yy - 15) ** 2 <= 25] = (40, 80, 225)
    detections, backgrounds, _ = analyse(_tensor(img[None]))
    found = sorted((d.color, d.shape) for d in detections[0])
    assert found == [("blue", "circle"), ("red", "square")]
    red = next(d for d in detections[0] if d.color == "red")
    assert red.centroid == pytest.approx((7.0, 15.0), abs=0.01) and red.area == 100
    assert backgrounds == ["black"]
    scores, details = verify(_tensor(np.stack([img] * 4)), [
        "a red square left of a blue circle",   # 3/3
        "a red square right of a blue circle",  # objects right, relation wrong: 2/3
        "two red squares",                      # one found: 0/1
        "a red square on a white background",   # 1/2
    ])
    assert scores.tolist() == pytest.approx([1.0, 2 / 3, 0.0, 0.5])
    assert details[1]["clauses"][2] == {"clause": "red square right of blue circle", "ok": False}


def test_verifier_on_ground_truth(ground_truth):
    images, captions = ground_truth
    assert verify(images, captions)[0].mean() >= 0.98


def test_verifier_on_mildly_blurred_or_noisy_ground_truth(ground_truth):
    images, captions = ground_truth
    gen = torch.Generator().manual_seed(0)
    assert verify(_blur(images, 0.5), captions)[0].mean() >= 0.98
    noisy = (images + 0.05 * torch.randn(images.shape, generator=gen)).clamp(0, 1)
    assert verify(noisy, captions)[0].mean() >= 0.98


def test_verifier_on_mismatched_captions(ground_truth):
    images, captions = ground_truth
    shifted = captions[1:] + captions[:1]
    assert verify(images, shifted)[0].mean() <= 0.2


def test_counts():
    scene = world.Scene((("purple", "triangle", 3),), kind="count")
    img = _tensor(world.render(scene, seed=1)[None])
    scores, details = verify(torch.cat([img, img]), ["three purple triangles", "two purple triangles"])
    assert scores.tolist() == [1.0, 0.0]
    assert details[1]["clauses"][0]["found"] == 3


def test_reward_registry_entry():
    from rewards import get_reward, list_rewards

    assert "shapes_verifier" in list_rewards()
    reward = get_reward("shapes_verifier")
    assert reward.differentiable is False and reward.higher_is_better is True
    images, captions, _ = world.sample_batch(0, 4)
    out = reward(_tensor(images), captions)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32
    assert len(out.info["details"]) == 4
