"""Every DDPO/DPOK recipe validates, and the real-model recipes carry the published hyper-parameters."""

import re
from pathlib import Path

import pytest
from pg_helpers import tiny_pipeline_dir

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PG_RECIPES = sorted(p for trainer in ("ddpo", "dpok") for p in (RECIPES / trainer).glob("*.yaml"))


def test_the_issue_recipes_exist():
    names = {f"{p.parent.name}/{p.stem}" for p in PG_RECIPES}
    assert {"ddpo/tiny_shapes_verifier", "ddpo/tiny_shapes_jpeg", "dpok/tiny_shapes_clip", "ddpo/sd15_aesthetic",
            "ddpo/sd15_compressibility", "dpok/sd15_imagereward"} <= names


@pytest.mark.parametrize("path", PG_RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_validates(path, tmp_path):
    from diffrl.config import check_references, derived_numbers, load_recipe
    from diffrl.embedded import is_embedded

    cfg = load_recipe(path)
    assert cfg.trainer == path.parent.name
    if is_embedded(cfg.model.pipeline):
        # an embedded name is valid whether or not its weights are built yet; check the rest against a real folder
        cfg.model.pipeline = str(tiny_pipeline_dir(tmp_path))
    check_references(cfg)
    for processes in (1, 2, 8):
        derived = derived_numbers(cfg, processes)
        assert derived["samples_per_epoch"] == cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * processes
        assert derived["optimizer_steps_per_epoch"] >= 1
    assert cfg.sample.eta > 0  # a stochastic step policy
    if cfg.trainer == "ddpo" and cfg.train.advantage == "group":
        assert cfg.sample.batch_size % cfg.train.group_size == 0


@pytest.mark.parametrize("name", ["sd15_aesthetic", "sd15_compressibility"])
def test_ddpo_sd15_recipes_have_the_published_settings(name):
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(RECIPES / "ddpo" / f"{name}.yaml")
    t = cfg.train
    assert (cfg.sample.num_steps, cfg.sample.eta, cfg.sample.guidance_scale) == (50, 1.0, 5.0)
    assert (t.learning_rate, t.clip_range, t.adv_clip_max, t.max_grad_norm) == (3e-4, 1e-4, 5.0, 1.0)
    assert (t.advantage, t.stat_buffer_size, t.stat_min_count) == ("per_prompt", 16, 16)
    assert not cfg.model.full_finetune and cfg.model.mixed_precision == "fp16"
    derived = derived_numbers(cfg, 8)  # the published runs: 8 GPUs
    assert derived["samples_per_epoch"] == 256 and derived["optimizer_steps_per_epoch"] == 4
    assert cfg.run.num_epochs == (200 if name == "sd15_aesthetic" else 100)


def test_dpok_sd15_recipe_has_the_published_settings():
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe(RECIPES / "dpok" / "sd15_imagereward.yaml")
    t = cfg.train
    s = cfg.sample
    assert (s.num_steps, s.eta, s.guidance_scale, s.batch_size) == (50, 1.0, 7.5, 10)
    assert (t.learning_rate, t.reward_weight, t.kl_weight, t.ratio_clip) == (1e-5, 10.0, 0.01, 1e-4)
    assert t.max_grad_norm == 0.1
    assert (t.policy_batch_size, t.gradient_accumulation_steps, t.policy_steps) == (4, 12, 5)
    assert (t.value_baseline, t.value_learning_rate, t.value_batch_size, t.value_steps) == (True, 1e-4, 256, 5)
    assert cfg.model.lora.rank == 4
    assert derived_numbers(cfg, 1)["optimizer_steps_per_epoch"] == 5


def test_train_config_defaults_are_the_reference_defaults():
    from diffrl.trainers.ddpo import DDPOConfig
    from diffrl.trainers.dpok import DPOKConfig

    d = DDPOConfig()
    assert (d.learning_rate, d.clip_range, d.adv_clip_max, d.max_grad_norm, d.adam_weight_decay) == (
        3e-4, 1e-4, 5.0, 1.0, 1e-4)
    p = DPOKConfig()
    assert (p.learning_rate, p.kl_weight, p.ratio_clip, p.reward_weight) == (1e-5, 0.01, 1e-4, 100.0)
    assert p.max_grad_norm == 0.1
    assert (p.policy_batch_size, p.gradient_accumulation_steps, p.policy_steps, p.value_batch_size) == (2, 12, 5, 256)


@pytest.mark.parametrize("trainer, override, expected", [
    ("ddpo", "train.advantage=group", "needs train.group_size >= 2"),
    ("ddpo", "train.group_size=3", "must be a multiple of train.group_size"),
    ("ddpo", "train.timestep_fraction=1.5", "timestep_fraction must be in (0, 1]"),
    ("ddpo", "sample.eta=0.0", "deterministic"),
    ("dpok", "model.full_finetune=true", "LoRA adapter"),
    ("dpok", "train.policy_steps=0", "policy_steps must be >= 1"),
])
def test_trainer_checks_run_at_load_time(trainer, override, expected):
    from diffrl.config import load_recipe
    from diffrl.errors import UserError

    recipe = RECIPES / trainer / ("tiny_shapes_jpeg.yaml" if trainer == "ddpo" else "tiny_shapes_clip.yaml")
    with pytest.raises(UserError, match=re.escape(expected)):
        load_recipe(recipe, [override])
