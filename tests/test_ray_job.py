"""`ray job submit` of the tiny GRPO and DPO recipes to a Ray head on 127.0.0.1, as the README says."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf.metrics import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_head(temp_dir: str) -> None:
    """Stop only this head (`ray stop` would stop every Ray instance on the machine): the processes
    whose command line names its temp dir, and their descendants (the agents rename themselves)."""
    parents: dict[int, int] = {}
    doomed: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            if temp_dir.encode() in (proc / "cmdline").read_bytes():
                doomed.add(int(proc.name))
        except (OSError, ValueError, IndexError):
            pass
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in doomed} - doomed
        if not more:
            break
        doomed |= more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def ray_head():
    """A loopback-only head with the dashboard (the Jobs API); auth off, as for a private test head.
    Its temp dir is short on purpose: Ray's Unix socket paths must fit in 107 bytes."""
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    dashboard = _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}"}
    start = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--include-dashboard=true",
             f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}",  # not Ray's fixed defaults: another head may hold them
             "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    try:
        started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(ray_head, *args: str) -> subprocess.CompletedProcess:
    address, env = ray_head
    for _ in range(30):  # the head's job agent comes up a few seconds after `ray start` returns
        proc = subprocess.run(
            ["bash", "scripts/submit.sh", *args], cwd=ROOT,
            env={**env, "RAY_ADDRESS": address, "RAY": str(BIN / "ray")},
            capture_output=True, text=True, timeout=900,
        )
        if "No available agent" not in proc.stderr:
            break
        time.sleep(2)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "succeeded" in proc.stdout.lower(), proc.stdout[-2000:]
    return proc


def test_ray_job_submit_runs_the_tiny_recipe(ray_head, tmp_path):
    out = tmp_path / "job_out"
    submit(ray_head, "configs/grpo_tiny_cpu.yaml", "grpo.steps=2", "save_every=0", f"output_dir={out}")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert (out / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()


def test_ray_job_submit_runs_the_tiny_dpo_recipe(ray_head, tmp_path):
    out = tmp_path / "dpo_job_out"
    submit(ray_head, "configs/dpo_tiny_cpu.yaml", "dpo.max_steps=2", "save_every=0", "eval_every=0",
           f"output_dir={out}")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "rewards/margin" in records[-1]
    assert (out / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()
