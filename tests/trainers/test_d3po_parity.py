"""D3PO's preference rule and loss against numbers computed by the reference code (github.com/yk7333/d3po).

`data/d3po_reference.json` holds only numbers, with the commit and the lines each came from (its `source` entry), all
at 40d3175: `scripts/rm/train_d3po.py`'s `compare` (the preference from one reward or several, Pareto dominance) and
its loss lines (clamped ratios to the frozen reference, `-log σ(β log ρ_0 · c_0 + β log ρ_1 · c_1)`, mean over pairs)
with their gradient w.r.t. the policy's step log-probs, run once on the stored inputs: 8 pairs with a tie and a NaN
reward, and 6 two-reward pairs. The step log-prob itself is `ddim_step_with_logprob`, bit-identical to ddpo-pytorch's
(`test_ddpo_parity.py`).

Checked: `pair_choices` is `compare` (its [−1, 1] row, chain 1 preferred, is choice 1; [1, −1] choice 0; [0, 0], a
tie, a NaN or a split Pareto verdict, −1); `d3po_loss` over the decided pairs gives the reference's loss and gradient
through the documented tie conversion (`d3po.py`, "differences from the reference code"): the reference keeps a tie
in the mean at loss log 2 with zero gradient, so with n of P pairs decided
    reference loss = (n · diffrl loss + (P − n) · log 2) / P,   reference gradient = n / P · diffrl gradient
and zero on the tied pairs' log-probs.

Tolerances: the loss 1e-12 relative and the gradient 1e-12 absolute (float64 on both sides, the same formula up to
`logsigmoid` against `log(sigmoid)` and the order of the mean: measured 1.1e-16 relative on the loss, 1.7e-18 absolute
on gradients of size up to 6e-3).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from diffrl.trainers.d3po import d3po_loss, pair_choices

GOLDEN = json.loads((Path(__file__).parent / "data" / "d3po_reference.json").read_text())
RTOL, GRAD_ATOL = 1e-12, 1e-12


def values(key, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in GOLDEN[key]], dtype=dtype)


def choices_of(human_prefer) -> list[int]:
    """The reference's rows [c_0, c_1] as diffrl's choices."""
    rows = torch.tensor(human_prefer).reshape(-1, 2).tolist()
    return [{(1.0, -1.0): 0, (-1.0, 1.0): 1, (0.0, 0.0): -1}[tuple(r)] for r in rows]


def test_the_preference_is_compares():
    choice = pair_choices(values("rewards_0", torch.float32), values("rewards_1", torch.float32))
    assert choice.tolist() == choices_of(GOLDEN["human_prefer"]) == [1, 0, -1, 1, 0, -1, 0, -1]
    pareto = pair_choices(values("pareto_0", torch.float32).reshape(-1, 2), values("pareto_1", torch.float32).reshape(-1, 2))
    assert pareto.tolist() == choices_of(GOLDEN["pareto_human_prefer"]) == [1, -1, -1, 1, 0, -1]


def test_the_loss_over_decided_pairs_is_the_references_with_ties_converted():
    choice = pair_choices(values("rewards_0", torch.float32), values("rewards_1", torch.float32))
    lp = torch.stack([values("log_probs_0"), values("log_probs_1")], dim=1).requires_grad_(True)  # [P, 2]
    ref = torch.stack([values("ref_log_probs_0"), values("ref_log_probs_1")], dim=1)
    decided = torch.nonzero(choice >= 0).squeeze(1)
    w, lo = choice[decided], 1 - choice[decided]
    loss, stats = d3po_loss(lp[decided, w], ref[decided, w], lp[decided, lo], ref[decided, lo],
                            beta=GOLDEN["beta"], clip_range=GOLDEN["eps"])
    loss.backward()
    n, total = len(decided), len(choice)
    assert (n, total) == (5, 8) and 0 < float(stats["clipfrac"]) < 1  # ties dropped; the clamp is exercised
    assert (n * float(loss.detach()) + (total - n) * math.log(2)) / total == pytest.approx(GOLDEN["loss"], rel=RTOL)
    expected = torch.stack([values("grad_log_probs_0"), values("grad_log_probs_1")], dim=1)
    torch.testing.assert_close(lp.grad * n / total, expected, rtol=0, atol=GRAD_ATOL)
    assert (expected[choice < 0] == 0).all()  # the reference's ties carry no gradient either
