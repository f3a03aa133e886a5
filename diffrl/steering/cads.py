"""CADS in steering: every particle's model calls see its own annealed condition, for every steering method.

CADS itself (Sadat et al., ICLR 2024; the schedule γ(t), the noising and the rescaling) is `samplers/cads.py`; the
samplers take it as a hook (`CADSHook`). Steering runs its own loop over a `DenoisingProcess` (see
`diffrl/steering/core.py` for why), so the UNet and flow processes apply it in their model call instead, with this
class. What it has to decide is whose noise a row gets when a method copies, resamples or branches particles.

The rule: the condition noise n of a model call is a function of (the call's seed, `CADSConfig.seed`, the row's
particle slot, the step index) and of nothing else. A particle slot is a row of the method's population: best-of-N's
N·B samples, FK's k·B particles, guidance's and ReNO's chains, SVDD's chains (an SVDD chain's M candidates share
its slot, so at one step all of them see the same condition). Consequences, and why each is what we want:

- Within one call, particles get different condition noise (different slots), as the samples of one
  `diffrl sample --cads` call do (different seeds); the same call seed gives the same images.
- n is drawn afresh at every step (independent across steps), as in the paper and the sampler hook. So the CADS
  sampler is Markov in (x_t, n_t): n_t is drawn with the step, and the step x_t → x_{t−1} uses only x_t and n_t.
- FK resampling at step i copies an ancestor's x_t *and the model output it computed with its n_i* (the potential
  scored x̂0 of that output, so the pair (x_t, n_i) is the particle's state; FK needs no second model call). From
  step i + 1 on each copy draws the condition noise of its own slot, as it draws its own step noise. Resampling the
  state (x_t, n_i) with potentials that are functions of it is ordinary SMC on the extended chain, whose x0-marginal
  is the CADS sampler's, so FK still targets p_CADS(x0)·exp(λ·r(x0)) / Z. A later step's noise is not yet part of
  any particle's state, so nothing is lost by keying it by slot rather than by ancestry, and the copies' futures
  stay independent, as their step noise does.
- SVDD scores candidates x_{t−1}^(m) by r(x̂0) under the next step's condition. Candidates of one chain share it,
  so they differ by the sampler's step noise alone and the selection compares states, not condition draws (a
  candidate with its own n would also be chosen for a lucky condition).
- A keyed draw, rather than a stream per particle, makes a step's noise independent of how often and in which
  chunks a method evaluates the model there: ReNO regenerates the chain at every iteration and sees the same
  condition noise each time, so its generator G stays a deterministic function of the initial noise ε and the
  gradient through it is exact; reward guidance evaluates row chunks with a graph. Neither differentiates through n
  (it is a constant of the step), so gradients through the model with the annealed condition are those of the CADS
  sampler; no method is refused.

The one refusal: a chain whose every step has γ(t) = 0 (t ≥ τ2 at every step, e.g. a one-step model at t ≈ 1, as
ReNO's default on a UNet pipeline) would never show the model its prompt; that is an error, not CADS.

Differences from `CADSHook` (the sampler path): the hook keys a sample's noise by the sample's own seed and draws it
as a stream; here the key is the call's seed and the particle slot, since steering draws every row's start and step
noise from one generator per call. γ(t) and the fields noised (the conditional branch's `prompt_embeds` and
`pooled_prompt_embeds`) are the same.
"""

from __future__ import annotations

import torch

from diffrl.errors import UserError
from samplers.cads import NOISED_FIELDS, CADSConfig, anneal_conditioning, cads_gamma, keyed_condition_noise


class ParticleCADS:
    """CADS for the model calls of a steering process: the annealed conditioning of rows given their particle slots.

    Args:
        config (`CADSConfig`): the settings (τ1, τ2, s, ψ and the noise seed).
        seed (`int`): the steering call's seed; with `config.seed`, a slot and a step index it keys the noise.
        times (`list[float]`): the normalised time t ∈ [0, 1] of each step (the step's timestep over the scheduler's
            `num_train_timesteps`; a flow's σ).
    """

    def __init__(self, config: CADSConfig, seed: int, times: list[float]):
        self.config, self.seed, self.times = config, int(seed), [float(t) for t in times]
        self.gammas = [cads_gamma(t, config.tau1, config.tau2) for t in self.times]
        if all(g == 0.0 for g in self.gammas):
            raise UserError(
                f"CADS with tau2={config.tau2} replaces the prompt with noise at every one of the chain's "
                f"{len(self.times)} step(s) (t = {min(self.times):.3g} at the last); raise tau2 above it or use more "
                "steps")

    def conditioning(self, cond, step_index: int, particles: torch.Tensor):
        """`cond` (a `Conditioning` of the rows) annealed for `step_index`; row i keyed by slot `particles[i]`."""
        gamma = self.gammas[step_index]
        if gamma >= 1.0:
            return cond
        names = [name for name in NOISED_FIELDS if getattr(cond, name) is not None]
        keys = [[self.seed, self.config.seed, int(p), step_index] for p in particles.tolist()]
        device = cond.prompt_embeds.device
        noise = keyed_condition_noise(keys, [tuple(getattr(cond, name).shape[1:]) for name in names], device)
        return anneal_conditioning(cond, gamma, self.config, dict(zip(names, noise)))
