"""DPO end to end on CPU: Ray + 2 learner ranks over gloo, the frozen reference on the same ranks.

One uninterrupted run on a small fixed pair set per learner backend (FSDP2, DeepSpeed ZeRO-2,
ZeRO-3; the margin must rise), and, for FSDP2, the run resumed from its first checkpoint
(must reproduce the uninterrupted metrics), a run with precomputed reference log-probs (no
reference model; must match the reference-model run), and SimPO.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
# 8 training pairs, 8 per step: every step sees the same pairs, so the margin must grow.
COMMON = [f"dpo.max_steps={STEPS}", "save_every=1", "eval_every=2", "dpo.num_train=8", "dpo.num_eval=8",
          "learner.lr=5e-4"]
REQUIRED = ["step", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
            "logps/chosen", "logps/rejected", "timing/step_s", "throughput/tokens_per_s", "grad_norm"]
BACKENDS = {
    "fsdp2": ["learner.backend=fsdp2"],
    "deepspeed-zero2": ["learner.backend=deepspeed", "learner.zero_stage=2"],
    "deepspeed-zero3": ["learner.backend=deepspeed", "learner.zero_stage=3"],
}
DETERMINISTIC = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "grad_norm"]


def train(output_dir: Path, *extra: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    return run_training("scripts/train_dpo.py", "configs/dpo_tiny_cpu.yaml", output_dir, *COMMON, *extra, wait=wait)


def steps_of(path: Path) -> list[dict]:
    return [r for r in read_metrics(path / "metrics.jsonl") if r["step"] >= 0]


@pytest.fixture(scope="module", params=list(BACKENDS))
def full_run(request, tmp_path_factory) -> Path:
    """One uninterrupted run per learner backend (every test below that takes it runs per backend)."""
    out = tmp_path_factory.mktemp(f"dpo_full-{request.param}")
    proc = train(out, *BACKENDS[request.param])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_metrics_every_step_and_the_margin_rises(full_run):
    records = steps_of(full_run)
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert not [k for k in REQUIRED if k not in r]
        assert r["throughput/tokens_per_s"] > 0 and r["pairs"] == 8
    first, last = records[0], records[-1]
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at step 0
    assert first["rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    margins = [r["rewards/margin"] for r in records]
    assert margins == sorted(margins) and last["rewards/margin"] > 0.05, margins
    assert last["loss"] < first["loss"] and last["rewards/accuracy"] > 0.5
    assert (full_run / "metrics.png").stat().st_size > 10_000


def test_held_out_pairs_are_evaluated_before_during_and_after(full_run):
    evals = [r for r in read_metrics(full_run / "metrics.jsonl") if "eval/reward_accuracy" in r]
    assert [r["step"] for r in evals] == [-1, 1, 3]  # before training, every 2 steps, and the last step
    assert evals[0]["eval/loss"] == pytest.approx(0.693147, abs=1e-5) and evals[0]["eval/margin"] == 0.0
    assert all(0.0 <= r["eval/logp_accuracy"] <= 1.0 and r["eval/pairs"] == 8 for r in evals)


def test_checkpoints_are_hf_folders(full_run):
    from transformers import AutoModelForCausalLM

    ckpts = sorted((full_run / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    model = AutoModelForCausalLM.from_pretrained(ckpts[-1] / "model")
    assert model.config.model_type == "qwen2"


@pytest.mark.parametrize("full_run", ["fsdp2"], indirect=True)  # one backend is enough for the variants
def test_precomputed_reference_matches_the_reference_model(full_run, tmp_path):
    """Scored by the policy before its first update, the cached reference log-probs equal the
    frozen reference model's, so the run is the same without holding a reference model."""
    proc = train(tmp_path, "dpo.precompute_ref=true", "eval_every=0", "save_every=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "scoring 8 eval and 8 train pairs" in proc.stdout
    assert (tmp_path / "reference_logps.pt").is_file()
    for want, got in zip(steps_of(full_run), steps_of(tmp_path)):
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (got["step"], key)


def test_simpo_needs_no_reference(tmp_path):
    proc = train(tmp_path, "dpo.loss_type=simpo", "dpo.beta=2.0", "eval_every=0", "save_every=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = steps_of(tmp_path)
    assert len(records) == STEPS and not (tmp_path / "reference_logps.pt").exists()
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize("full_run", ["fsdp2"], indirect=True)
def test_resumed_run_continues_exactly(full_run, tmp_path):
    """The uninterrupted run's folder as a run killed after its first checkpoint leaves it (later
    checkpoints gone; its metrics.jsonl still holds the later steps, which the resume must drop),
    resumed: the policy, reference, optimizer and data position come back, so steps 1-3 repeat.
    Killing a run mid-way is tests/e2e/test_grpo_e2e.py's and tests/e2e/test_faults.py's: the checkpoint
    is the same folder whether the run then dies or not."""
    out = tmp_path / "resumed"
    shutil.copytree(full_run, out)
    for later in (out / "checkpoints").glob("step_*"):
        if later.name > "step_000001":
            shutil.rmtree(later)

    resumed = train(out, "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    want, got = steps_of(full_run), steps_of(out)
    assert [r["step"] for r in got] == list(range(STEPS))
    for w, g in zip(want[1:], got[1:]):
        for key in DETERMINISTIC:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)


def test_bad_input_is_one_line_before_ray_starts(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/train_dpo.py", "--config", "configs/dpo_tiny_cpu.yaml",
                           f"output_dir={tmp_path}", "dpo.dataset=jsonl:/no/such.jsonl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: dpo.dataset=")
    proc = subprocess.run([sys.executable, "scripts/train_dpo.py", "--config", "configs/grpo_tiny_cpu.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "use scripts/train_grpo.py" in proc.stderr
