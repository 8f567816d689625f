"""benchmarks/pin.py: a command on its GPUs' share of the host's cores (qwen_learn.sh starts runs
through it), with a stand-in nvidia-smi naming the host's GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.host_cores import gpu_cores
from benchmarks import pin

REPO = Path(__file__).resolve().parents[2]
AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


def fake_nvidia_smi(folder: Path, gpus: int) -> dict[str, str]:
    """An environment whose `nvidia-smi` lists `gpus` 80 GiB GPUs, as `--query-gpu=index,...` prints them."""
    script = folder / "nvidia-smi"
    rows = "\\n".join(f"{i}, 81559" for i in range(gpus))
    script.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def run_pinned(gpus: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.pin", gpus, "--", sys.executable, "-c", AFFINITY]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60)


def test_a_job_on_one_of_the_hosts_gpus_runs_on_that_gpus_cores(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    want = gpu_cores(["1"], ["0", "1"], cores) or cores  # one core here: nothing to split
    out = run_pinned("1", fake_nvidia_smi(tmp_path, 2)).stdout.splitlines()
    assert out[-1] == str(want)
    if want != cores:
        assert out[0] == f"[pin] GPU 1: cores {pin.cpu_list(want)}"


@pytest.mark.parametrize(("host_gpus", "gpus"), [(0, "0"), (2, "0,1")])
def test_no_gpus_or_every_gpu_of_the_host_keeps_every_core(tmp_path, host_gpus, gpus):
    out = run_pinned(gpus, fake_nvidia_smi(tmp_path, host_gpus)).stdout.splitlines()
    assert out == [str(sorted(os.sched_getaffinity(0)))]


def test_cores_for_ignores_gpus_the_host_does_not_have(monkeypatch):
    monkeypatch.setattr(pin, "gpu_query", lambda field: {"0": 80.0, "1": 80.0, "2": 80.0, "3": 80.0})
    monkeypatch.setattr(pin.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert pin.cores_for(["2"]) == list(range(32, 48))
    assert pin.cores_for(["2", "7"]) == list(range(32, 48)) and pin.cores_for(["7"]) == []
    assert pin.cores_for(["0", "1", "2", "3"]) == []  # the whole host: nothing to pin


def test_a_command_line_without_the_separator_is_refused_in_one_line():
    cmd = [sys.executable, "-m", "benchmarks.pin", "0", "echo"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, check=False, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("usage: python -m benchmarks.pin {GPUS | --cores LIST} --")


def test_named_cores_pin_the_command_without_asking_for_gpus(tmp_path):
    core = min(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "benchmarks.pin", "--cores", str(core), "--", sys.executable, "-c", AFFINITY]
    env = fake_nvidia_smi(tmp_path, 0)  # no GPUs: the named cores still apply
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.splitlines() == [f"[pin] cores {core}", f"[{core}]"]


def test_a_malformed_call_says_how_to_call_it():
    for argv in (["--cores", "0-3"], ["--cores", "0", "echo"], []):
        with pytest.raises(SystemExit, match="usage: python -m benchmarks.pin"):
            pin.main(argv)
