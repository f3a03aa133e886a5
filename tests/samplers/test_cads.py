"""CADS (samplers/cads.py): the schedule, noising and rescaling worked by hand, and the hook on every sampler."""

import json
import math

import numpy as np
import pytest
import torch
from cli_helpers import one_line_error
from PIL import Image

from diffrl.bench.cads import mean_pairwise_cosine_distance, paired_mean_and_se
from diffrl.cli import main
from diffrl.errors import UserError
from samplers.base import StepHook
from samplers.cads import (
    CADSConfig,
    CADSHook,
    anneal_condition,
    cads_gamma,
    noise_condition,
    parse_cads,
    rescale_condition,
)
from samplers.ddim import DDIMSampler
from samplers.flow import FlowSampler
from samplers.lcm import LCMSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SEEDS = [1, 2, 3]


# -- pure functions, worked by hand ------------------------------------------------------------------------


def test_gamma_is_one_then_linear_then_zero():
    # τ1 = 0.6, τ2 = 0.9: γ = (0.9 − t) / 0.3 between
    assert cads_gamma(0.0, 0.6, 0.9) == 1.0
    assert cads_gamma(0.6, 0.6, 0.9) == 1.0
    assert cads_gamma(0.75, 0.6, 0.9) == pytest.approx(0.5)
    assert cads_gamma(0.81, 0.6, 0.9) == pytest.approx(0.3)
    assert cads_gamma(0.9, 0.6, 0.9) == 0.0
    assert cads_gamma(1.0, 0.6, 0.9) == 0.0
    # τ1 = τ2: a step, no division by zero; τ1 = 1: γ ≡ 1
    assert cads_gamma(0.5, 0.5, 0.5) == 1.0 and cads_gamma(0.51, 0.5, 0.5) == 0.0
    assert cads_gamma(1.0, 1.0, 1.0) == 1.0


def test_noise_condition_by_hand():
    # γ = 0.25, s = 0.5: ŷ = 0.5·y + 0.5·√0.75·n
    y, n = torch.tensor([[3.0, -1.0]]), torch.tensor([[2.0, 4.0]])
    expected = torch.tensor([[1.5 + 0.5 * math.sqrt(0.75) * 2, -0.5 + 0.5 * math.sqrt(0.75) * 4]])
    assert torch.allclose(noise_condition(y, 0.25, 0.5, n), expected, atol=1e-6)
    assert torch.equal(noise_condition(y, 0.0, 0.5, n), 0.5 * n)


def test_rescale_restores_each_samples_mean_and_std():
    # row 0: y = [1, 2, 3] (mean 2, unbiased std 1); ŷ = [0, 4, 8] standardises to [−1, 0, 1] → [1, 2, 3]
    # row 1: y = [0, 0, 6] (mean 2, std √12); ŷ = [1, 2, 3] → [2 − √12, 2, 2 + √12]
    y = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])
    y_noised = torch.tensor([[0.0, 4.0, 8.0], [1.0, 2.0, 3.0]])
    r = math.sqrt(12)
    full = torch.tensor([[1.0, 2.0, 3.0], [2 - r, 2.0, 2 + r]])
    assert torch.allclose(rescale_condition(y_noised, y, 1.0), full, atol=1e-6)
    # ψ = 0.5: halfway between the rescaled and the noised condition
    half = torch.tensor([[0.5, 3.0, 5.5], [(2 - r + 1) / 2, 2.0, (2 + r + 3) / 2]])
    assert torch.allclose(rescale_condition(y_noised, y, 0.5), half, atol=1e-6)


def test_anneal_condition_is_the_identity_at_gamma_one_and_noise_only_at_zero():
    y, n = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    assert anneal_condition(y, 1.0, 0.25, 1.0, n) is y
    assert torch.allclose(anneal_condition(y, 0.0, 0.5, 0.0, n), 0.5 * n)
    half = anneal_condition(y.half(), 0.5, 0.25, 1.0, n)
    assert half.dtype == torch.float16


def test_config_and_parse_errors_are_one_line_user_errors():
    assert parse_cads("on") == CADSConfig(0.6, 0.9, 0.25, 1.0, 0)
    assert parse_cads("tau1=0.5, mix=0,seed=7") == CADSConfig(tau1=0.5, mix=0.0, seed=7)
    for bad in ("tau1=0.95", "tau3=1", "noise_scale=-1", "mix=2", "tau1=abc", "tau2", "tau1=nan", "seed=1.5"):
        with pytest.raises(UserError) as info:
            parse_cads(bad)
        assert "\n" not in str(info.value)


def test_bench_diversity_and_paired_se_by_hand():
    # pairs (0,1): 1 − 0 = 1, (0,2): 1 − 1 = 0, (1,2): 1 − 0 = 1 → 2/3; lengths do not matter (cosine)
    assert mean_pairwise_cosine_distance(torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])) == pytest.approx(2 / 3)
    # differences 1, 2, 3: mean 2, sample std 1, s.e. 1/√3
    assert paired_mean_and_se([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / math.sqrt(3)))


# -- the hook on the samplers ------------------------------------------------------------------------------


def _recorder(seen):
    return StepHook(before=lambda ctx: seen.append(ctx.cond))


@pytest.mark.parametrize("family", ["ddim", "lcm", "flow"])
def test_gamma_one_equals_plain_sampling_exactly_and_cads_changes_samples(family, tiny_sd, tiny_lcm, tiny_sd3):
    pipe, sampler, kwargs = {
        "ddim": (tiny_sd, DDIMSampler(), {"eta": 1.0, "guidance_scale": 6.0}),  # η = 1: the noise stream matters
        "lcm": (tiny_lcm, LCMSampler(), {"eta": 1.0, "guidance_scale": 8.0}),
        "flow": (tiny_sd3, FlowSampler(), {"eta": 0.7, "guidance_scale": 6.0}),
    }[family]
    settings = {"num_steps": 4, "seeds": SEEDS, "output": "latents", **kwargs}
    plain = sampler.sample(pipe, PROMPTS, **settings)
    same = sampler.sample(pipe, PROMPTS, hooks=[CADSHook(tau1=1.0, tau2=1.0)], **settings)
    assert torch.equal(same.latents, plain.latents)
    assert torch.equal(same.log_probs, plain.log_probs)
    cads = sampler.sample(pipe, PROMPTS, hooks=[CADSHook()], **settings)
    again = sampler.sample(pipe, PROMPTS, hooks=[CADSHook()], **settings)
    assert torch.equal(cads.latents, again.latents)  # reproducible per seed
    diff = (cads.latents[:, -1] - plain.latents[:, -1]).abs().amax(dim=(1, 2, 3))
    assert (diff > 1e-3).all()
    other = sampler.sample(pipe, PROMPTS, hooks=[CADSHook(seed=1)], **settings)
    assert not torch.equal(other.latents, cads.latents)
    assert cads.extras["cads"] == {"tau1": 0.6, "tau2": 0.9, "noise_scale": 0.25, "mix": 1.0, "seed": 0}


def test_ddim_steps_see_sqrt_gamma_times_the_condition_and_an_untouched_unconditional_branch(tiny_sd):
    # 5 DDIM steps: timesteps 801, 601, 401, 201, 1 → t = 0.801 (γ = 0.099/0.3 = 0.33), 0.601 (γ = 0.299/0.3), then 1
    seen, plain_seen = [], []
    settings = {"num_steps": 5, "guidance_scale": 6.0, "eta": 0.0, "seeds": SEEDS, "output": "latents"}
    DDIMSampler().sample(tiny_sd, PROMPTS, hooks=[_recorder(plain_seen)], **settings)
    hook = CADSHook(noise_scale=0.0, mix=0.0)  # s = 0, no rescaling: ŷ = √γ · y exactly
    DDIMSampler().sample(tiny_sd, PROMPTS, hooks=[hook, _recorder(seen)], **settings)
    y = plain_seen[0].prompt_embeds
    assert torch.allclose(seen[0].prompt_embeds, math.sqrt(0.33) * y, atol=1e-6)
    assert torch.allclose(seen[1].prompt_embeds, math.sqrt(0.299 / 0.3) * y, atol=1e-6)
    for step in (2, 3, 4):
        assert torch.equal(seen[step].prompt_embeds, plain_seen[step].prompt_embeds)
    for step in range(5):
        assert torch.equal(seen[step].negative_prompt_embeds, plain_seen[step].negative_prompt_embeds)


def test_flow_pooled_embeddings_are_noised_with_sigma_as_time(tiny_sd3):
    seen, plain_seen = [], []
    settings = {"num_steps": 4, "guidance_scale": 6.0, "eta": 0.0, "seeds": SEEDS, "output": "latents"}
    plain = FlowSampler().sample(tiny_sd3, PROMPTS, hooks=[_recorder(plain_seen)], **settings)
    FlowSampler().sample(tiny_sd3, PROMPTS, hooks=[CADSHook(noise_scale=0.0, mix=0.0), _recorder(seen)], **settings)
    sigma = plain.timesteps[0].item() / 1000  # σ_0 = 1: t ≥ τ2, γ = 0, the condition is s·n = 0
    assert sigma >= 0.9
    assert torch.equal(seen[0].prompt_embeds, torch.zeros_like(plain_seen[0].prompt_embeds))
    assert torch.equal(seen[0].pooled_prompt_embeds, torch.zeros_like(plain_seen[0].pooled_prompt_embeds))
    assert torch.equal(seen[0].negative_pooled_prompt_embeds, plain_seen[0].negative_pooled_prompt_embeds)
    for step in range(4):  # each step: √γ(σ_i) · y with γ worked from σ_i by Eq. 2
        s = plain.timesteps[step].item() / 1000
        gamma = 1.0 if s <= 0.6 else 0.0 if s >= 0.9 else (0.9 - s) / 0.3
        assert torch.allclose(seen[step].pooled_prompt_embeds,
                              math.sqrt(gamma) * plain_seen[step].pooled_prompt_embeds, atol=1e-6)


def test_a_samples_condition_noise_does_not_depend_on_its_batch(tiny_sd):
    settings = {"num_steps": 4, "guidance_scale": 6.0, "eta": 1.0, "output": "latents"}
    batch = DDIMSampler().sample(tiny_sd, PROMPTS, hooks=[CADSHook()], seeds=SEEDS, **settings)
    alone = DDIMSampler().sample(tiny_sd, PROMPTS[1:2], hooks=[CADSHook()], seeds=SEEDS[1:2], **settings)
    # 1e-4: plain sampling's batched matmuls already differ by ~2e-5 between these batch sizes; CADS moves the
    # final latents by ~0.2 here, so a condition noise that depended on the batch would show
    assert torch.allclose(alone.latents[0], batch.latents[1], atol=1e-4)


def test_replacing_the_condition_after_the_prediction_is_refused(tiny_sd):
    early = StepHook(before=lambda ctx: (ctx.noise_pred, None)[1])  # reads the prediction first
    with pytest.raises(RuntimeError, match="already computed"):
        DDIMSampler().sample(tiny_sd, PROMPTS, hooks=[early, CADSHook()], num_steps=4, guidance_scale=6.0, eta=0.0,
                             seeds=SEEDS, output="latents")


# -- diffrl sample --cads ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    from samplers.testing import tiny_sd_pipeline

    folder = tmp_path_factory.mktemp("tiny") / "sd"
    tiny_sd_pipeline(folder)
    return folder


def test_sample_cads_option(pipeline_dir, tmp_path):
    argv = ["sample", "--pipeline", str(pipeline_dir), "--prompt", "a red circle", "-n", "2", "--steps", "4",
            "--guidance-scale", "6"]
    images = {}
    for name, extra in {"plain": [], "off": ["--cads", "tau1=1,tau2=1"], "on": ["--cads", "on"]}.items():
        assert main([*argv, "--out", str(tmp_path / name), *extra]) == 0
        images[name] = [np.asarray(Image.open(tmp_path / name / f"0000{i}.png")) for i in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(images["plain"], images["off"]))
    assert not any(np.array_equal(a, b) for a, b in zip(images["plain"], images["on"]))
    settings = json.loads((tmp_path / "on" / "settings.json").read_text())
    assert settings["cads"] == {"tau1": 0.6, "tau2": 0.9, "noise_scale": 0.25, "mix": 1.0, "seed": 0}
    assert json.loads((tmp_path / "plain" / "settings.json").read_text())["cads"] is None


@pytest.mark.parametrize(("value", "expected"), [
    ("tau1=0.95", "tau1 <= tau2"), ("tau=0.5", "is not one of tau1="), ("mix=x", "mix='x' is not a number"),
    ("noise_scale=-0.1", "noise_scale must be >= 0"),
])
def test_sample_bad_cads_is_one_line_and_writes_nothing(pipeline_dir, tmp_path, capsys, value, expected):
    argv = ["sample", "--pipeline", str(pipeline_dir), "--prompt", "a", "--out", str(tmp_path / "out"),
            "--cads", value]
    one_line_error(capsys, argv, expected, tmp_path)
    assert not (tmp_path / "out").exists()
