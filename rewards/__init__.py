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
from rewards.combine import NormalizedReward, WeightedSumReward, normalized, weighted_sum
from rewards.registry import get_reward, get_reward_factory, list_rewards, register_reward

__all__ = [
    "NormalizedReward",
    "Reward",
    "RewardOutput",
    "WeightedSumReward",
    "get_reward",
    "get_reward_factory",
    "list_rewards",
    "normalized",
    "register_reward",
    "weighted_sum",
]
