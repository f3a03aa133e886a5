"""`shapes_verifier_map`: the ShapesWorld verifier's per-pixel feedback (PXPO's dense reward), on hand-placed shapes
whose pixels are known, so every expected map below is built from the placement, not from the verifier."""

import torch

from diffrl.shapes.world import BACKGROUNDS, COLORS
from rewards import get_reward


def _canvas(background: str, squares: list[tuple[str, int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A [1, 3, 32, 32] image of axis-aligned squares (colour, row, col, side) on `background`, and each square's
    pixel mask."""
    image = (torch.tensor(BACKGROUNDS[background], dtype=torch.float32) / 255).view(1, 3, 1, 1).repeat(1, 1, 32, 32)
    masks = []
    for color, row, col, side in squares:
        image[0, :, row:row + side, col:col + side] = (torch.tensor(COLORS[color], dtype=torch.float32) / 255)[:, None,
                                                                                                               None]
        mask = torch.zeros(32, 32, dtype=torch.bool)
        mask[row:row + side, col:col + side] = True
        masks.append(mask)
    return image, masks


def test_satisfied_object_plus_one_unwanted_object_minus_one_background_its_clauses():
    # caption: red square (present: +1), green circle (missing), white background (right). The blue square is named
    # by no clause: -1. Background votes: white background +1, missing green circle -1 -> mean 0.
    image, (red, blue) = _canvas("white", [("red", 4, 4, 8), ("blue", 18, 18, 10)])
    out = get_reward("shapes_verifier_map")(image, ["a red square and a green circle on a white background"])
    expected = torch.zeros(32, 32)
    expected[red], expected[blue] = 1.0, -1.0
    assert torch.equal(out.info["maps"][0], expected)
    # score = the map's mean: (64 - 100) / 1024
    assert out.scores.tolist() == [(64 - 100) / 1024]
    assert abs(out.info["verifier"].item() - 2 / 3) < 1e-6  # 2 of 3 clauses hold


def test_relation_clause_votes_on_both_objects():
    # "a red square left of a blue square": red at the left -> each object: its own clause +1, relation +1 -> +1;
    # swapped -> +1 and -1 -> 0. No background clause and no missing object: background 0.
    for red_col, blue_col, relation_sign in ((2, 20, 1.0), (20, 2, -1.0)):
        image, (red, blue) = _canvas("black", [("red", 12, red_col, 8), ("blue", 12, blue_col, 8)])
        out = get_reward("shapes_verifier_map")(image, ["a red square left of a blue square"])
        expected = torch.zeros(32, 32)
        expected[red] = expected[blue] = (1.0 + relation_sign) / 2
        assert torch.equal(out.info["maps"][0], expected)


def test_empty_canvas_is_not_rewarded_and_a_wrong_count_marks_every_copy():
    # nothing drawn: the missing red square makes the background -1 (with no background clause)
    image, _ = _canvas("black", [])
    out = get_reward("shapes_verifier_map")(image, ["a red square"])
    assert torch.equal(out.info["maps"][0], -torch.ones(32, 32))
    # "two red squares" with three present: the count clause fails, so all three squares are -1; background 0
    image, masks = _canvas("black", [("red", 2, 2, 6), ("red", 2, 20, 6), ("red", 20, 10, 6)])
    out = get_reward("shapes_verifier_map")(image, ["two red squares"])
    expected = torch.zeros(32, 32)
    for mask in masks:
        expected[mask] = -1.0
    assert torch.equal(out.info["maps"][0], expected)
    assert out.scores.tolist() == [-108 / 1024]


def test_batch_and_device_of_the_outputs():
    a, _ = _canvas("white", [("red", 4, 4, 8)])
    b, _ = _canvas("black", [])
    out = get_reward("shapes_verifier_map")(torch.cat([a, b]), ["a red square", "a red square"])
    assert out.info["maps"].shape == (2, 32, 32) and out.scores.shape == (2,)
    assert torch.allclose(out.scores, out.info["maps"].mean(dim=(1, 2)))
