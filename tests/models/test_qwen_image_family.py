"""The Qwen-Image family (`diffrl.models.qwen_image`) on the tiny random `QwenImagePipeline` of `samplers.testing_families`:
loaded through `diffrl.load_pipeline`, the flow sampler's ODE against diffusers' own pipeline for the same start
latents, its true CFG with per-token renormalisation, and Flow-GRPO, DiffusionNFT and DRaFT training steps through
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
from diffrl.models.flux import pack
from diffrl.models.qwen_image import QwenImageFamily, guide_renormalised
from diffrl.pipelines import load_pipeline
from samplers.flow import FlowSampler
from samplers.testing_families import TINY_CALL, tiny_family

sys.path.insert(0, str(Path(__file__).parents[1] / "trainers"))  # the trainer tests' tiny recipes (pg_helpers)
from pg_helpers import load_cfg, tiny_recipe, with_trainer

SIZE = TINY_CALL["qwenimage"]  # 32 px: latents [B, 4, 8, 8], 16 packed tokens of 16 channels
PROMPTS = ["a red circle", "a big blue square on the beach at night"]  # different lengths: a padded, masked batch
NEGATIVE = ["blurry", "a small gray dog"]
# the attention projections of both streams less the text queries and output (`add_q_proj`, `to_add_out`): in the
# last block the text tokens' outputs are discarded, so those would get no gradient
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_v_proj"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny folder with its sampling size in model_index.json (read by the loader): the default of recipes that
    leave sample.height/width at 0; the pipeline's own is 512 px on the tiny VAE (1024 on the real model)."""
    folder = tiny_family("qwenimage", tmp_path_factory.mktemp("qwen") / "qwenimage")
    index_path = folder / "model_index.json"
    index_path.write_text(json.dumps({**json.loads(index_path.read_text()), "_diffrl_height": SIZE["height"],
                                      "_diffrl_width": SIZE["width"]}))  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(folder)


def test_load_pipeline_gives_the_qwen_image_family(pipe):
    family = model_family(pipe)
    assert isinstance(family, QwenImageFamily) and family.flow
    assert family.denoiser is pipe.transformer
    assert family.latent_shape(32, 32) == ((4, 8, 8), 32, 32)
    assert family.latent_shape(None, None) == ((4, 8, 8), 32, 32)  # the folder's _diffrl_height/_diffrl_width
    with pytest.raises(UserError, match="height=36 is not a multiple of 8"):
        family.latent_shape(36, 32)


def test_schedule_is_the_pipelines(pipe):
    """μ = calculate_shift(16 tokens, 256, 8192, 0.5, 0.9) by hand: 0.5 + (16 − 256)·0.4/7936; σ = linspace(1, 1/3, 3)
    exponentially shifted and stretched to end at shift_terminal 0.02, then 0 — the sigmas diffusers' own call sets."""
    kwargs = model_family(pipe).schedule_kwargs(3, (8, 8))
    assert kwargs["mu"] == pytest.approx(0.5 + (16 - 256) * 0.4 / 7936, abs=1e-12)
    schedule = FlowSampler().schedule(pipe, 3, (8, 8))
    shifted = [math.exp(kwargs["mu"]) / (math.exp(kwargs["mu"]) + (1 / s - 1)) for s in (1.0, 2 / 3, 1 / 3)]
    stretch = (1 - shifted[-1]) / (1 - 0.02)
    expected = [1 - (1 - s) / stretch for s in shifted] + [0.0]
    assert schedule.sigmas == pytest.approx(expected, abs=1e-6)
    pipe(prompt="a red circle", num_inference_steps=3, output_type="latent", **SIZE)
    assert schedule.sigmas == pytest.approx(pipe.scheduler.sigmas.tolist(), abs=0)


@pytest.mark.parametrize("guided", [False, True])
def test_ode_equals_the_diffusers_pipeline(pipe, guided):
    """eta = 0 reproduces `QwenImagePipeline` for the same start latents (packed as its `latents=` takes them), the
    prompts padded to the longest with a mask; guided: true CFG at 4 with per-token renormalisation."""
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    ours = {"guidance_scale": 4.0, "negative_prompt": NEGATIVE} if guided else {"guidance_scale": 1.0}
    theirs = {"true_cfg_scale": 4.0, "negative_prompt": NEGATIVE} if guided else {}
    sampler = FlowSampler()
    latents = sampler.sample(pipe, PROMPTS, num_steps=3, eta=0.0, latents=x_T, output="latents", **ours, **SIZE)
    reference = pipe(prompt=PROMPTS, latents=pack(x_T), num_inference_steps=3, output_type="latent", **theirs,
                     **SIZE).images  # fmt: skip
    assert latents.prompt_embeds_mask is not None and not latents.prompt_embeds_mask.all()
    assert (pack(latents.latents[:, -1]) - reference).abs().max() <= 1e-5
    images = sampler.sample(pipe, PROMPTS, num_steps=3, eta=0.0, latents=x_T, **ours, **SIZE).images
    reference_images = pipe(prompt=PROMPTS, latents=pack(x_T), num_inference_steps=3, output_type="pt", **theirs,
                            **SIZE).images  # fmt: skip
    assert images.shape == (2, 3, 32, 32)
    assert (images - reference_images).abs().max() <= 1e-5
    plain = sampler.sample(pipe, PROMPTS, num_steps=3, eta=0.0, latents=x_T, output="latents", guidance_scale=1.0,
                           **SIZE)  # fmt: skip
    assert guided != torch.equal(plain.latents, latents.latents)


def test_batches_of_different_text_lengths_concatenate_and_recompute(pipe):
    """Each batch is padded to its own longest prompt: `Trajectory.cat` zero-pads the shorter batch's embeddings and
    masks, and the recomputed log-probs of the joined batch (masked padding) are the rollouts' own."""
    from samplers.base import Trajectory

    sampler = FlowSampler()
    short = sampler.sample(pipe, ["a cat", "a dog"], num_steps=2, guidance_scale=4.0, eta=0.7, seeds=[0, 1],
                           output="latents", **SIZE)  # fmt: skip
    long = sampler.sample(pipe, PROMPTS, num_steps=2, guidance_scale=4.0, eta=0.7, seeds=[2, 3], output="latents",
                          **SIZE)  # fmt: skip
    assert short.prompt_embeds.shape[1] < long.prompt_embeds.shape[1]
    joined = Trajectory.cat([short, long])
    assert joined.prompt_embeds.shape[1] == long.prompt_embeds.shape[1]
    assert joined.prompt_embeds_mask[:2].sum() == short.prompt_embeds_mask.sum()
    for i in range(2):
        assert (sampler.log_prob(pipe, joined, i) - joined.log_probs[:, i]).abs().max() <= 1e-5


def test_renormalised_guidance_by_hand():
    """v = u + s·(c − u), then scaled per token (last axis) to ‖c‖."""
    c = torch.tensor([[[3.0, 4.0], [1.0, 1.0]]])
    u = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])
    out = guide_renormalised(c, u, 3.0)
    # token 0: 3·c = [9, 12], norm 15, scaled to ‖c‖ = 5: [3, 4]; token 1: [1, 0] + 3·[0, 1] = [1, 3] → ·√2/√10
    expected = torch.tensor([[[3.0, 4.0], [1 / math.sqrt(5), 3 / math.sqrt(5)]]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_detach_uncond_keeps_the_value_and_drops_the_unconditional_gradient(pipe):
    family = model_family(pipe)
    cond, _ = family.encode(PROMPTS, guidance_scale=4.0, negative_prompt=NEGATIVE)
    assert cond.guided and cond.negative_prompt_embeds_mask is not None
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor(700.0)
    outputs, grads = [], []
    for detach in (False, True):
        negative = cond.negative_prompt_embeds.clone().requires_grad_(True)
        positive = cond.prompt_embeds.clone().requires_grad_(True)
        c = type(cond)(prompt_embeds=positive, negative_prompt_embeds=negative,
                       prompt_embeds_mask=cond.prompt_embeds_mask,
                       negative_prompt_embeds_mask=cond.negative_prompt_embeds_mask)  # fmt: skip
        out = family.model_output(x, t, c, 4.0, detach_uncond=detach)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append((negative.grad, positive.grad))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
    assert grads[0][0] is not None and grads[0][0].abs().sum() > 0
    assert grads[1][0] is None and grads[1][1].abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Training steps through the trainers' `train()` (what `diffrl run` calls)


def _recipe(tmp_path, folder, trainer, **groups):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 1, "eval_every": 0},
                         "sample": {"num_steps": 3, "batch_size": 2, "num_batches_per_epoch": 2},
                         "log": {"tracker": "none", "image_every": 0}}, trainer)
    if trainer in ("flow_grpo", "diffusion_nft"):
        base["model"] = {**base["model"], "lora": {**base["model"]["lora"], "target_modules": LORA_TARGETS}}
    else:
        base["model"] = {"lora": {"rank": 2, "alpha": 2.0, "target_modules": LORA_TARGETS}}
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
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
def test_trainers_train_the_qwen_image_transformer(tmp_path, folder, trainer):
    """Every LoRA weight of the transformer moves; Flow-GRPO (CFG at 3 with the "" negative, renormalised) recomputes
    the rollout's log-probs (ratio 1 before the first update), and its exported LoRA loads in plain diffusers."""
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
    """The checkpoint's LoRA loads with `QwenImagePipeline.load_lora_weights` and gives the trained transformer
    (the same output as diffrl's own adapter loaded from the checkpoint), not the base one."""
    from diffusers import QwenImagePipeline

    from diffrl.training.weights import load_trainable, setup_trainable

    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    ckpt = checkpoints[-1]
    plain = QwenImagePipeline.from_pretrained(folder)
    plain.load_lora_weights(ckpt)
    ours = QwenImagePipeline.from_pretrained(folder)
    lora = recipe["model"]["lora"]
    setup_trainable(ours.transformer, use_lora=True, lora_rank=lora["rank"], lora_alpha=lora["alpha"],
                    lora_target_modules=LORA_TARGETS)
    load_trainable(ours.transformer, ckpt)
    base = QwenImagePipeline.from_pretrained(folder)
    generator = torch.Generator().manual_seed(2)
    tokens, text = torch.randn(2, 16, 16, generator=generator), torch.randn(2, 5, 16, generator=generator)
    with torch.no_grad():
        outs = [p.transformer(hidden_states=tokens, timestep=torch.tensor([0.8, 0.1]), encoder_hidden_states=text,
                              img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0] for p in (plain, ours, base)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert (outs[0] - outs[2]).abs().max() > 1e-5
    x_T = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(3))
    images = [p(prompt="a red circle", latents=x_T, num_inference_steps=2, output_type="pt", **SIZE).images
              for p in (plain, base)]
    assert (images[0] - images[1]).abs().max() > 1e-4  # the loaded LoRA changes the pipeline's output
