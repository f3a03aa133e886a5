"""The UNet-era trainers on a flow-matching pipeline (the tiny random SD3): those whose math holds run (DDPO, DPOK and
D3PO through the flow SDE step, DRaFT through the ODE), those whose math needs a DDPM schedule refuse in one line."""

import pytest
import torch
from pg_helpers import load_cfg, tiny_flow_pipeline_dir, tiny_recipe, with_trainer

from diffrl.errors import UserError


def _flow_recipe(tmp_path, trainer, **groups):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 0},
                         "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2},
                         "log": {"tracker": "none", "image_every": 0}}, trainer)
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_flow_pipeline_dir(tmp_path), tmp_path, **base)


def _train_and_snapshot(tmp_path, trainer, recipe):
    import importlib

    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                          if p.requires_grad}

    module = importlib.import_module(f"diffrl.trainers.{trainer}")
    module.train(load_cfg(recipe), tmp_path / "run", step_callback=snapshot)
    return snapshots


@pytest.mark.parametrize("trainer", ["ddpo", "dpok", "draft", "d3po"])
def test_trainers_whose_math_holds_train_a_flow_transformer(tmp_path, trainer):
    from diffrl.training.metrics import read_metrics

    snapshots = _train_and_snapshot(tmp_path, trainer, _flow_recipe(tmp_path, trainer))
    first, last = snapshots[0], snapshots[max(snapshots)]
    assert max(snapshots) >= 1 and first and all("lora" in n for n in first)
    assert not [n for n in first if torch.equal(first[n], last[n])]  # every LoRA weight of the transformer moved
    record = read_metrics(tmp_path / "run")[0]
    if "logprob_max_diff" in record:  # the policy-gradient trainers: recomputed log-probs are the rollout's
        assert record["logprob_max_diff"] <= 1e-5


@pytest.mark.parametrize("trainer, groups, message", [
    ("raft", {}, "flow-matching pipelines .* not supported"),
    ("draft", {"train": {"lv_samples": 2}}, "DRaFT-LV"),
    ("diffusion_dpo", {}, "flow-matching pipelines .* not supported"),
])
def test_trainers_that_need_a_ddpm_schedule_refuse_a_flow_pipeline(tmp_path, trainer, groups, message):
    import importlib

    recipe = _flow_recipe(tmp_path, trainer, **groups)
    with pytest.raises(UserError, match=message):
        importlib.import_module(f"diffrl.trainers.{trainer}").train(load_cfg(recipe), tmp_path / "run")
