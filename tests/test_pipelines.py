"""load_pipeline on tiny random pipelines saved to disk: folders, embedded names, borrowed components, LoRA
folders, run dirs, full fine-tune checkpoints, and hub ids that fail fast offline."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import diffrl.embedded
from diffrl.checks import resolve_dtype
from diffrl.errors import UserError
from diffrl.pipelines import find_trained_weights, load_pipeline, resolve_pipeline_name
from samplers.testing import tiny_lcm_pipeline, tiny_sd_pipeline

LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny SD pipeline folder and an LCM folder that keeps only unet/ and scheduler/ (like tiny-shapes-lcm)."""
    root = tmp_path_factory.mktemp("pipelines")
    tiny_sd_pipeline(root / "sd")
    tiny_lcm_pipeline(root / "lcm_full", seed=1)
    partial = root / "lcm_partial"
    partial.mkdir()
    for part in ("unet", "scheduler"):
        shutil.copytree(root / "lcm_full" / part, partial / part)
    shutil.copy(root / "lcm_full" / "model_index.json", partial / "model_index.json")
    return root


def unet_out(pipe):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    ehs = torch.randn(1, 77, pipe.unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return pipe.unet(x, 10, ehs).sample


def save_random_lora(pipe, folder: Path, seed: int):
    """Add a LoRA with random (non-zero) weights to pipe.unet and save it in diffusers' format."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pipe.unet.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet))
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=layers)
    return unet_out(pipe)


def test_load_folder(saved):
    pipe = load_pipeline(saved / "sd")
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe._progress_bar_config == {"disable": True}
    assert pipe.unet.dtype == torch.float32 and pipe.device.type == "cpu"
    reference = tiny_sd_pipeline()  # same seed, built in memory
    assert torch.equal(unet_out(pipe), unet_out(reference))


def test_load_time_of_tiny_pipeline(saved):
    load_pipeline(saved / "sd")  # imports done
    start = time.perf_counter()
    load_pipeline(saved / "sd")
    assert time.perf_counter() - start < 3.0


def test_dtype(saved):
    pipe = load_pipeline(saved / "sd", dtype="bf16")
    assert pipe.unet.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    assert resolve_dtype(None) == torch.float32 and resolve_dtype("no") == torch.float32
    assert resolve_dtype(torch.float16) == torch.float16
    # one resolve_dtype for pipelines and reward models: the union of the names each accepted
    names = {"fp32": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
             "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16, "fp64": torch.float64}
    assert {name: resolve_dtype(name) for name in names} == names
    import rewards.base

    assert not hasattr(rewards.base, "resolve_dtype")
    with pytest.raises(UserError, match="unknown dtype 'fp8'; use fp32, fp16, bf16 or fp64") as info:
        resolve_dtype("fp8")
    assert "\n" not in str(info.value)


def test_partial_folder_borrows_components(saved, tmp_path):
    folder = tmp_path / "lcm"
    shutil.copytree(saved / "lcm_partial", folder)
    with pytest.raises(UserError, match="does not say where"):
        load_pipeline(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_diffrl_components_from"] = str(saved / "sd")
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(folder)
    base = load_pipeline(saved / "sd")
    assert type(pipe).__name__ == "LatentConsistencyModelPipeline"
    assert type(pipe.scheduler).__name__ == "LCMScheduler"
    assert pipe.unet.config.time_cond_proj_dim == 32
    for name in ("vae", "text_encoder"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(base, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert pipe.tokenizer.get_vocab() == base.tokenizer.get_vocab()


def test_a_folder_shares_a_component_and_records_its_t5_length(tmp_path):
    # tiny-shapes-flow's layout: SD3's second CLIP tower is the first one, stored once; no T5, trained with 0 tokens
    from samplers.testing import tiny_sd3_pipeline

    folder = tmp_path / "sd3"
    tiny_sd3_pipeline(folder, t5=False)
    first = load_pipeline(folder).text_encoder.state_dict()
    shutil.rmtree(folder / "text_encoder_2")
    shutil.rmtree(folder / "tokenizer_2")
    index = json.loads((folder / "model_index.json").read_text())
    with pytest.raises(UserError, match="text_encoder_2"):  # nothing says where the missing tower comes from
        load_pipeline(folder)
    index["_diffrl_shared_components"] = {"text_encoder_2": "text_encoder", "tokenizer_2": "tokenizer"}
    index["_diffrl_max_sequence_length"] = 0
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(folder)
    assert pipe.text_encoder_2 is pipe.text_encoder and pipe.tokenizer_2 is pipe.tokenizer
    assert pipe.text_encoder_3 is None and pipe.config["_diffrl_max_sequence_length"] == 0
    assert all(torch.equal(v, first[k]) for k, v in pipe.text_encoder_2.state_dict().items())
    # the flow sampler feeds no T5 tokens to such a model: CLIP tokens only
    from samplers.flow import FlowSampler

    traj = FlowSampler().sample(pipe, ["a red circle"], num_steps=2, guidance_scale=1.0, eta=0.0, seeds=[0])
    assert traj.prompt_embeds.shape[1] == pipe.tokenizer.model_max_length
    index["_diffrl_shared_components"] = {"text_encoder_2": "text_encoder_9"}
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="_diffrl_shared_components"):
        load_pipeline(folder)


def test_embedded_names(saved, tmp_path, monkeypatch):
    """tiny-shapes is a full folder; tiny-shapes-lcm keeps unet/ + scheduler/ and borrows the rest."""
    shutil.copytree(saved / "sd", tmp_path / "tiny-shapes")
    shutil.copytree(saved / "lcm_partial", tmp_path / "tiny-shapes-lcm")
    monkeypatch.setattr(diffrl.embedded, "ASSETS", tmp_path)
    assert resolve_pipeline_name("tiny-shapes") == ("embedded", tmp_path / "tiny-shapes")
    sd = load_pipeline("tiny-shapes")
    lcm = load_pipeline("tiny-shapes-lcm")
    assert type(sd).__name__ == "StableDiffusionPipeline"
    assert type(lcm).__name__ == "LatentConsistencyModelPipeline"
    assert torch.equal(lcm.vae.decoder.conv_out.weight, sd.vae.decoder.conv_out.weight)


def test_embedded_name_not_built(saved, tmp_path, monkeypatch):
    monkeypatch.setattr(diffrl.embedded, "ASSETS", tmp_path)
    with pytest.raises(UserError, match="has no weights"):
        load_pipeline("tiny-shapes")
    shutil.copytree(saved / "sd" / "vae", tmp_path / "tiny-shapes" / "vae")  # a build that stopped half way
    with pytest.raises(UserError, match="not fully built.*python -m diffrl.shapes.train unet"):
        load_pipeline("tiny-shapes")


@pytest.mark.parametrize("name, expected", [
    ("tiny-shape", "unknown pipeline 'tiny-shape'.*did you mean 'tiny-shapes'"),
    ("/definitely/not/here", "pipeline folder /definitely/not/here does not exist"),
    ("not a name", "unknown pipeline"),
])
def test_bad_names(name, expected):
    with pytest.raises(UserError, match=expected):
        load_pipeline(name)


def test_folder_without_model_index(tmp_path):
    with pytest.raises(UserError, match="not a diffusers pipeline folder"):
        load_pipeline(tmp_path)


def test_offline_hub_id_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(UserError) as info:
        load_pipeline("some-org/some-uncached-pipeline")
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert "'some-org/some-uncached-pipeline'" in message and "HF_HUB_OFFLINE" in message
    assert "local diffusers folder" in message and "\n" not in message
    assert elapsed < 10  # a guard against network retry loops, not a speed test


@pytest.mark.parametrize("hf_hub_offline, transformers_offline, offline", [
    (None, None, False), ("1", None, True), ("on", None, True), (None, "TRUE", True), (None, "0", False),
    ("0", "1", False),  # huggingface_hub reads TRANSFORMERS_OFFLINE only when HF_HUB_OFFLINE is unset
])
def test_hub_offline_reads_the_variables_as_huggingface_hub_does(monkeypatch, hf_hub_offline, transformers_offline,
                                                                 offline):
    """One `hub_offline` for pipelines, export and rewards, read at call time."""
    import diffrl.export
    import rewards.loading
    from diffrl.hub import hub_offline

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for name, value in (("HF_HUB_OFFLINE", hf_hub_offline), ("TRANSFORMERS_OFFLINE", transformers_offline)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert hub_offline() is offline
    assert diffrl.pipelines.hub_offline is rewards.loading.hub_offline is diffrl.export.hub_offline is hub_offline
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # switched off when it was imported
    assert hub_offline()


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setattr("diffrl.pipelines.hub_offline", lambda: False)
    # the endpoint is a closed port on this machine: the probe is refused at once
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache lookup itself must not go out either
    start = time.perf_counter()
    with pytest.raises(UserError, match="hub is unreachable"):
        load_pipeline("some-org/some-uncached-pipeline")
    assert time.perf_counter() - start < 10


def test_lora_folder(saved, tmp_path):
    trained = load_pipeline(saved / "sd")
    expected = save_random_lora(trained, tmp_path / "lora", seed=1)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    base = load_pipeline(saved / "sd")
    pipe = load_pipeline(saved / "sd", lora=tmp_path / "lora")
    assert torch.allclose(unet_out(pipe), expected, atol=1e-6)
    assert not torch.allclose(unet_out(pipe), unet_out(base), atol=1e-3)


def test_run_dir_uses_newest_checkpoint(saved, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-10").mkdir(parents=True)  # numeric order: 10 is newer than 2
    (run / "checkpoints" / ".tmp-step-12").mkdir(parents=True)  # incomplete save: ignored
    (run / "config.yaml").write_text("trainer: ddpo\n")
    save_random_lora(load_pipeline(saved / "sd"), run / "checkpoints" / "step-2", seed=2)
    newest = save_random_lora(load_pipeline(saved / "sd"), run / "checkpoints" / "step-10", seed=3)
    assert find_trained_weights(run) == ("lora", run / "checkpoints" / "step-10" / "pytorch_lora_weights.safetensors")
    pipe = load_pipeline(saved / "sd", lora=run)
    assert torch.allclose(unet_out(pipe), newest, atol=1e-6)


def test_full_finetune_checkpoint_replaces_unet(saved, tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step-1"
    tuned = load_pipeline(saved / "sd")
    with torch.no_grad():
        tuned.unet.conv_out.bias.add_(1.0)
    tuned.unet.save_pretrained(step / "unet")
    pipe = load_pipeline(saved / "sd", lora=tmp_path / "run")
    assert torch.equal(unet_out(pipe), unet_out(tuned))


def test_lora_path_errors(saved, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_pipeline(saved / "sd", lora=tmp_path / "missing")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="no checkpoints yet"):
        load_pipeline(saved / "sd", lora=tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no LoRA weights"):
        load_pipeline(saved / "sd", lora=tmp_path / "empty")


def test_a_lora_that_does_not_fit_is_one_error_from_load_pipeline(saved, tmp_path, capsys):
    """The pipelines-level loader (`diffrl sample`, `diffrl steer` and the demo all load through it): keys partly for
    another model name how many matched; a file diffusers cannot map is a UserError naming the error; nothing on
    stderr."""
    from safetensors.torch import load_file, save_file

    save_random_lora(load_pipeline(saved / "sd"), tmp_path / "good", seed=1)
    good = load_file(tmp_path / "good" / "pytorch_lora_weights.safetensors")
    keys = sorted(good)
    assert len(keys) >= 4 and all(k.startswith("unet.") for k in keys)
    cases = {
        # a quarter of the keys for a flow model's transformer, the rest for the UNet
        "other_model": {("transformer" + k.removeprefix("unet") if i % 4 == 0 else k): good[k]
                        for i, k in enumerate(keys)},
        "only_down": {k: v for k, v in good.items() if "lora.down" in k},  # diffusers: IndexError
    }
    for name, weights in cases.items():
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "pytorch_lora_weights.safetensors"))
    capsys.readouterr()
    other = len(range(0, len(keys), 4))
    with pytest.raises(UserError) as info:
        load_pipeline(saved / "sd", lora=tmp_path / "other_model")
    assert (f"only {len(keys) - other} of its {len(keys)} keys match StableDiffusionPipeline (unet); the other "
            f"{other} are for transformer, which it has not") in str(info.value)
    with pytest.raises(UserError, match="into StableDiffusionPipeline: IndexError") as info:
        load_pipeline(saved / "sd", lora=tmp_path / "only_down")
    assert "\n" not in str(info.value)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("shared", [False, True], ids=["component", "shared-component"])
def test_a_folder_cannot_make_diffrl_import_its_code(tmp_path, monkeypatch, shared):
    """A model index naming a library of its own (`payload`, a .py beside it) is refused before any import, by
    load_pipeline, by check_pipeline (what `diffrl validate` runs) and through the CLI run from that folder (the
    working folder on sys.path, as `python -m diffrl.cli` puts it); the payload never runs."""
    from diffrl.pipelines import check_pipeline
    from samplers.testing import tiny_sd3_pipeline

    folder = tmp_path / "evil"
    tiny_sd3_pipeline(folder, t5=False)
    marker = tmp_path / "ran"
    (folder / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\nclass X: pass\n")
    index = json.loads((folder / "model_index.json").read_text())
    if shared:  # the diffrl-only key, whose component diffrl loads itself
        shutil.rmtree(folder / "text_encoder_2")
        index["text_encoder"] = ["payload", "X"]
        index["_diffrl_shared_components"] = {"text_encoder_2": "text_encoder", "tokenizer_2": "tokenizer"}
    else:
        index["text_encoder"] = ["payload", "X"]
    (folder / "model_index.json").write_text(json.dumps(index))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    expected = "component 'text_encoder' names the library 'payload'"
    with pytest.raises(UserError, match=expected):
        load_pipeline(folder)
    with pytest.raises(UserError, match=expected):
        check_pipeline(str(folder))
    out = subprocess.run([sys.executable, "-m", "diffrl.cli", "sample", "--pipeline", ".", "--prompt", "x",
                          "--out", str(tmp_path / "out")], check=False, capture_output=True, text=True,
                         cwd=folder, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and expected in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not marker.exists()
