"""Learned reward models: an HF sequence-classification model with one output scores prompt + response.

    rm = RewardModel("path/to/rm", batch_size=8)
    scores = rm.score(rows, completions)      # one float per sample

A recipe names one next to reward functions, `reward.functions: [{model: path, weight: 0.5}, ...]`,
and `rlhf.scoring.PoolScorer` mixes it in with its weight (in training, inside the reward worker).

Decisions:
- Text: the text is the reward model's own chat template applied to the conversation: the row's
  messages (or its prompt as one user message) followed by the response as the assistant's, without
  a generation prompt. A tokenizer without a chat template gets prompt + response, concatenated.
- Score: the model's single logit at the last real token (HF's
  `...ForSequenceClassification` heads pick it by the pad id; batches are right-padded and the pad
  id set when the config lacks one).
- Where: on the CPU of the process that scores (the reward worker in training), float32, in batches
  of `batch_size`, under `torch.no_grad`. Placing reward models on GPUs is not done here.
- Nothing caught: unlike reward functions, a model that cannot score stops the run (it is part
  of the setup, not a sample's failure); `check_reward_model` loads its config before Ray starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf.types import PromptRow


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


def reward_model_name(path: str) -> str:
    """The name of a reward model's metrics, `reward/<name>/mean`: `rm_` and its folder's name."""
    return "rm_" + "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(path).name)


class RewardModel:
    """A sequence-classification model with one output, scoring (row, response) pairs ("Text", "Score",
    "Where")."""

    def __init__(self, path: str, *, batch_size: int = 8) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path, self.batch_size = path, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def text(self, row: PromptRow, response: str) -> str:
        """The conversation as the reward model reads it ("Text")."""
        if self.tokenizer.chat_template is None:
            return row.user_text() + response
        messages: list[dict[str, Any]] = (list(row.prompt) if not isinstance(row.prompt, str)
                                          else [{"role": "user", "content": row.prompt}])
        return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}],
                                                  tokenize=False)

    @torch.no_grad()
    def score(self, rows: Sequence[PromptRow], responses: Sequence[str]) -> list[float]:
        """One score per (rows[i], responses[i])."""
        texts = [self.text(r, c) for r, c in zip(rows, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size], padding=True, return_tensors="pt",
                                 add_special_tokens=False)
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores
