"""Reward scoring off the learners: one Ray actor that owns a `rewards.RewardPool`."""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch

from rlhf.config import RewardConfig
from rlhf.types import PromptRow


class RewardWorker:
    """Holds the process pool (per-sample timeouts, failures counted) for the whole run."""

    def __init__(self, cfg: RewardConfig) -> None:
        from rewards import RewardPool

        self.pool = RewardPool(
            [(f.function, f.weight) for f in cfg.functions], timeout_s=cfg.timeout_s, num_workers=cfg.num_workers
        )

    def score(self, prompts: list[str], completions: list[str], rows: list[dict]) -> tuple[list[float], dict]:
        return self.pool.score(prompts, completions, rows)

    def close(self) -> None:
        self.pool.close()


class RayRewardScorer:
    """`rlhf.protocols.RewardScorer` backed by a RewardWorker actor."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.actor = ray.remote(RewardWorker).options(num_cpus=0).remote(cfg)

    def score(self, rows: Sequence[PromptRow], completions: Sequence[str]) -> tuple[torch.Tensor, dict[str, float]]:
        rewards, metrics = ray.get(self.actor.score.remote(
            [r.user_text() for r in rows], list(completions), [r.reward_kwargs() for r in rows]))
        return torch.tensor(rewards, dtype=torch.float32), metrics

    def shutdown(self) -> None:
        try:
            ray.get(self.actor.close.remote())
        finally:
            ray.kill(self.actor)
