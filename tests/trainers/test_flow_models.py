"""The UNet-era trainers on a flow-matching pipeline (the tiny random SD3): DDPO, DPOK and D3PO through the flow SDE
step, DRaFT through the ODE, and those that noise clean latents themselves (RAFT, DRaFT-LV, Diffusion-DPO) through
the model family's forward process (x_σ = (1 − σ)·x0 + σ·ε, the velocity target ε − x0)."""

import pytest
import torch
from pg_helpers import load_cfg, tiny_flow_pipeline_dir, tiny_recipe, with_trainer


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


@pytest.mark.parametrize("trainer, groups", [
    ("raft", {}),
    ("raft", {"train": {"fit": "conditional"}}),
    ("draft", {"train": {"lv_samples": 2}}),
    ("diffusion_dpo", {}),
])
def test_trainers_that_noise_clean_latents_train_a_flow_transformer(tmp_path, monkeypatch, trainer, groups):
    """They draw t from the family's forward process: SD3's training σ carry its static shift 3, so every timestep
    the transformer sees while they fine-tune is 1000·3s/(1 + 2s) for some s in {1/1000, ..., 1} (a DDPM integer t
    would not be); Diffusion-DPO starts at log 2 (policy = reference)."""
    import math

    from pg_helpers import DPO_TINY

    from diffrl.models import flow
    from diffrl.training.metrics import read_metrics

    seen = []
    original = flow.RectifiedFlowProcess.add_noise

    def add_noise(self, x0, noise, t):
        seen.append(t.detach().double().cpu())
        return original(self, x0, noise, t)

    monkeypatch.setattr(flow.RectifiedFlowProcess, "add_noise", add_noise)
    losses = []
    if trainer == "diffusion_dpo":
        from diffrl.trainers import diffusion_dpo

        groups = {**DPO_TINY, **groups}
        del groups["trainer"]
        original_loss = diffusion_dpo.diffusion_dpo_loss

        def loss_fn(*args):
            loss, stats = original_loss(*args)
            losses.append(loss.item())
            return loss, stats

        monkeypatch.setattr(diffusion_dpo, "diffusion_dpo_loss", loss_fn)
    snapshots = _train_and_snapshot(tmp_path, trainer, _flow_recipe(tmp_path, trainer, **groups))
    first, last = snapshots[0], snapshots[max(snapshots)]
    assert max(snapshots) >= 1 and first and all("lora" in n for n in first)
    assert not [n for n in first if torch.equal(first[n], last[n])]  # every LoRA weight of the transformer moved
    if trainer != "draft":  # DRaFT-LV re-noises to the last sampling step's σ instead
        s = torch.arange(1, 1001, dtype=torch.float64) / 1000
        grid = 1000 * 3 * s / (1 + 2 * s)
        t = torch.cat(seen)
        assert len(t) and float((t[:, None] - grid[None]).abs().min(dim=1).values.max()) < 1e-3
    records = read_metrics(tmp_path / "run")
    assert all(math.isfinite(r["loss"]) for r in records)
    if trainer == "diffusion_dpo":  # before the first update the LoRA is the identity: policy = reference
        assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and len(set(losses)) > 1
