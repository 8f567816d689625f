"""Nothing a local run starts listens beyond loopback, and the learners' rendezvous is sealed.

End to end (tiny recipe, real stack): while a local GRPO run is in its training steps, every TCP
socket listening, and every unconnected UDP socket, of every process of the run (the driver and its
rendezvous store, Ray's GCS, raylet, dashboard process, agents and autoscaler monitor, the engine,
learner and reward actors) is bound to 127.0.0.1 / ::1; the processes are found by the run's
session, its process tree and its Ray session folder, not by timing.
Unit level: the rendezvous store binds exactly the address asked for; a sealed store refuses a value
that a client without the run's secret wrote, two gloo ranks rendezvous through sealed stores, and
an ActorGroup's actors get the secret through Ray, not their environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.run.checkpoint import MANIFEST, checkpoint_root
from tests.support.processes import is_loopback

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.ray
def test_a_local_run_listens_on_loopback_only(interrupted_run):
    """The run of conftest.py's `interrupted_run` (the tiny recipe on a private local Ray), its
    processes and sockets read in its steps, after its first checkpoint; it also serves the Ctrl-C
    test of test_failure_lines.py."""
    processes, found = interrupted_run.processes, interrupted_run.listening
    table = "\n".join(f"  {ip}:{port}/{kind}  pid {pid}  {processes.get(pid, '?')[:100]}"
                      for pid, ip, port, kind in sorted(found, key=lambda f: f[0]))
    print(f"\nlisteners of the run:\n{table}")
    # Not vacuous: the driver (its store, its Ray core worker), Ray's GCS and raylet, and the learner
    # and engine actors were found and listen.
    owners = {pid for pid, *_ in found}
    assert interrupted_run.pid in owners, table
    for title in ("gcs_server", "raylet", "ray::LearnerRank", "ray::VLLMGenerator"):
        assert any(title in processes[pid] for pid in owners), f"no listener of {title} found:\n{table}"
    exposed = [f for f in found if not is_loopback(f[1])]
    assert not exposed, f"listening beyond loopback: {exposed}\n{table}"


def test_the_rendezvous_store_binds_only_the_address_it_is_given():
    """host_store on 127.0.0.1: the listening socket is that address (not 0.0.0.0), and a client
    reaches it there."""
    import psutil
    from torch.distributed import TCPStore

    from actors.actor_group import host_store

    addr, port, store = host_store(1, "127.0.0.1")
    mine = [c.laddr for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert (addr, [a.ip for a in mine]) == ("127.0.0.1", ["127.0.0.1"])
    TCPStore(addr, port, is_master=False, use_libuv=True).set("k", "v")
    assert store.get("k") == b"v"


def test_a_store_hosted_through_torchs_rendezvous_binds_its_advertised_address():
    """In a worker set up by `setup_worker_process` (before torch is imported, as in a fresh Ray
    worker), rank 0 of a `tcp://127.0.0.1:0` rendezvous (how vLLM starts its world) serves the
    store on 127.0.0.1 only; without the hook TCPStore listens on every interface."""
    code = ("import psutil; from actors.worker_setup import setup_worker_process; setup_worker_process(); "
            "import torch.distributed as dist; "
            "store, _, _ = next(dist.rendezvous('tcp://127.0.0.1:0?rank=0&world_size=1')); "
            "print(*[c.laddr.ip for c in psutil.Process().net_connections() "
            "if c.status == 'LISTEN' and c.laddr.port == store.port])")
    env = {k: v for k, v in os.environ.items() if k != "RLHF_LOG_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["127.0.0.1"]


def test_a_sealed_store_refuses_what_a_client_without_the_secret_wrote():
    """Values written through SealedStore carry the run secret's tag; one written (or rewritten) by
    a plain client is refused by name, as is one sealed under another secret."""
    from torch.distributed import TCPStore

    from actors.actor_group import SealedStore, host_store

    addr, port, _store = host_store(3, "127.0.0.1")
    rank = SealedStore(TCPStore(addr, port, is_master=False, use_libuv=True), "s3cret")
    outsider = TCPStore(addr, port, is_master=False, use_libuv=True)
    rank.set("addr/0", b"10.0.0.1:1234")
    assert rank.get("addr/0") == b"10.0.0.1:1234"
    assert outsider.get("addr/0") != b"10.0.0.1:1234"  # the raw value carries the tag
    outsider.set("addr/0", b"6.6.6.6:666")
    with pytest.raises(PermissionError, match="addr/0"):
        rank.get("addr/0")
    SealedStore(outsider, "other").set("addr/1", b"6.6.6.6:666")
    with pytest.raises(PermissionError, match="addr/1"):
        rank.get("addr/1")
    assert rank.compare_set("cas", b"", b"first") == b"first"
    assert rank.compare_set("cas", b"first", b"second") == b"second"


def test_two_ranks_rendezvous_through_sealed_stores():
    """Two gloo ranks, each joining the driver's store with `join_store` and the same secret, form a
    process group and all-reduce; what they wrote is sealed."""
    from actors.actor_group import SealedStore, host_store, loopback_interface

    addr, port, store = host_store(2, "127.0.0.1")
    code = ("import sys, torch, torch.distributed as dist; from actors.actor_group import join_store; "
            "r = int(sys.argv[1]); store = join_store(sys.argv[2], int(sys.argv[3]), 's3cret'); "
            "dist.init_process_group('gloo', store=store, rank=r, world_size=2); "
            "t = torch.ones(1) * (r + 1); dist.all_reduce(t); print(int(t.item()))")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": loopback_interface()}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), addr, str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    assert [p.communicate(timeout=120)[0].strip() for p in ranks] == ["3", "3"]
    assert all(p.returncode == 0 for p in ranks)
    (key, *_) = [k for k in store.list_keys() if "/0" in k]  # a rank's address, under gloo's prefix
    with pytest.raises(PermissionError):
        SealedStore(store, "other").get(key)


def test_a_joined_store_outlives_its_callers_reference():
    """A process group over `join_store`'s sealed store keeps working after the caller drops its
    reference (a learner's constructor does): NCCL reaches the store only at its first collective,
    and a collected Python store failed every GPU run there. `new_group` reaches the store the same
    way on gloo."""
    from actors.actor_group import host_store

    addr, port, _store = host_store(1, "127.0.0.1")
    code = ("import gc, torch.distributed as dist; from actors.actor_group import join_store; "
            f"dist.init_process_group('gloo', store=join_store('{addr}', {port}, 's3cret'), rank=0, world_size=1); "
            "gc.collect(); dist.new_group([0], backend='gloo'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]


class _Rank:
    """An actor that joins its group's store as a learner rank does (`join_store`) and writes."""

    def __init__(self, master_addr: str, master_port: int) -> None:
        from actors.actor_group import join_store

        self.store = join_store(master_addr, master_port)
        self.store.set("probe", b"hello")

    def seen(self) -> tuple[bytes, bool, dict[str, str]]:
        """What it reads back, whether its group's secret is anywhere in its environment, and the
        variables that place its gloo, NCCL and vLLM sockets."""
        from actors.actor_group import rendezvous_secret

        secret = rendezvous_secret()
        names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "VLLM_HOST_IP")
        placing = {k: os.environ.get(k, "") for k in names}
        return self.store.get("probe"), any(secret in v for v in os.environ.values()), placing

    def shutdown(self) -> None:
        pass


@pytest.mark.ray
def test_a_groups_secret_reaches_its_actors_through_ray_not_their_environment(tmp_path):
    """An ActorGroup with `rendezvous_store` under a local Ray: its actor finds the secret (through
    Ray's internal KV), not in its environment (Ray's runtime-env agent logs the environment); what
    it writes to the driver's store is sealed; shutting the group down removes the secret. Its
    gloo/NCCL sockets are pinned to the loopback interface, vLLM's address to 127.0.0.1."""
    import ray
    import ray.cloudpickle
    from ray.experimental.internal_kv import _internal_kv_get
    from ray.util.placement_group import placement_group

    from actors.actor_group import KV_NAMESPACE, ActorGroup, SealedStore, loopback_interface
    from scripts.console import ray_init_kwargs

    ray.cloudpickle.register_pickle_by_value(sys.modules[_Rank.__module__])  # workers cannot import tests
    ray.init(num_cpus=1, **ray_init_kwargs(tmp_path, verbose=True, local=True))
    try:
        pg = placement_group([{"CPU": 0.5}])
        ray.get(pg.ready())
        group = ActorGroup(_Rank, name="rank", pg=pg, bundles=[0], num_cpus=0.5, num_gpus=0,
                           make_kwargs=lambda rank, addr, port: dict(master_addr=addr, master_port=port),
                           rendezvous_store=True)
        lo = loopback_interface()
        placing = {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo, "VLLM_HOST_IP": "127.0.0.1"}
        assert group.call("seen") == [(b"hello", False, placing)]
        raw = group._store.get("probe")
        assert raw != b"hello" and raw.endswith(b"hello")
        with pytest.raises(PermissionError):
            SealedStore(group._store, "guess").get("probe")
        key = group._secret_key
        assert _internal_kv_get(key, namespace=KV_NAMESPACE)
        group.shutdown()
        assert _internal_kv_get(key, namespace=KV_NAMESPACE) is None
    finally:
        ray.shutdown()


@pytest.mark.e2e
@pytest.mark.ray
def test_ctrl_c_ends_a_real_run_in_one_line_and_shuts_ray_down(interrupted_run):
    """SIGINT to the run's process group (what a terminal's Ctrl-C does) once its first checkpoint is
    complete: exit 130, one error line naming the latest complete checkpoint, no traceback on the
    terminal (it is in driver.log), and no process of the run left behind (Ray shut down). The run
    (`interrupted_run`) is the one the first test of this module reads."""
    out, stderr = interrupted_run.out, interrupted_run.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert interrupted_run.returncode == 130, stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last == errors[0], stderr[-3000:]  # the last line, not one the bar redraws over
    latest = sorted(p.parent for p in checkpoint_root(out).glob(f"step_*/{MANIFEST}"))[-1]
    assert errors[0].startswith("error: interrupted (Ctrl-C) after ")
    assert errors[0].endswith(f". Resume from {latest} with resume=true"), errors[0]
    assert "KeyboardInterrupt" in (out / "logs" / "driver.log").read_text()
    assert not interrupted_run.left, interrupted_run.left  # within 30 s of the driver's exit
