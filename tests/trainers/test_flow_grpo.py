"""Flow-GRPO end to end on the tiny random SD3 pipeline, through the shared run context.

Registered: tests/trainers/test_contract.py checks its contract too; these are its own checks.
"""

import json

import pytest
import torch
from pg_helpers import TINY, load_cfg, tiny_flow_pipeline_dir, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.errors import UserError


def _recipe(tmp_path, **groups):
    base = with_trainer({"run": {"num_epochs": 2, "save_every": 1, "eval_every": 1},
                         "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2, "eval_num_images": 3},
                         "log": {"tracker": "none", "image_every": 1, "grid_images": 3}}, "flow_grpo")
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_flow_grpo_trains_its_lora_writes_the_run_dir_and_exports_a_diffusers_lora(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from diffrl.trainers import flow_grpo
    from diffrl.training.metrics import read_metrics
    from diffrl.training.weights import load_trainable, setup_trainable

    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: (p.detach().clone(), p.requires_grad)
                                          for n, p in info["unet"].named_parameters()}

    recipe = _recipe(tmp_path, reward={"name": "pg_helpers:brightness", "gold": "pg_helpers:redness"})
    run_dir = tmp_path / "run"
    final = flow_grpo.train(load_cfg(recipe), run_dir, step_callback=snapshot)

    # 4 samples per epoch in micro-batches of 2, one optimizer step each: steps 0 (start) to 4
    assert sorted(snapshots) == [0, 1, 2, 3, 4]
    before, after = snapshots[0], snapshots[4]
    trainable = [n for n, (_, grad) in before.items() if grad]
    assert trainable and all("lora" in n for n in trainable)
    assert not [n for n in trainable if torch.equal(before[n][0], after[n][0])]
    assert not [n for n, (value, grad) in before.items() if not grad and not torch.equal(value, after[n][0])]

    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [0, 1, 2] and records[-1]["final"]
    for r in records[:2]:
        # the invariant: before each epoch's first update the recomputed log-probs are the rollout's (ratio 1)
        assert r["logprob_max_diff"] <= 1e-5 and r["ratio_first_step"] == pytest.approx(1.0, abs=1e-5)
        for key in ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "eval_gold_mean", "reward_mean"):
            assert key in r, key
    assert records[1]["kl"] > 0  # the second epoch starts from moved weights: a KL to the reference
    assert final["eval_gold_mean"] == records[-1]["eval_gold_mean"]
    assert (run_dir / "images" / "epoch-1.png").is_file() and (run_dir / "reward_curve.png").is_file()
    ckpt = run_dir / "checkpoints" / "step-4"
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 4

    # the exported LoRA loads in plain diffusers (SD3's `load_lora_weights`) and gives the trained transformer
    pipe_dir = tiny_flow_pipeline_dir(tmp_path)
    plain = StableDiffusion3Pipeline.from_pretrained(pipe_dir)
    plain.load_lora_weights(ckpt)
    ours = StableDiffusion3Pipeline.from_pretrained(pipe_dir)
    lora = TINY["flow_grpo"]["model"]["lora"]
    setup_trainable(ours.transformer, use_lora=True, lora_rank=lora["rank"], lora_alpha=lora["alpha"],
                    lora_target_modules=lora["target_modules"])
    load_trainable(ours.transformer, ckpt)
    base = StableDiffusion3Pipeline.from_pretrained(pipe_dir)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([800.0, 100.0])
    text, pooled = torch.randn(2, 12, 32), torch.randn(2, 32)
    with torch.no_grad():
        outs = [p.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, pooled_projections=pooled,
                              return_dict=False)[0] for p in (plain, ours, base)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert (outs[0] - outs[2]).abs().max() > 1e-5


def test_flow_grpo_refuses_what_cannot_work(tmp_path):
    from diffrl.trainers import flow_grpo

    with pytest.raises(UserError, match="flow sampler"):
        load_cfg(_recipe(tmp_path, sample={"sampler": "ddim"}))
    with pytest.raises(UserError, match="kl_beta"):
        load_cfg(_recipe(tmp_path, train={"kl_beta": -1.0}))
    # a UNet pipeline: one line that names the trainer to use instead
    recipe = _recipe(tmp_path)
    recipe["model"]["pipeline"] = str(tiny_pipeline_dir(tmp_path))
    with pytest.raises(UserError, match="no UNet2DConditionModel module matched"):  # SD3's LoRA targets
        flow_grpo.train(load_cfg(recipe), tmp_path / "run")
    recipe["model"]["lora"] = {"rank": 2, "alpha": 2.0}  # the UNet's
    with pytest.raises(UserError, match="flow-matching pipelines .* use the ddpo or raft trainer"):
        flow_grpo.train(load_cfg(recipe), tmp_path / "run2")


def test_an_epoch_of_ties_trains_one_sample_per_micro_batch_as_the_reference_drops_them(tmp_path):
    """With a constant reward every advantage is 0: `drop_zero_advantage` trains one (topped-up) sample per
    micro-batch, 2 of the epoch's 4 here; without it all 4."""
    from diffrl.trainers import flow_grpo
    from diffrl.training.metrics import read_metrics

    fractions = {}
    for drop in (True, False):
        recipe = _recipe(tmp_path, reward={"name": "pg_helpers:constant"},
                         run={"num_epochs": 1, "save_every": 0, "eval_every": 0},
                         train={"drop_zero_advantage": drop})
        flow_grpo.train(load_cfg(recipe), tmp_path / f"run-{drop}")
        fractions[drop] = read_metrics(tmp_path / f"run-{drop}")[0]["trained_fraction"]
    assert fractions == {True: 0.5, False: 1.0}
