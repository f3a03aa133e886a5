"""The Wan 2.1 / 2.2 text-to-video family (`diffrl.models.wan`) on the tiny random `WanPipeline` of `samplers.testing_families`:
loaded through `diffrl.load_pipeline`, its ODE equal to diffusers' own pipeline output for the same start latents
(with and without CFG; Wan 2.2's two experts), the released UniPC scheduler's σ grid, training steps of Flow-GRPO,
DiffusionNFT and DRaFT with a per-frame video reward, the GIF grid, the LoRA export and the recipe."""

import json
import warnings

import numpy as np
import pytest
import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.wan import WanFamily
from diffrl.pipelines import load_pipeline
from samplers.flow import FlowSampler
from samplers.testing_families import TINY_CALL, tiny_family

CALL = TINY_CALL["wan"]  # 32x32, 5 frames, 32 text tokens: latents [B, 4, 3, 8, 8]
PROMPTS = ["a red circle", "a blue square on the grass"]


def wan_folder(folder, **kwargs):
    """The tiny Wan folder with its sampling size written into model_index.json (as a user would for a video folder),
    so the sampler's defaults are the tiny call's."""
    tiny_family("wan", folder, **kwargs)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update({"_diffrl_height": CALL["height"], "_diffrl_width": CALL["width"],
                  "_diffrl_num_frames": CALL["num_frames"], "_diffrl_max_sequence_length": CALL["max_sequence_length"]})
    index_path.write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return load_pipeline(wan_folder(tmp_path_factory.mktemp("wan") / "wan"))


def start_latents(batch, seed=0):
    return torch.randn((batch, 4, 3, 8, 8), generator=torch.Generator().manual_seed(seed))


def test_wan_pipeline_is_the_wan_family(pipe):
    family = model_family(pipe)
    assert isinstance(family, WanFamily) and family.flow and family.denoiser is pipe.transformer
    assert family.latent_shape(None, None) == ((4, 3, 8, 8), 32, 32)  # the folder's size keys
    assert family.latent_shape(64, 48, 9) == ((4, 5, 16, 12), 64, 48)  # F' = (9 - 1)/2 + 1, h = H/4
    with pytest.raises(UserError, match="height=36 is not a multiple of 8"):
        family.latent_shape(36, 32)
    with pytest.raises(UserError, match=r"num_frames=4 is not 2·k \+ 1"):
        family.latent_shape(32, 32, 4)


@pytest.mark.parametrize("guidance_scale, negative_prompt", [(1.0, None), (5.0, None), (4.0, "blurry")])
def test_wan_ode_equals_the_pipeline(pipe, guidance_scale, negative_prompt):
    """eta = 0 through the family equals `WanPipeline(latents=...)` (Euler, static shift 5, σ_min shifted twice as
    diffusers does): final latents and decoded frames; CFG with the default "" and with a given negative prompt."""
    steps, x_T = 3, start_latents(len(PROMPTS))
    kwargs = {} if negative_prompt is None else {"negative_prompt": [negative_prompt] * len(PROMPTS)}
    ours = FlowSampler().sample(pipe, PROMPTS, num_steps=steps, guidance_scale=guidance_scale, eta=0.0,
                                latents=x_T, output="latents", **kwargs)
    call = dict(prompt=PROMPTS, latents=x_T.clone(), num_inference_steps=steps, guidance_scale=guidance_scale,
                **CALL, **kwargs)  # fmt: skip
    reference = pipe(output_type="latent", **call).frames
    assert ours.latents.shape == (2, steps + 1, 4, 3, 8, 8)
    torch.testing.assert_close(ours.latents[:, -1], reference, rtol=0, atol=1e-5)
    frames = model_family(pipe).decode(ours.latents[:, -1])
    reference_frames = pipe(output_type="pt", **call).frames  # [B, F, 3, H, W] in [0, 1]
    assert frames.shape == reference_frames.shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(frames, reference_frames, rtol=0, atol=1e-5)
    # the schedule is the pipeline's: σ_min shifted twice (5·s/(1 + 4·s) of an already shifted s)
    pipe.scheduler.set_timesteps(steps)
    torch.testing.assert_close(ours.timesteps, pipe.scheduler.timesteps.float(), rtol=0, atol=0)


def test_wan_schedule_shifts_sigma_min_twice(pipe):
    """The σ the family's sampler steps, worked out by hand: FlowMatchEuler(shift=5) shifts its training σ once in
    `__init__` (σ_min = 5·0.001/(1 + 4·0.001)), `set_timesteps(3)` takes linspace(1, σ_min, 3) and shifts again."""
    shift = 5.0
    sigma_min = shift * 0.001 / (1 + (shift - 1) * 0.001)
    grid = np.linspace(1.0, sigma_min, 3)
    expected = shift * grid / (1 + (shift - 1) * grid)
    schedule = FlowSampler().schedule(pipe, 3, (8, 8))
    np.testing.assert_allclose(schedule.sigmas, [*expected, 0.0], rtol=0, atol=1e-6)


def test_wan_unipc_config_steps_unipc_sigmas(tmp_path):
    """The released Wan 2.1 folders ship UniPC with flow sigmas (flow_shift 3): the flow sampler steps UniPC's own σ
    grid (compared with UniPC's `set_timesteps`, except its −1e-6 nudge of σ_0), then 0."""
    pipe = load_pipeline(wan_folder(tmp_path / "wan", scheduler="unipc"))
    schedule = FlowSampler().schedule(pipe, 4, (8, 8))
    pipe.scheduler.set_timesteps(4)
    np.testing.assert_allclose(schedule.sigmas[1:], pipe.scheduler.sigmas[1:].numpy(), rtol=0, atol=1e-6)
    s = np.array([1, 0.75025, 0.5005, 0.25075])  # linspace(1, 0.001, 5)[:-1]
    np.testing.assert_allclose(schedule.sigmas, [*(3 * s / (1 + 2 * s)), 0.0], rtol=0, atol=1e-6)
    traj = FlowSampler().sample(pipe, PROMPTS[:1], num_steps=4, guidance_scale=1.0, eta=0.0, output="images")
    assert traj.images.shape == (1, 5, 3, 32, 32) and torch.isfinite(traj.images).all()


def test_wan22_two_experts_ode_equals_the_pipeline(tmp_path):
    """Wan 2.2 A14B's layout: `transformer` at t >= 875 (boundary_ratio 0.875), `transformer_2` below. In 3 steps of
    shift 5 the timesteps are 1000, 834.7, ...: both experts run; the ODE equals the pipeline's with CFG (its
    guidance_scale_2 defaulting to guidance_scale); a batch whose rows straddle the boundary gets each row's expert."""
    pipe = load_pipeline(wan_folder(tmp_path / "wan22", two_experts=True))
    family = model_family(pipe)
    assert family.boundary == 875.0 and not any(p.requires_grad for p in pipe.transformer_2.parameters())
    x_T = start_latents(2, seed=1)
    ours = FlowSampler().sample(pipe, PROMPTS, num_steps=3, guidance_scale=4.0, eta=0.0, latents=x_T,
                                output="latents")
    assert ours.timesteps[0] >= 875 > ours.timesteps[1]
    reference = pipe(prompt=PROMPTS, latents=x_T.clone(), num_inference_steps=3, guidance_scale=4.0,
                     output_type="latent", **CALL).frames
    torch.testing.assert_close(ours.latents[:, -1], reference, rtol=0, atol=1e-5)
    cond, _ = family.encode(PROMPTS, guidance_scale=1.0)
    t = torch.tensor([900.0, 100.0])
    mixed = family.model_output(x_T, t, cond, 1.0)
    with torch.no_grad():
        for row, expert in ((0, pipe.transformer), (1, pipe.transformer_2)):
            alone = expert(hidden_states=x_T[row:row + 1], timestep=t[row:row + 1],
                           encoder_hidden_states=cond.prompt_embeds[row:row + 1], return_dict=False)[0]
            torch.testing.assert_close(mixed[row:row + 1], alone, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Training steps through the trainers' own entry points (what `diffrl run` calls), on videos scored per frame

TRAINING = {  # each trainer's tiny settings (tests/trainers/pg_helpers.TINY) on the Wan folder, with a video reward
    "flow_grpo": {"sample": {"eta": 0.7}, "reward": {"name": "video", "kwargs": {"reward": "pg_helpers:brightness"}}},
    "diffusion_nft": {"reward": {"name": "video", "kwargs": {"reward": "pg_helpers:brightness"}}},
    "draft": {"reward": {"name": "video", "kwargs": {"reward": "pg_helpers:smooth_brightness"}}},
}


def wan_recipe(tmp_path, trainer, folder):
    from pg_helpers import tiny_recipe, with_trainer

    base = with_trainer({"run": {"num_epochs": 1, "save_every": 1},
                         "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 1},
                         "log": {"tracker": "none", "image_every": 1, "grid_images": 2}}, trainer)
    for group, values in TRAINING[trainer].items():
        base[group] = {**base.get(group, {}), **values}
    base["model"] = {**base.get("model", {}), "lora": {"rank": 2, "alpha": 2.0}}  # to_q/k/v/out of attn1 and attn2
    recipe = tiny_recipe(folder, tmp_path, **base)
    recipe["model"]["pipeline"] = str(folder)  # tiny_recipe points flow trainers at the tiny SD3
    return recipe


@pytest.mark.parametrize("trainer, two_experts", [("flow_grpo", False), ("diffusion_nft", False), ("draft", False),
                                                  ("flow_grpo", True)])
def test_wan_training_step_moves_every_lora_weight(tmp_path, trainer, two_experts):
    """Wan 2.1, and Wan 2.2's two experts with Flow-GRPO training both of its 2 steps: the trained high-noise
    `transformer` (t = 1000), then the frozen `transformer_2` (its step's loss backpropagates zero instead of failing);
    the high-noise LoRA moves."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainers"))  # pg_helpers: the trainers' tiny recipes
    from pg_helpers import load_cfg

    from diffrl.training.metrics import read_metrics

    folder = wan_folder(tmp_path / "wan", two_experts=two_experts)
    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                          if p.requires_grad}

    module = importlib.import_module(f"diffrl.trainers.{trainer}")
    recipe = wan_recipe(tmp_path, trainer, folder)
    if two_experts:  # train both steps, the low-noise one included
        recipe["train"]["timestep_fraction"] = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.train(load_cfg(recipe), tmp_path / "run", step_callback=snapshot)
    frozen = [w for w in caught if "frozen low-noise expert" in str(w.message)]
    assert bool(frozen) == two_experts  # said when a loss runs through transformer_2, and only then
    first, last = snapshots[0], snapshots[max(snapshots)]
    assert max(snapshots) >= 1 and first and all("lora" in n for n in first)
    assert {n.split(".")[2] for n in first} == {"attn1", "attn2"}  # blocks.<i>.attn1/attn2...
    assert not [n for n in first if torch.equal(first[n], last[n])]  # every LoRA weight of the transformer moved
    record = read_metrics(tmp_path / "run")[0]
    assert np.isfinite(record["loss"]) and np.isfinite(record["reward_mean"])
    # the run dir shows the videos: the first frames as a PNG grid, all 5 frames as an animated GIF grid
    from PIL import Image

    with Image.open(tmp_path / "run" / "images" / "epoch-0.gif") as gif:
        assert gif.is_animated and gif.n_frames == 5 and gif.size[0] == 2 * 128  # 2 tiles of 32 px upscaled x4
    with Image.open(tmp_path / "run" / "images" / "epoch-0.png") as png:
        assert png.size == gif.size
    if trainer == "flow_grpo":  # the rollout's log-probs recomputed under the same weights
        assert record["logprob_max_diff"] <= 1e-5
    if trainer == "flow_grpo" and not two_experts:
        check_lora_export(folder, tmp_path / "run")


def check_lora_export(folder, run_dir):
    """The run's LoRA loads in plain diffusers (`WanPipeline.load_lora_weights`) and gives the trained transformer,
    which differs from the base one."""
    from diffusers import WanPipeline

    from diffrl.training.weights import load_trainable, setup_trainable

    checkpoint = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    plain = WanPipeline.from_pretrained(folder)
    plain.load_lora_weights(checkpoint)
    ours = WanPipeline.from_pretrained(folder)
    setup_trainable(ours.transformer, use_lora=True, lora_rank=2, lora_alpha=2.0,
                    lora_target_modules=["to_k", "to_q", "to_v", "to_out.0"])
    load_trainable(ours.transformer, checkpoint)
    base = WanPipeline.from_pretrained(folder)
    x, t, text = torch.randn(2, 4, 3, 8, 8), torch.tensor([800.0, 100.0]), torch.randn(2, 7, 32)
    with torch.no_grad():
        outs = [p.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
                for p in (plain, ours, base)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    assert (outs[0] - outs[2]).abs().max() > 1e-5


def test_wan_recipe_validates_with_flow_factorys_numbers():
    """`diffrl validate`'s checks pass offline on the Wan recipe, and it keeps Flow-Factory's published numbers
    (examples/grpo/lora/wan21/t2v.yaml): 768 videos an epoch on 8 processes in 2 optimizer steps, one SDE step."""
    from diffrl import config
    from diffrl.config_references import check_references

    cfg = config.load_recipe("flow_grpo/wan21_t2v_clip_pickscore", [])
    check_references(cfg)
    derived = config.derived_numbers(cfg, 8)
    assert derived["samples_per_epoch"] == 48 * 16 and derived["optimizer_steps_per_epoch"] == 2
    assert (cfg.model.pipeline, cfg.model.lora.rank, cfg.model.lora.alpha) == ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 64, 128)
    assert (cfg.sample.num_steps, cfg.sample.eta, cfg.sample.guidance_scale) == (10, 0.9, 5.0)
    assert (cfg.train.clip_range, cfg.train.kl_beta, cfg.train.sde_window) == (1e-4, 0.0, 1)
    assert cfg.reward.name == "video" and cfg.reward.kwargs["aggregate"] == "mean"
