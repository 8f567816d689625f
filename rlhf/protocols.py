"""The interfaces the loops call. `actors/` implements them; nothing here knows Ray, vLLM or FSDP.

Each Protocol holds only the methods a loop uses, so a fake for a test is a few lines and a new
backend is one file in `actors/` plus one entry in its `build_*` table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rlhf.types import Batch, Completion, PromptRow, SampleRequest, SamplingSpec, StepMetrics, TrainBatch

# A training objective: (token log-probs [B, T] of the current policy, the micro-batch (a
# TrainBatch for GRPO, a PreferenceBatch for DPO), the denominator of the whole step) -> (loss to backpropagate, metrics summed over the micro-batch).
# It is a picklable callable (a frozen dataclass in rlhf.algo.objectives) so it crosses process borders.
Objective = Callable[[torch.Tensor, Batch, float], tuple[torch.Tensor, dict[str, float]]]


class PendingGeneration(Protocol):
    """A generation running on the engines (`Generator.submit`)."""

    def result(self) -> list[Completion]:
        """Wait for the completions; the same grouping as `Generator.generate`'s."""
        ...

    def metrics(self) -> dict[str, float]:
        """What `Generator.last_metrics` says of this generation, once `result` has returned."""
        ...


class Generator(Protocol):
    """Samples completions from the current policy weights."""

    def submit(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> PendingGeneration:
        """Start `generate` and return at once. The loop pushes no weights while a generation runs
        ("Weights change only between generations" in rlhf.rollouts), so it samples from the weights of
        when it was submitted."""
        ...

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped: result[i*n:(i+1)*n] answer prompt i.
        Prompt i samples with `sampling.prompt_seed(i)`, however the prompts are spread over engines."""
        ...

    def last_metrics(self) -> dict[str, float]:
        """Figures of the last `generate` call per engine (`gen/engine{e}_tokens`, `gen/engine{e}_s`)
        and `gen/engine_time_ratio` (slowest over fastest engine)."""
        ...

    def sleep(self) -> None:
        """Release device memory (weights and KV cache) so colocated learners can train."""
        ...

    def wake(self) -> None:
        """Take the memory back before generating or receiving weights."""
        ...


class SampleStream(Protocol):
    """A Generator's streaming side (`grpo.rollouts: stream | partial`, rlhf.partial): samples go in
    one by one and come back as each finishes, so the engines batch continuously across a step and
    a step need not wait for its longest sample."""

    def add(self, requests: Sequence[SampleRequest], sampling: SamplingSpec) -> None:
        """Start these samples (temperature, top-p/k and ignore_eos from `sampling`; each request's
        own token limit and seed) on whichever engine has room; return at once."""
        ...

    def poll(self, timeout_s: float | None = None) -> list[tuple[int, Completion]]:
        """(key, completion) of samples finished since the last call, waiting until there is at least
        one; [] when none is in flight, or none finished within `timeout_s` (None: no limit)."""
        ...

    def pause(self) -> list[tuple[int, Completion]]:
        """Stop every sample in flight and return each one's tokens so far, finish_reason "abort"
        (and any that finished meanwhile, as they finished); nothing runs on the engines afterwards,
        so weights can be pushed. Each engine's tokens and busy seconds since the previous pause are
        in `last_metrics()`."""
        ...

    def last_metrics(self) -> dict[str, float]:
        """`gen/engine{e}_tokens` and `gen/engine{e}_s` of the window the last `pause` ended."""
        ...


class LearnerGroup(Protocol):
    """N learner ranks seen as one: calls fan out, results come back reduced over ranks."""

    def logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """Token log-probs [rows, T] of the policy (or the frozen reference), in the batch's row
        order, aligned like TrainBatch.old_logprobs; 0 where loss_mask is False."""
        ...

    def train_step(self, batch: Batch, objective: Objective) -> StepMetrics:
        """One optimizer step over the whole batch (micro-batches, gradient accumulation)."""
        ...

    def update(self, batch: TrainBatch, objective: Objective, *, reference: bool, updates: int) -> StepMetrics:
        """GRPO's whole policy update of one step, on the ranks: the reference log-probs when
        `reference`, the old log-probs when `updates` > 1 (the policy that sampled), then `updates`
        optimizer steps, stopping after one the learners skipped as NaN/inf. The batch goes to the
        ranks once and the log-probs never leave them. Returns the last step's metrics."""
        ...

    def save(self, path: str) -> None:
        """Write the model (HF safetensors) and the optimizer/scheduler state under `path`."""
        ...

    def load(self, path: str) -> None:
        """Restore what `save` wrote."""
        ...


class WeightSync(Protocol):
    """Pushes the learners' current weights into the generator.

    Ordering contract: `push` is called after the optimizer step of step k and before the
    generation of step k+1; it returns only once the generator serves the new weights, so the
    next `generate` samples from the policy that was just trained (strictly on-policy).
    """

    def push(self, version: int) -> dict[str, float]:
        """Send the weights to every engine; return where the time went (`sync/engine{e}_s`: the
        seconds engine e spent receiving and committing; `sync/gather_s` and `sync/send_s`: the
        learners' gathering and handing over). The loop times the whole push itself."""
        ...


class RewardScorer(Protocol):
    """Scores completions with the configured reward functions (off the learners).

    Completions arrive as token ids and become text here, the only place that needs it: one
    batched `rlhf.scoring.decode_completions` per call, so every generator backend hands the
    reward functions the same strings."""

    def score(self, rows: Sequence[PromptRow], token_ids: Sequence[Sequence[int]]
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """rows[i] is the prompt row of completion i, token_ids[i] its generated ids
        (`Completion.model_token_ids()`: of a multi-turn episode, the model's own turns). Returns
        rewards [N] and metrics (per-function means, failures, timeouts)."""
        ...


class Cluster(Protocol):
    """Everything a GRPO step talks to, built once by `actors.cluster.build_cluster`."""

    generator: Generator
    learners: LearnerGroup
    weight_sync: WeightSync
    rewards: RewardScorer

    def shutdown(self) -> None: ...
