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


@pytest.mark.e2e
def test_engine_sweep_runs_two_engines_in_processes_beside_one_in_process(tmp_path):
    """benchmarks/engine_sweep.py on the tiny CPU recipe: one engine in this process, then `@2`, two
    engine processes with a shard of the prompts each, released together per call; both give the
    step's every sample (4 prompts x 4 x 16 tokens) in every call, and a record per variant."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    results = tmp_path / "sweep.jsonl"
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine_sweep.py", "--recipe", "configs/grpo_tiny_cpu.yaml", "--calls", "2",
         "--variant", "one", "--variant", "two@2", "--ignore-eos", "--results", str(results),
         "grpo.prompts_per_step=4", "grpo.group_size=4", "generation.max_new_tokens=16"],
        cwd=repo, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = [json.loads(line) for line in results.read_text().splitlines()]
    assert (one["variant"], one["engines"], two["variant"], two["engines"]) == ("one", 1, "two@2", 2)
    for row in (one, two):
        assert [c["tokens"] for c in row["calls"]] == [4 * 4 * 16] * 2
    assert all(len(c["engine_s"]) == 2 and min(c["engine_s"]) > 0 for c in two["calls"])
    assert "| two@2 | 2 |" in proc.stdout
