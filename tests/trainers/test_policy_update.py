"""The shared PPO-family update loop (`diffrl.training.update.PolicyUpdate`) against a recording fake run context:
which backward passes are scaled how and marked last, when the optimizer steps, what a NaN loss does, when the run
stops, and that the first-step ratio check sees only the log-probs before the first update. Worked by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.training.update import PolicyUpdate


class FakeContext:
    def __init__(self, accumulation: int, stop_after: int | None = None, skip: tuple = ()):
        self.cfg = SimpleNamespace(optim=SimpleNamespace(gradient_accumulation_steps=accumulation))
        self.logprob_check_atol = 1e-5
        self.events: list = []
        self.stop_after, self.skip = stop_after, skip

    def backward(self, loss, *, last):
        self.events.append(("backward", round(float(loss), 6), last))

    def optimizer_step(self, losses_finite):
        n = sum(e[0] == "step" for e in self.events) + 1
        self.events.append(("step", losses_finite))
        stepped = losses_finite and n not in self.skip
        return stepped, float(n), self.stop_after is not None and n >= self.stop_after


def test_accumulation_scaling_last_flags_and_steps_per_pass():
    # 2 passes of 3 micro-batches, 2 losses each, accumulation 2: each pass steps after its 2nd micro-batch only (the
    # 3rd's gradient carries into the next pass, as the reference loops count micro-batches per pass); every loss is
    # divided by 2 losses × 2 micro-batches = 4, and the last backward before a step is marked
    ctx = FakeContext(accumulation=2)
    update = PolicyUpdate(ctx, losses_per_micro_batch=2)
    for _ in update.passes(2):
        for m in update.micro_batches([0, 1, 2]):
            for k in range(2):
                update.backward(torch.tensor(4.0 * (10 * m + k)), {"x": 1.0})
    expected_pass = [("backward", 0.0, False), ("backward", 1.0, False),
                     ("backward", 10.0, False), ("backward", 11.0, True), ("step", True),
                     ("backward", 20.0, False), ("backward", 21.0, False)]
    assert ctx.events == expected_pass * 2
    stats = update.stats(("loss", "x", "grad_norm", "kl"), kl=None)
    assert stats == {"loss": (0 + 1 + 10 + 11 + 20 + 21) * 4 / 6, "x": 1.0, "grad_norm": 1.5, "kl": None,
                     "nan_losses": 0}
    assert not update.stopped


def test_a_nan_loss_skips_its_step_and_the_flag_is_clean_again_after():
    ctx = FakeContext(accumulation=1)
    update = PolicyUpdate(ctx, losses_per_micro_batch=1)
    for loss, stats in update.micro_batches([(float("nan"), None), (1.0, {})]):
        update.backward(torch.tensor(loss), stats)  # no stats: a stand-in loss stays out of the diagnostics
    assert [e for e in ctx.events if e[0] == "step"] == [("step", False), ("step", True)]
    assert update.stats(("loss",)) == {"loss": 1.0, "nan_losses": 1}


def test_a_stop_ends_the_micro_batches_and_the_passes():
    ctx = FakeContext(accumulation=1, stop_after=2)
    update = PolicyUpdate(ctx, losses_per_micro_batch=1)
    seen = []
    for p in update.passes(3):
        for m in update.micro_batches(range(4)):
            seen.append((p, m))
            update.backward(torch.tensor(1.0), {})
    assert seen == [(0, 0), (0, 1)] and update.stopped
    assert sum(e[0] == "step" for e in ctx.events) == 2


def test_the_ratio_check_sees_only_the_log_probs_before_the_first_update():
    ctx = FakeContext(accumulation=2)
    update = PolicyUpdate(ctx, losses_per_micro_batch=1, ratio_check="epoch 0")
    old = torch.zeros(2)

    def epoch():
        for m in update.micro_batches(range(4)):
            update.check_ratio(torch.full((2,), 0.1 * (m + 1)), old)  # off by 0.1, 0.2 (recorded), 0.3, 0.4 (not)
            update.backward(torch.tensor(1.0), {})

    with pytest.warns(UserWarning, match="differ from the rollout's by 1.00e-01"):  # once, at the first mismatch
        epoch()
    stats = update.stats(("loss",))
    assert math.isclose(stats["logprob_max_diff"], 0.2, rel_tol=1e-6)
    assert math.isclose(stats["ratio_first_step"], (math.exp(0.1) + math.exp(0.2)) / 2, rel_tol=1e-6)
    assert PolicyUpdate(ctx, losses_per_micro_batch=1).stats(("loss",)).keys() == {"loss", "nan_losses"}
