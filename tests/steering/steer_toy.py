"""A 2-D diffusion whose every quantity is closed form, for ground-truth checks of the steering code.

The data distribution is a Gaussian mixture p0 = Σ_k π_k N(μ_k, s_k² I). Under the forward process
q(x_t | x0) = N(√ᾱ_t x0, (1 − ᾱ_t) I) the marginal stays a mixture, q_t = Σ_k π_k N(√ᾱ_t μ_k, v_k I) with
v_k = ᾱ_t s_k² + 1 − ᾱ_t, so the exact noise prediction is ε*(x_t, t) = −√(1 − ᾱ_t) ∇ log q_t(x_t)
= √(1 − ᾱ_t) Σ_k γ_k(x_t) (x_t − √ᾱ_t μ_k) / v_k with γ_k the posterior responsibilities.

For a linear reward r(x) = a·x the tilted target p0(x) exp(λ r(x)) / Z is again a mixture: component k becomes
N(μ_k + λ s_k² a, s_k² I) and its weight is multiplied by exp(λ a·μ_k + λ² |a|² s_k² / 2).

`GMMProcess` implements `diffrl.steering.core.DenoisingProcess` with DDIM(η) steps over a subset of a 1000-step
linear-β schedule, in float64, so the steering methods run on it unchanged.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

DTYPE = torch.float64


@dataclass
class GMM:
    weights: torch.Tensor  # [K] π_k
    means: torch.Tensor  # [K, 2] μ_k
    stds: torch.Tensor  # [K] s_k

    def tilted(self, a: torch.Tensor, lmbda: float) -> "GMM":
        """The mixture p0(x) exp(λ a·x) / Z."""
        log_factor = lmbda * self.means @ a + 0.5 * lmbda**2 * (a @ a) * self.stds**2
        weights = torch.softmax(torch.log(self.weights) + log_factor, dim=0)
        return GMM(weights, self.means + lmbda * self.stds[:, None] ** 2 * a, self.stds)

    def responsibilities(self, x: torch.Tensor, scale: float = 1.0, extra_var: float = 0.0) -> torch.Tensor:
        """γ_k(x) for the mixture Σ π_k N(scale·μ_k, (scale² s_k² + extra_var) I); `[N, 2]` -> `[N, K]`."""
        var = scale**2 * self.stds**2 + extra_var  # [K]
        sq = ((x[:, None, :] - scale * self.means[None]) ** 2).sum(-1)  # [N, K]
        log_p = torch.log(self.weights) - sq / (2 * var) - math.log(2 * math.pi) * 1.0 - torch.log(var)
        return torch.softmax(log_p, dim=1)

    def sample(self, n: int, generator=None) -> torch.Tensor:
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        z = torch.randn(n, 2, generator=generator, dtype=DTYPE)
        return self.means[k] + self.stds[k, None] * z


def default_gmm() -> GMM:
    return GMM(
        weights=torch.tensor([0.5, 0.3, 0.2], dtype=DTYPE),
        means=torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]], dtype=DTYPE),
        stds=torch.tensor([0.5, 0.5, 0.7], dtype=DTYPE),
    )


class GMMProcess:
    """DDIM(η) sampling of a 2-D Gaussian mixture with the exact noise prediction (a `DenoisingProcess`)."""

    def __init__(self, gmm: GMM, num_steps: int = 100, eta: float = 1.0, num_train_timesteps: int = 1000):
        betas = torch.linspace(1e-4, 0.02, num_train_timesteps, dtype=DTYPE)
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        # the last step goes to ᾱ = 1 (a clean sample), as DDIM with set_alpha_to_one does
        self.timesteps = torch.linspace(num_train_timesteps - 1, 0, num_steps).round().long()
        self.gmm = gmm
        self.eta = eta
        self.num_steps = num_steps
        self.model_calls = 0

    def alpha_bar(self, step_index: int) -> float:
        return float(self.alphas_cumprod[self.timesteps[step_index]])

    def _alpha_bar_prev(self, step_index: int) -> float:
        return 1.0 if step_index + 1 == self.num_steps else self.alpha_bar(step_index + 1)

    def initial_latents(self, cond, generator=None):
        return torch.randn(len(cond), 2, generator=generator, dtype=DTYPE)

    def predict(self, latents, step_index, cond):
        self.model_calls += 1
        a = self.alpha_bar(step_index)
        gamma = self.gmm.responsibilities(latents, math.sqrt(a), 1 - a)  # [N, K]
        var = a * self.gmm.stds**2 + 1 - a  # [K]
        centred = (latents[:, None, :] - math.sqrt(a) * self.gmm.means[None]) / var[None, :, None]  # [N, K, 2]
        return math.sqrt(1 - a) * (gamma[..., None] * centred).sum(1)

    def pred_x0(self, model_output, step_index, latents):
        a = self.alpha_bar(step_index)
        return (latents - math.sqrt(1 - a) * model_output) / math.sqrt(a)

    def step(self, model_output, step_index, latents, *, generator=None):
        a, a_prev = self.alpha_bar(step_index), self._alpha_bar_prev(step_index)
        x0 = self.pred_x0(model_output, step_index, latents)
        std = self.eta * math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        mean = math.sqrt(a_prev) * x0 + math.sqrt(max(1 - a_prev - std**2, 0.0)) * model_output
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
        return SimpleNamespace(prev_sample=mean + std * noise, mean=mean, std=torch.tensor(std), pred_x0=x0)

    def decode(self, latents):
        return latents


class LinearReward:
    """r(x) = a·x on 2-D points, with the attributes of a `rewards.Reward`."""

    name = "linear"
    differentiable = True
    higher_is_better = True

    def __init__(self, a):
        self.a = torch.as_tensor(a, dtype=DTYPE)
        self.calls = 0

    def __call__(self, samples, prompts, metadata=None):
        self.calls += 1
        return SimpleNamespace(scores=samples @ self.a.to(samples), info={})


class Brightness:
    """100 × the mean pixel value of images in [0, 1]: differentiable, and it varies enough between samples of a
    random tiny pipeline for steering to move it."""

    name = "brightness"
    higher_is_better = True

    def __init__(self, differentiable=True):
        self.differentiable = differentiable

    def __call__(self, images, prompts, metadata=None):
        assert images.shape[0] == len(prompts) and images.min() >= 0 and images.max() <= 1
        return SimpleNamespace(scores=100 * images.mean(dim=(1, 2, 3)), info={})


def brightness(differentiable: bool = True) -> Brightness:
    """Factory for `get_reward("steer_toy:brightness")` (the CLI tests load it by module path)."""
    return Brightness(differentiable)
