"""A copy of the trainable weights kept beside them, soft-updated towards them and swapped in on demand.

DiffusionNFT samples with it (its sampling policy v_old); AWM regularises towards it (its EMA policy, the KL anchor
of the reference code's "ema" adapter). Both update it once per epoch, after training, as

    copy ← d·copy + (1 − d)·θ,   d = `old_policy_decay(step, rate, maximum, flat)`

with `step` the optimizer steps done so far. `velocity_kl` is both trainers' KL in velocity space.
"""

from contextlib import contextmanager

import torch


def old_policy_decay(step: int, rate: float, maximum: float, flat: int = 0) -> float:
    """d of the soft update copy ← d·copy + (1 − d)·θ once `step` optimizer steps are done:

        d = 0                                  for step < flat
        d = min(rate·(step − flat), maximum)   otherwise

    d = 0 copies θ. DiffusionNFT's reference `decay_type`s: 0 is d = 0 at every step; 1 (its default) is
    d = min(0.001·step, 0.5); 2 (its OCR run) is d = 0 for step < 75, then min(0.0075·(step − 75), 0.999). AWM's
    reference (`kl_ema_decay_type: linear`) is d = min(0.001·step, 0.3). All count the same `step`: optimizer steps
    so far, read after the epoch's training.

    Args:
        step (`int`): optimizer steps done so far (global).
        rate (`float`): growth of d per step after the flat part.
        maximum (`float`): cap of d.
        flat (`int`, *optional*, defaults to 0): steps before d starts to grow.
    """
    if step < flat:
        return 0.0
    return float(min(rate * (step - flat), maximum))


def velocity_kl(v_theta: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """The KL term per sample `[B]`: mean over latent dims of (v_θ − v_ref)² (v_ref detached)."""
    return ((v_theta - v_ref.detach()) ** 2).flatten(1).mean(1)


@contextmanager
def swapped_in(params: list, tensors: list):
    """`tensors` copied into `params` in place (no gradient) for the block, the params' own values restored on exit
    (also on an error): another policy's weights run through the same network without a second copy of it."""
    current = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, other in zip(params, tensors):
            p.copy_(other)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, current):
                p.copy_(value)


class OldPolicy(torch.nn.Module):
    """A copy of the trainable tensors, soft-updated towards them (`soft_update`) and swapped into the network
    (`active`). A module so checkpoints save and resume it (pass it to `RunContext.load_state(extra_modules=)`)."""

    def __init__(self, params: list):
        super().__init__()
        for i, p in enumerate(params):
            self.register_buffer(f"p{i}", p.detach().clone())

    def tensors(self) -> list:
        return [getattr(self, f"p{i}") for i in range(len(self._buffers))]

    @torch.no_grad()
    def soft_update(self, params: list, decay: float) -> None:
        """old ← decay·old + (1 − decay)·θ."""
        for old, p in zip(self.tensors(), params):
            old.mul_(decay).add_(p.detach().to(old.dtype), alpha=1 - decay)

    @contextmanager
    def active(self, params: list):
        """Run the network with the copy's weights in place of the trainable ones (no gradient); restore on exit.

        Under autocast, run it in an autocast region of its own: autocast caches its low-precision copy of each
        weight until the outermost region exits, keyed by the tensor and blind to this in-place swap."""
        with swapped_in(params, self.tensors()):
            yield
