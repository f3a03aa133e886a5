"""Stat tracker and advantage helpers; expected values worked out by hand."""

import math

import numpy as np
import pytest

from diffrl.training.advantages import (
    PerPromptStatTracker,
    batch_advantages,
    clip_advantages,
    group_advantages,
)


def test_stat_tracker_uses_prompt_stats_above_min_count_and_batch_stats_below():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=2)
    adv = tracker.update(["a", "a", "b"], [1.0, 3.0, 10.0])
    # "a": buffer [1, 3] has 2 >= min_count -> mean 2, std 1 -> [-1, 1]
    assert adv[0] == pytest.approx(-1.0, rel=1e-5)
    assert adv[1] == pytest.approx(1.0, rel=1e-5)
    # "b": 1 < min_count -> batch stats: mean 14/3, std sqrt(((1-14/3)² + (3-14/3)² + (10-14/3)²)/3) = 3.858612
    assert adv[2] == pytest.approx((10 - 14 / 3) / 3.8586123, rel=1e-5)
    # second batch: "b" buffer [10, 20] -> mean 15, std 5 -> (20 - 15) / 5 = 1
    adv = tracker.update(["b"], [20.0])
    assert adv[0] == pytest.approx(1.0, rel=1e-5)


def test_stat_tracker_buffer_is_fifo():
    tracker = PerPromptStatTracker(buffer_size=2, min_count=2)
    tracker.update(["a", "a"], [1.0, 3.0])
    adv = tracker.update(["a"], [5.0])  # buffer now [3, 5]: mean 4, std 1
    assert adv[0] == pytest.approx(1.0, rel=1e-5)
    assert list(tracker.buffers["a"]) == [3.0, 5.0]


def test_stat_tracker_identical_rewards_give_zero_advantage():
    tracker = PerPromptStatTracker(buffer_size=8, min_count=1)
    assert np.all(tracker.update(["a", "a"], [2.0, 2.0]) == 0.0)


def test_stat_tracker_state_dict_round_trip():
    tracker = PerPromptStatTracker(buffer_size=3, min_count=2)
    tracker.update(["a", "b", "a"], [1.0, 2.0, 4.0])
    restored = PerPromptStatTracker(buffer_size=1, min_count=1)
    restored.load_state_dict(tracker.state_dict())
    assert restored.buffer_size == 3 and restored.min_count == 2
    assert np.allclose(restored.update(["a", "b"], [0.5, 7.0]), tracker.update(["a", "b"], [0.5, 7.0]))
    assert tracker.stats() == {"num_prompts": 2, "mean_buffer_len": 2.5}


def test_group_advantages_group_and_global_std():
    rewards, groups = [1.0, 3.0, 10.0, 20.0], [0, 0, 1, 1]
    # group std: each pair centred on its mean and divided by its std (1 and 5)
    assert np.allclose(group_advantages(rewards, groups, std="group"), [-1, 1, -1, 1], atol=1e-5)
    # global std: sqrt(((1-8.5)² + (3-8.5)² + (10-8.5)² + (20-8.5)²) / 4) = sqrt(55.25) = 7.4330344
    expected = np.array([-1, 1, -5, 5]) / math.sqrt(55.25)
    assert np.allclose(group_advantages(rewards, groups, std="global"), expected, rtol=1e-5)
    assert np.allclose(group_advantages(rewards, groups, std="none"), [-1, 1, -5, 5])


def test_batch_and_clip():
    # mean 2, std sqrt(2/3) = 0.8164966
    assert np.allclose(batch_advantages([1.0, 2.0, 3.0]), [-1.2247449, 0, 1.2247449], rtol=1e-5)
    assert np.allclose(clip_advantages([-7.0, 0.5, 9.0], 5.0), [-5.0, 0.5, 5.0])
    assert np.allclose(clip_advantages([-7.0, 9.0], 0.0), [-7.0, 9.0])
