"""AlignProp's truncated backpropagation against numbers computed by the reference code (github.com/mihirp1998/AlignProp).

`data/alignprop_reference.json` holds only numbers, with the commit and function they came from (its `source` entry):
`sd_pipeline.py:pipeline_step_with_grad` at b22918a (its DDIM step is trl 0.11.4's `scheduler_step`), run once in
float64 on a stub pipeline around an analytic UNet, ε̂_i(x) = (w_i + u)·x + c_i at sampling step i (x_T, y, w, u, c
stored), 4 DDIM steps of SD 1.x's schedule, η = 0, no CFG, with the cut-off fixed to b = 1, 2, 3; the loss
mean (x0 − y)² and its gradients w.r.t. w_i, u and each step's model output (∂L/∂c_i); and the reference's cut-off
draw, N(42, 5) on 50 steps, executed 100,000 times.

Checked: diffrl's chain with `GradPolicy(keep="last", k=T − b)` (what `truncation=normal_cutoff` builds from a drawn b)
keeps the same steps and gives the same x0, loss and gradients as the reference with cut-off b, i.e. "cut-off b" means
"the last T − b steps carry a gradient"; `normal_cutoff_pmf` is the distribution of the reference's draws (every bin
within 5 binomial standard deviations, mean K within 5 standard errors), and diffrl's own draw has the same moments.
A seeded draw cannot match: the reference samples `torch.distributions.Normal` from the global generator.

Tolerances: x0 and the gradients `RTOL` 1e-12 (float64 latents and model, the step scalars float32 on both sides as
diffusers' table is: measured bit-identical, the margin is for other CPU kernels); the loss `LOSS_RTOL` 1e-6
(`draft_loss` averages the rewards in float32: measured 1.6e-8); the draw histograms are statistical (5σ of a
binomial count).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from diffrl.trainers.draft import DRaFTConfig, draft_loss, draw_normal_cutoff, grad_policy, normal_cutoff_pmf
from samplers.base import GradPolicy
from samplers.ddim import DDIMSampler
from samplers.testing import SD_SCHEDULER_CONFIG

GOLDEN = json.loads((Path(__file__).parent / "data" / "alignprop_reference.json").read_text())
SHAPE = tuple(GOLDEN["shape"])
RTOL, LOSS_RTOL = 1e-12, 1e-6
T = len(GOLDEN["chains"][0]["timesteps"])


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).reshape(SHAPE)


class _Config(dict):
    __getattr__ = dict.__getitem__


class LinearEps(torch.nn.Module):
    """The reference run's model: ε̂_i(x) = (w_i + u)·x + c_i, float64."""

    def __init__(self, timesteps):
        super().__init__()
        inputs = GOLDEN["inputs"]
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in inputs["w"]])
        self.u = torch.nn.Parameter(torch.tensor(inputs["u"], dtype=torch.float64))
        self.c = torch.nn.ParameterList([torch.nn.Parameter(tensor(c)) for c in inputs["c"]])
        self.step_of = {t: i for i, t in enumerate(timesteps)}
        self.config = _Config(sample_size=SHAPE[2], in_channels=SHAPE[1], time_cond_proj_dim=None,
                              addition_embed_type=None)

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, x, t, return_dict=False, encoder_hidden_states=None):
        i = self.step_of[int(t)]
        return ((self.w[i] + self.u) * x + self.c[i],)


class ToyPipe:
    vae_scale_factor = 1

    def __init__(self, timesteps):
        from diffusers import DDIMScheduler

        self.unet = LinearEps(timesteps)
        self.scheduler = DDIMScheduler(**SD_SCHEDULER_CONFIG)

    def encode_prompt(self, prompt, device, num_images_per_prompt, do_classifier_free_guidance, negative_prompt,
                      prompt_embeds, negative_prompt_embeds):
        return prompt_embeds, None


def diffrl_chain(policy: GradPolicy, timesteps) -> dict:
    pipe = ToyPipe(timesteps)
    traj = DDIMSampler().sample(
        pipe, None, prompt_embeds=torch.zeros(SHAPE[0], 1, 1, dtype=torch.float64), num_steps=T, guidance_scale=1.0,
        eta=0.0, latents=tensor(GOLDEN["inputs"]["x_T"]), seeds=[0, 1], output="latents", grad=policy)
    assert [int(t) for t in traj.timesteps] == timesteps
    rewards = -((traj.final_latents - tensor(GOLDEN["inputs"]["y"])) ** 2).mean(dim=(1, 2, 3))
    loss, _ = draft_loss(rewards.double())
    loss.backward()
    m = pipe.unet
    return {"steps": sorted(traj.grad_steps), "x0": traj.final_latents.detach(), "loss": loss.item(),
            "w": [None if p.grad is None else p.grad.item() for p in m.w], "u": m.u.grad.item(),
            "c": [None if p.grad is None else p.grad for p in m.c]}


@pytest.mark.parametrize("chain", GOLDEN["chains"], ids=lambda c: f"cutoff{c['cutoff']}")
def test_cutoff_b_trains_the_last_T_minus_b_steps_with_the_references_gradients(chain):
    b = chain["cutoff"]
    got = diffrl_chain(GradPolicy(keep="last", k=T - b, checkpoint=True, decode=False), chain["timesteps"])
    assert got["steps"] == chain["kept_steps"] == list(range(b, T))
    torch.testing.assert_close(got["x0"], tensor(chain["x0"]), rtol=RTOL, atol=0)
    assert got["loss"] == pytest.approx(chain["loss"], rel=LOSS_RTOL)  # draft_loss averages in float32
    assert got["u"] == pytest.approx(chain["grad_u"], rel=RTOL)
    for i in range(T):
        if chain["grad_w"][i] is None:  # a step before the cut-off: its output is a constant in both
            assert got["w"][i] is None and got["c"][i] is None
        else:
            assert got["w"][i] == pytest.approx(chain["grad_w"][i], rel=RTOL)
            torch.testing.assert_close(got["c"][i], tensor(chain["grad_c"][i]), rtol=RTOL, atol=1e-15)


def test_normal_cutoff_builds_the_suffix_policy_of_its_draw():
    tc = DRaFTConfig(truncation="normal_cutoff")
    policy = grad_policy(tc, num_steps=50, generator=torch.Generator().manual_seed(3), decode=False)
    k = draw_normal_cutoff(50, generator=torch.Generator().manual_seed(3))
    assert (policy.keep, policy.k, policy.checkpoint) == ("last", k, True)
    assert policy.kept_steps(50) == list(range(50 - k, 50))


def test_normal_cutoff_pmf_is_the_distribution_of_the_references_draws():
    draws = GOLDEN["draws"]
    n, steps = draws["n"], draws["num_steps"]
    counts = {int(b): c for b, c in draws["counts"].items()}
    assert sum(counts.values()) == n and min(counts) >= 1 and max(counts) <= steps - 1  # support: b in 1..T−1
    pmf = normal_cutoff_pmf(steps, draws["mean"], draws["std"])  # P(K = k), k = T − b
    assert float(pmf.sum()) == pytest.approx(1.0, abs=1e-12) and float(pmf[-1]) == 0.0
    for k in range(1, steps):
        p, observed = float(pmf[k - 1]), counts.get(steps - k, 0)
        assert abs(observed - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, f"K={k}: {observed} vs {n * p:.1f}"
    ks = torch.tensor([steps - b for b, c in counts.items() for _ in range(c)], dtype=torch.float64)
    mean = float((pmf * torch.arange(1, steps + 1)).sum())
    assert float(ks.mean()) == pytest.approx(mean, abs=5 * float(ks.std()) / math.sqrt(n))
    assert mean == pytest.approx(9.09, abs=0.005)  # draft.py's docstring


def test_diffrls_draw_has_the_pmfs_moments():
    g = torch.Generator().manual_seed(0)
    n, steps = 20_000, 50
    ks = torch.tensor([draw_normal_cutoff(steps, 42.0, 5.0, g) for _ in range(n)], dtype=torch.float64)
    pmf = normal_cutoff_pmf(steps)
    support = torch.arange(1, steps + 1, dtype=torch.float64)
    mean = float((pmf * support).sum())
    var = float((pmf * (support - mean) ** 2).sum())
    assert 1 <= ks.min() and ks.max() <= steps - 1
    assert float(ks.mean()) == pytest.approx(mean, abs=5 * math.sqrt(var / n))
    assert float(ks.var()) == pytest.approx(var, rel=0.05)
