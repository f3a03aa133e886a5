"""Differentiable sampling: gradients reach the model only through kept steps; checkpointing changes nothing."""

import pytest
import torch
from tiny_models import tiny_lcm_pipeline, tiny_sd_pipeline

from samplers.base import GradPolicy
from samplers.ddim import DDIMSampler
from samplers.lcm import LCMSampler

PROMPTS = ["a red circle", "two blue squares"]
SETTINGS = {"num_steps": 4, "guidance_scale": 3.0, "eta": 1.0, "seeds": [3, 4]}


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_sd_pipeline(seed=5)
    pipe.vae.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    return pipe


def unet_grads(pipe, loss):
    pipe.unet.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in pipe.unet.parameters()])


def guided_eps(pipe, traj, i, x):
    """The guided model output at step i, written out by hand (CFG as one batched call)."""
    embeds = torch.cat([traj.negative_prompt_embeds, traj.prompt_embeds])
    out = pipe.unet(torch.cat([x, x]), traj.timesteps[i], encoder_hidden_states=embeds).sample
    uncond, cond = out.chunk(2)
    return uncond + traj.guidance_scale * (cond - uncond)


def reference_grads(pipe, traj, kept):
    """Gradient of the same loss by a hand-written chain: the model output is detached outside `kept`, the latent
    chain is differentiable from the first kept step on, and each step reuses the rollout's own noise."""
    sampler = DDIMSampler()
    sampler.schedule(pipe, traj.num_steps)
    with torch.no_grad():
        means = [sampler.log_prob(pipe, traj, i, return_step=True) for i in range(traj.num_steps)]
    noises = [(traj.latents[:, i + 1] - m.mean) / m.std for i, m in enumerate(means)]
    x = traj.latents[:, min(kept)]
    for i in range(min(kept), traj.num_steps):
        with torch.set_grad_enabled(i in kept):
            eps = guided_eps(pipe, traj, i, x)
        x = sampler.step(eps, traj.timesteps[i], x, eta=traj.eta, noise=noises[i]).prev_sample
    from diffrl.models.base import decode_latents

    return unet_grads(pipe, decode_latents(pipe, x).mean())


def count_grad_calls(pipe):
    calls = []
    handle = pipe.unet.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    return calls, handle


def test_last_k_gradient_comes_only_from_the_last_k_steps(pipe):
    sampler = DDIMSampler()
    calls, handle = count_grad_calls(pipe)
    traj = sampler.sample(pipe, PROMPTS, grad=GradPolicy("last", k=1), **SETTINGS)
    handle.remove()
    assert calls == [False, False, False, True]
    assert traj.grad_steps == [3] and traj.images.requires_grad
    ours = unet_grads(pipe, traj.images.mean())
    ref = reference_grads(pipe, traj, kept={3})
    assert ours.abs().max() > 0
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-7)
    # the check can fail: keeping every step gives a clearly different gradient
    everything = unet_grads(pipe, sampler.sample(pipe, PROMPTS, grad=GradPolicy("all"), **SETTINGS).images.mean())
    assert (everything - ref).abs().max() > 100 * (ours - ref).abs().max() + 1e-6


def test_random_steps_keep_the_chain_between_kept_steps(pipe):
    sampler = DDIMSampler()
    torch.manual_seed(0)
    traj = sampler.sample(pipe, PROMPTS, grad=GradPolicy("random", k=2), **SETTINGS)
    kept = set(traj.grad_steps)
    assert len(kept) == 2
    ours = unet_grads(pipe, traj.images.mean())
    assert torch.allclose(ours, reference_grads(pipe, traj, kept), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("keep", ["all", "last"])
def test_checkpointing_gives_the_same_gradient(pipe, keep):
    sampler = DDIMSampler()
    plain = unet_grads(pipe, sampler.sample(pipe, PROMPTS, grad=GradPolicy(keep, k=2), **SETTINGS).images.mean())
    calls, handle = count_grad_calls(pipe)
    traj = sampler.sample(pipe, PROMPTS, grad=GradPolicy(keep, k=2, checkpoint=True), **SETTINGS)
    forward_calls = len(calls)
    checkpointed = unet_grads(pipe, traj.images.mean())
    handle.remove()
    kept = 4 if keep == "all" else 2
    assert len(calls) == forward_calls + kept  # the backward pass re-ran each kept UNet call
    assert plain.abs().max() > 0
    assert (checkpointed - plain).abs().max() <= 1e-5 * plain.abs().max()


def test_no_grad_policy_builds_no_graph(pipe):
    traj = DDIMSampler().sample(pipe, PROMPTS, **SETTINGS)
    assert not traj.images.requires_grad and not traj.final_latents.requires_grad
    traj = DDIMSampler().sample(pipe, PROMPTS, grad=GradPolicy("none"), **SETTINGS)
    assert not traj.images.requires_grad


def test_decode_false_keeps_the_latent_graph_only(pipe):
    traj = DDIMSampler().sample(pipe, PROMPTS, grad=GradPolicy("last", k=1, decode=False), **SETTINGS)
    assert not traj.images.requires_grad and traj.final_latents.requires_grad
    assert not traj.latents.requires_grad and not traj.log_probs.requires_grad


def test_gradient_reaches_the_start_noise_for_noise_optimisation(pipe):
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    traj = DDIMSampler().sample(pipe, PROMPTS, latents=x_T, grad=GradPolicy("all"), **{**SETTINGS, "seeds": None})
    traj.images.mean().backward()
    assert x_T.grad is not None and x_T.grad.abs().max() > 0
    pipe.unet.zero_grad(set_to_none=True)


def test_gradient_reaches_lora_parameters_only():
    from peft import LoraConfig

    pipe = tiny_sd_pipeline(seed=6)
    pipe.vae.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    pipe.unet.requires_grad_(False)
    lora = LoraConfig(
        r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]
    )
    pipe.unet.add_adapter(lora)
    traj = DDIMSampler().sample(pipe, PROMPTS, grad=GradPolicy("last", k=2, checkpoint=True), **SETTINGS)
    traj.images.mean().backward()
    named = dict(pipe.unet.named_parameters())
    lora_grads = [p.grad for n, p in named.items() if "lora" in n]
    assert lora_grads and all(g is not None for g in lora_grads)
    assert sum(g.abs().sum() for g in lora_grads) > 0
    assert all(p.grad is None for n, p in named.items() if "lora" not in n)


def test_lcm_sampler_is_differentiable_too():
    pipe = tiny_lcm_pipeline(seed=2)
    pipe.vae.requires_grad_(False)
    sampler = LCMSampler()
    traj = sampler.sample(pipe, PROMPTS, num_steps=3, guidance_scale=6.0, seeds=[1, 2], grad=GradPolicy("last", k=1))
    assert traj.grad_steps == [2]
    grads = unet_grads(pipe, traj.images.mean())
    assert grads.abs().max() > 0
    # the last LCM step is x̂0(x_τ) itself: its gradient is that of decoding x̂0 from the rollout's x_τ
    pipe.unet.zero_grad(set_to_none=True)
    x = traj.latents[:, 2]
    out = pipe.unet(
        x, traj.timesteps[2], encoder_hidden_states=traj.prompt_embeds, timestep_cond=traj.timestep_cond
    ).sample
    pred_x0 = sampler.step(out, traj.timesteps[2], x).pred_x0
    from diffrl.models.base import decode_latents

    ref = unet_grads(pipe, decode_latents(pipe, pred_x0).mean())
    assert torch.allclose(grads, ref, rtol=1e-4, atol=1e-7)
