"""LCMSampler against diffusers' LatentConsistencyModelPipeline and its own recomputation."""

import pytest
import torch

from diffrl.errors import UserError
from samplers.lcm import LCMSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def test_reproduces_the_lcm_pipeline_with_the_same_noise(tiny_lcm):
    # the pipeline draws step noise from generator i for sample i (start latents given); ours from seed i
    x_T = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    seeds = [4, 5, 6]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    ref = tiny_lcm(
        PROMPTS, num_inference_steps=4, guidance_scale=8.0, latents=x_T, generator=generators, output_type="latent"
    ).images
    ref_images = tiny_lcm(
        PROMPTS,
        num_inference_steps=4,
        guidance_scale=8.0,
        latents=x_T,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type="pt",
    ).images
    traj = LCMSampler().sample(tiny_lcm, PROMPTS, num_steps=4, guidance_scale=8.0, latents=x_T, seeds=seeds)
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert (traj.images - ref_images).abs().max() <= 1e-5
    assert traj.timesteps.tolist() == [999, 759, 499, 259]
    assert (traj.log_probs[:, :3] < 0).all()
    assert traj.log_probs[:, 3].abs().max() == 0  # the last step returns x̂0 itself: a point mass
    assert traj.negative_prompt_embeds is None and traj.timestep_cond.shape == (3, 32)
    assert traj.nfe == 3 * 4  # one UNet row per sample and step: no CFG batch


def test_start_noise_from_seeds_matches_the_pipeline_generators(tiny_lcm):
    seeds = [7, 8]
    ref = tiny_lcm(
        PROMPTS[:2],
        num_inference_steps=2,
        guidance_scale=3.0,
        output_type="latent",
        generator=[torch.Generator().manual_seed(s) for s in seeds],
    ).images
    traj = LCMSampler().sample(tiny_lcm, PROMPTS[:2], num_steps=2, guidance_scale=3.0, seeds=seeds, output="latents")
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5


def test_step_log_prob_is_the_gaussian_of_the_renoising(tiny_lcm):
    sampler = LCMSampler()
    traj = sampler.sample(tiny_lcm, PROMPTS, num_steps=4, guidance_scale=8.0, seeds=[1, 2, 3], output="latents")
    alphas = tiny_lcm.scheduler.alphas_cumprod
    with torch.no_grad():
        step = sampler.log_prob(tiny_lcm, traj, 1, return_step=True)
    a_next = alphas[traj.timesteps[2]].item()
    assert torch.allclose(step.mean, a_next**0.5 * step.pred_x0, atol=1e-6)
    assert step.std.item() == pytest.approx((1 - a_next) ** 0.5, rel=1e-6)
    expected = torch.distributions.Normal(step.mean, (1 - a_next) ** 0.5).log_prob(traj.latents[:, 2])
    assert torch.allclose(traj.log_probs[:, 1], expected.mean(dim=(1, 2, 3)), atol=1e-5)
    with torch.no_grad():
        last = sampler.log_prob(tiny_lcm, traj, 3, return_step=True)
    assert torch.equal(last.pred_x0, traj.latents[:, 4]) and last.std.item() == 0


def test_recomputed_log_probs_equal_the_rollout(tiny_lcm):
    sampler = LCMSampler()
    traj = sampler.sample(tiny_lcm, PROMPTS + ["a star"], num_steps=4, guidance_scale=6.0, seeds=[1, 2, 3, 4])
    with torch.no_grad():
        for i in range(4):
            assert (sampler.log_prob(tiny_lcm, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5
            order = [3, 0, 2]
            recomputed = sampler.log_prob(tiny_lcm, traj, i, indices=order)
            assert (recomputed - traj.log_probs[order, i]).abs().max() <= 1e-5


def test_one_step_is_deterministic(tiny_lcm):
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    ref = tiny_lcm(PROMPTS[:2], num_inference_steps=1, guidance_scale=8.0, latents=x_T, output_type="latent").images
    traj = LCMSampler().sample(tiny_lcm, PROMPTS[:2], num_steps=1, guidance_scale=8.0, latents=x_T, output="latents")
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert traj.log_probs.abs().max() == 0


def test_bad_input_raises_user_errors(tiny_lcm, tiny_sd):
    sampler = LCMSampler()
    with pytest.raises(UserError, match="eta must be 1.0"):
        sampler.sample(tiny_lcm, PROMPTS, num_steps=2, guidance_scale=8.0, eta=0.0)
    with pytest.raises(UserError, match="negative prompt"):
        sampler.sample(tiny_lcm, PROMPTS, num_steps=2, guidance_scale=8.0, negative_prompt="ugly")
    with pytest.raises(UserError, match="time_cond_proj_dim"):
        sampler.sample(tiny_sd, PROMPTS, num_steps=2, guidance_scale=8.0)
