"""benchmarks/scale.py run end to end on CPU (the records' arithmetic: tests/unit/test_benchmarks.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.e2e
@pytest.mark.ray
def test_scale_runs_a_layout_end_to_end_on_cpu(tmp_path):
    """benchmarks/scale.py --tiny with the two-engine layout (2 engines + 2 ranks) on CPU: the run,
    its cluster line and per-engine figures, the table, the target lines and the JSON record. The
    speed-up against 1gpu and the table of several layouts are unit-tested above on the same
    records (a second launch here would only repeat the start-up)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "benchmarks/scale.py", "--tiny", "--layouts", "2gpu-fsdp2", "--steps", "2",
         "--workdir", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
        cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "| metric | 2gpu-fsdp2 |" in lines
    assert "| engines | 2 |" in lines and "| learner ranks, backend | 2 fsdp2 |" in lines
    assert "2 GPUs vs 1: not measured (needs 1gpu and a 2-GPU layout that ran)" in lines
    assert (tmp_path / "results" / "grpo-gpu-scale-tiny.png").is_file()  # the plot beside the record
    assert any(line.startswith("sync: max ") for line in lines)
    [record] = [json.loads(line) for line in (tmp_path / "results" / "grpo-gpu-scale-tiny.jsonl").read_text()
                .splitlines()]
    assert list(record["layouts"]) == ["2gpu-fsdp2"]
    side = record["sides"]["2gpu-fsdp2"]
    assert side["ok"] and [s["step"] for s in side["steps"]] == [0, 1]
    assert all(s["engines"] == 2 for s in side["steps"]) and side["cluster"]["engines"] == 2
    assert record["summary"]["2gpu-fsdp2"]["samples_per_s"] > 0
    assert record["summary"]["2gpu-fsdp2"]["speedup"] is None  # no 1gpu side to divide by
