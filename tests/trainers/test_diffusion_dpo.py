"""Diffusion-DPO: the loss by hand, what one micro-batch feeds the UNet (shared t and ε, adapter-off reference, log 2
at the start), the pairs file checks (one line, file:line, exit code 2, nothing written), Pick-a-Pic parquet and the
ShapesWorld pairs set."""

import json
import math
from pathlib import Path

import pytest
import torch
from pg_helpers import TINY_PAIRS, load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

from diffrl.errors import UserError
from diffrl.trainers import diffusion_dpo
from diffrl.trainers.diffusion_dpo import diffusion_dpo_loss

# ------------------------------------------------------------------------------------------------ the loss by hand


def test_loss_for_pairs_with_known_noise_errors():
    # target 0, two latent dims, so each row's MSE is the mean of its two squared entries
    target = torch.zeros(4, 1, 1, 2)
    model = torch.tensor([[1.0, 1.0], [0.0, 2.0], [2.0, 0.0], [1.0, 1.0]]).reshape(4, 1, 1, 2)  # mse 1, 2 | 2, 1
    ref = torch.ones(4, 1, 1, 2)  # mse 1 everywhere
    loss, stats = diffusion_dpo_loss(model, ref, target, beta=2.0)
    # pair 0: (1 − 1) − (2 − 1) = −1, argument −½·2·(−1) = +1: −log σ(1) = log(1 + e^−1) = 0.3132617
    # pair 1: (2 − 1) − (1 − 1) = +1, argument −1:               −log σ(−1) = log(1 + e) = 1.3132617
    assert loss.item() == pytest.approx((0.3132617 + 1.3132617) / 2, abs=1e-6)
    assert stats["implicit_acc"].item() == 0.5  # one of two arguments > 0
    assert stats["reward_margin"].item() == pytest.approx(0.0, abs=1e-12)  # (+1 − 1) / 2
    assert stats["model_mse"].item() == pytest.approx(1.5) and stats["ref_mse"].item() == pytest.approx(1.0)


def test_loss_is_log_two_when_the_model_is_the_reference_and_its_gradient_favours_the_preferred_image():
    torch.manual_seed(0)
    target, ref = torch.randn(6, 4, 3, 3), torch.randn(6, 4, 3, 3)
    model = ref.clone().requires_grad_(True)
    loss, stats = diffusion_dpo_loss(model, ref, target, beta=5000.0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7) and stats["implicit_acc"].item() == 0.0
    loss.backward()
    # at argument 0, d(−log σ(a))/da = −½, and a = −½β((mse_w − ·) − (mse_l − ·)) with d mse / d pred = 2(pred − y)/D:
    # the gradient on a preferred row is +½ · ½β · 2(pred − y)/D / B, on a rejected row the same with a minus sign
    d, b = 4 * 3 * 3, 3
    expected = 0.5 * 0.5 * 5000.0 * 2 * (ref - target) / d / b
    assert torch.allclose(model.grad[:3], expected[:3], rtol=1e-5)
    assert torch.allclose(model.grad[3:], -expected[3:], rtol=1e-5)


def test_loss_refuses_an_odd_number_of_rows():
    with pytest.raises(ValueError, match="pairs"):
        diffusion_dpo_loss(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1), beta=1.0)


# ------------------------------------------------------------------------------------------------ one micro-batch


def _recipe(tmp_path, **groups):
    base = with_trainer({"run": {"num_epochs": 2, "save_every": 0},
                         "log": {"tracker": "none", "image_every": 0}}, "diffusion_dpo")
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def test_pairs_share_t_and_noise_the_reference_is_the_adapter_off_unet_and_the_start_is_log_two(tmp_path, monkeypatch):
    from diffusers import UNet2DConditionModel

    from diffrl.models import unet as unet_family

    calls, losses = [], []
    noising = []
    original_add_noise, original_loss = unet_family.DDPMProcess.add_noise, diffusion_dpo.diffusion_dpo_loss

    def add_noise(self, x0, noise, t):
        noising.append((x0.clone(), noise.clone(), t.clone()))
        return original_add_noise(self, x0, noise, t)

    def loss_fn(model_pred, ref_pred, target, beta):
        loss, stats = original_loss(model_pred, ref_pred, target, beta)
        losses.append((loss.item(), model_pred.detach().clone(), ref_pred.clone()))
        return loss, stats

    monkeypatch.setattr(unet_family.DDPMProcess, "add_noise", add_noise)
    monkeypatch.setattr(diffusion_dpo, "diffusion_dpo_loss", loss_fn)

    def record(info):
        if not calls:  # once: hook the UNet's inputs (the step callback runs before training too)
            info["unet"].register_forward_hook(
                lambda module, args, kwargs, out: calls.append((args, kwargs)), with_kwargs=True)

    diffusion_dpo.train(load_cfg(_recipe(tmp_path, train={"random_flip": False})), tmp_path / "run",
                        step_callback=record)
    assert len(losses) == 4 and len(calls) == 8  # 2 epochs × 2 micro-batches; a policy and a reference call each
    for (x0, noise, t), (args, kwargs) in zip(noising, calls[::2]):
        b = len(x0) // 2  # rows [:b] preferred, [b:] rejected, pair i = rows i and b + i
        assert torch.equal(noise[:b], noise[b:]) and torch.equal(t[:b], t[b:])
        timesteps = args[1]
        assert torch.equal(timesteps, t)
        assert torch.equal(kwargs["encoder_hidden_states"][:b], kwargs["encoder_hidden_states"][b:])
        assert not torch.equal(x0[:b], x0[b:])  # two different images
    # before the first update the LoRA is the identity: the policy is the reference, the loss exactly log 2
    assert losses[0][0] == pytest.approx(math.log(2), abs=1e-6)
    assert torch.equal(losses[0][1], losses[0][2])
    # after updates, the reference is still exactly the pre-trained UNet (a fresh copy with no adapter at all)
    base = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir(tmp_path) / "unet")
    args, kwargs = calls[-1]
    with torch.no_grad():
        expected = base(*args, **kwargs)[0]  # called with return_dict=False, as the model family calls it
    assert torch.allclose(losses[-1][2], expected, atol=1e-6)
    assert (losses[-1][1] - expected).abs().max() > 1e-4  # while the policy has moved


def test_posterior_latents_are_the_vaes_mean_and_std_scaled(tmp_path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir(tmp_path))
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        mean, std = diffusion_dpo.encode_posterior(pipe, images)
        dist = pipe.vae.encode(images).latent_dist
    scale = pipe.vae.config.scaling_factor  # no shift_factor, no latents_mean in SD 1.x VAEs
    assert torch.allclose(mean, dist.mean * scale) and torch.allclose(std, dist.std * scale)


def test_an_epoch_counts_pairs_and_the_skipped_ties_and_unlabelled(tmp_path):
    from diffrl.training.metrics import read_metrics

    diffusion_dpo.train(load_cfg(_recipe(tmp_path)), tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert [r["samples_seen"] for r in records] == [4, 8]  # 2 steps × 2 pairs per epoch
    assert all(r["pairs"] == 4 and r["ties_skipped"] == 1 and r["unlabelled_skipped"] == 1 for r in records)
    assert all(r["reward_mean"] is None for r in records)  # offline: nothing sampled in training


def test_full_finetuning_is_refused(tmp_path):
    with pytest.raises(UserError, match="adapter off"):
        load_cfg(_recipe(tmp_path, model={"full_finetune": True}))


# ------------------------------------------------------------------------------------------------ label files

BAD_LINES = [  # the checks of diffrl.pairs.labels.read_label_file, the format's one definition
    ("{not json", "not valid JSON"),
    ('["a list"]', "a line is a JSON object"),
    ('{"prompt": "x", "seed": 1, "choice": 0}', "missing key 'images'"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png", "b.png"], "choice": 0, "score": 1}', "unknown key 'score'"),
    ('{"prompt": 3, "seed": 1, "images": ["a.png", "b.png"], "choice": 0}', "prompt must be a non-empty string"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png"], "choice": 0}', "images must be a list of two paths"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png", "missing.png"], "choice": 0}', "image missing.png does not exist"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png", "b.png"], "choice": 2}', "choice must be 0, 1"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png", "b.png"], "choice": true}', "choice must be 0, 1"),
    ('{"prompt": "x", "seed": 1, "images": ["a.png", "b.png"], "choice": "left"}', "choice must be 0, 1"),
]


def _label_file(folder: Path, bad_line: str) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("a.png", "b.png"):
        Image.new("RGB", (16, 16), (200, 10, 10)).save(folder / name)
    good = json.dumps({"prompt": "a red circle", "seed": 0, "images": ["a.png", "b.png"], "choice": 1})
    path = folder / "pairs.jsonl"
    path.write_text(f"{good}\n\n{good}\n{bad_line}\n{good}\n")  # the bad pair on line 4 (line 2 is blank)
    return path


@pytest.mark.parametrize("bad_line, message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_a_malformed_line_names_the_file_and_line(tmp_path, bad_line, message):
    from diffrl.pairs.datasets import read_label_file

    path = _label_file(tmp_path / "labels", bad_line)
    with pytest.raises(UserError) as info:
        read_label_file(path)
    assert str(info.value).startswith(f"{path}:4: ") and message in str(info.value)


def test_a_bad_label_file_stops_run_and_validate_with_one_line_and_exit_2_writing_nothing(tmp_path, capsys):
    import yaml

    from diffrl.cli import main

    path = _label_file(tmp_path / "labels", '{"prompt": "x", "seed": 1, "images": ["a.png", "b.png"], "choice": 7}')
    recipe = _recipe(tmp_path, train={"pairs": str(path)}, run={"output_dir": str(tmp_path / "runs")})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()  # the tiny pipeline's build output
    for verb in ("validate", "run"):
        assert main([verb, str(tmp_path / "recipe.yaml")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{path}:4: choice must be 0, 1" in err[0], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no run dir, nothing written


def test_a_label_file_with_nothing_labelled_is_refused(tmp_path):
    from diffrl.pairs.datasets import read_label_file

    path = _label_file(tmp_path / "labels", "")
    path.write_text(json.dumps({"prompt": "x", "seed": 0, "images": ["a.png", "b.png"], "choice": None}) + "\n")
    with pytest.raises(UserError, match="no labelled pair"):
        read_label_file(path)


def test_the_tiny_label_file_prefers_the_chosen_image():
    from diffrl.pairs.datasets import load_pairs

    pairs = load_pairs(str(Path(TINY_PAIRS).parent))  # a folder holding pairs.jsonl is that file
    lines = [json.loads(line) for line in Path(TINY_PAIRS).read_text().splitlines()]
    labelled = [line for line in lines if line["choice"] in (0, 1)]
    assert len(pairs) == len(labelled) == 4 and pairs.skipped == {"tie": 1, "unlabelled": 1}
    for i, line in enumerate(labelled):
        preferred, rejected = pairs._paths[i]
        assert preferred.name == Path(line["images"][line["choice"]]).name
        assert rejected.name == Path(line["images"][1 - line["choice"]]).name


# ------------------------------------------------------------------------------------------------ Pick-a-Pic


def test_pickapic_parquet_pairs_preferred_first_ties_skipped(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import io

    from PIL import Image

    from diffrl.pairs.datasets import check_pairs_source, load_pairs

    def jpg(value):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (value, value, value)).save(buffer, format="JPEG", quality=100)
        return buffer.getvalue()

    table = pa.table({"caption": ["one", "two", "three"], "jpg_0": [jpg(0), jpg(100), jpg(200)],
                      "jpg_1": [jpg(50), jpg(150), jpg(250)], "label_0": [1.0, 0.0, 0.5]})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "train-00000-of-00001.parquet", row_group_size=2)
    pq.write_table(table.slice(0, 1), tmp_path / "data" / "validation-00000-of-00001.parquet")
    check_pairs_source(str(tmp_path))
    pairs = load_pairs(str(tmp_path))  # the folder: its train- files only
    assert pairs.prompts == ["one", "two"] and pairs.skipped == {"tie": 1, "unlabelled": 0}
    grey = [[image.getpixel((4, 4))[0] for image in pairs.images(i)] for i in range(2)]
    assert grey[0][0] == pytest.approx(0, abs=3) and grey[0][1] == pytest.approx(50, abs=3)  # label_0 = 1: jpg_0
    assert grey[1][0] == pytest.approx(150, abs=3) and grey[1][1] == pytest.approx(100, abs=3)  # label_0 = 0: jpg_1
    assert sorted(pairs.order(__import__("numpy").random.default_rng(0)).tolist()) == [0, 1]

    pq.write_table(table.drop(["label_0"]), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match="no column 'label_0'"):
        check_pairs_source(str(tmp_path / "bad.parquet"))


def test_pairs_sources_that_do_not_exist_or_are_unknown(tmp_path):
    from diffrl.pairs.datasets import check_pairs_source

    with pytest.raises(UserError, match="does not exist"):
        check_pairs_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="did you mean 'shapes:train'"):
        check_pairs_source("shapes:trian")
    check_pairs_source("yuvalkirstain/pickapic_v2")  # a hub id: resolved when training starts, like a hub pipeline


# ------------------------------------------------------------------------------------------------ ShapesWorld pairs


def test_shapes_pairs_rank_by_the_verifier_and_are_generated_once(tmp_path, monkeypatch):
    from diffrl.pairs import shapes as shapes_pairs
    from diffrl.pairs.datasets import load_pairs

    setting = shapes_pairs.PairsSetting(num_prompts=3, samples_per_prompt=3, num_steps=10)
    monkeypatch.setitem(shapes_pairs.PAIR_SETS, "tiny", (setting, "a test set"))
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    pairs = load_pairs("shapes:tiny")
    folder = tmp_path / "cache" / "pairs" / "tiny"
    lines = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    scores = json.loads((folder / "meta.json").read_text())["scores"]
    assert len(lines) == 3 and len(pairs) + pairs.skipped["tie"] == 3
    from diffrl.pairs.labels import read_label_file
    from diffrl.shapes.prompts import get_prompt_set

    assert len(read_label_file(folder / "pairs.jsonl")) == 3  # a label file as diffrl.pairs.labels defines it
    assert [line["prompt"] for line in lines] == get_prompt_set("train")[:3]
    for i, (line, two) in enumerate(zip(lines, scores)):
        assert all((folder / p).is_file() for p in line["images"]) and line["seed"] == i  # prompt i's shared x_T
        if two[0] == two[1]:
            assert line["choice"] == "tie"
        else:
            assert two[line["choice"]] == max(two) and two[1 - line["choice"]] == min(two)
    stamp = (folder / "pairs.jsonl").stat().st_mtime_ns
    load_pairs("shapes:tiny")  # cached: not generated again
    assert (folder / "pairs.jsonl").stat().st_mtime_ns == stamp
    assert "cached in" in shapes_pairs.list_pair_sets()["shapes:tiny"]
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir())  # no temporary folder left


def test_sdxl_pairs_get_pooled_text_and_size_conditioning(tmp_path):
    from samplers.testing import tiny_sdxl_pipeline

    pipe_dir = tmp_path / "tiny-sdxl"
    tiny_sdxl_pipeline(pipe_dir)  # 16x16 images, like the tiny label file's
    calls, weights = [], {}

    def record(info):
        weights[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                        if p.requires_grad}
        if not calls:
            info["unet"].register_forward_hook(
                lambda module, args, kwargs, out: calls.append(kwargs), with_kwargs=True)

    recipe = _recipe(tmp_path, model={"pipeline": str(pipe_dir)}, run={"num_epochs": 1})
    diffusion_dpo.train(load_cfg(recipe), tmp_path / "run", step_callback=record)
    added = calls[0]["added_cond_kwargs"]
    rows = len(calls[0]["encoder_hidden_states"])
    # SDXL's micro-conditioning at the pipeline's size: original (16, 16), crop (0, 0), target (16, 16)
    assert torch.equal(added["time_ids"], torch.tensor([[16.0, 16, 0, 0, 16, 16]]).expand(rows, -1))
    assert added["text_embeds"].shape == (rows, 16) and torch.equal(added["text_embeds"][: rows // 2],
                                                                    added["text_embeds"][rows // 2:])
    assert sorted(weights) == [0, 1, 2]
    assert not [n for n in weights[0] if torch.equal(weights[0][n], weights[2][n])]


def test_ls_pairs_lists_the_shapes_sets(capsys):
    from diffrl.cli import main

    assert main(["ls", "pairs"]) == 0
    out = capsys.readouterr().out
    assert "shapes:train " in out and "256 captions" in out and "shapes:train_small" in out


def test_shapes_pairs_can_be_ranked_by_any_reward(tmp_path):
    import io

    from PIL import Image

    from diffrl.errors import UserError
    from diffrl.pairs import shapes as shapes_pairs

    setting = shapes_pairs.PairsSetting(num_prompts=2, samples_per_prompt=3, num_steps=2,
                                        reward="jpeg_compressibility")
    folder = shapes_pairs.make_pairs(tmp_path / "jpeg", setting)
    lines = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    scores = json.loads((folder / "meta.json").read_text())["scores"]
    for line, two in zip(lines, scores):
        # each score is minus the kB of the saved image re-encoded as JPEG at quality 95, by PIL directly
        for path, score in zip(line["images"], two):
            buffer = io.BytesIO()
            Image.open(folder / path).convert("RGB").save(buffer, format="JPEG", quality=95)
            assert score == pytest.approx(-len(buffer.getvalue()) / 1000, abs=1e-6)
        assert line["choice"] == "tie" if two[0] == two[1] else two[line["choice"]] == max(two)
    with pytest.raises(UserError, match="no_such_reward"):
        shapes_pairs.make_pairs(tmp_path / "bad", shapes_pairs.PairsSetting(num_prompts=2, reward="no_such_reward"))
    assert not (tmp_path / "bad").exists()
