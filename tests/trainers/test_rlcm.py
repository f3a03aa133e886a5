"""RLCM = DDPO over the LCM sampler: its recipes validate with the reference code's settings, and one DDPO step over a
tiny random LCM pipeline changes the weights, with the rollout's log-probs equal to a recomputation under the starting
weights by a fresh sampler."""

from pathlib import Path

import pytest
import torch
from pg_helpers import load_cfg, tiny_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "rlcm"


def _tiny_lcm_dir(root: Path) -> Path:
    path = root / "tiny-lcm"
    if not (path / "model_index.json").is_file():
        from samplers.testing import tiny_lcm_pipeline

        tiny_lcm_pipeline(path)
    return path


@pytest.mark.parametrize("name", ["tiny_shapes_lcm_verifier", "lcm_dreamshaper_aesthetic"])
def test_rlcm_recipes_validate_as_ddpo_over_the_lcm_sampler(name, tmp_path):
    from diffrl.config import derived_numbers, load_recipe
    from diffrl.config_references import check_references
    from diffrl.embedded import is_embedded

    cfg = load_recipe(f"rlcm/{name}")
    # the published-settings recipe samples at the reference's timesteps (lcm_rlcm), the tiny one at diffusers'
    expected = "lcm_rlcm" if name == "lcm_dreamshaper_aesthetic" else "lcm"
    assert cfg.trainer == "ddpo" and cfg.sample.sampler == expected and cfg.sample.eta == 1.0
    if is_embedded(cfg.model.pipeline):
        cfg.model.pipeline = str(_tiny_lcm_dir(tmp_path))
    check_references(cfg)
    assert derived_numbers(cfg, 1)["optimizer_steps_per_epoch"] >= 1


def test_the_dreamshaper_recipe_has_the_reference_settings():
    from diffrl.config import derived_numbers, load_recipe

    cfg = load_recipe("rlcm/lcm_dreamshaper_aesthetic")  # Owen-Oertell/rlcm conf/config.yaml + conf/task/aesthetic.yaml
    s, o, a, t = cfg.sample, cfg.optim, cfg.advantage, cfg.train
    assert cfg.model.pipeline == "SimianLuo/LCM_Dreamshaper_v7" and cfg.model.mixed_precision == "fp16"
    assert (s.num_steps, s.guidance_scale, s.batch_size) == (8, 8.0, 8)
    assert (o.learning_rate, o.weight_decay, o.max_grad_norm) == (1e-4, 0.0, 5.0)
    assert (t.batch_size, o.gradient_accumulation_steps, t.num_inner_epochs, t.clip_range) == (2, 4, 1, 1e-4)
    assert (a.mode, a.clip_max, a.stat_buffer_size, a.stat_min_count) == ("per_prompt", 10.0, 32, 16)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (8, 8.0)
    assert cfg.model.lora.target_modules == ["to_k", "to_q", "to_v", "to_out.0"]
    assert derived_numbers(cfg, 1)["optimizer_steps_per_epoch"] == 1  # 8 samples / (2 × 4): one step per batch
    assert cfg.run.num_epochs == 100 * 10  # 100 epochs of 10 sampling batches


def test_one_ddpo_step_over_the_lcm_sampler(tmp_path, monkeypatch):
    from diffusers import LatentConsistencyModelPipeline

    from diffrl.trainers import ddpo
    from diffrl.training import context
    from diffrl.training.metrics import read_metrics
    from samplers.lcm import LCMSampler

    recipe = tiny_recipe(_tiny_lcm_dir(tmp_path), tmp_path,
                         run={"num_epochs": 1, "save_every": 0},
                         sample={"sampler": "lcm", "num_steps": 3, "guidance_scale": 3.0, "batch_size": 2,
                                 "num_batches_per_epoch": 2},
                         log={"tracker": "none", "image_every": 0},
                         train={"batch_size": 4, "clip_range": 0.2})
    captured, weights = [], {}
    original = context.collect_rollouts

    def capture(**kwargs):
        out = original(**kwargs)
        captured.append(out.traj)
        return out

    def record(info):
        weights[info["global_step"]] = {n: p.detach().clone() for n, p in info["unet"].named_parameters()
                                        if p.requires_grad}

    monkeypatch.setattr(context, "collect_rollouts", capture)
    ddpo.train(load_cfg(recipe), tmp_path / "run", step_callback=record)

    assert sorted(weights) == [0, 1]  # 4 samples in one micro-batch of 4: one optimizer step
    unchanged = [n for n in weights[0] if torch.equal(weights[0][n], weights[1][n])]
    assert not unchanged, unchanged[:5]
    [traj] = captured
    assert traj.sampler == "lcm" and traj.log_probs.shape == (4, 3)
    assert torch.all(traj.log_probs[:, -1] == 0)  # the last LCM step returns x̂0: deterministic, log-prob 0
    assert torch.all(traj.log_probs[:, :-1] != 0)
    # the starting weights are the pre-trained pipeline (a fresh LoRA is the identity): recompute every step there
    pipe = LatentConsistencyModelPipeline.from_pretrained(_tiny_lcm_dir(tmp_path))
    sampler = LCMSampler()
    with torch.no_grad():
        recomputed = torch.stack([sampler.log_prob(pipe, traj, j) for j in range(3)], dim=1)
    assert torch.allclose(recomputed, traj.log_probs, atol=1e-5, rtol=0)
    [record] = read_metrics(tmp_path / "run")
    assert record["logprob_max_diff"] <= 1e-5 and record["ratio_first_step"] == pytest.approx(1.0, abs=1e-5)
