"""ShapesWorld renderer, captions, splits and prompt sets."""

import random

import numpy as np
import pytest

from diffrl.errors import UserError
from diffrl.shapes import world
from diffrl.shapes.prompts import get_prompt_set, list_prompt_sets


def test_render_is_deterministic_and_seed_dependent():
    scene = world.Scene((("red", "circle", 1), ("blue", "square", 1)), relation="left of", kind="relation")
    a, b = world.render(scene, seed=3), world.render(scene, seed=3)
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, world.render(scene, seed=4))
    assert world.render(scene, seed=3, size=64).shape == (64, 64, 3)


def test_sample_batch_is_deterministic():
    x1, c1, _ = world.sample_batch(11, 16, "train")
    x2, c2, _ = world.sample_batch(11, 16, "train")
    assert np.array_equal(x1, x2) and c1 == c2


def test_default_background_is_black_and_named_background_fills_corners():
    plain = world.render(world.Scene((("red", "circle", 1),)), seed=0)
    assert tuple(plain[0, 0]) == (0, 0, 0)
    green = world.render(world.Scene((("red", "circle", 1),), background="green", kind="background"), seed=0)
    assert tuple(green[0, 0]) == world.BACKGROUNDS["green"]


def test_object_colour_covers_expected_area():
    # A circle of radius r covers pi r^2 pixels; the renderer's radius lies in [0.12, 0.19] x size.
    img = world.render(world.Scene((("blue", "circle", 1),)), seed=5).astype(int)
    blue = (img[..., 2] > 150) & (img[..., 0] < 120)
    r_lo, r_hi = 0.12 * 32, 0.19 * 32
    assert np.pi * r_lo**2 * 0.8 <= blue.sum() <= np.pi * r_hi**2 * 1.2


def test_rendered_relations_hold():
    rng = random.Random(0)
    for _ in range(50):
        scene = world.sample_scene(rng, "train", kind="relation")
        placed = world._layout(scene, random.Random(rng.random()), 32)
        assert world.relation_holds(scene.relation, placed[0][2:4], placed[1][2:4], 32)


def test_train_split_never_shows_heldout_pairs_or_phrasings():
    rng = random.Random(1)
    heldout_words = list(world.HELDOUT_RELATION_WORDS) + list(world.HELDOUT_COUNT_WORDS.values()) + ["an image of"]
    for _ in range(2000):
        scene, text = world.sample_captioned(rng, "train")
        assert not any((c, s) in world.HELDOUT_PAIRS for c, s, _ in scene.objects)
        assert not any(f" {w} " in f" {text} " for w in heldout_words), text


def test_heldout_split_is_novel():
    rng = random.Random(2)
    heldout_words = list(world.HELDOUT_RELATION_WORDS) + list(world.HELDOUT_COUNT_WORDS.values()) + ["an image of"]
    for _ in range(500):
        scene, text = world.sample_captioned(rng, "heldout")
        novel_pair = any((c, s) in world.HELDOUT_PAIRS for c, s, _ in scene.objects)
        novel_words = any(f" {w} " in f" {text} " for w in heldout_words)
        assert novel_pair or novel_words, text
    assert not set(get_prompt_set("heldout")) & set(get_prompt_set("train"))


def test_captions_use_articles():
    assert world.caption(world.Scene((("orange", "circle", 1),))) == "an orange circle"
    assert world.caption(world.Scene((("red", "square", 3),), kind="count")) == "three red squares"
    scene = world.Scene((("red", "square", 1), ("blue", "circle", 1)), relation="above", kind="relation")
    assert world.caption(scene, heldout_phrasing=True) == "a red square on top of a blue circle"


def test_prompt_sets():
    sets = list_prompt_sets()
    assert {"train", "heldout", "train_single", "heldout_relation"} <= set(sets)
    train = get_prompt_set("shapes:train")
    assert len(train) == 256 and len(set(train)) == 256
    assert get_prompt_set("train") == train  # fixed lists
    assert len(get_prompt_set("train_single")) == 14  # 6 colours x 3 shapes - 4 held-out pairs
    with pytest.raises(UserError, match="did you mean 'heldout'"):
        get_prompt_set("heldou")
