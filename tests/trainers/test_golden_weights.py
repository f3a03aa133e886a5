"""Behaviour unchanged across refactors: the final trainable weights of each shipped tiny-shapes training recipe,
after 2 short epochs from a fixed seed, equal the numbers recorded before the trainers were rebuilt on the shared
run context (commit 12d7d0c, CPU, fp32, one torch thread; `data/golden_weights.json`: per LoRA tensor its sum and
its sum of absolute values, in float64).

Tolerance: 1e-6 relative to the tensor's absolute sum. The same operations in the same order reproduce the numbers
bit for bit (two runs at 12d7d0c differed by exactly 0.0); 1e-6 leaves room for fp32 reductions regrouped by a
refactor (rounding of order 1e-7 relative), while a change of the algorithm's numerics (a different minibatch
order, a loss scaled differently, an extra random draw) moves the sums by 1e-3 or more.
"""

import json
from pathlib import Path

import pytest
import torch

GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_weights.json").read_text())


@pytest.mark.parametrize("recipe", sorted(GOLDEN))
def test_shipped_recipe_trains_to_the_recorded_weights(recipe, tmp_path):
    from diffrl.config import load_recipe
    from diffrl.trainers import get_trainer

    case = GOLDEN[recipe]
    cfg = load_recipe(recipe, case["overrides"] + [f"run.output_dir={tmp_path}", "run.name=g"])
    final = {}

    def record(info):
        final.update({n: p.detach().double() for n, p in info["unet"].named_parameters() if p.requires_grad})

    get_trainer(cfg.trainer).train(cfg, tmp_path / "g", step_callback=record)
    assert sorted(final) == sorted(case["tensors"])
    for name, (total, abs_total) in case["tensors"].items():
        got = final[name]
        assert float(got.abs().sum()) == pytest.approx(abs_total, rel=1e-6, abs=1e-9), name
        assert float(got.sum()) == pytest.approx(total, rel=0, abs=1e-6 * abs_total + 1e-9), name
    assert torch.cat([p.flatten() for p in final.values()]).isfinite().all()
