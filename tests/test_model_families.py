"""The model-family layer (`diffrl.models`): which family a pipeline is, and each family's forward process against
diffusers' own schedulers (an independent reference) or closed forms worked by hand."""

import math

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.flow import RectifiedFlowProcess
from diffrl.models.unet import DDPMProcess
from samplers.testing import SD_SCHEDULER_CONFIG, tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sd_pipeline

SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}  # SD3's static shift


def test_each_pipeline_gets_its_family_and_others_a_one_line_error():
    assert model_family(tiny_sd_pipeline()).name == "ddpm_unet"
    assert model_family(tiny_sd3_pipeline(t5=False)).name == "sd3"
    assert model_family(tiny_flux_pipeline()).name == "flux"

    class Other:
        pass

    with pytest.raises(UserError, match="Other is not a supported model family; diffrl runs ddpm_unet, sd3, flux"):
        model_family(Other())


def test_rectified_flow_noising_is_diffusers_scale_noise():
    scheduler = FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER)
    process = RectifiedFlowProcess(scheduler.config)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = scheduler.timesteps[torch.tensor([0, 500, 999])]
    expected = torch.cat([scheduler.scale_noise(x0[i:i + 1], t[i:i + 1], noise[i:i + 1]) for i in range(3)])
    assert torch.allclose(process.add_noise(x0, noise, t), expected, atol=1e-6)
    # the velocity target of diffusers' SD3/FLUX training scripts: noise − x0
    assert torch.equal(process.target(x0, noise, t), noise - x0)


def test_flow_training_timesteps_are_uniform_over_the_shifted_schedule():
    # σ = shift·s / (1 + (shift − 1)·s) for s uniform on {1/1000, ..., 1}; shift 3: the median s = 0.5 maps to 0.75
    process = RectifiedFlowProcess(FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER).config)
    t = process.train_timesteps(20000, torch.Generator().manual_seed(0))
    s = torch.arange(1, 1001, dtype=torch.float64) / 1000
    grid = 1000 * 3 * s / (1 + 2 * s)
    assert float((t.double()[:, None] - grid[None]).abs().min(dim=1).values.max()) < 1e-3  # float32 of a grid point
    assert t.dtype == torch.float32 and float(t.median()) / 1000 == pytest.approx(0.75, abs=0.01)
    assert float(t.min()) < 10 and float(t.max()) == 1000.0


def test_ddpm_process_is_diffusers_add_noise_and_velocity():
    scheduler = DDPMScheduler.from_config({**SD_SCHEDULER_CONFIG, "prediction_type": "v_prediction"})
    process = DDPMProcess(scheduler)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    t = torch.tensor([0, 400, 999])
    assert torch.allclose(process.add_noise(x0, noise, t), scheduler.add_noise(x0, noise, t), atol=1e-6)
    assert torch.allclose(process.target(x0, noise, t), scheduler.get_velocity(x0, noise, t), atol=1e-6)
    draws = process.train_timesteps(5000, torch.Generator().manual_seed(0))
    assert draws.dtype == torch.int64 and int(draws.min()) >= 0 and int(draws.max()) <= 999
    assert float(draws.double().mean()) == pytest.approx(499.5, abs=3 * 288.7 / math.sqrt(5000))
