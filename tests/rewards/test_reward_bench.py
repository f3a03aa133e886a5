"""`diffrl bench rewards` runs end to end on the tiny configs and reports what it promises."""

import json

import pytest

from diffrl.bench import run_bench
from diffrl.errors import UserError


def test_rewards_bench_reports_images_per_second(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["--rewards", "jpeg_compressibility,aesthetic,hpsv21", "--batch-size", "2", "--image-size", "64"]
    argv += ["--repeats", "1", "--device", "cpu", "--out", str(out)]
    assert run_bench("rewards", argv) == 0
    result = json.loads(out.read_text())
    assert result["config"] == "tiny" and result["device"] == "cpu" and result["batch_size"] == 2
    # Differentiable rewards get a forward+backward row too; JPEG size has no gradient.
    rows = {(row["reward"], row["mode"]): row for row in result["rows"]}
    expected = {("jpeg_compressibility", "score"), ("aesthetic", "score"), ("aesthetic", "grad")}
    assert set(rows) == expected | {("hpsv21", "score"), ("hpsv21", "grad")}
    for row in rows.values():
        assert row["s_per_call"] > 0 and row["images_per_s"] == pytest.approx(2 / row["s_per_call"])
    assert "images/s" in capsys.readouterr().out


def test_rewards_bench_unknown_reward_is_a_user_error():
    with pytest.raises(UserError, match="unknown reward 'pickscor' in --rewards; choose from jpeg_compressibility"):
        run_bench("rewards", ["--rewards", "clip_score,pickscor", "--device", "cpu"])
