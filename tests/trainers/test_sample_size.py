"""A recipe's `sample.height` / `sample.width` reach every image a run samples (rollouts, evaluation, DRaFT's graph),
are kept in the run's config.yaml, are what `diffrl sample --lora RUN` and an export sample at, and a size the model
cannot take fails before anything is written. The tiny pipelines sample 16x16 images by default (VAE factor 2,
patch 1)."""

import json

import pytest
import yaml
from pg_helpers import TINY, _Reward, load_cfg, tiny_flow_pipeline_dir, tiny_pipeline_dir, tiny_recipe, with_trainer
from PIL import Image

from diffrl.cli import main
from diffrl.config import check_references, config_from_dict, load_run_config
from diffrl.errors import UserError

SEEN = {"reward": [], "gold": []}  # image shapes [3, H, W] each reward was called with, in this process


def _recording(key: str, differentiable: bool):
    def fn(images, prompts):
        SEEN[key].extend(tuple(image.shape) for image in images)
        return images.mean(dim=(1, 2, 3))

    return _Reward(f"recording_{key}", fn, differentiable=differentiable)


def recording_reward():
    """Brightness (differentiable, so DRaFT takes it too) that records the shape of every image it scores."""
    return _recording("reward", differentiable=True)


def recording_gold():
    return _recording("gold", differentiable=False)


def _recipe(tmp_path, trainer: str, size: dict) -> dict:
    groups = with_trainer(TINY[trainer], trainer)
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path / "runs", **groups)
    recipe["run"].update(num_epochs=1, eval_every=1, save_every=1)
    recipe["sample"].update(size)
    recipe["reward"] = {"name": "test_sample_size:recording_reward"}
    recipe["reward"]["gold"] = "test_sample_size:recording_gold"
    return recipe


@pytest.fixture(autouse=True)
def _clear_seen():
    for shapes in SEEN.values():
        shapes.clear()


@pytest.mark.parametrize(("size", "expected"), [({"height": 32, "width": 24}, (3, 32, 24)),
                                                 ({"height": 0, "width": 0}, (3, 16, 16))])  # 0: the model's default
def test_flow_grpo_rollouts_and_evaluation_sample_at_the_recipe_size(tmp_path, size, expected):
    from diffrl.trainers import flow_grpo

    recipe = _recipe(tmp_path, "flow_grpo", size)
    assert recipe["model"]["pipeline"] == str(tiny_flow_pipeline_dir(tmp_path))
    flow_grpo.train(load_cfg(recipe), tmp_path / "runs" / "t")
    # one epoch of 2 batches of 2 rollouts, and 2 evaluations (before training, final) of sample.eval_num_images = 4,
    # scored by the gold reward and the training reward (the proxy)
    assert len(SEEN["reward"]) == 4 + 2 * 4 and set(SEEN["reward"]) == {expected}
    assert len(SEEN["gold"]) == 2 * 4 and set(SEEN["gold"]) == {expected}
    saved = load_run_config(tmp_path / "runs" / "t")  # what `diffrl resume` rebuilds the run from
    assert (saved.sample.height, saved.sample.width) == (size["height"], size["width"])


@pytest.mark.parametrize("trainer", ["ddpo", "draft"])
def test_unet_trainers_sample_at_the_recipe_size_and_diffrl_sample_of_the_run_too(tmp_path, capsys, trainer):
    recipe = _recipe(tmp_path, trainer, {"height": 24, "width": 32})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "recipe.yaml")]) == 0, capsys.readouterr().err
    assert SEEN["reward"] and set(SEEN["reward"]) == {(3, 24, 32)}
    assert len(SEEN["gold"]) == 2 * 4 and set(SEEN["gold"]) == {(3, 24, 32)}
    run_dir = tmp_path / "runs" / "t"
    with open(run_dir / "config.yaml") as f:
        assert yaml.safe_load(f)["sample"]["height"] == 24

    out = tmp_path / "samples"
    assert main(["sample", "--lora", str(run_dir), "--prompt", "a red circle", "--steps", "2", "--out", str(out)]) == 0
    assert Image.open(out / "00000.png").size == (32, 24)  # PIL: (width, height)
    out = tmp_path / "samples-flag"
    assert main(["sample", "--lora", str(run_dir), "--prompt", "a red circle", "--steps", "2", "--height", "8",
                 "--out", str(out)]) == 0
    assert Image.open(out / "00000.png").size == (32, 8)  # the flag wins over the run's height
    if trainer != "ddpo":
        return
    export = tmp_path / "export"  # the card's diffusers call and the saved base carry the run's size
    assert main(["export", str(run_dir), "--with-base", "--out", str(export)]) == 0
    assert "height=24, width=32" in (export / "README.md").read_text()
    index = json.loads((export / "base" / "model_index.json").read_text())
    assert (index["_diffrl_height"], index["_diffrl_width"]) == (24, 32)
    out = tmp_path / "samples-export"
    assert main(["sample", "--pipeline", str(export / "base"), "--lora", str(export), "--prompt", "a red circle",
                 "--steps", "2", "--out", str(out)]) == 0
    assert Image.open(out / "00000.png").size == (32, 24)


@pytest.mark.parametrize(("trainer", "override", "expected"), [
    ("flow_grpo", "sample.height=33", "sample.height=33 is not a multiple of 2"),
    ("ddpo", "sample.width=15", "sample.width=15 is not a multiple of 2"),
    ("ddpo", "sample.num_frames=5", "sample.num_frames=5:"),  # an image model takes no frame count
])
def test_a_size_the_model_cannot_take_fails_before_the_run_dir_exists(tmp_path, capsys, trainer, override,
                                                                       expected):
    recipe = _recipe(tmp_path, trainer, {})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    for verb in ("validate", "run"):
        capsys.readouterr()
        assert main([verb, str(tmp_path / "recipe.yaml"), override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "runs").exists()


def test_a_negative_size_is_a_one_line_error(tmp_path):
    recipe = _recipe(tmp_path, "ddpo", {})
    with pytest.raises(UserError, match="sample.height must be >= 0, got -512"):
        config_from_dict(recipe, ["sample.height=-512"])
    with pytest.raises(UserError, match="sample.width must be <= 4096, got 100000"):
        config_from_dict(recipe, ["sample.width=100000"])
    cfg = config_from_dict(recipe, ["sample.height=64", "sample.width=48"])
    check_references(cfg)  # multiples of the tiny pipeline's 2 pass


# The image size of each published-settings recipe, as read in its reference's files (the recipe's comment names it)
PUBLISHED_SIZES = {
    "flow_grpo/sd35m_pickscore": (512, 512, 0),  # yifan123/flow_grpo@ac4c86e config/grpo.py:pickscore_sd3
    "flow_grpo/flux_dev_pickscore": (512, 512, 0),  # the same config (flow_grpo has no FLUX config)
    "flow_grpo/qwen_image_pickscore": (512, 512, 0),  # Flow-Factory@a0b2bc5 examples/grpo/lora/qwen_image/default.yaml
    "flow_grpo/flux2_dev_pickscore": (512, 512, 0),  # Flow-Factory@a0b2bc5 examples/grpo/lora/flux2/t2i.yaml
    "flow_grpo/wan21_t2v_clip_pickscore": (256, 256, 5),  # Flow-Factory@a0b2bc5 examples/grpo/lora/wan21/t2v.yaml
    "flow_grpo/mixgrpo_flux_dev_multireward": (720, 720, 0),  # MixGRPO@e5cdd6a finetune_flux_grpo_MixGRPO.sh
    "diffusion_nft/sd35m_pickscore": (512, 512, 0),  # NVlabs/DiffusionNFT@24af555 config/nft.py
    "awm/sd35m_pickscore": (512, 512, 0),  # scxue/advantage_weighted_matching@be51372 config/dgx_awm.py
    "draft/wan21_instructvideo_hpsv2": (256, 256, 17),  # VGen@4014d1f: 256x256, 16 frames -> 4k + 1
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_published_settings_recipes_sample_at_their_references_size(name):
    from diffrl.config import load_recipe

    cfg = load_recipe(name)
    assert (cfg.sample.height, cfg.sample.width, cfg.sample.num_frames) == PUBLISHED_SIZES[name]


# Image side multiples of the tiny family pipelines (samplers/testing_families.py): Qwen-Image's and Wan's VAE spatial
# factor 4 × their transformers' 2x2 patch = 8; FLUX.2's VAE (block_out_channels [8, 16]) factor 2 × its 2x2
# patchified latents = 4. Wan's VAE halves frames: 2k + 1.
@pytest.mark.parametrize(("family", "multiple"), [("qwenimage", 8), ("flux2", 4), ("wan", 8)])
def test_the_size_check_from_configs_agrees_with_each_loaded_family(tmp_path, family, multiple):
    from diffrl.models import model_family
    from diffrl.pipelines import check_sampling_size, load_pipeline
    from samplers.testing_families import tiny_family

    folder = tiny_family(family, tmp_path / family)
    frames = 5 if family == "wan" else 0
    good, bad = 3 * multiple, 3 * multiple // 2  # bad: an odd number of half-multiples
    check_sampling_size(folder, height=good, width=5 * multiple, num_frames=frames)
    with pytest.raises(UserError, match=f"sample.height={bad} is not a multiple of {multiple}"):
        check_sampling_size(folder, height=bad, width=5 * multiple, num_frames=frames)
    shape_family = model_family(load_pipeline(folder))
    args = (frames,) if frames else ()
    assert shape_family.latent_shape(good, 5 * multiple, *args)[1:] == (good, 5 * multiple)
    with pytest.raises(UserError, match=f"multiples of {multiple}"):
        shape_family.latent_shape(bad, 5 * multiple, *args)
    if family == "wan":
        with pytest.raises(UserError, match=r"sample.num_frames=4 is not 2·k \+ 1"):
            check_sampling_size(folder, height=good, width=good, num_frames=4)
        with pytest.raises(UserError, match=r"num_frames must be 2·k \+ 1"):
            shape_family.latent_shape(good, good, 4)
    else:
        with pytest.raises(UserError, match="sample.num_frames=5: .* is an image model"):
            check_sampling_size(folder, height=good, width=good, num_frames=5)


def test_pairs_are_drawn_at_the_recipes_size_and_d3po_trains_on_them(tmp_path, capsys):
    """`diffrl pairs sample` draws at the recipe's size, and D3PO, which recomputes the chains' log-probs at the
    size its pipeline samples, trains on them (chains of another size are refused)."""
    out = tmp_path / "labels"
    groups = with_trainer({"run": {"num_epochs": 1, "save_every": 1}, "sample": {"height": 24, "width": 32}}, "d3po")
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path / "runs", **groups)
    recipe["train"].update({"preference": "labels", "labels": str(out / "pairs.jsonl")})
    (tmp_path / "labels.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["pairs", "sample", str(tmp_path / "labels.yaml"), "--out", str(out), "-n", "2"]) == 0
    lines = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert {Image.open(out / path).size for line in lines for path in line["images"]} == {(32, 24)}
    for line in lines:
        line["choice"] = 0
    (out / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()
    assert main(["run", str(tmp_path / "labels.yaml"), "sample.height=16"]) == 2  # latents 12x16, the run's 8x16
    assert "are [4, 12, 16] per step" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    assert main(["run", str(tmp_path / "labels.yaml")]) == 0, capsys.readouterr().err
