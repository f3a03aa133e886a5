"""Adjoint Matching's pure math against hand-worked numbers and closed forms, and the linear-Gaussian toy whose
tilted optimum is known in closed form (`diffrl/trainers/adjoint_matching.py`)."""

import itertools
import math

import numpy as np
import pytest
import torch
from pg_helpers import load_cfg, tiny_pipeline_dir, tiny_recipe, with_trainer

import diffrl.trainers.adjoint_matching as am
from diffrl.config import derived_numbers, load_recipe
from diffrl.errors import UserError
from diffrl.trainers.adjoint_matching import (
    MEMORYLESS_ETA,
    adjoint_matching_loss,
    lean_adjoint_step,
    lean_adjoints,
    loss_steps,
    memoryless_noise_std,
    step_noise_std,
    terminal_adjoint,
    trained_steps,
)
from diffrl.training.update import PolicyUpdate
from samplers.flow import sde_constants

D = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# The memoryless schedule


def test_memoryless_noise_std_by_hand():
    # g(σ) = √(2σ/(1 − σ)): σ = 0.5 → √2; σ = 0.2 → √(0.4/0.8) = √0.5; σ = 0 → 0; σ = 1 → ∞
    assert memoryless_noise_std(0.5) == pytest.approx(math.sqrt(2))
    assert memoryless_noise_std(0.2) == pytest.approx(math.sqrt(0.5))
    assert memoryless_noise_std(0.0) == 0.0
    assert memoryless_noise_std(1.0) == math.inf
    # the paper's σ(t) = √(2(1 − t)/t) at t = 1 − σ = 0.25: √(2·0.75/0.25) = √6
    assert memoryless_noise_std(0.75) == pytest.approx(math.sqrt(6))


def test_step_noise_std_at_sigma_one_divides_by_one_minus_next():
    assert step_noise_std(1.0, 0.9) == pytest.approx(math.sqrt(20))  # √(2·1/(1 − 0.9))
    assert step_noise_std(0.5, 0.4) == pytest.approx(math.sqrt(2))


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.95), (0.7, 0.6), (0.3, 0.0)])
def test_flow_grpo_sde_at_sqrt2_is_the_memoryless_sde(sigma, sigma_next):
    """The sampler's step at a = √2 is Euler–Maruyama of dx = (−2v − x/(1 − σ))·dt + g·dB with dt = σ − σ' > 0:
    x' = x·(1 − dt/(1 − σ)) − 2·dt·v + g·√dt·z. At σ = 1 the sampler's 1 − σ' stands for 1 − σ, and its v
    coefficient (1 + g²(1 − σ)/(2σ))·(−dt) is −dt there, not −2·dt (the reference code's convention)."""
    c = sde_constants(sigma, sigma_next, MEMORYLESS_ETA)
    dt = sigma - sigma_next
    denominator = 1 - (sigma_next if sigma == 1 else sigma)
    g = math.sqrt(2 * sigma / denominator)
    assert c.std_dev_t == pytest.approx(g, rel=1e-6)
    assert step_noise_std(sigma, sigma_next) == pytest.approx(g, rel=1e-12)
    assert c.x_coef == pytest.approx(1 - dt / denominator, rel=1e-5, abs=1e-6)
    assert c.v_coef == pytest.approx(-(1 if sigma == 1 else 2) * dt, rel=1e-5)
    assert c.std == pytest.approx(g * math.sqrt(dt), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The lean adjoint


def test_terminal_adjoint_quadratic_reward_by_hand():
    # r(x) = −(x − c)²/(2τ²): ã = −λ·∇r = λ(x − c)/τ² = 2·(3 − 2)/0.25 = 8; second sample 2·(1 − 2)/0.25 = −8
    x = torch.tensor([[3.0], [1.0]], dtype=D)
    adjoint, rewards = terminal_adjoint(x, lambda x: (-(x - 2.0) ** 2 / (2 * 0.25)).sum(1), reward_scale=2.0)
    torch.testing.assert_close(adjoint, torch.tensor([[8.0], [-8.0]], dtype=D))
    torch.testing.assert_close(rewards, torch.tensor([-2.0, -2.0], dtype=D))


def test_lean_adjoint_step_scalar_by_hand():
    # v = 3x at σ = 0.5, ã = 2: ãᵀ∇v = 6; ãᵀ∇b = −2·6 − 2/(1 − 0.5) = −16; ã(0.75) = 2 + 0.25·(−16) = −2
    out = lean_adjoint_step(torch.tensor([[2.0]], dtype=D), torch.tensor([[0.3]], dtype=D), 0.5, 0.75,
                            lambda x: 3 * x)
    torch.testing.assert_close(out, torch.tensor([[-2.0]], dtype=D))


def test_lean_adjoint_step_uses_the_transposed_jacobian():
    # v = A x, A = [[1, 2], [0, 3]], ã = [1, 1]: ãᵀA = [1, 5] (A ã would be [3, 3]); at σ = 0 → 0.5:
    # ãᵀ∇b = −2·[1, 5] − [1, 1]/1 = [−3, −11]; ã(0.5) = [1, 1] + 0.5·[−3, −11] = [−0.5, −4.5]
    A = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=D)
    out = lean_adjoint_step(torch.tensor([[1.0, 1.0]], dtype=D), torch.tensor([[0.2, -0.4]], dtype=D), 0.0, 0.5,
                            lambda x: x @ A.T)
    torch.testing.assert_close(out, torch.tensor([[-0.5, -4.5]], dtype=D))


def test_lean_adjoints_approach_the_closed_form_for_a_linear_velocity():
    """v = a·x: dã/dσ = ã·(−2a − 1/(1 − σ)), so ã(σ) = ã(0)·e^{−2aσ}·(1 − σ); Euler over 2000 steps is within
    O(1/T) of it (checked up to σ = 0.9, where the 1/(1 − σ) term is still mild)."""
    a, steps = 0.7, 2000
    sigmas = [1 - k / steps for k in range(steps + 1)]
    latents = torch.randn(3, steps + 1, 2, dtype=D)  # the states do not matter for a linear v
    terminal = torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]], dtype=D)
    out = lean_adjoints(latents, sigmas, terminal, lambda x, k: a * x)
    assert out.shape == latents.shape
    torch.testing.assert_close(out[:, -1], terminal)
    for k in (1800, 1000, 200):  # σ = 0.1, 0.5, 0.9
        s = sigmas[k]
        expected = terminal * math.exp(-2 * a * s) * (1 - s)
        torch.testing.assert_close(out[:, k], expected, rtol=5e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The loss


def test_adjoint_matching_loss_by_hand():
    # g = 2: u = −(2/2)·(v_ft − v_base) = −[1, 1]; residual = u + 2·[0.5, −1] = [0, −3]; ‖·‖² = 9
    v_ft = torch.tensor([[1.0, 2.0]], dtype=D)
    v_base = torch.tensor([[0.0, 1.0]], dtype=D)
    adjoint = torch.tensor([[0.5, -1.0]], dtype=D)
    torch.testing.assert_close(adjoint_matching_loss(v_ft, v_base, adjoint, 2.0), torch.tensor([9.0], dtype=D))
    # per-sample g `[B]`: second row g = 1: u = −2·[1, 1], residual = [−2 + 0.5, −2 − 1] → 2.25 + 9 = 11.25
    both = adjoint_matching_loss(v_ft.repeat(2, 1), v_base.repeat(2, 1), adjoint.repeat(2, 1),
                                 torch.tensor([2.0, 1.0], dtype=D))
    torch.testing.assert_close(both, torch.tensor([9.0, 11.25], dtype=D))


def test_adjoint_matching_loss_is_zero_at_the_optimum_and_its_gradient_flows_only_to_v_finetuned():
    # optimum: v_ft − v_base = (g²/2)·ã; g = √3 → 1.5·ã
    adjoint = torch.tensor([[0.2, -0.4, 1.0]], dtype=D)
    v_base = torch.tensor([[1.0, 0.0, -1.0]], dtype=D, requires_grad=True)
    v_ft = (v_base.detach() + 1.5 * adjoint).requires_grad_(True)
    loss = adjoint_matching_loss(v_ft, v_base, adjoint, math.sqrt(3))
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-24)
    (adjoint_matching_loss(v_ft + 1.0, v_base, adjoint, math.sqrt(3))).sum().backward()
    assert v_ft.grad is not None and v_base.grad is None


# ---------------------------------------------------------------------------------------------------------------
# The toy: a 1-D linear-Gaussian flow whose tilted optimum is Gaussian in closed form


M0, S0 = 0.5, 0.8  # data N(m0, s0²)
C, TAU, LAM = 2.0, 0.7, 1.0  # r(x) = −(x − c)²/(2τ²), target ∝ p_base·exp(λ·r)


def _base_velocity(x, sigma):
    """The exact v = E[ε − x0 | x_σ] of data N(m0, s0²): affine in x, Cov(ε − x0, x_σ)/Var(x_σ) the slope."""
    var = (1 - sigma) ** 2 * S0**2 + sigma**2
    return -M0 + (sigma - (1 - sigma) * S0**2) / var * (x - (1 - sigma) * M0)


def test_toy_fine_tuned_sampler_reaches_the_tilted_gaussian():
    """N(m0, s0²)·exp(−λ(x − c)²/(2τ²)) is N(m*, v*) with 1/v* = 1/s0² + λ/τ², m* = v*·(m0/s0² + λc/τ²):
    here m* = 1.3496, v* = 0.2775 (base: 0.5, 0.64). The control is affine per step (the optimal control of a
    linear SDE with a quadratic terminal cost is affine in x), v_ft = v_base + w1_k·x + w0_k, trained with the
    adjoint-matching loss on the memoryless sampler's own rollouts (T = 20 Euler–Maruyama steps, Flow-GRPO's step
    at a = √2).

    Tolerance: 0.05 on the mean and 0.035 on the variance. The errors left are the Euler discretisation of the
    SDE and of the lean adjoint (O(1/T): on this toy halving T to 10 roughly doubles them, to about 0.04 and 0.03),
    the Monte-Carlo error of 100k samples (s.e. ≈ 0.002 for both) and the optimiser's noise. The base is 0.85
    away in mean and 0.36 in variance, so a wrong sign, a missing factor 2 in u or λ's scale fails."""
    v_star = 1 / (1 / S0**2 + LAM / TAU**2)
    m_star = v_star * (M0 / S0**2 + LAM * C / TAU**2)
    steps = 20
    sigmas = [1 - k / steps for k in range(steps + 1)]
    consts = [sde_constants(s, n, MEMORYLESS_ETA) for s, n in itertools.pairwise(sigmas)]
    noise_std = [step_noise_std(s, n) for s, n in itertools.pairwise(sigmas)]
    w1 = torch.zeros(steps, dtype=D, requires_grad=True)
    w0 = torch.zeros(steps, dtype=D, requires_grad=True)
    generator = torch.Generator().manual_seed(0)

    def v_ft(x, k):
        return _base_velocity(x, sigmas[k]) + w1[k] * x + w0[k]

    def rollout(n, finetuned=True):
        x = torch.randn(n, 1, dtype=D, generator=generator)
        states = [x]
        with torch.no_grad():
            for k, c in enumerate(consts):
                v = v_ft(x, k) if finetuned else _base_velocity(x, sigmas[k])
                x = c.x_coef * x + c.v_coef * v + c.std * torch.randn(x.shape, dtype=D, generator=generator)
                states.append(x)
        return torch.stack(states, dim=1)  # [n, T + 1, 1]

    def reward(x):
        return (-(x - C) ** 2 / (2 * TAU**2)).sum(1)

    optimizer = torch.optim.Adam([w1, w0], lr=0.1)
    for _ in range(150):
        latents = rollout(512)
        terminal, _ = terminal_adjoint(latents[:, -1], reward, LAM)
        adjoints = lean_adjoints(latents, sigmas, terminal, lambda x, k: _base_velocity(x, sigmas[k]))
        loss = sum(adjoint_matching_loss(v_ft(latents[:, k], k), _base_velocity(latents[:, k], sigmas[k]),
                                         adjoints[:, k], noise_std[k]).mean() for k in range(steps)) / steps
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    base = rollout(100_000, finetuned=False)[:, -1, 0]
    tuned = rollout(100_000)[:, -1, 0]
    # the memoryless base chain itself ends at the data law (so the tilt, not the sampler, moves the fine-tuned one)
    assert float(base.mean()) == pytest.approx(M0, abs=0.02)
    assert float(base.var()) == pytest.approx(S0**2, abs=0.03)
    assert float(tuned.mean()) == pytest.approx(m_star, abs=0.05)
    assert float(tuned.var()) == pytest.approx(v_star, abs=0.035)


# ---------------------------------------------------------------------------------------------------------------
# The recipe checks


def _recipe(tmp_path, **groups):
    recipe = tiny_recipe("tiny-shapes-flow", tmp_path, **with_trainer({}, "adjoint_matching"))
    for group, values in groups.items():  # over the contract tests' tiny settings
        recipe[group] = {**recipe.get(group, {}), **values}
    return recipe


def test_a_reward_without_gradients_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="'jpeg_compressibility' is not differentiable"):
        load_cfg(_recipe(tmp_path, reward={"name": "jpeg_compressibility", "kwargs": {}}))


@pytest.mark.parametrize("eta", [0.0, 0.7, 1.0])
def test_a_noise_level_other_than_the_memoryless_one_is_refused(tmp_path, eta):
    with pytest.raises(UserError, match="memoryless"):
        load_cfg(_recipe(tmp_path, sample={"eta": eta}))


def test_the_tiny_recipe_loads_and_trains_every_step_by_default(tmp_path):
    cfg = load_cfg(_recipe(tmp_path))
    assert cfg.train.train_timesteps == 0
    assert trained_steps(cfg) == cfg.sample.num_steps


# ---------------------------------------------------------------------------------------------------------------
# The authors' settings: stratified loss steps and CFG left out of the adjoint and the control


def test_loss_steps_uniform_stratified_and_all():
    rng = np.random.default_rng(0)
    assert loss_steps(rng, 5, 5).tolist() == [0, 1, 2, 3, 4] and loss_steps(rng, 5, 9).tolist() == [0, 1, 2, 3, 4]
    seen = set()
    for _ in range(400):
        # the authors' draw: T = 50, K = 4, split 0.6: round(30.0) = 30, so 2 of steps 0-29 and 2 of steps 30-49
        k = loss_steps(rng, 50, 4, 0.6)
        assert len(set(k.tolist())) == 4 and k.tolist() == sorted(k.tolist())
        assert (k < 30).sum() == 2 and (k >= 30).sum() == 2
        seen |= set(k.tolist())
        # odd K: K // 2 = 1 early (T = 10, split 0.6: the first 6 steps), 2 late
        k = loss_steps(rng, 10, 3, 0.6)
        assert (k < 6).sum() == 1 and (k >= 6).sum() == 2 and len(set(k.tolist())) == 3
    assert seen == set(range(50))  # every step can be drawn
    uniform = [loss_steps(rng, 10, 3).tolist() for _ in range(200)]
    assert all(len(set(u)) == 3 for u in uniform) and {i for u in uniform for i in u} == set(range(10))


def test_a_timestep_split_that_leaves_a_part_too_small_is_refused(tmp_path):
    for bad in (1.0, -0.1):
        with pytest.raises(UserError, match="timestep_split must be in"):
            load_cfg(_recipe(tmp_path, train={"timestep_split": bad}))
    # 3 steps split 0.2: round(0.6) = 1 early step, but K = 4 > 3 is all steps (no draw), so it loads; K = 2 at
    # split 0.1: round(0.3) = 0 early steps for K // 2 = 1
    load_cfg(_recipe(tmp_path, train={"timestep_split": 0.2, "train_timesteps": 4}))
    with pytest.raises(UserError, match="too few"):
        load_cfg(_recipe(tmp_path, sample={"num_steps": 3}, train={"timestep_split": 0.1, "train_timesteps": 2}))


@pytest.mark.parametrize("in_adjoint, in_control", [(True, True), (False, True), (True, False), (False, False)])
def test_guidance_in_the_adjoint_and_the_control_follows_the_settings(tmp_path, monkeypatch, in_adjoint, in_control):
    """Guided rollouts (CFG 3): the lean adjoint's T base calls and the loss's two calls per step run with or
    without the unconditional branch as set (the authors' defaults: neither)."""
    calls = []

    class Recording:
        def __init__(self, family):
            self.family = family

        def __getattr__(self, name):
            return getattr(self.family, name)

        def model_output(self, x, t, cond, guidance_scale, dtype=None, **kw):
            calls.append(cond.guided)
            return self.family.model_output(x, t, cond, guidance_scale, dtype, **kw)

    family_of = am.model_family
    monkeypatch.setattr(am, "model_family", lambda pipe: Recording(family_of(pipe)))
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer(
        {"run": {"num_epochs": 1, "save_every": 0}, "log": {"tracker": "none", "image_every": 0},
         "train": {"guidance_in_adjoint": in_adjoint, "guidance_in_control": in_control}}, "adjoint_matching"))
    cfg = load_cfg(recipe)
    assert cfg.sample.guidance_scale > 1 and cfg.sample.num_steps == 3
    am.train(cfg, tmp_path / "run")
    # per micro-batch (2 of 2 trajectories): 3 lean-adjoint steps, then 3 loss steps × (base, trained)
    per_micro_batch = [in_adjoint] * 3 + [in_control] * 6
    assert calls == per_micro_batch * 2


# The authors' public settings, as read in microsoft/soc-fine-tuning-sd@489f904 configs/multi_prompt.yaml (numbers
# only; soc_trainer.py: AdamW weight_decay 0.0, the whole UNet trained; prompt_files/refl_data.json: 10,000 prompts;
# am_trainer.py: EMA_decay 0.9)
AUTHORS = {"reward_func": "ImageReward", "reward_multiplier": 100.0, "num_inference_steps": 50, "lr": 3.0e-6,
           "beta1": 0.9, "beta2": 0.95, "batch_size": 5, "accum_grad_steps": 25, "gradient_clip": 0.0,
           "warmup_steps": 20, "num_timesteps_to_load_train": 4, "guidance_in_adjoint_computation": False,
           "guidance_in_control_computation": False, "precision": "32", "max_epochs": 10, "seed": 0,
           "per_sample_threshold_quantile": 0.9, "EMA_decay": 0.9}


def test_the_published_recipe_has_the_authors_settings():
    cfg = load_recipe("adjoint_matching/sd35m_imagereward")
    t, o, s = cfg.train, cfg.optim, cfg.sample
    assert cfg.trainer == "adjoint_matching" and cfg.model.pipeline == "stabilityai/stable-diffusion-3.5-medium"
    assert (cfg.reward.name, t.reward_scale) == ("imagereward", AUTHORS["reward_multiplier"])
    assert s.num_steps == s.eval_num_steps == AUTHORS["num_inference_steps"]
    assert s.eta == pytest.approx(math.sqrt(2)) and s.sampler == "flow"  # memoryless, as the reference's DDIM eta 1
    assert (o.learning_rate, o.adam_beta1, o.adam_beta2, o.weight_decay) == (AUTHORS["lr"], AUTHORS["beta1"],
                                                                              AUTHORS["beta2"], 0.0)
    assert o.max_grad_norm == AUTHORS["gradient_clip"]  # 0: no clipping in either
    assert (o.lr_scheduler, o.lr_warmup_steps) == ("constant_with_warmup", AUTHORS["warmup_steps"])
    assert s.batch_size == t.batch_size == AUTHORS["batch_size"]
    assert s.num_batches_per_epoch == o.gradient_accumulation_steps == AUTHORS["accum_grad_steps"]
    assert t.train_timesteps == AUTHORS["num_timesteps_to_load_train"] and t.timestep_split == 0.6
    assert (t.guidance_in_adjoint, t.guidance_in_control) == (AUTHORS["guidance_in_adjoint_computation"],
                                                              AUTHORS["guidance_in_control_computation"])
    assert (t.clip_quantile, t.clip_ema_decay) == (AUTHORS["per_sample_threshold_quantile"], AUTHORS["EMA_decay"])
    assert t.loss_step_weight == "dt"  # the reference's loss is δ·‖u + σ·ã‖² (am_trainer.py compute_loss)
    assert cfg.model.full_finetune and cfg.model.mixed_precision == "no" and cfg.run.seed == AUTHORS["seed"]
    # 10 passes over 10,000 prompts at 5 × 25 = 125 trajectories per optimizer step: 800 steps on one process
    assert cfg.run.num_epochs == AUTHORS["max_epochs"] * 10_000 // (5 * 25) == 800
    derived = derived_numbers(cfg, 1)
    assert (derived["optimizer_steps_per_epoch"], derived["global_train_batch"]) == (1, 125)
    assert (s.height, s.width) == (512, 512)


# ---------------------------------------------------------------------------------------------------------------
# The authors' loss clipping at an EMA of the 90 % quantile, and the step-size weighting of the loss


def test_ema_threshold_is_the_authors_running_average_by_hand():
    # decay 0.9 (1/decay = 1.11): the first value as is; the second, 1 < 1.11, a plain mean: 2/2 + 4/2 = 3; then
    # 0.9·3 + 0.1·10 = 3.7 and 0.9·3.7 + 0 = 3.33
    t = 0.0
    for updates, (value, expected) in enumerate([(4.0, 4.0), (2.0, 3.0), (10.0, 3.7), (0.0, 3.33)]):
        t = am.ema_threshold(t, value, updates, 0.9)
        assert t == pytest.approx(expected, abs=1e-12)
    # decay 0.4 (1/decay = 2.5): two running-mean steps, 4 → (4 + 1)/2 = 2.5 → (2.5·2 + 7)/3 = 4, then 0.4·4 + 0.6·9
    t = 0.0
    for updates, (value, expected) in enumerate([(4.0, 4.0), (1.0, 2.5), (7.0, 4.0), (9.0, 7.0)]):
        t = am.ema_threshold(t, value, updates, 0.4)
        assert t == pytest.approx(expected, abs=1e-12)


def test_loss_clip_takes_the_quantile_of_square_roots_ignores_nans_and_resumes_from_its_buffers():
    clip = am.LossClip(0.9, 0.9)
    # square roots 1..5; linear interpolation at 0.9·4 = 3.6 between the 4th and 5th: 4.6; the NaN (a sample whose
    # reward was NaN) is left out
    assert clip.update(torch.tensor([25.0, 1.0, 16.0, float("nan"), 4.0, 9.0])) == pytest.approx(4.6)
    # all square roots 10: quantile 10; second value, a plain mean: (4.6 + 10)/2
    assert clip.update(torch.full((4,), 100.0)) == pytest.approx(7.3)
    resumed = am.LossClip(0.9, 0.9)
    resumed.load_state_dict(clip.state_dict())
    assert float(resumed.threshold) == pytest.approx(7.3) and int(resumed.updates) == 2
    # third value on both: 0.9·7.3 + 0.1·1 (square roots all 1)
    assert resumed.update(torch.ones(3)) == clip.update(torch.ones(3)) == pytest.approx(6.67)


_BACKWARD = PolicyUpdate.backward


def _run_recording_losses(tmp_path, monkeypatch, train, name):
    """Train the tiny flow recipe for one epoch of one micro-batch; the losses handed to `backward` and the weights."""
    losses = []
    backward = _BACKWARD

    def recording(self, loss, stats=None):
        losses.append(float(loss.detach()))
        return backward(self, loss, stats)

    monkeypatch.setattr(PolicyUpdate, "backward", recording)
    recipe = tiny_recipe(tiny_pipeline_dir(tmp_path), tmp_path, **with_trainer({}, "adjoint_matching"))
    for group, values in {"run": {"num_epochs": 1, "save_every": 1, "name": name},
                          "log": {"tracker": "none", "image_every": 0}, "optim": {"weight_decay": 0.0},
                          "sample": {"batch_size": 4, "num_batches_per_epoch": 1},
                          "train": {"batch_size": 4, **train}}.items():  # over the contract tests' tiny settings
        recipe[group] = {**recipe.get(group, {}), **values}
    cfg = load_cfg(recipe)
    metrics = am.train(cfg, tmp_path / name)
    return cfg, losses, metrics


def test_dt_weighting_scales_each_steps_loss_by_its_step_size(tmp_path, monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg, plain, _ = _run_recording_losses(tmp_path, monkeypatch, {}, "plain")
    _, weighted, _ = _run_recording_losses(tmp_path, monkeypatch, {"loss_step_weight": "dt"}, "dt")
    # the pipeline's own scheduler (diffusers), independently of the sampler: σ_0 .. σ_T with σ_T = 0
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(cfg.model.pipeline, subfolder="scheduler")
    scheduler.set_timesteps(cfg.sample.num_steps)
    sigmas = scheduler.sigmas.double().tolist()
    steps = [s - n for s, n in itertools.pairwise(sigmas)]
    assert len(plain) == len(weighted) == cfg.sample.num_steps  # one micro-batch, every step in order
    for k, dt in enumerate(steps):
        assert weighted[k] == pytest.approx(plain[k] * dt, rel=1e-5)


def test_losses_at_or_above_the_clip_threshold_are_left_out(tmp_path, monkeypatch):
    # 4 trajectories × 3 steps, one micro-batch, the first threshold = the quantile itself. Quantile 1: the largest
    # square root is the threshold and "below it" keeps the other 11. Quantile 1e-9: the threshold is a hair above
    # the smallest, so only that one is kept and only its step's loss is non-zero
    n = 4 * 3
    _, losses, most = _run_recording_losses(tmp_path, monkeypatch, {"clip_quantile": 1.0}, "most")
    assert most["loss_kept"] == pytest.approx((n - 1) / n) and all(loss > 0 for loss in losses)
    _, losses, one = _run_recording_losses(tmp_path, monkeypatch, {"clip_quantile": 1e-9}, "one")
    assert one["loss_kept"] == pytest.approx(1 / n)
    assert sum(loss > 0 for loss in losses) == 1 and one["grad_norm"] > 0


def test_clip_settings_out_of_range_are_refused(tmp_path):
    for train, match in [({"clip_quantile": 1.5}, "clip_quantile must be in"), ({"clip_ema_decay": 1.0}, "decay"),
                         ({"loss_step_weight": "dT"}, "loss_step_weight must be")]:
        with pytest.raises(UserError, match=match):
            load_cfg(_recipe(tmp_path, train=train))
