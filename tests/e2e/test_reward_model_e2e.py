"""Learned rewards served on a device share (issue 41) through the real stack on CPU: the reward worker
actor with `reward.model_device=gpu` (a CPU share here: the same code) scores like the in-process CPU
path, a judge without a model of its own answers through the policy's engine actor, and a short GRPO
run with the served reward model places the worker, mixes its scores by weight and logs its figures."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import load_config
from rlhf.run.metrics import read_metrics
from rlhf.types import PromptRow
from tests.support.runs import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROWS = [PromptRow(prompt="What is 2 + 3?", answer="5"), PromptRow(prompt="1 + 1?", answer="2"),
        PromptRow(prompt="Say a long sentence about numbers.", answer="7")]
RESPONSES = ["5", "The answer is 3, which is a small number.", "7 7 7"]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_the_reward_actor_scores_like_the_cpu_path(ray_local, tiny_reward_model, tiny_qwen2):
    from transformers import AutoTokenizer

    from actors.reward_worker import RayRewardScorer
    from rlhf.scoring import PoolScorer

    cfg = load_config(None, [f"reward.functions=[{{model: {tiny_reward_model}, weight: 2.0}}]",
                             "reward.model_device=gpu", "reward.max_tokens_per_batch=64"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    served = RayRewardScorer(cfg.reward, str(tiny_qwen2), options={"num_cpus": 0.01}, offload=True)
    cpu = PoolScorer(cfg.reward.functions, tokenizer=tokenizer, timeout_s=10, num_workers=0)
    try:
        rewards, metrics = served.score(ROWS, ids)
        want, _ = cpu.score(ROWS, ids)
    finally:
        served.shutdown()
        cpu.close()
    torch.testing.assert_close(rewards, want, atol=1e-5, rtol=0)
    assert metrics[f"reward/rm_{tiny_reward_model.name}/samples_per_s"] > 0


def test_a_judge_answers_through_the_policys_engine(ray_local, tiny_qwen2):
    """No `judge_model`: the worker asks the engine actors it was handed (here one HF engine on the
    tiny random policy, which writes no score: parse failures, scored 0, the run goes on)."""
    from transformers import AutoTokenizer

    from actors.hf_generator import HFGenerator
    from actors.reward_worker import RayRewardScorer
    from rlhf.config import GenerationConfig

    cfg = load_config(None, ["reward.functions=[{function: rewards.answers:exact_answer}, "
                             "{judge: 'Grade: {prompt} -> {response}. Score:', weight: 0.5, judge_max_tokens: 4}]"])
    engine = ray_local.remote(HFGenerator).options(num_cpus=0.01).remote(
        str(tiny_qwen2), GenerationConfig(backend="hf"), dtype="float32", seed=0, enable_sleep=False)
    scorer = RayRewardScorer(cfg.reward, str(tiny_qwen2), engines=[engine])
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    try:
        rewards, metrics = scorer.score(ROWS, [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES])
    finally:
        scorer.shutdown()
        ray_local.kill(engine)
    failed = metrics["reward/judge_inline/parse_failed"]
    assert 0 <= failed <= len(ROWS) and metrics["reward/judge_inline/time_s"] > 0
    exact = torch.tensor([1.0, 0.0, 1.0])
    judged = rewards - exact
    assert ((judged >= 0) & (judged <= 0.5 + 1e-6)).all()
    assert float(judged.sum()) == pytest.approx(0.5 * metrics["reward/judge_inline/mean"] * len(ROWS), abs=1e-5)


def test_a_grpo_run_scores_with_the_served_reward_model(tmp_path, tiny_reward_model):
    out = tmp_path / "run"
    proc = run_training(
        "scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, "grpo.steps=2", "save_every=0",
        "learner.num_ranks=1", "generation.backend=hf", "data.num_train=16", "data.num_eval=4",
        f"reward.functions=[{{function: rewards.tasks:arithmetic}}, {{model: {tiny_reward_model}, weight: 0.5}}]",
        "reward.model_device=gpu", "reward.max_tokens_per_batch=256", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "| reward worker @node0" in proc.stdout  # a share of bundle 0, beside engine 0 and rank 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    name = f"rm_{tiny_reward_model.name}"
    for r in records:
        assert r["reward/mean"] == pytest.approx(r["reward/arithmetic/mean"] + 0.5 * r[f"reward/{name}/mean"], abs=1e-5)
        assert r[f"reward/{name}/time_s"] > 0 and r[f"reward/{name}/samples_per_s"] > 0
        assert r["reward/pool/time_s"] > 0 and r["timing/reward_s"] >= r[f"reward/{name}/time_s"]
