"""AWM's loss and t schedule against the reference code: scxue/advantage_weighted_matching at be51372
(be5137232e33a21b449ed65a533211d0deb97ed8), advantage_weighted_matching/scripts/train_sd3_awm.py.

The numbers in tests/trainers/data/awm_reference.json were computed once, in a scratch folder outside this repo, by
running the reference's own `compute_log_prob_awm` and the loss lines of its training loop (`exp_first`, kl_weight
and kl_ema_weight `Uniform`, beta 0.1, ema_beta 1, adv_clip_max 5, advantage_max 1; clip_range 1 on-policy and 0.002
with log p_old from another velocity) on the file's small fixed tensors, with a stand-in transformer that returns
v_theta, and its `discrete` / `discrete_wo_init` t-index lines with fixed uniforms. No reference code is copied
here; only the numbers are stored.

Checked: `matching_log_prob` for the five weightings; the mean over t of `awm_loss` (one backward per t, as
`awm_update`) and its gradient w.r.t. v_θ against the reference's loss over T·B, its policy, KL and EMA-KL parts;
`timestep_indices` against the reference's strata.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrl.trainers.awm import awm_loss, matching_log_prob, scaled_advantages, timestep_indices

REFERENCE = json.loads((Path(__file__).parent / "data" / "awm_reference.json").read_text())
NAMES = {"Uniform": "uniform", "t": "t", "t**2": "t2", "huber": "huber", "ghuber": "ghuber"}  # reference → ours


def _reference_inputs():
    d = REFERENCE
    t = lambda key: torch.tensor(d[key], dtype=torch.float64)
    T, B = d["T"], d["B"]
    x0 = t("x0")
    clean = torch.cat([x0] * T)
    sigma = torch.tensor(d["sigma"], dtype=torch.float64).repeat_interleave(B)
    return T, B, clean, t("noise"), sigma, t("v_theta"), t("v_ref"), t("v_ema"), t("v_old"), t("advantages_raw")


# ---------------------------------------------------------------------------------------------------------------
# The loss against the reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", list(NAMES))
def test_matching_log_prob_is_the_reference_compute_log_prob_awm(weighting):
    _, _, clean, noise, sigma, v_theta, *_ = _reference_inputs()
    ours = matching_log_prob(v_theta, noise - clean, sigma, weighting=NAMES[weighting], ghuber_power=0.25)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, torch.tensor(REFERENCE["log_prob"][weighting], dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", ["on_policy_clip1", "off_policy_clip0.002"])
def test_loss_and_gradient_are_the_reference_training_loop(case):
    """The reference's loss over T·B (per-t ratio, `exp_first`) equals the mean over t of `awm_loss` on each t's
    batch, as `awm_update` backpropagates it (one backward per t, divided by T), and so does the gradient w.r.t.
    v_θ. The off-policy case has log p_old from another velocity and a clip of 0.002, so some ratios are clipped."""
    ref = REFERENCE["loss"][case]
    T, B, clean, noise, sigma, v_theta, v_ref, v_ema, v_old, adv_raw = _reference_inputs()
    target = noise - clean
    advantages = scaled_advantages(adv_raw, 5.0, 1.0)
    v = v_theta.clone().requires_grad_(True)
    total, parts = 0.0, {"policy_loss": 0.0, "kl": 0.0, "ema_kl": 0.0}
    for k in range(T):
        rows = slice(k * B, (k + 1) * B)
        old = None
        if ref["old_from_v_old"]:
            old = matching_log_prob(v_old[rows], target[rows], sigma[rows], weighting="ghuber", ghuber_power=0.25)
        loss, stats = awm_loss(v[rows], target[rows], sigma[rows], advantages, old_log_prob=old, v_ref=v_ref[rows],
                               v_ema=v_ema[rows], weighting="ghuber", ghuber_power=0.25,
                               ratio_clip=ref["clip_range"], kl_beta=0.1, ema_kl_beta=1.0)
        (loss / T).backward()
        total += float(loss.detach()) / T
        for key in parts:
            parts[key] += float(stats[key]) / T
    assert total == pytest.approx(ref["loss"], rel=1e-10, abs=1e-12)
    assert parts["policy_loss"] == pytest.approx(ref["policy_loss"], rel=1e-10, abs=1e-12)
    assert parts["kl"] == pytest.approx(ref["kl_loss"], rel=1e-10)
    assert parts["ema_kl"] == pytest.approx(ref["ema_kl_loss"], rel=1e-10)
    torch.testing.assert_close(v.grad, torch.tensor(ref["grad_v_theta"], dtype=torch.float64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("time_type", ["discrete", "discrete_wo_init"])
def test_timestep_indices_are_the_reference_strata(time_type):
    ref = REFERENCE["timesteps"]

    class FixedUniforms:  # the reference's torch.rand draws, here the trainer generator's
        def random(self, n):
            assert n == ref["train_timesteps"]
            return np.asarray(ref["u"], dtype=np.float32).astype(np.float64)

    got = timestep_indices(ref["num_steps"], ref["train_timesteps"], ref["timestep_fraction"], time_type,
                           FixedUniforms())
    assert got.tolist() == ref[time_type]


def test_timestep_indices_stay_in_the_schedule():
    rng = np.random.default_rng(0)
    for n_steps, n, fraction, kind in [(3, 2, 0.9, "discrete"), (3, 6, 0.9, "discrete"), (10, 6, 1.0, "discrete"),
                                       (2, 4, 0.5, "discrete_wo_init"), (14, 6, 0.9, "discrete_wo_init")]:
        for _ in range(50):
            idx = timestep_indices(n_steps, n, fraction, kind, rng)
            assert len(idx) == n and idx.min() >= (kind == "discrete_wo_init") and idx.max() < n_steps
            assert (np.diff(idx) >= 0).all()  # one per stratum, in order
    # 3 steps at 0.9: int(2.7) = 2 indices, strata [0, 1) and [1, 2)
    assert timestep_indices(3, 2, 0.9, "discrete", rng).tolist() == [0, 1]
