"""The training machinery between the pure losses and a whole run, each checked against numbers worked out by hand
or against an independent computation: advantages of an epoch (NaN rewards, clipping), the optimizer step (mean,
clip, skip), gradient accumulation, trained timesteps and inner epochs, DPOK's adapter-off reference."""

import math

import numpy as np
import pytest
import torch
from pg_helpers import load_cfg, route, tiny_pipeline_dir, tiny_recipe, trainers_with_train_field, with_trainer

from diffrl.training.advantages import PerPromptStatTracker
from diffrl.training.rollout import Rollout, compute_advantages

NAN = float("nan")

# ------------------------------------------------------------------------------------------------ advantages


def _rollout(rewards, prompts, groups) -> Rollout:
    return Rollout(traj=None, images=torch.empty(0), rewards=torch.tensor(rewards, dtype=torch.float64),
                   all_rewards=np.array(rewards, dtype=np.float64), all_prompts=list(prompts),
                   all_groups=np.array(groups))


# rewards [1, NaN, 3, 10]: the NaN sample is left out of every statistic and gets advantage 0.
# Finite rewards [1, 3, 10]: mean 14/3, std sqrt(((1-14/3)² + (3-14/3)² + (10-14/3)²)/3) = 3.8586123.
BATCH_STD = 3.8586123


@pytest.mark.parametrize("mode, clip, expected", [
    # (r - 14/3) / 3.8586123 = [-0.9502553, -0.4319342, 1.3821895]; clipping at 1 caps the last one
    ("batch", 1.0, [-0.9502553, 0.0, -0.4319342, 1.0]),
    ("batch", 0.0, [-0.9502553, 0.0, -0.4319342, 1.3821895]),
    # groups [0, 0, 1, 1]: group 0 keeps only r = 1 -> centred 0; group 1 [3, 10]: mean 6.5, std 3.5 -> -1, +1
    ("group", 5.0, [0.0, 0.0, -1.0, 1.0]),
    # raw rewards, clipped at 5
    ("none", 5.0, [1.0, 0.0, 3.0, 5.0]),
])
def test_epoch_advantages_drop_nan_rewards_and_clip(mode, clip, expected):
    rollout = _rollout([1.0, NAN, 3.0, 10.0], ["a", "a", "a", "b"], [0, 0, 1, 1])
    adv = compute_advantages(rollout, mode=mode, stat_tracker=None, group_std="group", adv_clip_max=clip)
    assert np.allclose(adv, expected, atol=1e-6)


def test_epoch_advantages_per_prompt_keep_nan_out_of_the_buffers():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=2)
    rollout = _rollout([1.0, NAN, 3.0, 10.0], ["a", "a", "a", "b"], [0, 1, 2, 3])
    adv = compute_advantages(rollout, mode="per_prompt", stat_tracker=tracker, group_std="group", adv_clip_max=5.0)
    # "a": buffer [1, 3] (the NaN never enters it) -> mean 2, std 1 -> -1, +1; "b": 1 reward < min_count 2 ->
    # the batch statistics of the finite rewards: (10 - 14/3) / 3.8586123 = 1.3821895
    assert np.allclose(adv, [-1.0, 0.0, 1.0, 1.3821895], atol=1e-6)
    assert list(tracker.buffers["a"]) == [1.0, 3.0] and list(tracker.buffers["b"]) == [10.0]


# ------------------------------------------------------------------------------------------------ optimizer step


class _Schedule:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def _state(param, lr=1.0):
    from diffrl.training.state import TrainState

    return TrainState(trainer="t", unet=None, optimizer=torch.optim.SGD([param], lr=lr), lr_scheduler=_Schedule(),
                      rng=np.random.default_rng(0), use_lora=True)


def test_optimizer_step_clips_the_global_norm_and_skips_non_finite_steps():
    from accelerate import Accelerator

    from diffrl.training.guards import NanStepGuard
    from diffrl.training.loop import optimizer_step

    accelerator = Accelerator()
    param = torch.nn.Parameter(torch.zeros(2))
    state, guard = _state(param), NanStepGuard(limit=2)

    # gradient [3, 4]: norm 5, clipped to norm 1 -> [0.6, 0.8]; SGD lr 1 -> weights [-0.6, -0.8]
    param.grad = torch.tensor([3.0, 4.0])
    stepped, norm, stop = optimizer_step([param], state, accelerator=accelerator, max_grad_norm=1.0, nan_guard=guard,
                                         losses_finite=True)
    assert (stepped, stop) == (True, False) and norm == pytest.approx(5.0)
    assert torch.allclose(param.detach(), torch.tensor([-0.6, -0.8]))
    assert param.grad is None and state.global_step == 1 and state.lr_scheduler.steps == 1

    # no clipping (max_grad_norm <= 0): the raw gradient [3, 4] -> [-3.6, -4.8]
    param.grad = torch.tensor([3.0, 4.0])
    optimizer_step([param], state, accelerator=accelerator, max_grad_norm=0.0, nan_guard=guard, losses_finite=True)
    assert torch.allclose(param.detach(), torch.tensor([-3.6, -4.8]))

    # a NaN gradient, then a finite gradient of a non-finite loss: both skipped, weights kept; 2 in a row stop
    param.grad = torch.tensor([NAN, 1.0])
    stepped, norm, stop = optimizer_step([param], state, accelerator=accelerator, max_grad_norm=1.0,
                                         nan_guard=guard, losses_finite=True)
    assert (stepped, stop) == (False, False) and math.isnan(norm)
    param.grad = torch.tensor([1.0, 1.0])
    stepped, _, stop = optimizer_step([param], state, accelerator=accelerator, max_grad_norm=1.0, nan_guard=guard,
                                      losses_finite=False)
    assert (stepped, stop) == (False, True)
    assert torch.allclose(param.detach(), torch.tensor([-3.6, -4.8]))
    assert state.global_step == 2 and state.nan_steps_total == 2 and state.lr_scheduler.steps == 2


# ------------------------------------------------------------------------------------------------ DDPO epochs


def _ddpo_recipe(tmp_path, **train):
    return tiny_recipe(
        tiny_pipeline_dir(tmp_path), tmp_path,
        run={"num_epochs": 1, "save_every": 0},
        sample={"num_steps": 4, "batch_size": 2, "num_batches_per_epoch": 2},
        log={"tracker": "none", "image_every": 0},
        **route(weight_decay=0.0, **train),
    )


def _train_ddpo(recipe, run_dir, **kwargs):
    from diffrl.trainers import ddpo

    return ddpo.train(load_cfg(recipe), run_dir, **kwargs)


def test_timestep_fraction_and_inner_epochs(tmp_path, monkeypatch):
    from samplers.ddim import DDIMSampler

    calls = []
    original = DDIMSampler.log_prob

    def recording(self, pipe, traj, step_index, **kwargs):
        calls.append((step_index, len(traj)))
        return original(self, pipe, traj, step_index, **kwargs)

    monkeypatch.setattr(DDIMSampler, "log_prob", recording)
    steps = []
    # 4 samples, minibatches of 2, 2 inner epochs -> 4 minibatches; T = 4 steps at fraction 0.5 -> 2 trained each
    recipe = _ddpo_recipe(tmp_path, timestep_fraction=0.5, num_inner_epochs=2, batch_size=2,
                          gradient_accumulation_steps=1)
    _train_ddpo(recipe, tmp_path / "run", step_callback=lambda info: steps.append(info["global_step"]))
    assert len(calls) == 4 * 2
    assert all(size == 2 for _, size in calls)
    for mb in range(4):  # each minibatch trains 2 different steps of the 4
        (a, _), (b, _) = calls[2 * mb: 2 * mb + 2]
        assert a != b and {a, b} <= {0, 1, 2, 3}
    assert steps == [0, 1, 2, 3, 4]  # one optimizer step per minibatch, over both inner epochs


def test_skip_final_steps_never_trains_the_last_steps(tmp_path, monkeypatch):
    from samplers.ddim import DDIMSampler

    calls = []
    original = DDIMSampler.log_prob

    def recording(self, pipe, traj, step_index, **kwargs):
        calls.append(step_index)
        return original(self, pipe, traj, step_index, **kwargs)

    monkeypatch.setattr(DDIMSampler, "log_prob", recording)
    # T = 4 steps, the last 2 skipped: every minibatch trains steps 0 and 1, never 2 or 3
    recipe = _ddpo_recipe(tmp_path, skip_final_steps=2, batch_size=2, gradient_accumulation_steps=1)
    _train_ddpo(recipe, tmp_path / "run")
    assert len(calls) == 2 * 2 and sorted(calls) == [0, 0, 1, 1]


@pytest.mark.parametrize("skip", [-1, 4])
@pytest.mark.parametrize("trainer", trainers_with_train_field("skip_final_steps"))
def test_skip_final_steps_must_leave_a_step(tmp_path, skip, trainer):
    import importlib

    from diffrl.errors import UserError

    groups = with_trainer({"sample": {"num_steps": 4}, "train": {"skip_final_steps": skip}}, trainer)
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **groups)
    # a negative count is refused by the config's number checks (every int >= 0) before the trainer's own range
    expected = "skip_final_steps must be in" if skip >= 0 else r"skip_final_steps must be (in|>= 0)"
    with pytest.raises(UserError, match=expected):
        importlib.import_module(f"diffrl.trainers.{trainer}").train(load_cfg(recipe), tmp_path / "run")


def _dpok_recipe(tmp_path, num_epochs, **train):
    """DPOK on the tiny pipeline, T = 4 steps (timesteps 751, 501, 251, 1), 4 samples per epoch."""
    return tiny_recipe(
        tiny_pipeline_dir(tmp_path), tmp_path, trainer="dpok",
        run={"num_epochs": num_epochs, "save_every": 0},
        sample={"num_steps": 4, "batch_size": 2, "num_batches_per_epoch": 2},
        log={"tracker": "none", "image_every": 0}, **route(**train),
    )


def _record_value_timesteps(monkeypatch) -> list:
    """Patch DPOK's value network to record, per call, the timesteps it is asked about."""
    from diffrl.trainers import dpok

    calls, forward = [], dpok.ValueNet.forward

    def recording(self, latents, text, timesteps):
        calls.append(timesteps.tolist())
        return forward(self, latents, text, timesteps)

    monkeypatch.setattr(dpok.ValueNet, "forward", recording)
    return calls


def test_dpok_skip_final_steps_never_trains_or_fits_the_last_steps(tmp_path, monkeypatch):
    from diffrl.trainers import dpok
    from samplers.ddim import DDIMSampler

    policy_steps, log_prob = [], DDIMSampler.log_prob

    def recording_log_prob(self, pipe, traj, step_index, **kwargs):
        policy_steps.append(step_index)
        return log_prob(self, pipe, traj, step_index, **kwargs)

    monkeypatch.setattr(DDIMSampler, "log_prob", recording_log_prob)
    value_calls = _record_value_timesteps(monkeypatch)
    # the last 2 of 4 steps skipped: 12 policy pairs and 64 value pairs all come from steps 0 and 1; unrestricted,
    # 12 draws of 4 steps would miss steps 2-3 with probability (1/2)^12
    recipe = _dpok_recipe(tmp_path, 1, skip_final_steps=2, batch_size=2, gradient_accumulation_steps=3,
                          policy_steps=4, value_batch_size=32, value_steps=2)
    dpok.train(load_cfg(recipe), tmp_path / "run")
    assert len(policy_steps) == 2 * 12  # each pair's step under the policy and under the adapter-off reference
    assert set(policy_steps) == {0, 1}
    value_timesteps = [t for call in value_calls for t in call]
    assert len(value_timesteps) >= 64 and set(value_timesteps) <= {751, 501}


def test_gradient_accumulation_equals_one_larger_batch(tmp_path):
    # With AdamW's ε far above |g|, a first step from B = 0 moves each LoRA weight by -lr·g/(|g| + ε) ≈ -lr·g/ε:
    # linear in the gradient, so accumulating 2 minibatches of 2 must give the update of one minibatch of 4.
    # (Had the accumulated loss not been divided by the number of minibatches, the update would be twice as big.)
    def lora_b(batch_size, accumulation, name):
        weights = {}

        def keep(info):
            weights.update({n: p.detach().clone() for n, p in info["unet"].named_parameters() if "lora_B" in n})

        recipe = _ddpo_recipe(tmp_path, batch_size=batch_size, gradient_accumulation_steps=accumulation,
                              adam_epsilon=1e3, max_grad_norm=0.0, learning_rate=1.0)
        _train_ddpo(recipe, tmp_path / name, step_callback=keep)
        return torch.cat([weights[n].flatten() for n in sorted(weights)])

    one_batch, accumulated = lora_b(4, 1, "one"), lora_b(2, 2, "accumulated")
    assert one_batch.abs().max() > 0
    assert (accumulated - one_batch).norm() <= 1e-4 * one_batch.norm()


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state and refuses a second mixed-precision setting in the same process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_mixed_precision_trains_fp32_adapters_over_bf16_frozen_weights(tmp_path, fresh_accelerate_state):
    snaps = {}

    def keep(info):
        snaps[info["global_step"]] = {n: (p.detach().clone(), p.requires_grad)
                                      for n, p in info["unet"].named_parameters()}

    recipe = _ddpo_recipe(tmp_path)
    recipe["model"]["mixed_precision"] = "bf16"
    _train_ddpo(recipe, tmp_path / "run", step_callback=keep)
    before, after = snaps[0], snaps[max(snaps)]
    trainable = [n for n, (_, grad) in before.items() if grad]
    assert {before[n][0].dtype for n in trainable} == {torch.float32}  # AdamW state and updates stay fp32
    assert {v.dtype for n, (v, grad) in before.items() if not grad} == {torch.bfloat16}
    assert all(not torch.equal(before[n][0], after[n][0]) for n in trainable)


# ------------------------------------------------------------------------------------------------ distributed types


@pytest.mark.parametrize("kind, fsdp2, use_ema, refused", [
    ("DistributedType.MULTI_CPU", False, False, None), ("DistributedType.MULTI_GPU", False, True, None),
    ("DistributedType.FSDP", True, False, None), ("DistributedType.FSDP", False, False, "FSDP1"),
    ("DistributedType.FSDP", True, True, "use_ema"), ("DistributedType.MEGATRON_LM", False, False, "not supported"),
])
def test_unsupported_distributed_types_are_refused_with_a_clear_message(kind, fsdp2, use_ema, refused, monkeypatch):
    from diffrl.errors import UserError
    from diffrl.training.setup import check_distributed_type

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)

    class _Acc:
        distributed_type = kind
        is_fsdp2 = fsdp2

    if refused:
        with pytest.raises(UserError, match=refused):
            check_distributed_type(_Acc(), "ddpo", use_ema=use_ema)
    else:
        check_distributed_type(_Acc(), "ddpo", use_ema=use_ema)


@pytest.mark.parametrize("config, refused", [
    ({"zero_optimization": {"stage": 2}}, None),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}, "bf16": {"enabled": True}}, None),
    ({"zero_optimization": {"stage": 3}}, "stage 3 partitions the UNet's weights"),
    ({"zero_optimization": {"stage": 0}}, "stage 0 is plain data parallelism"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer to 'cpu'"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, "remove the 'optimizer' section"),
    ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}, "remove the 'scheduler' section"),
])
def test_deepspeed_configs_other_than_zero_1_2_with_the_recipes_optimizer_are_refused(config, refused, monkeypatch):
    from types import SimpleNamespace

    from diffrl.errors import UserError
    from diffrl.training.setup import check_distributed_type

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    accelerator = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED",
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    if refused:
        with pytest.raises(UserError, match=refused):
            check_distributed_type(accelerator, "ddpo")
    else:
        check_distributed_type(accelerator, "ddpo")


def test_an_fsdp_config_that_accelerate_ignored_is_refused(monkeypatch):
    """accelerate drops an FSDP config on CPU and runs plain data parallelism; the run says so instead."""
    from diffrl.errors import UserError
    from diffrl.training.setup import check_distributed_type

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")

    class _Acc:
        distributed_type = "DistributedType.MULTI_CPU"

    with pytest.raises(UserError, match="GPUs only"):
        check_distributed_type(_Acc(), "ddpo")


def _record_window_training(monkeypatch) -> tuple[list, list]:
    """Patch the rollout and DDIM log-prob to record each epoch's η tuple and every recomputed step, checking that
    only stochastic steps are recomputed and that deterministic steps have log-prob 0."""
    from diffrl.training import context as rollout_module  # the run context calls collect_rollouts
    from samplers.ddim import DDIMSampler

    calls, etas = [], []
    original_log_prob, original_collect = DDIMSampler.log_prob, rollout_module.collect_rollouts

    def recording(self, pipe, traj, step_index, **kwargs):
        calls.append(step_index)
        assert traj.eta[step_index] == 1.0 and (traj.log_probs[:, step_index] != 0).all()
        return original_log_prob(self, pipe, traj, step_index, **kwargs)

    def collecting(**kwargs):
        out = original_collect(**kwargs)
        etas.append(out.traj.eta)
        assert (out.traj.log_probs[:, [i for i, e in enumerate(out.traj.eta) if e == 0]] == 0).all()
        return out

    monkeypatch.setattr(DDIMSampler, "log_prob", recording)
    monkeypatch.setattr(rollout_module, "collect_rollouts", collecting)
    return calls, etas


def test_sde_window_samples_and_trains_only_its_steps(tmp_path, monkeypatch):
    calls, etas = _record_window_training(monkeypatch)
    # T = 4, windows of 2 steps starting at 0 or 1 (one draw per epoch), 3 epochs, 2 minibatches of 2 per epoch
    recipe = _ddpo_recipe(tmp_path, sde_window=2, sde_window_max_start=1, batch_size=2,
                          gradient_accumulation_steps=1)
    cfg = load_cfg(recipe)
    cfg.run.num_epochs = 3
    from diffrl.trainers import ddpo

    ddpo.train(cfg, tmp_path / "run")
    assert len(etas) == 3 and all(e in [(1.0, 1.0, 0.0, 0.0), (0.0, 1.0, 1.0, 0.0)] for e in etas)
    assert len(calls) == 3 * 2 * 2  # per epoch: 2 minibatches × the window's 2 steps
    for epoch, eta in enumerate(etas):
        window = {i for i, e in enumerate(eta) if e}
        assert sorted(calls[4 * epoch: 4 * epoch + 4]) == sorted(2 * list(window))


def test_dpok_sde_window_samples_and_trains_only_its_steps(tmp_path, monkeypatch):
    from diffrl.trainers import dpok

    calls, etas = _record_window_training(monkeypatch)
    value_timesteps = _record_value_timesteps(monkeypatch)
    # windows of 2 starting at 0 or 1; per epoch 2 policy steps × 2 pairs, each pair's step recomputed under the
    # policy and the adapter-off reference, and 1 value step of 16 pairs
    recipe = _dpok_recipe(tmp_path, 3, sde_window=2, sde_window_max_start=1, batch_size=2,
                          gradient_accumulation_steps=2, policy_steps=1, value_batch_size=16, value_steps=1)
    dpok.train(load_cfg(recipe), tmp_path / "run")
    timesteps = (751, 501, 251, 1)
    assert len(etas) == 3 and all(e in [(1.0, 1.0, 0.0, 0.0), (0.0, 1.0, 1.0, 0.0)] for e in etas)
    assert len(calls) == 3 * 2 * 2
    for epoch, eta in enumerate(etas):
        window = {i for i, e in enumerate(eta) if e}
        assert set(calls[4 * epoch: 4 * epoch + 4]) <= window
        # the epoch's value fit (its first value call) sees window timesteps only
        assert set(value_timesteps[3 * epoch]) <= {timesteps[i] for i in window}


@pytest.mark.parametrize("window, max_start, skip, message", [
    (3, 2, 0, "must be <= sample.num_steps"),  # 2 + 3 > 4 steps
    (2, 1, 2, "must be <= sample.num_steps"),  # the window may not reach the skipped final steps
    (0, 1, 0, "needs train.sde_window"),
])
@pytest.mark.parametrize("trainer", trainers_with_train_field("sde_window"))
def test_sde_window_must_fit(tmp_path, window, max_start, skip, message, trainer):
    import importlib

    from diffrl.errors import UserError

    train = {"sde_window": window, "sde_window_max_start": max_start, "skip_final_steps": skip}
    groups = with_trainer({"sample": {"num_steps": 4}, "train": train}, trainer)
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **groups)
    with pytest.raises(UserError, match=message):
        importlib.import_module(f"diffrl.trainers.{trainer}").train(load_cfg(recipe), tmp_path / "run")


def test_sde_window_is_refused_for_a_sampler_without_per_step_eta(tmp_path):
    from types import SimpleNamespace

    from diffrl.errors import UserError
    from diffrl.trainers import ddpo

    cfg = load_cfg(_ddpo_recipe(tmp_path, sde_window=2))
    ddim_like = SimpleNamespace(name="ddim", per_step_eta=True, consistency=False)
    lcm_like = SimpleNamespace(name="lcm", per_step_eta=False, consistency=True)
    ddpo.check_sampler(cfg, ddim_like, "DDPO")
    with pytest.raises(UserError, match="needs a sampler that takes one eta per step"):
        ddpo.check_sampler(cfg, lcm_like, "DDPO")
    cfg.train.sde_window = 0
    ddpo.check_sampler(cfg, lcm_like, "DDPO")  # without the window any sampler is fine
    cfg.sample.eta = 0.0
    ddpo.check_sampler(cfg, lcm_like, "DDPO")  # a consistency sampler re-noises whatever eta is
    with pytest.raises(UserError, match="deterministic"):
        ddpo.check_sampler(cfg, ddim_like, "DDPO")
