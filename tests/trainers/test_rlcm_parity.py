"""RLCM's step policy and loss against numbers computed by the reference code (github.com/Owen-Oertell/rlcm).

`data/rlcm_reference.json` holds only numbers, with the commit and the file each came from (its `source` entry), all
at b8330ed: `lcm_rl_pytorch/diffusers_patch/lcm_scheduler.py`'s `LCMScheduler.set_timesteps` and `.step` (x_τ', x̂0
"denoised", log-prob, and the ᾱ_τ, ᾱ_τ', c_skip, c_out it used; steps 0, 4, 6 and 7 of 8 with 50 original steps, an
LCM-Dreamshaper-v7 scheduler config) and `core/ppo_training_loop.py`'s per-sample log-prob loop and PPO lines (loss,
approx_kl, clipfrac, gradient w.r.t. the model output), run once on fixed-seed inputs (stored too). RLCM's objective
is DDPO's (the same lines as ddpo-pytorch's `train.py`; diffrl runs it as the `ddpo` trainer with `sample.sampler:
lcm`); its stat tracker is a copy of ddpo-pytorch's (`test_ddpo_parity.py`).

Checked: `samplers.lcm.lcm_step` on the reference's schedule draws the reference's x_τ' with the same noise, and its
x̂0, mean √ᾱ_τ'·x̂0, σ = √(1 − ᾱ_τ') and log-prob are the reference's on every step but the last; `ddpo_loss` on
`clip_advantages(A, 10)` gives the reference's loss, approx_kl, clipfrac and gradient. The last step is the documented
difference (`samplers/lcm.py`'s docstring): diffrl returns x̂0 with log-prob 0; the reference re-noises x̂0 to the last
timestep's own level, x = √ᾱ_τ x̂0 + √(1 − ᾱ_τ) z (a sample the pipeline never decodes: it decodes x̂0), and scores it
under N(√ᾱ_τ x̂0, 1 − ᾱ_τ) — checked here as that expression of diffrl's x̂0.

The schedule: the reference's own `set_timesteps` takes every (50 // T)-th of the 50 original timesteps,
[999, 879, 759, 639, 519, 399, 279, 159] for T = 8; diffusers 0.42's `LCMScheduler.set_timesteps` (the `lcm` sampler)
spreads them over the whole range, [999, 879, 759, 639, 499, 379, 259, 139]. The `lcm_rlcm` sampler
(`samplers.lcm.rlcm_timesteps`) takes the reference's; the published-settings recipe uses it.
"""

import json
from pathlib import Path

import torch
from parity_helpers import check_ppo, close, input32, tensor

from diffrl.config import load_recipe
from samplers.base import gaussian_log_prob
from samplers.lcm import LCMSampler, lcm_constants, lcm_step, lcm_timesteps, rlcm_timesteps

GOLDEN = json.loads((Path(__file__).parent / "data" / "rlcm_reference.json").read_text())
SHAPE, PPO_SHAPE = (2, 4, 4, 4), (8, 4, 2, 2)
ATOL, LP_ATOL, LOSS_RTOL, GRAD_RTOL = 1e-12, 1e-6, 1e-9, 3e-7
LAST = GOLDEN["num_steps"] - 1


def sqrt32(value: float) -> float:
    """√ in float32, as the reference's `.sqrt()` of its float32 ᾱ."""
    return torch.tensor(value, dtype=torch.float32).sqrt().item()


X, OUT = input32(GOLDEN["inputs"]["x"]), input32(GOLDEN["inputs"]["model_output"])


def constants(ref: dict):
    """diffrl's step scalars on the reference's schedule (its timestep, ᾱ_τ and, but on the last step, ᾱ_τ')."""
    alpha_next = None if ref["step"] == LAST else ref["alpha_prod_t_prev"]
    return lcm_constants(ref["timestep"], ref["alpha_prod_t"], alpha_next, GOLDEN["scheduler_config"]["timestep_scaling"])


def test_the_lcm_step_is_lcm_schedulers_but_the_last():
    for ref in GOLDEN["steps"]:
        c = constants(ref)
        assert (c.c_skip, c.c_out) == (ref["c_skip"], ref["c_out"])
        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + ref["step"]), dtype=torch.float64)
        step = lcm_step(OUT, X, c, noise=noise)
        close(step.pred_x0, ref["denoised"])
        if ref["step"] == LAST:
            continue
        close(step.prev_sample, ref["prev_sample"])
        close(step.mean, sqrt32(ref["alpha_prod_t_prev"]) * tensor(ref["denoised"]))
        assert float(step.std) == sqrt32(1 - torch.tensor(ref["alpha_prod_t_prev"], dtype=torch.float32).item())
        close(step.log_prob, ref["log_prob"], atol=LP_ATOL)
        scored = lcm_step(OUT, X, c, prev_sample=tensor(ref["prev_sample"]))  # the recomputation in training
        close(scored.log_prob, ref["log_prob"], atol=LP_ATOL)


def test_the_last_step_is_the_documented_difference():
    ref = GOLDEN["steps"][-1]
    assert ref["step"] == LAST and ref["prev_timestep"] == ref["timestep"]  # the reference's ᾱ_τ' is ᾱ_τ itself
    step = lcm_step(OUT, X, constants(ref))
    assert float(step.std) == 0 and (step.log_prob == 0).all() and torch.equal(step.prev_sample, step.pred_x0)
    # the reference's x: x̂0 re-noised to ᾱ_τ with the step's noise, scored under N(√ᾱ_τ x̂0, 1 − ᾱ_τ)
    a = ref["alpha_prod_t"]
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + LAST), dtype=torch.float64)
    std = sqrt32(1 - torch.tensor(a, dtype=torch.float32).item())
    mean = sqrt32(a) * step.pred_x0
    close(mean + std * noise, ref["prev_sample"])
    close(gaussian_log_prob(tensor(ref["prev_sample"]), mean, std), ref["log_prob"], atol=LP_ATOL)


def test_the_ppo_loss_and_its_gradient_are_ppo_training_loops():
    ppo = GOLDEN["ppo"]
    c = constants(ppo)
    x, next_latents = input32(ppo["x"], PPO_SHAPE), tensor(ppo["next_latents"], PPO_SHAPE)
    old = lcm_step(input32(ppo["old_model_output"], PPO_SHAPE), x, c, prev_sample=next_latents)
    close(old.log_prob, ppo["old_log_probs"], atol=LP_ATOL)
    model_output = tensor(ppo["model_output"], PPO_SHAPE).requires_grad_(True)
    step = lcm_step(model_output, x, c, prev_sample=next_latents)
    close(step.log_prob, ppo["log_probs"], atol=LP_ATOL)
    # diffrl's own rollout log-probs as the old ones
    check_ppo(ppo, step.log_prob, old.log_prob, model_output, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)


def test_the_schedule_is_the_references():
    from diffusers import LCMScheduler  # the only test that needs diffusers

    config = LCMScheduler(**GOLDEN["scheduler_config"]).config
    assert LCMSampler(spacing="rlcm").schedule(config, GOLDEN["num_steps"]).timesteps.tolist() == GOLDEN["timesteps"]
    assert rlcm_timesteps(1000, 50, 4).tolist() == [999, 759, 519, 279]  # every 12th of 19, 39, ..., 999 from the top
    # diffusers' own spacing (the `lcm` sampler) differs from the 5th step on
    assert lcm_timesteps(config, GOLDEN["num_steps"]).tolist() == [999, 879, 759, 639, 499, 379, 259, 139]
    assert load_recipe("rlcm/lcm_dreamshaper_aesthetic").sample.sampler == "lcm_rlcm"  # the published settings
