"""AWM (Advantage Weighted Matching): its loss worked by hand, the direction of its advantage weighting, the ratio clip,
the KL terms, the t schedule's range, and end-to-end runs on the tiny random SD3 pipeline and the embedded
tiny-shapes-flow recipe. Its parity with the reference code: test_awm_parity.py.

Registered: tests/trainers/test_contract.py checks its contract too (direction: `_fit_shift` below).
"""

import math

import pytest
import torch
from pg_helpers import AWM_TINY, load_cfg, tiny_pipeline_dir, tiny_recipe

from diffrl.errors import UserError
from diffrl.trainers.awm import (
    awm_loss,
    matching_log_prob,
    scaled_advantages,
)

# ---------------------------------------------------------------------------------------------------------------
# Worked by hand
# ---------------------------------------------------------------------------------------------------------------


def test_loss_worked_by_hand():
    """Two 1-element samples at t = ½: v = (1, 0), target 0, so ℓ = (1, 0); A = (1, −1).

    uniform: log p = −ℓ = (−1, 0); ρ = 1; L = mean(−A·ρ) = mean(−1, 1) = 0; ∂L/∂v_i = −A_i·∂log p_i/∂v_i / B
    = A_i·2(v_i − 0)/2 = (1, 0).
    ghuber (p = ¼): w(1, ½) = ½·((1 + 1e-10)^¼ − (1e-10)^¼)/¼ = 2·((1 + 1e-10)^¼ − 10^−2.5) = 1.99367544..., w(0, ½) = 0;
    ∂w/∂ℓ at 1 = ½·(1 + 1e-10)^−¾ ≈ ½, ∂ℓ/∂v = 2 → ∂L/∂v_0 = A_0·½·2/2 = ½."""
    v = torch.tensor([[1.0], [0.0]], dtype=torch.float64, requires_grad=True)
    target, sigma, a = torch.zeros(2, 1, dtype=torch.float64), torch.full((2,), 0.5, dtype=torch.float64), \
        torch.tensor([1.0, -1.0])
    lp = matching_log_prob(v, target, sigma, weighting="uniform")
    assert lp.tolist() == [-1.0, 0.0]
    loss, stats = awm_loss(v, target, sigma, a, weighting="uniform")
    assert float(loss.detach()) == 0.0 and float(stats["ratio"]) == 1.0 and float(stats["matching_loss"]) == 0.5
    loss.backward()
    assert v.grad[:, 0].tolist() == pytest.approx([1.0, 0.0])

    w = 2 * ((1 + 1e-10) ** 0.25 - 10 ** -2.5)  # (1 + 1e-10)^¼ = 1 + 2.5e-11
    lp = matching_log_prob(v.detach(), target, sigma, weighting="ghuber", ghuber_power=0.25)
    assert lp.tolist() == pytest.approx([-w, 0.0], abs=1e-12)
    assert w == pytest.approx(1.99367544472966, rel=1e-12)
    v.grad = None
    loss, _ = awm_loss(v, target, sigma, a, weighting="ghuber", ghuber_power=0.25)
    loss.backward()
    assert v.grad[0, 0].item() == pytest.approx(0.5, rel=1e-6)
    # the other weightings at ℓ = 1, t = ½: t·ℓ, t²·ℓ, t·(√(ℓ + 1e-10) − 1e-5)
    one = v.detach()[:1]
    for weighting, expected in [("t", 0.5), ("t2", 0.25), ("huber", 0.5 * (math.sqrt(1 + 1e-10) - 1e-5))]:
        got = matching_log_prob(one, target[:1], sigma[:1], weighting=weighting)
        assert got.item() == pytest.approx(-expected, rel=1e-12), weighting


def test_the_ratio_clip_by_hand():
    """A = 1 and log p − log p_old = log 2: ρ = 2 > 1 + c (c = ½), so L = max(−2, −1.5) = −1.5 with no gradient;
    with A = −1 the unclipped −A·ρ = 2 is the larger: L = 2 and the gradient flows."""
    v = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    target, sigma = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    old = matching_log_prob(v.detach(), target, sigma, weighting="uniform") - math.log(2.0)
    loss, stats = awm_loss(v, target, sigma, torch.tensor([1.0]), old_log_prob=old, weighting="uniform",
                           ratio_clip=0.5)
    assert float(loss.detach()) == pytest.approx(-1.5) and float(stats["clipfrac"]) == 1.0
    loss.backward()
    assert v.grad.abs().max().item() == 0.0
    v.grad = None
    loss, _ = awm_loss(v, target, sigma, torch.tensor([-1.0]), old_log_prob=old, weighting="uniform", ratio_clip=0.5)
    assert float(loss.detach()) == pytest.approx(2.0)
    loss.backward()
    # L = −A·ρ = ρ, ∂L/∂v = ρ·∂log p/∂v = 2·(−2·(v − 0)) = −4: descent moves v away from its target
    assert v.grad.item() == pytest.approx(-4.0)


def test_scaled_advantages_clip_then_scale():
    a = torch.tensor([7.0, -2.0, 0.5, -9.0])
    assert scaled_advantages(a, 5.0, 1.0).tolist() == pytest.approx([1.0, -0.4, 0.1, -1.0])
    assert scaled_advantages(a, 5.0, 0.0).tolist() == pytest.approx([5.0, -2.0, 0.5, -5.0])  # 0: clipped only


# ---------------------------------------------------------------------------------------------------------------
# Direction and KL
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["uniform", "ghuber"])
def test_a_positive_advantage_fits_its_sample_and_a_negative_one_pushes_it_away(weighting):
    """One gradient step on v: the matching error of the sample with A > 0 falls, that of A < 0 rises; the
    advantages negated, the other way round (the gradient is exactly negated)."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 4, generator=g, dtype=torch.float64)
    v0 = target + torch.randn(2, 4, generator=g, dtype=torch.float64)
    sigma = torch.full((2,), 0.7, dtype=torch.float64)

    def grad(a):
        v = v0.clone().requires_grad_(True)
        awm_loss(v, target, sigma, torch.tensor(a), weighting=weighting)[0].backward()
        return v.grad

    up, down = grad([1.0, -1.0]), grad([-1.0, 1.0])
    torch.testing.assert_close(up, -down)
    err = lambda v: ((v - target) ** 2).mean(1)
    after = err(v0 - 0.01 * up)
    assert after[0] < err(v0)[0] and after[1] > err(v0)[1]
    after = err(v0 - 0.01 * down)
    assert after[0] > err(v0)[0] and after[1] < err(v0)[1]
    # zero advantage: no gradient from the policy term
    assert grad([0.0, 0.0]).abs().max().item() == 0.0


def test_kl_terms_are_zero_when_the_policy_is_the_reference_and_the_ema():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(3, 2, 2, 2, generator=g)
    v = (target + torch.randn(3, 2, 2, 2, generator=g)).requires_grad_(True)
    sigma, a = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.3, -0.1, 0.0])
    plain, _ = awm_loss(v, target, sigma, a)
    loss, stats = awm_loss(v, target, sigma, a, v_ref=v.detach().clone(), v_ema=v.detach().clone(), kl_beta=0.5,
                           ema_kl_beta=2.0)
    assert float(stats["kl"]) == 0.0 and float(stats["ema_kl"]) == 0.0
    assert float(loss.detach()) == float(plain.detach())
    (g_kl,) = torch.autograd.grad(loss, v)
    (g_plain,) = torch.autograd.grad(plain, v)
    torch.testing.assert_close(g_kl, g_plain)
    # away from the reference the KL is mean (v − v_ref)² and pulls v towards it
    shifted = v.detach() + 0.5
    _, stats = awm_loss(v, target, sigma, a, v_ref=shifted, kl_beta=1.0)
    assert float(stats["kl"]) == pytest.approx(0.25)


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


def _recipe(tmp_path, **groups):
    base = {"run": {"num_epochs": 2, "save_every": 1, "eval_every": 0},
            "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2},
            "log": {"tracker": "none", "image_every": 0}}
    for group, values in [*AWM_TINY.items(), *groups.items()]:
        base[group] = {**base.get(group, {}), **values} if isinstance(values, dict) else values
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_awm_trains_its_lora_and_checkpoints_the_ema_policy(tmp_path):
    from diffrl.trainers import awm
    from diffrl.training.metrics import read_metrics

    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: (p.detach().clone(), p.requires_grad)
                                          for n, p in info["unet"].named_parameters()}

    run_dir = tmp_path / "run"
    awm.train(load_cfg(_recipe(tmp_path)), run_dir, step_callback=snapshot)
    assert sorted(snapshots) == [0, 1, 2, 3, 4]  # 2 optimizer steps per epoch
    before, after = snapshots[0], snapshots[4]
    trainable = [n for n, (_, grad) in before.items() if grad]
    assert trainable and all("lora" in n for n in trainable)
    assert not [n for n in trainable if torch.equal(before[n][0], after[n][0])]
    assert not [n for n, (value, grad) in before.items() if not grad and not torch.equal(value, after[n][0])]
    records = read_metrics(run_dir)
    for r in records:
        for key in ("loss", "policy_loss", "matching_loss", "kl", "ema_kl", "ratio", "clipfrac", "reward_mean"):
            assert key in r, key
    # the second micro-batch of each epoch comes after an optimizer step: its ratio is to the epoch-start weights
    assert records[0]["ratio"] != 1.0 and records[0]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert records[1]["ema_kl"] > 0  # θ left the EMA policy (d = min(0.001·2, 0.3): almost a copy, yet not θ)
    assert (run_dir / "checkpoints" / "step-4" / "ema_policy.safetensors").is_file()

    # resumed from the epoch-0 checkpoint, the second epoch ends with the same weights (EMA policy included)
    resumed = {}
    awm.train(load_cfg(_recipe(tmp_path, run={"resume": str(run_dir / "checkpoints" / "step-2")})),
              tmp_path / "resumed", resume=True,
              step_callback=lambda info: resumed.update({info["global_step"]: {
                  n: p.detach().clone() for n, p in info["unet"].named_parameters() if p.requires_grad}}))
    assert all(torch.equal(resumed[4][n], after[n][0]) for n in trainable)


def test_one_step_per_epoch_keeps_the_ratio_at_one(tmp_path):
    """With all micro-batches accumulated into one optimizer step (the published runs) ρ ≡ 1 and nothing clips."""
    from diffrl.trainers import awm
    from diffrl.training.metrics import read_metrics

    recipe = _recipe(tmp_path, run={"num_epochs": 1, "save_every": 0}, optim={"gradient_accumulation_steps": 2},
                     train={"ema_kl_beta": 0.0})
    awm.train(load_cfg(recipe), tmp_path / "run")
    record = read_metrics(tmp_path / "run")[0]
    assert record["ratio"] == 1.0 and record["clipfrac"] == 0.0
    assert record.get("ema_kl") is None  # no EMA term: not recorded (NaN, written as null)


def test_the_tiny_shapes_flow_recipe_trains_for_a_step(tmp_path):
    """The shipped recipe on the embedded tiny-shapes-flow, cut to one epoch of 8 samples at 2 t values each (one
    optimizer step, a few seconds): its LoRA moves."""
    from diffrl.config import load_recipe
    from diffrl.embedded import is_built
    from diffrl.trainers import awm

    if not is_built("tiny-shapes-flow"):
        pytest.skip("tiny-shapes-flow is not built (python -m diffrl.shapes.train flow)")
    cfg = load_recipe("awm/tiny_shapes_flow_verifier",
                      ["run.num_epochs=1", "run.eval_every=0", "run.save_every=0", "sample.batch_size=8",
                       "sample.num_batches_per_epoch=1", "log.tracker=none", "log.image_every=0",
                       f"run.output_dir={tmp_path}", "train.train_timesteps=2"])
    snapshots = {}
    awm.train(cfg, tmp_path / "run", step_callback=lambda info: snapshots.update({info["global_step"]: {
        n: p.detach().clone() for n, p in info["unet"].named_parameters() if p.requires_grad}}))
    assert sorted(snapshots) == [0, 1]
    assert snapshots[0] and all("lora" in n for n in snapshots[0])
    assert [n for n in snapshots[0] if not torch.equal(snapshots[0][n], snapshots[1][n])]


def test_awm_refuses_what_cannot_work(tmp_path):
    from diffrl.trainers import awm

    with pytest.raises(UserError, match="weighting"):
        load_cfg(_recipe(tmp_path, train={"weighting": "x0"}))
    with pytest.raises(UserError, match="ratio_clip"):
        load_cfg(_recipe(tmp_path, train={"ratio_clip": 0.0}))
    with pytest.raises(UserError, match="time_type"):
        load_cfg(_recipe(tmp_path, train={"time_type": "logit_normal"}))
    with pytest.raises(UserError, match="ema_decay_max"):
        load_cfg(_recipe(tmp_path, train={"ema_decay_max": 1.0}))
    with pytest.raises(UserError, match="full_finetune"):
        load_cfg(_recipe(tmp_path, model={"full_finetune": True}))
    recipe = _recipe(tmp_path)
    recipe["model"]["pipeline"] = str(tiny_pipeline_dir(tmp_path))
    recipe["model"]["lora"] = {"rank": 2, "alpha": 2.0}
    with pytest.raises(UserError, match="flow-matching pipelines .* use the ddpo or raft trainer"):
        awm.train(load_cfg(recipe), tmp_path / "run")


# ---------------------------------------------------------------------------------------------------------------
# The contract's direction check
# ---------------------------------------------------------------------------------------------------------------


def _fit_shift(tmp_path, sign: float) -> float:
    """After one optimizer step on the epoch's 8 samples: mean over its below-average-brightness samples of the change
    in their flow-matching error (fine-tuned minus pre-trained, at fixed σ and noise) minus the same over the
    above-average ones. With r it fits its brighter samples better (> 0), with −r its darker ones (< 0)."""
    from test_contract import _train_capturing_rollouts

    from diffrl.models.base import decode_latents
    from diffrl.training.weights import adapter_disabled
    from samplers.flow import FlowSampler

    captured, shift = [], {}
    recipe = _recipe(tmp_path, run={"num_epochs": 1, "save_every": 0},
                     sample={"batch_size": 8, "num_batches_per_epoch": 1},
                     reward={"name": "pg_helpers:signed_brightness", "kwargs": {"sign": sign}},
                     optim={"learning_rate": 1e-2}, advantage={"mode": "batch"},
                     train={"batch_size": 8, "timestep_fraction": 1.0, "ema_kl_beta": 0.0})

    def record(info):
        if info["global_step"] != 1:
            return
        pipe, traj = info["pipe"], captured[0]
        x0, text, pooled = traj.latents[:, -1], traj.prompt_embeds, traj.pooled_prompt_embeds
        # the schedule's first two σ (1 and 0.75), where the sample still matters, each with 4 fixed noise draws
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

    _train_capturing_rollouts("awm", load_cfg(recipe), tmp_path / f"run{sign}", record, captured)
    return shift["value"]
