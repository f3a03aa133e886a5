"""End-to-end runs of DDPO and DPOK on the tiny random pipeline: what changes, what the run dir holds, the guards."""

import json
import math
import warnings

import pytest
import torch
from pg_helpers import (
    StepLog,
    load_cfg,
    offline_trainers,
    registered_trainers,
    tiny_pipeline_dir,
    tiny_recipe,
    trainers_with_train_field,
    with_trainer,
)


def _recipe(tmp_path, trainer="ddpo", **groups):
    base = {
        "run": {"num_epochs": 1, "save_every": 0},
        "sample": {"num_steps": 2, "batch_size": 2, "num_batches_per_epoch": 2},
        "log": {"tracker": "none", "image_every": 0},
    }
    base = with_trainer({**base, "optim": {"weight_decay": 0.0}}, trainer)
    for group, values in groups.items():
        base[group] = {**base.get(group, {}), **values} if isinstance(values, dict) else values
    return tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **base)


def _train(trainer, recipe, run_dir, **kwargs):
    import importlib

    return importlib.import_module(f"diffrl.trainers.{trainer}").train(load_cfg(recipe), run_dir, **kwargs)


class Snapshots:
    """step_callback that keeps a copy of every parameter (trainable and frozen) at each call."""

    def __init__(self):
        self.by_step = {}

    def __call__(self, info):
        self.by_step[info["global_step"]] = {
            n: (p.detach().clone(), p.requires_grad) for n, p in info["unet"].named_parameters()
        }


@pytest.mark.parametrize("trainer", registered_trainers())
def test_every_trainable_parameter_changes_after_two_steps_and_frozen_ones_do_not(tmp_path, trainer):
    snaps = Snapshots()
    _train(trainer, _recipe(tmp_path, trainer), tmp_path / "run", step_callback=snaps)
    assert sorted(snaps.by_step) == [0, 1, 2]
    before, after = snaps.by_step[0], snaps.by_step[2]
    trainable = [n for n, (_, grad) in before.items() if grad]
    frozen = [n for n, (_, grad) in before.items() if not grad]
    assert trainable and all("lora" in n for n in trainable)
    assert len(frozen) > len(trainable)
    unchanged = [n for n in trainable if torch.equal(before[n][0], after[n][0])]
    assert not unchanged, f"trainable parameters that did not change: {unchanged[:5]}"
    moved = [n for n in frozen if not torch.equal(before[n][0], after[n][0])]
    assert not moved, f"frozen parameters that changed: {moved[:5]}"


@pytest.mark.parametrize("trainer", registered_trainers())
def test_bf16_mixed_precision_trains_fp32_adapters_over_bf16_frozen_weights(tmp_path, trainer):
    # model.mixed_precision=bf16 (accelerate's autocast runs on the CPU too): the frozen UNet is bf16, the trainable
    # LoRA weights and their AdamW state stay fp32 and change; the run's losses and rewards stay finite
    from accelerate.state import AcceleratorState

    from diffrl.training.metrics import read_metrics

    # accelerate keeps one process-wide state and refuses a second mixed-precision setting in the same process (an
    # earlier test's fp32 run): start from a fresh state, and leave one behind for the tests that follow
    AcceleratorState._reset_state(reset_partial_state=True)
    snaps = Snapshots()
    try:
        _train(trainer, _recipe(tmp_path, trainer, model={"mixed_precision": "bf16"}), tmp_path / "run",
               step_callback=snaps)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    before, after = snaps.by_step[0], snaps.by_step[max(snaps.by_step)]
    trainable = [n for n, (_, grad) in before.items() if grad]
    frozen = [n for n, (p, grad) in before.items() if not grad and p.is_floating_point()]
    assert trainable and all(before[n][0].dtype == torch.float32 for n in trainable)
    assert frozen and all(before[n][0].dtype == torch.bfloat16 for n in frozen)
    assert all(not torch.equal(before[n][0], after[n][0]) for n in trainable)
    record = read_metrics(tmp_path / "run")[-1]
    sampled = trainer not in offline_trainers()  # an offline trainer has no training rewards (reward_mean null)
    assert all(math.isfinite(record[k]) for k in (("reward_mean", "loss") if sampled else ("loss",)))


@pytest.mark.parametrize("trainer", ["ddpo", "draft", "raft"])  # DPOK, D3PO, Diffusion-DPO need the LoRA-off reference
def test_full_finetune_trains_every_unet_weight_and_exports_a_unet(tmp_path, trainer):
    from diffusers import UNet2DConditionModel

    from diffrl.rundir import latest_checkpoint

    snaps = Snapshots()
    recipe = _recipe(tmp_path, trainer, model={"full_finetune": True}, run={"save_every": 1},
                     optim={"learning_rate": 1e-4, "weight_decay": 0.0})
    _train(trainer, recipe, tmp_path / "run", step_callback=snaps)
    before, after = snaps.by_step[0], snaps.by_step[max(snaps.by_step)]
    assert all(grad for _, grad in before.values())
    unchanged = [n for n in before if torch.equal(before[n][0], after[n][0])]
    assert not unchanged, unchanged[:5]
    unet = UNet2DConditionModel.from_pretrained(latest_checkpoint(tmp_path / "run") / "unet")
    loaded = dict(unet.named_parameters())
    assert all(torch.equal(loaded[n], after[n][0]) for n in after)


@pytest.mark.parametrize("trainer", registered_trainers())
def test_run_dir_metrics_images_curve_and_lora_loads_in_plain_diffusers(tmp_path, trainer):
    from diffusers import DiffusionPipeline
    from pg_helpers import PROMPTS

    from diffrl.config import load_run_config
    from diffrl.models import model_family
    from diffrl.trainers import get_trainer
    from diffrl.training.evaluation import EVAL_SEED
    from diffrl.training.metrics import read_metrics
    from diffrl.training.weights import DEFAULT_LORA_TARGETS, load_trainable, setup_trainable

    policy_gradient = get_trainer(trainer).ADVANTAGE_DEFAULTS is not None
    # a PPO-clipped ratio of recomputed to rollout log-probs (DiffusionNFT is likelihood-free: no log-probs to check)
    ratio = trainer in trainers_with_train_field("clip_range")
    recipe = _recipe(tmp_path, trainer, run={"num_epochs": 2, "save_every": 1, "eval_every": 1},
                     reward={"name": "pg_helpers:smooth_brightness", "gold": "pg_helpers:redness"},
                     sample={"eval_num_images": 3}, log={"image_every": 1, "grid_images": 3})
    run_dir = tmp_path / "run"
    final = _train(trainer, recipe, run_dir)

    assert load_run_config(run_dir).trainer == trainer
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [0, 1, 2] and records[-1]["final"]
    for r in records[:2]:
        for key in ("epoch", "samples_seen", "reward_mean", "reward_std", "loss", "kl", "wall_s", "rollout_s",
                    "reward_s", "train_s", "nan_rewards", "eval_reward_mean", "eval_gold_mean"):
            assert key in r, key
        if policy_gradient:
            for key in ("nan_losses", "reward/brightness"):
                assert key in r, key
        if policy_gradient and ratio:  # the invariant: before the epoch's first update, recomputed log-probs equal
            for key in ("approx_kl", "clipfrac", "ratio_first_step", "logprob_max_diff"):  # the rollout's
                assert key in r, key
            assert r["logprob_max_diff"] <= 1e-5
            assert r["ratio_first_step"] == pytest.approx(1.0, abs=1e-5)
    assert [r["samples_seen"] for r in records] == [4, 8, 8]  # 2 per batch × 2 batches × 1 process per epoch
    assert final["eval_gold_mean"] == records[-1]["eval_gold_mean"]
    for name in ("epoch-0.png", "epoch-1.png", "eval-epoch-0.png", "eval-final.png"):
        assert (run_dir / "images" / name).is_file(), name
    assert (run_dir / "reward_curve.png").is_file()

    ckpt = run_dir / "checkpoints" / "step-4"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["epoch"] == 1 and state["global_step"] == 4 and state["samples_seen"] == 8

    # the exported LoRA loads in plain diffusers and gives the trained network exactly (the recipe's pipeline: the
    # tiny SD one, or the tiny SD3 one for a flow trainer, and its LoRA targets)
    pipe_dir, lora = recipe["model"]["pipeline"], recipe["model"]["lora"]
    plain = DiffusionPipeline.from_pretrained(pipe_dir)
    plain.load_lora_weights(ckpt)
    ours = DiffusionPipeline.from_pretrained(pipe_dir)
    setup_trainable(model_family(ours).denoiser, use_lora=True, lora_rank=lora["rank"], lora_alpha=lora["alpha"],
                    lora_target_modules=lora.get("target_modules", DEFAULT_LORA_TARGETS))
    load_trainable(model_family(ours).denoiser, ckpt)
    base = DiffusionPipeline.from_pretrained(pipe_dir)
    flow = getattr(plain, "transformer", None) is not None
    x, text = torch.randn(2, 4, 8, 8), torch.randn(2, 12, 32) if flow else torch.randn(2, 7, 32)
    pooled = torch.randn(2, 32)  # SD3's pooled projections

    def forward(p):
        if flow:
            return p.transformer(hidden_states=x, timestep=torch.tensor([800.0, 100.0]), encoder_hidden_states=text,
                                 pooled_projections=pooled, return_dict=False)[0]
        return p.unet(x, torch.tensor([500, 20]), text).sample

    with torch.no_grad():
        out_plain, out_ours, out_base = (forward(p) for p in (plain, ours, base))
    assert torch.allclose(out_plain, out_ours, atol=1e-6)
    assert (out_plain - out_base).abs().max() > 1e-4

    # The held-out numbers, recomputed without the trainer: eval image i is prompt i % 4 drawn with seed EVAL_SEED + i
    # (2 steps at the recipe's η and guidance), here by plain diffusers with a generator per image (the sampler draws
    # its noise as diffusers does; DDIM at any η, a flow pipeline's Euler sampler at η = 0), with the weights of each
    # evaluation: the base at epoch 0, then the checkpoints. The flow SDE (η > 0) has no diffusers sampler: the
    # samplers' own `FlowSampler` draws it, from the same per-image seeds.
    # Gold = redness = mean red − mean of green and blue; reward = brightness = mean pixel; std over the 3 images.
    eta, guidance_scale = recipe["sample"]["eta"], recipe["sample"]["guidance_scale"]

    def eval_images(pipe):
        pipe.set_progress_bar_config(disable=True)
        prompts, seeds = [PROMPTS[i % len(PROMPTS)] for i in range(3)], [EVAL_SEED + i for i in range(3)]
        if flow and eta > 0:
            from samplers.flow import FlowSampler

            return FlowSampler().sample(pipe, prompts, num_steps=2, guidance_scale=guidance_scale, eta=eta,
                                        seeds=seeds).images
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        return pipe(prompts, num_inference_steps=2, guidance_scale=guidance_scale, generator=generators,
                    output_type="pt", **({} if flow else {"eta": eta})).images

    after_epoch_0 = DiffusionPipeline.from_pretrained(pipe_dir)
    after_epoch_0.load_lora_weights(run_dir / "checkpoints" / "step-2")
    # eval_scores.jsonl: every evaluation's per-image gold scores, in image order (for paired before/after gains)
    per_image = [json.loads(line) for line in (run_dir / "eval_scores.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["final"]) for e in per_image] == [(0, False), (1, False), (2, True)]
    for record, pipe, logged in zip(records, (base, after_epoch_0, plain), per_image):
        images = eval_images(pipe)  # [3, 3, 16, 16] in [0, 1]
        redness = images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))
        brightness = images.mean(dim=(1, 2, 3))
        assert record["eval_gold_mean"] == pytest.approx(redness.mean().item(), abs=1e-5), record["epoch"]
        assert logged["scores"] == pytest.approx(redness.tolist(), abs=1e-5), record["epoch"]
        assert record["eval_gold_std"] == pytest.approx(redness.std(correction=0).item(), abs=1e-5)
        assert record["eval_reward_mean"] == pytest.approx(brightness.mean().item(), abs=1e-5)
        # with a gold reward the trained-on reward's per-image scores are logged beside it (its paired se)
        assert logged["proxy_scores"] == pytest.approx(brightness.tolist(), abs=1e-5), record["epoch"]


def test_group_relative_advantages_run(tmp_path):
    log = StepLog()
    recipe = _recipe(tmp_path, advantage={"mode": "group", "group_size": 2})
    _train("ddpo", recipe, tmp_path / "run", step_callback=log)
    assert [s for s, _ in log.steps] == [0, 1, 2]


def test_ema_weights_are_exported_and_raw_weights_resume(tmp_path):
    from safetensors.torch import load_file

    recipe = _recipe(tmp_path, run={"save_every": 1}, optim={"use_ema": True, "ema_decay": 0.5})
    _train("ddpo", recipe, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    assert (ckpt / "ema.safetensors").is_file()
    raw = load_file(str(ckpt / "trainable.safetensors"))
    exported = load_file(str(ckpt / "pytorch_lora_weights.safetensors"))
    # same number of LoRA tensors, but the exported (EMA) ones differ from the raw training weights
    assert len(raw) == len(exported)
    raw_b = sorted((k, v) for k, v in raw.items() if "lora_B" in k)
    exp_b = sorted((k, v) for k, v in exported.items() if "lora_B" in k or "lora.up" in k)
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(raw_b, exp_b))


def test_nan_rewards_are_dropped_and_counted(tmp_path):
    from diffrl.training.metrics import read_metrics

    recipe = _recipe(tmp_path, reward={"name": "pg_helpers:nan_for_dog"}, run={"num_epochs": 2},
                     sample={"batch_size": 4, "num_batches_per_epoch": 1}, train={"batch_size": 2})
    _train("ddpo", recipe, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert sum(r["nan_rewards"] for r in records) > 0  # "a green dog" is 1 of 4 prompts, 8 draws
    assert all(r["reward_mean"] == r["reward_mean"] for r in records)  # finite: NaNs left out
    assert all(r["nan_losses"] == 0 for r in records)


def test_all_nan_rewards_stop_with_a_last_good_checkpoint(tmp_path):
    from diffrl.training.guards import TrainingStopped

    recipe = _recipe(tmp_path, reward={"name": "pg_helpers:all_nan"})
    with pytest.raises(TrainingStopped, match="rewards of the epoch are NaN") as err:
        _train("ddpo", recipe, tmp_path / "run")
    assert "last good checkpoint" in str(err.value)
    assert (tmp_path / "run" / "checkpoints" / "step-0" / "trainable.safetensors").is_file()


def test_repeated_nan_losses_stop_the_run_without_touching_the_weights(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from diffrl.trainers import ddpo
    from diffrl.training.guards import TrainingStopped

    def nan_loss(log_probs, old_log_probs, advantages, clip_range):
        return log_probs.sum() * float("nan"), {}

    monkeypatch.setattr(ddpo, "ddpo_loss", nan_loss)
    snaps = Snapshots()
    recipe = _recipe(tmp_path, run={"max_nan_steps": 2})
    with pytest.raises(TrainingStopped, match="2 optimizer steps in a row"):
        _train("ddpo", recipe, tmp_path / "run", step_callback=snaps)
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-0" / "trainable.safetensors"))
    start = snaps.by_step[0]
    assert saved and all(torch.equal(saved[n], start[n][0]) for n in saved)


def test_unwritable_run_dir_fails_before_loading_anything(tmp_path, monkeypatch):
    from diffrl.errors import UserError
    from diffrl.training import setup

    def must_not_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the run dir was checked")

    monkeypatch.setattr(setup, "load_policy_pipeline", must_not_load)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError, match="not writable"):
        _train("ddpo", _recipe(tmp_path), blocker / "run")


def test_logprob_mismatch_warns(tmp_path, monkeypatch):
    from diffrl.training import context as rollout_module  # the run context calls collect_rollouts
    from diffrl.training.metrics import read_metrics

    original = rollout_module.collect_rollouts

    def shifted(**kwargs):
        out = original(**kwargs)
        out.traj.log_probs = out.traj.log_probs + 1e-3  # as if sampling and training disagreed
        return out

    monkeypatch.setattr(rollout_module, "collect_rollouts", shifted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train("ddpo", _recipe(tmp_path), tmp_path / "run")
    assert any("recomputed log-probs differ" in str(w.message) for w in caught)
    assert read_metrics(tmp_path / "run")[0]["logprob_max_diff"] == pytest.approx(1e-3, rel=1e-3)


def test_dpok_refuses_full_finetuning(tmp_path):
    from diffrl.errors import UserError

    with pytest.raises(UserError, match="LoRA adapter"):
        _train("dpok", _recipe(tmp_path, "dpok", model={"full_finetune": True}), tmp_path / "run")


def test_weighted_reward_components_are_logged(tmp_path):
    from diffrl.training.metrics import read_metrics

    reward = {"name": "", "components": [{"name": "pg_helpers:brightness", "weight": 1.0},
                                         {"name": "pg_helpers:redness", "weight": 0.5}]}
    _train("ddpo", _recipe(tmp_path, reward=reward), tmp_path / "run")
    record = read_metrics(tmp_path / "run")[0]
    # the epoch mean of a weighted sum is the weighted sum of the component means
    expected = record["reward/brightness"] + 0.5 * record["reward/redness"]
    assert record["reward_mean"] == pytest.approx(expected, abs=1e-6)


def test_gradient_checkpointing_gives_the_same_updates(tmp_path):
    plain, checkpointed = Snapshots(), Snapshots()
    _train("ddpo", _recipe(tmp_path), tmp_path / "plain", step_callback=plain)
    _train("ddpo", _recipe(tmp_path, model={"gradient_checkpointing": True}), tmp_path / "ckpt",
           step_callback=checkpointed)
    a, b = plain.by_step[2], checkpointed.by_step[2]
    assert all(torch.allclose(a[n][0], b[n][0], atol=1e-6) for n in a if a[n][1])


def test_tensorboard_tracker_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    _train("ddpo", _recipe(tmp_path, log={"tracker": "tensorboard"}), tmp_path / "run")
    assert list((tmp_path / "run").rglob("events.out.tfevents.*"))


def test_shared_start_noise_gives_each_group_one_x_T_and_different_chains(tmp_path, monkeypatch):
    # DanceGRPO-style groups: the k samples of a prompt start from the same x_T, so their rewards differ only by
    # the step noise (the policy's actions); different groups start from different x_T.
    from diffrl.training import context as rollout_module  # the run context calls collect_rollouts

    original, captured = rollout_module.collect_rollouts, []

    def capture(**kwargs):
        out = original(**kwargs)
        captured.append(out.traj)
        return out

    monkeypatch.setattr(rollout_module, "collect_rollouts", capture)
    recipe = _recipe(tmp_path, sample={"batch_size": 4, "num_batches_per_epoch": 1},
                     advantage={"group_size": 2, "mode": "group", "shared_start_noise": True})
    _train("ddpo", recipe, tmp_path / "run")
    latents = captured[0].latents  # [4, T+1, C, h, w]; groups are samples (0, 1) and (2, 3)
    x_T, final = latents[:, 0], latents[:, -1]
    assert torch.equal(x_T[0], x_T[1]) and torch.equal(x_T[2], x_T[3])
    assert not torch.allclose(x_T[0], x_T[2])
    assert (final[0] - final[1]).abs().max() > 1e-3 and (final[2] - final[3]).abs().max() > 1e-3


def test_shared_start_noise_needs_groups(tmp_path):
    from diffrl.errors import UserError

    with pytest.raises(UserError, match="group_size >= 2"):
        _train("ddpo", _recipe(tmp_path, advantage={"shared_start_noise": True}), tmp_path / "run")


def test_evaluation_export_and_resume_use_the_ema_weights(tmp_path, monkeypatch):
    """With EMA on, evaluation scores the EMA weights (and leaves the raw ones in place), the exported LoRA is the
    EMA, and resuming restores both the raw weights and the EMA so the run ends where an uninterrupted one does."""
    from safetensors.torch import load_file

    from diffrl.training import loop

    seen, original = [], loop.evaluate

    def recording(**kwargs):
        unet = kwargs["pipe"].unet
        seen.append({n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad})
        return original(**kwargs)

    monkeypatch.setattr(loop, "evaluate", recording)
    recipe = _recipe(tmp_path, run={"num_epochs": 2, "save_every": 1, "eval_every": 1},
                     optim={"use_ema": True, "ema_decay": 0.5}, sample={"eval_num_images": 2})
    _train("ddpo", recipe, tmp_path / "straight")
    final = tmp_path / "straight" / "checkpoints" / "step-4"
    raw, ema = load_file(str(final / "trainable.safetensors")), load_file(str(final / "ema.safetensors"))
    order = sorted(raw)  # EMA shadows are stored by position, in the order of the trainable parameters
    at_final_eval = seen[-1]
    # the final evaluation saw the EMA (shadow i = the i-th trainable parameter), not the raw weights
    names = list(at_final_eval)
    assert all(torch.equal(at_final_eval[n], ema[str(i)]) for i, n in enumerate(names))
    assert any(not torch.equal(at_final_eval[n], raw[n]) for n in order)
    # the exported LoRA (what users load) is the EMA: the same multiset of tensors
    exported = load_file(str(final / "pytorch_lora_weights.safetensors"))
    key = lambda t: (tuple(t.shape), round(float(t.double().sum()), 6))
    assert sorted(map(key, exported.values())) == sorted(key(ema[str(i)]) for i in range(len(names)))

    # resume from the first checkpoint into a new run dir: raw weights and EMA end as the uninterrupted run's
    monkeypatch.setattr(loop, "evaluate", original)
    resumed_recipe = _recipe(tmp_path, run={"num_epochs": 2, "save_every": 1, "eval_every": 1,
                                            "resume": str(tmp_path / "straight" / "checkpoints" / "step-2")},
                             optim={"use_ema": True, "ema_decay": 0.5}, sample={"eval_num_images": 2})
    _train("ddpo", resumed_recipe, tmp_path / "resumed")
    again = tmp_path / "resumed" / "checkpoints" / "step-4"
    for file in ("trainable.safetensors", "ema.safetensors"):
        a, b = load_file(str(final / file)), load_file(str(again / file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file


@pytest.mark.parametrize("trainer", ["ddpo", "draft"])
def test_max_train_minutes_ends_the_run_checkpointed_and_evaluated_and_resume_does_not_train_further(tmp_path,
                                                                                                        trainer):
    # a budget any epoch exceeds: the run stops after epoch 0 of 5, with epoch 0's checkpoint and a final evaluation
    # labelled epoch 1; resuming the finished run changes nothing
    from diffrl.rundir import latest_checkpoint
    from diffrl.training.metrics import read_metrics

    recipe = _recipe(tmp_path, trainer, run={"num_epochs": 5, "save_every": 3, "eval_every": 1,
                                            "max_train_minutes": 1e-6})
    run_dir = tmp_path / "t"
    _train(trainer, recipe, run_dir)
    records = read_metrics(run_dir)
    assert [(r["epoch"], bool(r.get("final"))) for r in records] == [(0, False), (1, True)]
    assert records[-1]["eval_reward_mean"] is not None
    steps = records[0]["global_step"]
    assert steps > 0 and latest_checkpoint(run_dir).name == f"step-{steps}"
    _train(trainer, {**recipe, "run": {**recipe["run"], "resume": "latest"}}, run_dir)
    assert latest_checkpoint(run_dir).name == f"step-{steps}"
    assert [r["epoch"] for r in read_metrics(run_dir) if not r.get("final")] == [0]


@pytest.mark.parametrize("minutes, evaluated", [(1e-9, [0, 1, 2, 3]), (1e3, [0, 3])])
def test_eval_every_minutes_evaluates_by_the_training_clock(tmp_path, minutes, evaluated):
    # every epoch takes longer than 1e-9 minutes, so each starts a new period and is evaluated; 1000 minutes never
    # pass: only epoch 0 (the pre-trained model) and the final evaluation (labelled 3 after epochs 0-2)
    from diffrl.training.metrics import read_metrics

    recipe = _recipe(tmp_path, run={"num_epochs": 3, "eval_every": 0, "eval_every_minutes": minutes})
    _train("ddpo", recipe, tmp_path / "t")
    assert [r["epoch"] for r in read_metrics(tmp_path / "t") if r.get("eval_reward_mean") is not None] == evaluated
