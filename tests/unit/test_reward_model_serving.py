"""Learned rewards served off the CPU path (issue 41), on CPU, no Ray: token-budget batches, the reward
worker's device path against the in-process CPU path, generative judges (templates, parsing, failure
counts, mixing by weight), the recipe keys' validation, the reward worker's place in the cluster's
layout and its memory in the planner."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rewards.api import RewardLoadError
from rewards.judges import TEMPLATES, judge_name, load_template, parse_score, template_problem
from rlhf.config import ConfigError, RewardFnConfig, load_config
from rlhf.data.tiny_models import build_tiny_model
from rlhf.reward_model import Judge, RewardModel, reward_batches
from rlhf.scoring import PoolScorer
from rlhf.types import Completion, PromptRow

ROOT = Path(__file__).resolve().parents[2]

ROWS = [PromptRow(prompt="What is 2 + 3?", answer="5"),
        PromptRow(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
                  answer="2"),
        PromptRow(prompt="Say a long sentence about numbers and words, please, a long one.", answer="7"),
        PromptRow(prompt="3 * 3?", answer="9")]
RESPONSES = ["5", "The answer is 3, which is a small number, and a long answer too.", "7 7 7", "9"]


@pytest.fixture(scope="module")
def rm_path(tiny_reward_model) -> Path:
    return tiny_reward_model


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    return build_tiny_model("tiny-qwen2", tmp_path_factory.mktemp("policy"))


def test_token_budget_batches_cover_every_sample_once_longest_first():
    lengths = [5, 30, 12, 30, 7, 60]
    assert reward_batches(lengths, 4) == [[0, 1, 2, 3], [4, 5]]  # no budget: batch_size rows in order
    bins = reward_batches(lengths, 4, max_tokens=64)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert bins[0] == [5]  # 60 tokens: alone (two rows would pad to 120)
    assert bins[1] == [1, 3]  # 2 x 30 = 60 <= 64; ties keep their order
    assert all(len(b) * max(lengths[i] for i in b) <= 64 for b in bins)
    assert reward_batches([100], 4, max_tokens=10) == [[0]]  # longer than the budget: alone


def test_budgeted_batches_score_like_one_sample_at_a_time(rm_path):
    alone = RewardModel(str(rm_path), batch_size=1).score(ROWS, RESPONSES)
    packed = RewardModel(str(rm_path), batch_size=1, max_tokens_per_batch=128).score(ROWS, RESPONSES)
    assert packed == pytest.approx(alone, abs=1e-5)  # in the samples' order, padding ignored
    assert len(set(round(v, 6) for v in packed)) == len(ROWS)
    offloaded = RewardModel(str(rm_path), max_tokens_per_batch=128, device=torch.device("cpu"), offload=True)
    assert offloaded.score(ROWS, RESPONSES) == pytest.approx(alone, abs=1e-5)
    assert next(offloaded.model.parameters()).device.type == "cpu"


def test_the_reward_worker_scores_like_the_cpu_path(rm_path, policy):
    """The served path (`reward.model_device=gpu`, a device share: on this machine a CPU one, the same
    code) in the worker class itself, against the in-process CPU scorer on the same samples."""
    from actors.reward_worker import RewardWorker

    cfg = load_config(None, [f"reward.functions=[{{function: rewards.answers:exact_answer}}, "
                             f"{{model: {rm_path}, weight: 0.5}}]", "reward.model_device=gpu",
                             "reward.max_tokens_per_batch=96", "reward.num_workers=1"])
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    worker = RewardWorker(cfg.reward, str(policy), offload=True)
    cpu = PoolScorer(cfg.reward.functions, tokenizer=tokenizer, timeout_s=10, num_workers=0)
    try:
        served, metrics, warnings = worker.score(ROWS, ids)
        want, want_metrics = cpu.score(ROWS, ids)
    finally:
        worker.close()
        cpu.close()
    torch.testing.assert_close(served, want, atol=1e-5, rtol=0)
    name = f"rm_{rm_path.name}"
    assert metrics[f"reward/{name}/mean"] == pytest.approx(want_metrics[f"reward/{name}/mean"], abs=1e-5)
    assert metrics[f"reward/{name}/time_s"] > 0 and metrics[f"reward/{name}/samples_per_s"] > 0
    assert "reward/pool/time_s" in metrics and warnings == []
    assert "memory/reward_peak_gib" not in metrics  # a device figure: GPU shares only


def test_judge_answers_are_parsed_to_numbers_and_failures_counted():
    assert parse_score("Score: 7") == pytest.approx(0.7)
    assert parse_score("It is fine. **Score:** 8.5 out of 10") == pytest.approx(0.85)  # the tag, not "10"
    assert parse_score("score = 10") == pytest.approx(1.0)
    assert parse_score("I counted 3 errors. Score: 4") == pytest.approx(0.4)  # the tag wins over numbers
    assert parse_score("3 errors, so 6") == pytest.approx(0.6)  # no tag: the last number
    assert parse_score("Score: 11") is None and parse_score("Score: -1") is None  # out of [0, 10]
    assert parse_score("no idea") is None and parse_score("") is None
    assert TEMPLATES["score_0_10"].format(prompt="P", response="R").count("P") >= 1


class CannedEngine:
    """A Generator that answers each judge prompt with the next hand-written text (as token ids)."""

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.tokenizer, self.answers, self.prompts = tokenizer, answers, []

    def generate(self, prompt_ids, sampling):
        assert sampling.temperature == 0.0 and sampling.n == 1
        self.prompts += [list(p) for p in prompt_ids]
        return [Completion(token_ids=self.tokenizer(a, add_special_tokens=False)["input_ids"], logprobs=[],
                           finish_reason="stop") for a in self.answers[:len(prompt_ids)]]


def test_a_judge_mixes_with_a_rule_reward_by_weight(policy):
    tokenizer = AutoTokenizer.from_pretrained(policy)
    answers = ["Score: 8", "garbage", "score: 3", "Score: 42"]
    engine = CannedEngine(tokenizer, answers)
    judge = Judge(TEMPLATES["score_0_10"], engine, tokenizer, max_tokens=8)
    scores, failed = judge.score(ROWS, RESPONSES)
    assert scores == pytest.approx([0.8, 0.0, 0.3, 0.0]) and failed == 2
    first = tokenizer.decode(engine.prompts[0])
    assert "What is 2 + 3?" in first and "[Answer]\n5" in first and first.startswith("<|im_start|>user")

    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    entries = [RewardFnConfig(function="rewards.answers:exact_answer", weight=1.0),
               RewardFnConfig(judge="score_0_10", weight=2.0)]
    scorer = PoolScorer(entries, tokenizer=tokenizer, timeout_s=10, num_workers=0,
                        judge_engine=lambda f: (CannedEngine(tokenizer, answers), tokenizer))
    rewards, metrics = scorer.score(ROWS, ids)
    exact = torch.tensor([1.0, 0.0, 1.0, 1.0])  # "5", a sentence, "7 7 7", "9"
    torch.testing.assert_close(rewards, exact + 2.0 * torch.tensor([0.8, 0.0, 0.3, 0.0]))
    assert metrics["reward/judge_score_0_10/parse_failed"] == 2
    assert metrics["reward/judge_score_0_10/mean"] == pytest.approx(1.1 / 4)
    assert metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
    with pytest.raises(ConfigError, match="needs an engine"):  # evaluation's scorer has none
        PoolScorer(entries, tokenizer=tokenizer, timeout_s=10, num_workers=0)


def test_judge_templates_and_names(tmp_path):
    assert template_problem("score_0_10") is None and template_problem("my_judge.txt") is None
    assert template_problem("Rate {prompt} -> {response}") is None
    assert "lacks {response}" in template_problem("Rate {prompt}")
    assert "only fields" in template_problem("{prompt} {response} {other}")
    good = tmp_path / "strict.txt"
    good.write_text("Q: {prompt}\nA: {response}\nScore: ")
    assert load_template(str(good)).startswith("Q: ")
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholders")
    with pytest.raises(RewardLoadError, match="bad.txt' is not a built-in judge template"):
        load_template(str(bad))
    with pytest.raises(RewardLoadError, match="cannot be read"):
        load_template(str(tmp_path / "missing.txt"))
    assert judge_name("score_0_10") == "judge_score_0_10"
    assert judge_name(str(good), "/models/Qwen2.5-7B") == "judge_strict_Qwen2.5-7B"
    assert judge_name("Rate {prompt} {response}") == "judge_inline"


def test_a_judge_answers_through_a_real_engine_of_its_own(policy, rm_path):
    """The judge model's own engine (`judge_model`, here the HF backend on the tiny random model) in
    the worker: the same code a vLLM judge runs. A random model writes no score: every answer counts
    as a parse failure and scores 0, and nothing stops."""
    from actors.reward_worker import RewardWorker

    cfg = load_config(None, [f"reward.functions=[{{judge: score_0_10, judge_model: {policy}, "
                             "judge_max_tokens: 4}]", "generation.backend=hf"])
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    worker = RewardWorker(cfg.reward, str(policy), generation=cfg.generation)
    try:
        rewards, metrics, _ = worker.score(ROWS, ids)
    finally:
        worker.close()
    name = f"judge_score_0_10_{policy.name}"
    failed = metrics[f"reward/{name}/parse_failed"]
    assert 0 <= failed <= len(ROWS) and rewards.shape == (len(ROWS),)
    assert ((rewards >= 0) & (rewards <= 1)).all()
    assert rewards.sum() == pytest.approx(metrics[f"reward/{name}/mean"] * len(ROWS))


@pytest.mark.parametrize("overrides,message", [
    (["reward.model_device=tpu"], "reward.model_device"),
    (["reward.max_tokens_per_batch=-1"], "reward.max_tokens_per_batch=-1 is not allowed"),
    (["reward.functions=[{judge: 'Rate this: {response}'}]"],
     "reward.functions[0].judge='Rate this: {response}' is not allowed: a built-in judge template"),
    (["reward.functions=[{judge: score_0_10, function: a:b}]"], "reward.functions[0].judge="),
    (["reward.functions=[{function: a:b, judge_model: m}]"], "reward.functions[0].judge_model='m' is not allowed"),
    (["reward.functions=[{judge: score_0_10, judge_max_tokens: 0}]"],
     "reward.functions[0].judge_max_tokens=0 is not allowed"),
    (["reward.functions=[{judge: score_0_10, judge_memory_utilization: 1.5}]"],
     "reward.functions[0].judge_memory_utilization=1.5 is not allowed"),
])
def test_bad_reward_placement_and_judges_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_reward_worker_takes_a_share_like_the_engines(rm_path):
    from actors.cluster import plan_layout
    from rlhf.rules import engine_count, reward_gpus, run_gpus

    rm = [f"reward.functions=[{{model: {rm_path}}}]", "reward.model_device=gpu"]
    colocated = plan_layout(load_config(None, [*rm, "learner.num_ranks=2"]), "cuda", 2)
    assert colocated.bundles == [{"GPU": 1.0}] * 2 and colocated.reward_bundle == 0
    assert colocated.engine_share["GPU"] + colocated.learner_share["GPU"] + colocated.reward_share["GPU"] <= 1.0
    split_cfg = load_config(None, [*rm, "cluster.placement=split", "learner.num_ranks=2"])
    split = plan_layout(split_cfg, "cuda", 1)
    assert split.bundles == [{"GPU": 1.0}] * 4 and split.reward_bundle == 3 and split.reward_share == {"GPU": 1.0}
    assert reward_gpus(split_cfg) == 1 and run_gpus(split_cfg, 1) == 4  # 2 ranks, 1 engine, the reward worker
    # `auto` on the Ray cluster's 4 GPUs: the one the learners and the reward worker leave free (this
    # run once failed at launch: the worker's GPU was taken off the cluster's and then asked for again)
    assert engine_count(split_cfg, "cuda", 4) == 1
    with pytest.raises(ConfigError, match="less learner.num_ranks=2 and the reward worker's GPU leave 0"):
        engine_count(split_cfg, "cuda", 3)
    with pytest.raises(ConfigError, match=r"needs 5 GPUs \(.* \+ 1 for the reward worker\) but the Ray cluster has 4"):
        engine_count(load_config(None, [*rm, "cluster.placement=split", "learner.num_ranks=2",
                                         "cluster.generator_engines=2"]), "cuda", 4)
    on_cpu = load_config(None, [f"reward.functions=[{{model: {rm_path}}}]"])  # reward.model_device=cpu
    assert plan_layout(on_cpu, "cuda", 1).reward_bundle is None and reward_gpus(on_cpu) == 0
    assert plan_layout(load_config(None, rm), "cpu", 1).reward_share == {"CPU": pytest.approx(0.01)}


def test_the_planner_counts_the_reward_model(rm_path):
    from rlhf.planner.memory import GIB, RM_WORKSPACE_GIB, describe, make_plan, reward_memory
    from rlhf.planner.shapes import gpu_kind, model_shape

    base = ["model.dtype=bfloat16", f"reward.functions=[{{model: {rm_path}, batch_size: 4}}]"]
    h100 = gpu_kind("h100-80gb")
    plain = load_config(None, base)
    served = load_config(None, [*base, "reward.model_device=gpu", "reward.max_tokens_per_batch=2048"])
    assert reward_memory(plain, h100.memory_gib * GIB) == (0.0, 0.0)  # on the CPU: nothing on a GPU
    scoring, kept = reward_memory(served, h100.memory_gib * GIB)
    s = model_shape(str(rm_path))  # tiny-qwen2 with a one-output head instead of its untied LM head
    weights = 2 * (s.params() - s.vocab_size * s.hidden_size + s.hidden_size)
    row = 256 + 64 + 16  # data.max_prompt_tokens + generation.max_new_tokens + the chat template's
    workspace = RM_WORKSPACE_GIB * GIB  # cuBLAS's
    assert scoring == pytest.approx(weights + 2 * 2048 * (4 * s.hidden_size + 3 * s.intermediate_size + row)
                                    + workspace)
    assert kept == 0.0  # colocated: offloaded while the learner trains
    shape = model_shape("tiny-qwen2")
    from rlhf.planner.memory import breakdown

    a, b = breakdown(plain, shape, h100), breakdown(served, shape, h100)
    assert b.reward_scoring * GIB == pytest.approx(scoring) and a.reward_scoring == 0
    assert b.contexts > a.contexts  # the reward worker's own CUDA context on GPU 0
    assert "reward worker scoring" in describe(make_plan(served, shape, h100))
    budgetless = dataclasses.replace(served, reward=dataclasses.replace(served.reward, max_tokens_per_batch=0))
    assert reward_memory(budgetless, 0)[0] == pytest.approx(weights + 2 * 4 * row * (
        4 * s.hidden_size + 3 * s.intermediate_size + row) + workspace)  # batch_size rows of the longest row
    judge = load_config(None, [f"reward.functions=[{{judge: score_0_10, judge_model: {rm_path}, "
                               "judge_memory_utilization: 0.25}]"])
    assert reward_memory(judge, 80 * GIB) == (20 * GIB, 20 * GIB)  # an engine never sleeps


def test_the_benchmark_samples_are_the_same_in_every_process(rm_path):
    """benchmarks/reward_model.py's samples (the GPU test's too) come out alike in two processes: a
    fast tokenizer returns its vocabulary in a per-process order, so the words are sorted first."""
    code = ("import sys; from transformers import AutoTokenizer; from benchmarks.reward_model import samples; "
            f"rows, responses = samples(4, 16, AutoTokenizer.from_pretrained({str(rm_path)!r})); "
            "print(repr([r.prompt for r in rows] + responses))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1] and "Calculate" in runs[0]
