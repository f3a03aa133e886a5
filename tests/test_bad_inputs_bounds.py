"""Sizes a command asks for beyond `diffrl/steering/bounds.py`, and LoRA files that do not fit: one stderr line naming
the bound, exit code 2, checked before any work (nothing written), as in test_bad_inputs.py.

The bounds are the demo's too (tests/demo/test_bounds_and_cleanup.py): one place, so `diffrl steer --set
num_samples=100000000` and the demo's budget field stop at the same number.
"""

import textwrap
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from safetensors.torch import save_file

from diffrl.cli import main
from diffrl.steering.bounds import (
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_CALL,
    MAX_LATENT_ROWS,
    MAX_NUM_STEPS,
    MAX_ROWS_PER_CALL,
)


@pytest.fixture(scope="module")
def materials(tmp_path_factory):
    """A steering recipe that asks for a huge image, and LoRA folders for tiny-shapes that do not fit it."""
    from diffrl.embedded import is_built

    if not (is_built("tiny-shapes") and is_built("tiny-shapes-flow")):
        pytest.skip("the embedded tiny-shapes pipelines are not built")
    root = tmp_path_factory.mktemp("bounds")
    (root / "huge_image.yaml").write_text(textwrap.dedent("""\
        method: best-of-n
        pipeline: tiny-shapes
        reward: jpeg_compressibility
        prompts: [a red circle]
        sample: {height: 100000, width: 64}
    """))
    good = _tiny_shapes_lora()
    keys = sorted(good)
    # every other adapter renamed onto a module that does not exist: peft builds the adapter layers from the names
    # and leaves the weights the file lacks on the meta device (a traceback when the pipeline moves)
    _save(root / "half_matching", {k.replace("to_q", "to_qq") if i % 2 else k: v for i, (k, v) in
                                   enumerate((k, good[k]) for k in keys)})
    # only the down (A) matrices: diffusers infers no rank and raises an IndexError
    _save(root / "only_down", {k: v for k, v in good.items() if "lora.down" in k})
    # every other key renamed onto a component tiny-shapes has not (a flow model's transformer): diffusers would load
    # the UNet half and drop the rest without a word
    _save(root / "other_model", {("transformer" + k.removeprefix("unet")) if i % 2 else k: good[k]
                                 for i, k in enumerate(keys)})
    _save(root / "good", good)
    return root


def _tiny_shapes_lora() -> dict:
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    from diffrl.pipelines import load_pipeline

    unet = load_pipeline("tiny-shapes").unet
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"]))
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    return {f"unet.{k}": v.contiguous() for k, v in layers.items()}


def _save(folder: Path, weights: dict) -> None:
    folder.mkdir()
    save_file(weights, str(folder / "pytorch_lora_weights.safetensors"))


STEER = ["steer", "--pipeline", "tiny-shapes", "--method", "best-of-n", "--reward", "jpeg_compressibility",
         "--prompt", "a red circle", "--out", "{tmp}/steer"]
SAMPLE = ["sample", "--pipeline", "tiny-shapes", "--prompt", "a red circle", "--steps", "1", "--out", "{tmp}/o"]
THREE_PROMPTS = ["--prompt", "a blue square", "--prompt", "a green triangle"]

CASES = [
    # steer: the sizes of one call
    ("steer-num-samples-1e8", [*STEER, "--set", "num_samples=100000000"],
     f"best-of-n's num_samples must be 1 to {MAX_LATENT_ROWS} (per prompt), got 100000000"),
    ("steer-fk-particles-1e8", [*STEER[:3], "--method", "fk", *STEER[5:], "--set", "num_particles=100000000"],
     f"fk's num_particles must be 1 to {MAX_LATENT_ROWS} (per prompt), got 100000000"),
    ("steer-svdd-candidates-1e8", [*STEER[:3], "--method", "svdd", *STEER[5:], "--set", "num_candidates=100000000"],
     f"svdd's num_candidates must be 1 to {MAX_LATENT_ROWS}"),
    ("steer-guidance-samples-1e8", [*STEER[:3], "--method", "guidance", *STEER[5:], "--set",
                                    "num_samples=100000000"], f"guidance's num_samples must be 1 to {MAX_LATENT_ROWS}"),
    ("steer-prompts-times-samples", [*STEER, *THREE_PROMPTS, "--set", "num_samples=2000"],
     (f"best-of-n would hold 3 prompts × 2000 latents = 6000 latents at once, more than {MAX_ROWS_PER_CALL}; "
      "use a smaller --prompts-per-call")),
    ("steer-fk-prompts-times-particles", [*STEER[:3], "--method", "fk", *STEER[5:], *THREE_PROMPTS,
                                          "--prompts-per-call", "2", "--set", "num_particles=4000"],
     "fk would hold 2 prompts × 4000 latents = 8000 latents at once"),
    ("steer-flow-steps-beyond-bound", [*STEER[:2], "tiny-shapes-flow", *STEER[3:], "--steps", "5000"],
     f"--steps (sample.num_steps) must be 1 to {MAX_NUM_STEPS}, got 5000"),
    ("steer-recipe-image-height", ["steer", "--recipe", "{root}/huge_image.yaml", "--out", "{tmp}/steer"],
     f"sample.height must be at most {MAX_IMAGE_SIDE}, got 100000"),
    # sample
    ("sample-flow-steps-beyond-bound", [*SAMPLE[:2], "tiny-shapes-flow", *SAMPLE[3:6], "5000", *SAMPLE[7:]],
     f"--steps must be 1 to {MAX_NUM_STEPS}, got 5000"),
    ("sample-batch-size-huge", [*SAMPLE, "--batch-size", "100000000"],
     f"--batch-size must be 1 to {MAX_ROWS_PER_CALL}, got 100000000"),
    # images one call writes: the job list alone of `sample -n 1000000000` took the machine's memory (SIGKILL)
    ("sample-images-beyond-bound", [*SAMPLE, "-n", "1000000000"],
     f"1 prompt × -n 1000000000 = 1000000000 images, more than the bound of {MAX_IMAGES_PER_CALL} for one call"),
    ("sample-images-beyond-bound-over-prompts", [*SAMPLE, *THREE_PROMPTS, "-n", "40000"],
     f"3 prompts × -n 40000 = 120000 images, more than the bound of {MAX_IMAGES_PER_CALL}"),
    ("pairs-num-pairs-beyond-bound", ["pairs", "sample", "d3po/tiny_shapes_labels", "--out", "{tmp}/o", "-n",
                                      str(10**12)], f"--num-pairs must be 1 to {MAX_IMAGES_PER_CALL // 2}, got {10**12}"),
    ("pairs-batch-size-beyond-bound", ["pairs", "sample", "d3po/tiny_shapes_labels", "--out", "{tmp}/o",
                                       "--batch-size", str(10**9)],
     f"--batch-size must be 1 to {MAX_ROWS_PER_CALL // 2}, got {10**9}"),
    # sample --lora and steer --lora (one loader, diffrl.pipelines.load_lora_into): a LoRA file that does not fit is
    # one line (no diffusers/peft warning, no traceback)
    ("sample-lora-half-matching", [*SAMPLE, "--lora", "{root}/half_matching"],
     "adapter weights it declares are not in its file"),
    ("sample-lora-only-down-matrices", [*SAMPLE, "--lora", "{root}/only_down"],
     "cannot load LoRA {root}/only_down/pytorch_lora_weights.safetensors into StableDiffusionPipeline: IndexError"),
    ("sample-lora-keys-for-another-model", [*SAMPLE, "--lora", "{root}/other_model"],
     "keys match StableDiffusionPipeline (unet); the other"),
    ("steer-lora-half-matching", [*STEER, "--lora", "{root}/half_matching"],
     "adapter weights it declares are not in its file"),
    ("steer-lora-only-down-matrices", [*STEER, "--lora", "{root}/only_down"],
     "cannot load LoRA {root}/only_down/pytorch_lora_weights.safetensors into StableDiffusionPipeline: IndexError"),
    ("steer-lora-keys-for-another-model", [*STEER, "--lora", "{root}/other_model"],
     "are for transformer, which it has not"),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_size_beyond_bound_is_one_line_and_writes_nothing(materials, tmp_path, capsys, argv, expected):
    values = {"root": materials, "tmp": tmp_path}
    one_line_error(capsys, [a.format(**values) for a in argv], expected.format(**values), materials, tmp_path)
    assert not (tmp_path / "steer").exists() or not any((tmp_path / "steer").iterdir())
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_lora_that_fits_still_loads_and_prints_nothing_on_stderr(materials, tmp_path, capsys):
    capsys.readouterr()
    assert main([*[a.format(tmp=tmp_path) for a in SAMPLE], "--lora", str(materials / "good")]) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "o" / "00000.png").is_file()


def test_steer_api_checks_the_same_bounds_before_building_anything():
    """`diffrl.steering.steer` (the Python API the demo and the CLI call) refuses before it touches the pipeline."""
    from diffrl.errors import UserError
    from diffrl.steering import steer

    no_pipeline = object()  # never used: the checks come first
    with pytest.raises(UserError, match=f"more than {MAX_ROWS_PER_CALL}; use fewer prompts per call"):
        steer(no_pipeline, ["x"] * 8, "jpeg_compressibility", "best-of-n", num_samples=1000)
    with pytest.raises(UserError, match=f"num_steps must be 1 to {MAX_NUM_STEPS}, got 100000"):
        steer(no_pipeline, ["x"], "jpeg_compressibility", "best-of-n", num_steps=100000)
    with pytest.raises(UserError, match=f"width must be 1 to {MAX_IMAGE_SIDE}, got 5000"):
        steer(no_pipeline, ["x"], "jpeg_compressibility", "fk", width=5000)


def test_evaluation_images_have_the_bound_of_sample():
    from diffrl.config import MAX_EVAL_IMAGES

    assert MAX_EVAL_IMAGES == MAX_IMAGES_PER_CALL


def test_a_recipes_image_side_has_the_bound_of_steering():
    from diffrl.config import MAX_IMAGE_SIDE as RECIPE_MAX_IMAGE_SIDE

    assert RECIPE_MAX_IMAGE_SIDE == MAX_IMAGE_SIDE


def test_bounds_are_within_what_the_shipped_recipes_use():
    """Every shipped steering recipe stays inside the bounds (the bounds refuse typos, not real use)."""
    from diffrl.shipped_recipes import find_recipe
    from diffrl.steering import method_config
    from diffrl.steering.recipe import load_steer_recipe

    folder = find_recipe("steer/tiny-shapes_verifier_fk").parent
    for path in sorted(folder.glob("*.yaml")):
        recipe = load_steer_recipe(str(path))
        rows = recipe.prompts_per_call * method_config(recipe.method, **recipe.steer).latent_rows
        assert rows <= MAX_ROWS_PER_CALL, path.name
