"""Shared test setup: offline hub, the `gpu` marker, and session-wide tiny pipelines.

Tests never touch the network (`HF_HUB_OFFLINE=1` is set before anything imports huggingface_hub).
`@pytest.mark.gpu` tests are skipped without CUDA. The tiny random pipelines come from `tiny_models`
(importable from any test: this folder is on `sys.path`).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the tests run on the CPU; left to detect its accelerator, DeepSpeed prints "Setting accelerator to CPU" to stdout
# the first time anything imports it (transformers does, when loading a model), into whichever test checks its output
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# runs in tests evaluate the base model themselves; tests/trainers/test_eval_cache.py turns the cache on in a tmp dir
os.environ.setdefault("DIFFRL_EVAL_CACHE", "off")

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_sd():
    """A tiny random `StableDiffusionPipeline` (DDIM, SD 1.x schedule, 16x16 images). Do not modify it."""
    from tiny_models import tiny_sd_pipeline

    return tiny_sd_pipeline()


@pytest.fixture(scope="session")
def tiny_lcm():
    """A tiny random `LatentConsistencyModelPipeline` (LCMScheduler, 32-d w-embedding). Do not modify it."""
    from tiny_models import tiny_lcm_pipeline

    return tiny_lcm_pipeline()


@pytest.fixture(scope="session")
def tiny_sd3():
    """A tiny random `StableDiffusion3Pipeline` (flow matching, shift 3, 16x16 images). Do not modify it."""
    from tiny_models import tiny_sd3_pipeline

    return tiny_sd3_pipeline()
