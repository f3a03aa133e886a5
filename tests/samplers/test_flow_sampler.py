"""FlowSampler against diffusers' SD3 and FLUX pipelines, Flow-GRPO's and CPS's equations, and its own recomputation.

The pipelines are tiny random-weight `StableDiffusion3Pipeline` / `FluxPipeline`s built in code, saved to a temp
folder and loaded back through `diffrl.load_pipeline`, the loader users use.
"""

import math

import numpy as np
import pytest
import torch
from tiny_models import tiny_flux_pipeline, tiny_sd3_pipeline

import diffrl
from diffrl.errors import UserError
from diffrl.models.flux import pack, unpack
from samplers import get_sampler, resolve_sampler_name
from samplers.base import GradPolicy, StepEdit, StepHook
from samplers.flow import FlowSampler, cps_constants, flow_step, sde_constants

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SHAPE = (4, 8, 8)  # latents of 16x16 images, for both tiny pipelines
TEXT = {"max_sequence_length": 16}  # T5 tokens: the prompts are shorter; keeps the transformer calls small


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd3")
    tiny_sd3_pipeline(folder)
    return diffrl.load_pipeline(str(folder))


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    tiny_flux_pipeline(folder)
    return diffrl.load_pipeline(str(folder))


def start_latents(batch=3, seed=1):
    return torch.randn(batch, *SHAPE, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------
# ODE = the diffusers pipelines


@pytest.mark.parametrize("guidance_scale, negative_prompt", [(1.0, None), (5.0, None), (4.5, "blurry")])
def test_ode_reproduces_the_sd3_pipeline(sd3, guidance_scale, negative_prompt):
    x_1 = start_latents()
    common = {"num_inference_steps": 6, "guidance_scale": guidance_scale, "latents": x_1, **TEXT}
    negative = None if negative_prompt is None else [negative_prompt] * 3
    ref = sd3(PROMPTS, negative_prompt=negative, output_type="latent", **common).images
    ref_images = sd3(PROMPTS, negative_prompt=negative, output_type="pt", **common).images
    traj = FlowSampler().sample(
        sd3, PROMPTS, num_steps=6, guidance_scale=guidance_scale, eta=0.0, latents=x_1,
        negative_prompt=negative_prompt, **TEXT,
    )  # fmt: skip
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert (traj.images - ref_images).abs().max() <= 1e-5
    assert traj.latents.shape == (3, 7, *SHAPE) and traj.log_probs.shape == (3, 6)
    assert torch.equal(traj.latents[:, 0], x_1) and traj.log_probs.abs().max() == 0  # the ODE: point masses
    assert (traj.negative_prompt_embeds is not None) == (guidance_scale > 1)
    assert traj.nfe == 3 * 6 * (2 if guidance_scale > 1 else 1) and traj.sampler == "flow"


@pytest.mark.parametrize("guidance_embeds, guidance_scale", [(True, 3.5), (True, 1.0), (False, 3.5)])
def test_ode_reproduces_the_flux_pipeline(flux, tmp_path, guidance_embeds, guidance_scale):
    pipe = flux
    if not guidance_embeds:  # FLUX.1-schnell-like: no guidance embedding, the scale is ignored as in diffusers
        tiny_flux_pipeline(tmp_path, seed=1, guidance_embeds=False)
        pipe = diffrl.load_pipeline(str(tmp_path))
    x_1 = start_latents()
    common = {"num_inference_steps": 5, "guidance_scale": guidance_scale, "height": 16, "width": 16, **TEXT}
    # the pipeline takes packed start latents; the sampler keeps them unpacked
    ref = pipe(PROMPTS, latents=pack(x_1), output_type="latent", **common).images
    ref_images = pipe(PROMPTS, latents=pack(x_1), output_type="pt", **common).images
    traj = FlowSampler().sample(
        pipe, PROMPTS, num_steps=5, guidance_scale=guidance_scale, eta=0.0, latents=x_1, height=16, width=16, **TEXT
    )
    assert (pack(traj.latents[:, -1]) - ref).abs().max() <= 1e-5
    assert (traj.images - ref_images).abs().max() <= 1e-5
    assert traj.nfe == 15 and traj.negative_prompt_embeds is None


def test_pack_and_unpack_are_the_pipelines_own():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 8, 6)
    assert torch.equal(pack(x), FluxPipeline._pack_latents(x, 2, 4, 8, 6))
    assert torch.equal(unpack(pack(x), 8, 6), x)


def test_sd3_schedule_is_the_shifted_linspace(sd3):
    # SD3 (shift s = 3): u = linspace(1, σ_min, T) with σ_min the shifted smallest training sigma (u = 1/1000),
    # then σ = s·u / (1 + (s − 1)·u), and a final σ = 0
    shift = lambda u: 3 * u / (1 + 2 * u)
    u = np.linspace(1.0, shift(1 / 1000), 4)
    expected = [shift(x) for x in u] + [0.0]
    schedule = FlowSampler().schedule(sd3, 4, SHAPE[1:])
    assert schedule.sigmas == pytest.approx(expected, abs=1e-6)
    assert schedule.timesteps.tolist() == pytest.approx([1000 * s for s in expected[:-1]], abs=1e-3)


def test_flux_schedule_is_resolution_shifted(flux):
    # FLUX: u = linspace(1, 1/T, T); μ = 0.5 + (1.15 − 0.5)/(4096 − 256)·(L − 256) with L = 16 packed tokens;
    # σ = e^μ / (e^μ + 1/u − 1)
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (16 - 256)
    expected = [math.exp(mu) / (math.exp(mu) + 1 / u - 1) for u in np.linspace(1.0, 1 / 5, 5)] + [0.0]
    schedule = FlowSampler().schedule(flux, 5, SHAPE[1:])
    assert schedule.sigmas == pytest.approx(expected, abs=1e-6)


def test_dynamic_shifting_sd3_config_follows_the_pipeline(sd3):
    from diffusers import FlowMatchEulerDiscreteScheduler

    original = sd3.scheduler
    sd3.scheduler = FlowMatchEulerDiscreteScheduler.from_config(original.config, use_dynamic_shifting=True)
    try:
        x_1 = start_latents(2)
        ref = sd3(PROMPTS[:2], num_inference_steps=4, guidance_scale=1.0, latents=x_1, output_type="latent", **TEXT)
        traj = FlowSampler().sample(sd3, PROMPTS[:2], num_steps=4, guidance_scale=1.0, eta=0.0, latents=x_1,
                                    output="latents", **TEXT)  # fmt: skip
        assert (traj.latents[:, -1] - ref.images).abs().max() <= 1e-5
    finally:
        sd3.scheduler = original


# ----------------------------------------------------------------------------------------------------------
# The step's math against the papers' equations, by hand


def test_ode_step_is_diffusers_euler_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    x, v = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    sigmas = scheduler.sigmas.tolist()
    for i, t in enumerate(scheduler.timesteps):
        ref = scheduler.step(v, t, x, return_dict=False)[0]
        ours = flow_step(v, x, sde_constants(sigmas[i], sigmas[i + 1], 0.0))
        assert torch.equal(ours.prev_sample, ref) and ours.std == 0 and ours.log_prob.abs().max() == 0


def gaussian_log_prob_by_hand(x_next, mean, std):
    return sum(-((a - m) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
               for a, m in zip(x_next, mean)) / len(x_next)  # fmt: skip


@pytest.mark.parametrize("sigma, sigma_next", [(0.6, 0.4), (1.0, 0.75), (0.3, 0.0)])
def test_sde_step_mean_std_and_log_prob_by_hand(sigma, sigma_next):
    # Flow-GRPO eq. (9), x_{t+Δt} = x_t + [v + σ_t²/(2t)·(x_t + (1 − t)·v)]·Δt + σ_t·√|Δt|·ε with
    # σ_t = a·√(t/(1 − t)) (at t = 1 the reference code uses 1 − t' in the denominator), t = σ, Δt = σ' − σ
    a, xs, vs, x_next = 0.7, [1.0, -2.0, 0.5], [0.5, 1.5, -1.0], [0.9, -1.7, 0.2]
    dt = sigma_next - sigma
    s = a * math.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))
    mean = [x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt for x, v in zip(xs, vs)]
    std = s * math.sqrt(-dt)
    out = flow_step(torch.tensor([vs]), torch.tensor([xs]), sde_constants(sigma, sigma_next, a),
                    prev_sample=torch.tensor([x_next]))  # fmt: skip
    assert out.mean[0].tolist() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.pred_x0[0].tolist() == pytest.approx([x - sigma * v for x, v in zip(xs, vs)], rel=1e-6)
    assert out.log_prob.item() == pytest.approx(gaussian_log_prob_by_hand(x_next, mean, std), rel=1e-5)


def test_sde_step_numbers_worked_by_hand():
    # σ = 0.5, σ' = 0.25, a = 1: s² = 0.5/0.5 = 1, Δt = −0.25; x = 2, v = 4:
    # μ = 2 + [4 + 1/(2·0.5)·(2 + 0.5·4)]·(−0.25) = 2 + (4 + 4)·(−0.25) = 0; std = 1·√0.25 = 0.5
    # at x' = 0.5: log p = −0.5²/(2·0.25) − log 0.5 − ½ log 2π = −0.5 + 0.693147 − 0.918939 = −0.725791
    out = flow_step(torch.tensor([[4.0]]), torch.tensor([[2.0]]), sde_constants(0.5, 0.25, 1.0),
                    prev_sample=torch.tensor([[0.5]]))  # fmt: skip
    assert out.mean.item() == pytest.approx(0.0, abs=1e-6) and out.std.item() == pytest.approx(0.5)
    assert out.log_prob.item() == pytest.approx(-0.725791, abs=1e-5)


def marginal_coefficients(constants, sigma, x0, eps):
    """(weight of x0, weight of ε) in the step's mean at x = (1 − σ)·x0 + σ·ε with the exact velocity v = ε − x0."""

    def mean(x0, eps):
        return flow_step(eps - x0, (1 - sigma) * x0 + sigma * eps, constants, prev_sample=x0).mean

    zero = torch.zeros_like(x0)
    return ((mean(x0, eps) - mean(zero, eps)) / x0).mean().item(), ((mean(x0, eps) - mean(x0, zero)) / eps).mean().item()


def test_cps_step_by_hand_and_it_keeps_the_marginal_coefficients():
    # CPS: std = σ'·sin(aπ/2); μ = (1 − σ')·x̂0 + √(σ'² − std²)·x̂1, x̂0 = x − σv, x̂1 = x + (1 − σ)v.
    # For x = (1 − σ)·x0 + σ·ε and the exact velocity v = ε − x0: x̂0 = x0, x̂1 = ε, so
    # x' = (1 − σ')·x0 + [√(σ'² − std²)·ε + std·z]: x0's coefficient is 1 − σ' and the noise variance
    # (σ'² − std²) + std² = σ'², exactly the forward process's at σ' (the paper's claim)
    sigma, sigma_next, a = 0.8, 0.5, 0.7
    x0, eps = torch.tensor([[1.0, -0.5, 2.0]]), torch.tensor([[0.3, 1.2, -0.7]])
    std = sigma_next * math.sin(a * math.pi / 2)
    c = math.sqrt(sigma_next**2 - std**2)
    cps = cps_constants(sigma, sigma_next, a)
    out = flow_step(eps - x0, (1 - sigma) * x0 + sigma * eps, cps, prev_sample=x0)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.mean[0].tolist() == pytest.approx(((1 - sigma_next) * x0 + c * eps)[0].tolist(), rel=1e-5)
    x0_weight, eps_weight = marginal_coefficients(cps, sigma, x0, eps)
    assert x0_weight == pytest.approx(1 - sigma_next, rel=1e-5)
    assert eps_weight**2 + std**2 == pytest.approx(sigma_next**2, rel=1e-5)
    # Flow-GRPO's SDE keeps x0's weight but injects too much noise: from eq. (9), ε's weight in μ is
    # σ' − s²|Δt|/(2σ), so the variance is σ'² + s²|Δt|·(1 − σ'/σ) + s⁴Δt²/(4σ²) > σ'²
    sde = sde_constants(sigma, sigma_next, a)
    s2, dt = a**2 * sigma / (1 - sigma), sigma - sigma_next
    x0_weight, eps_weight = marginal_coefficients(sde, sigma, x0, eps)
    assert x0_weight == pytest.approx(1 - sigma_next, rel=1e-5)
    variance = eps_weight**2 + sde.std**2
    excess = s2 * dt * (1 - sigma_next / sigma) + s2**2 * dt**2 / (4 * sigma**2)
    assert variance == pytest.approx(sigma_next**2 + excess, rel=1e-5) and variance > 1.1 * sigma_next**2
    # CPS's last step (σ' = 0) is a point mass at x̂0
    last = flow_step(eps - x0, (1 - sigma) * x0 + sigma * eps, cps_constants(sigma, 0.0, a))
    assert last.std == 0 and torch.allclose(last.prev_sample, x0, atol=1e-6)


def test_a_stochastic_step_without_noise_fails():
    with pytest.raises(ValueError, match="needs `noise`"):
        flow_step(torch.zeros(1, 2), torch.zeros(1, 2), sde_constants(0.5, 0.25, 0.7))


# ----------------------------------------------------------------------------------------------------------
# Rollouts: noise, log-probs and their recomputation


@pytest.mark.parametrize("name, guidance_scale", [("flow", 4.5), ("flow_cps", 4.5), ("flow", 1.0)])
def test_recomputed_log_probs_equal_the_rollout_sd3(sd3, name, guidance_scale):
    sampler = get_sampler(name, sd3)
    traj = sampler.sample(sd3, PROMPTS, num_steps=5, guidance_scale=guidance_scale, eta=0.7, seeds=[1, 2, 3],
                          output="latents", **TEXT)  # fmt: skip
    assert traj.sampler == name
    for i in range(5):
        assert (sampler.log_prob(sd3, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5
    # a sub-batch in another order recomputes the same
    sub = sampler.log_prob(sd3, traj, 2, indices=[2, 0])
    assert (sub - traj.log_probs[[2, 0], 2]).abs().max() <= 1e-5
    # stochastic steps have log-probs; CPS's last step (σ' = 0) is a point mass
    last_is_point_mass = name == "flow_cps"
    assert (traj.log_probs[:, :4] != 0).all() and ((traj.log_probs[:, 4] == 0).all() == last_is_point_mass)


def test_recomputed_log_probs_equal_the_rollout_flux(flux):
    sampler = FlowSampler()
    traj = sampler.sample(flux, PROMPTS[:2], num_steps=4, guidance_scale=3.5, eta=0.7, seeds=[5, 6], height=16,
                          width=16, output="latents", **TEXT)  # fmt: skip
    for i in range(4):
        assert (sampler.log_prob(flux, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5


def test_rollout_noise_and_log_probs_are_the_gaussian_closed_form(sd3):
    # sample i draws its start noise, then each step's z, from torch.Generator().manual_seed(seeds[i]); the stored
    # log-prob is the closed-form Gaussian density (mean over dims) of the next latents under the step's N(μ, std²)
    sampler, seeds = FlowSampler(), [7, 8]
    traj = sampler.sample(sd3, PROMPTS[:2], num_steps=3, guidance_scale=4.0, eta=0.8, seeds=seeds,
                          output="latents", **TEXT)  # fmt: skip
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    draws = [[torch.randn(SHAPE, generator=g) for _ in range(4)] for g in generators]
    for b in range(2):
        assert torch.equal(traj.latents[b, 0], draws[b][0])
    for i in range(3):
        step = sampler.log_prob(sd3, traj, i, return_step=True)
        std = step.std.double()
        for b in range(2):
            z = (traj.latents[b, i + 1].double() - step.mean[b].double()) / std
            assert torch.allclose(z, draws[b][i + 1].double(), atol=1e-4)
            closed = (-(z**2) / 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean()
            assert traj.log_probs[b, i].item() == pytest.approx(closed.item(), abs=1e-5)


def test_sde_window_is_stochastic_only_inside(sd3):
    sampler = FlowSampler()
    window = (0.0, 0.7, 0.7, 0.0, 0.0)
    common = {"num_steps": 5, "guidance_scale": 4.0, "seeds": [1, 2], "output": "latents", **TEXT}
    traj = sampler.sample(sd3, PROMPTS[:2], eta=window, **common)
    ode = sampler.sample(sd3, PROMPTS[:2], eta=0.0, **common)
    assert traj.eta == window
    assert (traj.log_probs[:, [0, 3, 4]] == 0).all() and (traj.log_probs[:, [1, 2]] != 0).all()
    assert torch.equal(traj.latents[:, :2], ode.latents[:, :2])  # identical until the window's first draw
    assert not torch.allclose(traj.latents[:, -1], ode.latents[:, -1])
    for i in range(5):
        assert (sampler.log_prob(sd3, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5


def test_a_recomputation_by_another_step_policy_fails(sd3):
    traj = FlowSampler().sample(sd3, PROMPTS[:1], num_steps=2, guidance_scale=1.0, eta=0.7, seeds=[0],
                                output="latents", **TEXT)  # fmt: skip
    with pytest.raises(ValueError, match="'flow' sampler, not 'flow_cps'"):
        FlowSampler(sde_type="cps").log_prob(sd3, traj, 0)


# ----------------------------------------------------------------------------------------------------------
# Differentiable mode and hooks


def transformer_grads(pipe, loss):
    pipe.transformer.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in pipe.transformer.parameters() if p.grad is not None])


def test_gradient_of_the_last_step_equals_a_hand_written_chain(sd3):
    # DRaFT-1 through the ODE: only the last step's transformer call keeps a graph; by hand, the loss of
    # x' = x + dt·v(x) with v from the same guided call
    sampler = FlowSampler()
    settings = {"num_steps": 3, "guidance_scale": 3.0, "eta": 0.0, "seeds": [3, 4], **TEXT}
    traj = sampler.sample(sd3, PROMPTS[:2], grad=GradPolicy("last", k=1), **settings)
    assert traj.grad_steps == [2] and traj.images.requires_grad
    ours = transformer_grads(sd3, traj.images.mean())

    from diffrl.models import model_family
    from diffrl.models.base import Conditioning, decode_latents

    x = traj.latents[:, 2]
    cond = Conditioning.from_trajectory(traj)
    v = model_family(sd3).model_output(x, traj.timesteps[2], cond, 3.0, torch.float32)
    schedule = sampler.schedule(sd3, 3, SHAPE[1:])
    x_0 = x + (schedule.sigmas[3] - schedule.sigmas[2]) * v
    reference = transformer_grads(sd3, decode_latents(sd3, x_0).mean())
    assert ours.abs().max() > 0 and torch.allclose(ours, reference, atol=1e-6, rtol=1e-4)


def test_checkpointing_gives_the_same_gradient_and_noise_optimisation_reaches_the_start(flux):
    sampler = FlowSampler()
    settings = {"num_steps": 3, "guidance_scale": 3.5, "eta": 0.7, "seeds": [1, 2], "height": 16, "width": 16,
                **TEXT}  # fmt: skip
    plain = transformer_grads(flux, sampler.sample(flux, PROMPTS[:2], grad=GradPolicy("all"), **settings).images.mean())
    checkpointed = sampler.sample(flux, PROMPTS[:2], grad=GradPolicy("all", checkpoint=True), **settings)
    assert torch.allclose(plain, transformer_grads(flux, checkpointed.images.mean()), atol=1e-7, rtol=1e-5)
    x_1 = start_latents(2).requires_grad_(True)
    traj = sampler.sample(flux, PROMPTS[:2], latents=x_1, grad=GradPolicy("all"), **{**settings, "seeds": None})
    traj.images.mean().backward()
    assert x_1.grad is not None and x_1.grad.abs().max() > 0
    flux.transformer.zero_grad(set_to_none=True)


def test_no_grad_policy_builds_no_graph(sd3):
    traj = FlowSampler().sample(sd3, PROMPTS[:1], num_steps=2, guidance_scale=3.0, eta=0.7, seeds=[0], **TEXT)
    assert not traj.images.requires_grad and traj.grad_steps == []


def test_hooks_replace_the_velocity_and_the_next_latents(sd3):
    sampler = FlowSampler()
    settings = {"num_steps": 4, "guidance_scale": 4.0, "seeds": [1, 2], "output": "latents", **TEXT}
    # v = 0 makes the ODE stand still, without a single transformer call
    still = sampler.sample(sd3, PROMPTS[:2], eta=0.0, hooks=[StepHook(before=lambda c: torch.zeros_like(c.x_t))],
                           **settings)  # fmt: skip
    assert torch.equal(still.latents[:, -1], still.latents[:, 0]) and still.nfe == 0
    # taking the mean instead of the draw is rescored: log p = −log std − ½ log 2π at every stochastic step
    traj = sampler.sample(sd3, PROMPTS[:2], eta=0.7, hooks=[StepHook(after=lambda c: StepEdit(prev_sample=c.step.mean))],
                          **settings)  # fmt: skip
    schedule = sampler.schedule(sd3, 4, SHAPE[1:])
    for i in range(4):
        std = schedule.constants(i, 0.7, "sde").std
        assert traj.log_probs[:, i].tolist() == pytest.approx([-math.log(std) - 0.5 * math.log(2 * math.pi)] * 2,
                                                              abs=1e-5)  # fmt: skip
        assert (sampler.log_prob(sd3, traj, i) - traj.log_probs[:, i]).abs().max() <= 1e-5
    # resampling re-indexes the particles' history
    swap = StepHook(after=lambda c: StepEdit(ancestors=torch.tensor([1, 1])) if c.step_index == 1 else None)
    resampled = sampler.sample(sd3, PROMPTS[:2], eta=0.7, hooks=[swap], **settings)
    assert torch.equal(resampled.latents[0, :3], resampled.latents[1, :3]) and resampled.prompts == [PROMPTS[1]] * 2


# ----------------------------------------------------------------------------------------------------------
# The factory and bad input


def test_auto_picks_the_flow_sampler_and_samplers_refuse_the_wrong_pipeline(sd3, flux, tiny_sd):
    assert resolve_sampler_name(sd3) == resolve_sampler_name(flux) == "flow"
    assert get_sampler("auto", sd3).name == "flow" and get_sampler("flow_cps", flux).sde_type == "cps"
    with pytest.raises(UserError, match="use flow"):
        get_sampler("ddim", sd3)
    with pytest.raises(UserError, match="use ddim"):
        get_sampler("flow", tiny_sd)
    with pytest.raises(UserError, match="flow-matching pipeline"):
        FlowSampler().sample(tiny_sd, PROMPTS[:1], num_steps=2, guidance_scale=1.0, eta=0.0)


def test_bad_input_is_one_line(flux, sd3):
    with pytest.raises(UserError, match="negative prompts"):
        FlowSampler().sample(flux, PROMPTS[:1], num_steps=2, guidance_scale=3.5, eta=0.0, negative_prompt="blurry",
                             height=16, width=16)  # fmt: skip
    with pytest.raises(UserError, match="height=18 is not a multiple of 4"):
        FlowSampler().sample(flux, PROMPTS[:1], num_steps=2, guidance_scale=3.5, eta=0.0, height=18, width=16)
    with pytest.raises(UserError, match="latents must have shape"):
        FlowSampler().sample(sd3, PROMPTS[:1], num_steps=2, guidance_scale=1.0, eta=0.0, latents=start_latents(2))
    with pytest.raises(UserError, match="eta must be >= 0"):
        FlowSampler().sample(sd3, PROMPTS[:1], num_steps=2, guidance_scale=1.0, eta=-0.1)
    with pytest.raises(UserError, match="sde_type"):
        FlowSampler(sde_type="ode")
