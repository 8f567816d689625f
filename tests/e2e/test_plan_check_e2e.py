"""benchmarks/plan_check.py run end to end on CPU (its verdicts and tables: tests/unit/test_plan_check.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]



@pytest.mark.e2e
@pytest.mark.ray
def test_plan_check_runs_one_configuration_end_to_end_on_cpu(tmp_path):
    """benchmarks/plan_check.py --tiny: 1.5b-fsdp2 on the tiny model, planned for an H100 and run
    with that plan on CPU; the plan reaches the run's config.yaml and the record."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/plan_check.py", "--tiny", "--configs", "1.5b-fsdp2", "--steps", "2",
         "--workdir", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "1.5b-fsdp2: ran" in lines and "| metric | 1.5b-fsdp2 |" in lines
    assert any(line.startswith("  planned for h100-80gb: ") and "learner.max_tokens_per_micro_batch=" in line
               for line in lines)
    assert any(line.startswith("  learner peak: predicted ") and line.endswith("within +-10%: n/a (CPU)")
               for line in lines)
    assert "no planned run OOMs: met (1 run(s))" in lines
    stored = (tmp_path / "results" / "plan-check-tiny.jsonl").read_text().splitlines()
    [record] = [json.loads(line) for line in stored]
    run = record["checks"]["1.5b-fsdp2"]
    assert run["ok"] and [s["step"] for s in run["steps"]] == [0, 1]
    used = yaml.safe_load((tmp_path / "work" / "plan-check-tiny" / "1.5b-fsdp2" / "run" / "config.yaml").read_text())
    assert used["memory"] == {"plan": "auto", "gpu": "h100-80gb", "gpu_memory_gib": 0.0}
    for line in run["plan"]["lines"]:
        key, value = line.split("=", 1)
        section, name = key.split(".")
        assert str(used[section][name]).lower() == value.lower()
    summary = record["summary"]["1.5b-fsdp2"]
    assert summary["predicted_peak_gib"] > 0 and summary["learner_peak_gib"] > 0 and summary["samples_per_s"] > 0
    assert not any(o.startswith("learner.micro_batch_size=") for o in run["overrides"])
