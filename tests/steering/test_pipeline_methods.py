"""Every steering method on tiny random diffusers pipelines: it runs, counts its evaluations, and raises the reward.

The tiny models are random, so the reward has to be one they can move: mean brightness (×100, differentiable).
"""

import pytest
import torch
from steer_toy import Brightness

from diffrl.errors import UserError
from diffrl.steering import steer, steer_process
from diffrl.steering.core import SteerContext, sample_chain
from diffrl.steering.pipeline import PipelineProcess

PROMPTS = ["a red circle", "a blue square", "two green triangles", "a yellow star"]
STEPS = 8


def _plain(pipe, seed=0, **kwargs):
    """Plain sampling: best-of-1 draws exactly the initial and step noise of any other 1-chain method."""
    return steer(pipe, PROMPTS, Brightness(), "best-of-n", num_steps=STEPS, seed=seed, num_samples=1, **kwargs)


def test_pipeline_process_matches_the_ddim_sampler(tiny_sd):
    # With η = 0 the chain is deterministic: from the same x_T, our process must land exactly where the samplers'
    # own DDIMSampler.sample does (same conditioning, CFG, schedule and step).
    from samplers.ddim import DDIMSampler

    process = PipelineProcess(tiny_sd, PROMPTS, num_steps=STEPS, guidance_scale=7.5, eta=0.0)
    ctx = SteerContext(process, Brightness(), PROMPTS)
    cond = torch.arange(len(PROMPTS))
    x_T = process.initial_latents(cond, torch.Generator().manual_seed(0))
    ours = sample_chain(ctx, x_T, cond)
    traj = DDIMSampler().sample(
        tiny_sd, PROMPTS, num_steps=STEPS, guidance_scale=7.5, eta=0.0, latents=x_T, output="latents"
    )
    torch.testing.assert_close(ours, traj.final_latents, atol=1e-5, rtol=1e-5)
    # NFE: one per latent row and step (the CFG pair counts once; the sampler counts UNet rows, i.e. twice)
    assert ctx.nfe == len(PROMPTS) * STEPS and traj.nfe == 2 * ctx.nfe


def test_v_prediction_pipeline_steps_the_same_in_eps_space():
    # The process works in ε-space (v converted to ε, step built with prediction_type="epsilon"): still the same
    # chain as the sampler stepping on v itself.
    from samplers.ddim import DDIMSampler
    from samplers.testing import tiny_sd_pipeline

    pipe = tiny_sd_pipeline(prediction_type="v_prediction")
    process = PipelineProcess(pipe, PROMPTS[:2], num_steps=4, guidance_scale=3.0, eta=0.0)
    cond = torch.arange(2)
    x_T = process.initial_latents(cond, torch.Generator().manual_seed(1))
    ours = sample_chain(SteerContext(process, Brightness(), PROMPTS[:2]), x_T, cond)
    traj = DDIMSampler().sample(
        pipe, PROMPTS[:2], num_steps=4, guidance_scale=3.0, eta=0.0, latents=x_T, output="latents"
    )
    torch.testing.assert_close(ours, traj.final_latents, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "method, cfg, nfe_per_prompt, reward_evals_per_prompt",
    [
        ("best-of-n", {"num_samples": 4}, 4 * STEPS, 4),
        # scheduled steps 0, 2, 4, 6 (the last step is never scheduled) + the final score, for 4 particles
        ("fk", {"num_particles": 4, "lmbda": 10.0, "interval": 2}, 4 * STEPS, 4 * 5),
        # 1 + (T − 1)·M model calls, (T − 1)·M + M reward calls (the SD schedule's last DDIM step still has noise)
        ("svdd", {"num_candidates": 4}, 1 + (STEPS - 1) * 4, STEPS * 4),
    ],
)
def test_value_methods_raise_the_reward_and_count_evaluations(
    tiny_sd, method, cfg, nfe_per_prompt, reward_evals_per_prompt
):
    _, base_scores, _ = _plain(tiny_sd)
    images, scores, info = steer(tiny_sd, PROMPTS, Brightness(), method, num_steps=STEPS, seed=0, **cfg)
    assert images.shape == (len(PROMPTS), 3, 16, 16) and scores.shape == (len(PROMPTS),)
    # the scores returned are the reward of the images returned
    torch.testing.assert_close(scores, Brightness()(images, PROMPTS).scores)
    # measured on seeds 0–2 with 8 steps: plain ≈ 44.1–44.9, these ≈ 44.9–45.5; the margin is a third of the gain
    assert scores.mean() > base_scores.mean() + 0.2, (scores.mean(), base_scores.mean())
    assert info["nfe_per_prompt"] == nfe_per_prompt and info["reward_evals_per_prompt"] == reward_evals_per_prompt
    assert info["method"] == method and info["num_steps"] == STEPS
    assert info["wall_s"] >= info["model_s"] + info["reward_s"]


def test_budget_one_spends_no_intermediate_reward_evaluations(tiny_sd):
    # FK with one particle is plain sampling (nothing to resample): the same draws, one reward call per prompt
    _, base_scores, _ = _plain(tiny_sd)
    _, scores, info = steer(tiny_sd, PROMPTS, Brightness(), "fk", num_steps=STEPS, seed=0, num_particles=1)
    torch.testing.assert_close(scores, base_scores)
    assert info["reward_evals_per_prompt"] == 1 and info["scheduled_steps"] == []
    # SVDD with one candidate has nothing to choose: only the final sample is scored
    _, _, info = steer(tiny_sd, PROMPTS, Brightness(), "svdd", num_steps=STEPS, seed=0, num_candidates=1)
    assert info["reward_evals_per_prompt"] == 1 and info["nfe_per_prompt"] == STEPS


def test_reward_guidance_raises_the_reward_of_the_same_chain(tiny_sd):
    # One chain per prompt from the same seed draws the same x_T and step noise as plain sampling, so the
    # comparison is paired: any gain is the guidance itself.
    _, base_scores, _ = _plain(tiny_sd)
    _, scores, info = steer(tiny_sd, PROMPTS, Brightness(), "guidance", num_steps=STEPS, seed=0, scale=3.0)
    assert (scores > base_scores).all(), (scores, base_scores)
    assert info["nfe_grad"] == len(PROMPTS) * STEPS and info["backward_passes"] == STEPS
    # zero scale is plain sampling, exactly
    _, same, _ = steer(tiny_sd, PROMPTS, Brightness(), "guidance", num_steps=STEPS, seed=0, scale=0.0)
    torch.testing.assert_close(same, base_scores)


def test_reno_raises_the_reward_of_a_one_step_lcm(tiny_lcm):
    _, scores, info = steer(tiny_lcm, PROMPTS, Brightness(), "reno", seed=0, iterations=7)
    history = info["objective_per_iteration"]
    assert len(history) == 7 and history[-1] > history[0]
    # best-so-far: never worse than the first evaluation (the plain one-step sample of the same noise)
    _, plain, _ = steer(tiny_lcm, PROMPTS, Brightness(), "best-of-n", num_steps=1, seed=0, num_samples=1)
    assert (scores >= plain - 1e-4).all() and scores.mean() > plain.mean()
    # 7 generations of one step each per prompt, all but the last with a graph; an update after each but the last
    assert info["nfe_per_prompt"] == 7 and info["nfe_grad"] == 6 * len(PROMPTS) and info["backward_passes"] == 6


def test_reno_multi_step_keeps_the_injected_noise_fixed(tiny_lcm):
    # With 2 LCM steps the sampler injects noise between them; ReNO fixes it, so with lr → 0 every evaluation sees
    # the same image and the per-iteration objective is constant.
    _, _, info = steer(tiny_lcm, PROMPTS[:2], Brightness(), "reno", num_steps=2, seed=0, iterations=4, lr=1e-12)
    history = info["objective_per_iteration"]
    assert max(history) - min(history) < 1e-4


def test_fk_and_svdd_run_on_an_lcm_pipeline(tiny_lcm):
    settings = {"num_steps": 4, "seed": 0, "num_particles": 3, "interval": 1}
    _, scores, info = steer(tiny_lcm, PROMPTS[:2], Brightness(), "fk", **settings)
    assert scores.shape == (2,) and info["sampler"] == "lcm" and info["nfe_per_prompt"] == 3 * 4


def test_fk_runs_on_sdxl():
    from samplers.testing import tiny_sdxl_pipeline

    pipe = tiny_sdxl_pipeline()
    settings = {"num_steps": 4, "seed": 0, "num_particles": 2, "interval": 1}
    images, _, info = steer(pipe, PROMPTS[:2], Brightness(), "fk", **settings)
    assert images.shape == (2, 3, 16, 16) and info["nfe_per_prompt"] == 2 * 4


def test_same_seed_same_result(tiny_sd):
    kwargs = {"num_steps": 4, "seed": 3, "num_particles": 3, "interval": 1, "resampling": "systematic"}
    first = steer(tiny_sd, PROMPTS[:2], Brightness(), "fk", **kwargs)
    second = steer(tiny_sd, PROMPTS[:2], Brightness(), "fk", **kwargs)
    torch.testing.assert_close(first[0], second[0])


def test_batch_size_does_not_change_the_result(tiny_sd):
    full = steer(tiny_sd, PROMPTS, Brightness(), "svdd", num_steps=3, seed=0, num_candidates=3)
    chunked = steer(tiny_sd, PROMPTS, Brightness(), "svdd", num_steps=3, seed=0, num_candidates=3, batch_size=5)
    torch.testing.assert_close(full[1], chunked[1], atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- errors


def test_gradient_methods_refuse_a_non_differentiable_reward(tiny_sd, tiny_lcm):
    with pytest.raises(UserError, match="needs a differentiable reward"):
        steer(tiny_sd, PROMPTS[:1], Brightness(differentiable=False), "guidance", num_steps=2)
    with pytest.raises(UserError, match="needs a differentiable reward"):
        steer(tiny_lcm, PROMPTS[:1], Brightness(differentiable=False), "reno", iterations=1)


def test_fk_and_svdd_refuse_a_deterministic_sampler(tiny_sd):
    for method in ("fk", "svdd"):
        with pytest.raises(UserError, match="stochastic sampler"):
            steer(tiny_sd, PROMPTS[:1], Brightness(), method, num_steps=2, eta=0.0)


def test_bad_method_and_setting_names(tiny_sd):
    with pytest.raises(UserError, match="did you mean 'svdd'"):
        steer(tiny_sd, PROMPTS[:1], Brightness(), "svd")
    with pytest.raises(UserError, match="did you mean 'num_particles'"):
        steer(tiny_sd, PROMPTS[:1], Brightness(), "fk", num_steps=2, num_partcles=4)
    with pytest.raises(UserError, match="did you mean 'num_steps'"):
        steer(tiny_sd, PROMPTS[:1], Brightness(), "fk", num_step=2)
    with pytest.raises(UserError, match="unknown FK potential"):
        steer(tiny_sd, PROMPTS[:1], Brightness(), "fk", num_steps=2, potential="sum")


def test_steer_process_takes_any_process():
    # the public entry point for non-diffusers models (here the 2-D toy)
    from steer_toy import DTYPE, GMMProcess, LinearReward, default_gmm

    out = steer_process(
        GMMProcess(default_gmm(), num_steps=20), ["toy"] * 3, LinearReward(torch.tensor([1.0, 0.0], dtype=DTYPE)),
        "best-of-n", generator=torch.Generator().manual_seed(0), num_samples=2,
    )
    assert out.images.shape == (3, 2) and out.info["nfe"] == 3 * 2 * 20
