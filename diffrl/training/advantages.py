"""Turning rewards into advantages: per-prompt statistics (DDPO), group-relative (GRPO-style), batch, none.

All functions take and return float64 numpy arrays of shape `[N]` (N = samples of the whole epoch, every
process), so every rank computes the same advantages from the same gathered rewards and then keeps its own slice.
"""

from collections import deque

import numpy as np

from diffrl.errors import UserError

# Added to every standard deviation so a prompt whose samples all scored the same gives advantage 0, not inf: the
# default of `advantage.std_eps` (flow_grpo's stat tracker adds 1e-4, ddpo-pytorch's per-prompt tracker 1e-6).
STD_EPS = 1e-6

ADVANTAGE_MODES = ("per_prompt", "group", "batch", "none")


class PerPromptStatTracker:
    """Running reward statistics per prompt (Black et al. 2023, "per-prompt stat tracking").

    Each prompt keeps a FIFO buffer of its last `buffer_size` rewards. A reward's advantage is
    `(r - mean(buffer)) / (std(buffer) + std_eps)`, with the current batch added to the buffer first. A prompt
    whose buffer holds fewer than `min_count` rewards falls back to the statistics of the whole current batch,
    so rarely drawn prompts do not get advantages from one or two samples.

    Args:
        buffer_size (`int`): rewards kept per prompt (oldest dropped first).
        min_count (`int`): rewards a prompt needs before its own statistics are used.
        std_eps (`float`, *optional*, defaults to `STD_EPS` = 1e-6): ε added to every std.
    """

    def __init__(self, buffer_size: int, min_count: int, std_eps: float = STD_EPS):
        if buffer_size < 1 or min_count < 1:
            raise ValueError(f"buffer_size and min_count must be >= 1, got {buffer_size}, {min_count}")
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.std_eps = std_eps
        self.buffers: dict[str, deque] = {}

    def update(self, prompts: list[str], rewards) -> np.ndarray:
        """Add a batch of rewards and return their advantages (`[N]` float64)."""
        rewards = np.asarray(rewards, dtype=np.float64)
        if len(prompts) != len(rewards):
            raise ValueError(f"{len(prompts)} prompts but {len(rewards)} rewards")
        advantages = np.empty_like(rewards)
        batch_mean, batch_std = rewards.mean(), rewards.std() + self.std_eps
        prompt_array = np.array(prompts, dtype=object)
        for prompt in dict.fromkeys(prompts):  # first-seen order, deterministic
            mask = prompt_array == prompt
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(rewards[mask].tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                mean, std = np.mean(buffer), np.std(buffer) + self.std_eps
            advantages[mask] = (rewards[mask] - mean) / std
        return advantages

    def stats(self) -> dict:
        lengths = [len(b) for b in self.buffers.values()]
        return {"num_prompts": len(lengths), "mean_buffer_len": float(np.mean(lengths)) if lengths else 0.0}

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {prompt: list(buffer) for prompt, buffer in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size = int(state["buffer_size"])
        self.min_count = int(state["min_count"])
        self.buffers = {p: deque(v, maxlen=self.buffer_size) for p, v in state["buffers"].items()}


def group_advantages(rewards, group_ids, *, std: str = "group", std_eps: float = STD_EPS) -> np.ndarray:
    """Group-relative advantages (GRPO-style): `(r - mean of its group) / (std + std_eps)` (population std).
    With `std_eps=1e-4`, and each group holding all of its prompt's samples of the epoch, equal to flow_grpo's
    `PerPromptStatTracker` (group and global std; `tests/trainers/test_flow_grpo_parity.py`).

    Args:
        rewards (`[N]`): rewards.
        group_ids (`[N]` int): samples with the same id were drawn for the same prompt in the same batch.
        std (`str`, *optional*, defaults to `"group"`): `"group"` divides by the group's std, `"global"` by the
            std of all N rewards (Dr. GRPO-style, keeps easy prompts from being amplified), `"none"` only centres.
        std_eps (`float`, *optional*, defaults to `STD_EPS` = 1e-6): ε added to the std.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if std not in ("group", "global", "none"):
        raise ValueError(f"std must be 'group', 'global' or 'none', got {std!r}")
    advantages = np.empty_like(rewards)
    global_std = rewards.std() + std_eps
    for gid in np.unique(group_ids):
        mask = group_ids == gid
        centred = rewards[mask] - rewards[mask].mean()
        scale = {"group": rewards[mask].std() + std_eps, "global": global_std, "none": 1.0}[std]
        advantages[mask] = centred / scale
    return advantages


def batch_advantages(rewards, *, std_eps: float = STD_EPS) -> np.ndarray:
    """`(r - mean) / (std + std_eps)` over the whole batch (population std)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    return (rewards - rewards.mean()) / (rewards.std() + std_eps)


def clip_advantages(advantages, max_abs: float) -> np.ndarray:
    """Clip advantages to `[-max_abs, max_abs]` (DDPO's `adv_clip_max`); `max_abs <= 0` disables clipping."""
    advantages = np.asarray(advantages, dtype=np.float64)
    return advantages if max_abs <= 0 else np.clip(advantages, -max_abs, max_abs)


def make_stat_tracker(adv) -> PerPromptStatTracker | None:
    """The per-prompt tracker an `advantage:` group asks for (mode per_prompt), else None."""
    if adv.mode != "per_prompt":
        return None
    return PerPromptStatTracker(adv.stat_buffer_size, adv.stat_min_count, std_eps=adv.std_eps)


def check_advantage_config(cfg) -> None:
    """Cross-field checks of the `advantage:` group against the sampling batch. Raises `UserError`."""
    adv = cfg.advantage
    if adv.group_size < 1 or adv.stat_buffer_size < 1 or adv.stat_min_count < 1:
        raise UserError("advantage.group_size, advantage.stat_buffer_size and advantage.stat_min_count must be >= 1")
    if not adv.std_eps > 0 or adv.std_eps == float("inf"):
        raise UserError(f"advantage.std_eps must be a finite number > 0 (flow_grpo uses 1e-4), got {adv.std_eps}")
    if adv.mode == "group" and adv.group_size < 2:
        raise UserError("advantage.mode=group needs advantage.group_size >= 2 (samples per prompt to compare)")
    if cfg.sample.batch_size % adv.group_size:
        raise UserError(f"sample.batch_size ({cfg.sample.batch_size}) must be a multiple of advantage.group_size "
                        f"({adv.group_size}): a group's samples are drawn in the same batch")
    if adv.shared_start_noise and adv.group_size < 2:
        raise UserError("advantage.shared_start_noise needs groups to share within: set advantage.group_size >= 2")
