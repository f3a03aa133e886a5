"""Rewards for fine-tuning and steering diffusion models: a registry of reward factories and combinators.

```python
from rewards import get_reward, list_rewards, weighted_sum

reward = get_reward("pickscore")                       # or "package.module:factory" for your own
out = reward(images, prompts)                          # images [B, 3, H, W] in [0, 1] -> out.scores [B]
```

Every reward has `name`, `differentiable` and `higher_is_better`. Heavy libraries load inside the factories,
so importing this package is cheap.
"""

from rewards.base import Reward, RewardOutput
from rewards.registry import get_reward, get_reward_factory, list_rewards, register_reward


def __getattr__(name):
    # The combinators live in rewards.combine, which imports the registry; resolve them lazily.
    if name in {"weighted_sum", "normalized", "WeightedSumReward", "NormalizedReward"}:
        from rewards import combine

        return getattr(combine, name)
    raise AttributeError(f"module 'rewards' has no attribute {name!r}")


__all__ = [
    "Reward",
    "RewardOutput",
    "get_reward",
    "get_reward_factory",
    "list_rewards",
    "normalized",
    "register_reward",
    "weighted_sum",
]
