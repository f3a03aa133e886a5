"""Strict recipe loading, overrides, derived numbers, YAML round trip, recipe lookup."""

import dataclasses
import sys
import textwrap
import types
from dataclasses import dataclass, field

import pytest

from diffrl import config
from diffrl.config import (
    RunConfig,
    UserError,
    config_from_dict,
    derived_numbers,
    load_recipe,
    load_run_config,
    parse_yaml,
    to_yaml,
)
from diffrl.config_references import check_references
from diffrl.training.setup import write_run_config


@dataclass
class DummyTrainConfig:
    learning_rate: float = 3e-4  # per optimizer step
    batch_size: int = 4  # samples per training minibatch, per process
    num_inner_epochs: int = 1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


def _train(cfg, run_dir, *, resume=False, accelerator=None, step_callback=None):
    return {}


def _derived(cfg, num_processes):
    from diffrl.config import minibatch_numbers

    return minibatch_numbers(cfg, num_processes, batch_size=cfg.train.batch_size, passes=cfg.train.num_inner_epochs)


@pytest.fixture
def dummy_trainer(monkeypatch):
    """Registers trainer 'dummy' (a module made here) in diffrl.trainers.TRAINERS for the test."""
    import diffrl.trainers

    module = types.ModuleType("dummy_trainer_for_tests")
    module.TrainConfig = DummyTrainConfig
    module.train = _train
    module.OPTIM_DEFAULTS = {"gradient_accumulation_steps": 2}
    module.ADVANTAGE_DEFAULTS = None
    module.check = lambda cfg: None
    module.derived = _derived
    module.epoch_passes = lambda cfg: {}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(diffrl.trainers.TRAINERS, "dummy", module.__name__)
    return module


def recipe(**groups):
    base = {
        "trainer": "dummy",
        "model": {"pipeline": "some-org/some-pipeline"},
        "reward": {"name": "jpeg_compressibility"},
        "prompts": {"source": ["a red circle"]},
    }
    for key, value in groups.items():
        base[key] = value
    return base


def error_of(data, overrides=()) -> str:
    with pytest.raises(UserError) as info:
        config_from_dict(data, overrides, source="r.yaml")
    return str(info.value)


def test_defaults_and_train_group(dummy_trainer):
    cfg = config_from_dict(recipe())
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.train, DummyTrainConfig)
    assert cfg.train.learning_rate == 3e-4
    assert cfg.sample.batch_size == 8 and cfg.model.mixed_precision == "no"
    assert cfg.model.lora.target_modules == ["to_k", "to_q", "to_v", "to_out.0"]


def test_overrides_are_typed(dummy_trainer):
    cfg = config_from_dict(recipe(train={"learning_rate": 1e-3}), [
        "train.learning_rate=1e-4",  # YAML 1.1 would read 1e-4 as a string
        "sample.batch_size=4",
        "sample.guidance_scale=7",  # an int is accepted for a float field
        "model.lora.rank=16",
        "model.lora.target_modules=[to_q, to_v]",
        "model.mixed_precision=no",  # YAML 1.1 would read no as False
        "run.name=2024",  # a str field keeps the command-line text
        "prompts.source=[a, b]",
        "reward.kwargs={quality: 90}",
    ])
    assert cfg.train.learning_rate == 1e-4 and isinstance(cfg.train.learning_rate, float)
    assert cfg.sample.batch_size == 4
    assert cfg.sample.guidance_scale == 7.0 and isinstance(cfg.sample.guidance_scale, float)
    assert cfg.model.lora.rank == 16 and cfg.model.lora.target_modules == ["to_q", "to_v"]
    assert cfg.model.mixed_precision == "no"
    assert cfg.run.name == "2024"
    assert cfg.prompts.source == ["a", "b"]
    assert cfg.reward.kwargs == {"quality": 90}


def test_override_into_list_of_components(dummy_trainer):
    data = recipe(reward={"components": [{"name": "jpeg_compressibility", "weight": 1.0},
                                         {"name": "aesthetic", "weight": 0.5}]})
    cfg = config_from_dict(data, ["reward.components.1.weight=2"])
    assert [c.weight for c in cfg.reward.components] == [1.0, 2.0]
    assert isinstance(cfg.reward.components[0], config.RewardComponent)


@pytest.mark.parametrize("override, expected", [
    ("sample.num_stesp=3", "unknown key 'sample.num_stesp'; did you mean 'sample.num_steps'?"),
    ("sampel.num_steps=3", "unknown key 'sampel'; did you mean 'sample'?"),
    ("model.lora.rnak=8", "unknown key 'model.lora.rnak'; did you mean 'model.lora.rank'?"),
    ("train.learnin_rate=1", "unknown key 'train.learnin_rate'; did you mean 'train.learning_rate'?"),
    # right key, wrong group: the suggestion crosses groups
    ("sample.learning_rate=1", "unknown key 'sample.learning_rate'; did you mean 'optim.learning_rate'?"),
])
def test_unknown_key_names_it_and_suggests(dummy_trainer, override, expected):
    message = error_of(recipe(), [override])
    assert expected in message
    assert "from the command line" in message
    assert "\n" not in message


def test_unknown_key_in_file_says_file(dummy_trainer):
    message = error_of(recipe(sample={"num_stesp": 3}))
    assert message == "unknown key 'sample.num_stesp'; did you mean 'sample.num_steps'? (in r.yaml)"


@pytest.mark.parametrize("override, expected", [
    ("sample.num_steps=ten", "sample.num_steps must be int, got 'ten' (str)"),
    ("sample.num_steps=2.5", "sample.num_steps must be int, got 2.5 (float)"),
    ("sample.num_steps=true", "sample.num_steps must be int, got True (bool)"),
    ("model.full_finetune=1", "model.full_finetune must be bool, got 1 (int)"),
    ("model.mixed_precision=fp61",
     "model.mixed_precision must be one of 'no' | 'fp16' | 'bf16', got 'fp61'; did you mean 'fp16'?"),
    ("model.lora.target_modules=to_q", "model.lora.target_modules must be a list"),
    ("train.betas=[0.9, x]", "train.betas.1 must be float, got 'x' (str)"),
    ("sample=3", "'sample' must be a mapping of SampleGroup fields, got 3"),
])
def test_wrong_type_names_key_value_and_type(dummy_trainer, override, expected):
    assert expected in error_of(recipe(), [override])


def test_wrong_type_in_file(dummy_trainer):
    message = error_of(recipe(run={"seed": "zero"}))
    assert message == "run.seed must be int, got 'zero' (str) (in r.yaml)"


def test_missing_required(dummy_trainer):
    data = recipe()
    del data["model"]
    assert error_of(data).startswith("missing required key 'model.pipeline'")
    data = recipe()
    del data["trainer"]
    assert error_of(data).startswith("missing required key 'trainer'")
    data = recipe()
    data["reward"] = {"components": [{"weight": 2.0}]}
    assert error_of(data).startswith("missing required key 'reward.components.0.name'")


def test_steering_recipe_is_pointed_to_steer(dummy_trainer):
    message = error_of({"method": "fk", "pipeline": "tiny-shapes", "reward": "shapes_verifier"})
    assert message == ("r.yaml is a steering recipe (it has `method:`, no `trainer:`); "
                       "run it with `diffrl steer --recipe`")


def test_trainer_check_runs_at_load(monkeypatch, dummy_trainer):
    def check(cfg):
        if cfg.sample.batch_size % cfg.train.batch_size:
            raise UserError("sample.batch_size must be a multiple of train.batch_size")

    monkeypatch.setattr(dummy_trainer, "check", check)
    config_from_dict(recipe(), ["sample.batch_size=8", "train.batch_size=4"])
    assert error_of(recipe(), ["sample.batch_size=6"]) == "sample.batch_size must be a multiple of train.batch_size"


def test_unknown_trainer_suggests(dummy_trainer):
    assert "unknown trainer 'dumy'; did you mean 'dummy'?" in error_of(recipe(trainer="dumy"))


@pytest.mark.parametrize("override, expected", [
    ("sample.batch_size=0", "sample.batch_size must be > 0, got 0"),
    ("run.num_epochs=-1", "run.num_epochs must be > 0, got -1"),
    ("sample.eta=-0.5", "sample.eta must be >= 0, got -0.5"),
    ("reward.components=[{name: aesthetic}]", "exactly one of reward.name"),
    ("prompts.source=[]", "prompts.source is empty"),
    ("run.name=a/b", "run.name 'a/b' must be a plain folder name"),
])
def test_value_checks(dummy_trainer, override, expected):
    assert expected in error_of(recipe(), [override])


def test_bad_override_syntax(dummy_trainer):
    assert "is not key=value" in error_of(recipe(), ["sample.batch_size"])
    assert "is not key=value" in error_of(recipe(), ["sample..x=1"])


def test_derived_numbers(dummy_trainer):
    cfg = config_from_dict(recipe(run={"num_epochs": 10}, sample={"batch_size": 8, "num_batches_per_epoch": 4},
                                  train={"batch_size": 4, "num_inner_epochs": 2}, optim={"gradient_accumulation_steps": 2}))
    d = derived_numbers(cfg, num_processes=3)
    # 8 images × 4 batches = 32 per process; × 3 processes = 96 per epoch; × 10 epochs = 960
    assert d["samples_per_epoch_per_process"] == 32
    assert d["samples_per_epoch"] == 96
    assert d["total_samples"] == 960
    # one optimizer step uses 4 × 2 samples per process = 24 over 3 processes;
    # 32 / 8 = 4 steps per pass over the epoch's samples, × 2 inner epochs = 8; × 10 epochs = 80
    assert d["global_train_batch"] == 24
    assert d["optimizer_steps_per_epoch"] == 8
    assert d["total_optimizer_steps"] == 80
    assert derived_numbers(cfg, 1)["samples_per_epoch"] == 32


def test_derived_numbers_reject_partial_optimizer_step(dummy_trainer):
    cfg = config_from_dict(recipe(sample={"batch_size": 6, "num_batches_per_epoch": 1},
                                  train={"batch_size": 4}, optim={"gradient_accumulation_steps": 1}))
    with pytest.raises(UserError, match="not a multiple of"):
        derived_numbers(cfg, 1)


def test_the_trainer_states_its_own_derived_numbers(monkeypatch, dummy_trainer):
    def derived(cfg, num_processes):
        return {"pairs_per_epoch": cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * num_processes // 2}

    monkeypatch.setattr(dummy_trainer, "derived", derived)
    d = derived_numbers(config_from_dict(recipe()), 2)
    assert d["pairs_per_epoch"] == 32 and "optimizer_steps_per_epoch" not in d
    assert d["samples_per_epoch"] == 64  # the shared numbers stay


def test_a_module_breaking_the_trainer_contract_is_named(monkeypatch, dummy_trainer):
    monkeypatch.delattr(dummy_trainer, "derived")
    assert "lacks derived" in error_of(recipe())


def test_shared_groups_take_the_trainers_defaults_and_refuse_what_it_lacks(dummy_trainer):
    cfg = config_from_dict(recipe())
    assert cfg.optim.gradient_accumulation_steps == 2 and cfg.optim.learning_rate == 1e-4  # the trainer's, the class's
    assert cfg.advantage is None
    assert "computes no advantages; remove the advantage group" in error_of(recipe(advantage={"mode": "batch"}))


def test_yaml_round_trip_and_run_config(dummy_trainer, tmp_path):
    cfg = config_from_dict(recipe(), ["train.learning_rate=1e-5", "model.lora.rank=8", "run.name=x"])
    text = to_yaml(cfg, derived=derived_numbers(cfg, 2), versions=config.package_versions())
    data = parse_yaml(text, "t")
    assert data["derived"]["samples_per_epoch"] == 64
    assert data["versions"]["python"] == sys.version.split()[0]
    assert "torch" in data["versions"] and "diffusers" in data["versions"]
    write_run_config(tmp_path, cfg, derived_numbers(cfg, 2))  # the one config.yaml writer (`diffrl run`, RunContext)
    assert (tmp_path / "config.yaml").read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # written atomically, no temporary left
    again = load_run_config(tmp_path)
    assert again == cfg
    assert dataclasses.asdict(again.train) == dataclasses.asdict(cfg.train)
    with pytest.raises(UserError, match="cannot write"):  # files.write_text: one line, not an OSError
        write_run_config(tmp_path / "missing", cfg, derived_numbers(cfg, 2))


def test_load_run_config_needs_config_yaml(tmp_path):
    with pytest.raises(UserError, match="not a run dir"):
        load_run_config(tmp_path)


def test_load_recipe_file_and_short_name(dummy_trainer, tmp_path, monkeypatch):
    root = tmp_path / "recipes"
    (root / "dummy").mkdir(parents=True)
    (root / "dummy" / "tiny_jpeg.yaml").write_text(textwrap.dedent("""\
        trainer: dummy
        model:
          pipeline: some-org/some-pipeline
          mixed_precision: no
        reward: {name: jpeg_compressibility}
        prompts: {source: [a red circle]}
        train:
          learning_rate: 1e-4
    """))
    monkeypatch.setattr("diffrl.shipped_recipes.recipe_roots", lambda: [root])
    by_path = load_recipe(root / "dummy" / "tiny_jpeg.yaml", ["sample.num_steps=10"])
    by_name = load_recipe("dummy/tiny_jpeg", ["sample.num_steps=10"])
    assert by_path == by_name
    assert by_name.train.learning_rate == 1e-4 and by_name.model.mixed_precision == "no"
    with pytest.raises(UserError, match="did you mean 'dummy/tiny_jpeg'"):
        load_recipe("dummy/tiny_jepg")
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_bad_yaml_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: dummy\nmodel: [unclosed\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert "not valid YAML" in str(info.value) and "\n" not in str(info.value)
    path.write_text("")
    with pytest.raises(UserError, match="is empty"):
        load_recipe(path)


def test_check_references(dummy_trainer, tmp_path):
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\n# a comment\ntwo squares\n")
    ok = config_from_dict(recipe(model={"pipeline": str(tmp_path / "pipe")}, prompts={"source": str(prompts)}))
    check_references(ok)

    def check_error(**groups):
        with pytest.raises(UserError) as info:
            check_references(config_from_dict(recipe(**groups)))
        return str(info.value)

    assert check_error(reward={"name": "jpeg_compresibility"}).startswith(
        "reward.name: unknown reward 'jpeg_compresibility'; did you mean 'jpeg_compressibility'?")
    assert check_error(model={"pipeline": "tiny-shape"}).startswith("model.pipeline: unknown pipeline 'tiny-shape'")
    assert check_error(model={"pipeline": str(tmp_path / "nope")}).startswith("model.pipeline: pipeline folder")
    assert check_error(prompts={"source": str(tmp_path / "missing.txt")}).startswith("prompts.source:")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert check_error(prompts={"source": str(empty)}).startswith("prompts.source:")


def _shipped_training_recipes():
    """recipes/<trainer>/*.yaml (recipes/steer/ holds steering recipes, checked by the steering tests)."""
    from diffrl.config import trainer_table
    from diffrl.shipped_recipes import list_recipes

    found = [(name, path) for name, path in list_recipes().items() if name.split("/")[0] in trainer_table()]
    return found or [pytest.param(None, None, marks=pytest.mark.skip("no training recipes shipped"))]


@pytest.mark.parametrize("name, path", _shipped_training_recipes())
def test_every_shipped_recipe_loads_strictly(name, path, tmp_path, monkeypatch):
    from recipe_inputs import RECIPE_INPUTS

    from diffrl.embedded import is_embedded

    if name in RECIPE_INPUTS:  # a recipe that names input files (a D3PO label file) gets them in a temp working dir
        monkeypatch.chdir(tmp_path)
        RECIPE_INPUTS[name](tmp_path)
    cfg = load_recipe(name)
    assert load_recipe(path) == cfg
    for processes in (1, 8):
        assert derived_numbers(cfg, processes)["samples_per_epoch"] > 0
    if is_embedded(cfg.model.pipeline):
        # an embedded name is valid whether or not its weights are built in this checkout (test_pipelines covers
        # embedded loading); check the rewards and prompts against a stand-in folder
        (tmp_path / "model_index.json").write_text("{}")
        cfg.model.pipeline = str(tmp_path)
    check_references(cfg)
