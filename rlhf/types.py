"""The data that moves between the loop and the actors: named dataclasses, never string-keyed bags.

Type-only and import-light on purpose: the generator, learner and reward actors all import this
module, so it must not pull in Ray, vLLM or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a task, before tokenization.

    `prompt` is the rendered user text (or chat messages), `answer` the reference the reward
    functions compare against, `meta` every other column of the dataset row (passed to reward
    functions as keyword arguments).
    """

    prompt: str | list[dict[str, str]]
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def user_text(self) -> str:
        """The user-visible prompt (the last user message of chat rows): a reward's `prompt`."""
        if isinstance(self.prompt, str):
            return self.prompt
        return next(m["content"] for m in reversed(self.prompt) if m["role"] == "user")

    def reward_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a reward function gets for this row: `answer` and every meta field."""
        return {"answer": self.answer, **self.meta}


@dataclass(frozen=True)
class SamplingSpec:
    """How the generator samples: one object per call so a call is self-describing."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """Base seed of the call; prompt i of the step samples with `prompt_seed(i)`, so a prompt's
    samples depend on (seed, its global index) only, not on which engine or batch it lands in."""
    ignore_eos: bool = False
    lengths: tuple[int, ...] = ()
    """Forced lengths (`generation.forced_lengths`): the token limit of each completion of the call,
    prompt-major (completion j of prompt i is `lengths[i * n + j]`), each sampled on its own; empty:
    `max_new_tokens` for all."""

    def prompt_seed(self, index: int) -> int | None:
        """The sampling seed of the step's prompt `index` (None when the call is unseeded).

        A SplitMix64 mix of (seed, index), 62 bits: vLLM seeds the k-th of a prompt's n samples
        with seed + k, so neighbouring prompts must not get neighbouring seeds."""
        if self.seed is None:
            return None
        return mix_seed(self.seed, index)


def mix_seed(seed: int, index: int) -> int:
    """A SplitMix64 mix of (seed, index), 62 bits: seeds for items of one run that must not be neighbours."""
    mask = 2**64 - 1
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 2


@dataclass
class Completion:
    """One sampled completion, as token ids only: generators never decode (vLLM skips its
    incremental detokenizer); the reward scorer decodes a step's completions once, in one batch
    (`rlhf.scoring.decode_completions`), where text is needed.

    token_ids: the generated token ids, EOS included when the model stopped on it.
    logprobs:  the sampler's log-prob of each generated token (same length as token_ids);
               compared with the learner's to measure train/inference mismatch.
    finish_reason: "stop" (EOS) or "length" (max_new_tokens reached).
    mask:      a multi-turn episode's (rlhf.env.episodes): True on the model's own tokens, False on
               tool outputs and template tokens (trained on: the True ones); None: all the model's.
    reward:    a multi-turn episode's reward from its environment; None: reward.functions score it.
    versions:  the weight version that sampled each token (same length as token_ids), for a sample
               continued across weight pushes (partial rollouts, rlhf.partial); None: every token is
               of its RolloutBatch's `version`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    mask: list[bool] | None = None
    reward: float | None = None
    versions: list[int] | None = None

    def model_token_ids(self) -> list[int]:
        """The tokens the model wrote (all of them unless `mask` says otherwise): what rewards score."""
        if self.mask is None:
            return self.token_ids
        return [t for t, m in zip(self.token_ids, self.mask) if m]


@dataclass(frozen=True)
class SampleRequest:
    """One sample for a streaming engine (`rlhf.protocols.SampleStream`): a new one, or one continued
    under newer weights, whose `prompt_ids` are then its prompt followed by the tokens it has."""

    key: int
    """The caller's name for the sample; the engine answers with it."""
    prompt_ids: list[int]
    max_new_tokens: int
    """Tokens still to generate."""
    seed: int | None = None


@dataclass
class RolloutBatch:
    """All rollouts of one step, flat and grouped: completions[i*G:(i+1)*G] answer prompt i.

    prompt_ids[i] are the token ids of prompt i; `rewards` is [num_prompts * G] once scored.
    """

    rows: list[PromptRow]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    group_size: int
    rewards: torch.Tensor | None = None
    reward_metrics: dict[str, float] = field(default_factory=dict)
    engine_metrics: dict[str, float] = field(default_factory=dict)
    """Per-engine generation figures of the step (Generator.last_metrics)."""
    version: int = 0
    """The weight version that generated every completion: the number of optimizer steps behind it
    ("Weights change only between generations" in rlhf.rollouts); with partial rollouts the oldest
    token's, each completion's `versions` telling its tokens'."""


@dataclass
class TrainBatch:
    """Right-padded token batch the learner trains on. B sequences, T = longest prompt+completion.

    input_ids:      [B, T] long, prompt followed by completion, padded with pad_id.
    attention_mask: [B, T] bool, True on real tokens.
    loss_mask:      [B, T] bool, True on completion tokens (the ones whose log-prob is trained).
    advantages:     [B] float, one advantage per sequence (GRPO), broadcast over its tokens.
    old_logprobs:   [B, T] float or None: log-probs of the policy that sampled, recomputed by the
                    learner before the first update when a step makes several updates; None means
                    strictly on-policy (one update per step): the ratio is 1 and old = current.detach().
    ref_logprobs:   [B, T] float or None, reference-model log-probs when KL is on.
    sampler_logprobs: [B, T] float or None, the generator's own log-probs of the sampled tokens;
                    only used to measure the train/inference mismatch.

    Log-probs are aligned to the token they score: logprobs[:, t] is log p(input_ids[:, t] | < t).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    # Learners treat both batch types alike through these: rows per item, select, trim, dummy, gather.
    rows_per_item = 1

    def select(self, index: slice | torch.Tensor) -> TrainBatch:
        """Rows `index` of every tensor (micro-batching and sharding across ranks)."""
        return self._map(lambda t: t[index], advantages=self.advantages[index])

    def trim(self, width: int) -> TrainBatch:
        """Columns [0, width) of every [B, T] tensor (drop right padding)."""
        return self._map(lambda t: t[:, :width], advantages=self.advantages)

    def _map(self, f, *, advantages: torch.Tensor) -> TrainBatch:
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else f(t)

        return TrainBatch(
            input_ids=f(self.input_ids), attention_mask=f(self.attention_mask), loss_mask=f(self.loss_mask),
            advantages=advantages, old_logprobs=opt(self.old_logprobs), ref_logprobs=opt(self.ref_logprobs),
            sampler_logprobs=opt(self.sampler_logprobs),
        )

    def dummy(self) -> TrainBatch:
        """One padding token with an empty loss mask and the same optional fields: a pass that keeps
        a rank's collectives in step with the others and adds nothing to the loss."""
        zeros = torch.zeros((1, 1))
        return TrainBatch(
            input_ids=torch.zeros((1, 1), dtype=torch.long), attention_mask=torch.ones((1, 1), dtype=torch.bool),
            loss_mask=torch.zeros((1, 1), dtype=torch.bool), advantages=torch.zeros(1),
            old_logprobs=None if self.old_logprobs is None else zeros,
            ref_logprobs=None if self.ref_logprobs is None else zeros,
            sampler_logprobs=None if self.sampler_logprobs is None else zeros,
        )

    @staticmethod
    def gather_rows(parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-row outputs of contiguous shards (in shard order) back into batch row order."""
        return torch.cat(parts, dim=0)


@dataclass
class PreferenceBatch:
    """P preference pairs as one right-padded batch of 2P rows: chosen rows first, then rejected,
    so one forward pass scores both responses of every pair.

    input_ids:          [2P, T] long; row i is prompt+chosen_i, row P+i is prompt+rejected_i.
    attention_mask:     [2P, T] bool, True on real tokens.
    loss_mask:          [2P, T] bool, True on response tokens.
    ref_chosen_logps:   [P] float, *summed* reference log-prob of each chosen response
                        (`DPOObjective.sequence_logps` on the reference model's token log-probs);
                        None for SimPO, which has no reference.
    ref_rejected_logps: [P] float, same for the rejected responses.

    `len()` counts pairs; selecting pairs keeps both rows of each pair (chosen block first).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None

    rows_per_item = 2

    def __len__(self) -> int:
        """Number of pairs P (half the rows)."""
        return self.input_ids.shape[0] // 2

    def select(self, index: slice | torch.Tensor) -> PreferenceBatch:
        """Pairs `index` (both rows of each pair stay together, chosen rows first)."""
        pairs = torch.arange(len(self))[index]
        rows = torch.cat([pairs, pairs + len(self)]).to(self.input_ids.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[pairs.to(t.device)]

        return PreferenceBatch(self.input_ids[rows], self.attention_mask[rows], self.loss_mask[rows],
                               pick(self.ref_chosen_logps), pick(self.ref_rejected_logps))

    def trim(self, width: int) -> PreferenceBatch:
        """Columns [0, width) of the token tensors (drop right padding)."""
        cut = slice(None), slice(0, width)
        return PreferenceBatch(self.input_ids[cut], self.attention_mask[cut], self.loss_mask[cut],
                               self.ref_chosen_logps, self.ref_rejected_logps)

    def dummy(self) -> PreferenceBatch:
        """One pair of single padding tokens with empty loss masks (see TrainBatch.dummy)."""
        ref = None if self.ref_chosen_logps is None else torch.zeros(1)
        return PreferenceBatch(torch.zeros((2, 1), dtype=torch.long), torch.ones((2, 1), dtype=torch.bool),
                               torch.zeros((2, 1), dtype=torch.bool), ref, None if ref is None else ref.clone())

    @staticmethod
    def gather_rows(parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-row outputs of pair shards ([2p_r, ...] each, chosen block first) back into the
        batch's row order: all chosen rows, then all rejected rows."""
        halves = [p.chunk(2) if p.shape[0] else (p, p) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


Batch = TrainBatch | PreferenceBatch
"""What learners train on: GRPO rollouts or DPO pairs (both: len, select, trim, dummy, gather_rows)."""


@dataclass(frozen=True)
class PreferencePair:
    """One DPO row after tokenization: the prompt and its two responses."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass
class StepMetrics:
    """What a learner reports after one optimizer step (already averaged over its ranks)."""

    loss: float
    grad_norm: float
    values: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
