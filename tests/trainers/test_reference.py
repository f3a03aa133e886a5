"""The pre-trained reference (adapter off) and the Gaussian KL to it (diffrl/training/reference.py); expected
numbers worked out by hand or from torch.distributions."""

import torch
from pg_helpers import PROMPTS, tiny_pipeline_dir

from diffrl.training.reference import gaussian_kl, step_kl_to_reference


def test_gaussian_kl_constant_mean_difference():
    # Every dim differs by 0.3 with σ = 0.5: 0.09 / (2·0.25) = 0.18 per dim, mean over dims = 0.18.
    mean = torch.full((2, 4, 2, 2), 0.3)
    kl = gaussian_kl(mean, torch.zeros_like(mean), 0.5)
    assert kl.shape == (2,)
    assert torch.allclose(kl, torch.tensor([0.18, 0.18]), atol=1e-7)


def test_gaussian_kl_single_dim_difference_with_tensor_std():
    # One of 4 dims differs by 1 with σ = 1: (1/2 + 0 + 0 + 0) / 4 = 0.125; sample 2 with σ = 2: 1/8/4 = 0.03125.
    mean = torch.zeros(2, 4)
    mean[:, 0] = 1.0
    std = torch.tensor([1.0, 2.0]).view(2, 1)
    kl = gaussian_kl(mean, torch.zeros_like(mean), std)
    assert torch.allclose(kl, torch.tensor([0.125, 0.03125]))


def test_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean, mean_ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    std = 0.37
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std)
    ).mean(dim=1)
    assert torch.allclose(gaussian_kl(mean, mean_ref, std), expected, atol=1e-6)


def test_gaussian_kl_is_the_reference_eps_penalty_times_a_step_factor():
    # μ = a·x_t + c·ε̂ for a DDIM step, so μ_θ - μ_ref = c (ε_θ - ε_ref): KL = c² / (2σ²) · mean((Δε)²).
    g = torch.Generator().manual_seed(1)
    x, eps, eps_ref = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    a, c, sigma = 0.9, -0.3, 0.2
    kl = gaussian_kl(a * x + c * eps, a * x + c * eps_ref, sigma)
    eps_penalty = ((eps - eps_ref) ** 2).flatten(1).mean(dim=1)
    assert torch.allclose(kl, c**2 / (2 * sigma**2) * eps_penalty, rtol=1e-5)


def test_dpok_reference_is_the_unet_with_its_adapter_off(tmp_path):
    from diffusers import StableDiffusionPipeline

    from diffrl.training.weights import DEFAULT_LORA_TARGETS, setup_trainable
    from samplers.ddim import DDIMSampler

    pipe_dir = tiny_pipeline_dir(tmp_path)
    policy = StableDiffusionPipeline.from_pretrained(pipe_dir)
    pretrained = StableDiffusionPipeline.from_pretrained(pipe_dir)  # an independent copy, never given an adapter
    params = setup_trainable(policy.unet, use_lora=True, lora_rank=2, lora_alpha=2.0,
                             lora_target_modules=DEFAULT_LORA_TARGETS)
    sampler = DDIMSampler()
    with torch.no_grad():
        traj = sampler.sample(policy, PROMPTS[:2], num_steps=3, guidance_scale=3.0, eta=1.0, seeds=[0, 1])

    # a fresh adapter (B = 0) is the pre-trained model: KL exactly 0
    _, kl = step_kl_to_reference(policy, sampler, traj, 1)
    assert torch.equal(kl, torch.zeros(2))

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in policy.unet.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    step, kl = step_kl_to_reference(policy, sampler, traj, 1)
    with torch.no_grad():
        ref = sampler.log_prob(pretrained, traj, 1, return_step=True)
    # KL(N(μ, σ²) ‖ N(μ_ref, σ²)) per dim = (μ - μ_ref)² / (2σ²), averaged over the C·h·w latent dims
    expected = ((step.mean.detach() - ref.mean) ** 2 / (2 * float(step.std) ** 2)).flatten(1).mean(dim=1)
    assert (expected > 0).all()
    assert torch.allclose(kl.detach(), expected, rtol=1e-4, atol=1e-10)
    # the adapter is back on afterwards, and the KL carries a gradient to the LoRA weights only
    again = sampler.log_prob(policy, traj, 1, return_step=True)
    assert torch.allclose(again.mean, step.mean) and not torch.allclose(again.mean, ref.mean)
    kl.sum().backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in params)
    assert all(p.grad is None for p in policy.unet.parameters() if not p.requires_grad)
