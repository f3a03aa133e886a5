"""Flow-GRPO's conventions against numbers computed by the reference code (github.com/yifan123/flow_grpo).

`data/flow_grpo_reference.json` holds only numbers, with the commit and file each came from (its `source` entry):
`sde_step_with_logprob` (SDE and CPS) at 54809b5 (its SDE branch bit-identical at ac4c86e), `scripts/train_sd3.py`'s
`kl_loss` and `stat_tracking.PerPromptStatTracker` at ac4c86e, run once on fixed-seed float32 inputs (stored too):
x, v, v_ref `[2, 4, 4, 4]`, a `FlowMatchEulerDiscreteScheduler(shift=3.0)` with 10 steps, noise level a = 0.7, the
step noise of step i `torch.randn(shape, generator=torch.Generator().manual_seed(100 + i))`.

Checked: diffrl's flow step (sample, mean, std_dev_t, log-prob) equals the reference's; with `train.kl_convention:
reference` its KL equals `train_sd3.py`'s `kl_loss`; with `cps_log_prob="reference"` its CPS log-prob equals the
reference's; group advantages with `std_eps=1e-4` equal the stat tracker's. The other conventions are checked as the
documented conversions of those numbers, worked out here in float64: exact KL = reference KL / |Δt| on SDE steps
(same on CPS steps); Gaussian CPS log-prob = reference / (2·std²) − log std − ½ log 2π.

Tolerances (float32): step tensors and log-probs `RTOL` 1e-5 / `ATOL` 1e-6 (the same float32 formula with scalars
evaluated in another order: measured at most 2.4e-7 absolute on the tensors, 3e-7 relative on the log-probs); KLs
`KL_RTOL` 2e-5 relative (a squared difference of two float32 means whose gap is small, so their 1-ulp rounding shows
more: measured 3.5e-6); advantages 1e-9 (both in float64 from the same float32 rewards) and 1e-6 for the batch
normalisation the reference does in float32.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrl.config import load_recipe
from diffrl.errors import UserError
from diffrl.trainers.flow_grpo import FlowGRPOConfig, kl_std
from diffrl.training.advantages import STD_EPS, batch_advantages, group_advantages
from diffrl.training.reference import gaussian_kl
from samplers.flow import FlowSampler, FlowSchedule, sde_constants

GOLDEN = json.loads((Path(__file__).parent / "data" / "flow_grpo_reference.json").read_text())
SHAPE = (2, 4, 4, 4)
RTOL, ATOL, KL_RTOL = 1e-5, 1e-6, 2e-5
A = GOLDEN["noise_level"]
STEPS = len(GOLDEN["timesteps"])


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(SHAPE)


X, V, V_REF = (tensor(GOLDEN["inputs"][k]) for k in ("x", "v", "v_ref"))


@pytest.fixture(scope="module")
def schedule() -> FlowSchedule:
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = FlowMatchEulerDiscreteScheduler(shift=3.0).config
    sched = FlowSchedule.from_config(config, {"num_inference_steps": STEPS})
    assert list(sched.sigmas) == pytest.approx(GOLDEN["sigmas"], rel=1e-7)  # the reference's schedule
    return sched


def noise(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + i))


def close(actual, expected, rtol=RTOL, atol=ATOL) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def steps_of(sampler: FlowSampler, schedule, i: int, *, prev_sample=None):
    """The policy's step (drawn with the reference's noise, or scoring `prev_sample`) and the reference policy's
    step scoring the same x_σ', as `train_sd3.py` recomputes both."""
    t = schedule.timesteps[i]
    step = sampler.step(V, t, X, eta=A, noise=None if prev_sample is not None else noise(i), prev_sample=prev_sample,
                        schedule=schedule)
    step_ref = sampler.step(V_REF, t, X, eta=A, prev_sample=step.prev_sample, schedule=schedule)
    return step, step_ref


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_flow_step_is_the_references(schedule, sde_type):
    sampler = FlowSampler(sde_type=sde_type, cps_log_prob="reference")
    for i, ref in enumerate(GOLDEN[sde_type]):
        step, _ = steps_of(sampler, schedule, i)
        close(step.prev_sample, ref["prev_sample"])
        close(step.mean, ref["mean"])
        close(step.log_prob, ref["log_prob"])
        assert schedule.constants(i, A, sde_type).std_dev_t == pytest.approx(ref["std_dev_t"], rel=RTOL)
        # scoring the reference's x_σ' gives its log-prob too (the recomputation in training)
        scored, _ = steps_of(sampler, schedule, i, prev_sample=tensor(ref["prev_sample"]))
        close(scored.log_prob, ref["log_prob"])


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_reference_kl_is_train_sd3s_kl_loss(schedule, sde_type):
    sampler = FlowSampler(sde_type=sde_type)
    checked = 0
    for i, ref in enumerate(GOLDEN[sde_type]):
        step, step_ref = steps_of(sampler, schedule, i)
        sigma = kl_std(schedule.constants(i, A, sde_type), "reference")
        if ref["kl_loss"] is None:  # the reference divides by std_dev_t = 0 on CPS's last step (never trained)
            assert sde_type == "cps" and i == STEPS - 1 and sigma == 0
            continue
        kl = gaussian_kl(step.mean, step_ref.mean, sigma)
        close(kl, ref["kl_per_sample"], rtol=KL_RTOL, atol=0)
        assert float(kl.mean()) == pytest.approx(ref["kl_loss"], rel=KL_RTOL)
        checked += 1
    assert checked == (STEPS if sde_type == "sde" else STEPS - 1)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_exact_kl_is_the_reference_kl_over_dt_on_sde_steps(schedule, sde_type):
    sampler, sigmas = FlowSampler(sde_type=sde_type), GOLDEN["sigmas"]
    factors = []
    for i, ref in enumerate(GOLDEN[sde_type]):
        if ref["kl_loss"] is None:
            continue
        step, step_ref = steps_of(sampler, schedule, i)
        exact = gaussian_kl(step.mean, step_ref.mean, kl_std(schedule.constants(i, A, sde_type), "exact"))
        # worked out independently: the SDE step's variance is std_dev_t²·|Δt|, CPS's is std_dev_t²
        factor = 1.0 / (sigmas[i] - sigmas[i + 1]) if sde_type == "sde" else 1.0
        close(exact, [k * factor for k in ref["kl_per_sample"]], rtol=KL_RTOL, atol=0)
        factors.append(factor)
    if sde_type == "sde":  # the module docstring's numbers: 3.7–25× on steps 0–8, 112× on the last
        assert min(factors[:-1]) == pytest.approx(3.7, abs=0.05) and max(factors[:-1]) == pytest.approx(25, abs=0.2)
        assert factors[-1] == pytest.approx(112, abs=0.5)


def test_the_gaussian_cps_log_prob_is_the_reference_one_rescaled_plus_constants(schedule):
    sampler = FlowSampler(sde_type="cps", cps_log_prob="gaussian")
    scales = []
    for i, ref in enumerate(GOLDEN["cps"]):
        step, _ = steps_of(sampler, schedule, i, prev_sample=tensor(ref["prev_sample"]))
        std = ref["std_dev_t"]
        if std == 0:  # the last step is a point mass: both conventions give 0
            close(step.log_prob, ref["log_prob"])
            assert float(step.log_prob.abs().max()) == 0
            continue
        expected = [lp / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi) for lp in ref["log_prob"]]
        close(step.log_prob, expected, rtol=RTOL, atol=1e-5)
        scales.append(1 / (2 * std**2))
    # samplers/flow.py's docstring: the log-ratio scale is 0.68× on the first step, 7,900× on the ninth
    assert scales[0] == pytest.approx(0.68, abs=0.005) and scales[-1] == pytest.approx(7900, rel=0.01)


def test_the_sde_log_prob_does_not_depend_on_cps_log_prob(schedule):
    ref = GOLDEN["sde"][3]
    for convention in ("gaussian", "reference"):
        step, _ = steps_of(FlowSampler(sde_type="sde", cps_log_prob=convention), schedule, 3)
        close(step.log_prob, ref["log_prob"])


def test_group_advantages_with_std_eps_1e4_are_the_stat_trackers():
    adv = GOLDEN["advantages"]
    rewards = np.array(adv["rewards_float32"])
    groups = np.array([{"a": 0, "b": 1}[p] for p in adv["prompts"]])
    np.testing.assert_allclose(group_advantages(rewards, groups, std="group", std_eps=1e-4), adv["group_group_std"],
                               rtol=1e-9)
    np.testing.assert_allclose(group_advantages(rewards, groups, std="global", std_eps=1e-4),
                               adv["group_global_std"], rtol=1e-9)
    np.testing.assert_allclose(batch_advantages(rewards, std_eps=1e-4), adv["batch"], rtol=1e-6)
    # diffrl's default ε differs visibly on a low-variance group (std ≈ 0.005 here)
    default = group_advantages(rewards, groups, std="group", std_eps=STD_EPS)
    assert np.abs(default / np.array(adv["group_group_std"]) - 1).max() > 0.015
    assert (0.005 + 1e-4) / (0.005 + 1e-6) == pytest.approx(1.02, abs=0.001)  # config.py's "2 %"


def test_recipes_claiming_published_settings_use_the_references_conventions():
    assert FlowGRPOConfig().kl_convention == "reference" and FlowGRPOConfig().cps_log_prob == "reference"
    for name in ("flow_grpo/sd35m_pickscore", "flow_grpo/flux_dev_pickscore", "flow_grpo/tiny_shapes_flow_verifier"):
        cfg = load_recipe(name)
        assert cfg.train.kl_convention == "reference" and cfg.advantage.std_eps == 1e-4, name
    exact = load_recipe("flow_grpo/tiny_shapes_flow_verifier", ["train.kl_convention=exact",
                                                                "train.cps_log_prob=gaussian"])
    assert exact.train.kl_convention == "exact" and exact.train.cps_log_prob == "gaussian"
    with pytest.raises(UserError, match="kl_convention"):
        load_recipe("flow_grpo/tiny_shapes_flow_verifier", ["train.kl_convention=paper"])
    with pytest.raises(UserError, match="std_eps"):
        load_recipe("flow_grpo/tiny_shapes_flow_verifier", ["advantage.std_eps=0"])
    with pytest.raises(UserError, match="cps_log_prob"):
        FlowSampler(sde_type="cps", cps_log_prob="scaled")


@pytest.mark.parametrize("kl_convention", ["reference", "exact"])
def test_the_trainer_uses_its_settings_on_cps_rollouts(tmp_path, monkeypatch, kl_convention):
    """Wiring: `train.cps_log_prob` reaches the sampler before the rollout, and the KL divides by `kl_std` of
    `train.kl_convention` (spied on `step_kl_to_reference`); with the flow SDE step `std_dev_t = std / √|Δt|`."""
    from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

    from diffrl.trainers import flow_grpo

    seen = []
    original = flow_grpo.step_kl_to_reference

    def spy(pipe, sampler, traj, step_index, *, kl_std=None):
        step, kl = original(pipe, sampler, traj, step_index, kl_std=kl_std)
        c = sampler.step_constants(pipe, traj, step_index)
        seen.append((sampler.cps_log_prob, kl_std, c))
        squared = ((step.prev_sample - step.mean) ** 2).flatten(1).mean(dim=1)  # the reference scale's log-prob
        if c.std > 0:
            torch.testing.assert_close(step.log_prob, -squared)
        return step, kl

    monkeypatch.setattr(flow_grpo, "step_kl_to_reference", spy)
    groups = with_trainer({"run": {"num_epochs": 1, "save_every": 0, "eval_every": 0},
                           "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 1,
                                      "eval_num_images": 2, "sampler": "flow_cps"},
                           "log": {"tracker": "none", "image_every": 0, "grid_images": 2}}, "flow_grpo")
    groups["train"] = {**groups.get("train", {}), "kl_convention": kl_convention, "cps_log_prob": "reference",
                       "kl_beta": 0.04}
    flow_grpo.train(load_cfg(tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **groups)), tmp_path / "run")
    assert seen and all(convention == "reference" for convention, _, _ in seen)
    for _, sigma, c in seen:
        assert sigma == (c.std if kl_convention == "exact" else c.std_dev_t) == c.std  # CPS: the same σ
    c = sde_constants(0.8, 0.6, 0.7)  # an SDE step: the reference divides by the std per √|Δt|
    assert kl_std(c, "reference") == pytest.approx(c.std / math.sqrt(0.8 - 0.6), rel=1e-6)
    assert kl_std(c, "exact") == c.std


# ---------------------------------------------------------------------------------------------------------------
# The training loop as scripts/train_sd3.py runs it (ac4c86e): grouping, zero-advantage filter, steps, CFG gradient
# ---------------------------------------------------------------------------------------------------------------


def _rollout(prompts, rewards, draws):
    from diffrl.training.rollout import Rollout

    return Rollout(traj=None, images=torch.empty(0), rewards=torch.as_tensor(rewards, dtype=torch.float64),
                   all_rewards=np.asarray(rewards, dtype=np.float64), all_prompts=list(prompts),
                   all_groups=np.asarray(draws))


@pytest.mark.parametrize("std", ["group", "global"])
def test_groups_by_prompt_text_across_the_epoch_as_the_stat_tracker(std):
    """Five draws of two samples (prompts a, b, a, b, c): the reference's tracker pools each prompt's draws."""
    from diffrl.training.rollout import compute_advantages

    ref = GOLDEN["advantages"]["interleaved"]
    rollout = _rollout(ref["prompts"], ref["rewards_float32"], [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    adv = compute_advantages(rollout, mode="group", stat_tracker=None, group_std=std, adv_clip_max=5.0,
                             std_eps=1e-4, group_by="prompt")
    np.testing.assert_allclose(adv, ref[f"{std}_std"], rtol=1e-9, atol=1e-12)
    per_draw = compute_advantages(rollout, mode="group", stat_tracker=None, group_std=std, adv_clip_max=5.0,
                                  std_eps=1e-4, group_by="draw")
    assert not np.allclose(per_draw, ref[f"{std}_std"], rtol=0.05)  # each draw's own mean: 8-17 % off here
    assert load_recipe("flow_grpo/tiny_shapes_flow_verifier").advantage.group_by == "prompt"


def test_zero_advantage_samples_are_left_out_and_topped_up_to_the_micro_batches():
    from diffrl.trainers.flow_grpo import train_samples

    adv = np.array(GOLDEN["advantages"]["interleaved"]["global_std"])  # samples 8 and 9 (prompt c) tie: 0
    valid = np.ones(10, dtype=bool)
    rng = np.random.default_rng(0)
    assert train_samples(adv, valid, 2, rng, True).tolist() == list(range(8))  # 8 kept, 2 micro-batches of 4
    three = train_samples(adv, valid, 3, rng, True)  # 8 kept, one of the two ties put back: 3 micro-batches of 3
    assert len(three) == 9 and set(range(8)) <= set(three.tolist())
    assert train_samples(adv, valid, 2, rng, False).tolist() == list(range(10))
    invalid = valid.copy()
    invalid[0] = False  # a non-finite reward (advantage 0 there anyway) is not trained either
    assert 0 not in train_samples(adv, invalid, 1, rng, True).tolist()
    ties = train_samples(np.zeros(10), valid, 2, rng, True)  # nothing to learn from: one sample per micro-batch
    assert len(ties) == 2


def test_trains_the_first_steps_in_order_as_the_reference():
    from diffrl.trainers.flow_grpo import trained_steps
    from diffrl.training.setup import num_train_timesteps

    n = num_train_timesteps(10, 0.99)  # train_sd3.py: int(num_steps * timestep_fraction) = 9, steps 0..8
    assert trained_steps(np.arange(10), n, "first", np.random.default_rng(0)) == list(range(9))
    assert trained_steps(np.arange(3, 5), 2, "first", np.random.default_rng(0)) == [3, 4]  # an SDE window
    drawn = trained_steps(np.arange(10), n, "random", np.random.default_rng(0))
    assert sorted(drawn) != drawn and len(set(drawn)) == 9
    assert FlowGRPOConfig().timestep_selection == "first" and FlowGRPOConfig().drop_zero_advantage


@pytest.mark.parametrize("mode", ["conditional", "both"])
def test_cfg_gradient_flows_through_the_branches_it_names(tmp_path, mode):
    """The gradient of a recomputed guided step's log-prob equals the one formed from separate transformer calls,
    v = v_u + s·(v_c − v_u), with v_u a constant (`conditional`, train_sd3.py's `noise_pred_uncond.detach()`) or
    differentiated too (`both`); the log-prob itself is the same."""
    from diffrl.models.base import Conditioning
    from samplers.testing import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline(tmp_path / "sd3", t5=False)
    scale = 4.5
    sampler = FlowSampler(cfg_gradient=mode)
    with torch.no_grad():
        traj = sampler.sample(pipe, ["a red circle", "a blue square"], num_steps=3, guidance_scale=scale, eta=0.7,
                              seeds=[0, 1])
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]

    def grads(log_prob):
        return torch.cat([g.flatten() for g in torch.autograd.grad(log_prob.sum(), params, allow_unused=False)])

    step_index = 1
    got = sampler.log_prob(pipe, traj, step_index)
    cond = Conditioning.from_trajectory(traj)
    x, t = traj.latents[:, step_index], traj.timesteps[step_index]

    def velocity(embeds, pooled):
        return pipe.transformer(hidden_states=x, timestep=t.expand(len(x)), encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False)[0]

    v_c = velocity(cond.prompt_embeds, cond.pooled_prompt_embeds)
    v_u = velocity(cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds)
    if mode == "conditional":
        v_u = v_u.detach()
    schedule = sampler.schedule(pipe, traj.num_steps, tuple(x.shape[-2:]))
    expected = sampler.step(v_u + scale * (v_c - v_u), t, x, eta=0.7, prev_sample=traj.latents[:, step_index + 1],
                            schedule=schedule).log_prob
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    got_grad = grads(got)
    torch.testing.assert_close(got_grad, grads(expected), rtol=1e-4, atol=1e-6)
    other = FlowSampler(cfg_gradient="both" if mode == "conditional" else "conditional").log_prob(pipe, traj,
                                                                                              step_index)
    torch.testing.assert_close(other, got)  # same value, other gradient
    assert (grads(other) - got_grad).norm() > 0.1 * got_grad.norm()
    with pytest.raises(UserError, match="cfg_gradient"):
        FlowSampler(cfg_gradient="uncond")


@pytest.mark.parametrize("mode", ["conditional", "both"])
def test_conditional_cfg_gradient_runs_the_unconditional_branch_without_a_graph_in_rollout_and_recompute(tmp_path,
                                                                                                        mode):
    """With `cfg_gradient: conditional` the rollout and the recomputed step make the same two transformer calls
    (unconditional without a graph, then conditional), so the recomputed log-prob equals the rollout's bit for bit
    and the backward covers only the conditional half; `both` keeps one batched call of 2B rows with a graph."""
    from samplers.testing import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline(tmp_path / "sd3", t5=False)
    calls = []
    pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((kwargs["hidden_states"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True)
    sampler = FlowSampler(cfg_gradient=mode)
    with torch.no_grad():
        traj = sampler.sample(pipe, ["a red circle", "a blue square"], num_steps=3, guidance_scale=4.5, eta=0.7,
                              seeds=[0, 1])
    rollout_calls, calls[:] = list(calls), []
    got = sampler.log_prob(pipe, traj, 1)
    if mode == "conditional":
        assert rollout_calls == [(2, False), (2, False)] * 3
        assert calls == [(2, False), (2, True)]
    else:
        assert rollout_calls == [(4, False)] * 3
        assert calls == [(4, True)]
    assert torch.equal(got.detach(), traj.log_probs[:, 1])  # ratio exactly 1 before any update
