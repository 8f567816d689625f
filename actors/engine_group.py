"""EngineGroup: E generation engines (vLLM or HF actors) seen by the loop as one `Generator`.

Data-parallel generation: a call's prompts are cut into E contiguous, balanced shards
(`rlhf.batching.even_shards`), engine e gets shard e, and the engines' answers concatenated in
engine order are in prompt order. The unit is a prompt with its `n` samples, so a GRPO group
never spans engines. Each engine is told the step-wide index of its first prompt, which seeds its
prompts exactly as one engine would (`SamplingSpec.prompt_seed`): with vLLM the samples do not
depend on the engine count, up to the batch-dependent rounding of the kernels.

All engines work at once; the call returns when the slowest is done. `last_metrics()` gives each
engine's tokens and seconds for the call (from issuing it to its result being ready) and the
slowest/fastest ratio, which shows an imbalance (long completions bunched in one shard).
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.actor_group import ActorGroup, gather_timed
from rlhf.batching import even_shards
from rlhf.types import Completion, SamplingSpec


class EngineGroup:
    """`rlhf.protocols.Generator` over the engine actors of an ActorGroup (named "engine")."""

    def __init__(self, group: ActorGroup, gpus_per_engine: int = 0) -> None:
        """`gpus_per_engine`: the engines' tensor-parallel width on GPUs, 0 on CPU (no per-GPU rate)."""
        self.group = group
        self.engines = group.actors
        self.gpus = gpus_per_engine * len(self.engines)
        self._metrics: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> list[Completion]:
        shards = even_shards(len(prompt_ids), len(self.engines))
        busy = [e for e, part in enumerate(shards) if len(part)]
        refs = [self.engines[e].generate.remote([list(p) for p in prompt_ids[shards[e].start:shards[e].stop]],
                                                sampling, shards[e].start) for e in busy]
        labels = self.group.labels()
        parts, seconds = gather_timed(refs, [labels[e] for e in busy], "generate")
        tokens = [sum(len(c.token_ids) for c in part) for part in parts]
        self._metrics = engine_metrics({e: (t, s) for e, t, s in zip(busy, tokens, seconds)})
        if self.gpus and seconds:  # every generating GPU, the idle ones of a short call included
            self._metrics["throughput/gen_tokens_per_s_per_gpu"] = sum(tokens) / max(max(seconds), 1e-9) / self.gpus
        return [c for part in parts for c in part]

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def sleep(self) -> None:
        self.group.call("sleep")

    def wake(self) -> None:
        self.group.call("wake")

    def shutdown(self) -> None:
        self.group.shutdown()


def engine_metrics(per_engine: dict[int, tuple[int, float]]) -> dict[str, float]:
    """{engine: (generated tokens, seconds)} -> `gen/engine{e}_tokens`, `gen/engine{e}_s` and
    `gen/engine_time_ratio` (slowest over fastest; 1.0 for one engine)."""
    out: dict[str, float] = {}
    for e, (tokens, seconds) in sorted(per_engine.items()):
        out[f"gen/engine{e}_tokens"] = float(tokens)
        out[f"gen/engine{e}_s"] = seconds
    times = [s for _, s in per_engine.values()]
    if times:
        out["gen/engine_time_ratio"] = max(times) / max(min(times), 1e-9)
    return out
