"""DiffusionNFT's conventions against numbers computed by the reference code (github.com/NVlabs/DiffusionNFT).

`data/diffusion_nft_reference.json` holds only numbers, with the commit and file each came from (its `source` entry),
all at 24af555: the training loop's loss lines of `scripts/train_nft_sd3.py` (advantage clamp → r, implicit positive
and negative predictions, adaptive x0-space weighting, policy loss, KL term) run as they are on fixed-seed inputs
(stored too: x0, noise, v_θ, v_old, v_ref `[6, 2, 4, 4]`, t, advantages) with β = 1 and β = 0.1, in float64 and
float32, and the gradient of its policy loss and total loss w.r.t. v_θ; `return_decay` for decay types 0, 1, 2 at 15
steps; `flow_grpo/stat_tracking.PerPromptStatTracker` (the reference's own copy) on float32 rewards, and its published
config values.

Checked: `nft_loss` (adaptive) + `velocity_kl` give the reference's loss and gradient; `implicit_policies` its v⁺ and
v⁻; `optimality_probability` its r; `group_advantages` with `std="global"` and `std_eps=1e-4` its stat tracker (the
default `sample.global_std = True`); `old_policy_decay` with `OLD_DECAY_TYPES` its `return_decay`; the config and
recipe defaults its published settings. The deliberate difference, `weighting="velocity"` (the paper's plain
objective), is checked as the documented conversion of the reference's v^±, worked out here in float64.

Tolerances, measured: float64 runs 1e-12 relative (the same formula; the reference divides each element by w before
the mean where `nft_loss` divides the mean: measured at most 1.1e-16, the gradients bit-equal); float32 runs 1e-6
relative on the losses and 1e-5 relative + 1e-7 absolute on the gradients (the reference divides by a float64 w, so
its losses are float64 and `nft_loss`'s float32: measured 4e-8 on the losses, 1.5e-8 absolute on the gradients, one
float32 ulp at their largest entry, 0.2); advantages 1e-12 relative (both float64 from the same float32 rewards:
measured 2.2e-16) and 1e-6 absolute for the reference's batch branch, which normalises in float32 (measured 2.7e-7,
a few float32 ulps of advantages up to 1.8); r 1e-15 (measured 0); decay values exactly equal.

The reference's training loop writes `loss = policy_loss; loss += β_KL·KL`, so the tensor it logs as `policy_loss`
is the total loss (stored as `logged_policy_loss`); the stored `policy_loss` and its gradient are the same lines run
with the KL weight 0.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrl.config import load_recipe
from diffrl.errors import UserError
from diffrl.trainers import diffusion_nft
from diffrl.trainers.diffusion_nft import (
    ADVANTAGE_DEFAULTS,
    OLD_DECAY_TYPES,
    OPTIM_DEFAULTS,
    DiffusionNFTConfig,
    implicit_policies,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    velocity_kl,
)
from diffrl.training.advantages import batch_advantages, group_advantages

GOLDEN = json.loads((Path(__file__).parent / "data" / "diffusion_nft_reference.json").read_text())
SHAPE = tuple(GOLDEN["shape"])
DTYPES = {"float64": torch.float64, "float32": torch.float32}
RTOL = {"float64": 1e-12, "float32": 1e-6}  # on the losses
GRAD_TOL = {"float64": (1e-12, 1e-15), "float32": (1e-5, 1e-7)}  # (rtol, atol) on the gradients


def inputs(dtype: torch.dtype) -> dict:
    raw = GOLDEN["inputs"]
    out = {k: torch.tensor(raw[k], dtype=dtype).reshape(SHAPE) for k in ("x0", "noise", "v_theta", "v_old", "v_ref")}
    out["t"] = torch.tensor(raw["t"], dtype=dtype)
    out["advantages"] = torch.tensor(raw["advantages"], dtype=torch.float64)  # the reference's are float64
    return out


def close(actual, expected, rtol, atol=0.0) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.detach().double(), expected, rtol=rtol, atol=atol)


def diffrl_loss(ref: dict):
    """diffrl's loss on the reference run's inputs: (r, policy loss, KL per sample, total loss, stats, v_θ)."""
    x = inputs(DTYPES[ref["dtype"]])
    v_theta = x["v_theta"].clone().requires_grad_(True)
    r = optimality_probability(x["advantages"], ref["adv_clip_max"])
    policy_loss, stats = nft_loss(v_theta, x["v_old"], x["x0"], x["noise"], x["t"], r, beta=ref["beta"],
                                  weighting="adaptive", clip_max=ref["adv_clip_max"])
    kl = velocity_kl(v_theta, x["v_ref"])
    return r, policy_loss, kl, policy_loss + ref["kl_beta"] * kl.mean(), stats, v_theta


def value(x: torch.Tensor) -> float:
    return float(x.detach())


@pytest.mark.parametrize("run", sorted(GOLDEN["loss"]))
def test_the_loss_and_its_gradient_are_the_references(run):
    ref = GOLDEN["loss"][run]
    rtol = RTOL[ref["dtype"]]
    r, policy_loss, kl, loss, stats, v_theta = diffrl_loss(ref)
    close(r, ref["r"], rtol=1e-15)
    assert value(policy_loss) == pytest.approx(ref["policy_loss"], rel=rtol)
    assert value(kl.mean()) == pytest.approx(ref["kl_div_loss"], rel=rtol)
    close(kl, ref["kl_per_sample"], rtol=rtol)
    assert value(loss) == pytest.approx(ref["loss"], rel=rtol)
    assert float(stats["positive_loss"]) == pytest.approx(np.mean(ref["positive_loss"]), rel=rtol)
    assert float(stats["negative_loss"]) == pytest.approx(np.mean(ref["negative_loss"]), rel=rtol)
    grad_rtol, grad_atol = GRAD_TOL[ref["dtype"]]
    (grad_policy,) = torch.autograd.grad(policy_loss, v_theta, retain_graph=True)
    close(grad_policy, ref["grad_policy_loss"], rtol=grad_rtol, atol=grad_atol)
    (grad,) = torch.autograd.grad(loss, v_theta)
    close(grad, ref["grad_loss"], rtol=grad_rtol, atol=grad_atol)


@pytest.mark.parametrize("run", ["beta_1_float64", "beta_0.1_float64"])
def test_the_implicit_policies_are_the_references(run):
    ref, x = GOLDEN["loss"][run], inputs(torch.float64)
    positive, negative = implicit_policies(x["v_theta"], x["v_old"], ref["beta"])
    close(positive, ref["positive_prediction"], rtol=1e-12, atol=1e-15)
    close(negative, ref["negative_prediction"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("run", ["beta_1_float64", "beta_0.1_float64"])
def test_velocity_weighting_is_the_papers_objective_on_the_references_policies(run):
    """The documented conversion: the reference's adaptive per-sample error is t·mean((v^± − v)²)/mean|v^± − v|
    (x0-space error t²·(v^± − v)² over w = t·mean|v^± − v|), and `weighting="velocity"` drops the x0 space, w and
    A_max/β: r·mean((v⁺ − v)²) + (1 − r)·mean((v⁻ − v)²) on the same v^±."""
    ref, x = GOLDEN["loss"][run], inputs(torch.float64)
    target = (x["noise"] - x["x0"]).flatten(1)
    t, r = x["t"], torch.tensor(ref["r"], dtype=torch.float64)
    errors = {}
    for name in ("positive", "negative"):
        error = torch.tensor(ref[f"{name}_prediction"], dtype=torch.float64).reshape(SHAPE).flatten(1) - target
        errors[name] = (error**2).mean(1)
        close(t * errors[name] / error.abs().mean(1), ref[f"{name}_loss"], rtol=1e-12)
    expected = (r * errors["positive"] + (1 - r) * errors["negative"]).mean()
    loss, _ = nft_loss(x["v_theta"], x["v_old"], x["x0"], x["noise"], x["t"], r, beta=ref["beta"],
                       weighting="velocity")
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)
    # and the adaptive loss is that per-sample split in x0 space, scaled by A_max/β
    positive_loss, negative_loss = (torch.tensor(ref[k], dtype=torch.float64) for k in ("positive_loss", "negative_loss"))
    adaptive = (r * positive_loss + (1 - r) * negative_loss).mean()
    assert float(adaptive) * ref["adv_clip_max"] / ref["beta"] == pytest.approx(ref["policy_loss"], rel=1e-12)


def test_optimality_from_rewards_is_the_stat_trackers_with_global_std_and_eps_1e4():
    adv = GOLDEN["advantages"]
    rewards = np.array(adv["rewards_float32"])
    groups = np.array([{"a": 0, "b": 1, "c": 2}[p] for p in adv["prompts"]])
    eps = ADVANTAGE_DEFAULTS["std_eps"]
    assert eps == 1e-4 and ADVANTAGE_DEFAULTS["group_std"] == "global" and ADVANTAGE_DEFAULTS["mode"] == "group"
    advantages = group_advantages(rewards, groups, std=ADVANTAGE_DEFAULTS["group_std"], std_eps=eps)
    np.testing.assert_allclose(advantages, adv["per_prompt_global_std_true"], rtol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards, groups, std="group", std_eps=eps),
                               adv["per_prompt_global_std_false"], rtol=1e-12)
    np.testing.assert_allclose(batch_advantages(rewards, std_eps=eps), adv["batch_float32"], rtol=0, atol=1e-6)
    r = optimality_probability(torch.from_numpy(advantages), DiffusionNFTConfig().adv_clip_max)
    close(r, adv["r_per_prompt_global_std_true"], rtol=1e-15)


@pytest.mark.parametrize("decay_type", [0, 1, 2])
def test_old_policy_decay_is_return_decay(decay_type):
    settings = OLD_DECAY_TYPES[decay_type]
    values = [old_policy_decay(step, settings["old_decay_rate"], settings["old_decay_max"], settings["old_decay_flat"])
              for step in GOLDEN["decay"]["steps"]]
    assert values == GOLDEN["decay"][f"type_{decay_type}"]


def test_defaults_and_recipes_are_the_published_settings():
    published, defaults = GOLDEN["config"], DiffusionNFTConfig()
    assert (defaults.beta, defaults.kl_beta, defaults.adv_clip_max, defaults.timestep_fraction) == (
        published["beta"], published["kl_beta"], published["adv_clip_max"], published["timestep_fraction"])
    decay = {k: getattr(defaults, k) for k in ("old_decay_flat", "old_decay_rate", "old_decay_max")}
    assert decay == OLD_DECAY_TYPES[published["decay_type"]]
    assert (OPTIM_DEFAULTS["learning_rate"], OPTIM_DEFAULTS["weight_decay"], OPTIM_DEFAULTS["max_grad_norm"]) == (
        published["learning_rate"], published["adam_weight_decay"], published["max_grad_norm"])
    for name in ("diffusion_nft/sd35m_pickscore", "diffusion_nft/tiny_shapes_flow_verifier"):
        cfg = load_recipe(name)
        assert cfg.advantage.std_eps == 1e-4 and cfg.advantage.group_std == "global", name
        assert {k: getattr(cfg.train, k) for k in decay} == decay, name
    cfg = load_recipe("diffusion_nft/sd35m_pickscore")
    assert (cfg.sample.num_steps, cfg.sample.guidance_scale, cfg.advantage.group_size, cfg.train.beta) == (
        published["num_steps"], published["guidance_scale"], published["num_image_per_prompt"], published["beta"])


def test_every_decay_type_is_a_setting_and_bad_values_fail_in_one_line():
    ocr = OLD_DECAY_TYPES[GOLDEN["config"]["decay_type_ocr"]]
    cfg = load_recipe("diffusion_nft/tiny_shapes_flow_verifier", [f"train.{k}={v}" for k, v in ocr.items()])
    assert (cfg.train.old_decay_flat, cfg.train.old_decay_rate, cfg.train.old_decay_max) == (75, 0.0075, 0.999)
    for override, match in (("train.old_decay_flat=-1", "train.old_decay_flat must be >= 0"),
                            ("train.old_decay_rate=-0.001", "train.old_decay_rate must be a finite number >= 0"),
                            ("train.old_decay_rate=.inf", "train.old_decay_rate must be a finite number"),
                            ("train.old_decay_max=1.0", r"train.old_decay_max must be in \[0, 1\)"),
                            ("train.old_decay_max=-0.5", r"train.old_decay_max must be in \[0, 1\)")):
        with pytest.raises(UserError, match=match) as error:
            load_recipe("diffusion_nft/tiny_shapes_flow_verifier", [override])
        assert "\n" not in str(error.value), override
    with pytest.raises(UserError, match="old_decay_flat"):
        load_recipe("diffusion_nft/tiny_shapes_flow_verifier", ["train.old_decay_flat=7.5"])
    with pytest.raises(UserError, match="old_decay_type"):  # not a key: the three numbers are
        load_recipe("diffusion_nft/tiny_shapes_flow_verifier", ["train.old_decay_type=2"])


def test_the_trainer_uses_the_decay_settings_and_std_eps(tmp_path, monkeypatch):
    """Wiring: after each epoch the sampling policy's decay is `old_policy_decay` of the optimizer steps so far with
    the recipe's flat/rate/max, and the advantages get `advantage.std_eps`."""
    from pg_helpers import NFT_TINY, load_cfg, tiny_pipeline_dir, tiny_recipe

    from diffrl.training import rollout

    decays, eps = [], []
    original_decay, original_advantages = diffusion_nft.old_policy_decay, rollout.compute_advantages

    def decay_spy(step, rate, maximum, flat=0):
        decays.append((step, rate, maximum, flat))
        return original_decay(step, rate, maximum, flat)

    def advantages_spy(*args, **kwargs):
        eps.append(kwargs.get("std_eps"))
        return original_advantages(*args, **kwargs)

    monkeypatch.setattr(diffusion_nft, "old_policy_decay", decay_spy)
    monkeypatch.setattr(rollout, "compute_advantages", advantages_spy)
    groups = {"run": {"num_epochs": 2, "save_every": 0, "eval_every": 0},
              "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 1, "eval_num_images": 2},
              "log": {"tracker": "none", "image_every": 0, "grid_images": 2}}
    for group, values in NFT_TINY.items():
        groups[group] = {**groups.get(group, {}), **values} if isinstance(values, dict) else values
    groups["train"] = {**groups["train"], "old_decay_flat": 1, "old_decay_rate": 0.25, "old_decay_max": 0.3}
    groups["advantage"] = {**groups["advantage"], "std_eps": 3e-4}
    diffusion_nft.train(load_cfg(tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **groups)), tmp_path / "run")
    assert decays == [(1, 0.25, 0.3, 1), (2, 0.25, 0.3, 1)]  # one optimizer step per epoch
    assert [original_decay(*d[:3], d[3]) for d in decays] == [0.0, 0.25]
    assert eps == [3e-4, 3e-4]


def test_each_sample_trains_its_own_sigmas_as_the_references_per_sample_permutation():
    """train_nft_sd3.py permutes the T timesteps per sample and trains the first int(T · 0.99) columns: each sample
    gets distinct σ's of its own. `per_batch` (diffrl's earlier choice) shares one draw across the micro-batch."""
    rng = np.random.default_rng(0)
    own = diffusion_nft.sigma_indices(6, 10, 9, "per_sample", rng)
    assert own.shape == (6, 9) and all(len(set(row)) == 9 and set(row) <= set(range(10)) for row in own.tolist())
    assert len({tuple(row) for row in own.tolist()}) > 1  # 6 rows drawn alike by chance: p = (10!)^-5
    shared = diffusion_nft.sigma_indices(6, 10, 9, "per_batch", rng)
    assert len({tuple(row) for row in shared.tolist()}) == 1 and len(set(shared[0].tolist())) == 9
    cfg = load_recipe("diffusion_nft/tiny_shapes_flow_verifier")
    assert cfg.train.timestep_selection == "per_sample" and cfg.advantage.group_by == "prompt"
    with pytest.raises(UserError, match="timestep_selection"):
        load_recipe("diffusion_nft/tiny_shapes_flow_verifier", ["train.timestep_selection=first"])
