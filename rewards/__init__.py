"""User-facing reward API and ready-made rewards. Bottom layer: imports nothing from rlhf/actors.

    from rewards import load_reward_fn, RewardPool
    fn = load_reward_fn("rewards.answers:exact_answer")   # or "path/to/my_rewards.py:my_reward"
    fn("What is 1+5?", "1 + 5 = 6", answer="6")         # -> 1.0

A reward function is `fn(prompt, completion, **row) -> float | None` (None: not applicable),
optionally `async def`, or `@batched` over lists. See rewards/api.py for the contract and
rewards/pool.py for running them with time limits in worker processes.

Names are imported on first access (PEP 562), so `import rewards` costs almost nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RewardFn": "rewards.api",
    "RewardLoadError": "rewards.api",
    "WeightedReward": "rewards.api",
    "batched": "rewards.api",
    "combine": "rewards.api",
    "load_reward_fn": "rewards.api",
    "RewardPool": "rewards.pool",
    "TASK_REWARDS": "rewards.tasks",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from rewards.api import RewardFn, RewardLoadError, WeightedReward, batched, combine, load_reward_fn
    from rewards.pool import RewardPool
    from rewards.tasks import TASK_REWARDS


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rewards' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
