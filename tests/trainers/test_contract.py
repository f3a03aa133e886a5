"""The trainer contract, checked for every trainer in the registry (`diffrl.trainers.TRAINERS`): registering a trainer
enrols it here and in the parametrised tests of test_pg_training.py (parameters change, frozen ones do not, run dir),
test_resume.py (SIGKILL and resume equals an uninterrupted run), test_distributed.py (two processes agree after every
step) and test_pg_recipes.py (its recipes validate).

Direction of learning: a trainer told to maximise r and one told to maximise −r must move opposite ways, from the
same seed, by a margin stated below. What moves depends on the kind of gradient:
- a trainer without advantages (DRaFT's pathwise gradient, RAFT's fine-tuning on its best samples) raises the reward
  itself: the mean brightness of fixed-seed held-out images after a few updates is higher with r than with −r;
- a policy-gradient trainer (with advantages: DDPO, DPOK) raises the likelihood of its epoch's better-than-average
  samples against its worse ones. Its reward on held-out images is too noisy to order after a few updates with
  the tiny models here (a score-function gradient needs hundreds of samples per step, `diffrl bench gradient`), but
  the likelihood shift on its own samples is exact: after the first optimizer step, mean Δ log π over the samples
  with above-average reward minus that over the below-average ones is > 0 for r and < 0 for −r. An advantage whose
  sign is flipped where the trainer calls its loss reverses it.
"""

import numpy as np
import pytest
import torch
from pg_helpers import (
    DIRECTION,
    TINY,
    load_cfg,
    offline_trainers,
    registered_trainers,
    tiny_pipeline_dir,
    tiny_recipe,
    with_trainer,
)

from diffrl.trainers import get_trainer


@pytest.mark.parametrize("trainer", registered_trainers())
def test_every_registered_trainer_has_a_tiny_recipe(trainer):
    assert trainer in TINY and trainer in DIRECTION, (
        f"add the contract tests' tiny settings of '{trainer}' to tests/trainers/pg_helpers.TINY and DIRECTION")


@pytest.mark.parametrize("trainer", registered_trainers())
def test_the_module_states_the_contract(trainer, tmp_path):
    import dataclasses

    from diffrl.trainers import CONTRACT

    module = get_trainer(trainer)
    assert all(hasattr(module, attr) for attr in CONTRACT)
    assert dataclasses.is_dataclass(module.TrainConfig)
    assert isinstance(module.OPTIM_DEFAULTS, dict) and module.ADVANTAGE_DEFAULTS in (None, module.ADVANTAGE_DEFAULTS)
    # an embedded pipeline name: checking a config needs no weights
    cfg = load_cfg(tiny_recipe("tiny-shapes", tmp_path, **with_trainer({}, trainer)))
    derived = module.derived(cfg, 2)
    assert {"global_train_batch", "optimizer_steps_per_epoch", "total_optimizer_steps"} <= set(derived)
    assert derived["total_optimizer_steps"] == derived["optimizer_steps_per_epoch"] * cfg.run.num_epochs


def _direction_recipe(tmp_path, trainer, sign: float, **groups):
    base = with_trainer({"run": {"num_epochs": 1, "save_every": 0, "eval_every": 0},
                         "sample": {"num_steps": 2, "batch_size": 4, "num_batches_per_epoch": 2},
                         "log": {"tracker": "none", "image_every": 0}}, trainer)
    base["reward"] = {"name": "pg_helpers:signed_brightness", "kwargs": {"sign": sign}, "gold": "pg_helpers:brightness"}
    for group, values in [*DIRECTION[trainer].items(), *groups.items()]:
        base[group] = {**base.get(group, {}), **values}
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def _train_capturing_rollouts(trainer, cfg, run_dir, step_callback, captured: list) -> None:
    """Train, appending each epoch's trajectories to `captured` as the run context samples them."""
    from diffrl.training import context

    original = context.collect_rollouts

    def capture(**kwargs):
        out = original(**kwargs)
        captured.append(out.traj)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(context, "collect_rollouts", capture)
        get_trainer(trainer).train(cfg, run_dir, step_callback=step_callback)


def _likelihood_shift(tmp_path, trainer, sign: float, pairs: bool = False) -> float:
    """mean Δ log π (first optimizer step) of the epoch's above-average-brightness samples minus the below-average;
    with `pairs` (samples 2i, 2i+1 form a pair), of each pair's brighter sample minus its darker one."""
    from diffrl.models.base import decode_latents
    from samplers import get_sampler

    captured, log_probs = [], {}

    def record(info):
        if info["global_step"] > 1 or not captured:
            return
        pipe, traj = info["pipe"], captured[0]
        sampler = get_sampler("auto", pipe)
        with torch.no_grad():
            log_probs[info["global_step"]] = torch.stack(
                [sampler.log_prob(pipe, traj, j) for j in range(traj.num_steps - skip)]).sum(dim=0)
            if "brightness" not in log_probs:  # the samples' own brightness, from their final latents
                log_probs["brightness"] = decode_latents(pipe, traj.latents[:, -1]).mean(dim=(1, 2, 3))

    recipe = _direction_recipe(tmp_path, trainer, sign, optim={"learning_rate": 1e-3})
    skip = recipe["train"].get("skip_final_steps", 0)  # the trained steps are the first T − skip
    _train_capturing_rollouts(trainer, load_cfg(recipe), tmp_path / f"run{sign}", record, captured)
    # the callback runs once before training (global_step 0) but the rollout exists only from the first step on:
    # step 0's log-probs are the rollout's own (weights unchanged until the first step)
    before = captured[0].log_probs[:, : captured[0].num_steps - skip].sum(dim=1) if 0 not in log_probs else log_probs[0]
    delta = log_probs[1] - before.to(log_probs[1])
    brightness = log_probs["brightness"]
    if pairs:
        return float(((delta[0::2] - delta[1::2]) * torch.sign(brightness[0::2] - brightness[1::2])).mean())
    above = brightness > brightness.mean()
    return float(delta[above].mean() - delta[~above].mean())


def _fit_shift(tmp_path, trainer, sign: float) -> float:
    """After the first round, how much better the model denoises its above-average-brightness samples than its
    below-average ones, against the pre-trained model: mean ΔMSE(below) − mean ΔMSE(above), where ΔMSE is the
    fine-tuned minus the pre-trained (adapter off; a fresh LoRA starts as the identity) ε-prediction error at fixed
    timesteps and noise, of the prediction the trainer fits (conditional, or guided as the sampler ran it)."""
    from diffrl.models.base import decode_latents
    from diffrl.training.weights import adapter_disabled

    captured, shift = [], {}

    recipe = _direction_recipe(tmp_path, trainer, sign)
    cfg = load_cfg(recipe)
    guided = getattr(cfg.train, "fit", "conditional") == "guided" and cfg.sample.guidance_scale > 1
    steps_per_round = get_trainer(trainer).derived(cfg, 1)["optimizer_steps_per_epoch"]

    def record(info):
        if info["global_step"] != steps_per_round or shift:
            return
        pipe, traj = info["pipe"], captured[0]
        unet, x0, g = pipe.unet, traj.latents[:, -1], torch.Generator().manual_seed(0)

        def error():  # ε-prediction MSE per sample, averaged over t = 100, 300, ..., 900 with fixed noise
            total = 0.0
            for step in range(100, 1000, 200):
                noise = torch.randn(x0.shape, generator=g.manual_seed(step))
                a = pipe.scheduler.alphas_cumprod[step]
                x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
                t = torch.full((len(x0),), step)
                pred = unet(x_t, t, encoder_hidden_states=traj.prompt_embeds).sample
                if guided:  # the prediction RAFT's default fit (train.fit=guided) regresses: the sampler's CFG one
                    uncond = unet(x_t, t, encoder_hidden_states=traj.negative_prompt_embeds).sample
                    pred = uncond + traj.guidance_scale * (pred - uncond)
                total = total + (pred - noise).pow(2).flatten(1).mean(1)
            return total / 5

        with torch.no_grad():
            after = error()
            with adapter_disabled(unet):
                before = error()
            brightness = decode_latents(pipe, x0).mean(dim=(1, 2, 3))
        delta, above = after - before, brightness > brightness.mean()
        shift["value"] = float(delta[~above].mean() - delta[above].mean())

    _train_capturing_rollouts(trainer, cfg, tmp_path / f"run{sign}", record, captured)
    return shift["value"]


def _write_ranked_pairs(folder, sign: float, n: int = 8) -> str:
    """A label file of n pairs of 16x16 grey images, one bright (0.7) and one dark (0.3) per pair, in random order on
    the line; the choice is the image with the higher sign × brightness. (With noise images the pairs differ mostly
    in their noise, which a few steps of the tiny random UNet cannot tell apart: measured, no consistent direction.)"""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (folder / "images").mkdir(parents=True)
    lines = []
    for i in range(n):
        levels = [0.7, 0.3] if rng.random() < 0.5 else [0.3, 0.7]
        names = []
        for j, level in enumerate(levels):
            Image.new("RGB", (16, 16), (round(level * 255),) * 3).save(folder / "images" / f"{i}_{j}.png")
            names.append(f"images/{i}_{j}.png")
        choice = int(np.argmax([sign * level for level in levels]))
        lines.append({"prompt": ["a red circle", "a blue square"][i % 2], "seed": i, "images": names, "choice": choice})
    (folder / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(folder / "pairs.jsonl")


def _sharp_vae_pipeline(tmp_path):
    """The tiny pipeline with its random VAE made to encode like a trained one: a random VAE's posterior is as wide
    as the prior (std ~1 against means that differ by ~0.3 between images), so its latents would be noise and no
    pair of images distinguishable; here the posterior std is e^-10 and the means are 10x further apart."""
    from diffusers import StableDiffusionPipeline

    path = tmp_path / "tiny-sd-sharp-vae"
    if not (path / "model_index.json").is_file():
        pipe = StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir(tmp_path))
        with torch.no_grad():
            conv = pipe.vae.quant_conv  # outputs [mean; logvar] of the posterior
            half = conv.out_channels // 2
            conv.weight[:half] *= 10
            conv.bias[:half] *= 10
            conv.weight[half:] = 0
            conv.bias[half:] = -20
        pipe.save_pretrained(path)
    return path


def _preference_shift(tmp_path, trainer, sign: float) -> float:
    """An offline preference trainer's direction is its labels: trained on pairs that prefer the brighter image
    (sign +1) or the darker (−1), how much better than the pre-trained model it denoises the bright images than the
    dark ones: mean ΔMSE(dark) − mean ΔMSE(bright), ΔMSE = fine-tuned minus adapter-off ε-prediction error of the
    images' VAE latents (posterior means) at fixed timesteps and noise, with their pairs' captions."""
    import json
    from pathlib import Path

    from PIL import Image

    from diffrl.training.weights import adapter_disabled

    pairs = _write_ranked_pairs(tmp_path / f"pairs{sign}", sign)
    recipe = _direction_recipe(tmp_path, trainer, sign, train={"pairs": pairs},
                               model={"pipeline": str(_sharp_vae_pipeline(tmp_path))})
    cfg = load_cfg(recipe)
    total = get_trainer(trainer).derived(cfg, 1)["total_optimizer_steps"]
    shift = {}

    def record(info):
        if info["global_step"] != total:
            return
        pipe, unet = info["pipe"], info["pipe"].unet
        bright, dark, prompts = [], [], []
        for line in Path(pairs).read_text().splitlines():
            entry = json.loads(line)
            images = [torch.from_numpy(np.asarray(Image.open(Path(pairs).parent / p), dtype=np.float32)).permute(
                2, 0, 1) / 127.5 - 1 for p in entry["images"]]
            means = [float(x.mean()) for x in images]
            bright.append(images[int(np.argmax(means))])
            dark.append(images[int(np.argmin(means))])
            prompts.append(entry["prompt"])
        with torch.no_grad():
            embeds = pipe.encode_prompt(prompts, "cpu", 1, False)[0]

            def latents(images):
                return pipe.vae.encode(torch.stack(images)).latent_dist.mean * pipe.vae.config.scaling_factor

            def error(x0):  # ε-prediction MSE per image, averaged over t = 100, 300, ..., 900 with fixed noise
                total_error = 0.0
                for step in range(100, 1000, 200):
                    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(step))
                    a = pipe.scheduler.alphas_cumprod[step]
                    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
                    pred = unet(x_t, torch.full((len(x0),), step), encoder_hidden_states=embeds).sample
                    total_error = total_error + (pred - noise).pow(2).flatten(1).mean(1)
                return total_error / 5

            x_bright, x_dark = latents(bright), latents(dark)
            after = error(x_bright), error(x_dark)
            with adapter_disabled(unet):
                before = error(x_bright), error(x_dark)
        shift["value"] = float((after[1] - before[1]).mean() - (after[0] - before[0]).mean())

    get_trainer(trainer).train(cfg, tmp_path / f"run{sign}", step_callback=record)
    return shift["value"]


@pytest.mark.parametrize("trainer", registered_trainers())
def test_training_moves_in_the_direction_of_its_reward(tmp_path, trainer):
    module = get_trainer(trainer)
    if trainer in offline_trainers():  # no rollouts, no reward in training: the labels of its pairs say the way
        up, down = _preference_shift(tmp_path, trainer, 1.0), _preference_shift(tmp_path, trainer, -1.0)
        # measured over seeds 0-3 (a throwaway loop): up 1.1e-4 to 5.0e-4, down −6.3e-5 to −4.2e-4; labels swapped
        # in the loader (the rejected image trained as the preferred) swap the signs
        assert up > 3e-5 and down < -3e-5, (up, down)
        return
    if hasattr(module, "select_kept"):  # fine-tuning on its best samples (RAFT): it fits them better than the rest
        up, down = _fit_shift(tmp_path, trainer, 1.0), _fit_shift(tmp_path, trainer, -1.0)
        # the runs share seeds and the drift of a fresh LoRA (both shifts lean the same way), which cancels in the
        # difference; measured +0.4e-4 (r) vs −3.2e-4 (−r) with the guided fit (+1.8e-4 vs +0.9e-4 when it fitted
        # the conditional prediction); a selection that kept the worst samples swaps them
        assert up - down > 5e-5, (up, down)
        return
    if hasattr(module, "matching_log_prob"):  # advantage-weighted flow matching on its own samples (AWM)
        from test_awm import _fit_shift as awm_fit_shift

        # with r it fits its brighter samples better than its darker ones (relative to the pre-trained model), with
        # −r the other way round; measured +3.2e-4 and −3.5e-4 after the first optimizer step (ghuber weighting);
        # an advantage with its sign flipped where the loss is called swaps them
        up, down = awm_fit_shift(tmp_path, 1.0), awm_fit_shift(tmp_path, -1.0)
        assert up > 0 > down and up - down > 1e-4, (up, down)
        return
    if hasattr(module, "optimality_probability"):  # likelihood-free on its own samples (DiffusionNFT)
        from test_diffusion_nft import _fit_shift as nft_fit_shift

        # with r it fits its brighter samples better than its darker ones (relative to the pre-trained model), with
        # −r the other way round (r ↔ 1 − r swaps the positive and negative policies); measured +3.0e-4 and
        # −3.2e-4 after the first optimizer step; a loss with the split reversed gives the opposite signs
        up, down = nft_fit_shift(tmp_path, 1.0), nft_fit_shift(tmp_path, -1.0)
        assert up > 0 > down and up - down > 1e-4, (up, down)
        return
    if hasattr(module, "pair_choices"):  # preference pairs (D3PO): the likelihood of each pair's preferred sample
        up = _likelihood_shift(tmp_path, trainer, 1.0, pairs=True)
        down = _likelihood_shift(tmp_path, trainer, -1.0, pairs=True)
        # measured +0.047 (r) and -0.047 (-r) for D3PO (4 pairs, first of 2 steps, lr 1e-3)
        assert up > 1e-3 and down < -1e-3, (up, down)
        return
    if hasattr(module, "reward_difference_pairs"):  # pairs of one prompt's chains regress their reward difference
        # (PRDP, with 2 chains per prompt): the likelihood of each pair's higher-reward chain rises against the other's
        up = _likelihood_shift(tmp_path, trainer, 1.0, pairs=True)
        down = _likelihood_shift(tmp_path, trainer, -1.0, pairs=True)
        # measured +0.052 (r) and −0.054 (−r) for PRDP (4 pairs, β 1e-3, one step at lr 1e-3)
        assert up > 1e-3 and down < -1e-3, (up, down)
        return
    if module.ADVANTAGE_DEFAULTS is not None:  # a policy gradient: the likelihood of its better samples
        up, down = _likelihood_shift(tmp_path, trainer, 1.0), _likelihood_shift(tmp_path, trainer, -1.0)
        # measured over seeds 0-3 (printed by a throwaway loop); rounding of the recomputed log-probs is ~1e-6
        assert up > 1e-3 and down < -1e-3, (up, down)
        return
    from diffrl.training.metrics import read_metrics

    gold = {}
    for sign in (1.0, -1.0):
        recipe = _direction_recipe(tmp_path, trainer, sign, run={"num_epochs": 3, "eval_every": 100},
                                   sample={"eval_num_images": 8})
        module.train(load_cfg(recipe), tmp_path / f"run{sign}")
        records = read_metrics(tmp_path / f"run{sign}")
        gold[sign] = records[-1]["eval_gold_mean"] - records[0]["eval_gold_mean"]
    # both runs start from the same weights and draw the same seeds, so the drift every run shares (a fresh LoRA's
    # first steps move brightness either way) cancels in the difference; measured: DRaFT +0.0016 vs −0.0022,
    # RAFT −0.0001 vs −0.0016 (K = 4), from 0.4426 after 3 epochs; eval images have fixed seeds
    print(trainer, gold)
    assert gold[1.0] - gold[-1.0] > 3e-4, gold
