"""The demo's Generate with a run's LoRA draws at the size the run trained at (its config.yaml's sample.height /
sample.width), as `diffrl sample --lora RUN` does; `height`/`width` override it; without a run, the pipeline's.
Compare draws each run at its size, and the base model at the fine-tuned run's."""

import pytest
from demo_helpers import demo_module, make_lora_run, require_tiny_shapes

from diffrl.errors import UserError


@pytest.fixture(scope="module")
def engine():
    require_tiny_shapes()
    return demo_module("engine").Engine(device="cpu")


@pytest.fixture(scope="module")
def run_at_24x40(tmp_path_factory):
    run = make_lora_run(tmp_path_factory.mktemp("runs") / "sized")
    with open(run / "config.yaml", "a") as f:
        f.write("sample: {height: 24, width: 40}\n")  # tiny-shapes: VAE factor 4, so multiples of 4
    (run / "metrics.jsonl").write_text("")  # a folder inside a run dir finds the run's config through it
    return run


def _sizes(engine, lora, method="plain", **size):
    generation = engine.generate(pipeline="", lora=str(lora) if lora else None, prompt="a red circle",
                                 negative_prompt=None, seed=3, steps=2, guidance_scale=5.0, num_images=2,
                                 method=method, budget=2, settings="", weights={"jpeg_compressibility": 1.0},
                                 **size)
    return {item.pixels.size for item in generation.items}  # PIL: (width, height)


@pytest.mark.parametrize("method", ["plain", "best-of-n"])
def test_generate_with_a_runs_lora_draws_at_the_runs_size(engine, run_at_24x40, method):
    assert _sizes(engine, run_at_24x40, method) == {(40, 24)}
    assert _sizes(engine, run_at_24x40, method, height=16) == {(40, 16)}  # the override wins over the run's
    assert _sizes(engine, run_at_24x40 / "checkpoints" / "step-2", method, width=8) == {(8, 24)}


def test_generate_without_a_run_draws_at_the_pipelines_size(engine, tmp_path):
    plain = make_lora_run(tmp_path / "unsized")  # a run whose config.yaml sets no size
    assert _sizes(engine, plain) == {(32, 32)}  # tiny-shapes: 32 px


def test_generate_refuses_a_size_beyond_the_bound(engine, run_at_24x40):
    with pytest.raises(UserError, match="height must be <= 4096, got 5000"):
        _sizes(engine, run_at_24x40, height=5000)


def _compare_sizes(engine, run, other=None):
    result = engine.compare(run_dir=str(run), other_run_dir=str(other) if other else None, pipeline=None,
                            prompts="a red circle\na blue square", images_per_prompt=1, seed=3, steps=2,
                            guidance_scale=5.0, weights={"jpeg_compressibility": 1.0})
    return ({item.pixels.size for item in result["left_items"]},  # PIL: (width, height)
            {item.pixels.size for item in result["right_items"]})


def test_compare_draws_each_run_at_its_size_and_the_base_at_the_runs(engine, run_at_24x40, tmp_path):
    assert _compare_sizes(engine, run_at_24x40) == ({(40, 24)}, {(40, 24)})  # the base at the run's size
    plain = make_lora_run(tmp_path / "unsized")  # no size in its config.yaml: the pipeline's 32 px
    assert _compare_sizes(engine, plain) == ({(32, 32)}, {(32, 32)})
    assert _compare_sizes(engine, run_at_24x40, other=plain) == ({(32, 32)}, {(40, 24)})  # each run its own
