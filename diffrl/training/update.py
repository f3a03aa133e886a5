"""The gradient-update loop every PPO-family trainer shares (DDPO, DPOK, D3PO, Flow-GRPO, DiffusionNFT).

What is the same in all of them, written once: micro-batches grouped into optimizer steps of
`optim.gradient_accumulation_steps`, each micro-batch's losses divided by (losses per micro-batch × accumulation) so
an optimizer step's gradient is the mean over its (sample, step) pairs, the last backward of a step marked (the
cross-process gradient sync), the NaN guard (a step with a non-finite loss is skipped; too many in a row stop the
run), skipped steps counted, and the check that before an epoch's first update the recomputed log-probs equal the
rollout's (ratio exactly 1). The trainer keeps what is its algorithm: which micro-batches, which steps, the loss.

A trainer's update then reads like cleanrl's `ppo.py`:

    update = ctx.policy_update(losses_per_micro_batch=n_steps, ratio_check=f"epoch {epoch}, first inner step")
    for _ in update.passes(num_inner_epochs):
        for idx in update.micro_batches(minibatches):      # an optimizer step after every `accumulation` of them
            for j in steps:
                log_probs = sampler.log_prob(pipe, mb, j)
                update.check_ratio(log_probs, old_log_probs)  # only until the first optimizer step
                loss, stats = the_algorithms_loss(...)
                update.backward(loss, stats)
    return stats_from(update), update.stopped

DDPO and Flow-GRPO also share their epoch (`advantage_epochs`): sample, advantages, this process's slice, the
update, log and checkpoint; Flow-GRPO's update is DDPO's plus its KL to the reference and its sample selection.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from diffrl.errors import UserError
from diffrl.training.advantages import check_advantage_config
from diffrl.training.loop import RunningMean
from diffrl.training.rollout import FirstStepCheck, epoch_advantages, local_batch
from diffrl.training.sde_window import check_steps_config, sde_window_etas


class PolicyUpdate:
    """One epoch's updates (`RunContext.policy_update` builds it).

    Args:
        ctx: the run context (`backward`, `optimizer_step`, the config's `optim.gradient_accumulation_steps`).
        losses_per_micro_batch (`int`): the losses (backward passes) each micro-batch makes: trained steps per sample
            (DDPO, D3PO, Flow-GRPO), σ values (DiffusionNFT), 1 (DPOK).
        ratio_check (`str`, *optional*): where to report a first-step log-prob mismatch; None for a trainer
            whose loss has no importance ratio to the rollout (DiffusionNFT; D3PO on stored label chains).
    """

    def __init__(self, ctx, *, losses_per_micro_batch: int, ratio_check: str | None = None):
        self.ctx = ctx
        self.accumulation = ctx.cfg.optim.gradient_accumulation_steps
        self.losses_per_micro_batch = losses_per_micro_batch
        self.diag = RunningMean()
        self.first = FirstStepCheck(ctx.logprob_check_atol, where=ratio_check) if ratio_check else None
        self.updated = False  # an optimizer step ran (or was skipped) this epoch: the weights may have moved
        self.stopped = False  # the NaN guard ended the run; the trainer returns and calls `ctx.stop_nan()`
        self.steps_skipped = 0
        self._finite = True
        self._index = 0  # of the current micro-batch within its pass
        self._losses = 0  # backward passes so far in the current micro-batch

    def passes(self, n: int) -> Iterator[int]:
        """`range(n)` that ends early once the run has stopped."""
        for p in range(n):
            if self.stopped:
                return
            yield p

    def micro_batches(self, items: Iterable) -> Iterator:
        """Yield each micro-batch of one pass; after every `accumulation` of them (counted from the pass's start, as
        the reference implementations count) the optimizer step. A pass's NaN flag starts clean."""
        self._finite = True
        for self._index, item in enumerate(items):
            self._losses = 0
            yield item
            if self._ends_step() and self._step():
                return

    def check_ratio(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> None:
        """Before the epoch's first optimizer step the weights are the rollout's: the log-probs must be its own."""
        if self.first is not None and not self.updated:
            self.first.add(log_probs, old_log_probs)

    def backward(self, loss: torch.Tensor, stats: dict | None = None) -> None:
        """Backward of one loss, scaled so an optimizer step's gradient is the mean over its losses; `stats` (None for
        a stand-in zero loss that keeps processes in step) go into the epoch's diagnostics with the loss."""
        if stats is not None:
            self.diag.add({"loss": loss.detach(), **stats})
        self._finite &= bool(torch.isfinite(loss.detach()))
        self._losses += 1
        last = self._ends_step() and self._losses == self.losses_per_micro_batch
        self.ctx.backward(loss / (self.losses_per_micro_batch * self.accumulation), last=last)

    def _ends_step(self) -> bool:
        return (self._index + 1) % self.accumulation == 0

    def _step(self) -> bool:
        stepped, grad_norm, stop = self.ctx.optimizer_step(self._finite)
        self.updated, self._finite = True, True
        self.steps_skipped += not stepped
        self.diag.add({"grad_norm": grad_norm})
        self.stopped = stop
        return stop

    def stats(self, keys: Iterable[str], **fixed) -> dict:
        """The epoch's means of `keys` (NaN where none was recorded), `fixed` entries, the first-step check's
        numbers and the skipped optimizer steps (`nan_losses`)."""
        means = self.diag.means()
        out = {key: fixed[key] if key in fixed else means.get(key, float("nan")) for key in keys}
        if self.first is not None:
            out.update(self.first.stats())
        out["nan_losses"] = self.steps_skipped
        return out


def advantage_epochs(ctx, update_fn: Callable, *, n_train_steps: int) -> dict:
    """The epochs of an on-policy trainer with advantages over whole trajectories (DDPO, Flow-GRPO):

        1. sample trajectories with the current weights (in an SDE window if set) and score them;
        2. advantages over every process's samples, then this process's slice;
        3. `update_fn(ctx, traj=, advantages=, valid=, n_train_steps=, epoch=) -> (stats, stop)`: the algorithm;
        4. log, checkpoint.

    Returns what `ctx.finish()` returns."""
    cfg, adv = ctx.cfg, ctx.cfg.advantage
    for epoch, record in ctx.epochs():
        rollout = ctx.rollout(group_size=adv.group_size, shared_start_noise=adv.shared_start_noise,
                              eta=sde_window_etas(cfg, ctx.rng, epoch))
        advantages = epoch_advantages(rollout, adv, ctx.state.stat_tracker)
        traj, local_adv, local_ok = local_batch(rollout, advantages, ctx.accelerator)
        train_start = time.perf_counter()
        ctx.unet.train()
        stats, stop = update_fn(ctx, traj=traj, advantages=local_adv, valid=local_ok, n_train_steps=n_train_steps,
                                epoch=epoch)
        ctx.unet.eval()
        if stop:
            ctx.stop_nan()
        ctx.end_epoch(record, rollout, stats, train_s=time.perf_counter() - train_start)
    return ctx.finish()


def check_ppo_config(cfg) -> None:
    """The settings of `advantage_epochs`' clipped-ratio epochs (DDPO, Flow-GRPO): advantages, micro-batch, inner
    epochs, the trained fraction of the steps, the SDE window, the clip range. Raises `UserError`."""
    tc = cfg.train
    check_advantage_config(cfg)
    if tc.batch_size < 1 or tc.num_inner_epochs < 1:
        raise UserError("train.batch_size and train.num_inner_epochs must be >= 1")
    if not 0 < tc.timestep_fraction <= 1:
        raise UserError(f"train.timestep_fraction must be in (0, 1], got {tc.timestep_fraction}")
    check_steps_config(cfg)
    if tc.clip_range <= 0 or not math.isfinite(tc.clip_range):
        raise UserError(f"train.clip_range must be > 0, got {tc.clip_range}")
