"""`ray job submit` of the tiny GRPO and DPO recipes to a Ray head on 127.0.0.1, as the README says;
and a two-node Ray cluster on 127.0.0.1 (a head plus a second `ray start --address=...` node, each
with its own resources) that a run spreads over: engines and learner ranks on both nodes, the
learners' gloo group and the weight sync across them, directly and through `ray job submit`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
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


def _ray_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}"}


def _start_node(temp_dir: str, *args: str) -> None:
    """`ray start` on 127.0.0.1 with its own temp dir and free ports for every agent (another
    node or head on this machine may hold Ray's fixed defaults). Temp dirs are short on purpose:
    Ray's Unix socket paths must fit in 107 bytes."""
    start = [str(BIN / "ray"), "start", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
             f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
             "--disable-usage-stats", *args]
    started = subprocess.run(start, env=_ray_env(), capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]


@contextmanager
def _cluster(nodes: int):
    """A loopback-only head with the dashboard (the Jobs API), auth off as for a private test
    head, plus `nodes - 1` worker nodes; yields (dashboard URL, GCS address, env). Each node has
    2 CPUs and a custom resource `node<i>`; everything is stopped afterwards."""
    temp_dirs = [tempfile.mkdtemp(prefix=f"ray{i}", dir="/tmp") for i in range(nodes)]
    dashboard, gcs = _free_port(), _free_port()
    try:
        _start_node(temp_dirs[0], "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard}", "--include-dashboard=true", "--num-cpus=2",
                    '--resources={"node0": 1}')
        for i in range(1, nodes):
            _start_node(temp_dirs[i], f"--address=127.0.0.1:{gcs}", "--num-cpus=2", f'--resources={{"node{i}": 1}}')
        yield f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", _ray_env(), temp_dirs
    finally:
        for d in reversed(temp_dirs):
            _stop_head(d)
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    with _cluster(1) as (dashboard, _, env, _):
        yield dashboard, env


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


# ------------------------------------------------------------------------------------------------
# Two nodes


TWO_NODES = ["cluster.placement_strategy=STRICT_SPREAD", "cluster.generator_engines=2", "learner.num_ranks=2",
             "grpo.steps=2", "save_every=0"]


def _nodes_of(stdout: str) -> tuple[set[str], set[str]]:
    """The nodes of the engines and of the learner ranks, from the run's `placement:` line."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith("placement:"))
    engines, learners = line.removeprefix("placement: engines ").split(" | learner ranks ")
    return ({e.split("@")[1] for e in engines.split()},
            {r.split("@")[1] for r in learners.split(" (")[0].split()})


def test_a_run_spreads_over_two_ray_nodes(tmp_path):
    """Engines and learner ranks on both nodes: the learners' gloo group spans the nodes, and the
    weights reach the engine of the other node (mismatch at fp32 noise on every step)."""
    with _cluster(2) as (dashboard, gcs, env, _):
        out = tmp_path / "two_nodes"
        proc = subprocess.run(
            [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml", f"output_dir={out}",
             f"cluster.address={gcs}", *TWO_NODES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "on 2 node(s)" in proc.stdout
        print("\n" + "\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith(("cluster:", "placement:"))))
        engine_nodes, learner_nodes = _nodes_of(proc.stdout)
        assert engine_nodes == learner_nodes == {"node0", "node1"}
        records = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1]
        assert all(r["mismatch/logprob_abs_diff"] < 1e-4 for r in records)
        assert all(r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0 for r in records)

        job_out = tmp_path / "two_nodes_job"
        job = submit((dashboard, env), "configs/grpo_tiny_cpu.yaml", *TWO_NODES, f"output_dir={job_out}")
        engine_nodes, learner_nodes = _nodes_of(job.stdout)
        assert engine_nodes == learner_nodes == {"node0", "node1"}
        assert [r["step"] for r in read_metrics(job_out / "metrics.jsonl")] == [0, 1]


def test_a_node_that_dies_ends_the_run_with_one_line(tmp_path):
    """The second node's processes are killed mid-run: the driver exits non-zero in bounded time
    with one line naming the actor that was lost and the phase, and where to resume from."""
    with _cluster(2) as (_, gcs, env, temp_dirs):
        out = tmp_path / "node_dies"
        cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml", f"output_dir={out}",
               f"cluster.address={gcs}", *TWO_NODES, "grpo.steps=50", "save_every=1"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = out / "checkpoints" / "step_000001" / "run_state.pt"
        deadline = time.time() + 600
        while not first.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert first.exists(), "the run never wrote its first checkpoint"
        killed_at = time.time()
        _stop_head(temp_dirs[1])  # every process of the second node: its raylet, engine 1, learner rank 1
        stdout, stderr = proc.communicate(timeout=300)
        waited = time.time() - killed_at
        assert waited < 180
    assert proc.returncode == 1, stdout[-2000:] + stderr[-3000:]
    last = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(last) == 1, stderr[-3000:]
    print(f"\n[node death] exit after {waited:.0f} s: {last[0]}")  # -s shows what the user sees
    assert re.search(r"^error: (engine|learner rank) \d .*(died|unreachable|failed) during \w+", last[0]), last[0]
    assert "resume=true" in last[0] and "step_" in last[0]
