"""DDIMSampler against diffusers' own pipeline, the closed form, and its own recomputation."""

import math

import pytest
import torch
from tiny_models import tiny_sd_pipeline, tiny_sdxl_pipeline

from diffrl.errors import UserError
from samplers.ddim import DDIMSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SHAPE = (4, 8, 8)


def start_latents(batch=3, seed=1):
    return torch.randn(batch, *SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "guidance_scale, negative_prompt", [(1.0, None), (5.0, None), (5.0, "blurry"), (7.5, ["a", "b c", "d"])]
)
def test_eta0_reproduces_the_diffusers_pipeline(tiny_sd, guidance_scale, negative_prompt):
    x_T = start_latents()
    negative = [negative_prompt] * 3 if isinstance(negative_prompt, str) else negative_prompt
    ref = tiny_sd(
        PROMPTS,
        num_inference_steps=10,
        guidance_scale=guidance_scale,
        eta=0.0,
        latents=x_T,
        negative_prompt=negative,
        output_type="latent",
    ).images
    ref_images = tiny_sd(
        PROMPTS,
        num_inference_steps=10,
        guidance_scale=guidance_scale,
        eta=0.0,
        latents=x_T,
        negative_prompt=negative,
        output_type="pt",
    ).images
    traj = DDIMSampler().sample(
        tiny_sd,
        PROMPTS,
        num_steps=10,
        guidance_scale=guidance_scale,
        eta=0.0,
        latents=x_T,
        negative_prompt=negative_prompt,
    )
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert (traj.images - ref_images).abs().max() <= 1e-5
    assert traj.latents.shape == (3, 11, *SHAPE) and traj.log_probs.shape == (3, 10)
    assert traj.images.shape == (3, 3, 16, 16) and traj.images.dtype == torch.float32
    assert torch.equal(traj.latents[:, 0], x_T)
    assert traj.log_probs.abs().max() == 0  # eta = 0: every step is a point mass
    assert (traj.negative_prompt_embeds is not None) == (guidance_scale > 1)


def test_eta0_reproduces_a_v_prediction_pipeline():
    pipe = tiny_sd_pipeline(prediction_type="v_prediction")
    x_T = start_latents()
    ref = pipe(PROMPTS, num_inference_steps=8, guidance_scale=4.0, eta=0.0, latents=x_T, output_type="latent").images
    traj = DDIMSampler().sample(pipe, PROMPTS, num_steps=8, guidance_scale=4.0, eta=0.0, latents=x_T, output="latents")
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert traj.images is None


def test_eta1_with_per_sample_seeds_reproduces_the_pipeline_with_a_generator_list(tiny_sd):
    # diffusers draws sample i's start noise, then its step noise, from generator i; so do we, from seed i
    seeds = [11, 22, 33]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    ref = tiny_sd(
        PROMPTS, num_inference_steps=10, guidance_scale=5.0, eta=1.0, generator=generators, output_type="latent"
    ).images
    traj = DDIMSampler().sample(tiny_sd, PROMPTS, num_steps=10, guidance_scale=5.0, eta=1.0, seeds=seeds)
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert traj.seeds == seeds
    assert (traj.log_probs != 0).all()  # σ_t > 0 on every step of the SD schedule (set_alpha_to_one=False)


def test_stored_log_prob_equals_closed_form_from_the_unet(tiny_sd):
    sampler = DDIMSampler()
    traj = sampler.sample(tiny_sd, PROMPTS, num_steps=5, guidance_scale=3.0, eta=1.0, seeds=[0, 1, 2])
    scheduler = tiny_sd.scheduler
    alphas = scheduler.alphas_cumprod.double()
    with torch.no_grad():
        embeds = torch.cat([traj.negative_prompt_embeds, traj.prompt_embeds])
        for i, t in enumerate(traj.timesteps.tolist()):
            x_t = traj.latents[:, i]
            out = tiny_sd.unet(torch.cat([x_t, x_t]), t, encoder_hidden_states=embeds).sample.double()
            eps = out[3:] * 3.0 - out[:3] * 2.0  # ε_u + 3 (ε_c − ε_u)
            prev = t - 1000 // 5
            a_t = alphas[t].item()
            a_prev = alphas[prev].item() if prev >= 0 else alphas[0].item()  # set_alpha_to_one=False
            sigma = math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
            pred_x0 = (x_t.double() - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
            mean = math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev - sigma**2) * eps
            expected = torch.distributions.Normal(mean, sigma).log_prob(traj.latents[:, i + 1].double())
            assert torch.allclose(traj.log_probs[:, i].double(), expected.mean(dim=(1, 2, 3)), atol=1e-5), i


def test_recomputed_log_probs_equal_the_rollout_for_any_batch_composition(tiny_sd):
    sampler = DDIMSampler()
    batch = PROMPTS + ["a yellow star", "three circles"]
    traj = sampler.sample(
        tiny_sd, batch, num_steps=6, guidance_scale=5.0, eta=1.0, seeds=[5, 6, 7, 8, 9], negative_prompt="ugly"
    )
    with torch.no_grad():
        for i in range(6):
            full = sampler.log_prob(tiny_sd, traj, i)
            assert (full - traj.log_probs[:, i]).abs().max() <= 1e-5
            shuffled = [4, 2, 0, 3, 1]
            assert (
                sampler.log_prob(tiny_sd, traj, i, indices=shuffled) - traj.log_probs[shuffled, i]
            ).abs().max() <= 1e-5
            sub = traj.select([3, 1])
            assert (sampler.log_prob(tiny_sd, sub, i) - traj.log_probs[[3, 1], i]).abs().max() <= 1e-5
            one = sampler.log_prob(tiny_sd, traj, i, indices=[2])
            assert one.shape == (1,) and (one - traj.log_probs[2, i]).abs().max() <= 1e-5


def test_log_prob_return_step_gives_mean_and_std(tiny_sd):
    sampler = DDIMSampler()
    traj = sampler.sample(tiny_sd, PROMPTS, num_steps=4, guidance_scale=5.0, eta=0.7, output="latents")
    with torch.no_grad():
        step = sampler.log_prob(tiny_sd, traj, 2, return_step=True)
    schedule = sampler.schedule(tiny_sd, 4)
    assert step.std.item() == pytest.approx(schedule.constants(2, 0.7).std)
    assert torch.equal(step.prev_sample, traj.latents[:, 3])
    z = (traj.latents[:, 3] - step.mean) / step.std  # the rollout's own noise, recovered
    assert z.std().item() == pytest.approx(1.0, abs=0.2)


def test_a_sample_does_not_depend_on_its_batch(tiny_sd):
    sampler = DDIMSampler()
    kwargs = {"num_steps": 6, "guidance_scale": 5.0, "eta": 1.0}
    big = sampler.sample(tiny_sd, PROMPTS, seeds=[1, 2, 3], **kwargs)
    small = sampler.sample(tiny_sd, [PROMPTS[2], PROMPTS[0]], seeds=[3, 1], **kwargs)
    alone = sampler.sample(tiny_sd, [PROMPTS[1]], seeds=[2], **kwargs)
    # Same noise, so the only differences left are float rounding: CPU kernels block a batch of 1, 2 or 3
    # differently (~1e-7 relative per op, grown over 6 steps of a random UNet whose latents reach |x| ~ 10).
    # Noise that depended on the batch would differ by O(1).
    scale = big.latents.abs().max()
    assert (small.latents - big.latents[[2, 0]]).abs().max() <= 1e-5 * scale
    assert (alone.latents[0] - big.latents[1]).abs().max() <= 1e-5 * scale
    assert (small.log_probs - big.log_probs[[2, 0]]).abs().max() <= 1e-5
    assert (alone.log_probs[0] - big.log_probs[1]).abs().max() <= 1e-5


def test_seeding_defaults_and_generators(tiny_sd):
    sampler = DDIMSampler()
    kwargs = {"num_steps": 3, "guidance_scale": 1.0, "eta": 1.0, "output": "latents"}
    torch.manual_seed(0)
    a = sampler.sample(tiny_sd, PROMPTS, **kwargs)
    torch.manual_seed(0)
    b = sampler.sample(tiny_sd, PROMPTS, **kwargs)
    assert a.seeds == b.seeds and len(set(a.seeds)) == 3 and torch.equal(a.latents, b.latents)
    c = sampler.sample(tiny_sd, PROMPTS, generator=torch.Generator().manual_seed(4), **kwargs)
    d = sampler.sample(tiny_sd, PROMPTS, seeds=c.seeds, **kwargs)
    assert torch.equal(c.latents, d.latents)
    with pytest.raises(UserError, match="not both"):
        sampler.sample(tiny_sd, PROMPTS, seeds=[1, 2, 3], generator=torch.Generator(), **kwargs)
    with pytest.raises(UserError, match="3 seeds"):
        sampler.sample(tiny_sd, PROMPTS[:2], seeds=[1, 2, 3], **kwargs)


def test_precomputed_embeddings_give_the_same_samples(tiny_sd):
    sampler = DDIMSampler()
    kwargs = {"num_steps": 4, "guidance_scale": 5.0, "eta": 1.0, "seeds": [1, 2, 3], "output": "latents"}
    with torch.no_grad():
        embeds, negative = tiny_sd.encode_prompt(PROMPTS, "cpu", 1, True, None)
    from_text = sampler.sample(tiny_sd, PROMPTS, **kwargs)
    cached = sampler.sample(tiny_sd, None, prompt_embeds=embeds, negative_prompt_embeds=negative[:1], **kwargs)
    # not bit-equal on every CPU: the text encoder's batch of 3 and the cached [1] negative take different kernels,
    # whose last bits differ on the generic/SSE paths (ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 …)
    assert (from_text.latents - cached.latents).abs().max() <= 1e-3
    assert cached.prompts == ["", "", ""]


def test_bad_input_raises_user_errors(tiny_sd):
    sampler = DDIMSampler()
    with pytest.raises(UserError, match="latents must have shape"):
        sampler.sample(tiny_sd, PROMPTS, num_steps=2, guidance_scale=1.0, eta=0.0, latents=torch.zeros(3, 4, 4, 4))
    with pytest.raises(UserError, match="eta"):
        sampler.sample(tiny_sd, PROMPTS, num_steps=2, guidance_scale=1.0, eta=-1.0)
    with pytest.raises(UserError, match="negative prompts"):
        sampler.sample(tiny_sd, PROMPTS, num_steps=2, guidance_scale=5.0, eta=0.0, negative_prompt=["a", "b"])
    with pytest.raises(UserError, match="prompts or prompt_embeds"):
        sampler.sample(tiny_sd, None, num_steps=2, guidance_scale=5.0, eta=0.0)


def test_wrong_sampler_or_schedule_for_log_prob_fails(tiny_sd):
    sampler = DDIMSampler()
    traj = sampler.sample(tiny_sd, PROMPTS[:1], num_steps=3, guidance_scale=1.0, eta=1.0, output="latents")
    traj.sampler = "lcm"
    with pytest.raises(ValueError, match="lcm"):
        sampler.log_prob(tiny_sd, traj, 0)
    traj.sampler = "ddim"
    with pytest.raises(IndexError):
        sampler.log_prob(tiny_sd, traj, 3)
    traj.timesteps = traj.timesteps + 1
    with pytest.raises(ValueError, match="timesteps"):
        sampler.log_prob(tiny_sd, traj, 0)


def test_final_step_is_deterministic_when_set_alpha_to_one():
    pipe = tiny_sd_pipeline()
    from diffusers import DDIMScheduler

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, set_alpha_to_one=True)
    sampler = DDIMSampler()
    traj = sampler.sample(pipe, PROMPTS, num_steps=4, guidance_scale=1.0, eta=1.0, output="latents")
    assert (traj.log_probs[:, :-1] != 0).all() and traj.log_probs[:, -1].abs().max() == 0
    with torch.no_grad():
        assert sampler.log_prob(pipe, traj, 3).abs().max() == 0
        assert (sampler.log_prob(pipe, traj, 2) - traj.log_probs[:, 2]).abs().max() <= 1e-5


def test_public_step_matches_the_rollout(tiny_sd):
    sampler = DDIMSampler()
    traj = sampler.sample(tiny_sd, PROMPTS, num_steps=4, guidance_scale=1.0, eta=1.0, output="latents")
    t = traj.timesteps[1]
    with torch.no_grad():
        eps = tiny_sd.unet(traj.latents[:, 1], t, encoder_hidden_states=traj.prompt_embeds).sample
    out = sampler.step(eps, t, traj.latents[:, 1], eta=1.0, prev_sample=traj.latents[:, 2])
    assert (out.log_prob - traj.log_probs[:, 1]).abs().max() <= 1e-5
    drawn = sampler.step(eps, int(t), traj.latents[:, 1], eta=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(
        (drawn.prev_sample - drawn.mean) / drawn.std,
        torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(0)),
        atol=1e-4,
    )


def test_unet_in_bfloat16_keeps_fp32_step_math():
    pipe = tiny_sd_pipeline()
    pipe.unet.to(torch.bfloat16)
    sampler = DDIMSampler()
    traj = sampler.sample(pipe, PROMPTS, num_steps=4, guidance_scale=5.0, eta=1.0, seeds=[1, 2, 3])
    assert traj.latents.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all() and torch.isfinite(traj.images).all()
    with torch.no_grad():
        assert (sampler.log_prob(pipe, traj, 1) - traj.log_probs[:, 1]).abs().max() <= 1e-5


def test_sdxl_eta0_reproduces_the_pipeline_and_recomputes():
    pipe = tiny_sdxl_pipeline()
    x_T = start_latents()
    ref = pipe(PROMPTS, num_inference_steps=6, guidance_scale=5.0, eta=0.0, latents=x_T, output_type="latent").images
    sampler = DDIMSampler()
    traj = sampler.sample(pipe, PROMPTS, num_steps=6, guidance_scale=5.0, eta=0.0, latents=x_T)
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert traj.pooled_prompt_embeds.shape == (3, 16) and traj.add_time_ids.tolist()[0] == [16, 16, 0, 0, 16, 16]
    stochastic = sampler.sample(pipe, PROMPTS, num_steps=6, guidance_scale=5.0, eta=1.0, output="latents")
    with torch.no_grad():
        for i in (0, 5):
            recomputed = sampler.log_prob(pipe, stochastic, i, indices=[2, 0])
            assert (recomputed - stochastic.log_probs[[2, 0], i]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "config",
    [
        {"timestep_spacing": "trailing", "prediction_type": "v_prediction", "rescale_betas_zero_snr": True},
        {"timestep_spacing": "linspace", "clip_sample": True, "clip_sample_range": 2.0},
    ],
)
def test_eta0_reproduces_other_scheduler_configs(config):
    from diffusers import DDIMScheduler

    pipe = tiny_sd_pipeline()
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, **config)
    x_T = start_latents()
    ref = pipe(PROMPTS, num_inference_steps=7, guidance_scale=3.0, eta=0.0, latents=x_T, output_type="latent").images
    traj = DDIMSampler().sample(pipe, PROMPTS, num_steps=7, guidance_scale=3.0, eta=0.0, latents=x_T, output="latents")
    assert (traj.latents[:, -1] - ref).abs().max() <= 1e-5
    assert torch.isfinite(traj.latents).all()


def test_decode_undoes_scaling_and_shift():
    from diffrl.models.base import decode_latents

    pipe = tiny_sd_pipeline()
    z = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = (pipe.vae.decode(z / pipe.vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)
        assert torch.equal(decode_latents(pipe, z), expected)
        pipe.vae.register_to_config(shift_factor=0.25, scaling_factor=0.5)
        expected = (pipe.vae.decode(z / 0.5 + 0.25).sample / 2 + 0.5).clamp(0, 1)
        assert torch.equal(decode_latents(pipe, z), expected)
        mean, std = [0.1, -0.2, 0.3, 0.0], [1.0, 2.0, 0.5, 1.5]
        pipe.vae.register_to_config(latents_mean=mean, latents_std=std)
        shaped = torch.tensor(mean).view(1, 4, 1, 1), torch.tensor(std).view(1, 4, 1, 1)
        expected = (pipe.vae.decode(z * shaped[1] / 0.5 + shaped[0]).sample / 2 + 0.5).clamp(0, 1)
        assert torch.equal(decode_latents(pipe, z), expected)


def test_per_step_eta_is_stochastic_only_where_eta_is_positive(tiny_sd):
    sampler = DDIMSampler()
    kwargs = {"num_steps": 5, "guidance_scale": 3.0, "seeds": [0, 1, 2]}
    # every step at η = 1 given as a tuple is exactly the scalar η = 1
    scalar = sampler.sample(tiny_sd, PROMPTS, eta=1.0, **kwargs)
    as_tuple = sampler.sample(tiny_sd, PROMPTS, eta=[1.0] * 5, **kwargs)
    assert torch.equal(scalar.latents, as_tuple.latents) and torch.equal(scalar.log_probs, as_tuple.log_probs)
    assert scalar.eta == 1.0 and as_tuple.eta == (1.0,) * 5
    # a window: steps 1 and 2 stochastic, 0, 3 and 4 deterministic
    window = (0.0, 1.0, 1.0, 0.0, 0.0)
    traj = sampler.sample(tiny_sd, PROMPTS, eta=window, **kwargs)
    assert traj.eta == window
    eta0 = sampler.sample(tiny_sd, PROMPTS, eta=0.0, **kwargs)
    assert torch.equal(traj.latents[:, 1], eta0.latents[:, 1])  # step 0: the deterministic DDIM step
    assert (traj.log_probs[:, [0, 3, 4]] == 0).all() and (traj.log_probs[:, [1, 2]] != 0).all()
    assert (traj.latents[:, 2] - eta0.latents[:, 2]).abs().max() > 1e-2  # step 1 drew noise
    with torch.no_grad():
        for i in range(5):
            step = sampler.log_prob(tiny_sd, traj, i, return_step=True)
            assert (step.log_prob - traj.log_probs[:, i]).abs().max() <= 1e-5, i
            if window[i] == 0:  # deterministic: the next latent is the step's mean
                assert float(step.std) == 0.0 and torch.allclose(step.mean, traj.latents[:, i + 1], atol=1e-6), i
            else:  # σ_t is DDIM's η = 1 value, the same as in the all-stochastic chain
                assert float(step.std) == float(sampler.log_prob(tiny_sd, scalar, i, return_step=True).std), i
    with pytest.raises(UserError, match="one per step"):
        sampler.sample(tiny_sd, PROMPTS, eta=[1.0, 0.0], **kwargs)
    with pytest.raises(UserError, match="eta must be >= 0"):
        sampler.sample(tiny_sd, PROMPTS, eta=[1.0, -1.0, 0.0, 0.0, 0.0], **kwargs)
