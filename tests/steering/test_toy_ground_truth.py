"""Ground truth on a 2-D Gaussian-mixture diffusion with the exact score (see steer_toy.py).

The steering methods here are the same functions that steer images; only the `DenoisingProcess` differs.
Reward r(x) = a·x with a = (1, 0); the tilted target p0(x)·exp(λ r(x)) / Z has closed-form mode weights.
"""

import math

import pytest
import torch
from steer_toy import DTYPE, GMMProcess, LinearReward, default_gmm

from diffrl.steering.best_of_n import BestOfNConfig, best_of_n
from diffrl.steering.core import SteerContext
from diffrl.steering.fk import FKConfig, fk_steer
from diffrl.steering.guidance import GuidanceConfig, reward_guidance
from diffrl.steering.svdd import SVDDConfig, svdd

A = torch.tensor([1.0, 0.0], dtype=DTYPE)
LMBDA = 0.5
GROUPS, PARTICLES = 8, 1000


def _weighted_mode_weights(out, target):
    """Self-normalised importance estimate of the target's mode weights: Σ_i ŵ_i γ_k(x_i), averaged over groups.

    E_target[γ_k(x)] = π'_k exactly (the expected responsibility of a component is its weight), so this estimates
    the mode weights without assigning points to modes.
    """
    weights = out.info["final_weights"].reshape(-1).double() / GROUPS
    return (weights[:, None] * target.responsibilities(out.info["particles"])).sum(0)


def test_tilted_target_weights_are_what_the_closed_form_says():
    # the closed form itself, by hand for λ = 0.5: factors exp(λ a·μ_k + λ² s_k²/2) with a·μ = (−2, 2, 0),
    # s² = (0.25, 0.25, 0.49): exp(−0.96875), exp(1.03125), exp(0.06125); times π = (0.5, 0.3, 0.2)
    gmm = default_gmm()
    raw = torch.tensor([0.5 * math.exp(-0.96875), 0.3 * math.exp(1.03125), 0.2 * math.exp(0.06125)], dtype=DTYPE)
    torch.testing.assert_close(gmm.tilted(A, LMBDA).weights, raw / raw.sum())
    assert gmm.tilted(A, LMBDA).weights.tolist() == pytest.approx([0.1526, 0.6765, 0.1710], abs=1e-4)


@pytest.mark.parametrize("potential", ["max", "difference", "immediate", "add"])
def test_fk_reproduces_tilted_mode_weights(potential):
    gmm = default_gmm()
    target = gmm.tilted(A, LMBDA)
    # "add" multiplies every scheduled reward into all later potentials, so its final correction is large and its
    # weights degenerate fast; it stays unbiased but needs fewer scheduled steps to be measurable at this k
    interval = 40 if potential == "add" else 10
    ctx = SteerContext(GMMProcess(gmm, num_steps=100), LinearReward(A), ["toy"] * GROUPS)
    cfg = FKConfig(
        num_particles=PARTICLES, lmbda=LMBDA, potential=potential, interval=interval, resampling="systematic"
    )
    out = fk_steer(ctx, cfg, torch.Generator().manual_seed(0), keep_particles=True)
    # tolerance: ≥ 8 groups × ~250 effective particles -> standard error ≤ 0.011 per weight; 0.035 covers it plus
    # the 100-step discretisation bias (base mean reward −0.411 against −0.400 exact)
    estimate = _weighted_mode_weights(out, target)
    torch.testing.assert_close(estimate, target.weights, atol=0.035, rtol=0)
    # the plain base distribution has weights (0.5, 0.3, 0.2): steering moved them far beyond the tolerance
    assert estimate[1] - 0.3 > 0.3
    # accounting: k particles × 100 steps per prompt, one reward call per particle and scheduled step + the final one
    assert out.info["nfe"] == GROUPS * PARTICLES * 100
    assert out.info["reward_evals"] == GROUPS * PARTICLES * (len(out.info["scheduled_steps"]) + 1)


def test_fk_without_any_resampling_is_exact_importance_sampling():
    # An ESS threshold no group reaches: nothing is ever resampled, so the final weight of a particle is the
    # product of all its potentials times the final correction = exp(λ r(x0)) exactly. Dropping the weights of
    # earlier scheduled steps (the reference code's bug) would leave exp(λ r0)/∏_{s<last} G_s, a wrong target.
    gmm = default_gmm()
    target = gmm.tilted(A, LMBDA)
    ctx = SteerContext(GMMProcess(gmm, num_steps=100), LinearReward(A), ["toy"] * GROUPS)
    cfg = FKConfig(num_particles=PARTICLES, lmbda=LMBDA, potential="max", interval=10, ess_threshold=1e-9)
    out = fk_steer(ctx, cfg, torch.Generator().manual_seed(1), keep_particles=True)
    assert all(count == 0 for _, count in out.info["resample_steps"])
    final_rewards = out.info["particle_scores"].double()
    expected = torch.softmax(LMBDA * final_rewards, dim=1)
    torch.testing.assert_close(out.info["final_weights"].double(), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_weighted_mode_weights(out, target), target.weights, atol=0.035, rtol=0)


def test_fk_resampled_draws_follow_the_target():
    # select="sample" returns one particle per prompt drawn ∝ its final weight: over many prompts those draws are a
    # sample of the tilted target (up to the O(1/k) bias of SMC with k particles).
    gmm = default_gmm()
    target = gmm.tilted(A, LMBDA)
    prompts = 1000
    ctx = SteerContext(GMMProcess(gmm, num_steps=100), LinearReward(A), ["toy"] * prompts)
    cfg = FKConfig(num_particles=32, lmbda=LMBDA, potential="difference", interval=10, select="sample")
    out = fk_steer(ctx, cfg, torch.Generator().manual_seed(2))
    draws = out.images
    # 1000 draws: s.e. ≤ 0.016 per weight; measured errors over seeds 2–5 were 0.009–0.024
    torch.testing.assert_close(target.responsibilities(draws).mean(0), target.weights, atol=0.045, rtol=0)
    # the target mean of r = Σ π'_k a·μ'_k = 1.193 (μ' the tilted component means). Budget: s.e. 0.05 (r has sd
    # ≈ 1.5 under the target) + 0.03 discretisation bias at 100 steps (importance sampling with 32 000 particles
    # gives 1.164) + the finite-k bias; measured 1.07–1.15 over seeds 2–5.
    target_mean_r = float((target.weights * (target.means @ A)).sum())
    assert target_mean_r == pytest.approx(1.1933, abs=1e-4)
    assert float(out.scores.double().mean()) == pytest.approx(target_mean_r, abs=0.15)


def _reward_cdf(gmm, r):
    """CDF of r = a·x under the base mixture: Σ π_k Φ((r − a·μ_k) / (|a| s_k)), |a| = 1."""
    z = (r[:, None] - (gmm.means @ A)[None]) / gmm.stds[None]
    return (gmm.weights[None] * torch.special.ndtr(z)).sum(1)


def test_best_of_n_follows_the_distribution_of_the_max():
    # best-of-N keeps the max of N i.i.d. rewards: its CDF is F(r)^N with F the base reward CDF
    gmm = default_gmm()
    prompts, n = 2000, 4
    # 400 steps: the max of 4 magnifies the upper tail, where 100 coarse ancestral steps leave a visible bias
    ctx = SteerContext(GMMProcess(gmm, num_steps=400), LinearReward(A), ["toy"] * prompts)
    out = best_of_n(ctx, BestOfNConfig(num_samples=n), torch.Generator().manual_seed(3), keep_samples=True)
    kept = out.scores.double().sort().values
    empirical = torch.arange(1, prompts + 1, dtype=DTYPE) / prompts
    ks = (empirical - _reward_cdf(gmm, kept) ** n).abs().max().item()
    # Kolmogorov–Smirnov: the 1% critical value at 2000 draws is 1.63/√2000 = 0.036; + 0.01 for discretisation
    assert ks < 0.046, ks
    # the kept one is the max of its group's draws, and the accounting is N·T model calls per prompt
    torch.testing.assert_close(out.scores, out.info["sample_scores"].max(dim=1).values)
    assert out.info["nfe"] == prompts * n * 400 and out.info["reward_evals"] == prompts * n


def test_svdd_and_guidance_raise_the_reward_on_the_toy():
    gmm = default_gmm()
    base_mean = float((gmm.weights * (gmm.means @ A)).sum())  # −0.4
    prompts = 200
    ctx = SteerContext(GMMProcess(gmm, num_steps=50), LinearReward(A), ["toy"] * prompts)
    out = svdd(ctx, SVDDConfig(num_candidates=4), torch.Generator().manual_seed(4))
    assert out.scores.mean().item() > base_mean + 1.0
    # NFE: 1 + (T − 1)·M per chain; the last DDIM step (to ᾱ = 1) is deterministic, so it has 1 candidate
    assert out.info["nfe"] == prompts * (1 + 49 * 4)
    assert out.info["reward_evals"] == prompts * (49 * 4 + 1)

    ctx = SteerContext(GMMProcess(gmm, num_steps=50), LinearReward(A), ["toy"] * prompts)
    out = reward_guidance(ctx, GuidanceConfig(scale=1.0), torch.Generator().manual_seed(5))
    assert out.scores.mean().item() > base_mean + 0.5
    assert out.info["nfe_grad"] == prompts * 50 and out.info["backward_passes"] == 50
