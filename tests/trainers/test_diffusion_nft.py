"""DiffusionNFT end to end on the tiny random SD3 pipeline, through the shared run context.

Registered: tests/trainers/test_contract.py checks its contract too; these are its own checks.
"""

import pytest
import torch
from pg_helpers import NFT_TINY, load_cfg, tiny_pipeline_dir, tiny_recipe

from diffrl.errors import UserError


def _recipe(tmp_path, **groups):
    base = {"run": {"num_epochs": 2, "save_every": 1, "eval_every": 0},
            "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2},
            "log": {"tracker": "none", "image_every": 0}}
    for group, values in [*NFT_TINY.items(), *groups.items()]:
        base[group] = {**base.get(group, {}), **values} if isinstance(values, dict) else values
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_old_policy_swaps_in_and_soft_updates():
    from diffrl.trainers.diffusion_nft import OldPolicy

    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([[3.0]]))]
    old = OldPolicy(params)
    with torch.no_grad():
        params[0].add_(1.0)  # θ moves: [2, 3]
    seen = []
    with old.active(params):
        seen.append(params[0].detach().clone())
    assert seen[0].tolist() == [1.0, 2.0] and params[0].tolist() == [2.0, 3.0]  # old inside, θ restored after
    old.soft_update(params, 0.25)  # 0.25·old + 0.75·θ
    assert old.tensors()[0].tolist() == [1.75, 2.75] and old.tensors()[1].tolist() == [[3.0]]


def test_diffusion_nft_trains_its_lora_and_checkpoints_the_old_policy(tmp_path):
    from diffrl.trainers import diffusion_nft
    from diffrl.training.metrics import read_metrics

    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: (p.detach().clone(), p.requires_grad)
                                          for n, p in info["unet"].named_parameters()}

    run_dir = tmp_path / "run"
    diffusion_nft.train(load_cfg(_recipe(tmp_path)), run_dir, step_callback=snapshot)
    assert sorted(snapshots) == [0, 1, 2, 3, 4]
    before, after = snapshots[0], snapshots[4]
    trainable = [n for n, (_, grad) in before.items() if grad]
    assert trainable and all("lora" in n for n in trainable)
    assert not [n for n in trainable if torch.equal(before[n][0], after[n][0])]
    assert not [n for n, (value, grad) in before.items() if not grad and not torch.equal(value, after[n][0])]
    records = read_metrics(run_dir)
    for r in records:
        for key in ("loss", "positive_loss", "negative_loss", "old_deviation", "kl", "reward_mean"):
            assert key in r, key
    assert records[0]["old_deviation"] > 0  # v_θ leaves v_old within the epoch
    assert (run_dir / "checkpoints" / "step-4" / "old_policy.safetensors").is_file()

    # resumed from the epoch-0 checkpoint, the second epoch ends with the same weights (old policy included)
    resumed = {}
    diffusion_nft.train(load_cfg(_recipe(tmp_path, run={"resume": str(run_dir / "checkpoints" / "step-2")})),
                        tmp_path / "resumed", resume=True,
                        step_callback=lambda info: resumed.update({info["global_step"]: {
                            n: p.detach().clone() for n, p in info["unet"].named_parameters() if p.requires_grad}}))
    assert all(torch.equal(resumed[4][n], after[n][0]) for n in trainable)


def _fit_shift(tmp_path, sign: float) -> float:
    """After one epoch: mean over the epoch's below-average-brightness samples of the change in their flow-matching
    error (fine-tuned minus pre-trained, at fixed σ and noise) minus the same over the above-average ones."""
    from test_contract import _train_capturing_rollouts

    from diffrl.models.base import decode_latents
    from diffrl.training.weights import adapter_disabled
    from samplers.flow import FlowSampler

    captured, shift = [], {}
    recipe = _recipe(tmp_path, run={"num_epochs": 1, "save_every": 0},
                     sample={"batch_size": 8, "num_batches_per_epoch": 1},
                     reward={"name": "pg_helpers:signed_brightness", "kwargs": {"sign": sign}},
                     optim={"learning_rate": 1e-2}, advantage={"mode": "batch"},
                     train={"batch_size": 8, "timestep_fraction": 1.0})

    def record(info):
        if info["global_step"] != 1:
            return
        pipe, traj = info["pipe"], captured[0]
        x0, text, pooled = traj.latents[:, -1], traj.prompt_embeds, traj.pooled_prompt_embeds

        # the trained σ values where the sample still matters (the rollout schedule's first two: 1 and 0.75; at
        # the third, 0.009, the target is almost all noise), each with 4 fixed noise draws
        sigmas = FlowSampler().schedule(pipe, traj.num_steps, tuple(x0.shape[-2:])).sigmas[:2]

        def error():  # flow-matching (velocity) MSE per sample
            total = 0.0
            for k in range(8):
                sigma = sigmas[k % 2]
                noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(k))
                x_t = (1 - sigma) * x0 + sigma * noise
                v = pipe.transformer(hidden_states=x_t, timestep=torch.full((len(x0),), 1000 * sigma),
                                     encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)[0]
                total = total + (v - (noise - x0)).pow(2).flatten(1).mean(1)
            return total / 8

        with torch.no_grad():
            after = error()
            with adapter_disabled(pipe.transformer):
                before = error()
            brightness = decode_latents(pipe, x0).mean(dim=(1, 2, 3))
        delta, above = after - before, brightness > brightness.mean()
        shift["value"] = float(delta[~above].mean() - delta[above].mean())

    _train_capturing_rollouts("diffusion_nft", load_cfg(recipe), tmp_path / f"run{sign}", record, captured)
    return shift["value"]


def test_diffusion_nft_refuses_what_cannot_work(tmp_path):
    from diffrl.trainers import diffusion_nft

    with pytest.raises(UserError, match="train.beta must be > 0"):
        load_cfg(_recipe(tmp_path, train={"beta": 0.0}))
    with pytest.raises(UserError, match="weighting"):
        load_cfg(_recipe(tmp_path, train={"weighting": "x0"}))
    recipe = _recipe(tmp_path)
    recipe["model"]["pipeline"] = str(tiny_pipeline_dir(tmp_path))
    recipe["model"]["lora"] = {"rank": 2, "alpha": 2.0}
    with pytest.raises(UserError, match="flow-matching pipelines .* use the ddpo or raft trainer"):
        diffusion_nft.train(load_cfg(recipe), tmp_path / "run")
