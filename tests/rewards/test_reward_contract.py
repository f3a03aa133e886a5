"""What every model reward promises, checked on each one's tiny random model loaded through `get_reward`:
autograd is off inside the model unless the caller backpropagates to the pixels, the model is loaded once per
process (per device and dtype), `batch_size` chunks give the same scores, a reduced-precision model still returns
float32 scores on the images' device, and an empty batch gives an empty result.

The grad-mode check records `torch.is_grad_enabled()` inside the vision tower's forward: with frozen weights,
scores of images that do not require grad never carry a graph anyway, so only the grad mode itself shows whether
the reward ran under `no_grad` (and saved no activations).
"""

import pytest
import torch
from reward_testing import (
    PROMPTS,
    aesthetic_head,
    quantised,
    sample_images,
    tiny_clip_dir,
    tiny_clip_split_dirs,
    tiny_hps,
    tiny_imagereward,
)

from rewards import get_reward

REWARDS = ["aesthetic", "clip_score", "pickscore", "hpsv2", "hpsv21", "imagereward"]
# Every module the factory loads (and caches), the first being the one that sees the pixels.
MODULES = {"aesthetic": ("backbone", "head"), "imagereward": ("vision", "text", "mlp")}


def modules(reward):
    return [getattr(reward, attribute) for attribute in MODULES.get(reward.name, ("model",))]


def vision_tower(reward):
    """The submodule the reward runs on the pixels (the rewards call towers, not the models' own forward)."""
    model = modules(reward)[0]
    return getattr(model, "vision_model", None) or getattr(model, "visual", None) or model


def build(name, **options):
    if name == "aesthetic":
        return get_reward(name, head=aesthetic_head("v2"), backbone=tiny_clip_dir(), device="cpu", **options)
    if name == "clip_score":
        return get_reward(name, model=tiny_clip_dir(), device="cpu", **options)
    if name == "pickscore":
        model, processor = tiny_clip_split_dirs()
        return get_reward(name, model=model, processor=processor, device="cpu", **options)
    if name in ("hpsv2", "hpsv21"):
        return get_reward(name, device="cpu", **tiny_hps(), **options)
    return get_reward(name, device="cpu", **tiny_imagereward(), **options)


def grad_modes(reward, images, prompts) -> tuple[list[bool], torch.Tensor]:
    """(`torch.is_grad_enabled()` inside the vision tower at each of its forwards, scores) of one reward call."""
    modes = []
    hook = vision_tower(reward).register_forward_pre_hook(lambda module, args: modes.append(torch.is_grad_enabled()))
    try:
        scores = reward(images, prompts).scores
    finally:
        hook.remove()  # the model is cached: leave no hook behind
    return modes, scores


@pytest.fixture(scope="module")
def images():
    return quantised(sample_images(64, 80))


@pytest.mark.parametrize("name", REWARDS)
def test_no_grad_unless_the_pixels_need_grad(name, images):
    reward = build(name)
    assert torch.is_grad_enabled()
    modes, scores = grad_modes(reward, images[:2], PROMPTS[:2])  # plain images: scored under no_grad
    assert modes == [False] and not scores.requires_grad
    pixels = images[:2].clone().requires_grad_(True)
    modes, scores = grad_modes(reward, pixels, PROMPTS[:2])  # DRaFT / guidance: a graph back to the pixels
    assert modes == [True] and scores.requires_grad
    assert not any(p.requires_grad for module in modules(reward) for p in module.parameters())

    # The published-processor path is not differentiable: no_grad even when the pixels require grad.
    processor_path = build(name, preprocess="processor")
    assert processor_path.differentiable is False
    modes, scores = grad_modes(processor_path, pixels, PROMPTS[:2])
    assert modes == [False] and not scores.requires_grad


@pytest.mark.parametrize("name", REWARDS)
def test_models_cached_per_process_device_and_dtype(name):
    first, second = build(name), build(name, batch_size=2)
    for a, b in zip(modules(first), modules(second)):
        assert a is b
    reduced = build(name, dtype="bfloat16")
    assert modules(reduced)[0] is not modules(first)[0]
    assert next(modules(reduced)[0].parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("name", REWARDS)
def test_batch_size_chunks_and_empty_batch(name, images):
    whole = build(name)(images, PROMPTS).scores
    chunked = build(name, batch_size=3)(images, PROMPTS).scores
    torch.testing.assert_close(chunked, whole, atol=1e-4 * (1 + whole.abs().max().item()), rtol=0)
    empty = build(name)(images[:0], []).scores
    assert empty.shape == (0,)


@pytest.mark.parametrize("name", REWARDS)
def test_bfloat16_model_gives_float32_scores_close_to_float32(name, images):
    reference = build(name)(images, PROMPTS).scores
    scores = build(name, dtype="bfloat16")(images, PROMPTS).scores
    assert scores.dtype == torch.float32 and scores.device == images.device
    # bf16 keeps about 3 significant digits per operation: within 3% of the scores' magnitude (measured: <= 1.4%).
    assert (scores - reference).abs().max() <= 0.03 * reference.abs().max()
