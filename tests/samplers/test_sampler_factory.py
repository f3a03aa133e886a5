"""The one sampler factory (`samplers.get_sampler`) and the capabilities callers read instead of sampler names."""

import inspect
import json
from types import SimpleNamespace

import pytest

from diffrl.errors import UserError
from samplers import SAMPLERS, get_sampler, list_samplers, resolve_sampler_name

PROMPTS = ["a red circle", "two blue squares"]
CAPABILITIES = {
    "name": str,
    "per_step_eta": bool,
    "consistency": bool,
    "flow": bool,
    "default_num_steps": int,
    "default_guidance_scale": float,
    "default_eta": float,
}


def fake_pipe(time_cond_proj_dim):
    return SimpleNamespace(unet=SimpleNamespace(config={"time_cond_proj_dim": time_cond_proj_dim}))


def pipe_for(sampler, tiny_sd, tiny_lcm, tiny_sd3):
    # a consistency sampler needs a UNet with a guidance embedding, a flow sampler a flow-matching transformer
    if sampler.flow:
        return tiny_sd3
    return tiny_lcm if sampler.consistency else tiny_sd


def test_auto_picks_lcm_for_an_lcm_pipeline_and_ddim_for_stable_diffusion(tiny_sd, tiny_lcm):
    assert resolve_sampler_name(tiny_lcm) == "lcm" and get_sampler("auto", tiny_lcm).name == "lcm"
    assert resolve_sampler_name(tiny_sd) == "ddim" and get_sampler(pipe=tiny_sd).name == "ddim"
    # the UNet's guidance embedding decides, whatever the pipeline class
    assert resolve_sampler_name(fake_pipe(32)) == "lcm" and resolve_sampler_name(fake_pipe(None)) == "ddim"
    with pytest.raises(ValueError, match="needs the pipeline"):
        get_sampler("auto")


def test_names_and_their_errors(tiny_sd):
    assert {get_sampler(name).name for name in list_samplers()} == set(SAMPLERS) == {"ddim", "lcm", "lcm_rlcm", "flow",
                                                                                     "flow_cps"}
    assert get_sampler("ddim", noise_device="cpu").noise_device == "cpu"
    with pytest.raises(UserError) as error:
        get_sampler("lmc", tiny_sd)
    message = str(error.value)
    assert "\n" not in message and "did you mean 'lcm'?" in message and "auto, ddim, flow, flow_cps, lcm" in message
    with pytest.raises(UserError, match="guidance embedding"):  # an LCM sampler on a UNet without one
        get_sampler("lcm", tiny_sd)


def test_every_sampler_declares_its_capabilities():
    for name in list_samplers():
        sampler = get_sampler(name)
        for attribute, kind in CAPABILITIES.items():
            assert type(getattr(type(sampler), attribute)) is kind, (name, attribute)


@pytest.mark.parametrize("name", list_samplers())
def test_defaults_are_the_diffusers_pipelines_own_and_sample(name, tiny_sd, tiny_lcm, tiny_sd3):
    sampler = get_sampler(name)
    pipe = pipe_for(sampler, tiny_sd, tiny_lcm, tiny_sd3)
    defaults = inspect.signature(type(pipe).__call__).parameters
    assert sampler.default_num_steps == defaults["num_inference_steps"].default  # 50 SD, 4 LCM
    assert sampler.default_guidance_scale == defaults["guidance_scale"].default  # 7.5 SD, 8.5 LCM
    # DDIM: the pipeline's eta (0); LCM has none and re-noises with the full √(1 − ᾱ), which is η = 1; the flow
    # pipelines have none and sample the ODE, which is the noise level a = 0
    assert sampler.default_eta == (defaults["eta"].default if "eta" in defaults else 0.0 if sampler.flow else 1.0)
    traj = sampler.sample(
        pipe,
        PROMPTS[:1],
        num_steps=sampler.default_num_steps,
        guidance_scale=sampler.default_guidance_scale,
        eta=sampler.default_eta,
        seeds=[0],
        output="latents",
    )
    assert traj.num_steps == sampler.default_num_steps


@pytest.mark.parametrize("name", list_samplers())
def test_per_step_eta_is_what_the_sampler_accepts(name, tiny_sd, tiny_lcm, tiny_sd3):
    sampler = get_sampler(name)
    pipe = pipe_for(sampler, tiny_sd, tiny_lcm, tiny_sd3)
    kwargs = {"num_steps": 3, "guidance_scale": 3.0, "seeds": [0, 1], "output": "latents"}
    if sampler.per_step_eta:
        traj = sampler.sample(pipe, PROMPTS, eta=(0.0, 1.0, 1.0), **kwargs)
        # η = 0 makes step 0 deterministic (point mass, log-prob 0); η = 1 at step 1 draws noise
        assert (traj.log_probs[:, 0] == 0).all() and (traj.log_probs[:, 1] != 0).all()
    else:
        with pytest.raises(UserError, match="eta"):
            sampler.sample(pipe, PROMPTS, eta=0.5, **kwargs)
        with pytest.raises(UserError, match="eta"):
            sampler.sample(pipe, PROMPTS, eta=(0.0, 1.0, 1.0), **kwargs)


@pytest.mark.parametrize("name", list_samplers())
def test_consistency_samplers_guide_without_a_cfg_batch_or_negative_prompt(name, tiny_sd, tiny_lcm, tiny_sd3):
    sampler = get_sampler(name)
    pipe = pipe_for(sampler, tiny_sd, tiny_lcm, tiny_sd3)
    kwargs = {"num_steps": 2, "guidance_scale": 3.0, "eta": sampler.default_eta, "seeds": [0, 1], "output": "latents"}
    traj = sampler.sample(pipe, PROMPTS, **kwargs)
    # 2 samples × 2 steps UNet rows, twice that with classifier-free guidance's unconditional half
    assert traj.nfe == (4 if sampler.consistency else 8)
    if sampler.consistency:
        with pytest.raises(UserError, match="negative prompt"):
            sampler.sample(pipe, PROMPTS, negative_prompt="blurry", **kwargs)
    else:
        assert sampler.sample(pipe, PROMPTS, negative_prompt="blurry", **kwargs).negative_prompt_embeds is not None


def test_cli_sample_uses_the_lcm_samplers_defaults(tmp_path, capsys):
    from tiny_models import tiny_lcm_pipeline

    from diffrl.cli import main

    tiny_lcm_pipeline(tmp_path / "lcm")
    assert main(["sample", "--pipeline", str(tmp_path / "lcm"), "--prompt", "a red circle", "--out",
                 str(tmp_path / "out"), "--device", "cpu"]) == 0
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    # diffusers' LatentConsistencyModelPipeline: 4 steps, guidance 8.5; the LCM step's η is 1
    assert (settings["sampler"], settings["num_steps"], settings["guidance_scale"], settings["eta"]) == (
        "lcm", 4, 8.5, 1.0)


def test_a_flux_pipeline_gets_fluxs_own_defaults_and_sd3_keeps_its():
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from tiny_models import tiny_flux_pipeline, tiny_sd3_pipeline

    for pipe_cls, pipe in ((FluxPipeline, tiny_flux_pipeline()), (StableDiffusion3Pipeline, tiny_sd3_pipeline())):
        defaults = inspect.signature(pipe_cls.__call__).parameters
        sampler = get_sampler("auto", pipe)
        assert sampler.default_guidance_scale == defaults["guidance_scale"].default, pipe_cls  # 3.5 FLUX, 7.0 SD3
        assert sampler.default_num_steps == defaults["num_inference_steps"].default, pipe_cls  # 28 both
