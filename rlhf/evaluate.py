"""pass@k of a policy on a task's held-out prompts, through the same Generator the loop samples with.

    evaluator = Evaluator.from_config(cfg, tokenizer)      # fixed eval subset, correctness scorer
    metrics = evaluator(cluster.generator)                 # {"eval/gsm8k/pass@1": 0.41, ...}
    evaluator.close()

Decisions:
- Correctness: a sample is correct when the task's answer checker gives it full credit,
  `reward >= CORRECT_AT` (1.0). The checker is the task's default in `rewards.tasks.TASK_REWARDS` (e.g.
  `rewards.answers:math_equivalence` for `math`), so eval numbers do not move when a recipe adds
  shaping terms (a format bonus) to its training reward; tasks without a default (local files) use
  the recipe's first reward function (`rlhf.scoring.correctness_spec`). A checker's None ("not
  applicable") is wrong.
- pass@k: the unbiased estimator of Chen et al. (2021), averaged over prompts: with n samples
  of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), computed as a product of ratios
  (no factorials, so it is exact in floats for any n). pass@1 is the mean fraction correct.
- Fixed subset: the eval subset is the first `eval.num_prompts` of the held-out split
  (`data.num_eval`, disjoint from training, see rlhf.data.prompts), and the sampling seed is fixed
  too, so two evaluations of the same weights draw the same samples and differences between steps
  are the policy's.
- Sampling: `eval.n` completions per prompt at `eval.temperature` (0: greedy, n=1), capped at
  `eval.max_new_tokens` (0: `generation.max_new_tokens`); top-p/top-k as in training.
- Text: generators return token ids; the scorer decodes them ("Text" in rlhf.scoring), in the
  driver for evaluation and in the reward actor for training, so both see the same strings.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.config import RunConfig
from rlhf.data.prompts import load_prompts, tokenize_prompts
from rlhf.protocols import Generator, RewardScorer
from rlhf.scoring import PoolScorer, decode_completions
from rlhf.types import Completion, PromptRow, SamplingSpec

CORRECT_AT = 1.0
"""A sample is correct when its correctness reward is >= this (full credit of a 0/1 checker)."""
EVAL_SEED_OFFSET = 1_000_002
"""Eval samples use seed `seed * 1_000_003 + EVAL_SEED_OFFSET`, beyond every training step's seed."""
BREAKDOWN_FIELDS = ("level", "subject", "type", "category")
"""Row metadata that the report breaks pass@k down by, when every row has it (MATH, MATH-500, CHAMP)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i), a product of c factors in [0, 1).

    >>> [round(pass_at_k(5, 2, k), 12) for k in (1, 2, 3, 4)]
    [0.4, 0.7, 0.9, 1.0]
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def task_label(task: str) -> str:
    """The task's name in metric keys: the task itself, or a local file's stem (`jsonl:d/x.jsonl` -> x)."""
    kind, sep, path = task.partition(":")
    return Path(path).stem if sep else task


def eval_sampling(cfg: RunConfig) -> SamplingSpec:
    """Sampling of every evaluation of a run ("Sampling"), with its fixed seed ("Fixed subset")."""
    return SamplingSpec(
        n=cfg.eval.n, max_new_tokens=cfg.eval.max_new_tokens or cfg.generation.max_new_tokens,
        temperature=cfg.eval.temperature, top_p=cfg.generation.top_p, top_k=cfg.generation.top_k,
        seed=cfg.seed * 1_000_003 + EVAL_SEED_OFFSET,
    )


# ---------------------------------------------------------------------------------------------
# The held-out prompts and their scorer


@dataclass(frozen=True)
class EvalSet:
    """Held-out prompts, tokenized: rows[i] is rendered as prompt_ids[i]."""

    name: str
    rows: list[PromptRow]
    prompt_ids: list[list[int]]


def load_eval_set(cfg: RunConfig, tokenizer: Any) -> EvalSet:
    """The first `eval.num_prompts` (0: all) of the held-out split that fit `data.max_prompt_tokens`."""
    rows, ids, _ = tokenize_prompts(load_prompts(cfg.data, "eval"), tokenizer, cfg.data)
    if cfg.eval.num_prompts:
        rows, ids = rows[: cfg.eval.num_prompts], ids[: cfg.eval.num_prompts]
    if not rows:
        raise ValueError(f"task {cfg.data.task!r} has no held-out prompts to evaluate on "
                         f"(data.num_eval={cfg.data.num_eval}); set data.num_eval > 0")
    return EvalSet(task_label(cfg.data.task), rows, ids)


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class EvalResult:
    """Every sample of one evaluation: completions[i][j] is sample j of prompt i."""

    name: str
    ks: tuple[int, ...]
    rows: list[PromptRow]
    completions: list[list[Completion]]
    rewards: list[list[float]]

    @property
    def correct(self) -> list[list[bool]]:
        return [[r >= CORRECT_AT for r in rs] for rs in self.rewards]

    def pass_at(self, indices: Sequence[int] | None = None) -> dict[int, float]:
        """pass@k for each k, averaged over the prompts `indices` (default: all)."""
        picked = [self.correct[i] for i in (range(len(self.rows)) if indices is None else indices)]
        return {k: sum(pass_at_k(len(c), sum(c), k) for c in picked) / len(picked) for k in self.ks}

    def breakdown(self) -> dict[str, dict[str, dict[int, float]]]:
        """pass@k per value of each BREAKDOWN_FIELDS field that every row carries (e.g. MATH level)."""
        out = {}
        for field in BREAKDOWN_FIELDS:
            if all(field in r.meta for r in self.rows):
                groups: dict[str, list[int]] = {}
                for i, row in enumerate(self.rows):
                    groups.setdefault(str(row.meta[field]), []).append(i)
                out[field] = {value: self.pass_at(idx) for value, idx in sorted(groups.items())}
        return out

    def metrics(self) -> dict[str, float]:
        """`eval/<task>/pass@k` for each k, and the mean completion length, for metrics.jsonl."""
        lengths = [len(c.token_ids) for cs in self.completions for c in cs]
        return {**{f"eval/{self.name}/pass@{k}": v for k, v in self.pass_at().items()},
                f"eval/{self.name}/response_len/mean": sum(lengths) / len(lengths)}


def evaluate(generator: Generator, scorer: RewardScorer, eval_set: EvalSet, sampling: SamplingSpec,
             ks: Sequence[int]) -> EvalResult:
    """`sampling.n` completions per held-out prompt, each scored by the correctness `scorer`."""
    if any(k > sampling.n for k in ks):
        raise ValueError(f"pass@k with k={max(ks)} needs at least that many samples per prompt "
                         f"(n={sampling.n})")
    n = sampling.n
    completions = generator.generate(eval_set.prompt_ids, sampling)
    rows = [row for row in eval_set.rows for _ in range(n)]
    rewards, _ = scorer.score(rows, [c.token_ids for c in completions])
    flat = rewards.tolist()
    return EvalResult(
        name=eval_set.name, ks=tuple(ks), rows=eval_set.rows,
        completions=[completions[i * n : (i + 1) * n] for i in range(len(eval_set.rows))],
        rewards=[flat[i * n : (i + 1) * n] for i in range(len(eval_set.rows))],
    )


class Evaluator:
    """What the training loop evaluates with: the fixed eval subset, its scorer and its sampling."""

    def __init__(self, eval_set: EvalSet, scorer: PoolScorer, sampling: SamplingSpec,
                 ks: Sequence[int]) -> None:
        self.eval_set, self.scorer, self.sampling, self.ks = eval_set, scorer, sampling, tuple(ks)

    @classmethod
    def from_config(cls, cfg: RunConfig, tokenizer: Any, eval_set: EvalSet | None = None) -> Evaluator:
        """`eval_set`: the held-out prompts when loaded already, else `load_eval_set`."""
        if eval_set is None:
            eval_set = load_eval_set(cfg, tokenizer)
        return cls(eval_set, PoolScorer.correctness(cfg, tokenizer), eval_sampling(cfg), cfg.eval.k)

    def __call__(self, generator: Generator) -> dict[str, float]:
        """Evaluate the generator's current weights; metrics plus `timing/eval_s`."""
        start = time.perf_counter()
        result = evaluate(generator, self.scorer, self.eval_set, self.sampling, self.ks)
        return {**result.metrics(), "timing/eval_s": time.perf_counter() - start}

    def close(self) -> None:
        self.scorer.close()


# ---------------------------------------------------------------------------------------------
# Reporting


def report(result: EvalResult, tokenizer: Any, **context: Any) -> dict[str, Any]:
    """The JSON report: `context` (model, config...), pass@k overall and broken down, every sample
    (decoded here with `tokenizer`, as the scorer did: the scorer keeps no text)."""
    flat = decode_completions(tokenizer, [c.token_ids for cs in result.completions for c in cs])
    n = len(result.completions[0])
    texts = [flat[i * n : (i + 1) * n] for i in range(len(result.rows))]
    return {
        **context,
        "task": result.name,
        "num_prompts": len(result.rows),
        "n": n,
        "correct_if": f"reward >= {CORRECT_AT}",
        "pass@k": {f"pass@{k}": v for k, v in result.pass_at().items()},
        "breakdown": {field: {value: {f"pass@{k}": v for k, v in ks.items()} for value, ks in groups.items()}
                      for field, groups in result.breakdown().items()},
        "metrics": result.metrics(),
        "prompts": [
            {"prompt": row.prompt, "answer": row.answer, "num_correct": sum(correct), "rewards": rewards,
             "completions": completions}
            for row, correct, rewards, completions in zip(result.rows, result.correct, result.rewards, texts,
                                                          strict=True)
        ],
    }


def write_report(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def format_table(result: EvalResult) -> str:
    """pass@k as a plain-text table: one line overall, then one per breakdown group."""
    ks = result.ks
    head = f"{'':<28}{'prompts':>8}" + "".join(f"{f'pass@{k}':>9}" for k in ks)

    def line(label: str, count: int, values: dict[int, float]) -> str:
        return f"{label[:27]:<28}{count:>8}" + "".join(f"{values[k]:>9.3f}" for k in ks)

    title = f"{result.name} (n={len(result.completions[0])})"
    lines = [head, line(title, len(result.rows), result.pass_at())]
    for field, groups in result.breakdown().items():
        for value, values in groups.items():
            count = sum(str(r.meta[field]) == value for r in result.rows)
            lines.append(line(f"  {field}={value}", count, values))
    return "\n".join(lines)
