"""Evaluation: pass@k against hand-computed values, the report, the loop's eval records (with fakes),
and, on the real stack, each task's CPU recipe plus scripts/evaluate.py on the checkpoint it wrote."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf.config import RewardFnConfig, load_config
from rlhf.data.prompts import load_prompts, tokenize_prompts
from rlhf.data.stream import PromptStream
from rlhf.data.tiny_models import build_tokenizer
from rlhf.evaluate import (
    EvalSet,
    eval_sampling,
    evaluate,
    format_table,
    load_eval_set,
    pass_at_k,
    report,
    task_label,
)
from rlhf.run.metrics import read_metrics
from rlhf.scoring import PoolScorer, correctness_spec
from rlhf.types import Completion, PromptRow, SamplingSpec, StepMetrics
from tests.support.runs import private_ray_env

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# The estimator


@pytest.mark.parametrize("n, c, k, expected", [
    # n=5 samples, c=2 correct: 1 - C(3,k)/C(5,k)
    (5, 2, 1, 1 - 3 / 5),    # = 2/5, the fraction correct
    (5, 2, 2, 1 - 3 / 10),   # C(3,2)=3, C(5,2)=10
    (5, 2, 3, 1 - 1 / 10),   # C(3,3)=1, C(5,3)=10
    (5, 2, 4, 1.0),          # only 3 wrong samples: every 4-subset holds a correct one
    (5, 0, 3, 0.0),
    (5, 5, 1, 1.0),
    (4, 1, 2, 1 - 3 / 6),    # C(3,2)=3, C(4,2)=6
    (1, 1, 1, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(2000, 1000) ~ 1e600 overflows a float; the product form does not. Exact value by Fractions:
    n, c, k = 2000, 7, 1000
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_task_label_and_correctness_checker():
    assert task_label("gsm8k") == "gsm8k" and task_label("jsonl:data/my_set.jsonl") == "my_set"
    countdown = load_config(ROOT / "configs/grpo_countdown_smollm2_cpu.yaml")
    assert [f.function for f in countdown.reward.functions][1].startswith("rewards.format")
    assert correctness_spec(countdown) == "rewards.tasks:countdown"  # the shaping term does not count
    local = load_config(None, ["data.task=jsonl:x.jsonl", "reward.functions=[{function: 'rewards.answers:exact_answer'}, "
                                                          "{function: 'rewards.format:think_answer_format'}]"])
    assert correctness_spec(local) == "rewards.answers:exact_answer"  # no task default: the first function


# ---------------------------------------------------------------------------------------------
# evaluate() on a fixed set of generations


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    """`text` as a generator would sample it: its tokens, then EOS (a special token the decode drops)."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


@dataclass
class CannedGenerator:
    """A Generator that answers prompt i with the tokens of texts[i] (n of them per prompt),
    recording each call."""

    texts: list[list[str]]
    tokenizer: Any
    calls: list[SamplingSpec] = field(default_factory=list)

    def generate(self, prompt_ids, sampling):
        self.calls.append(sampling)
        assert len(prompt_ids) == len(self.texts) and all(len(t) == sampling.n for t in self.texts)
        ids = [_ids(self.tokenizer, t) for texts in self.texts for t in texts]
        return [Completion(token_ids=i, logprobs=[-0.5] * len(i), finish_reason="stop") for i in ids]

    def sleep(self):
        pass

    def wake(self):
        pass


ROWS = [PromptRow(prompt="What is 2 + 3?", answer="5", meta={"level": 1}),
        PromptRow(prompt="What is 10 - 4?", answer="6", meta={"level": 2}),
        PromptRow(prompt="What is 3 * 3?", answer="9", meta={"level": 2})]
TEXTS = [["5", "It is 5.", "4", "6", "seven"],     # 2 of 5 correct
         ["14", "no", "x", "0", "-6"],              # 0 of 5
         ["9", "9", "#### 9", "3 * 3 = 9", "9.0"]]  # 5 of 5


@pytest.fixture
def scorer(tokenizer):
    s = PoolScorer([RewardFnConfig(function="rewards.answers:exact_answer")], tokenizer=tokenizer,
                   timeout_s=5, num_workers=0)
    yield s
    s.close()


def test_evaluate_counts_correct_samples_and_averages_pass_at_k(scorer, tokenizer):
    gen = CannedGenerator(TEXTS, tokenizer)
    sampling = SamplingSpec(n=5, max_new_tokens=8, temperature=1.0, seed=3)
    result = evaluate(gen, scorer, EvalSet("sums", ROWS, [[1], [2], [3]]), sampling, ks=(1, 2, 3))
    assert gen.calls == [sampling]
    assert [sum(c) for c in result.correct] == [2, 0, 5]
    # per prompt: pass@1 = c/n; pass@2 = 1 - C(n-c,2)/C(5,2); pass@3 = 1 - C(n-c,3)/C(5,3)
    want = {1: (2 / 5 + 0 + 1) / 3, 2: (7 / 10 + 0 + 1) / 3, 3: (9 / 10 + 0 + 1) / 3}
    assert result.pass_at() == pytest.approx(want)
    assert result.breakdown() == {"level": {"1": pytest.approx({1: 0.4, 2: 0.7, 3: 0.9}),
                                            "2": pytest.approx({1: 0.5, 2: 0.5, 3: 0.5})}}
    mean_len = sum(len(_ids(tokenizer, t)) for ts in TEXTS for t in ts) / 15
    assert result.metrics() == pytest.approx({"eval/sums/pass@1": want[1], "eval/sums/pass@2": want[2],
                                              "eval/sums/pass@3": want[3], "eval/sums/response_len/mean": mean_len})
    with pytest.raises(ValueError, match="k=6 needs at least that many samples"):
        evaluate(gen, scorer, EvalSet("sums", ROWS, [[1], [2], [3]]), sampling, ks=(1, 6))


def test_report_holds_every_sample_and_the_table_every_group(scorer, tokenizer, tmp_path):
    result = evaluate(CannedGenerator(TEXTS, tokenizer), scorer, EvalSet("sums", ROWS, [[1], [2], [3]]),
                      SamplingSpec(n=5, max_new_tokens=8), ks=(1, 5))
    data = json.loads(json.dumps(report(result, tokenizer, model="m")))  # plain JSON all the way down
    assert data["model"] == "m" and data["task"] == "sums" and (data["num_prompts"], data["n"]) == (3, 5)
    assert data["pass@k"] == pytest.approx({"pass@1": 7 / 15, "pass@5": 2 / 3})
    assert data["breakdown"]["level"]["2"] == pytest.approx({"pass@1": 0.5, "pass@5": 0.5})
    assert [p["num_correct"] for p in data["prompts"]] == [2, 0, 5]
    assert data["prompts"][0]["completions"] == TEXTS[0] and data["prompts"][0]["rewards"] == [1, 1, 0, 0, 0]
    table = format_table(result).splitlines()
    assert table[0].split() == ["prompts", "pass@1", "pass@5"]
    assert table[1].split() == ["sums", "(n=5)", "3", "0.467", "0.667"]
    assert [line.split() for line in table[2:]] == [["level=1", "1", "0.400", "1.000"],
                                                     ["level=2", "2", "0.500", "0.500"]]


def test_eval_set_is_a_fixed_prefix_of_the_held_out_split(tokenizer):
    cfg = load_config(None, ["data.task=arithmetic", "data.num_train=32", "data.num_eval=12", "eval.num_prompts=5"])
    eval_set = load_eval_set(cfg, tokenizer)
    held_out = load_prompts(cfg.data, "eval")
    assert eval_set.name == "arithmetic" and eval_set.rows == held_out[:5]
    assert eval_set.prompt_ids == tokenize_prompts(held_out[:5], tokenizer, cfg.data)[1]
    assert not {r.prompt for r in eval_set.rows} & {r.prompt for r in load_prompts(cfg.data, "train")}
    assert load_eval_set(cfg, tokenizer) == eval_set  # the same prompts at every evaluation of a run
    sampling = eval_sampling(cfg)
    assert (sampling.n, sampling.temperature, sampling.max_new_tokens) == (1, 0.0, cfg.generation.max_new_tokens)
    with pytest.raises(ValueError, match="no held-out prompts.*data.num_eval=0"):
        load_eval_set(load_config(None, ["data.num_eval=0"]), tokenizer)


# ---------------------------------------------------------------------------------------------
# The loop's eval records, with fakes for the cluster


class Policy:
    """A fake generator whose weights "learn" the answers: from weight version 2 on it answers right."""

    def __init__(self, answers: dict[tuple[int, ...], str], tokenizer: Any) -> None:
        self.answers, self.tokenizer, self.version, self.eval_calls = answers, tokenizer, 0, []

    def generate(self, prompt_ids, sampling):
        if sampling.seed % 1_000_003 == 1_000_002:
            self.eval_calls.append(self.version)
        texts = [self.answers[tuple(ids)] if self.version >= 2 else "no idea" for ids in prompt_ids]
        answers = [_ids(self.tokenizer, t) for t in texts]
        return [Completion(ids, [-1.0] * len(ids), "stop") for ids in answers for _ in range(sampling.n)]

    def submit(self, prompt_ids, sampling):
        from rlhf.rollouts import Finished

        return Finished(self.generate(prompt_ids, sampling))

    def last_metrics(self):
        return {}

    def sleep(self):
        pass

    def wake(self):
        pass


@dataclass
class FakeCluster:
    generator: Policy
    rewards: PoolScorer

    def __post_init__(self):
        policy = self.generator

        class Sync:
            def push(self, version):
                policy.version = version
                return {}

        class Learners:
            def update(self, batch, objective, *, reference, updates):
                return StepMetrics(loss=0.5, grad_norm=1.0)

            def save(self, path):
                Path(path, "model").mkdir()

        self.weight_sync, self.learners = Sync(), Learners()

    def shutdown(self):
        pass


def test_run_grpo_logs_eval_at_step_0_every_n_steps_and_after_the_last(tmp_path, tokenizer):
    from rlhf.grpo import run_grpo

    cfg = load_config(None, [f"output_dir={tmp_path}", "data.task=arithmetic", "data.num_train=16", "data.num_eval=6",
                             "eval.num_prompts=4", "eval_every=2", "grpo.steps=5", "grpo.prompts_per_step=2",
                             "grpo.group_size=2", "reward.functions=[{function: 'rewards.tasks:arithmetic'}]"])
    train_rows, train_ids, _ = tokenize_prompts(load_prompts(cfg.data, "train"), tokenizer, cfg.data)
    eval_rows, eval_ids, _ = tokenize_prompts(load_prompts(cfg.data, "eval"), tokenizer, cfg.data)
    answers = {tuple(ids): row.answer for row, ids in zip(train_rows + eval_rows, train_ids + eval_ids)}
    policy = Policy(answers, tokenizer)
    rewards = PoolScorer(cfg.reward.functions, tokenizer=tokenizer, timeout_s=5, num_workers=0)
    run_grpo(cfg, FakeCluster(policy, rewards), PromptStream(list(zip(train_rows, train_ids))), tokenizer)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    evals = {r["step"]: r["eval/arithmetic/pass@1"] for r in records if "eval/arithmetic/pass@1" in r}
    assert evals == {0: 0.0, 2: 1.0, 4: 1.0, 5: 1.0}  # before steps 0, 2, 4 and after the last (step 5)
    assert policy.eval_calls == [0, 2, 4, 5]  # weight versions evaluated: the policy after that many updates
    assert all("reward/mean" in r for r in records[:5]) and "reward/mean" not in records[5]
    assert records[2]["reward/mean"] == 1.0 and records[2]["timing/eval_s"] > 0
    assert records[5].keys() == {"step", "eval/arithmetic/pass@1", "eval/arithmetic/response_len/mean",
                                 "timing/eval_s"}


def test_run_grpo_says_at_once_when_no_group_can_learn(tmp_path, tokenizer, capsys):
    """Every response of the first two steps scores 0 ("no idea"), and from weight version 2 on every
    one scores 1: no group ever holds two rewards. Each of the first steps says so on the terminal,
    with the cause; no stall is said (a stall is a signal lost, and this run never had one); every
    record carries `reward/informative_frac` = 0."""
    from rlhf.grpo import FLAT_WARNING_STEPS, run_grpo

    cfg = load_config(None, [f"output_dir={tmp_path}", "data.task=arithmetic", "data.num_train=16", "data.num_eval=2",
                             "grpo.steps=6", "grpo.prompts_per_step=2", "grpo.group_size=2",
                             "reward.functions=[{function: 'rewards.tasks:arithmetic'}]"])
    rows, ids, _ = tokenize_prompts(load_prompts(cfg.data, "train"), tokenizer, cfg.data)
    policy = Policy({tuple(i): row.answer for row, i in zip(rows, ids)}, tokenizer)
    rewards = PoolScorer(cfg.reward.functions, tokenizer=tokenizer, timeout_s=5, num_workers=0)
    run_grpo(cfg, FakeCluster(policy, rewards), PromptStream(list(zip(rows, ids))), tokenizer)
    out = capsys.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "no learning signal" in line]
    assert [line.split(":")[1].strip() for line in warned] == [f"step {s}" for s in range(FLAT_WARNING_STEPS)]
    assert "all 2 groups scored one reward each (mean 0)" in warned[0] and "every response scored 0" in warned[0]
    assert "every response scored 1" in warned[2]
    assert "learning has stalled" not in out.out + out.err
    assert [r["reward/informative_frac"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0] * 6


def test_signal_watch_says_each_stall_once_and_again_after_the_signal_came_back():
    """informative_frac per step from step 10 (a resumed part): 0 and sparse at first (flat-rewards
    lines for the first FLAT_WARNING_STEPS, no stall: the signal was never there), one healthy step,
    a stall said on its STALL_STEPS-th low step and not repeated, a step at exactly STALL_FRAC
    (healthy), then a second stall said again."""
    from rlhf.grpo import FLAT_WARNING_STEPS, STALL_FRAC, STALL_STEPS, SignalWatch
    from rlhf.types import RolloutBatch

    batch = RolloutBatch(rows=[None, None], prompt_ids=[[1], [2]], group_size=2,
                         completions=[Completion([5] * n, [-1.0] * n, "stop") for n in (10, 20, 30, 40)],
                         rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    fracs = [0.0] * 3 + [0.01] * 3 + [0.3] + [0.0] * 7 + [STALL_FRAC] + [0.04, 0.0, 0.01, 0.0, 0.02, 0.0]
    watch = SignalWatch(start=10, max_new_tokens=64)
    lines = {10 + i: watch.check(10 + i, batch, f) for i, f in enumerate(fracs)}
    said = {step: line.split(": ", 2)[2][:21] for step, line in lines.items() if line}
    assert said == {**{10 + i: "no learning signal, a" for i in range(FLAT_WARNING_STEPS)},
                    16 + STALL_STEPS: "learning has stalled:", 24 + STALL_STEPS: "learning has stalled:"}
    assert lines[29].startswith("warning: step 29: learning has stalled: under 5% of groups")
    assert "last 5 steps (mean 1.4%; reward mean 0.5, responses 25 tokens" in lines[29]


@pytest.mark.parametrize(("rewards", "finish", "cause"), [
    ([0.0, 0.0, 1.0, 1.0], ["length", "length", "stop", "length"], "75% of the responses stopped at generation"),
    ([0.0, 0.0, 0.0, 0.0], ["stop"] * 4, "every response scored 0: check that the prompt template"),
    ([0.0, 0.0, 1.0, 1.0], ["stop"] * 4, "each prompt's responses all scored alike: raise grpo.group_size"),
])
def test_flat_rewards_warning_names_the_likeliest_cause(rewards, finish, cause):
    from rlhf.grpo import flat_rewards_warning, learning_signal
    from rlhf.types import RolloutBatch

    batch = RolloutBatch(rows=[None, None], prompt_ids=[[1], [2]], group_size=2,
                         completions=[Completion([5], [-1.0], f) for f in finish], rewards=torch.tensor(rewards))
    assert learning_signal(batch) == {"reward/informative_frac": 0.0}
    line = flat_rewards_warning(7, batch, max_new_tokens=64)
    assert line.startswith("warning: step 7: no learning signal, all 2 groups") and cause in line
    mixed = RolloutBatch(rows=[None, None], prompt_ids=[[1], [2]], group_size=2,
                         completions=batch.completions, rewards=torch.tensor([0.0, 1.0, 1.0, 1.0]))
    assert learning_signal(mixed) == {"reward/informative_frac": 0.5}


def test_signal_watch_replayed_on_the_countdown_collapse_says_it_once_at_step_21():
    """docs/grpo_countdown_qwen2.5-coder-0.5b_1gpu_metrics.jsonl (H100, 2026-11-28): sparse steps 0-4,
    learning from step 5, then a collapse from step 17 on; the watch says it at step 21 and only then."""
    from rlhf.grpo import SignalWatch
    from rlhf.types import RolloutBatch

    path = ROOT / "docs/grpo_countdown_qwen2.5-coder-0.5b_1gpu_metrics.jsonl"
    key = "reward/informative_frac"
    fracs = {r["step"]: r[key] for r in read_metrics(path) if key in r}
    batch = RolloutBatch(rows=[None], prompt_ids=[[1]], group_size=2, rewards=torch.tensor([1.0, 1.0]),
                         completions=[Completion([5] * 16, [-1.0] * 16, "stop")] * 2)
    watch = SignalWatch(start=0, max_new_tokens=512)
    said = [step for step in sorted(fracs) if watch.check(step, batch, fracs[step])]
    assert len(fracs) == 40 and said == [21]


# ---------------------------------------------------------------------------------------------
# The real stack: each task's CPU recipe, CI-sized, with eval on; evaluate.py on a checkpoint


def test_evaluate_cli_rejects_bad_input_in_one_line(tmp_path):
    cmd = [sys.executable, "scripts/evaluate.py", "--config", "configs/grpo_tiny_cpu.yaml", "--model", "tiny-qwen2",
           "eval.k=[1,4]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=private_ray_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: eval.k=[1, 4] is not allowed: integers in [1, eval.n=1]"
