"""DDPO's step policy, loss and advantages against numbers computed by the reference code (github.com/kvablack/ddpo-pytorch).

`data/ddpo_reference.json` holds only numbers, with the commit and the file each came from (its `source` entry), all
at 1958463: `ddim_with_logprob.py:ddim_step_with_logprob` (sample, mean, σ_t, log-prob and the ᾱ it used; ε and v
prediction, η 1 and 0.5; steps 0, 5 and 9 of a 10-step SD 1.x DDIM schedule), `scripts/train.py`'s PPO lines (loss,
approx_kl, clipfrac, and the loss's gradient w.r.t. the model output) and `stat_tracking.PerPromptStatTracker` over
three epochs, run once on fixed-seed inputs (stored too). yk7333/d3po's copy of `ddim_step_with_logprob` gave
bit-identical numbers (D3PO's step policy is covered here).

Checked: `ddim_step` draws the reference's x_{t−1} with the same noise, and its mean, σ_t and log-prob (mean over
latent dims) are the reference's; `DDIMSchedule.from_config` picks the reference's timesteps and ᾱ_t, ᾱ_{t−1};
`ddpo_loss` on `clip_advantages(A, 5)` gives the reference's loss, approx_kl, clipfrac and gradient w.r.t. the model
output (the reference clamps A inside the loss, diffrl before it: the same numbers); `PerPromptStatTracker` (its
default ε 1e-6) and `batch_advantages(std_eps=1e-8)` give the reference's advantages. No difference from the reference
was found. Not covered: `set_alpha_to_one=True`, where the reference's last step clamps the previous timestep to 0
before choosing ᾱ_{t−1} and so never uses `final_alpha_cumprod` (diffrl follows diffusers; SD 1.x sets it False).

Tolerances (float64 inputs; both sides use the same float32 schedule constants): tensors `ATOL` 1e-12 (measured
bit-identical); log-probs `LP_ATOL` 1e-6 absolute (the reference takes log σ_t and log √2π in float32, diffrl in
float64: measured 2.6e-7 on the η = 0.5 last step, whose log σ_t ≈ −3.3 has a float32 ulp of 2.4e-7); the loss
`LOSS_RTOL` 1e-9 relative (the constant float32 offsets cancel in each side's own log-ratio: measured 2.5e-11); the
gradient w.r.t. the model output and approx_kl `GRAD_RTOL` 1e-7 relative (both scale with 1/σ_t², which the reference
squares in float32, ulp 6e-8: measured 2.4e-9 and 4.8e-9); advantages `ADV_ATOL` 1e-5 absolute (the reference
normalises float32 rewards in float32, diffrl in float64: measured 1.9e-6, rewards ≈ 5 with a float32 ulp of 4.8e-7
divided by stds ≈ 0.5).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from parity_helpers import check_ppo, close, input32, tensor

from diffrl.training.advantages import PerPromptStatTracker, batch_advantages
from samplers.ddim import DDIMSchedule, ddim_constants, ddim_step

GOLDEN = json.loads((Path(__file__).parent / "data" / "ddpo_reference.json").read_text())
SHAPE, PPO_SHAPE = (2, 4, 4, 4), (8, 4, 2, 2)
ATOL, LP_ATOL, LOSS_RTOL, GRAD_RTOL, ADV_ATOL = 1e-12, 1e-6, 1e-9, 1e-7, 1e-5


X, OUT = input32(GOLDEN["inputs"]["x"]), input32(GOLDEN["inputs"]["model_output"])


def constants(ref: dict, eta: float):
    """diffrl's step scalars from the ᾱ_t, ᾱ_{t−1} the reference used (the schedule itself: the last test)."""
    return ddim_constants(ref["alpha_prod_t"], ref["alpha_prod_t_prev"], eta)


@pytest.mark.parametrize("case", sorted(GOLDEN["steps"]))
def test_the_ddim_step_is_ddim_step_with_logprob(case):
    prediction_type, eta = case.split("/eta")
    for ref in GOLDEN["steps"][case]:
        c = constants(ref, float(eta))
        assert c.std == ref["std_dev_t"]  # the same float32 σ_t
        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + ref["step"]), dtype=torch.float64)
        step = ddim_step(OUT, X, c, prediction_type=prediction_type, noise=noise)
        close(step.prev_sample, ref["prev_sample"])
        close(step.mean, ref["mean"])
        close(step.log_prob, ref["log_prob"], atol=LP_ATOL)
        # scoring the reference's x_{t−1} (the recomputation in training) gives its log-prob too
        scored = ddim_step(OUT, X, c, prediction_type=prediction_type, prev_sample=tensor(ref["prev_sample"]))
        close(scored.log_prob, ref["log_prob"], atol=LP_ATOL)


def test_the_ppo_loss_and_its_gradient_are_train_pys():
    ppo = GOLDEN["ppo"]
    c = constants(ppo, 1.0)
    x, next_latents = input32(ppo["x"], PPO_SHAPE), tensor(ppo["next_latents"], PPO_SHAPE)
    old = ddim_step(input32(ppo["old_model_output"], PPO_SHAPE), x, c, prev_sample=next_latents)
    close(old.log_prob, ppo["old_log_probs"], atol=LP_ATOL)
    model_output = tensor(ppo["model_output"], PPO_SHAPE).requires_grad_(True)
    step = ddim_step(model_output, x, c, prev_sample=next_latents)
    close(step.log_prob, ppo["log_probs"], atol=LP_ATOL)
    # diffrl's own rollout log-probs as the old ones (as in training): each side's float32 constants cancel in its ratio
    check_ppo(ppo, step.log_prob, old.log_prob, model_output, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)


def test_advantages_are_the_stat_trackers_and_train_pys():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)  # default std_eps 1e-6, as the reference
    fallbacks = 0
    for epoch in GOLDEN["advantages"]:
        rewards = np.array(epoch["rewards_float32"], dtype=np.float32)
        fallbacks += sum(len(tracker.buffers.get(p, ())) + epoch["prompts"].count(p) < 3 for p in set(epoch["prompts"]))
        np.testing.assert_allclose(tracker.update(epoch["prompts"], rewards), epoch["per_prompt"], rtol=0,
                                   atol=ADV_ATOL)
        np.testing.assert_allclose(batch_advantages(rewards, std_eps=1e-8), epoch["batch"], rtol=0, atol=ADV_ATOL)
    # both branches (batch statistics below min_count, the prompt's own above) and the FIFO limit are exercised
    assert fallbacks > 0 and {len(b) for b in tracker.buffers.values()} == {4}


def test_the_schedule_is_the_references():
    from diffusers import DDIMScheduler  # the only test that needs diffusers

    for prediction_type in ("epsilon", "v_prediction"):
        config = DDIMScheduler(**GOLDEN["scheduler_config"], prediction_type=prediction_type).config
        sched = DDIMSchedule.from_config(config, GOLDEN["num_steps"])
        for ref in GOLDEN["steps"][f"{prediction_type}/eta1.0"] + [GOLDEN["ppo"]]:
            i = ref["step"]
            assert int(sched.timesteps[i]) == ref.get("timestep", int(sched.timesteps[i]))
            assert sched.alphas_cumprod[i] == ref["alpha_prod_t"]
            assert sched.alphas_cumprod_prev[i] == ref["alpha_prod_t_prev"]
            assert sched.constants(i, 1.0) == constants(ref, 1.0)
