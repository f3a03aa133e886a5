"""Each ShapesWorld training script runs a couple of steps on a tiny budget, exports loadable weights, and resumes
exactly where it stopped."""

import json

import pytest
import torch
from safetensors.torch import load_file

from diffrl.embedded import ASSETS
from diffrl.shapes import train, train_common


def _run(target, tmp_path, *extra, name=None):
    work, out = tmp_path / f"{name or target}-work", tmp_path / f"{name or target}-out"
    train.main([target, "--steps", "2", "--batch-size", "4", "--log-every", "1", "--save-every", "1",
                "--work-dir", str(work), "--out", str(out), *extra])
    return work, out


def _weights(folder):
    return {k: v for f in sorted(folder.rglob("*.safetensors")) for k, v in load_file(f).items()}


def test_clip_two_steps(tmp_path):
    from transformers import CLIPModel

    from diffrl.shapes.tokenizer import load_tokenizer

    _, out = _run("clip", tmp_path, "--eval-size", "32")
    model = CLIPModel.from_pretrained(out)
    assert 0.0 <= json.loads((out / "quality.json").read_text())["heldout_text_to_image_top1_b32"] <= 1.0
    ids = load_tokenizer(out)(["a red circle"], return_tensors="pt").input_ids
    assert model.get_text_features(input_ids=ids).pooler_output.shape == (1, model.config.projection_dim)


def test_vae_resumes_exactly(tmp_path, monkeypatch):
    from diffusers import AutoencoderKL

    _, straight = _run("vae", tmp_path, name="straight")
    assert AutoencoderKL.from_pretrained(straight).config.scaling_factor > 0

    # The same run stopped right after its first checkpoint, then started again with the same command.
    saves = []
    real_save = train_common.Checkpointer.save

    def save_then_die(self, state):
        real_save(self, state)
        saves.append(state["step"])
        raise KeyboardInterrupt

    monkeypatch.setattr(train_common.Checkpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _run("vae", tmp_path, name="resumed")
    monkeypatch.setattr(train_common.Checkpointer, "save", real_save)
    assert saves == [1]
    _, resumed = _run("vae", tmp_path, name="resumed")
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tiny_unet_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unet")
    return _run("unet", tmp, "--cache-size", "16")


def test_unet_two_steps_writes_a_pipeline(tiny_unet_run):
    from diffrl.pipelines import load_pipeline

    work, out = tiny_unet_run
    assert (work / "train_set-0-16.pt").exists()  # the encoded train set is kept for resuming
    pipe = load_pipeline(str(out))
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe.unet.config.cross_attention_dim == pipe.text_encoder.config.hidden_size


def test_encoded_train_set_matches_the_vae_and_text_encoder(tiny_unet_run):
    from diffrl.shapes.train_common import batch_seed, frozen_parts, to_tensor, tokenize
    from diffrl.shapes.world import sample_batch

    work, _ = tiny_unet_run
    data = torch.load(work / "train_set-0-16.pt", weights_only=True)
    tokenizer, text_encoder, vae = frozen_parts(ASSETS / "tiny-shapes-clip", ASSETS / "tiny-shapes" / "vae")
    images, captions, _ = sample_batch(batch_seed(0, 0, 4), 16, "train")
    with torch.no_grad():
        mean = vae.encode(to_tensor(images) * 2 - 1).latent_dist.mean
        embeds = text_encoder(tokenize(tokenizer, captions))[0]
    torch.testing.assert_close(data["mean"].float(), mean, atol=2e-3, rtol=2e-3)  # stored in fp16
    torch.testing.assert_close(data["embeds"][data["caption_index"]], embeds)


def test_lcm_two_steps_from_the_unet(tiny_unet_run, tmp_path):
    from diffrl.pipelines import load_pipeline

    _, teacher = tiny_unet_run
    _, out = _run("lcm", tmp_path, "--teacher", str(teacher), "--cache-size", "16")
    assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "scheduler", "unet"]
    pipe = load_pipeline(str(out))  # unet/ + scheduler/; the rest comes from tiny-shapes
    assert type(pipe).__name__ == "LatentConsistencyModelPipeline"
    assert pipe.unet.config.time_cond_proj_dim is not None


def test_pickscore_two_steps(tmp_path):
    from rewards import get_reward

    _, out = _run("pickscore", tmp_path, "--eval-size", "16")
    quality = json.loads((out / "quality.json").read_text())
    assert set(quality) == {"heldout_pair_accuracy", "heldout_pair_accuracy_heldout_captions"}
    reward = get_reward("pickscore", model=str(out), device="cpu")
    scores = reward(torch.rand(2, 3, 32, 32), ["a red circle", "two blue squares"], None).scores
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_preference_pairs_prefer_the_higher_verifier_score_then_the_sharper_image():
    from diffrl.shapes.verifier import verify

    a, b, captions, label, levels = train.preference_pairs(seed=3, n=48)
    sa, sb = verify(a, captions)[0], verify(b, captions)[0]
    assert torch.equal(label[sa > sb], torch.ones(int((sa > sb).sum())))
    assert torch.equal(label[sa < sb], torch.zeros(int((sa < sb).sum())))
    tied = sa == sb
    assert 0 < tied.sum() < 48
    expected = torch.where(levels[:, 0] < levels[:, 1], 1.0, torch.where(levels[:, 0] > levels[:, 1], 0.0, 0.5))
    assert torch.equal(label[tied], expected[tied])
    # Level 0 is the clean render; higher levels are blurred (and noisy) copies of it.
    clean = levels[:, 0] == 0
    assert clean.any() and (levels[:, 0] > 0).any()


def test_flow_two_steps_writes_an_sd3_pipeline_trained_on_what_sampling_feeds(tmp_path):
    from diffrl.pipelines import load_pipeline
    from diffrl.shapes.train_common import batch_seed
    from diffrl.shapes.world import sample_batch

    work, out = _run("flow", tmp_path, "--cache-size", "16")
    # the text tower is stored once (SD3's two CLIP towers are the same one); the VAE is tiny-shapes'
    assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "scheduler", "text_encoder", "tokenizer",
                                                     "transformer", "vae"]
    pipe = load_pipeline(str(out))
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.text_encoder_2 is pipe.text_encoder
    assert pipe.transformer.config.patch_size == 1 and pipe.vae.config.shift_factor == 0.0
    # the cached conditioning is the pipeline's own encoding (CLIP tokens only, no T5), stored in fp16
    data = torch.load(work / "train_set-flow-0-16.pt", weights_only=True)
    _, captions, _ = sample_batch(batch_seed(0, 0, 4), 16, "train")
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=0)
    torch.testing.assert_close(data["embeds"][data["caption_index"]].float(), embeds, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(data["pooled"][data["caption_index"]].float(), pooled, atol=2e-3, rtol=2e-3)
