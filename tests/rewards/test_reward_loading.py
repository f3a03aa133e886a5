"""Missing weights give a one-line UserError within seconds: offline (HF_HUB_OFFLINE=1) and with an unreachable hub.

Without these checks huggingface_hub retries an unreachable hub for about 25 s per file. Libraries are
imported before the clock starts. The unreachable-hub case runs in a subprocess with HF_HUB_OFFLINE unset, an
empty HF cache and HF_ENDPOINT pointing at a closed local port, so nothing leaves the machine.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import open_clip  # noqa: F401  imported up front: the timings below are of the reward code, not of imports
import pytest
from transformers import AutoProcessor, AutoTokenizer, CLIPModel  # noqa: F401

from diffrl.errors import UserError
from rewards import get_reward

REPO = Path(__file__).resolve().parents[2]

CASES = [
    # (reward, kwargs, what the message must name)
    ("pickscore", {}, ["yuvalkirstain/PickScore_v1", "model="]),
    ("clip_score", {}, ["openai/clip-vit-large-patch14", "model="]),
    ("hpsv2", {}, ["xswu/HPSv2", "HPS_v2_compressed.pt", "checkpoint="]),
    ("hpsv21", {}, ["xswu/HPSv2", "HPS_v2.1_compressed.pt", "checkpoint="]),
    ("imagereward", {}, ["THUDM/ImageReward", "ImageReward.pt", "checkpoint="]),
    ("aesthetic", {"head": "TINY_HEAD"}, ["openai/clip-vit-large-patch14", "backbone="]),  # a head, no backbone
]


@pytest.fixture()
def empty_hf_cache(monkeypatch, tmp_path):
    """An empty Hugging Face cache, whatever this machine has cached (huggingface_hub reads it at call time)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name,kwargs,names", CASES)
def test_offline_missing_weights_fail_fast_in_one_line(name, kwargs, names, monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if kwargs.get("head") == "TINY_HEAD":
        from reward_testing import aesthetic_head

        kwargs = {**kwargs, "head": aesthetic_head("v2")}
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        get_reward(name, device="cpu", **kwargs)
    elapsed = time.perf_counter() - start
    message = str(err.value)
    assert elapsed < 5.0
    assert "\n" not in message
    assert "the hub is offline (HF_HUB_OFFLINE=1)" in message
    for part in names:
        assert part in message


def test_offline_missing_tokenizer_names_its_option(empty_hf_cache):
    from reward_testing import tiny_imagereward

    options = {**tiny_imagereward(), "tokenizer": "bert-base-uncased"}
    with pytest.raises(UserError, match=r"'bert-base-uncased' is not in the local .* pass tokenizer=<local path>"):
        get_reward("imagereward", device="cpu", **options)


def test_missing_local_paths_are_not_sent_to_the_hub():
    with pytest.raises(UserError, match="model='./no/such/clip' does not exist"):
        get_reward("clip_score", model="./no/such/clip", device="cpu")
    with pytest.raises(UserError, match="backbone='/no/such/folder' does not exist"):
        get_reward("aesthetic", head=__file__, backbone="/no/such/folder", device="cpu")


def test_embedded_names_resolve_through_diffrl_embedded(monkeypatch, tmp_path):
    from reward_testing import tiny_clip_dir

    import diffrl.embedded
    import rewards.loading

    monkeypatch.setattr(rewards.loading, "_MODEL_CACHE", {})  # a model loaded by an earlier test would skip resolution
    # Not built: the embedded module's own one-line error, naming the rebuild command.
    monkeypatch.setattr(diffrl.embedded, "ASSETS", tmp_path)
    with pytest.raises(UserError, match="embedded model 'tiny-shapes-clip' has no weights"):
        get_reward("clip_score", model="tiny-shapes-clip", device="cpu")
    # Built: the folder it names is loaded like any local folder (patched where rewards.loading looks it up).
    monkeypatch.setattr(rewards.loading, "embedded_path", lambda name: Path(tiny_clip_dir()))
    reward = get_reward("pickscore", model="tiny-shapes-pickscore", device="cpu")
    assert reward.name == "pickscore" and reward.model.config.projection_dim == 768


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="scale='1000'"):
        get_reward("clip_score", scale="1000")
    with pytest.raises(UserError, match="preprocess='pil'"):
        get_reward("pickscore", preprocess="pil")
    with pytest.raises(UserError, match="device='gpu0' is not a torch device"):
        get_reward("pickscore", device="gpu0")
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 without CUDA): fails before loading
    with pytest.raises(UserError, match=f"device='{missing}': this machine has .*; use device='cpu'"):
        get_reward("pickscore", device=missing)


UNREACHABLE = """
import json, sys, time
import open_clip  # imported before timing
from transformers import AutoProcessor, AutoTokenizer, CLIPModel
from diffrl.errors import UserError
from rewards import get_reward
results = []
for name in ("pickscore", "hpsv2", "imagereward"):
    start = time.perf_counter()
    try:
        get_reward(name, device="cpu")
        results.append((name, None, 0.0))
    except UserError as err:
        results.append((name, str(err), time.perf_counter() - start))
print(json.dumps(results))
"""


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and open_clip: ~10 s idle, more under load
def test_unreachable_hub_fails_fast_without_retries(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT="http://127.0.0.1:9",  # discard port: connection refused at once
    )
    out = subprocess.run(
        [sys.executable, "-c", UNREACHABLE],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a safety net only: the assertion is on each call's own time
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name, message, elapsed in json.loads(out.stdout.strip().splitlines()[-1]):
        assert message is not None, name
        assert "hub cannot be reached" in message and "\n" not in message
        assert elapsed < 5.0, (name, elapsed)
