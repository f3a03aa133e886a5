"""`diffrl steer` (steer_cli) end to end on a tiny pipeline saved to disk, and every shipped steering recipe."""

import argparse
import json

import pytest

from diffrl.errors import UserError
from diffrl.steering.cli import add_steer_arguments, steer_cli
from diffrl.steering.recipe import load_steer_recipe, recipe_from_dict


def _parse(argv):
    parser = argparse.ArgumentParser(prog="diffrl steer")
    add_steer_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tiny_models import tiny_sd_pipeline

    folder = tmp_path_factory.mktemp("tiny-sd")
    tiny_sd_pipeline(folder)  # saved and loaded back through diffusers, as `load_pipeline` reads it
    return folder


def test_steer_cli_writes_images_scores_and_accounting(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--pipeline", str(tiny_folder), "--method", "fk", "--reward", "steer_toy:brightness",
            "--prompt", "a red circle", "--prompt", "a blue square", "--prompt", "a star", "--out", str(out),
            "--steps", "4", "--set", "num_particles=2", "--set", "interval=1", "--prompts-per-call", "2",
            "--seed", "5", "--device", "cpu"]
    assert steer_cli(_parse(argv)) == 0
    records = json.loads((out / "scores.json").read_text())
    assert [r["file"] for r in records] == ["00000.png", "00001.png", "00002.png"]
    assert [r["prompt"] for r in records] == ["a red circle", "a blue square", "a star"]
    assert [r["seed"] for r in records] == [5, 5, 6]  # batch i uses seed + i
    assert all(r["method"] == "fk" and r["nfe"] == 2 * 4 and 0 < r["brightness"] < 100 for r in records)
    assert all((out / r["file"]).is_file() for r in records)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["recipe"]["steer"] == {"num_particles": 2, "interval": 1}
    assert settings["accounting"]["nfe"] == 3 * 2 * 4 and settings["accounting"]["num_prompts"] == 3
    assert "brightness mean" in capsys.readouterr().out


def test_steer_cli_recipe_with_flag_overrides(tiny_folder, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"method: best-of-n\npipeline: {tiny_folder}\nreward: steer_toy:brightness\nprompts: [a red circle]\n"
        "sample: {num_steps: 3}\nsteer: {num_samples: 2}\n"
    )
    out = tmp_path / "out"
    assert steer_cli(_parse(["--recipe", str(recipe), "--out", str(out), "--set", "num_samples=3"])) == 0
    records = json.loads((out / "scores.json").read_text())
    assert len(records) == 1 and records[0]["nfe"] == 3 * 3


def test_steer_cli_errors_are_user_errors(tiny_folder, tmp_path):
    base = ["--pipeline", str(tiny_folder), "--reward", "steer_toy:brightness", "--prompt", "x",
            "--out", str(tmp_path)]
    with pytest.raises(UserError, match="no method"):
        steer_cli(_parse(base))
    with pytest.raises(UserError, match="did you mean 'num_particles'"):
        steer_cli(_parse(base + ["--method", "fk", "--set", "num_particle=3"]))
    with pytest.raises(UserError, match="unknown reward"):
        steer_cli(_parse(["--pipeline", str(tiny_folder), "--method", "fk", "--reward", "brightnes",
                          "--prompt", "x", "--out", str(tmp_path)]))
    with pytest.raises(UserError, match="--reward-weight"):
        steer_cli(_parse(base + ["--method", "fk", "--reward", "steer_toy:brightness", "--reward-weight", "1"]))


def test_recipe_loading_is_strict():
    good = {"method": "fk", "pipeline": "tiny-shapes", "reward": "shapes_verifier", "prompts": "shapes:heldout"}
    recipe_from_dict(good)
    with pytest.raises(UserError, match="did you mean 'num_prompts'"):
        recipe_from_dict({**good, "num_prompt": 3})
    with pytest.raises(UserError, match="did you mean 'num_steps'"):
        recipe_from_dict({**good, "sample": {"num_stesp": 3}})
    with pytest.raises(UserError, match="fk has no setting 'lambda'"):
        recipe_from_dict({**good, "steer": {"lambda": 3}})
    with pytest.raises(UserError, match="sample.eta must be float"):
        recipe_from_dict({**good, "sample": {"eta": "one"}})
    with pytest.raises(UserError, match="did you mean 'svdd'"):
        recipe_from_dict({**good, "method": "svd"})
    with pytest.raises(UserError, match="unknown reward"):
        recipe_from_dict({**good, "reward": [{"name": "pickscor", "weight": 1.0}]})
    # a term of a sum may carry a label (two terms of one reward); a lone reward may not
    two = [{"name": "clip_score", "weight": 1.0, "label": "a"}, {"name": "clip_score", "weight": 0.5, "label": "b"}]
    assert recipe_from_dict({**good, "reward": two}).reward == two
    with pytest.raises(UserError, match="reward entry"):
        recipe_from_dict({**good, "reward": {"name": "clip_score", "label": "a"}})


def _steer_recipes():
    from diffrl.shipped_recipes import list_recipes

    return [name for name in list_recipes() if name.startswith("steer/")]


def test_steer_recipes_are_shipped():
    names = _steer_recipes()
    methods = {load_steer_recipe(n).method for n in names}
    assert methods == {"best-of-n", "fk", "svdd", "guidance", "reno"}
    assert any(load_steer_recipe(n).pipeline == "tiny-shapes" for n in names)


@pytest.mark.parametrize("name", _steer_recipes())
def test_every_steer_recipe_loads_strictly(name):
    recipe = load_steer_recipe(name)
    # the file name says <model>_<reward>_<method>
    assert name.endswith("_" + recipe.method)
    # gradient methods need differentiable rewards: the built-ins named here are (their torch preprocessing)
    if recipe.method in ("guidance", "reno"):
        specs = recipe.reward if isinstance(recipe.reward, list) else [recipe.reward]
        names = [s if isinstance(s, str) else s["name"] for s in specs]
        assert "shapes_verifier" not in names and "jpeg_compressibility" not in names
    # overrides go through the same strict checks
    assert load_steer_recipe(name, ["seed=3"]).seed == 3
    with pytest.raises(UserError):
        load_steer_recipe(name, ["steer.not_a_setting=1"])
