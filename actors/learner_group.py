"""The learner ranks seen as one `rlhf.protocols.LearnerGroup`: shard, fan out, gather."""

from __future__ import annotations

import ray
import torch

from actors.actor_group import ActorGroup
from rlhf.data.batching import shard_for_rank
from rlhf.protocols import Objective
from rlhf.types import Batch, StepMetrics, TrainBatch


class RayLearnerGroup:
    """Each call splits the batch's items (rows, or preference pairs) into contiguous per-rank shards (put once in the object
    store), runs the same method on every rank, and merges the answers."""

    def __init__(self, group: ActorGroup, *, model_path: str, export_dtype: str) -> None:
        self.group = group
        self.model_path, self.export_dtype = model_path, export_dtype

    def _shards(self, batch: Batch) -> list[tuple]:
        n = len(self.group)
        return [(ray.put(shard_for_rank(batch, r, n)),) for r in range(n)]

    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        parts = self.group.call_each("logprobs", self._shards(batch), reference=reference)
        return batch.gather_rows(parts)

    def train_step(self, batch: Batch, objective: Objective) -> StepMetrics:
        per_rank = self.group.call_each("train_step", [(s[0], objective) for s in self._shards(batch)])
        return per_rank[0]  # already reduced over ranks inside the step

    def update(self, batch: TrainBatch, objective: Objective, *, reference: bool, updates: int) -> StepMetrics:
        per_rank = self.group.call_each("update", [(s[0], objective) for s in self._shards(batch)],
                                        reference=reference, updates=updates)
        return per_rank[0]  # reduced over ranks inside each step

    def save(self, path: str) -> None:
        self.group.call("save", path, self.model_path, self.export_dtype)

    def load(self, path: str) -> None:
        self.group.call("load", path)

    def push_weights(self, targets: list[list[tuple[int, ray.actor.ActorHandle]]], transport: object
                     ) -> dict[str, float]:
        """All ranks gather parameters bucket by bucket; rank r sends each bucket to the engines
        `targets[r]` ((engine index, actor) pairs) and commits them (see actors.weight_sync).
        Returns `sync/engine{e}_s` (seconds engine e spent receiving and committing) and, over the
        slowest rank, `sync/gather_s` (gathering and casting) and `sync/send_s` (handing over)."""
        per_rank = self.group.call_each("push_weights", [(t, transport) for t in targets])
        engines = {engine: s for rank in per_rank for engine, s in rank["engines"].items()}
        return {**{f"sync/engine{e}_s": s for e, s in sorted(engines.items())},
                "sync/gather_s": max(rank["gather_s"] for rank in per_rank),
                "sync/send_s": max(rank["send_s"] for rank in per_rank)}

    def shutdown(self) -> None:
        self.group.shutdown()
