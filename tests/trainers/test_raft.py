"""RAFT's pure pieces against hand-worked cases and against diffusers' own noising (an independent reference)."""

import math

import pytest
import torch

from diffrl.errors import UserError
from diffrl.models.unet import add_noise, denoising_target
from diffrl.trainers.raft import (
    RAFTConfig,
    check_train,
    drop_prompts,
    raft_loss,
    select_kept,
)

NAN, INF = float("nan"), float("inf")

# ------------------------------------------------------------------------------------------------ selection

# three prompts: group 0 = samples 0-2, group 1 = 3-5 (a tie at 0.7 and a NaN), group 2 = 6-7
REWARDS = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.7, NAN, 0.2, 0.3])
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("keep,expected", [
    (1, [1, 3, 7]),  # 0.9 | 0.7 vs 0.7: the lower index, 3 | 0.3
    (2, [1, 2, 3, 4, 6, 7]),  # 0.9, 0.5 | both 0.7s (the NaN never) | both
    (3, [0, 1, 2, 3, 4, 6, 7]),  # group 1 has only two finite rewards, so it keeps two
])
def test_per_prompt_keeps_each_prompts_best(keep, expected):
    assert select_kept(REWARDS, GROUPS, mode="per_prompt", keep_per_prompt=keep).tolist() == expected


def test_per_prompt_with_interleaved_groups_and_a_tensor_of_ids():
    # group 1 = samples 0 and 2 (tied at 5: keep 0), group 0 = samples 1 and 3 (keep 3, reward 2)
    kept = select_kept(torch.tensor([5.0, 1.0, 5.0, 2.0]), torch.tensor([1, 0, 1, 0]), mode="per_prompt")
    assert kept.tolist() == [0, 3] and kept.dtype == torch.long


def test_per_prompt_threshold():
    # min_reward 0.6: group 2's best (0.3) is below it, so that prompt contributes nothing this round
    assert select_kept(REWARDS, GROUPS, mode="per_prompt", min_reward=0.6).tolist() == [1, 3]
    # the threshold is inclusive: r >= 0.7 keeps the 0.7s
    assert select_kept(REWARDS, GROUPS, mode="per_prompt", keep_per_prompt=2, min_reward=0.7).tolist() == [1, 3, 4]


# N = 10 with a NaN and both infinities; finite ones ranked: 0.9 (1), 0.9 (3), 0.8 (8), 0.7 (5), 0.5 (0), 0.3 (7),
# 0.1 (4)
GLOBAL = torch.tensor([0.5, 0.9, NAN, 0.9, 0.1, 0.7, INF, 0.3, 0.8, -INF])


@pytest.mark.parametrize("fraction,min_reward,expected", [
    (0.3, None, [1, 3, 8]),  # ceil(0.3·10) = 3; +inf is never kept
    (0.05, None, [1]),  # ceil(0.5) = 1: the tie at 0.9 goes to the lower index
    (0.4, None, [1, 3, 5, 8]),
    (0.3, 0.85, [1, 3]),  # the top 3, less those below the threshold
    (0.8, None, [0, 1, 3, 4, 5, 7, 8]),  # 8 places, only 7 finite rewards
    (1.0, None, [0, 1, 3, 4, 5, 7, 8]),
])
def test_global_keeps_the_top_fraction_of_the_round(fraction, min_reward, expected):
    kept = select_kept(GLOBAL, list(range(10)), mode="global", keep_fraction=fraction, min_reward=min_reward)
    assert kept.tolist() == expected


def test_global_count_is_not_fooled_by_float_rounding():
    # 0.07 · 100 = 7.000000000000001 in floating point; the top 7% of 100 samples is 7 samples
    kept = select_kept(torch.arange(100.0), [0] * 100, mode="global", keep_fraction=0.07)
    assert kept.tolist() == list(range(93, 100))


def test_global_ignores_prompts():
    # both winners come from prompt 0; per_prompt would take one from each
    rewards, groups = torch.tensor([3.0, 2.0, 1.0, 0.0]), [0, 0, 1, 1]
    assert select_kept(rewards, groups, mode="global", keep_fraction=0.5).tolist() == [0, 1]
    assert select_kept(rewards, groups, mode="per_prompt").tolist() == [0, 2]


def test_nothing_eligible_keeps_nothing():
    for mode in ("per_prompt", "global"):
        kept = select_kept(torch.tensor([NAN, NAN, INF]), [0, 0, 1], mode=mode)
        assert kept.tolist() == [] and kept.dtype == torch.long


def test_select_kept_rejects_bad_arguments():
    with pytest.raises(ValueError, match="group ids"):
        select_kept(torch.zeros(3), [0, 1], mode="global")
    with pytest.raises(ValueError, match="mode"):
        select_kept(torch.zeros(2), [0, 1], mode="best")
    with pytest.raises(ValueError, match="keep_fraction"):
        select_kept(torch.zeros(2), [0, 1], mode="global", keep_fraction=0.0)
    with pytest.raises(ValueError, match="keep_per_prompt"):
        select_kept(torch.zeros(2), [0, 1], mode="per_prompt", keep_per_prompt=0)


# ------------------------------------------------------------------------------------------------ noising and targets


def test_targets_by_hand():
    # x0 = 1, ε = 0.5; row 0 at ᾱ = 0.64 (√ᾱ = 0.8, √(1−ᾱ) = 0.6), row 1 at ᾱ = 0.36 (0.6, 0.8):
    # x_t = 0.8·1 + 0.6·0.5 = 1.1 and 0.6·1 + 0.8·0.5 = 1.0; v = 0.8·0.5 − 0.6·1 = −0.2 and 0.6·0.5 − 0.8·1 = −0.5
    x0, eps, alpha_bar = torch.ones(2, 1, 1, 1), torch.full((2, 1, 1, 1), 0.5), torch.tensor([0.64, 0.36])
    assert add_noise(x0, eps, alpha_bar).flatten().tolist() == pytest.approx([1.1, 1.0], rel=1e-6)
    assert denoising_target(x0, eps, alpha_bar, "v_prediction").flatten().tolist() == pytest.approx([-0.2, -0.5],
                                                                                                      rel=1e-6)
    assert torch.equal(denoising_target(x0, eps, alpha_bar, "epsilon"), eps)
    assert torch.equal(denoising_target(x0, eps, alpha_bar, "sample"), x0)
    # one number applies to every row
    assert add_noise(x0, eps, 0.64).flatten().tolist() == pytest.approx([1.1, 1.1], rel=1e-6)
    with pytest.raises(ValueError, match="prediction_type"):
        denoising_target(x0, eps, alpha_bar, "flow")


def test_targets_match_diffusers_add_noise_and_get_velocity():
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", prediction_type="v_prediction")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    timesteps = torch.tensor([0, 1, 500, 999])
    alpha_bar = scheduler.alphas_cumprod[timesteps]
    torch.testing.assert_close(add_noise(x0, noise, alpha_bar), scheduler.add_noise(x0, noise, timesteps),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(denoising_target(x0, noise, alpha_bar, "v_prediction"),
                               scheduler.get_velocity(x0, noise, timesteps), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_a_perfect_denoiser_has_zero_loss(prediction_type):
    # From x_t = a x0 + s ε alone (a = √ᾱ, s = √(1−ᾱ)) a model that knows x0 outputs ε = (x_t − a x0)/s, or
    # v = a ε − s x0 = (a x_t − a² x0 − s² x0)/s = (a x_t − x0)/s.
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    alpha_bar = torch.tensor([0.99, 0.5, 0.02])
    a, s = alpha_bar.sqrt().view(-1, 1, 1, 1), (1 - alpha_bar).sqrt().view(-1, 1, 1, 1)
    x_t = add_noise(x0, noise, alpha_bar)
    oracle = (x_t - a * x0) / s if prediction_type == "epsilon" else (a * x_t - x0) / s
    target = denoising_target(x0, noise, alpha_bar, prediction_type)
    loss, stats = raft_loss(oracle, target)
    assert loss.item() < 1e-10 and stats["denoise_mse"].item() < 1e-10
    # and one that confuses the noise level is not perfect (the check can fail)
    wrong = (x_t - a.flip(0) * x0) / s.flip(0) if prediction_type == "epsilon" else (a.flip(0) * x_t - x0) / s.flip(0)
    assert raft_loss(wrong, target)[0].item() > 1e-2


def test_raft_loss_by_hand():
    # B = 2 samples of D = 2 dims; pred = [[1, 2], [3, 4]], target 0: mse = [(1+4)/2, (9+16)/2] = [2.5, 12.5]
    pred = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(2, 2, 1, 1).requires_grad_(True)
    target = torch.zeros(2, 2, 1, 1)
    loss, stats = raft_loss(pred, target)
    assert loss.item() == pytest.approx(7.5) and stats["denoise_mse"].item() == pytest.approx(7.5)
    assert "reference_mse" not in stats
    # weights [1, 0] enter as given: (1·2.5 + 0·12.5)/2 = 1.25
    assert raft_loss(pred, target, weights=torch.tensor([1.0, 0.0]))[0].item() == pytest.approx(1.25)
    # reference = ones, weight 0.5: ref = [(0+1)/2, (4+9)/2] = [0.5, 6.5], mean 3.5 -> 7.5 + 0.5·3.5 = 9.25
    ref = torch.ones(2, 2, 1, 1, requires_grad=True)
    loss, stats = raft_loss(pred, target, ref_pred=ref, reference_weight=0.5)
    assert loss.item() == pytest.approx(9.25) and stats["reference_mse"].item() == pytest.approx(3.5)
    loss.backward()
    # ∂/∂pred = [2(p − 0) + 0.5·2(p − 1)] / (B·D = 4): p = 1, 2, 3, 4 -> 0.5, 1.25, 2.0, 2.75; the reference is constant
    assert pred.grad.flatten().tolist() == pytest.approx([0.5, 1.25, 2.0, 2.75])
    assert ref.grad is None
    # with weight 0 the reference is only reported
    loss, stats = raft_loss(pred, target, ref_pred=ref)
    assert loss.item() == pytest.approx(7.5) and stats["reference_mse"].item() == pytest.approx(3.5)
    with pytest.raises(ValueError, match="ref_pred"):
        raft_loss(pred, target, reference_weight=0.1)


def test_raft_loss_is_fp32_for_half_precision_predictions():
    pred = torch.full((1, 4, 2, 2), 300.0, dtype=torch.float16)  # 300² = 90000 overflows fp16 (max 65504)
    loss, _ = raft_loss(pred, torch.zeros(1, 4, 2, 2, dtype=torch.float16))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(90000.0)


# ------------------------------------------------------------------------------------------------ unconditional drop


def test_drop_prompts():
    cond, uncond = torch.ones(4000, 3, 2), torch.zeros(1, 3, 2)
    kept, dropped = drop_prompts(cond, uncond, fraction=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kept, cond) and not dropped.any()
    everything, dropped = drop_prompts(cond, uncond, fraction=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(everything, torch.zeros_like(cond)) and dropped.all()
    embeds, dropped = drop_prompts(cond, uncond, fraction=0.25, generator=torch.Generator().manual_seed(0))
    # a dropped row is exactly the unconditional one, a kept row exactly its prompt's
    assert torch.equal(embeds[dropped], torch.zeros_like(embeds[dropped]))
    assert torch.equal(embeds[~dropped], cond[~dropped])
    se = math.sqrt(0.25 * 0.75 / 4000)
    assert abs(dropped.double().mean().item() - 0.25) < 4 * se
    again, _ = drop_prompts(cond, uncond, fraction=0.25, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, embeds)


# ------------------------------------------------------------------------------------------------ check


@pytest.mark.parametrize("kwargs,expected", [
    ({"selection": "best"}, "train.selection must be one of"),
    ({"samples_per_prompt": 0}, "must be >= 1"),
    ({"batch_size": 0}, "must be >= 1"),
    ({"finetune_epochs": 0}, "must be >= 1"),
    ({"keep_per_prompt": 11}, "train.keep_per_prompt must be in 1..train.samples_per_prompt (10)"),
    ({"keep_per_prompt": 0}, "train.keep_per_prompt must be in"),
    ({"keep_per_prompt": 10}, "nothing is selected"),
    ({"keep_fraction": 0.2}, "train.keep_fraction applies to train.selection=global"),
    ({"selection": "global", "keep_per_prompt": 2}, "train.keep_per_prompt applies to train.selection=per_prompt"),
    ({"selection": "global", "keep_fraction": 0.0}, "train.keep_fraction must be in (0, 1]"),
    ({"selection": "global", "keep_fraction": 1.0}, "nothing is selected"),
    ({"min_reward": float("nan")}, "train.min_reward must be a finite number"),
    ({"fit": "conditional", "uncond_fraction": 1.0}, "train.uncond_fraction must be in [0, 1)"),
    ({"reference_weight": -0.1}, "train.reference_weight must be >= 0"),
    ({"fit": "uncond"}, "train.fit must be one of"),
    ({"uncond_fraction": 0.2}, "train.uncond_fraction applies to train.fit=conditional"),
])
def test_check_refuses_in_one_line(kwargs, expected):
    with pytest.raises(UserError) as info:
        check_train(RAFTConfig(**kwargs))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_check_accepts_sensible_configs():
    for tc in (RAFTConfig(), RAFTConfig(samples_per_prompt=4, keep_per_prompt=2),
               RAFTConfig(selection="global", keep_fraction=0.25), RAFTConfig(keep_per_prompt=10, min_reward=0.5),
               RAFTConfig(fit="conditional", uncond_fraction=0.0, reference_weight=1.0)):
        check_train(tc)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_guided_fit_regresses_the_samplers_own_guided_prediction(tmp_path, scale):
    # train.fit=guided: the prediction fitted is ε_u + s·(ε_c − ε_u) of two separate UNet calls (one per branch,
    # each sample with its own t), the function the sampler ran; s <= 1 (no CFG) is the conditional call alone
    from pg_helpers import tiny_pipeline_dir

    from diffrl.models import model_family
    from diffrl.pipelines import load_pipeline

    pipe = load_pipeline(str(tiny_pipeline_dir(tmp_path)))
    family = model_family(pipe)
    cond, _ = family.encode(["a red circle", "a blue square"], guidance_scale=scale, height=16, width=16)
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([10, 700])
    with torch.no_grad():
        got = family.model_output(x_t, t, cond, scale)
        c = torch.stack([pipe.unet(x_t[i:i + 1], t[i:i + 1], encoder_hidden_states=cond.prompt_embeds[i:i + 1]).sample[0]
                         for i in range(2)])
        if scale > 1:
            u = torch.stack([pipe.unet(x_t[i:i + 1], t[i:i + 1],
                                       encoder_hidden_states=cond.negative_prompt_embeds[i:i + 1]).sample[0]
                             for i in range(2)])
            expected = u + scale * (c - u)
        else:
            expected = c
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
