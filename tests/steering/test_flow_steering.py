"""Steering on flow-matching pipelines (SD3, FLUX class) through `FlowProcess`.

The tiny random SD3 and FLUX pipelines of `samplers.testing` are checked against the flow sampler's own `sample`
(same seeds: same images and final latents), against diffusers' pipelines (the ODE), and for the evaluations each
method spends. The rewards are what a random model can move: mean brightness (×100, differentiable). The last test,
slow and skipped until the embedded `tiny-shapes-flow` is built, checks that steering raises the ShapesWorld verifier.
"""

import argparse
import json

import pytest
import torch
from steer_toy import Brightness
from tiny_models import embedded_or_skip, tiny_flux_pipeline, tiny_sd3_pipeline

from diffrl.errors import UserError
from diffrl.steering import steer
from diffrl.steering.core import SteerContext, rows_per_prompt, sample_chain
from diffrl.steering.flow_process import FlowProcess
from diffrl.steering.guidance import guided_velocity
from samplers.flow import FlowSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
STEPS = 6
SHAPE = (4, 8, 8)  # latents of 16x16 images, for both tiny pipelines
T5_TOKENS = 16  # the prompts are shorter; keeps the transformer calls small


def _flow_pipeline(build):
    pipe = build()
    # the config key `load_pipeline` registers for a flow model's T5 length; the flow pieces read it by default
    pipe.register_to_config(_diffrl_max_sequence_length=T5_TOKENS)
    return pipe


@pytest.fixture(scope="module")
def sd3():
    return _flow_pipeline(tiny_sd3_pipeline)


@pytest.fixture(scope="module")
def flux():
    return _flow_pipeline(tiny_flux_pipeline)


# per pipeline: its fixture, a guidance scale it uses (SD3: CFG; FLUX: the embedded guidance) and the image size
# (FLUX's default is its transformer's 128-latent sample size)
PIPELINES = {"sd3": {"guidance_scale": 4.5}, "flux": {"guidance_scale": 3.5, "height": 16, "width": 16}}


@pytest.fixture(params=list(PIPELINES))
def flow_pipe(request):
    return request.getfixturevalue(request.param), dict(PIPELINES[request.param])


# ----------------------------------------------------------------------------------------------------------
# The unsteered chain is the flow sampler's


@pytest.mark.parametrize("sampler", ["flow", "flow_cps"])
def test_unsteered_chain_is_the_flow_samplers_for_the_same_seed(flow_pipe, sampler):
    # One prompt per call: the steering generator's draws (x_1, then the noise of each stochastic step) are then
    # exactly the draws of the sampler's per-sample generator seeded alike, so the SDE chains must agree bit for bit.
    pipe, common = flow_pipe
    settings = {"num_steps": STEPS, "eta": 0.7, "sampler": sampler, **common}
    for prompt in PROMPTS[:2]:
        for seed in (0, 1):
            ref = FlowSampler(sde_type="sde" if sampler == "flow" else "cps").sample(
                pipe, [prompt], seeds=[seed], **{k: v for k, v in settings.items() if k != "sampler"}
            )
            images, _, info = steer(pipe, [prompt], Brightness(), "best-of-n", seed=seed, num_samples=1, **settings)
            assert torch.equal(images, ref.images), (prompt, seed)
            assert info["sampler"] == sampler and info["nfe"] == STEPS
            process = FlowProcess(pipe, [prompt], **settings)
            generator = torch.Generator().manual_seed(seed)
            cond = rows_per_prompt(1, 1)
            x_1 = process.initial_latents(cond, generator)
            final = sample_chain(SteerContext(process, Brightness(), [prompt]), x_1, cond, generator)
            assert torch.equal(final, ref.final_latents) and torch.equal(x_1, ref.latents[:, 0])


def test_ode_chain_is_the_sd3_pipelines_own_output(sd3):
    # eta = 0 is the ODE: from the same x_1, a whole batch (with CFG and a negative prompt) lands where diffusers'
    # StableDiffusion3Pipeline does, latents and images
    x_1 = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(1))
    common = {"num_inference_steps": STEPS, "guidance_scale": 5.0, "latents": x_1, "max_sequence_length": T5_TOKENS}
    negative = ["blurry"] * 3
    ref = sd3(PROMPTS, negative_prompt=negative, output_type="latent", **common).images
    ref_images = sd3(PROMPTS, negative_prompt=negative, output_type="pt", **common).images
    process = FlowProcess(sd3, PROMPTS, num_steps=STEPS, guidance_scale=5.0, eta=0.0, negative_prompt="blurry")
    ctx = SteerContext(process, Brightness(), PROMPTS)
    final = sample_chain(ctx, x_1, torch.arange(3))
    assert (final - ref).abs().max() <= 1e-5
    assert (process.decode(final) - ref_images).abs().max() <= 1e-5
    assert not process.stochastic and ctx.nfe == 3 * STEPS  # a CFG pair counts once


def test_ode_chain_is_the_flux_pipelines_own_output(flux):
    from diffrl.models.flux import pack

    x_1 = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(2))
    ref = flux(PROMPTS[:2], num_inference_steps=STEPS, guidance_scale=3.5, latents=pack(x_1), height=16, width=16,
               max_sequence_length=T5_TOKENS, output_type="latent").images  # fmt: skip
    process = FlowProcess(flux, PROMPTS[:2], num_steps=STEPS, guidance_scale=3.5, eta=0.0, height=16, width=16)
    final = sample_chain(SteerContext(process, Brightness(), PROMPTS[:2]), x_1, torch.arange(2))
    assert (pack(final) - ref).abs().max() <= 1e-5


def test_flow_process_pred_x0_is_x_minus_sigma_v(sd3):
    process = FlowProcess(sd3, PROMPTS[:1], num_steps=4, guidance_scale=1.0)
    x, v = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    for i in range(4):
        torch.testing.assert_close(process.pred_x0(v, i, x), x - process.schedule.sigmas[i] * v)
    assert process.schedule.sigmas[0] == 1.0 and process.guidance_coefficient(0) == 0.0


# ----------------------------------------------------------------------------------------------------------
# The methods: refusals and evaluation counts


@pytest.mark.parametrize("method", ["fk", "svdd"])
def test_fk_and_svdd_refuse_the_ode(sd3, method):
    with pytest.raises(UserError, match="needs a stochastic sampler") as error:
        steer(sd3, PROMPTS[:1], Brightness(), method, num_steps=STEPS, eta=0.0)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "method, cfg, sampler, nfe_per_prompt, reward_evals_per_prompt",
    [
        ("best-of-n", {"num_samples": 4}, "flow", 4 * STEPS, 4),
        # scheduled steps 0, 2, 4 (the last step is never scheduled) + the final score, for 3 particles
        ("fk", {"num_particles": 3, "interval": 2}, "flow", 3 * STEPS, 3 * 4),
        # 1 + (T − 1)·M model calls; the SDE's last step (σ → 0) is stochastic, std a·√(σ/(1 − σ))·√σ > 0, so all M
        # candidates are scored at every step
        ("svdd", {"num_candidates": 3}, "flow", 1 + (STEPS - 1) * 3, STEPS * 3),
        # CPS's last step has std σ'·sin(aπ/2) = 0 at σ' = 0: one candidate there
        ("svdd", {"num_candidates": 3}, "flow_cps", 1 + (STEPS - 1) * 3, (STEPS - 1) * 3 + 1),
    ],
)
def test_value_methods_run_and_count_evaluations(flow_pipe, method, cfg, sampler, nfe_per_prompt,
                                                 reward_evals_per_prompt):  # fmt: skip
    pipe, common = flow_pipe
    images, scores, info = steer(pipe, PROMPTS, Brightness(), method, num_steps=STEPS, seed=0, sampler=sampler,
                                 **common, **cfg)  # fmt: skip
    assert images.shape == (len(PROMPTS), 3, 16, 16) and scores.shape == (len(PROMPTS),)
    # the scores returned are the reward of the images returned
    torch.testing.assert_close(scores, Brightness()(images, PROMPTS).scores)
    assert info["nfe_per_prompt"] == nfe_per_prompt and info["reward_evals_per_prompt"] == reward_evals_per_prompt
    assert info["sampler"] == sampler and info["eta"] == 0.7 and info["num_steps"] == STEPS  # the flow default a


def test_steer_defaults_come_from_the_flow_sampler(sd3):
    _, _, info = steer(sd3, PROMPTS[:1], Brightness(), "best-of-n", num_samples=1)
    assert info["num_steps"] == FlowSampler.default_num_steps and info["nfe"] == FlowSampler.default_num_steps
    assert info["guidance_scale"] == FlowSampler.default_guidance_scale and info["eta"] == 0.7


# ----------------------------------------------------------------------------------------------------------
# Reward guidance in velocity space


@pytest.mark.parametrize("sigma", [0.9, 0.5, 0.2])
def test_guided_velocity_is_the_tilted_models_velocity_for_gaussian_data(sigma):
    # Data x0 ~ N(m, s²) in 1-D, x = (1 − σ)·x0 + σ·ε: x ~ N((1 − σ)m, V), V = (1 − σ)²s² + σ², and the exact velocity
    #   v(x) = E[ε | x] − E[x0 | x] = σ/V·(x − (1 − σ)m) − [m + (1 − σ)s²/V·(x − (1 − σ)m)].
    # The reward r(x0) = a·x0 tilts the data to p(x0)·exp(γ·r(x0)) = N(m + γ·a·s², s²): its velocity is v(x) with
    # m replaced. DPS's gradient is ∇_x r(x̂0(x)) = a·(1 − σ)s²/V. Guidance must turn v into the tilted velocity.
    m, s, a, gamma = 0.5, 0.8, 1.5, 0.7
    V = (1 - sigma) ** 2 * s**2 + sigma**2

    def velocity(x, mean):
        centred = x - (1 - sigma) * mean
        return sigma / V * centred - (mean + (1 - sigma) * s**2 / V * centred)

    x = torch.tensor([-1.0, 0.3, 2.0], dtype=torch.float64)
    reward_grad = torch.full_like(x, a * (1 - sigma) * s**2 / V)
    guided = guided_velocity(velocity(x, m), reward_grad, sigma, gamma)
    torch.testing.assert_close(guided, velocity(x, m + gamma * a * s**2))


def test_guided_velocity_by_hand():
    # σ = 0.75: c = 0.75/0.25 = 3; v − γ·c·g = 1 − 0.5·3·2 = −2. At σ = 1 (pure noise) v is left as it is.
    assert guided_velocity(torch.ones(1), torch.full((1,), 2.0), 0.75, 0.5).item() == pytest.approx(-2.0)
    assert guided_velocity(torch.ones(1), torch.full((1,), 2.0), 1.0, 0.5).item() == 1.0


def test_reward_guidance_raises_the_reward_of_the_same_chain(flow_pipe):
    # One chain per prompt from the same seed draws the same x_1 and step noise as plain sampling, so the comparison
    # is paired: any gain is the guidance itself.
    pipe, common = flow_pipe
    settings = {"num_steps": STEPS, "seed": 0, **common}
    _, plain, _ = steer(pipe, PROMPTS, Brightness(), "best-of-n", num_samples=1, **settings)
    _, guided, info = steer(pipe, PROMPTS, Brightness(), "guidance", scale=1.0, **settings)
    assert (guided > plain).all(), (guided, plain)
    # step 0 is at σ = 1 (pure noise), where the velocity shift is 0: it is not guided and spends no gradient
    assert info["guided_steps"] == list(range(1, STEPS))
    assert info["nfe_grad"] == len(PROMPTS) * (STEPS - 1) and info["backward_passes"] == STEPS - 1
    _, same, _ = steer(pipe, PROMPTS, Brightness(), "guidance", scale=0.0, **settings)
    torch.testing.assert_close(same, plain)


def test_guidance_only_at_pure_noise_is_refused(sd3):
    with pytest.raises(UserError, match="pure noise"):
        steer(sd3, PROMPTS[:1], Brightness(), "guidance", num_steps=STEPS, start=0, end=0)


# ----------------------------------------------------------------------------------------------------------
# ReNO through a few ODE steps


def test_reno_optimises_the_noise_of_a_few_step_ode(flow_pipe):
    pipe, common = flow_pipe
    settings = {"num_steps": 3, "eta": 0.0, "seed": 0, **common}
    _, scores, info = steer(pipe, PROMPTS[:2], Brightness(), "reno", iterations=5, **settings)
    history = info["objective_per_iteration"]
    assert len(history) == 5 and history[-1] > history[0]
    # the first evaluation is the plain ODE sample of the same x_1, and ReNO keeps the best seen
    _, plain, _ = steer(pipe, PROMPTS[:2], Brightness(), "best-of-n", num_samples=1, **settings)
    assert history[0] == pytest.approx(float(plain.mean()), abs=1e-4)
    assert (scores >= plain - 1e-4).all() and scores.mean() > plain.mean()
    # 5 generations of 3 steps per prompt, all but the last with a graph
    assert info["nfe_per_prompt"] == 5 * 3 and info["nfe_grad"] == 4 * 3 * 2 and info["backward_passes"] == 4


def test_reno_defaults_to_a_few_flow_steps(sd3):
    _, _, info = steer(sd3, PROMPTS[:1], Brightness(), "reno", iterations=2)
    assert info["num_steps"] == FlowProcess.reno_num_steps and info["nfe"] == 2 * FlowProcess.reno_num_steps


# ----------------------------------------------------------------------------------------------------------
# `diffrl steer` on a flow pipeline folder


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd3")
    tiny_sd3_pipeline(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_diffrl_max_sequence_length"] = T5_TOKENS  # as the embedded flow model's folder says it
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def _parse(argv):
    from diffrl.steering.cli import add_steer_arguments

    parser = argparse.ArgumentParser(prog="diffrl steer")
    add_steer_arguments(parser)
    return parser.parse_args(argv)


def test_steer_cli_runs_a_recipe_on_a_flow_pipeline(sd3_folder, tmp_path):
    from diffrl.steering.cli import steer_cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"method: fk\npipeline: {sd3_folder}\nreward: steer_toy:brightness\nprompts: [a red circle, a blue square]\n"
        "sample: {num_steps: 4, guidance_scale: 4.5}\nsteer: {num_particles: 2, interval: 1}\n"
    )
    out = tmp_path / "out"
    assert steer_cli(_parse(["--recipe", str(recipe), "--out", str(out), "--device", "cpu"])) == 0
    records = json.loads((out / "scores.json").read_text())
    assert len(records) == 2 and all(r["nfe"] == 2 * 4 and 0 < r["brightness"] < 100 for r in records)
    call = json.loads((out / "settings.json").read_text())["per_call"][0]
    assert call["sampler"] == "flow" and call["eta"] == 0.7  # no eta in the recipe: the flow default
    # the ODE has nothing for FK to resample: refused before any sampling
    with pytest.raises(UserError, match="needs a stochastic sampler"):
        steer_cli(_parse(["--recipe", str(recipe), "--out", str(tmp_path / "ode"), "--eta", "0", "--device", "cpu"]))


# ----------------------------------------------------------------------------------------------------------
# The embedded flow model: steering raises the ShapesWorld verifier (slow; skipped until it is built)

SHAPES_PROMPTS = 16
SHAPES_STEPS = 20
SHAPES_COMMON = {"num_steps": SHAPES_STEPS, "guidance_scale": 4.5, "eta": 0.7}  # the SDE: FK needs eta > 0


@pytest.fixture(scope="module")
def shapes_flow():
    from diffrl.prompts import load_prompts
    from rewards import get_reward

    pipe = embedded_or_skip("tiny-shapes-flow")
    prompts = load_prompts("shapes:heldout")[:SHAPES_PROMPTS]
    return pipe, prompts, get_reward("shapes_verifier")


@pytest.mark.slow
@pytest.mark.parametrize("method, cfg", [
    ("best-of-n", {"num_samples": 4}),
    # systematic resampling: with 4 particles, multinomial draws duplicate one ancestor more often than needed
    ("fk", {"num_particles": 4, "lmbda": 10.0, "potential": "max", "start": 5, "interval": 5,
            "resampling": "systematic"}),
])
def test_value_methods_raise_the_verifier_score_of_tiny_shapes_flow(shapes_flow, method, cfg):
    pipe, prompts, verifier = shapes_flow
    plain = torch.cat([steer(pipe, prompts, verifier, "best-of-n", seed=s, num_samples=1, **SHAPES_COMMON)[1]
                       for s in (0, 1)])
    _, scores, info = steer(pipe, prompts, verifier, method, seed=0, **SHAPES_COMMON, **cfg)
    assert scores.mean() > plain.mean(), (method, float(scores.mean()), float(plain.mean()))
    assert info["sampler"] == "flow" and info["nfe_per_prompt"] == 4 * SHAPES_STEPS
