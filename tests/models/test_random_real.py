"""`samplers.random_real` (the released SD3.5-Medium, FLUX.1-dev and Qwen-Image architectures with random weights,
for `diffrl bench scale` on a GPU) built on the meta device, and the sampling size a folder's `_diffrl_height` /
`_diffrl_width` sets on the SD3 and FLUX.1 families (the bench registers its `--size` that way)."""

import pytest
import torch

from samplers.flow import FlowSampler
from samplers.random_real import random_real_pipeline
from samplers.testing import tiny_flux_pipeline, tiny_sd3_pipeline

# The released models' published sizes (model cards and announcements): SD3.5 Medium 2.5B (its MMDiT-X with the
# 384x384x1536 position table diffusers keeps as a buffer), FLUX.1-dev 12B, Qwen-Image 20B, the T5 v1.1 XXL encoder
# 4.7B, Qwen2.5-VL-7B's language model ~7.6B with its two 152064-word embedding tables (the vision tower is cut to
# one block here). A wrong width or a tower built twice is off by far more than the rounding of these figures.
PUBLISHED = {
    ("sd35m", "transformer"): 2.5e9, ("sd35m", "text_encoder_3"): 4.7e9,
    ("flux1dev", "transformer"): 12e9, ("flux1dev", "text_encoder_2"): 4.7e9,
    ("qwenimage", "transformer"): 20e9, ("qwenimage", "text_encoder"): 7.6e9,
}  # fmt: skip


def _size(module):
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()] if t.is_floating_point())


@pytest.mark.parametrize("preset", ["sd35m", "flux1dev", "qwenimage"])
def test_released_sizes_on_the_meta_device(preset):
    pipe = random_real_pipeline(preset, device="meta")
    for (name, component), published in PUBLISHED.items():
        if name == preset:
            module = getattr(pipe, component)
            assert module.dtype == torch.bfloat16
            assert _size(module) == pytest.approx(published, rel=0.05), component
    shallow = random_real_pipeline(preset, device="meta", depth=1)
    assert _size(shallow.transformer) < _size(pipe.transformer) / 5  # one block per stack, widths unchanged
    assert shallow.transformer.config.attention_head_dim == pipe.transformer.config.attention_head_dim


@pytest.mark.parametrize("build", [tiny_sd3_pipeline, tiny_flux_pipeline])
def test_folder_size_keys_set_the_sampling_size(build):
    """A folder's `_diffrl_height`/`_diffrl_width` (registered on the loaded pipeline) is the default size; an explicit
    size still wins. Without them: the tiny SD3's transformer `sample_size` 8 x VAE scale 2 = 16 px; the tiny FLUX's
    `FluxPipeline.default_sample_size` 128 x VAE scale 2 = 256 px."""
    pipe = build()
    sampler = FlowSampler()

    def size(**kwargs):
        traj = sampler.sample(pipe, ["a red circle"], num_steps=1, guidance_scale=1.0, eta=0.0,
                              generator=torch.Generator().manual_seed(0), **kwargs)
        return tuple(traj.images.shape[-2:])

    assert size() == ((16, 16) if build is tiny_sd3_pipeline else (256, 256))
    pipe.register_to_config(_diffrl_height=32, _diffrl_width=24)
    assert size() == (32, 24)
    assert size(height=16, width=16) == (16, 16)


@pytest.mark.parametrize("images, recipe_micro, micro, accumulation", [(8, 9, 8, 1), (16, 9, 8, 2), (8, 1, 1, 8),
                                                                        (6, 4, 3, 2), (5, 9, 5, 1)])
def test_bench_scale_splits_an_epoch_into_whole_micro_batches(images, recipe_micro, micro, accumulation):
    """`diffrl bench scale` trains one group of `images` per epoch in one optimizer step: micro-batches of the
    recipe's size, or of the largest divisor of `images` below it (16 images with the SD3.5 recipe's 9 failed the
    trainer's check on the GPU before this)."""
    from types import SimpleNamespace

    from diffrl.bench.scale import bench_overrides

    args = SimpleNamespace(images=images, dtype="bf16", epochs=2, size=None, no_checkpointing=False, overrides=[])
    out = bench_overrides(args, SimpleNamespace(train=SimpleNamespace(batch_size=recipe_micro)))
    assert f"train.batch_size={micro}" in out and f"optim.gradient_accumulation_steps={accumulation}" in out
    assert f"sample.batch_size={images}" in out and f"advantage.group_size={images}" in out
    assert "model.gradient_checkpointing=true" in out and not [o for o in out if o.startswith("sample.height")]


def test_bench_scale_hands_its_pipeline_to_the_trainers_loader():
    """Patching `LOADER` is what makes the run context's `load_policy_pipeline` return the bench's pipeline (the bench
    silently loaded by name — and failed on its label — once setup imported `load_pipeline` at its top)."""
    from types import SimpleNamespace
    from unittest import mock

    from diffrl.bench.scale import LOADER
    from diffrl.config import load_recipe
    from diffrl.training.setup import load_policy_pipeline
    from samplers.testing import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline()
    cfg = load_recipe("flow_grpo/tiny_shapes_flow_verifier")
    cfg.model.pipeline = "random-label-that-is-no-pipeline"
    with mock.patch(LOADER, lambda *args, **kwargs: pipe):
        assert load_policy_pipeline(cfg, SimpleNamespace(device=torch.device("cpu"))) is pipe
