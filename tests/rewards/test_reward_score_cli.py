"""`score_images`, the logic of `diffrl score`: reads files, scores each against the prompt, writes scores.json."""

import json

import pytest
from PIL import Image
from reward_testing import sample_images, tiny_clip_dir

from diffrl.errors import UserError
from rewards import get_reward
from rewards.preprocess import pil_to_tensor, to_pil
from rewards.score_cli import score_images


@pytest.fixture()
def image_files(tmp_path):
    paths = []
    for i, image in enumerate(to_pil(sample_images(48, 64))):
        path = tmp_path / f"image-{i}.png"
        image.save(path)
        paths.append(str(path))
    return paths


def test_scores_json_matches_direct_calls(image_files, tmp_path, capsys):
    out = tmp_path / "out" / "scores.json"
    records = score_images("clip_score", "a red cube", image_files, out_path=out, model=tiny_clip_dir(), device="cpu")
    assert json.loads(out.read_text()) == records
    reward = get_reward("clip_score", model=tiny_clip_dir(), device="cpu")
    for path, record in zip(image_files, records):
        assert set(record) == {"file", "prompt", "seed", "clip_score"}
        assert record["file"] == path and record["prompt"] == "a red cube" and record["seed"] is None
        expected = reward(pil_to_tensor(Image.open(path)).unsqueeze(0), ["a red cube"]).scores.item()
        assert record["clip_score"] == pytest.approx(expected, abs=1e-5)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == len(image_files) and printed[0].startswith(image_files[0])


def test_weighted_sum_components_are_written(image_files):
    terms = [{"name": "jpeg_incompressibility", "weight": 1.0}, {"name": "jpeg_compressibility", "weight": 0.5}]
    records = score_images("weighted_sum", "anything", image_files[:2], terms=terms)
    for record in records:
        size = record["jpeg_incompressibility"]
        assert record["jpeg_compressibility"] == pytest.approx(-size)
        assert record["weighted_sum"] == pytest.approx(size - 0.5 * size)
        assert record["jpeg_incompressibility/jpeg_kb"] == pytest.approx(size)


def test_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        score_images("jpeg_compressibility", "x", [str(tmp_path / "missing.png")])
    (tmp_path / "not-an-image.png").write_text("hello")
    with pytest.raises(UserError, match="cannot read image"):
        score_images("jpeg_compressibility", "x", [str(tmp_path / "not-an-image.png")])
    with pytest.raises(UserError, match="no images"):
        score_images("jpeg_compressibility", "x", [])
    with pytest.raises(UserError, match="unknown reward"):
        score_images("jpeg_compresibility", "x", [str(tmp_path / "not-an-image.png")])
