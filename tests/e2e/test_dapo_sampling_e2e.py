"""Dynamic sampling (DAPO) end to end: a tiny run that drops constant groups, fills its steps and resumes.

The sampling rules themselves: tests/unit/test_dapo_sampling.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

STEPS = 3
DAPO = [f"grpo.steps={STEPS}", "save_every=1", "data.num_train=64", "data.num_eval=4",
        "grpo.prompts_per_step=4", "grpo.group_size=2", "generation.max_new_tokens=16", "grpo.dynamic_sampling=true",
        "grpo.max_sampling_rounds=3", "grpo.overlong=shape", "grpo.overlong_buffer=8",
        "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction_or_constant}]"]
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "response_len/mean", "grad_norm",
                 "dynamic/groups_dropped", "dynamic/extra_rounds", "dynamic/informative_frac", "overlong/penalty_mean"]


def _train(out: Path, *extra: str) -> None:
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *DAPO, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.e2e
@pytest.mark.ray
def test_dynamic_sampling_end_to_end_and_resume(tmp_path):
    out = tmp_path / "run"
    _train(out)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert sum(r["dynamic/groups_dropped"] for r in records) > 0
    for r in records:
        assert 0 <= r["dynamic/extra_rounds"] <= 2 and 0 <= r["dynamic/informative_frac"] <= 1
        assert r["dynamic/groups_dropped"] >= 0 and -1 <= r["overlong/penalty_mean"] <= 0
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for later in (resumed / "checkpoints").glob("step_*"):
        if later.name > "step_000001":
            shutil.rmtree(later)
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:1]))
    _train(resumed, "resume=true")
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(STEPS))
    for want, got in zip(records[1:], again[1:]):
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
