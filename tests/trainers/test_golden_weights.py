"""Behaviour unchanged across refactors: the final trainable weights of each shipped tiny-shapes training recipe,
after 2 short epochs from a fixed seed, equal the numbers in `data/golden_weights.json` (per LoRA tensor its sum and
its sum of absolute values, in float64).

The runs are in float64 (`model.dtype=float64`, and `reward.kwargs.dtype=float64` for a reward model), so that the
numbers are a property of the code, not of the CPU. In float32 two epochs amplify the last-bit differences between
kernel paths (vector width, oneDNN/MKL code path, thread count) to relative differences of 1.5e-5 to 2e-3, as large as
the regressions this test is for; in float64 the same variations moved the numbers by at most 4.4e-13 (the commands
and numbers are in issue 25's note).

Tolerance: `RTOL` (1e-8) of each tensor's absolute sum, for the sum and for the absolute sum: more than four orders
of magnitude above that variation, and far below what a change of the algorithm's numerics does: a learning rate
1.001 times larger moves them by up to 1e-3 of a tensor's absolute sum, one 1.000001 times larger by up to 1e-6, one
extra draw from the trainer's random generator by up to 0.37.

Recording (the JSON holds only numbers, the commit and the dtype): `python tests/trainers/test_golden_weights.py
--record` trains every recipe of the JSON with its overrides on one torch thread and rewrites the file. Record only
after showing that the code's behaviour has not changed (the old numbers still pass at the new commit), or when a
change of behaviour is intended, and say which in the commit.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data" / "golden_weights.json"
GOLDEN = json.loads(DATA.read_text())
RTOL = 1e-8


def final_weights(recipe: str, overrides: list[str], tmp_path: Path) -> dict[str, torch.Tensor]:
    """Train `recipe` with `overrides`; the trainable UNet tensors after the last optimizer step, by name."""
    from diffrl.config import load_recipe
    from diffrl.trainers import get_trainer

    cfg = load_recipe(recipe, overrides + [f"run.output_dir={tmp_path}", "run.name=g"])
    final = {}

    def record(info):
        final.update({n: p.detach().clone() for n, p in info["unet"].named_parameters() if p.requires_grad})

    get_trainer(cfg.trainer).train(cfg, tmp_path / "g", step_callback=record)
    return final


@pytest.mark.parametrize("recipe", sorted(GOLDEN["recipes"]))
def test_shipped_recipe_trains_to_the_recorded_weights(recipe, tmp_path):
    case = GOLDEN["recipes"][recipe]
    final = final_weights(recipe, case["overrides"], tmp_path)
    assert {p.dtype for p in final.values()} == {torch.float64}
    assert sorted(final) == sorted(case["tensors"])
    for name, (total, abs_total) in case["tensors"].items():
        got = final[name]
        assert float(got.abs().sum()) == pytest.approx(abs_total, rel=RTOL, abs=1e-12), name
        assert float(got.sum()) == pytest.approx(total, rel=0, abs=RTOL * abs_total + 1e-12), name
    assert torch.cat([p.flatten() for p in final.values()]).isfinite().all()


def record() -> None:
    """Rewrite `data/golden_weights.json` from the current code (see the module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # as the trainer tests run (tests/trainers/conftest.py)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                            cwd=DATA.parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "diffrl", "samplers", "rewards", "recipes"],
                           capture_output=True, text=True, check=True, cwd=DATA.parent).stdout.strip()
    out = {"commit": commit + (" + uncommitted changes" if dirty else ""), "dtype": "float64", "recipes": {}}
    for recipe, case in GOLDEN["recipes"].items():
        with tempfile.TemporaryDirectory() as tmp:
            final = final_weights(recipe, case["overrides"], Path(tmp))
        tensors = {n: [float(p.sum()), float(p.abs().sum())] for n, p in sorted(final.items())}
        out["recipes"][recipe] = {"overrides": case["overrides"], "tensors": tensors}
    DATA.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {DATA} at {out['commit']}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/trainers/test_golden_weights.py --record")
    record()
