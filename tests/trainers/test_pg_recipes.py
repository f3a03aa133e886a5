"""Every shipped training recipe validates (each registered trainer's folder under recipes/), and the real-model
recipes carry the published hyper-parameters."""

import dataclasses
import re
from pathlib import Path

import pytest
from pg_helpers import registered_trainers, tiny_flow_pipeline_dir, tiny_pipeline_dir
from recipe_inputs import RECIPE_INPUTS

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# recipe folders named after a method that is another trainer's setting: AlignProp = DRaFT's randomised truncation
METHOD_FOLDERS = {"alignprop": "draft"}
PG_RECIPES = sorted(p for folder in [*registered_trainers(), *METHOD_FOLDERS] for p in (RECIPES / folder).glob("*.yaml"))


def test_the_issue_recipes_exist():
    names = {f"{p.parent.name}/{p.stem}" for p in PG_RECIPES}
    assert {"ddpo/tiny_shapes_verifier", "ddpo/tiny_shapes_jpeg", "dpok/tiny_shapes_clip", "ddpo/sd15_aesthetic",
            "ddpo/sd15_compressibility", "dpok/sd15_imagereward", "draft/tiny_shapes_pickscore", "draft/tiny_shapes_clip",
            "alignprop/tiny_shapes_pickscore", "raft/tiny_shapes_verifier"} <= names


@pytest.mark.parametrize("path", PG_RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_validates(path, tmp_path, monkeypatch):
    from diffrl.config import derived_numbers, load_recipe
    from diffrl.config_references import check_references
    from diffrl.embedded import EMBEDDED_MODELS, is_embedded

    make_inputs = RECIPE_INPUTS.get(f"{path.parent.name}/{path.stem}")
    if make_inputs:  # a recipe that names input files (a D3PO label file) gets them in a temp working directory
        monkeypatch.chdir(tmp_path)
        make_inputs(tmp_path)
    cfg = load_recipe(path)
    assert cfg.trainer == METHOD_FOLDERS.get(path.parent.name, path.parent.name)
    if is_embedded(cfg.model.pipeline):
        # an embedded name is valid whether or not its weights are built yet; check the rest against a real folder
        # of the same family (tiny-shapes-flow's recipes name SD3 transformer modules)
        flow = "StableDiffusion3" in EMBEDDED_MODELS[cfg.model.pipeline][1]
        cfg.model.pipeline = str((tiny_flow_pipeline_dir if flow else tiny_pipeline_dir)(tmp_path))
    check_references(cfg)
    offline = "pairs" in {f.name for f in dataclasses.fields(cfg.train)}  # trains on a dataset, samples to evaluate
    for processes in (1, 2, 8):
        derived = derived_numbers(cfg, processes)
        sampled = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * processes
        assert offline or derived["samples_per_epoch"] == sampled
        assert derived["optimizer_steps_per_epoch"] >= 1


@pytest.mark.parametrize("trainer", registered_trainers())
def test_every_registered_trainer_ships_a_tiny_shapes_recipe(trainer):
    assert sorted((RECIPES / trainer).glob("tiny_shapes*.yaml")), f"recipes/{trainer}/ has no tiny-shapes recipe"


@pytest.mark.parametrize("name", ["sd15_aesthetic", "sd15_compressibility"])
def test_ddpo_sd15_recipes_have_the_published_settings(name):
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(RECIPES / "ddpo" / f"{name}.yaml")
    t, o, a = cfg.train, cfg.optim, cfg.advantage
    assert (cfg.sample.num_steps, cfg.sample.eta, cfg.sample.guidance_scale) == (50, 1.0, 5.0)
    assert (o.learning_rate, t.clip_range, a.clip_max, o.max_grad_norm) == (3e-4, 1e-4, 5.0, 1.0)
    assert (a.mode, a.stat_buffer_size, a.stat_min_count) == ("per_prompt", 16, 16)
    assert not cfg.model.full_finetune and cfg.model.mixed_precision == "fp16"
    derived = derived_numbers(cfg, 8)  # the published runs: 8 GPUs
    assert derived["samples_per_epoch"] == 256 and derived["optimizer_steps_per_epoch"] == 4
    assert cfg.run.num_epochs == (200 if name == "sd15_aesthetic" else 100)


def test_dpok_sd15_recipe_has_the_published_settings():
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(RECIPES / "dpok" / "sd15_imagereward.yaml")
    t, o = cfg.train, cfg.optim
    s = cfg.sample
    assert (s.num_steps, s.eta, s.guidance_scale, s.batch_size) == (50, 1.0, 7.5, 10)
    assert (o.learning_rate, t.reward_weight, t.kl_weight, t.clip_range) == (1e-5, 10.0, 0.01, 1e-4)
    assert o.max_grad_norm == 0.1
    assert (t.batch_size, o.gradient_accumulation_steps, t.policy_steps) == (4, 12, 5)
    assert (t.value_baseline, t.value_learning_rate, t.value_batch_size, t.value_steps) == (True, 1e-4, 256, 5)
    assert cfg.model.lora.rank == 4
    assert derived_numbers(cfg, 1)["optimizer_steps_per_epoch"] == 5


def test_train_config_defaults_are_the_reference_defaults():
    from diffrl.config import config_from_dict

    def defaults(trainer):
        return config_from_dict({"trainer": trainer, "model": {"pipeline": "x"}, "reward": {"name": "jpeg_compressibility"},
                                 "prompts": {"source": ["a"]}})

    d = defaults("ddpo")  # ddpo-pytorch's config/base.py
    assert (d.optim.learning_rate, d.train.clip_range, d.advantage.clip_max, d.optim.max_grad_norm) == (3e-4, 1e-4, 5.0, 1.0)
    assert (d.optim.weight_decay, d.optim.gradient_accumulation_steps, d.advantage.mode) == (1e-4, 2, "per_prompt")
    p = defaults("dpok")  # google-research/dpok train_online_pg.py
    assert (p.optim.learning_rate, p.train.kl_weight, p.train.clip_range, p.train.reward_weight) == (1e-5, 0.01, 1e-4, 100.0)
    assert (p.optim.max_grad_norm, p.optim.weight_decay, p.advantage.mode, p.advantage.clip_max) == (0.1, 0.0, "none", 0.0)
    assert (p.train.batch_size, p.optim.gradient_accumulation_steps, p.train.policy_steps, p.train.value_batch_size) == (
        2, 12, 5, 256)


@pytest.mark.parametrize("trainer, override, expected", [
    ("ddpo", "advantage.mode=group", "needs advantage.group_size >= 2"),
    ("ddpo", "advantage.group_size=3", "must be a multiple of advantage.group_size"),
    ("ddpo", "train.learning_rate=1e-4", "'train.learning_rate' has moved to 'optim.learning_rate'"),
    ("dpok", "train.ratio_clip=0.1", "'train.ratio_clip' has moved to 'train.clip_range'"),
    ("dpok", "train.advantage=batch", "'train.advantage' has moved to 'advantage.mode'"),
    ("dpok", "train.max_nan_steps=2", "'train.max_nan_steps' has moved to 'run.max_nan_steps'"),
    ("ddpo", "optim.learning_rate=.nan", "optim.learning_rate must be a finite number"),
    ("ddpo", "optim.learning_rate=-1", "optim.learning_rate must be > 0"),
    ("draft", "reward.name=jpeg_compressibility reward.kwargs={}", "'jpeg_compressibility' is not differentiable"),
    ("draft", "reward.kwargs.preprocess=processor", "'clip_score' is not differentiable"),
    ("draft", "train.lv_samples=2 train.k=2", "needs train.truncation=last and train.k=1"),
    ("raft", "train.samples_per_prompt=3", "must be a multiple of train.samples_per_prompt"),
    ("ddpo", "train.timestep_fraction=1.5", "timestep_fraction must be in (0, 1]"),
    ("ddpo", "sample.sampler=ddim sample.eta=0.0", "deterministic"),
    ("dpok", "model.full_finetune=true", "LoRA adapter"),
    ("dpok", "train.policy_steps=0", "policy_steps must be >= 1"),
])
def test_trainer_checks_run_at_load_time(trainer, override, expected):
    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    recipe = min((RECIPES / trainer).glob("tiny_shapes*.yaml"))
    with pytest.raises(UserError, match=re.escape(expected)):
        load_recipe(recipe, override.split())


@pytest.mark.parametrize("name", ["sd15_aesthetic", "sd15_hps"])
def test_alignprop_sd15_recipes_have_the_published_settings(name):
    # mihirp1998/AlignProp config/align_prop.py: lr 1e-3, weight decay 0.1, clip 5, loss x 0.01, CFG 7.5, 50 steps,
    # grad checkpointing, fp16; 256 samples / 128 per step on 4 GPUs; the truncation as the current reference
    # (sd_pipeline.py): one cut-off per batch from N(42, 5), redrawn outside [1, 50)
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(RECIPES / "alignprop" / f"{name}.yaml")
    t, o, s = cfg.train, cfg.optim, cfg.sample
    assert (o.learning_rate, o.weight_decay, o.max_grad_norm, t.reward_scale) == (1e-3, 0.1, 5.0, 0.01)
    assert (s.num_steps, s.guidance_scale, s.eta, cfg.model.mixed_precision) == (50, 7.5, 0.0, "fp16")
    assert (t.truncation, t.checkpointing, t.lv_samples) == ("normal_cutoff", True, 0)
    assert (t.cutoff_mean, t.cutoff_std) == (42.0, 5.0)
    derived = derived_numbers(cfg, 4)
    assert derived["samples_per_epoch"] == 256 and derived["global_train_batch"] == 128
    assert cfg.reward.name == ("aesthetic" if name == "sd15_aesthetic" else "hpsv2")


def test_draft_lv_and_raft_sd15_recipes_have_the_published_settings():
    from diffrl.config import derived_numbers, load_recipe

    for name in ("sd15_aesthetic_lv", "sd15_hps_lv"):  # DRaFT-LV: K = 1, n = 2, 50 DDIM steps at eta 0, CFG 7.5
        cfg = load_recipe(RECIPES / "draft" / f"{name}.yaml")
        assert (cfg.train.truncation, cfg.train.k, cfg.train.lv_samples) == ("last", 1, 2)
        assert (cfg.sample.num_steps, cfg.sample.eta, cfg.sample.guidance_scale) == (50, 0.0, 7.5)
        assert (cfg.optim.learning_rate, cfg.model.lora.rank) == (3e-4, 8)
    cfg = load_recipe(RECIPES / "raft" / "sd15_aesthetic.yaml")  # LMFlow's RAFT-diffusion: K = 10, 8 kept, 80 x 8
    t = cfg.train
    assert (t.samples_per_prompt, t.keep_per_prompt, t.batch_size, t.finetune_epochs) == (10, 1, 8, 80)
    assert (cfg.optim.learning_rate, cfg.run.num_epochs, cfg.sample.guidance_scale) == (9e-6, 10, 7.5)
    derived = derived_numbers(cfg, 1)
    assert derived["kept_per_round"] == 8 and derived["optimizer_steps_per_epoch"] == 80
