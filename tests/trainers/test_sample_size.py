"""A recipe's `sample.height` / `sample.width` reach every image a run samples (rollouts, evaluation, DRaFT's graph),
are kept in the run's config.yaml, are what `diffrl sample --lora RUN` and an export sample at, and a size the model
cannot take fails before anything is written. The tiny pipelines sample 16x16 images by default (VAE factor 2,
patch 1)."""

import json
from collections import Counter

import pytest
import yaml
from pg_helpers import TINY, _Reward, load_cfg, tiny_flow_pipeline_dir, tiny_pipeline_dir, tiny_recipe, with_trainer
from PIL import Image

from diffrl.cli import main
from diffrl.config import config_from_dict, load_run_config
from diffrl.config_references import check_references
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


@pytest.mark.parametrize(("size", "rollout", "evaluation"), [
    ({"height": 32, "width": 24, "eval_height": 16, "eval_width": 40}, (3, 32, 24), (3, 16, 40)),
    ({"height": 32, "width": 24, "eval_width": 40}, (3, 32, 24), (3, 32, 40)),  # eval_height 0: the training one
])
def test_flow_grpo_evaluates_at_the_eval_size_and_rolls_out_at_the_training_size(tmp_path, size, rollout,
                                                                                   evaluation):
    from diffrl.trainers import flow_grpo

    recipe = _recipe(tmp_path, "flow_grpo", size)
    flow_grpo.train(load_cfg(recipe), tmp_path / "runs" / "t")
    # the training reward scores the epoch's 2 x 2 rollouts and, with the gold, the 2 evaluations of 4 images
    assert Counter(SEEN["reward"]) == {rollout: 4, evaluation: 2 * 4}
    assert len(SEEN["gold"]) == 2 * 4 and set(SEEN["gold"]) == {evaluation}
    saved = load_run_config(tmp_path / "runs" / "t")  # config.yaml, what `diffrl resume` rebuilds the run from
    assert (saved.sample.eval_height, saved.sample.eval_width) == (size.get("eval_height", 0), size["eval_width"])
    # the model card's held-out results say at which size they were drawn
    assert main(["export", str(tmp_path / "runs" / "t"), "--out", str(tmp_path / "export")]) == 0
    card = " ".join((tmp_path / "export" / "README.md").read_text().split())
    assert f", at {evaluation[1]}×{evaluation[2]} px (rollouts at 32×24 px))" in card


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
    # `diffrl steer --lora RUN` steers at the run's size too, `--height`/`--width` override it, a bad one is one line
    steer = ["steer", "--pipeline", str(tiny_pipeline_dir(tmp_path)), "--lora", str(run_dir), "--method",
             "best-of-n", "--set", "num_samples=2", "--reward", "jpeg_compressibility", "--prompt", "a red circle",
             "--steps", "2"]
    assert main([*steer, "--out", str(tmp_path / "steered")]) == 0
    assert Image.open(tmp_path / "steered" / "00000.png").size == (32, 24)
    settings = json.loads((tmp_path / "steered" / "settings.json").read_text())
    assert (settings["recipe"]["sample"]["height"], settings["recipe"]["sample"]["width"]) == (24, 32)
    assert main([*steer, "--width", "8", "--out", str(tmp_path / "steered-flag")]) == 0
    assert Image.open(tmp_path / "steered-flag" / "00000.png").size == (8, 24)
    capsys.readouterr()
    assert main([*steer, "--height", "7", "--out", str(tmp_path / "steered-bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--height (sample.height)=7 is not a multiple of 2" in err, err
    assert not (tmp_path / "steered-bad").exists()
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
    ("flow_grpo", "sample.eval_height=31", "sample.eval_height=31 is not a multiple of 2"),
    ("ddpo", "sample.eval_width=17", "sample.eval_width=17 is not a multiple of 2"),
    ("ddpo", "sample.eval_num_frames=5", "sample.eval_num_frames=5:"),
    ("ddpo", "sample.eval_height=5000", "sample.eval_height must be <= 4096, got 5000"),
    ("ddpo", "sample.eval_num_frames=2000", "sample.eval_num_frames must be <= 1025, got 2000"),
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


# Their held-out evaluation size where the reference evaluates at another (0 = the training size's)
PUBLISHED_EVAL_SIZES = {
    # X-GenGroup/Flow-Factory@a0b2bc5 examples/grpo/lora/qwen_image/default.yaml eval: resolution 1024
    "flow_grpo/qwen_image_pickscore": (1024, 1024, 0),
    "flow_grpo/flux2_dev_pickscore": (1024, 1024, 0),  # the same commit, examples/grpo/lora/flux2/t2i.yaml
    # the same commit, examples/grpo/lora/wan21/t2v.yaml eval: resolution 480, num_frames 13
    "flow_grpo/wan21_t2v_clip_pickscore": (480, 480, 13),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_published_settings_recipes_sample_at_their_references_size(name):
    from diffrl.config import load_recipe

    cfg = load_recipe(name)
    assert (cfg.sample.height, cfg.sample.width, cfg.sample.num_frames) == PUBLISHED_SIZES[name]
    s = cfg.sample
    assert (s.eval_height, s.eval_width, s.eval_num_frames) == PUBLISHED_EVAL_SIZES.get(name, (0, 0, 0))


# The tiny pipeline of every family, and what its size rule must give, worked out by hand from the builders' configs:
# (default height, default width, default frames, side multiple, VAE's temporal factor or None for an image model).
# SD: AutoencoderKL block_out_channels (8, 16) -> VAE factor 2, UNet sample_size 8 -> 16 px. SD3 at the released
# patch size 2: factor 2 × patch 2 = 4, transformer sample_size 8 -> 16 px. FLUX.1 and FLUX.2: factor 2 × the 2x2
# packing = 4, default_sample_size 128 -> 256 px. Qwen-Image: its VAE's temperal_downsample has 2 entries -> factor
# 2^2 = 4, × 2x2 packing = 8, 128 × 4 = 512 px. Wan: scale_factor_spatial 4 × patch (1, 2, 2) = 8, WanPipeline's
# 480x832 and 81 frames, scale_factor_temporal 2 -> 2k + 1 frames.
FAMILY_SIZES = {
    "sd": (16, 16, 0, 2, None),
    "sd3_patch2": (16, 16, 0, 4, None),
    "flux": (256, 256, 0, 4, None),
    "flux2": (256, 256, 0, 4, None),
    "qwenimage": (512, 512, 0, 8, None),
    "wan": (480, 832, 81, 8, 2),
}


def _tiny_family_folder(family: str, folder):
    from samplers.testing import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sd_pipeline
    from samplers.testing_families import tiny_family

    if family == "sd":
        tiny_sd_pipeline(folder)
    elif family == "sd3_patch2":
        tiny_sd3_pipeline(folder, patch_size=2, t5=False)
    elif family == "flux":
        tiny_flux_pipeline(folder)
    else:
        tiny_family(family, folder)
    return folder


def _refusals(folder, pipe, height, width, num_frames):
    """(the config-time check's message, the loaded family's), each None where it accepts the size. The loaded
    family gets frames as a recipe's reach it: registered on the pipeline (`set_sampling_size`)."""
    from diffrl.models import model_family
    from diffrl.pipelines import check_sampling_size

    messages = []
    try:
        check_sampling_size(folder, height=height, width=width, num_frames=num_frames)
        messages.append(None)
    except UserError as e:
        messages.append(str(e))
    pipe.register_to_config(_diffrl_num_frames=num_frames)
    family = model_family(pipe)
    try:
        family.latent_shape(height, width)
        messages.append(None)
    except UserError as e:
        messages.append(str(e))
    return messages


@pytest.mark.parametrize("family", sorted(FAMILY_SIZES))
def test_the_size_check_from_configs_and_the_loaded_family_are_one_rule(tmp_path, family):
    """`diffrl.pipelines.check_sampling_size` (before loading: validate, run, resume, sample's flags) and the loaded
    family's `latent_shape` call the family's one `sampling_size`: the same defaults, the same sizes accepted, the
    same one-line refusals (the config-time one names the recipe's keys), on every family's tiny pipeline."""
    from diffrl.models import model_family
    from diffrl.pipelines import check_sampling_size, load_pipeline

    height, width, frames, multiple, temporal = FAMILY_SIZES[family]
    folder = _tiny_family_folder(family, tmp_path / family)
    pipe = load_pipeline(folder)
    loaded = model_family(pipe)
    assert tuple(check_sampling_size(folder, height=0, width=0, num_frames=0)) == (height, width, frames)
    shape, h, w = loaded.latent_shape(None, None)
    assert (h, w) == (height, width)
    factor = pipe.vae_scale_factor_spatial if family == "wan" else pipe.vae_scale_factor  # diffusers' own
    packed = 2 if family == "flux2" else 1  # FLUX.2's latents are 2x2-patchified into channels
    assert shape[-2:] == (height // (factor * packed), width // (factor * packed))

    good_frames = 5 if temporal else 0
    assert _refusals(folder, pipe, 3 * multiple, 5 * multiple, good_frames) == [None, None]
    bad_sizes = {(3 * multiple + 1, 5 * multiple), (3 * multiple, 5 * multiple + multiple // 2)}
    bad_sizes.add((3 * multiple + multiple // 2, 5 * multiple))  # a VAE multiple where the patch needs more
    for bad_height, bad_width in sorted(bad_sizes):
        config_message, family_message = _refusals(folder, pipe, bad_height, bad_width, good_frames)
        assert config_message and family_message and "\n" not in config_message, (bad_height, bad_width)
        assert config_message.replace("sample.", "") == family_message
        bad = bad_height if bad_height % multiple else bad_width
        assert config_message.startswith(f"sample.{'height' if bad_height % multiple else 'width'}={bad} is not "
                                         f"a multiple of {multiple}, which ")
    bad_frames = 4 if temporal else 5
    config_message, family_message = _refusals(folder, pipe, 3 * multiple, 5 * multiple, bad_frames)
    assert config_message and config_message.replace("sample.", "") == family_message
    if temporal:
        assert config_message.startswith(f"sample.num_frames=4 is not {temporal}·k + 1")
        assert config_message.endswith("; use 5")
    else:
        assert config_message.startswith("sample.num_frames=5: ") and "is an image model" in config_message


def test_a_refusal_reads_as_the_hand_written_line(tmp_path):
    """SD3 at patch size 2: 6 is a multiple of the VAE's 2 but not of 2 × 2."""
    from diffrl.pipelines import check_sampling_size

    folder = _tiny_family_folder("sd3_patch2", tmp_path / "sd3")
    with pytest.raises(UserError) as e:
        check_sampling_size(folder, height=6, width=8, num_frames=0)
    assert str(e.value) == ("sample.height=6 is not a multiple of 4, which SD3 (VAE factor 2 × patch size 2) needs; "
                            "use 8, for example")
    with pytest.raises(UserError) as e:
        check_sampling_size(folder, height=8, width=10, num_frames=0, keys=("--height", "--width", "--num-frames"))
    assert str(e.value).startswith("--width=10 is not a multiple of 4")


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
