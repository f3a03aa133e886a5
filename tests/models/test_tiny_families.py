"""The tiny Qwen-Image, FLUX.2 and Wan pipelines of `samplers.testing_families`: built in code, saved, loaded through
`diffrl.load_pipeline` (the loader users use), and run by diffusers' own pipelines in two steps."""

import hashlib
import time

import pytest
import torch

from diffrl.pipelines import check_pipeline, load_pipeline, read_scheduler_config
from samplers.testing_families import (
    BUILDERS,
    FAMILIES,
    QWEN_IMAGE_TEMPLATE_PREFIX,
    TINY_CALL,
    folder_size,
    tiny_family,
    tiny_qwen2_tokenizer,
)

PIPELINE_CLASS = {"qwenimage": "QwenImagePipeline", "flux2": "Flux2Pipeline", "wan": "WanPipeline"}
MAX_FOLDER_BYTES = 4_000_000


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its saved tiny folder (seed 0), built once for the module."""
    root = tmp_path_factory.mktemp("tiny_families")
    return {family: tiny_family(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def pipes(folders):
    """family -> the pipeline `diffrl.load_pipeline` makes of its folder."""
    return {family: load_pipeline(folder) for family, folder in folders.items()}


def _call(pipe, family, output_type, seed=0, **kwargs):
    """The family's pipeline in 2 steps at its tiny size (prompt by keyword: Flux2Pipeline's first argument is
    `image`); returns the images, or the frames of a video pipeline."""
    out = pipe(prompt="a red circle", num_inference_steps=2, output_type=output_type,
               generator=torch.Generator().manual_seed(seed), **TINY_CALL[family], **kwargs)  # fmt: skip
    return out.frames if family == "wan" else out.images


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_loads_through_load_pipeline(folders, pipes, family):
    folder = folders[family]
    assert type(pipes[family]).__name__ == PIPELINE_CLASS[family]
    assert folder_size(folder) < MAX_FOLDER_BYTES, f"{family}: {folder_size(folder)} bytes"
    assert check_pipeline(folder) is None  # no UNet config to return; every component folder and config is there
    assert read_scheduler_config(folder)["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert all(not p.is_meta for p in pipes[family].transformer.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_runs_in_diffusers(pipes, family):
    pipe = pipes[family]
    start = time.perf_counter()
    pixels = _call(pipe, family, "pt")
    latents = _call(pipe, family, "latent")
    seconds = time.perf_counter() - start
    if family == "wan":  # frames [B, F, 3, H, W]; latents [B, C, F', h, w] with F' = (F - 1) / 2 + 1 (tiny VAE: /2)
        assert pixels.shape == (1, 5, 3, 32, 32)
        assert latents.shape == (1, 4, 3, 8, 8)
    else:  # images [B, 3, H, W]; latents packed as [B, tokens, channels]
        assert pixels.shape == (1, 3, 32, 32)
        assert latents.shape == {"qwenimage": (1, 16, 16), "flux2": (1, 64, 16)}[family]
    assert torch.isfinite(pixels).all() and torch.isfinite(latents).all()
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert seconds < 20, f"{family}: two 2-step calls took {seconds:.1f} s"  # ~0.1-2 s; slack for a loaded CI


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_guidance_changes_the_output(pipes, family):
    """Each family's guidance path runs: true CFG with a negative prompt (Qwen-Image `true_cfg_scale`, Wan
    `guidance_scale`), embedded guidance (FLUX.2 `guidance_scale`)."""
    pipe = pipes[family]
    plain = {"qwenimage": {}, "flux2": {"guidance_scale": 1.0}, "wan": {"guidance_scale": 1.0}}[family]
    guided = {"qwenimage": {"negative_prompt": "blurry", "true_cfg_scale": 4.0},
              "flux2": {"guidance_scale": 4.0},
              "wan": {"negative_prompt": "blurry", "guidance_scale": 5.0}}[family]  # fmt: skip
    a = _call(pipe, family, "latent", **plain)
    b = _call(pipe, family, "latent", **guided)
    assert a.shape == b.shape and torch.isfinite(b).all()
    assert not torch.allclose(a, b)
    torch.testing.assert_close(_call(pipe, family, "latent", **guided), b)  # same generator, same latents


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_round_trip_and_seed(folders, pipes, tmp_path, family):
    """Saving and loading changes nothing (tokenizer, chat template, VAE statistics included): the pipeline built in
    memory and the loaded one give the same output; the same seed writes the same weights, another seed others."""
    built = BUILDERS[family](tmp_path / "again", 0)
    torch.testing.assert_close(_call(built, family, "pt"), _call(pipes[family], family, "pt"))
    other = tiny_family(family, tmp_path / "other", seed=1)

    def digest(folder):
        return hashlib.sha256((folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()

    assert digest(tmp_path / "again") == digest(folders[family])
    assert digest(other) != digest(folders[family])


def test_qwen_tokenizer_template_prefix_is_34_tokens(pipes):
    """QwenImagePipeline drops the first 34 hidden states (prompt_template_encode_start_idx): the system part of its
    template, as the real Qwen2.5 tokenizer splits it. The tiny tokenizer splits it into the same 34."""
    pipe = pipes["qwenimage"]
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert prefix == QWEN_IMAGE_TEMPLATE_PREFIX
    assert len(pipe.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 34
    assert len(tiny_qwen2_tokenizer()(prefix)["input_ids"]) == 34


def test_wan_two_experts_and_unipc(tmp_path):
    """Wan 2.2 A14B's layout (a low-noise `transformer_2` switched at `boundary_ratio`) and Wan 2.1's released
    UniPC scheduler both load and run."""
    folder = tiny_family("wan", tmp_path / "wan22", two_experts=True, scheduler="unipc")
    pipe = load_pipeline(folder)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    frames = _call(pipe, "wan", "pt", negative_prompt="blurry", guidance_scale=4.0, guidance_scale_2=3.0)
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
