"""What the GPU acceptance tests share: a training run with the GPU's memory sampled, its metrics,
and a resume from one of its checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.plan_check import sampled_gpus
from rlhf.run.checkpoint import checkpoint_root
from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

HERE = Path(__file__).resolve().parent
GRPO_RECIPE = str(HERE / "grpo_suite.yaml")


def synced(mismatch: list[float], floor_max: float = 0.06) -> bool:
    """After the first update's sync the gap stays at the floor that step 0 (the loaded weights,
    pushed once) shows for this workload: a missed or corrupted sync adds the update's change on
    top. Completions run past their end (ignore_eos) are high-entropy: a bf16 floor near 0.04."""
    return len(mismatch) >= 2 and max(mismatch) <= floor_max and mismatch[1] <= 1.25 * mismatch[0] + 0.005


@dataclass
class Run:
    out: Path
    records: list[dict[str, Any]]
    stdout: str
    seconds: float
    gpu_peaks_gib: dict[str, float]
    """nvidia-smi's memory.used peak of each GPU (index -> GiB) over the run, every process on it,
    sampled 5x a second."""

    @property
    def gpu_peak_gib(self) -> float:
        """The highest of `gpu_peaks_gib`."""
        return max(self.gpu_peaks_gib.values(), default=0.0)

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.records if key in r]

    def first_line(self, prefix: str) -> str | None:
        return next((ln for ln in self.stdout.splitlines() if ln.startswith(prefix)), None)

    @property
    def startup(self) -> str:
        """The run's `start-up:` line without its prefix (where launch time went), "" if missing."""
        return (self.first_line("start-up:") or "").removeprefix("start-up: ")


@dataclass(frozen=True)
class PlannedRun:
    """A planned layout's run, read back: its config as run, the train/inference log-prob mismatch
    per step, each of its GPUs' nvidia-smi peak, the learner's measured and predicted peak, and the
    figures the record keeps."""

    cfg: Any
    mismatch: list[float]
    busy: dict[str, float]
    measured: float
    predicted: float
    figures: dict[str, Any]


def planned_run(run: Run) -> PlannedRun:
    """`run` (a `train` of a planned recipe) against the planner's prediction for this GPU."""
    from rlhf.config import load_config
    from rlhf.planner.memory import breakdown
    from rlhf.planner.shapes import gpu_kind_of_device, model_shape

    cfg = load_config(run.out / "config.yaml")  # as run: the plan settled
    gpu = gpu_kind_of_device(torch.cuda.get_device_name(0), device_gib())
    predicted = breakdown(cfg, model_shape(cfg.model.path), gpu).learner_peak
    measured = max(run.series("memory/learner_peak_gib"))
    mismatch = run.series("mismatch/logprob_abs_diff")
    busy = {index: round(gib, 1) for index, gib in sorted(run.gpu_peaks_gib.items())}
    figures = dict(cluster=run.first_line("cluster:"), placement=run.first_line("placement:"),
                   plan=(run.first_line("memory plan for") or "").split(": ", 1)[-1],
                   mismatch=[round(m, 4) for m in mismatch], sync_s=[round(s, 3) for s in run.series("timing/sync_s")],
                   gpu_peaks_gib=busy, learner_peak_gib=round(measured, 2), predicted_peak_gib=round(predicted, 2),
                   peak_ratio=round(measured / predicted, 3), run_s=round(run.seconds, 1), startup=run.startup)
    return PlannedRun(cfg, mismatch, busy, measured, predicted, figures)


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip a test where this machine has fewer than `n` GPUs, saying so."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs, this machine has {have}")


def device_gib() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def train(script: str, recipe: str, out: Path, *overrides: str, timeout: float = 480) -> Run:
    """`script --config recipe output_dir=out overrides` on a private Ray; asserts it succeeded."""
    start = time.perf_counter()
    with sampled_gpus(poll_s=0.2) as peaks:
        proc = run_training(script, recipe, out, *overrides, timeout=timeout)
    seconds = time.perf_counter() - start
    if os.environ.get("RLHF_GPU_RUNS_LOG"):  # every run's output, for the record (tests/gpu/run.sh)
        with open(os.environ["RLHF_GPU_RUNS_LOG"], "a") as log:
            log.write(f"=== {out.name}: {' '.join(overrides)} | rc {proc.returncode} in {seconds:.1f} s\n"
                      f"{proc.stdout[-20000:]}\n--- stderr\n{proc.stderr[-20000:]}\n")
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    metrics = out / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    return Run(out, records, proc.stdout, seconds, {gpu: peak for gpu, (_, peak) in peaks.items()})


def resume_from(run: Run, step: int, dest: Path, script: str, recipe: str, *overrides: str) -> Run:
    """A copy of `run` cut back to its checkpoint after `step` steps, resumed with `resume=true`:
    it trains the steps after `step` again."""
    shutil.copytree(run.out, dest)
    for ckpt in checkpoint_root(dest).iterdir():
        if ckpt.name != f"step_{step:06d}":
            shutil.rmtree(ckpt)
    kept = [r for r in run.records if r["step"] < step]
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return train(script, recipe, dest, *overrides, "resume=true")


def same_step(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...], rel: float = 1e-3) -> list[str]:
    """The keys on which two records of one step differ by more than `rel` (relative)."""
    return [k for k in keys if abs(a[k] - b[k]) > rel * max(abs(a[k]), abs(b[k]), 1e-6)]
