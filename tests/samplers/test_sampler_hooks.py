"""Sampler hooks: replacing the noise prediction, the next latents, or the whole particle set."""

import math

import pytest
import torch

from samplers.base import StepEdit, StepHook
from samplers.ddim import DDIMSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SETTINGS = {"num_steps": 5, "guidance_scale": 4.0, "seeds": [1, 2, 3], "output": "latents"}


def test_replacing_the_noise_prediction_with_zero_gives_the_closed_form_chain(tiny_sd):
    # with ε̂ = 0 and η = 0 a DDIM step is x_{t−1} = √ᾱ_{t−1} · x_t / √ᾱ_t, so x_0 = x_T · √ᾱ_prev(last) / √ᾱ_first
    calls = []
    handle = tiny_sd.unet.register_forward_pre_hook(lambda module, args: calls.append(1))
    hook = StepHook(before=lambda ctx: torch.zeros_like(ctx.x_t))
    traj = DDIMSampler().sample(tiny_sd, PROMPTS, eta=0.0, hooks=[hook], **SETTINGS)
    handle.remove()
    assert calls == []  # the sampler's own prediction is computed lazily: never needed here
    assert traj.nfe == 0
    # SD 1.x schedule, 5 steps: each step's previous timestep is the next one; the last one's lies before 0,
    # where set_alpha_to_one=False uses ᾱ_0; so the product telescopes
    assert traj.timesteps.tolist() == [801, 601, 401, 201, 1]
    alphas = tiny_sd.scheduler.alphas_cumprod.double()
    factor = math.sqrt(alphas[0].item() / alphas[801].item())
    assert torch.allclose(traj.latents[:, -1].double(), traj.latents[:, 0].double() * factor, rtol=1e-5)


def test_hooks_chain_and_see_the_earlier_edits(tiny_sd):
    seen = []

    def halve(ctx):
        return ctx.noise_pred * 0.5

    def record(ctx):
        seen.append(ctx.noise_pred.clone())

    plain = []
    DDIMSampler().sample(
        tiny_sd, PROMPTS, eta=1.0, hooks=[StepHook(before=lambda c: plain.append(c.noise_pred))], **SETTINGS
    )
    DDIMSampler().sample(
        tiny_sd, PROMPTS, eta=1.0, hooks=[StepHook(before=halve), StepHook(before=record)], **SETTINGS
    )
    assert len(seen) == 5
    assert torch.allclose(seen[0], 0.5 * plain[0], atol=1e-6)  # same x_T: the first step's prediction matches


def test_replacing_the_next_latents_rescores_them(tiny_sd):
    sampler = DDIMSampler()

    def take_the_mean(ctx):  # a zero-noise draw: the log-prob becomes −log σ − ½ log 2π
        return StepEdit(prev_sample=ctx.step.mean)

    traj = sampler.sample(tiny_sd, PROMPTS, eta=1.0, hooks=[StepHook(after=take_the_mean)], **SETTINGS)
    schedule = sampler.schedule(tiny_sd, 5)
    for i in range(5):
        sigma = schedule.constants(i, 1.0).std
        assert traj.log_probs[:, i].tolist() == pytest.approx(
            [-math.log(sigma) - 0.5 * math.log(2 * math.pi)] * 3, abs=1e-5
        )
    with torch.no_grad():
        for i in range(5):
            step = sampler.log_prob(tiny_sd, traj, i, return_step=True)
            assert torch.allclose(traj.latents[:, i + 1], step.mean, atol=1e-5)
            assert (step.log_prob - traj.log_probs[:, i]).abs().max() <= 1e-5


def test_resampling_reindexes_the_particle_history_and_keeps_slot_noise(tiny_sd):
    sampler = DDIMSampler()
    ancestors = torch.tensor([0, 0, 2])

    def resample_at_step_1(ctx):
        return StepEdit(ancestors=ancestors) if ctx.step_index == 1 else None

    plain = sampler.sample(tiny_sd, PROMPTS, eta=1.0, **SETTINGS)
    traj = sampler.sample(tiny_sd, PROMPTS, eta=1.0, hooks=[StepHook(after=resample_at_step_1)], **SETTINGS)
    # history up to and including step 1's result follows the ancestors
    assert torch.equal(traj.latents[:, :3], plain.latents[ancestors, :3])
    assert torch.equal(traj.log_probs[:, :2], plain.log_probs[ancestors, :2])
    assert traj.prompts == [PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    assert torch.equal(traj.prompt_embeds, plain.prompt_embeds[ancestors])
    assert traj.seeds == [1, 2, 3]  # generators stay with their slots ...
    assert (traj.latents[0, 3] - traj.latents[1, 3]).abs().max() > 1e-3  # ... so the copies diverge
    assert torch.equal(traj.latents[0], plain.latents[0]) and torch.equal(traj.latents[2], plain.latents[2])
    step, chosen = traj.extras["ancestors"][0]
    assert step == 1 and chosen.tolist() == [0, 0, 2]
    with torch.no_grad():  # the re-indexed conditioning makes recomputation agree
        for i in range(5):
            assert (sampler.log_prob(tiny_sd, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5


def test_model_and_step_helpers_agree_with_the_sampler(tiny_sd):
    checks = []

    def check(ctx):
        if ctx.step_index != 2:
            return
        x = ctx.x_t[[2, 0]]
        own = ctx.model(x, rows=torch.tensor([2, 0]))
        checks.append((own - ctx.noise_pred[[2, 0]]).abs().max().item())
        pred_x0 = ctx.to_pred_x0(ctx.noise_pred, ctx.x_t)
        checks.append((pred_x0 - ctx.step.pred_x0).abs().max().item())
        redo = ctx.take_step(ctx.noise_pred, ctx.x_t, prev_sample=ctx.step.prev_sample)
        checks.append((redo.log_prob - ctx.step.log_prob).abs().max().item())
        images = ctx.decode(ctx.pred_x0)
        checks.append(float(images.shape == (3, 3, 16, 16) and 0 <= images.min() and images.max() <= 1))
        return

    traj = DDIMSampler().sample(tiny_sd, PROMPTS, eta=1.0, hooks=[StepHook(after=check)], **SETTINGS)
    assert checks[0] <= 1e-5 and checks[1] <= 1e-6 and checks[2] <= 1e-6 and checks[3] == 1.0
    assert traj.nfe == 5 * 3 * 2 + 2 * 2  # 5 guided steps on 3 samples, plus the hook's 2 guided rows


def test_a_non_hook_is_rejected(tiny_sd):
    with pytest.raises(TypeError, match="StepHook"):
        DDIMSampler().sample(tiny_sd, PROMPTS, eta=1.0, hooks=[lambda ctx: None], **SETTINGS)
