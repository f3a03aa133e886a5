"""The FLUX.2 family (`diffrl.models.flux2`) on the tiny random `Flux2Pipeline` of `samplers.testing_families`: loaded through
`diffrl.load_pipeline`, the flow sampler's ODE against diffusers' own pipeline for the same start latents (embedded
guidance 1 and 4), its step-count-dependent schedule, and Flow-GRPO, DiffusionNFT and DRaFT training steps through
the trainers' own `train()`, with the LoRA export loaded in plain diffusers."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from diffrl.errors import UserError
from diffrl.models import model_family
from diffrl.models.flux2 import Flux2Family
from diffrl.pipelines import load_pipeline
from samplers.flow import FlowSampler
from samplers.testing_families import TINY_CALL, tiny_family

sys.path.insert(0, str(Path(__file__).parents[1] / "trainers"))  # the trainer tests' tiny recipes (pg_helpers)
from pg_helpers import load_cfg, tiny_recipe, with_trainer

CALL = TINY_CALL["flux2"]  # 32 px, 64 text tokens: patchified latents [B, 16, 8, 8] -> 64 tokens of 16 channels
PROMPTS = ["a red circle", "a big blue square on the beach at night"]
# Flow-Factory's FLUX.2 LoRA targets that name modules of diffusers' Flux2Transformer2DModel (its list's second
# `attn.to_out.0`, meant for the single-stream blocks, matches none: their output projection is `attn.to_out`)
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                "ff_context.linear_out", "attn.to_qkv_mlp_proj"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny folder with its sampling size and text length in model_index.json (read by the loader), so recipes
    that leave sample.height/width at 0 sample at the tiny call's size."""
    folder = tiny_family("flux2", tmp_path_factory.mktemp("flux2") / "flux2")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update({"_diffrl_height": CALL["height"], "_diffrl_width": CALL["width"],
                  "_diffrl_max_sequence_length": CALL["max_sequence_length"]})  # fmt: skip
    index_path.write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(folder)


def _packed(latents):
    """`[B, 4C, h, w]` → the pipeline's tokens `[B, h·w, 4C]` (what `output_type="latent"` returns)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def test_load_pipeline_gives_the_flux2_family(pipe):
    family = model_family(pipe)
    assert isinstance(family, Flux2Family) and family.flow and not family.uses_cfg(4.0)
    assert family.denoiser is pipe.transformer
    assert family.latent_shape(32, 32) == ((16, 8, 8), 32, 32)  # 4 VAE channels x 2x2, at 1/(2·2) of the image
    assert family.latent_shape(None, None) == ((16, 8, 8), 32, 32)  # the folder's _diffrl_height/_diffrl_width
    with pytest.raises(UserError, match="height=30 is not a multiple of 4"):
        family.latent_shape(30, 32)
    with pytest.raises(UserError, match="no negative prompt"):
        family.encode(PROMPTS, guidance_scale=4.0, negative_prompt="blurry")


def test_schedule_mu_depends_on_the_step_count(pipe):
    """μ = compute_empirical_mu(64 tokens, T) worked out by hand (black-forest-labs/flux2 sampling.py's constants):
    interpolated linearly in T between its 10-step and 200-step lines; the σ of diffusers' own call."""
    family = model_family(pipe)

    def mu(seq, steps):
        m_200, m_10 = 0.00016927 * seq + 0.45666666, 8.73809524e-05 * seq + 1.89833333
        return m_200 + (steps - 200) * (m_200 - m_10) / 190

    for steps in (2, 3, 10):
        assert family.schedule_kwargs(steps, (8, 8))["mu"] == pytest.approx(mu(64, steps), abs=1e-9)
    assert mu(64, 2) - mu(64, 10) > 0.05  # 1.964 vs 1.904: fewer steps, a larger shift
    kwargs = family.schedule_kwargs(3, (8, 8))
    shifted = [math.exp(kwargs["mu"]) / (math.exp(kwargs["mu"]) + (1 / s - 1)) for s in (1.0, 2 / 3, 1 / 3)]
    schedule = FlowSampler().schedule(pipe, 3, (8, 8))
    assert schedule.sigmas == pytest.approx(shifted + [0.0], abs=1e-6)
    pipe(prompt="a red circle", num_inference_steps=3, output_type="latent", **CALL)
    assert schedule.sigmas == pytest.approx(pipe.scheduler.sigmas.tolist(), abs=0)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_ode_equals_the_diffusers_pipeline(pipe, guidance_scale):
    """eta = 0 reproduces `Flux2Pipeline` for the same start latents: the patchified `[B, 4C, h/2, w/2]` the sampler
    keeps is exactly the pipeline's `latents=` argument; the embedded guidance changes the output."""
    x_T = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sampler = FlowSampler()
    common = {"num_steps": 3, "eta": 0.0, "latents": x_T, "guidance_scale": guidance_scale, **CALL}
    latents = sampler.sample(pipe, PROMPTS, output="latents", **common)
    call = {"prompt": PROMPTS, "latents": x_T, "num_inference_steps": 3, "guidance_scale": guidance_scale, **CALL}
    reference = pipe(output_type="latent", **call).images
    assert (_packed(latents.latents[:, -1]) - reference).abs().max() <= 1e-5
    images = sampler.sample(pipe, PROMPTS, **common).images
    reference_images = pipe(output_type="pt", **call).images
    assert images.shape == (2, 3, 32, 32)
    assert (images - reference_images).abs().max() <= 1e-5
    other = sampler.sample(pipe, PROMPTS, output="latents", **{**common, "guidance_scale": 2.5})
    assert not torch.equal(other.latents, latents.latents)


# ----------------------------------------------------------------------------------------------------------------
# Training steps through the trainers' `train()` (what `diffrl run` calls)


def _recipe(tmp_path, folder, trainer):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 1, "eval_every": 0},
                         "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2,
                                    "guidance_scale": 4.0},
                         "log": {"tracker": "none", "image_every": 0}}, trainer)  # fmt: skip
    lora = base.get("model", {}).get("lora", {"rank": 2, "alpha": 2.0})
    base["model"] = {**base.get("model", {}), "lora": {**lora, "target_modules": LORA_TARGETS}}
    recipe = tiny_recipe(folder, tmp_path, **base)
    recipe["model"]["pipeline"] = str(folder)  # tiny_recipe puts its tiny SD3 under the flow trainers
    return recipe


def _train(tmp_path, trainer, recipe):
    snapshots = {}

    def snapshot(info):
        snapshots[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                          if p.requires_grad}

    module = importlib.import_module(f"diffrl.trainers.{trainer}")
    module.train(load_cfg(recipe), tmp_path / "run", step_callback=snapshot)
    return snapshots


@pytest.mark.parametrize("trainer", ["flow_grpo", "diffusion_nft", "draft"])
def test_trainers_train_the_flux2_transformer(tmp_path, folder, trainer):
    """Every LoRA weight of the transformer moves; Flow-GRPO recomputes the rollout's log-probs (ratio 1 before the
    first update), and its exported LoRA loads in plain diffusers."""
    from diffrl.training.metrics import read_metrics

    recipe = _recipe(tmp_path, folder, trainer)
    if trainer == "flow_grpo":  # and the run context's evaluation and sample grid on this family
        recipe["run"]["eval_every"], recipe["log"]["image_every"] = 1, 1
    snapshots = _train(tmp_path, trainer, recipe)
    first, last = snapshots[0], snapshots[max(snapshots)]
    assert max(snapshots) >= 1 and first and all("lora" in n for n in first)
    assert not [n for n in first if torch.equal(first[n], last[n])]  # every LoRA weight moved
    records = read_metrics(tmp_path / "run")
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    if trainer == "flow_grpo":
        assert records[0]["logprob_max_diff"] <= 1e-5
        assert "eval_reward_mean" in records[-1] and (tmp_path / "run" / "images" / "epoch-0.png").is_file()
        _check_lora_export(tmp_path, folder, recipe)


def _check_lora_export(tmp_path, folder, recipe):
    """The checkpoint's LoRA loads with `Flux2Pipeline.load_lora_weights` and gives the trained transformer (the same
    output as diffrl's own adapter loaded from the checkpoint), not the base one."""
    from diffusers import Flux2Pipeline

    from diffrl.models.flux2 import image_ids, text_ids
    from diffrl.training.weights import load_trainable, setup_trainable

    ckpt = max((tmp_path / "run" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    plain = Flux2Pipeline.from_pretrained(folder)
    plain.load_lora_weights(ckpt)
    ours = Flux2Pipeline.from_pretrained(folder)
    lora = recipe["model"]["lora"]
    setup_trainable(ours.transformer, use_lora=True, lora_rank=lora["rank"], lora_alpha=lora["alpha"],
                    lora_target_modules=LORA_TARGETS)
    load_trainable(ours.transformer, ckpt)
    base = Flux2Pipeline.from_pretrained(folder)
    generator = torch.Generator().manual_seed(2)
    tokens, text = torch.randn(2, 16, 16, generator=generator), torch.randn(2, 5, 48, generator=generator)
    kwargs = {"timestep": torch.tensor([0.8, 0.1]), "guidance": torch.tensor([4.0, 4.0]), "encoder_hidden_states": text,
              "txt_ids": text_ids(5, "cpu"), "img_ids": image_ids(4, 4, "cpu"), "return_dict": False}  # fmt: skip
    with torch.no_grad():
        outs = [p.transformer(hidden_states=tokens, **kwargs)[0] for p in (plain, ours, base)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert (outs[0] - outs[2]).abs().max() > 1e-5
    x_T = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    images = [p(prompt="a red circle", latents=x_T, num_inference_steps=2, output_type="pt", **CALL).images
              for p in (plain, base)]
    assert (images[0] - images[1]).abs().max() > 1e-4  # the loaded LoRA changes the pipeline's output
