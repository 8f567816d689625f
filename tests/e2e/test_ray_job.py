"""`ray job submit` (scripts/submit.sh) of the tiny DPO recipe to a loopback-only Ray head with token
auth, as the README starts it, and that head's every process listening on loopback only; and a
two-node Ray cluster on this machine (a head plus a second `ray start --address=...` node, each with
its own resources) that GRPO runs spread over, through `ray job submit` and from a driver outside
the cluster: engines and learner ranks on both nodes, the learners' gloo group and the weight sync
across them, and the loss of a node mid-run. One cluster of each kind serves its tests.
Every node and client of these tests shares one random token (token auth, as on a real cluster)."""

from __future__ import annotations

import os
import re
import secrets
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

from rlhf.run.checkpoint import MANIFEST, checkpoint_root
from rlhf.run.metrics import read_metrics
from tests.support.processes import is_loopback, listeners

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOKEN = secrets.token_hex(32)
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""What keeps a head on 127.0.0.1: Ray 2.60 on Linux replaces `--node-ip-address=127.0.0.1` with the
address that routes outwards (and then listens on every interface) unless multi-node is off."""


QUIET_PORTS = range(20000, 32768)
"""Where `ray start` gets the port numbers it needs up front: below the kernel's ephemeral range
(`ip_local_port_range`, 32768-60999 by default), where every `bind(0)` lands and where Ray picks
its own random ports (at or above one such port), and above Ray's worker ports (10002-19999). So
no Ray cluster or learner group that a test beside this file starts takes one of them between the
check here and `ray start`."""
_handed_out: set[int] = set()


def _free_port() -> int:
    """A port of QUIET_PORTS that is free now and that this module has not handed out before."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in QUIET_PORTS:
        if port >= low:
            break
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {QUIET_PORTS} below the ephemeral range ({low})")


def _head_pids(temp_dir: str, gcs_port: int | None = None) -> set[int]:
    """The processes of the node started with `temp_dir`: those whose command line names it, and
    their descendants (the agents and workers rename themselves); for a head (`gcs_port`) also its
    Ray client server, whose command line names only the GCS address and whose parent, `ray start`,
    has exited."""
    client = re.compile(rf"ray\.util\.client\.server .*--address=\S+:{gcs_port}\b".encode())
    parents: dict[int, int] = {}
    found: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
            if temp_dir.encode() in cmdline or (gcs_port and client.search(cmdline)):
                found.add(int(proc.name))
        except (OSError, ValueError, IndexError):
            pass
    while more := {pid for pid, ppid in parents.items() if ppid in found} - found:
        found |= more
    return found


def _stop_head(temp_dir: str, gcs_port: int | None = None) -> None:
    """Stop only this node (`ray stop` would stop every Ray instance on the machine)."""
    for pid in _head_pids(temp_dir, gcs_port):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ray_env() -> dict[str, str]:
    """This environment with token auth on and this module's token, without RAY_ADDRESS."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))},
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, "PATH": f"{BIN}:{os.environ['PATH']}"}


def _start_node(temp_dir: str, *args: str, env: dict[str, str] | None = None) -> None:
    """`ray start --node-ip-address=127.0.0.1` (kept as such only with `LOOPBACK_ONLY` in `env`) with
    its own temp dir and free ports for every agent (another node or head on this machine may hold
    Ray's fixed defaults). Temp dirs are short on purpose: Ray's Unix socket paths must fit in 107
    bytes."""
    start = [str(BIN / "ray"), "start", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
             f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
             "--disable-usage-stats", *args]
    started = subprocess.run(start, env=env or _ray_env(), capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]


@contextmanager
def _cluster(nodes: int):
    """A head with the dashboard (the Jobs API) on 127.0.0.1, plus `nodes - 1` worker nodes; yields
    (dashboard URL, GCS address, env, temp dirs). One node alone is loopback-only (`LOOPBACK_ONLY`,
    as the README starts a test head); with more, the nodes take this machine's outward address
    (multi-node cannot be on with loopback). Each node has 2 CPUs and a custom resource `node<i>`;
    everything is stopped afterwards."""
    temp_dirs = [tempfile.mkdtemp(prefix=f"ray{i}", dir="/tmp") for i in range(nodes)]
    dashboard, gcs = _free_port(), _free_port()
    try:
        _start_node(temp_dirs[0], "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard}", "--include-dashboard=true", "--num-cpus=2",
                    '--resources={"node0": 1}', env={**_ray_env(), **LOOPBACK_ONLY} if nodes == 1 else None)
        for i in range(1, nodes):
            _start_node(temp_dirs[i], f"--address=127.0.0.1:{gcs}", "--num-cpus=2",
                        f'--resources={{"node{i}": 1}}')
        yield f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", _ray_env(), temp_dirs
    finally:
        for i, d in reversed(list(enumerate(temp_dirs))):
            _stop_head(d, gcs if i == 0 else None)
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    with _cluster(1) as (dashboard, gcs, env, temp_dirs):
        yield dashboard, env, temp_dirs[0], int(gcs.rsplit(":", 1)[1])


def submit(ray_head, *args: str) -> subprocess.CompletedProcess:
    """scripts/submit.sh with the cluster's token but no RAY_AUTH_MODE: the script turns token auth
    on for `ray job submit` when a token is there, as `ray start` does."""
    address, env = ray_head[:2]
    env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
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


def test_ray_start_ports_come_from_below_the_ephemeral_range_and_never_twice():
    """What lets this file run beside another test worker: no port handed to `ray start` can be
    one that a `bind(0)` elsewhere (another worker's Ray, its learners) is given meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [_free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(p in QUIET_PORTS and p < low for p in ports), (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low  # where the kernel's picks land instead


def test_ray_job_submit_runs_the_tiny_dpo_recipe(ray_head, tmp_path):
    out = tmp_path / "dpo_job_out"
    submit(ray_head, "configs/dpo_tiny_cpu.yaml", "dpo.max_steps=2", "save_every=0", "eval_every=0",
           f"output_dir={out}")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "rewards/margin" in records[-1]
    assert (out / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()


def test_the_test_head_listens_on_loopback_only(ray_head):
    """Every process of the head (GCS, raylet, dashboard and its Jobs API, agents, monitor, Ray
    client server, the workers of the DPO job above) listens on 127.0.0.1 / ::1 only; its dashboard
    refuses a request without the token."""
    import urllib.error
    import urllib.request

    pids = _head_pids(ray_head[2], ray_head[3])
    found = listeners(pids)
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                for pid, *_ in found if Path(f"/proc/{pid}/cmdline").exists()}
    table = "\n".join(f"  {ip}:{port}/{kind} {cmdlines.get(pid, '?')[:90]}" for pid, ip, port, kind in found)
    for title in ("gcs_server", "raylet", "dashboard.py", "ray.util.client.server"):
        assert any(title in cmd for cmd in cmdlines.values()), f"no listener of {title}:\n{table}"
    assert [f for f in found if not is_loopback(f[1])] == [], table
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"{ray_head[0]}/api/jobs/", timeout=30)


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


@pytest.fixture(scope="module")
def two_nodes():
    """One two-node cluster for the tests below, in order: a run spreads over it, then a node dies."""
    with _cluster(2) as cluster:
        yield cluster


def test_a_run_spreads_over_two_ray_nodes(two_nodes, tmp_path):
    """Through `ray job submit` (the driver then runs on the head): engines and learner ranks on both
    nodes, the learners' gloo group spans the nodes, and the weights reach the engine of the other
    node (mismatch at fp32 noise on every step); the final model is saved. A driver outside the
    cluster (`cluster.address=`) is the next test's run."""
    dashboard, _, env, _ = two_nodes
    out = tmp_path / "two_nodes_job"
    job = submit((dashboard, env), "configs/grpo_tiny_cpu.yaml", *TWO_NODES, f"output_dir={out}")
    assert "on 2 node(s)" in job.stdout
    print("\n" + "\n".join(ln for ln in job.stdout.splitlines() if ln.startswith(("cluster:", "placement:"))))
    engine_nodes, learner_nodes = _nodes_of(job.stdout)
    assert engine_nodes == learner_nodes == {"node0", "node1"}
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["mismatch/logprob_abs_diff"] < 1e-4 for r in records)
    assert all(r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0 for r in records)
    assert (out / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()


def test_a_node_that_dies_ends_the_run_with_one_line(two_nodes, tmp_path):
    """A driver outside the cluster (`cluster.address=`) spreads a run over both nodes, then the
    second node's processes are killed mid-run: the driver exits non-zero in bounded time with one
    line naming the actor that was lost and the phase, and where to resume from. (Last: it takes the
    module's cluster down to one node.)"""
    _, gcs, env, temp_dirs = two_nodes
    out = tmp_path / "node_dies"
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml", f"output_dir={out}",
           f"cluster.address={gcs}", *TWO_NODES, "grpo.steps=50", "save_every=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = checkpoint_root(out) / "step_000001" / MANIFEST  # written last: the checkpoint is complete
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert first.exists(), "the run never wrote its first checkpoint"
    _stop_head(temp_dirs[1])  # every process of the second node: its raylet, engine 1, learner rank 1
    stdout, stderr = proc.communicate(timeout=300)  # a driver that waited on the lost node forever fails here
    assert proc.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert _nodes_of(stdout) == ({"node0", "node1"}, {"node0", "node1"})  # it had spread over both
    last = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(last) == 1, stderr[-3000:]
    print(f"\n[node death] {last[0]}")  # -s shows what the user sees
    # The actor named is the first one the driver waits on after the kill, which depends on the phase
    # the node died in: an engine, a learner rank, or the reward worker (Ray places it on either node).
    lost = r"(engine \d|learner rank \d|reward worker)"
    assert re.search(rf"^error: {lost} .*(died|unreachable|failed) during \w+", last[0]), last[0]
    assert "resume=true" in last[0] and "step_" in last[0]
