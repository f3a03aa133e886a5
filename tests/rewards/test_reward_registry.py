"""The registry: names, errors with did-you-mean, `package.module:factory`, option checking, cheap import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rewards
from diffrl.errors import UserError
from rewards import get_reward, get_reward_factory, list_rewards, register_reward
from rewards.base import Reward

REPO = Path(__file__).resolve().parents[2]
BUILTIN = {
    "aesthetic",
    "clip_score",
    "pickscore",
    "hpsv2",
    "hpsv21",
    "imagereward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "weighted_sum",
    "normalized",
}


def test_list_rewards_has_every_builtin_and_key_equals_factory_name():
    names = list_rewards()
    assert BUILTIN <= set(names)
    assert names == sorted(names)
    for name in names:
        assert get_reward_factory(name).__name__ == name


def test_unknown_name_lists_known_and_suggests():
    with pytest.raises(UserError) as err:
        get_reward("pickscor")
    message = str(err.value)
    assert "did you mean 'pickscore'" in message
    assert "aesthetic" in message and "jpeg_compressibility" in message
    assert "\n" not in message


def test_unknown_option_suggests_the_close_one():
    with pytest.raises(UserError, match="has no option 'qualty'; did you mean 'quality'"):
        get_reward("jpeg_compressibility", qualty=90)


def test_module_factory_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "import torch\n"
        "from rewards import RewardOutput\n"
        "class Bright:\n"
        "    name = 'brightness'\n"
        "    differentiable = True\n"
        "    higher_is_better = True\n"
        "    def __init__(self, scale): self.scale = scale\n"
        "    def __call__(self, images, prompts, metadata=None):\n"
        "        return RewardOutput(self.scale * images.mean(dim=(1, 2, 3)))\n"
        "def brightness(scale=1.0):\n"
        "    return Bright(scale)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import torch

    reward = get_reward("my_rewards_mod:brightness", scale=2.0)
    assert isinstance(reward, Reward)
    images = torch.full((2, 3, 4, 4), 0.25)
    assert reward(images, ["a", "b"]).scores.tolist() == [0.5, 0.5]
    with pytest.raises(UserError, match="cannot import module 'no_such_mod_xyz'"):
        get_reward("no_such_mod_xyz:f")
    with pytest.raises(UserError, match="has no callable 'nope'"):
        get_reward("my_rewards_mod:nope")


def test_register_reward_checks_name_and_duplicates(monkeypatch):
    from rewards import registry

    # load the built-in rewards into the real registry first: loading them into the copy below would mark them
    # loaded while the real registry, restored after the test, lacks them (every later test in the process broke)
    list_rewards()
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))  # leave the real registry untouched
    with pytest.raises(UserError, match="must equal its factory name"):

        @register_reward("other_name")
        def my_factory():
            return None

    def dummy_reward():
        return None

    register_reward("dummy_reward")(dummy_reward)
    assert "dummy_reward" in list_rewards()

    def dummy_reward():
        return None

    dummy_reward.__module__ = "somewhere.else"
    with pytest.raises(UserError, match="already registered"):
        register_reward("dummy_reward")(dummy_reward)


def test_import_and_listing_do_not_import_torch_or_transformers():
    code = (
        "import sys, rewards; rewards.list_rewards(); "
        "heavy = [m for m in ('torch', 'transformers', 'open_clip') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


def test_combinators_are_exported():
    assert rewards.weighted_sum is get_reward_factory("weighted_sum")
    assert rewards.normalized is get_reward_factory("normalized")
