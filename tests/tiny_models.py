"""Tiny random-weight pipelines for tests: `from tiny_models import tiny_sd_pipeline` in any test.

The builders live in `samplers.testing` (the sample benchmark uses them too); this module is the tests'
entry point. All are seeded, CPU, fp32:

- `tiny_sd_components(seed=0, **kw)`: constructor kwargs of a `StableDiffusionPipeline` (DDIM scheduler with
  the SD 1.x schedule; `time_cond_proj_dim=`, `scheduler="lcm"`, `prediction_type=` variants).
- `tiny_sd_pipeline(tmp_path=None, seed=0, **kw)`: the pipeline; with `tmp_path` it is saved there and loaded
  back with `from_pretrained` (the loader users use).
- `tiny_lcm_pipeline(tmp_path=None, seed=0, **kw)`: a `LatentConsistencyModelPipeline`.
- `tiny_sdxl_pipeline(tmp_path=None, seed=0)`: a `StableDiffusionXLPipeline` (two text encoders).
- `tiny_tokenizer()`: the character-level `CLIPTokenizer` they share.
- `tiny_sd3_pipeline(tmp_path=None, seed=0, **kw)`, `tiny_flux_pipeline(tmp_path=None, seed=0, **kw)`: flow-matching
  pipelines (small transformer, tiny VAE, tiny CLIP and T5 towers; `tiny_t5_tokenizer()`).
- `embedded_or_skip(name)`: an embedded ShapesWorld pipeline (`tiny-shapes`, ...) on the CPU, or a skip when this
  checkout has not built it.
"""

from samplers.testing import (  # noqa: F401
    SD_SCHEDULER_CONFIG,
    tiny_flux_pipeline,
    tiny_lcm_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_components,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
    tiny_t5_tokenizer,
    tiny_tokenizer,
    tiny_unet,
    tiny_vae,
)


def embedded_or_skip(name: str):
    """The embedded pipeline `name` loaded the way users load it, or skip the test when it is not built."""
    import pytest

    from diffrl.errors import UserError
    from diffrl.pipelines import load_pipeline

    try:
        return load_pipeline(name, device="cpu")
    except UserError as e:
        pytest.skip(f"{name} is not built: {e}")
