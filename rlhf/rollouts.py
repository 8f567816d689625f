"""Rollouts of each GRPO step, generated on-policy or up to `grpo.max_staleness` steps ahead.

Decisions (docs/design/grpo-loop.md, "Asynchronous rollouts"):
- A queue of generations, one per step, oldest first. With max_staleness = s it holds the
  generations of steps k..k+s when step k takes its rollouts (`next`): the generation of step k+s
  is submitted then, with the weights the engines hold (version k), and runs while the learners
  train on step k. s = 0 is the synchronous loop: submit, wait, train.
- Weights change only between generations: before a push the loop waits for every generation
  still running (`finish`); their results stay queued. So every sample of a generation comes
  from one weight version, recorded with it (`RolloutBatch.version`), and step k trains on
  samples of version max(k - s, first step of the run): a lag of exactly s once the queue is full.
- Queued rollouts are checkpointed: prompts leave the stream when their generation is submitted, so
  a checkpoint's stream position counts the queued steps, and their finished rollouts are saved
  beside it (`state_dict`): the weights that generated them are in no checkpoint, so they could not
  be regenerated. A resumed run trains on the very samples the interrupted run would have.
- Seeds from (run seed, step): the schedule never changes the samples.
- Extra rounds: `more` generates extra prompts for the step being trained (dynamic sampling,
  rlhf.sampling), on-policy only: they come from the same prompt stream, so its checkpointed
  position covers them, and round r of a step samples with its own seed (derived from run seed,
  step, r).
- Episodes in the queue's thread: multi-turn episodes (rlhf.env.episodes) are driven from this
  process, turn by turn. Running ahead (s > 0), they run in the queue's one background thread, so
  they overlap training as a single-turn generation does (one thread: generations still run one at a
  time, oldest first); on-policy, in the caller's thread.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlhf.config import RunConfig
from rlhf.data.lengths import group_lengths
from rlhf.data.stream import PromptStream
from rlhf.env.episodes import EpisodeSampler
from rlhf.protocols import Generator, PendingGeneration
from rlhf.types import Completion, PromptRow, RolloutBatch, SamplingSpec


@dataclass
class Finished:
    """A `PendingGeneration` that is already done: for generators that cannot run in the background."""

    completions: list[Completion]
    engine_metrics: dict[str, float] = field(default_factory=dict)

    def result(self) -> list[Completion]:
        return self.completions

    def metrics(self) -> dict[str, float]:
        return dict(self.engine_metrics)


@dataclass
class _InBackground:
    """A `PendingGeneration` running in the queue's thread ("Episodes in the queue's thread"): its future
    holds (completions, engine metrics)."""

    future: Future

    def result(self) -> list[Completion]:
        return self.future.result()[0]

    def metrics(self) -> dict[str, float]:
        return dict(self.future.result()[1])


@dataclass
class _Queued:
    """One step's generation: submitted (`pending`) or finished (`completions`)."""

    step: int
    version: int
    rows: list[PromptRow]
    prompt_ids: list[list[int]]
    pending: PendingGeneration | None = None
    completions: list[Completion] | None = None
    engine_metrics: dict[str, float] = field(default_factory=dict)

    def wait(self) -> None:
        if self.completions is None:
            self.completions = self.pending.result()
            self.engine_metrics = self.pending.metrics()
            self.pending = None


class RolloutQueue:
    """The generations of the coming steps ("A queue of generations"); `state_dict` makes it part of a
    checkpoint."""

    def __init__(self, generator: Generator, prompts: PromptStream, cfg: RunConfig,
                 episodes: EpisodeSampler | None = None) -> None:
        self.generator, self.prompts, self.cfg = generator, prompts, cfg
        self.episodes = episodes  # multi-turn (rlhf.env.episodes); in a thread when running ahead
        self.ahead = cfg.grpo.max_staleness
        self._queue: deque[_Queued] = deque()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="episodes") if episodes and self.ahead else None

    def next(self, step: int) -> RolloutBatch:
        """Step `step`'s rollouts (waiting for them if needed), after submitting the generations of
        the steps up to step + max_staleness (and before grpo.steps) with the weights the engines
        hold: those of `step` optimizer steps, as the loop pushes after every step."""
        while len(self._queue) <= self.ahead and step + len(self._queue) < self.cfg.grpo.steps:
            self._submit(step + len(self._queue), version=step)
        item = self._queue.popleft() if self._queue else None
        if item is None or item.step != step:
            raise RuntimeError(f"the rollout queue holds step {item and item.step}, step {step} asked for it")
        item.wait()
        return RolloutBatch(rows=item.rows, prompt_ids=item.prompt_ids, completions=item.completions,
                            group_size=self.cfg.grpo.group_size, engine_metrics=item.engine_metrics,
                            version=item.version)

    def more(self, step: int, round: int) -> RolloutBatch:
        """Another `prompts_per_step` prompts of step `step`, generated now with the weights the
        engines hold ("Extra rounds"); only with nothing queued (max_staleness = 0)."""
        if self._queue:
            raise RuntimeError(f"extra rollouts for step {step} asked for with {len(self._queue)} "
                               "steps queued")
        self._submit(step, version=step, round=round)
        item = self._queue.pop()
        item.wait()
        return RolloutBatch(rows=item.rows, prompt_ids=item.prompt_ids, completions=item.completions,
                            group_size=self.cfg.grpo.group_size, engine_metrics=item.engine_metrics,
                            version=item.version)

    def finish(self) -> None:
        """Wait for every generation still running ("Weights change only between generations")."""
        for item in self._queue:
            item.wait()

    def _submit(self, step: int, version: int, round: int = 0) -> None:
        rows, prompt_ids = map(list, zip(*self.prompts.take(self.cfg.grpo.prompts_per_step)))
        item = _Queued(step=step, version=version, rows=rows, prompt_ids=prompt_ids)
        spec = sampling_spec(self.cfg, step, round)
        if self._thread is not None:
            item.pending = _InBackground(self._thread.submit(self.episodes, rows, prompt_ids, spec))
        elif self.episodes is not None:
            item.pending = Finished(*self.episodes(rows, prompt_ids, spec))
        else:
            item.pending = self.generator.submit(prompt_ids, spec)
        self._queue.append(item)

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position and the queued steps' finished rollouts ("Queued rollouts are
        checkpointed")."""
        self.finish()
        queued = [dict(step=q.step, version=q.version, rows=q.rows, prompt_ids=q.prompt_ids,
                       completions=q.completions, engine_metrics=q.engine_metrics) for q in self._queue]
        return {**self.prompts.state_dict(), "queued": queued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (a checkpoint without queued rollouts restores the stream)."""
        state = dict(state)
        queued = state.pop("queued", [])
        self.prompts.load_state_dict(state)
        self._queue = deque(_Queued(**q) for q in queued)


def sampling_spec(cfg: RunConfig, step: int, round: int = 0) -> SamplingSpec:
    """G samples per prompt. Prompt i's sampling seed derives from (run seed, step, i), so a resumed run
    draws the same samples as an uninterrupted one, whatever the number of engines. Extra round r > 0 of
    a step ("Extra rounds") offsets the seed by r * 2**32, beyond every step's and the evaluation's.
    With `generation.forced_lengths`, the step's prompt i is the run's group (step + r * steps) * P + i
    (rlhf.data.lengths)."""
    gen, p = cfg.generation, cfg.grpo.prompts_per_step
    lengths: tuple[int, ...] = ()
    if gen.forced_lengths != "none":
        first = (step + round * cfg.grpo.steps) * p
        lengths = tuple(n for i in range(p) for n in group_lengths(cfg, first + i))
    return SamplingSpec(
        n=cfg.grpo.group_size, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
        top_p=gen.top_p, top_k=gen.top_k, seed=cfg.seed * 1_000_003 + step + (round << 32),
        ignore_eos=gen.ignore_eos, lengths=lengths,
    )
