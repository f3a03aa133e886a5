"""Golden tests of the samplers' pure math: Gaussian log-probs, x̂0/ε̂, DDIM and LCM steps, GradPolicy, Trajectory."""

import math

import pytest
import torch
from diffusers import DDIMScheduler, LCMScheduler
from tiny_models import SD_SCHEDULER_CONFIG

from diffrl.errors import UserError
from samplers.base import GradPolicy, Trajectory, gaussian_log_prob, pred_x0_and_eps, step_log_prob
from samplers.ddim import ddim_constants, ddim_step
from samplers.lcm import lcm_constants, lcm_step


def test_gaussian_log_prob_hand_values():
    # x = mean: log N = -log σ - ½ log 2π; σ = 1 → -0.918938533, σ = 0.5 → -0.918938533 + log 2 = -0.225791352
    x = torch.zeros(2, 3, 2, 2)
    assert gaussian_log_prob(x, x, 1.0).tolist() == pytest.approx([-0.918938533] * 2, abs=5e-7)  # float32 arithmetic
    assert gaussian_log_prob(x, x, 0.5).tolist() == pytest.approx([-0.225791352] * 2, abs=5e-7)  # float32 arithmetic
    # one element off by 2σ among 4 dims: mean over dims adds -(2²/2)/4 = -0.5
    y = x.clone()[:1, :1]
    y[0, 0, 0, 0] = 1.0
    assert gaussian_log_prob(y, torch.zeros_like(y), 0.5).item() == pytest.approx(
        -0.225791352 - 0.5, abs=5e-7
    )  # float32 arithmetic


def test_gaussian_log_prob_is_mean_of_normal_log_density():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(4, 4, 3, 3, generator=g), torch.randn(4, 4, 3, 3, generator=g)
    expected = torch.distributions.Normal(mean.double(), 0.3).log_prob(x.double()).mean(dim=(1, 2, 3))
    assert torch.allclose(gaussian_log_prob(x, mean, 0.3).double(), expected, atol=1e-6)


def test_deterministic_step_log_prob_is_zero_and_keeps_a_graph():
    mean = torch.randn(3, 4, 2, 2, requires_grad=True)
    lp = step_log_prob(mean.detach() + 1, mean, 0.0)
    assert lp.tolist() == [0.0, 0.0, 0.0]
    lp.sum().backward()
    assert torch.equal(mean.grad, torch.zeros_like(mean))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_pred_x0_and_eps_inverts_the_forward_process(prediction_type):
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    alpha = 0.3
    sa, sb = math.sqrt(alpha), math.sqrt(1 - alpha)
    x_t = sa * x0 + sb * eps
    output = {"epsilon": eps, "v_prediction": sa * eps - sb * x0, "sample": x0}[prediction_type]
    got_x0, got_eps = pred_x0_and_eps(output, x_t, sa, sb, prediction_type)
    assert torch.allclose(got_x0, x0, atol=1e-5)
    assert torch.allclose(got_eps, eps, atol=1e-5)


def test_ddim_constants_match_the_closed_form():
    a_t, a_prev = 0.2, 0.5
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)  # 0.5/0.8 * 0.6 = 0.375
    assert variance == pytest.approx(0.375)
    c = ddim_constants(a_t, a_prev, eta=1.0)
    assert c.std == pytest.approx(math.sqrt(0.375), rel=1e-6)
    assert c.direction == pytest.approx(math.sqrt(1 - 0.5 - 0.375), rel=1e-6)
    assert c.sqrt_alpha == pytest.approx(math.sqrt(0.2), rel=1e-6)
    assert ddim_constants(a_t, a_prev, eta=0.5).std == pytest.approx(0.5 * math.sqrt(0.375), rel=1e-6)
    assert ddim_constants(a_t, a_prev, eta=0.0).std == 0.0


def _scheduler_pair(num_steps=10, **overrides):
    scheduler = DDIMScheduler(**{**SD_SCHEDULER_CONFIG, **overrides})
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize(
    "overrides", [{}, {"prediction_type": "v_prediction"}, {"clip_sample": True}, {"set_alpha_to_one": True}]
)
@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_ddim_step_with_fixed_noise_equals_diffusers(overrides, eta):
    scheduler = _scheduler_pair(**overrides)
    g = torch.Generator().manual_seed(2)
    x_t, output, noise = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    step_ratio = 1000 // 10
    for t in scheduler.timesteps.tolist():
        prev = t - step_ratio
        a_t = scheduler.alphas_cumprod[t].item()
        a_prev = (scheduler.alphas_cumprod[prev] if prev >= 0 else scheduler.final_alpha_cumprod).item()
        ours = ddim_step(
            output,
            x_t,
            ddim_constants(a_t, a_prev, eta),
            prediction_type=scheduler.config.prediction_type,
            scheduler_config=dict(scheduler.config),
            noise=noise,
        )
        ref = scheduler.step(output, t, x_t, eta=eta, variance_noise=noise)
        assert torch.allclose(ours.prev_sample, ref.prev_sample, atol=1e-6), t
        assert torch.allclose(ours.pred_x0, ref.pred_original_sample, atol=1e-6), t
        # the mean is diffusers' step without noise
        ref_mean = scheduler.step(output, t, x_t, eta=eta, variance_noise=torch.zeros_like(noise)).prev_sample
        assert torch.allclose(ours.mean, ref_mean, atol=1e-6), t


def test_ddim_step_log_prob_equals_closed_form_gaussian():
    g = torch.Generator().manual_seed(3)
    x_t, eps = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    a_t, a_prev, eta = 0.25, 0.6, 1.0
    x_prev = torch.randn(3, 4, 4, 4, generator=g)
    ours = ddim_step(eps, x_t, ddim_constants(a_t, a_prev, eta), prev_sample=x_prev)
    # by hand, in float64
    x_t64, eps64 = x_t.double(), eps.double()
    pred_x0 = (x_t64 - math.sqrt(1 - a_t) * eps64) / math.sqrt(a_t)
    sigma = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    mean = math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev - sigma**2) * eps64
    log_density = -((x_prev.double() - mean) ** 2) / (2 * sigma**2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
    expected = log_density.mean(dim=(1, 2, 3))
    assert torch.allclose(ours.log_prob.double(), expected, atol=1e-5)
    assert torch.allclose(ours.mean.double(), mean, atol=1e-5)
    assert ours.std.item() == pytest.approx(sigma, rel=1e-6)
    assert torch.equal(ours.prev_sample, x_prev)


def test_ddim_step_without_noise_at_positive_eta_fails():
    c = ddim_constants(0.25, 0.6, 1.0)
    with pytest.raises(ValueError, match="noise"):
        ddim_step(torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2), c)


def test_lcm_constants_match_the_boundary_condition_formula():
    t = 499
    s = t * 10.0
    c = lcm_constants(t, 0.3, 0.6)
    assert c.c_skip == pytest.approx(0.25 / (s**2 + 0.25), rel=1e-6)
    assert c.c_out == pytest.approx(s / math.sqrt(s**2 + 0.25), rel=1e-6)
    assert c.std == pytest.approx(math.sqrt(1 - 0.6), rel=1e-6)
    assert c.sqrt_alpha_next == pytest.approx(math.sqrt(0.6), rel=1e-6)
    last = lcm_constants(t, 0.3, None)
    assert last.std == 0.0


def test_lcm_step_equals_diffusers_lcm_scheduler_step():
    scheduler = LCMScheduler(**{**SD_SCHEDULER_CONFIG, "steps_offset": 0})
    scheduler.set_timesteps(4)
    timesteps = scheduler.timesteps.tolist()
    g = torch.Generator().manual_seed(4)
    x_t, output = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(timesteps):
        a_next = scheduler.alphas_cumprod[timesteps[i + 1]].item() if i + 1 < len(timesteps) else None
        noise = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(10 + i))
        ref = scheduler.step(output, t, x_t, generator=torch.Generator().manual_seed(10 + i))
        ours = lcm_step(output, x_t, lcm_constants(t, scheduler.alphas_cumprod[t].item(), a_next), noise=noise)
        assert torch.allclose(ours.prev_sample, ref.prev_sample, atol=1e-6), t
        assert torch.allclose(ours.pred_x0, ref.denoised, atol=1e-6), t
        if a_next is None:
            assert torch.equal(ours.prev_sample, ours.pred_x0) and ours.log_prob.abs().max() == 0
        else:
            expected = torch.distributions.Normal(ours.mean, math.sqrt(1 - a_next)).log_prob(ref.prev_sample)
            assert torch.allclose(ours.log_prob, expected.mean(dim=(1, 2, 3)), atol=1e-5)


def test_grad_policy_kept_steps():
    assert GradPolicy().kept_steps(5) == []
    assert GradPolicy("all").kept_steps(3) == [0, 1, 2]
    assert GradPolicy("last", k=2).kept_steps(5) == [3, 4]
    assert GradPolicy("last", k=9).kept_steps(3) == [0, 1, 2]
    picked = GradPolicy("random", k=3).kept_steps(10, generator=torch.Generator().manual_seed(0))
    assert len(set(picked)) == 3 and picked == sorted(picked) and all(0 <= i < 10 for i in picked)
    lengths = {len(GradPolicy("random_last", k=3).kept_steps(10)) for _ in range(200)}
    assert lengths == {1, 2, 3}
    for _ in range(20):
        steps = GradPolicy("random_last", k=3).kept_steps(10)
        assert steps == list(range(10 - len(steps), 10))
    with pytest.raises(UserError, match="keep"):
        GradPolicy("first")
    with pytest.raises(UserError, match="k=0"):
        GradPolicy("last", k=0)


def _trajectory(batch, seed_offset=0):
    return Trajectory(
        latents=torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1, 1).expand(batch, 3, 4, 2, 2).clone(),
        timesteps=torch.tensor([10, 0]),
        log_probs=torch.arange(batch * 2, dtype=torch.float32).view(batch, 2),
        prompt_embeds=torch.arange(batch, dtype=torch.float32).view(batch, 1, 1).expand(batch, 3, 5).clone(),
        prompts=[f"p{i + seed_offset}" for i in range(batch)],
        seeds=[i + seed_offset for i in range(batch)],
        guidance_scale=5.0,
        eta=1.0,
        num_steps=2,
        sampler="ddim",
    )


def test_trajectory_select_and_cat():
    traj = _trajectory(4)
    sub = traj.select([3, 1, 1])
    assert sub.prompts == ["p3", "p1", "p1"] and sub.seeds == [3, 1, 1]
    assert sub.latents[:, 0, 0, 0, 0].tolist() == [3.0, 1.0, 1.0]
    assert sub.log_probs.tolist() == [[6.0, 7.0], [2.0, 3.0], [2.0, 3.0]]
    assert sub.negative_prompt_embeds is None and len(sub) == 3
    both = Trajectory.cat([traj, _trajectory(2, seed_offset=10)])
    assert len(both) == 6 and both.seeds == [0, 1, 2, 3, 10, 11] and both.prompts[-1] == "p11"
    assert both.prompt_embeds[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0]
    other = _trajectory(2)
    other.eta = 0.0
    with pytest.raises(ValueError, match="different settings"):
        Trajectory.cat([traj, other])
