"""EngineGroup: E generation engines (vLLM or HF actors) seen by the loop as one `Generator`.

Data-parallel generation: a call's prompts are cut into E contiguous, balanced shards
(`rlhf.data.batching.even_shards`), engine e gets shard e, and the engines' answers concatenated in
engine order are in prompt order. The unit is a prompt with its `n` samples, so a GRPO group
never spans engines. Each engine is told the step-wide index of its first prompt, which seeds its
prompts exactly as one engine would (`SamplingSpec.prompt_seed`): with vLLM the samples do not
depend on the engine count, up to the batch-dependent rounding of the kernels.

All engines work at once; the call returns when the slowest is done. `last_metrics()` gives each
engine's tokens and seconds for the call (from issuing it to its result being ready) and the
slowest/fastest ratio, which shows an imbalance (long completions bunched in one shard).
`submit` issues the same calls and returns at once (asynchronous GRPO: rlhf.rollouts).

Streaming (`rlhf.protocols.SampleStream`, for rlhf.partial): samples wait here until an engine has
room (its `stream_room`, the sequences it decodes at once) and go to the one with the fewest
running; each engine has one `stream` call out at a time, which returns as soon as a sample
finishes there (or after STREAM_CALL_S), and is sent again at once with the samples that now fit.
The engines never wait for each other, and a call's return is the only hand-over.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import ray

from actors.actor_group import ActorGroup, gather, gather_timed
from rlhf.data.batching import even_shards
from rlhf.types import Completion, SampleRequest, SamplingSpec


class EngineGroup:
    """`rlhf.protocols.Generator` over the engine actors of an ActorGroup (named "engine")."""

    def __init__(self, group: ActorGroup, gpus: int = 0, sleeps: bool = False) -> None:
        """`gpus`: the GPUs the engines generate on, 0 on CPU (no per-GPU rate); `sleeps`: the engines
        have a sleep mode (`rlhf.rules.engines_sleep`), else `sleep` and `wake` never reach them."""
        self.group, self.sleeps = group, sleeps
        self.engines = group.actors
        self.gpus = gpus
        self._metrics: dict[str, float] = {}
        # Streaming: samples not yet sent, each engine's running count and room, the call out per engine.
        self._waiting: deque[SampleRequest] = deque()
        self._sampling: SamplingSpec | None = None
        self._running: list[int] = [0] * len(self.engines)
        self._room: list[int] = []
        self._calls: dict[ray.ObjectRef, tuple[int, float]] = {}  # -> (engine, when sent)
        self._busy = [[0, 0.0] for _ in self.engines]  # [tokens, seconds] per engine since the last pause

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> list[Completion]:
        pending = self.submit(prompt_ids, sampling)
        completions = pending.result()
        self._metrics = pending.metrics()
        return completions

    def submit(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> EngineGeneration:
        shards = even_shards(len(prompt_ids), len(self.engines))
        busy = [e for e, part in enumerate(shards) if len(part)]
        refs = [self.engines[e].generate.remote([list(p) for p in prompt_ids[shards[e].start:shards[e].stop]],
                                                sampling, shards[e].start) for e in busy]
        labels = self.group.labels()
        return EngineGeneration(refs, busy, [labels[e] for e in busy], self.gpus)

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def sleep(self) -> None:
        if self.sleeps:
            self.group.call("sleep")

    def wake(self) -> None:
        if self.sleeps:
            self.group.call("wake")

    # ------------------------------------------------------------------ streaming

    def add(self, requests: Sequence[SampleRequest], sampling: SamplingSpec) -> None:
        if not self._room:
            self._room = gather([e.stream_room.remote() for e in self.engines], self.group.labels(), "stream_room")
        self._sampling = sampling
        self._waiting.extend(requests)
        self._dispatch()

    def poll(self, timeout_s: float | None = None) -> list[tuple[int, Completion]]:
        end = None if timeout_s is None else time.perf_counter() + timeout_s
        while end is None or time.perf_counter() < end:
            self._dispatch()
            if not self._calls:
                return []
            left = None if end is None else max(end - time.perf_counter(), 0.0)
            ready, _ = ray.wait(list(self._calls), num_returns=1, timeout=left)
            if ready and (finished := self._take(ready[0])):  # a call may end on its time limit with none
                return finished
        return []

    def pause(self) -> list[tuple[int, Completion]]:
        finished = []
        while self._calls:  # each returns within STREAM_CALL_S; nothing new is sent meanwhile
            finished += self._take(next(iter(self._calls)))
        partial = gather([e.stop_stream.remote() for e in self.engines], self.group.labels(), "stop_stream")
        for e, part in enumerate(partial):
            self._busy[e][0] += sum(len(c.token_ids) for _, c in part)
        self._metrics = engine_metrics({e: (t, s) for e, (t, s) in enumerate(self._busy) if s})
        self._running, self._busy = [0] * len(self.engines), [[0, 0.0] for _ in self.engines]
        self._waiting.clear()
        return finished + [kc for part in partial for kc in part]

    def _dispatch(self) -> None:
        """A `stream` call to every engine without one that has samples: the waiting ones shared out
        evenly over those engines, fewest running first, none past an engine's room."""
        if not self._room:
            return
        out = {e for e, _ in self._calls.values()}
        idle = sorted((e for e in range(len(self.engines)) if e not in out), key=lambda e: self._running[e])
        for i, e in enumerate(idle):
            share = -(-len(self._waiting) // (len(idle) - i))
            take = [self._waiting.popleft() for _ in range(min(share, self._room[e] - self._running[e]))]
            if take or self._running[e]:
                self._running[e] += len(take)
                self._calls[self.engines[e].stream.remote(take, self._sampling)] = (e, time.perf_counter())

    def _take(self, ref: ray.ObjectRef) -> list[tuple[int, Completion]]:
        """A returned `stream` call's finished samples; its engine is idle until the next `_dispatch`."""
        e, sent = self._calls.pop(ref)
        finished = gather([ref], [self.group.labels()[e]], "stream")[0]  # fails fast on a dead engine
        self._busy[e][0] += sum(len(c.token_ids) for _, c in finished)
        self._busy[e][1] += time.perf_counter() - sent
        self._running[e] -= len(finished)
        return finished

    def shutdown(self) -> None:
        self.group.shutdown(process_exits=True)  # each engine is killed next (VLLMGenerator.shutdown)


class EngineGeneration:
    """The engines' shares of one `submit`, running (`rlhf.protocols.PendingGeneration`). A watcher
    thread notes when each share is ready, so an engine's seconds are its own even when the loop
    asks for the result long after (generation overlapping training)."""

    def __init__(self, refs: list[ray.ObjectRef], engines: list[int], labels: list[str], gpus: int) -> None:
        self.refs, self.engines, self.labels, self.gpus = refs, engines, labels, gpus
        self.submitted = time.perf_counter()
        self._ready_at: dict[ray.ObjectRef, float] = {}
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="engine-generation-watcher")
        self._watcher.start()
        self._completions: list[Completion] | None = None
        self._metrics: dict[str, float] = {}

    def _watch(self) -> None:
        waiting = list(self.refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            self._ready_at[ready[0]] = time.perf_counter()

    def result(self) -> list[Completion]:
        if self._completions is None:
            parts = gather_timed(self.refs, self.labels, "generate")[0]  # fails fast on a dead engine
            self._watcher.join()  # every share is ready: the thread is noting the last one at most
            seconds = [self._ready_at[ref] - self.submitted for ref in self.refs]
            tokens = [sum(len(c.token_ids) for c in part) for part in parts]
            self._metrics = engine_metrics({e: (t, s) for e, t, s in zip(self.engines, tokens, seconds)})
            if self.gpus and seconds:  # every generating GPU, the idle ones of a short call included
                self._metrics["throughput/gen_tokens_per_s_per_gpu"] = (sum(tokens) / max(max(seconds), 1e-9)
                                                                        / self.gpus)
            self._completions = [c for part in parts for c in part]
        return self._completions

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


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
