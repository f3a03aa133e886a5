"""DRaFT's math against closed forms: the truncated gradient of a linear chain, checkpointing, DRaFT-LV's estimator.

The chain tests run the real `DDIMSampler` (η = 0) on an analytic "UNet" whose prediction is linear in x_t with
scalar weights, ε̂_i(x) = (w_i + u)·x + c at sampling step i, so one DDIM step is affine:

    x_{i+1} = A_i x_i + B_i ε̂_i(x_i),  A_i = √ᾱ_prev / √ᾱ,  B_i = √(1 − ᾱ_prev) − √ᾱ_prev √(1 − ᾱ) / √ᾱ

(DDIM eq. 12 with σ = 0). With the quadratic reward r(x0) = −mean_d (x0 − y)², the gradient of
L = −mean_b r_b is worked out below by the chain rule in float64, from ᾱ values computed here from the SD 1.x beta
schedule; nothing of it comes from the code under test. Truncation (GradPolicy) means: at a kept step i the model
output depends on θ and on x_i, so ∂x_{i+1}/∂x_i = A_i + B_i (w_i + u); before the first kept step nothing carries
a graph.
"""

import math

import pytest
import torch

from diffrl.errors import UserError
from diffrl.models.unet import add_noise
from diffrl.trainers.draft import (
    DRaFTConfig,
    check_train,
    draft_loss,
    draw_normal_cutoff,
    final_step_noise_level,
    grad_policy,
    lv_reward,
    normal_cutoff_pmf,
    one_step_denoise,
)
from samplers.ddim import DDIMSampler
from samplers.testing import SD_SCHEDULER_CONFIG

T = 4  # sampling steps
W0 = [0.30, -0.20, 0.50, 0.15]  # w_i per step
U0, C0 = 0.10, 0.05  # shared weight and bias
SHAPE = (2, 4, 2, 2)  # [B, C, h, w]


def sd_alphas_cumprod() -> list[float]:
    """ᾱ_t of SD 1.x's scaled-linear schedule, β_t = (√0.00085 + t/999 · (√0.012 − √0.00085))², ᾱ_t = Π(1 − β),
    rounded to float32 the way the scheduler stores them: near t = 0, 1 − ᾱ is ~1e-3, so float32 ᾱ carries only
    ~4 significant digits of it, and the last DDIM step's coefficients inherit that."""
    lo, hi = math.sqrt(0.00085), math.sqrt(0.012)
    betas = torch.linspace(lo, hi, 1000, dtype=torch.float32) ** 2
    return torch.cumprod(1 - betas, dim=0).double().tolist()


ALPHAS = sd_alphas_cumprod()
# DDIM "leading" spacing with steps_offset=1, T = 4: t_i = 250·(3 − i) + 1; the previous timestep is t − 250, and
# past the start of the schedule ᾱ_prev = ᾱ_0 (set_alpha_to_one=False)
TIMESTEPS = [751, 501, 251, 1]
ALPHA_T = [ALPHAS[t] for t in TIMESTEPS]
ALPHA_PREV = [ALPHAS[t - 250] if t >= 250 else ALPHAS[0] for t in TIMESTEPS]


def step_coefficients(i: int) -> tuple[float, float]:
    a, a_prev = ALPHA_T[i], ALPHA_PREV[i]
    return math.sqrt(a_prev / a), math.sqrt(1 - a_prev) - math.sqrt(a_prev) * math.sqrt(1 - a) / math.sqrt(a)


def closed_form(x_T: torch.Tensor, y: torch.Tensor, kept: set[int]) -> dict:
    """Loss and gradients of L = mean_b mean_d (x0 − y)² for the linear chain, by hand (float64)."""
    x = x_T.double()
    xs = [x]
    for i in range(T):
        a, b = step_coefficients(i)
        x = (a + b * (W0[i] + U0)) * x + b * C0
        xs.append(x)
    n = x.numel()
    loss = ((x - y.double()) ** 2).sum() / n
    g = 2 * (x - y.double()) / n  # ∂L/∂x0
    grads = {"w": [None] * T, "u": 0.0, "c": 0.0}
    for i in reversed(range(min(kept), T)):
        a, b = step_coefficients(i)
        if i in kept:
            grads["w"][i] = float((g * b * xs[i]).sum())
            grads["u"] += float((g * b * xs[i]).sum())
            grads["c"] += float((g * b).sum())
            g = g * (a + b * (W0[i] + U0))
        else:  # the model output is a constant: only the skip term A_i x_i carries the gradient on
            g = g * a
    grads["loss"] = float(loss)
    return grads


class _Config(dict):
    __getattr__ = dict.__getitem__


class LinearEps(torch.nn.Module):
    """ε̂(x_t, t) = (w_i + u)·x_t + c, with i the sampling step whose model timestep is t."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(w)) for w in W0])
        self.u = torch.nn.Parameter(torch.tensor(U0))
        self.c = torch.nn.Parameter(torch.tensor(C0))
        self.step_of = {t: i for i, t in enumerate(TIMESTEPS)}
        self.config = _Config(sample_size=SHAPE[2], in_channels=SHAPE[1], time_cond_proj_dim=None,
                              addition_embed_type=None)
        self.calls = 0

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, x, t, return_dict=False, encoder_hidden_states=None):
        self.calls += 1
        i = self.step_of[int(t)]
        return ((self.w[i] + self.u) * x + self.c,)


class ToyPipe:
    """Just what `DDIMSampler.sample` reads from a pipeline, around the analytic model."""

    vae_scale_factor = 1

    def __init__(self):
        from diffusers import DDIMScheduler

        self.unet = LinearEps()
        self.scheduler = DDIMScheduler(**SD_SCHEDULER_CONFIG)

    def encode_prompt(self, prompt, device, num_images_per_prompt, do_classifier_free_guidance, negative_prompt,
                      prompt_embeds, negative_prompt_embeds):
        return prompt_embeds, None


def start_and_target():
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE[1:], generator=g)


def sampled_grads(tc: DRaFTConfig, *, seed: int = 0):
    """Sample the toy chain with the config's GradPolicy, backpropagate draft_loss; return traj, loss, grads, pipe."""
    pipe = ToyPipe()
    x_T, y = start_and_target()
    torch.manual_seed(seed)  # random_last and normal_cutoff draw K from the global generator
    traj = DDIMSampler().sample(
        pipe, None, prompt_embeds=torch.zeros(SHAPE[0], 1, 1), num_steps=T, guidance_scale=1.0, eta=0.0,
        latents=x_T, seeds=[0, 1], output="latents", grad=grad_policy(tc, decode=False, num_steps=T),
    )
    rewards = -((traj.final_latents - y) ** 2).mean(dim=(1, 2, 3))
    loss, _ = draft_loss(rewards)
    forward_calls = pipe.unet.calls
    loss.backward()
    m = pipe.unet
    grads = {"w": [None if p.grad is None else p.grad.item() for p in m.w], "u": m.u.grad.item(),
             "c": m.c.grad.item(), "loss": loss.item(), "backward_calls": m.calls - forward_calls}
    return traj, grads


def assert_matches(grads: dict, expected: dict, rel: float = 1e-5):
    for name in ("loss", "u", "c"):
        assert grads[name] == pytest.approx(expected[name], rel=rel), name
    for i, (got, want) in enumerate(zip(grads["w"], expected["w"])):
        if want is None:
            assert got is None, f"w[{i}] is used only before the kept steps and must get no gradient"
        else:
            assert got == pytest.approx(want, rel=rel), f"w[{i}]"


def test_the_sampler_runs_the_schedule_the_closed_form_assumes():
    pipe = ToyPipe()
    schedule = DDIMSampler().schedule(pipe, T)
    assert schedule.timesteps.tolist() == TIMESTEPS
    assert schedule.alphas_cumprod == pytest.approx(ALPHA_T, rel=1e-6)
    assert schedule.alphas_cumprod_prev == pytest.approx(ALPHA_PREV, rel=1e-6)


@pytest.mark.parametrize("truncation,k", [("last", 1), ("last", 2), ("last", 3), ("full", 1)])
def test_truncated_gradient_equals_the_closed_form(truncation, k):
    _, grads = sampled_grads(DRaFTConfig(truncation=truncation, k=k, checkpointing=False))
    kept = set(range(T)) if truncation == "full" else set(range(T - k, T))
    assert_matches(grads, closed_form(*start_and_target(), kept))


def test_gradient_reaches_only_the_last_k_steps():
    traj, grads = sampled_grads(DRaFTConfig(truncation="last", k=2, checkpointing=False))
    assert traj.grad_steps == [2, 3]
    assert grads["w"][0] is None and grads["w"][1] is None
    assert grads["w"][2] != 0 and grads["w"][3] != 0
    # DRaFT-K's gradient of a shared weight is a truncated sum, visibly not the full one (so the check can fail)
    full = closed_form(*start_and_target(), set(range(T)))
    assert abs(grads["u"] - full["u"]) > 0.05 * abs(full["u"])


@pytest.mark.parametrize("truncation,k", [("last", 2), ("full", 1)])
def test_checkpointing_gives_the_same_gradient(truncation, k):
    _, plain = sampled_grads(DRaFTConfig(truncation=truncation, k=k, checkpointing=False))
    _, checkpointed = sampled_grads(DRaFTConfig(truncation=truncation, k=k, checkpointing=True))
    kept = T if truncation == "full" else k
    assert plain["backward_calls"] == 0
    assert checkpointed["backward_calls"] == kept  # the backward pass re-ran every kept model call
    for name in ("u", "c", "loss"):
        assert checkpointed[name] == pytest.approx(plain[name], rel=1e-6, abs=1e-9)
    for got, want in zip(checkpointed["w"], plain["w"]):
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_random_last_keeps_a_suffix_and_its_gradient_is_that_suffix_s():
    seen = set()
    for seed in range(12):
        traj, grads = sampled_grads(DRaFTConfig(truncation="random_last", k=3, checkpointing=False), seed=seed)
        kept = traj.grad_steps
        assert 1 <= len(kept) <= 3 and kept == list(range(T - len(kept), T))
        assert_matches(grads, closed_form(*start_and_target(), set(kept)))
        seen.add(len(kept))
    assert seen == {1, 2, 3}  # K ~ U{1..3} per batch (seeded: these 12 draws cover every K)


def test_normal_cutoff_keeps_a_suffix_and_its_gradient_is_that_suffix_s():
    seen = set()
    for seed in range(12):
        traj, grads = sampled_grads(DRaFTConfig(truncation="normal_cutoff", checkpointing=False), seed=seed)
        kept = traj.grad_steps
        assert 1 <= len(kept) <= T - 1 and kept == list(range(T - len(kept), T))
        assert_matches(grads, closed_form(*start_and_target(), set(kept)))
        seen.add(len(kept))
    assert seen == {1, 2}  # on 4 steps μ = 3.36, σ = 0.4: K = 1 (p 0.81) or 2 (p 0.19); 3 has p 4e-4


def test_grad_policy_maps_the_config():
    assert grad_policy(DRaFTConfig(truncation="full")).keep == "all"
    p = grad_policy(DRaFTConfig(truncation="last", k=3, checkpointing=False), decode=False)
    assert (p.keep, p.k, p.checkpoint, p.decode) == ("last", 3, False, False)
    assert grad_policy(DRaFTConfig(truncation="random_last", k=5)).keep == "random_last"
    # DRaFT-LV: the rollout keeps no graph; lv_reward's one-step denoisings carry the gradient
    assert grad_policy(DRaFTConfig(lv_samples=2)).keep == "none"
    # normal_cutoff: a suffix of the drawn length, drawn per call (per batch)
    tc = DRaFTConfig(truncation="normal_cutoff")
    ks = {grad_policy(tc, num_steps=50, generator=torch.Generator().manual_seed(s)).k for s in range(20)}
    assert len(ks) > 3 and all(1 <= k <= 49 for k in ks)
    assert grad_policy(tc, num_steps=50).keep == "last"
    with pytest.raises(ValueError, match="num_steps"):
        grad_policy(tc)


def test_normal_cutoff_pmf_golden():
    # worked by hand from a table of Φ: on 50 steps, N(42, 5) conditioned on [1, 50) has mass
    # Φ(1.6) − Φ(−8.2) = 0.945201; K = 50 − ⌊z⌋, so P(K = 8) = P(42 <= z < 43) = (Φ(0.2) − Φ(0)) / 0.945201 and
    # P(K = 1) = P(49 <= z < 50) = (Φ(1.6) − Φ(1.4)) / 0.945201
    pmf = normal_cutoff_pmf(50)
    assert pmf.shape == (50,) and float(pmf.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(pmf[8 - 1]) == pytest.approx((0.579260 - 0.5) / 0.945201, abs=2e-6)
    assert float(pmf[1 - 1]) == pytest.approx((0.945201 - 0.919243) / 0.945201, abs=2e-6)
    assert float(pmf[-1]) == 0.0  # the first step never keeps a graph: b >= 1
    # on 10 steps, μ = 8.4 and σ = 1 (scaled by 10/50): P(K = 1) = P(9 <= z < 10) = (Φ(1.6) − Φ(0.6)) / Φ(1.6)
    pmf10 = normal_cutoff_pmf(10)
    assert float(pmf10[0]) == pytest.approx((0.945201 - 0.725747) / 0.945201, abs=2e-6)
    assert float(pmf10.sum()) == pytest.approx(1.0, abs=1e-12)


def test_draw_normal_cutoff_stays_in_its_support():
    g = torch.Generator().manual_seed(0)
    for steps in (2, 4, 10, 50, 100):
        ks = [draw_normal_cutoff(steps, generator=g) for _ in range(300)]
        assert 1 <= min(ks) and max(ks) <= steps - 1
    assert {draw_normal_cutoff(2, generator=g) for _ in range(10)} == {1}


# ------------------------------------------------------------------------------------------------ the loss


def test_draft_loss_is_the_negative_mean_reward():
    # r = [1, 2, 6]: mean 3; population std √((4 + 1 + 9)/3) = √(14/3)
    r = torch.tensor([1.0, 2.0, 6.0], requires_grad=True)
    loss, stats = draft_loss(r)
    assert loss.item() == -3.0
    assert stats["reward_std"].item() == pytest.approx(math.sqrt(14 / 3))
    assert (stats["reward_min"].item(), stats["reward_max"].item()) == (1.0, 6.0)
    loss.backward()
    assert r.grad.tolist() == pytest.approx([-1 / 3] * 3)  # ∂(−mean)/∂r_i = −1/B
    scaled, _ = draft_loss(torch.tensor([1.0, 2.0, 6.0]), reward_scale=0.5)
    assert scaled.item() == -1.5
    _, one = draft_loss(torch.tensor([4.0]))
    assert one["reward_std"].item() == 0.0


# ------------------------------------------------------------------------------------------------ DRaFT-LV


def test_one_step_denoise_inverts_the_noising_by_hand():
    # x0 = 1, ε = 0.5, ᾱ = 0.64 (√ᾱ = 0.8, √(1−ᾱ) = 0.6): x_t = 0.8 + 0.3 = 1.1;
    # ε-pred: (1.1 − 0.6·0.5)/0.8 = 1;  v = 0.8·0.5 − 0.6·1 = −0.2, v-pred: 0.8·1.1 − 0.6·(−0.2) = 1
    x_t = torch.tensor([[1.1]])
    assert one_step_denoise(x_t, torch.tensor([[0.5]]), 0.64).item() == pytest.approx(1.0, rel=1e-6)
    assert one_step_denoise(x_t, torch.tensor([[-0.2]]), 0.64, "v_prediction").item() == pytest.approx(1.0, rel=1e-6)
    # a wrong ε̂ moves x̂0 by −√(1−ᾱ)/√ᾱ per unit: ε̂ = 1.5 gives 1 − 0.75 = 0.25
    assert one_step_denoise(x_t, torch.tensor([[1.5]]), 0.64).item() == pytest.approx(0.25, rel=1e-6)


def test_final_step_noise_level_is_the_last_sampling_step():
    # SD's 50-step DDIM ends at model timestep 1 (the paper's t = 1); ᾱ_1 = (1 − β_0)(1 − β_1)
    schedule = DDIMSampler().schedule(ToyPipe(), 50)
    t, alpha_bar = final_step_noise_level(schedule.timesteps, ToyPipe().scheduler.alphas_cumprod)
    assert t == 1
    assert alpha_bar == pytest.approx(ALPHAS[1], rel=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_lv_estimator_is_unbiased(prediction_type):
    """Linear model output m̂ = θ·x_t, quadratic reward r(x) = −mean_d (x − y)².

    With a = √ᾱ, s = √(1 − ᾱ): x_t = a x0 + s ε and x̂0 = κ x_t, where κ = (1 − sθ)/a (ε-pred) or a − sθ (v-pred).
    Per dimension E[(κ(a x0 + s ε) − y)²] = (κ a x0 − y)² + κ² s², so
        E[r] = −mean_d [(κ a x0 − y)² + κ² s²],   dE[r]/dθ = −mean_d [2(κ a x0 − y) a x0 + 2 κ s²] · dκ/dθ,
    with dκ/dθ = −s/a (ε) or −s (v). Each batch row gets its own copy of θ, so one backward gives M independent
    per-row gradients of the n = 2 estimator; their mean must sit within 4 standard errors of the closed form.
    """
    M, n, D = 20000, 2, 3
    alpha_bar, theta = 0.7, 0.4
    a, s = math.sqrt(alpha_bar), math.sqrt(1 - alpha_bar)
    x0_row, y = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 0.0, -0.5])
    x0 = x0_row.expand(M, D).reshape(M, D, 1, 1).clone().requires_grad_(True)  # a graph that must be cut
    thetas = torch.full((M,), theta, dtype=torch.float64, requires_grad=True)
    noise = torch.randn(n, M, D, 1, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def predict_noise(x_t, t):
        assert t == 7
        return thetas.view(M, 1, 1, 1) * x_t

    def reward_fn(latents):
        return -((latents.view(M, D) - y.double()) ** 2).mean(dim=1)

    rewards = lv_reward(x0.double(), noise, renoise=lambda x, e: add_noise(x, e, alpha_bar),
                        denoise=lambda x: one_step_denoise(x, predict_noise(x, 7), alpha_bar, prediction_type),
                        reward_fn=reward_fn)
    rewards.sum().backward()
    assert x0.grad is None  # x0 is under stop-gradient (Algorithm 2)

    kappa, dkappa = ((1 - s * theta) / a, -s / a) if prediction_type == "epsilon" else (a - s * theta, -s)
    x0d, yd = x0_row.double(), y.double()
    expected_r = -((kappa * a * x0d - yd) ** 2 + kappa**2 * s**2).mean().item()
    expected_g = (-(2 * (kappa * a * x0d - yd) * a * x0d + 2 * kappa * s**2).mean() * dkappa).item()

    r, g = rewards.detach(), thetas.grad
    assert abs(r.mean().item() - expected_r) < 4 * r.std().item() / math.sqrt(M)
    assert abs(g.mean().item() - expected_g) < 4 * g.std().item() / math.sqrt(M)
    # the check has teeth: the gradient at the noise-free point (ε = 0) is off by far more than the tolerance
    biased = (-(2 * (kappa * a * x0d - yd) * a * x0d).mean() * dkappa).item()
    assert abs(biased - expected_g) > 20 * g.std().item() / math.sqrt(M)


def test_lv_reward_averages_the_n_draws():
    # identity reward on 1-d latents, ε̂ = 0: x̂0 = x_t/√ᾱ = x0 + (s/a)·ε, so the mean over n draws is
    # x0 + (s/a)·mean_i ε_i; with ε = (1, 3) and ᾱ = 0.5 (s/a = 1): 2 + 2 = 4
    x0 = torch.tensor([[2.0]])
    noise = torch.tensor([[[1.0]], [[3.0]]])
    out = lv_reward(x0, noise, renoise=lambda x, e: add_noise(x, e, 0.5),
                    denoise=lambda x: one_step_denoise(x, torch.zeros_like(x), 0.5), reward_fn=lambda z: z[:, 0])
    assert out.tolist() == pytest.approx([4.0])


# ------------------------------------------------------------------------------------------------ check


@pytest.mark.parametrize("kwargs,context,expected", [
    ({"lv_samples": 2, "k": 2}, {}, "train.truncation=last and train.k=1"),
    ({"lv_samples": 2, "truncation": "full"}, {}, "train.truncation=last and train.k=1"),
    ({"lv_samples": 2, "truncation": "random_last", "k": 3}, {}, "train.truncation=last and train.k=1"),
    ({"truncation": "full", "k": 3}, {}, "no effect with train.truncation=full"),
    ({"k": 0}, {}, "train.k must be >= 1"),
    ({"truncation": "first"}, {}, "train.truncation must be one of"),
    ({"lv_samples": -1}, {}, "train.lv_samples must be >= 0"),
    ({"reward_scale": -1.0}, {}, "train.reward_scale must be a positive number"),
    ({"reward_scale": float("nan")}, {}, "train.reward_scale must be a positive number"),
    ({"k": 5}, {"num_steps": 4}, "more than the 4 sampling steps"),
    ({}, {"reward_differentiable": False}, "not differentiable"),
    ({"truncation": "normal_cutoff", "k": 3}, {}, "no effect with train.truncation=normal_cutoff"),
    ({"cutoff_mean": 30.0}, {}, "apply to train.truncation=normal_cutoff"),
    ({"truncation": "normal_cutoff", "cutoff_std": 0.0}, {}, "train.cutoff_std must be in (0, 50]"),
    ({"truncation": "normal_cutoff", "cutoff_mean": 50.0}, {}, "train.cutoff_mean must be in (0, 50)"),
    ({"truncation": "normal_cutoff", "cutoff_mean": float("nan")}, {}, "train.cutoff_mean must be in (0, 50)"),
    ({"truncation": "normal_cutoff"}, {"num_steps": 1}, "needs at least 2 sampling steps"),
    ({"truncation": "normal_cutoff", "cutoff_mean": 4.0}, {"num_steps": 10}, "use at least 5"),
    ({"truncation": "normal_cutoff", "lv_samples": 2}, {}, "train.truncation=last and train.k=1"),
])
def test_check_refuses_bad_combinations_in_one_line(kwargs, context, expected):
    with pytest.raises(UserError) as info:
        check_train(DRaFTConfig(**kwargs), **context)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_check_accepts_the_paper_variants():
    for tc in (DRaFTConfig(), DRaFTConfig(truncation="full"), DRaFTConfig(truncation="last", k=10),
               DRaFTConfig(truncation="random_last", k=50), DRaFTConfig(lv_samples=2),
               DRaFTConfig(truncation="normal_cutoff"), DRaFTConfig(truncation="normal_cutoff", cutoff_mean=30.0)):
        check_train(tc, num_steps=50, reward_differentiable=True)
