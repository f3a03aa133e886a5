"""weighted_sum and running normalisation: golden numbers worked out by hand."""

import math

import pytest
import torch

from diffrl.errors import UserError
from rewards import RewardOutput, get_reward, normalized, weighted_sum
from rewards.combine import RunningStats, normalize_scores, update_stats


class Table:
    """A reward that returns fixed scores per call (in order), or a function of the images."""

    higher_is_better = True

    def __init__(self, name, batches=None, fn=None, differentiable=False):
        self.name = name
        self.batches = list(batches or [])
        self.fn = fn
        self.differentiable = differentiable

    def __call__(self, images, prompts, metadata=None):
        if self.fn is not None:
            return RewardOutput(self.fn(images), {"extra": 7.0})
        return RewardOutput(torch.tensor(self.batches.pop(0)), {})


def test_update_stats_golden():
    # [1, 2, 3] then [4]: mean 2.5, population variance ((1.5²+0.5²)·2)/4 = 1.25.
    stats = update_stats(update_stats(RunningStats(), [1.0, 2.0, 3.0]), [4.0])
    assert stats.count == 4
    assert stats.mean == pytest.approx(2.5, abs=1e-12)
    assert stats.std == pytest.approx(math.sqrt(1.25), abs=1e-12)
    assert update_stats(stats, []) == stats


def test_update_stats_equals_whole_history():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 1 for n in (5, 1, 17, 2)]
    stats = RunningStats()
    for batch in batches:
        stats = update_stats(stats, batch.tolist())
    everything = torch.cat(batches).double()
    assert stats.mean == pytest.approx(everything.mean().item(), abs=1e-12)
    assert stats.std == pytest.approx(everything.std(unbiased=False).item(), abs=1e-12)


def test_normalized_reward_golden():
    inner = Table("toy", batches=[[1.0, 3.0], [5.0, 7.0]])
    reward = normalized(inner)
    images = torch.zeros(2, 3, 4, 4)
    # Batch 1: mean 2, std 1 -> [-1, 1].
    first = reward(images, ["", ""])
    assert first.scores.tolist() == pytest.approx([-1.0, 1.0])
    assert first.info["raw"].tolist() == [1.0, 3.0]
    # After [1, 3, 5, 7]: mean 4, std sqrt(5) -> [(5-4)/√5, (7-4)/√5].
    second = reward(images, ["", ""])
    assert second.scores.tolist() == pytest.approx([1 / math.sqrt(5), 3 / math.sqrt(5)])
    assert second.info["running_mean"] == pytest.approx(4.0)
    assert second.info["running_std"] == pytest.approx(math.sqrt(5))
    assert reward.name == "toy" and reward.differentiable is False


def test_normalized_frozen_stats_and_eps():
    reward = normalized(Table("toy", batches=[[2.0, 2.0], [4.0, 6.0]]), eps=0.5)
    images = torch.zeros(2, 3, 4, 4)
    # Constant batch: std 0 -> divided by eps; scores (2-2)/0.5 = 0.
    assert reward(images, ["", ""]).scores.tolist() == [0.0, 0.0]
    reward.update = False
    # Frozen at mean 2, std 0 -> (x - 2) / 0.5.
    assert reward(images, ["", ""]).scores.tolist() == pytest.approx([4.0, 8.0])
    assert normalize_scores(3.0, RunningStats(count=2, mean=1.0, m2=8.0)) == pytest.approx(1.0)


def test_weighted_sum_golden_and_components_logged():
    a = Table("a", fn=lambda x: x.mean(dim=(1, 2, 3)), differentiable=True)
    b = Table("b", fn=lambda x: x.amax(dim=(1, 2, 3)) * 2, differentiable=True)
    images = torch.zeros(2, 3, 2, 2)
    images[0, 0, 0, 0] = 1.0  # mean 1/12, max 1
    images[1] += 0.5  # mean 0.5, max 0.5
    images.requires_grad_(True)
    reward = weighted_sum([(a, 3.0), (b, -0.5)])
    out = reward(images, ["", ""])
    # 3·(1/12) - 0.5·2 = -0.75 ; 3·0.5 - 0.5·1 = 1.0
    assert out.scores.tolist() == pytest.approx([-0.75, 1.0])
    assert out.info["a"].tolist() == pytest.approx([1 / 12, 0.5])
    assert out.info["b"].tolist() == pytest.approx([2.0, 1.0])
    assert out.info["a/extra"] == 7.0
    assert reward.differentiable
    out.scores.sum().backward()
    # d/dx of 3·mean = 3/12 everywhere; plus -0.5·2 at each image's argmax pixel (image 1: ties share the gradient).
    assert images.grad[0, 0, 0, 0].item() == pytest.approx(0.25 - 1.0)
    assert images.grad[0, 1, 1, 1].item() == pytest.approx(0.25)


def test_weighted_sum_from_specs_through_the_registry():
    images = torch.stack(
        [torch.full((3, 32, 32), 0.5), torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))]
    )
    jpeg = get_reward("jpeg_incompressibility")(images, ["", ""]).scores
    reward = get_reward(
        "weighted_sum",
        terms=[
            {"name": "jpeg_incompressibility", "weight": 2.0},
            {"name": "jpeg_compressibility", "weight": 0.5, "kwargs": {"quality": 95}, "label": "small"},
        ],
    )
    out = reward(images, ["", ""])
    assert out.scores.tolist() == pytest.approx((2.0 * jpeg - 0.5 * jpeg).tolist())
    assert set(out.info) >= {"jpeg_incompressibility", "small", "small/jpeg_kb"}
    assert reward.differentiable is False


def test_weighted_sum_with_normalised_term():
    reward = weighted_sum([{"name": "jpeg_incompressibility", "weight": 1.0, "normalize": True}])
    images = torch.stack(
        [torch.full((3, 32, 32), 0.5), torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))]
    )
    out = reward(images, ["", ""])
    # Two values standardised by their own mean and population std: exactly -1 and +1.
    assert out.scores.tolist() == pytest.approx([-1.0, 1.0])


def test_weighted_sum_errors():
    a = Table("same", batches=[[0.0]])
    with pytest.raises(UserError, match="several terms named"):
        weighted_sum([(a, 1.0), (Table("same"), 1.0)])
    with pytest.raises(UserError, match="at least one"):
        weighted_sum([])
    with pytest.raises(UserError, match="give 'name' and 'weight'"):
        weighted_sum([{"name": "jpeg_compressibility", "wieght": 1.0}])
