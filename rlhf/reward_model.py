"""Learned rewards: a sequence classifier that scores prompt + response, or a generative judge.

    rm = RewardModel("path/to/rm", batch_size=8, max_tokens_per_batch=4096, device=torch.device("cuda"))
    scores = rm.score(rows, completions)              # one float per sample
    scores, parse_failed = Judge(template, generator, tokenizer, max_tokens=32).score(rows, completions)

A recipe names them next to reward functions (`{model: path}`, `{judge: score_0_10}`) and
`rlhf.scoring.PoolScorer` mixes them in by weight (in training, inside the reward worker).

Decisions:
- Text: the reward model's own chat template over the row's messages (or its prompt as one user
  message) and the response as the assistant's; without a template, prompt + response.
- Score: the single logit at the last real token (HF's classifier heads find it by the pad id;
  batches are right-padded and the pad id set when the config lacks one).
- Batches (`reward_batches`): `batch_size` rows in order, or by token budget: sorted by length and
  packed while rows x longest row <= the budget (the learner's rule); scores return in order.
- Where: on `device` in `dtype` (the reward worker: fp32 on CPU, bf16 on a GPU share). With
  `offload`, the weights live in host memory and visit the device for each `score` only, so a
  colocated learner has the memory while it trains; the caller returns the freed cache.
- Judge: its template (rewards.judges: what it holds, how an answer becomes a score) goes as one
  user message through the judge model's chat template to any `rlhf.protocols.Generator` (the
  policy's engines, or the judge model's own), greedy; an answer without a score scores 0 and is
  counted (`parse_failed`).
- Nothing caught: a model that cannot score stops the run (it is part of the setup, not a sample's
  failure); `check_reward_model` loads its config before Ray starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rewards.judges import parse_score
from rlhf.data.batching import token_budget_bins
from rlhf.protocols import Generator
from rlhf.types import PromptRow, SamplingSpec


def check_reward_model(path: str) -> None:
    """Raise RewardLoadError (one line) unless `path` is a model folder with one output ("Nothing caught")."""
    from transformers import AutoConfig

    from rewards.api import RewardLoadError

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        raise RewardLoadError(f"reward model '{path}' cannot be loaded: {why}") from None
    if config.num_labels != 1:
        raise RewardLoadError(f"reward model '{path}' has {config.num_labels} outputs; "
                              "a reward model has one")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def reward_model_name(path: str) -> str:
    """The name of a reward model's metrics, `reward/<name>/mean`: `rm_` and its folder's name."""
    return "rm_" + _safe(Path(path).name)


def reward_batches(lengths: Sequence[int], batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Sample indices of each forward pass ("Batches"): consecutive runs of `batch_size`, or with a
    token budget the learner's micro-batch rule (`rlhf.data.batching.token_budget_bins`: longest
    first, packed while rows x longest row <= max_tokens, a longer sample alone). Every index once."""
    if not max_tokens:
        return [list(range(s, min(s + batch_size, len(lengths)))) for s in range(0, len(lengths), batch_size)]
    return token_budget_bins(lengths, max_tokens)


class RewardModel:
    """A sequence-classification model with one output, scoring (row, response) pairs ("Text", "Score",
    "Batches", "Where")."""

    def __init__(self, path: str, *, batch_size: int = 8, max_tokens_per_batch: int = 0,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 offload: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path, self.batch_size, self.max_tokens = path, batch_size, max_tokens_per_batch
        self.device, self.offload = device or torch.device("cpu"), offload
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._home = torch.device("cpu") if offload else self.device
        self.model.to(self._home)

    def text(self, row: PromptRow, response: str) -> str:
        """The conversation as the reward model reads it ("Text")."""
        if self.tokenizer.chat_template is None:
            return row.user_text() + response
        messages: list[dict[str, Any]] = (list(row.prompt) if not isinstance(row.prompt, str)
                                          else [{"role": "user", "content": row.prompt}])
        return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}],
                                                  tokenize=False)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def score(self, rows: Sequence[PromptRow], responses: Sequence[str]) -> list[float]:
        """One score per (rows[i], responses[i])."""
        ids = self.tokenizer([self.text(r, c) for r, c in zip(rows, responses)], add_special_tokens=False)["input_ids"]
        scores = [0.0] * len(ids)
        if self.offload:
            self.model.to(self.device)
        try:
            for batch in reward_batches([len(x) for x in ids], self.batch_size, self.max_tokens):
                enc = self.tokenizer.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
                # use_cache=False: a scoring pass needs no KV cache, which would hold every layer's keys
                # and values at once (on SmolLM2, 2.6x the activations the planner counts).
                inputs = {k: v.to(self.device) for k, v in enc.items()}
                logits = self.model(**inputs, use_cache=False).logits[:, 0]
                for i, value in zip(batch, logits.float().tolist()):
                    scores[i] = value
        finally:
            if self.offload:
                self.model.to(self._home)
        return scores


class Judge:
    """A template, the engine that answers it, and the judge model's tokenizer ("Judge")."""

    def __init__(self, template: str, generator: Generator, tokenizer: Any, *, max_tokens: int) -> None:
        self.template, self.generator, self.tokenizer, self.max_tokens = template, generator, tokenizer, max_tokens

    def prompt_ids(self, row: PromptRow, response: str) -> list[int]:
        """The judge's prompt for one sample, as token ids."""
        text = self.template.format(prompt=row.user_text(), response=response)
        if getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=True)["input_ids"])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, rows: Sequence[PromptRow], responses: Sequence[str]) -> tuple[list[float], int]:
        """One score in [0, 1] per sample, and how many answers held no score (scored 0)."""
        if not responses:
            return [], 0
        prompts = [self.prompt_ids(r, c) for r, c in zip(rows, responses)]
        spec = SamplingSpec(n=1, max_new_tokens=self.max_tokens, temperature=0.0, seed=0)
        answers = self.tokenizer.batch_decode([c.token_ids for c in self.generator.generate(prompts, spec)],
                                              skip_special_tokens=True)
        parsed = [parse_score(a) for a in answers]
        return [0.0 if p is None else p for p in parsed], sum(p is None for p in parsed)
