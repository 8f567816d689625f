"""Streaming and partial rollouts (`grpo.rollouts: stream | partial`): the loop's rollout source when
samples go to the engines one by one (rlhf.protocols.SampleStream) and come back as each finishes.

Decisions (docs/design/grpo-loop.md, "Partial rollouts", has the reasons):
- Groups: the run's g-th prompt is group g; sample j is a request of its own (key g*G + j), seeded
  from (run seed, key, tokens it has), limited by `generation.forced_lengths`.
- Windows: step k generates with version k until prompts_per_step groups are complete and every
  group due at k is; then the engines pause and unfinished samples keep their tokens.
- Due: a group whose first tokens are of version v is trained at step v + max_staleness at the
  latest (that window waits for it): no trained token is older than max_staleness, and no sample
  is thrown away for age.
- Admission: groups start while fewer than ceil(overprovision * P) run and fewer than
  (max_staleness + 1) * P are started and untrained (and no more than the steps left can train).
- Selection: the due groups, then complete ones oldest first (version, group), up to P; more than
  P only when more are due at once (`partial/extra_groups`).
- Continued samples go back as prompt + their tokens with what is left of their limit; each token
  keeps its version (`Completion.versions`) and log-prob, so importance weights are per token.
- `stream` is the same with max_staleness 0 and overprovision 1: every group is due at once; a
  sample may be a multi-turn episode there (rlhf.env.episodes.EpisodeStream).
- Only ended samples (EOS or limit) are trained; one an engine aborted by itself is continued,
  counted and said; an engine that dies stops the run before the step trains.
- Split layouts (`cluster.placement: split`): the engines go on while the learners train, at the
  same version, and stop at the push (`finish`); colocated, each window ends paused (they sleep).
- Scored as they finish: a group is scored (in one background thread) once its last sample ends,
  while the engines go on; a step's reward metrics are its groups' merged.
- Checkpointed: the stream position and every started, untrained group with its samples.

Metrics (`partial/`): `continued_frac`, `staleness_mean` and `staleness_max` (of trained tokens),
`extra_groups`, `carried_groups` and `carried_tokens` (after the pause), `aborted_samples`.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.config import RunConfig
from rlhf.data.lengths import group_lengths
from rlhf.data.stream import PromptStream
from rlhf.env.episodes import EpisodeSampler, EpisodeStream
from rlhf.protocols import RewardScorer, SampleStream
from rlhf.rollouts import sampling_spec
from rlhf.scoring import merge_reward_metrics, print_lines
from rlhf.types import Completion, PromptRow, RolloutBatch, SampleRequest, mix_seed

ENDED = ("stop", "length")
STOP_S = 0.25  # how long `finish` may wait for a split layout's engines to notice it


@dataclass
class Sample:
    """One sample of a group, as far as it has got."""

    limit: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None: not ended (running or paused)
    mask: list[bool] | None = None  # an episode's (rlhf.env.episodes)
    reward: float | None = None  # an episode's environment reward

    def extend(self, c: Completion, version: int) -> None:
        if c.mask is not None or self.mask is not None:
            self.mask = (self.mask or [True] * len(self.token_ids)) + (c.mask or [True] * len(c.token_ids))
        self.reward = c.reward if c.reward is not None else self.reward
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.versions += [version] * len(c.token_ids)
        if c.finish_reason in ENDED:
            self.finish_reason = c.finish_reason
        elif len(self.token_ids) >= self.limit:  # paused on its last token
            self.finish_reason = "length"

    def completion(self) -> Completion:
        return Completion(list(self.token_ids), list(self.logprobs), self.finish_reason or "abort",
                          mask=None if self.mask is None else list(self.mask), reward=self.reward,
                          versions=list(self.versions))


@dataclass
class Group:
    """A prompt's G samples, from the version its first window ran with."""

    id: int
    row: PromptRow
    prompt_ids: list[int]
    version: int
    samples: list[Sample]
    scored: Future | None = None  # (rewards [G], reward metrics), once complete

    @property
    def complete(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class RolloutStream:
    """Step k's rollouts from streaming engines (the module docstring's rules); the loop's rollout
    source like rlhf.rollouts.RolloutQueue: `next`, `finish`, `state_dict`, `load_state_dict`."""

    def __init__(self, engines: SampleStream, prompts: PromptStream, cfg: RunConfig,
                 scorer: RewardScorer | None = None, episodes: EpisodeSampler | None = None) -> None:
        """`scorer`: score each group as it completes ("Scored as they finish"); None: the caller scores.
        `episodes`: a sample is a multi-turn episode, each advancing on its own (EpisodeStream)."""
        g = cfg.grpo
        self.episodes = EpisodeStream(engines, episodes) if episodes is not None else None
        self.engines = self.episodes or engines
        self.prompts, self.cfg, self.scorer = prompts, cfg, scorer
        self._scoring = ThreadPoolExecutor(1, thread_name_prefix="scoring") if scorer is not None else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="run-ahead")
        self.staleness = g.max_staleness if g.rollouts == "partial" else 0
        self.running_cap = math.ceil(g.overprovision * g.prompts_per_step) if g.rollouts == "partial" else g.prompts_per_step
        self.groups: dict[int, Group] = {}  # started and not trained, by id
        self.next_group = 0
        self.aborted = 0  # samples given back aborted outside a pause, this window
        # "Split layouts": the engines go on while the learners train, until `finish` (partial only:
        # streaming on-policy, what they made meanwhile would be a version old).
        self.run_ahead = cfg.cluster.placement == "split" and self.staleness > 0
        self._ahead: Future | None = None
        self._stop = threading.Event()
        self._version = 0  # of the tokens being generated

    # ------------------------------------------------------------------ the loop's calls

    def next(self, step: int) -> RolloutBatch:
        """Step `step`'s rollouts: a window of generation with the weights of version `step` (the
        engines hold them: the loop pushes after every step), then the selected groups."""
        p, size = self.cfg.grpo.prompts_per_step, self.cfg.grpo.group_size
        self.finish()
        spec, self._version, self.aborted = sampling_spec(self.cfg, step), step, 0
        self.engines.add([self._request(g, j) for g in self.groups.values() for j, s in enumerate(g.samples)
                          if s.finish_reason is None], spec)
        self.engines.add(self._admit(step), spec)
        while not self._window_done(step):
            if not self._generate(step, spec):
                raise RuntimeError(f"step {step}: the engines ran dry with {self._complete_count()} of {p} groups "
                                   "complete")
        if not self.run_ahead:
            self._pause()
        chosen = self._select(step)
        for group in chosen:
            del self.groups[group.id]
        completions = [s.completion() for group in chosen for s in group.samples]
        batch = RolloutBatch(rows=[g.row for g in chosen], prompt_ids=[g.prompt_ids for g in chosen],
                             completions=completions, group_size=size,
                             engine_metrics={**self.engines.last_metrics(), **self._metrics(step, chosen)},
                             version=min(g.version for g in chosen))
        if self.scorer is not None:
            scores = [g.scored.result() for g in chosen]
            batch.rewards = torch.cat([r for r, _ in scores])
            batch.reward_metrics = merge_reward_metrics([(size, m) for _, m in scores])
        if self.aborted:  # said, as well as counted
            print_lines([(f"warning: step {step}: the engines aborted {self.aborted} samples by themselves; each is "
                          "continued from the tokens it had and trained only once it ends (partial/aborted_samples)")])
        if self.run_ahead:  # "Split layouts"
            self._ahead = self._thread.submit(self._generate_until_stopped, step, spec)
        return batch

    def finish(self) -> None:
        """Stop the engines before a weight push: on a split layout they went on while the learners
        trained; colocated, each window already ended paused."""
        if self._ahead is not None:
            self._stop.set()
            try:
                self._ahead.result()  # its failure is the step's
            finally:
                self._ahead = None
                self._stop.clear()
            self._pause()

    def _generate(self, step: int, spec: Any, timeout_s: float | None = None) -> bool:
        """One poll of the engines: its samples received, new groups admitted, complete ones scored.
        False when none finished: nothing in flight, or `timeout_s` passed."""
        finished = self.engines.poll(timeout_s)
        if not finished:
            return False
        again = self._receive(finished, step)
        self.engines.add([*again, *self._admit(step)], spec)
        self._score_complete()
        return True

    def _generate_until_stopped(self, step: int, spec: Any) -> None:
        """"Split layouts": poll until `finish` says stop (within STOP_S) or no sample runs."""
        while not self._stop.is_set():
            if not self._generate(step, spec, timeout_s=STOP_S) and all(g.complete for g in self.groups.values()):
                return

    def _pause(self) -> None:
        self._receive(self.engines.pause(), self._version, paused=True)
        self._score_complete()

    def more(self, step: int, round: int) -> RolloutBatch:
        raise RuntimeError("extra rounds (grpo.dynamic_sampling) are not streamed: config validation refuses it")

    # ------------------------------------------------------------------ the rules

    def _admit(self, step: int) -> list[SampleRequest]:
        """New groups per "Admission", version `step`; their requests."""
        p = self.cfg.grpo.prompts_per_step
        untrained_cap = min((self.staleness + 1) * p, (self.cfg.grpo.steps - step) * p)
        requests = []
        while (sum(not g.complete for g in self.groups.values()) < self.running_cap
               and len(self.groups) < untrained_cap):
            row, ids = self.prompts.take(1)[0]
            g = self.next_group
            group = Group(g, row, list(ids), step, [Sample(limit) for limit in group_lengths(self.cfg, g)])
            self.groups[g], self.next_group = group, g + 1
            for j in range(len(group.samples)):
                if self.episodes is not None:
                    self.episodes.start(self._key(group, j), row)
                requests.append(self._request(group, j))
        return requests

    def _request(self, group: Group, j: int) -> SampleRequest:
        key, sample = self._key(group, j), group.samples[j]
        return SampleRequest(key=key, prompt_ids=group.prompt_ids + sample.token_ids,
                             max_new_tokens=sample.limit - len(sample.token_ids),
                             seed=mix_seed(mix_seed(self.cfg.seed, key), len(sample.token_ids)))

    def _key(self, group: Group, j: int) -> int:
        """Sample j of `group`'s key ("Groups"); `_receive` inverts it."""
        return group.id * self.cfg.grpo.group_size + j

    def _receive(self, finished: list[tuple[int, Completion]], step: int, paused: bool = False
                 ) -> list[SampleRequest]:
        """Add what the engines gave back to the samples, at version `step`; the requests that continue
        samples an engine aborted by itself ("Nothing trained by surprise"), unless `paused`."""
        size, again = self.cfg.grpo.group_size, []
        for key, c in finished:
            group = self.groups[key // size]
            group.samples[key % size].extend(c, step)
            if c.finish_reason not in ENDED and not paused:
                self.aborted += 1
                if group.samples[key % size].finish_reason is None:
                    again.append(self._request(group, key % size))
        return again

    def _score_complete(self) -> None:
        """Start scoring every complete group not yet scored ("Scored as they finish")."""
        if self.scorer is None:
            return
        for g in self.groups.values():
            if g.complete and g.scored is None:
                tokens = [s.completion().model_token_ids() for s in g.samples]
                g.scored = self._scoring.submit(self.scorer.score, [g.row] * len(tokens), tokens)

    def _is_due(self, group: Group, step: int) -> bool:
        """"Due": the group is trained at step `step` at the latest."""
        return group.version <= step - self.staleness

    def _due(self, step: int) -> list[Group]:
        return [g for g in self.groups.values() if self._is_due(g, step)]

    def _complete_count(self) -> int:
        return sum(g.complete for g in self.groups.values())

    def _window_done(self, step: int) -> bool:
        return (self._complete_count() >= self.cfg.grpo.prompts_per_step
                and all(g.complete for g in self._due(step)))

    def _select(self, step: int) -> list[Group]:
        """Per "Selection": the due groups, then complete ones oldest first, prompts_per_step at least."""
        due = self._due(step)
        rest = sorted((g for g in self.groups.values() if g.complete and not self._is_due(g, step)),
                      key=lambda g: (g.version, g.id))
        return due + rest[:max(self.cfg.grpo.prompts_per_step - len(due), 0)]

    def _metrics(self, step: int, chosen: list[Group]) -> dict[str, float]:
        samples = [s for g in chosen for s in g.samples]
        ages = [step - v for s in samples for v in s.versions]
        carried = [s for g in self.groups.values() for s in g.samples]
        return {
            "partial/continued_frac": sum(len(set(s.versions)) > 1 for s in samples) / len(samples),
            "partial/staleness_mean": sum(ages) / max(len(ages), 1),
            "partial/staleness_max": float(max(ages, default=0)),
            "partial/extra_groups": float(len(chosen) - self.cfg.grpo.prompts_per_step),
            "partial/carried_groups": float(len(self.groups)),
            "partial/carried_tokens": float(sum(len(s.token_ids) for s in carried)),
            "partial/aborted_samples": float(self.aborted),
        }

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position and every started, untrained group ("Checkpointed"); the engines
        stopped first, as before a push."""
        self.finish()
        groups = [{"id": g.id, "row": g.row, "prompt_ids": g.prompt_ids, "version": g.version,
                   "samples": [vars(s).copy() for s in g.samples]} for g in self.groups.values()]
        return {**self.prompts.state_dict(), "partial": {"groups": groups, "next_group": self.next_group}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        partial = state.pop("partial", {"groups": [], "next_group": 0})
        state.pop("queued", None)
        self.prompts.load_state_dict(state)
        self.next_group = partial["next_group"]
        self.groups = {g["id"]: Group(g["id"], g["row"], g["prompt_ids"], g["version"],
                                      [Sample(**s) for s in g["samples"]]) for g in partial["groups"]}
