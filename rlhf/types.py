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


@dataclass(frozen=True)
class SamplingSpec:
    """How the generator samples: one object per call so a call is self-describing."""

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class Completion:
    """One sampled completion.

    token_ids: the generated token ids, EOS included when the model stopped on it.
    logprobs:  the sampler's log-prob of each generated token (same length as token_ids);
               compared with the learner's to measure train/inference mismatch.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


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

    def select(self, index: slice | torch.Tensor) -> TrainBatch:
        """Rows `index` of every tensor (micro-batching and sharding across ranks)."""
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return TrainBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            loss_mask=self.loss_mask[index],
            advantages=self.advantages[index],
            old_logprobs=rows(self.old_logprobs),
            ref_logprobs=rows(self.ref_logprobs),
            sampler_logprobs=rows(self.sampler_logprobs),
        )


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
