"""actors/host_cores.py: each GPU of a host owns an equal block of its cores (the rule that benchmark
sides and, under `cluster.pin_cores`, a run's engines and learner ranks are pinned by)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from actors.device import CpuDevice, CudaDevice
from actors.host_cores import cpu_list, gpu_cores, host_gpu_ids, parse_cpu_list

REPO = Path(__file__).resolve().parents[2]


def test_each_gpu_owns_an_equal_block_of_the_host_cores():
    four = ["0", "1", "2", "3"]
    assert gpu_cores(["1"], four, list(range(64))) == list(range(16, 32))
    assert gpu_cores(["0", "1"], four, list(range(64))) == list(range(32))
    assert gpu_cores(["3"], ["2", "3"], list(range(8))) == [4, 5, 6, 7]  # by place among the host's GPUs
    assert gpu_cores(["2"], four, [*range(32, 64), *range(32)]) == list(range(32, 48))  # cores in order
    assert gpu_cores(["1"], four, list(range(10))) == [2, 3, 4]  # 10 over 4: blocks of 2 or 3, none lost


def test_nothing_to_pin_keeps_every_core():
    four = ["0", "1", "2", "3"]
    assert gpu_cores(["0"], ["0"], list(range(64))) == []  # alone on the host
    assert gpu_cores(four, four, list(range(64))) == []  # every GPU of the host
    assert gpu_cores(["1"], four, [0, 1]) == []  # fewer cores than GPUs
    assert gpu_cores(["7"], four, list(range(64))) == [] and gpu_cores([], four, list(range(64))) == []
    assert gpu_cores(["2", "7"], four, list(range(64))) == list(range(32, 48))  # the host's GPUs only


def test_the_hosts_gpu_ids_are_rays():
    assert host_gpu_ids({"CUDA_VISIBLE_DEVICES": "2,3"}, 8) == ["2", "3"]
    assert host_gpu_ids({"HIP_VISIBLE_DEVICES": "1"}, 8) == ["1"]
    assert host_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}, 2) == ["0", "1"] and host_gpu_ids({}, 0) == []


def test_a_gpu_process_takes_its_gpus_block_and_a_cpu_process_none(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # what Ray sets for an actor given GPU 2
    assert CudaDevice().host_cores(["0", "1", "2", "3"]) == list(range(32, 48))
    assert CpuDevice().host_cores(["0", "1", "2", "3"]) == []


def test_pinning_moves_every_thread_and_what_starts_later():
    """A thread already running before the pin is moved too (os.sched_setaffinity alone sets only
    the calling thread), and a process started afterwards inherits the cores."""
    core = max(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys, threading, time\n"
        "from actors.host_cores import pin_process\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        f"pin_process([{core}])\n"
        "print(sorted(os.sched_getaffinity(t.native_id)))\n"
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])\n"
        "stop.set()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.splitlines() == [f"[{core}]", f"[{core}]"]


def test_a_core_list_reads_back_as_its_cores():
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and cpu_list([3]) == "3"
    for cores in ([0], [0, 1, 2, 5], [3, 4, 8, 9, 10, 63]):
        assert parse_cpu_list(cpu_list(cores)) == cores
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]


def test_a_run_under_pin_cores_hands_its_actors_the_drivers_node_gpus(monkeypatch):
    from types import SimpleNamespace

    from actors import cluster
    from rlhf.config import ClusterConfig

    monkeypatch.setattr(cluster.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "b"))
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{"NodeID": "a", "Resources": {"GPU": 8.0}},
                                                       {"NodeID": "b", "Resources": {"GPU": 4.0, "CPU": 64.0}}])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    assert cluster.pinned_host_gpus(ClusterConfig(pin_cores=True)) == ["0", "1", "2", "3"]
    assert cluster.pinned_host_gpus(ClusterConfig()) == []  # off by default
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a driver given the host's other half
    assert cluster.pinned_host_gpus(ClusterConfig(pin_cores=True)) == ["4", "5", "6", "7"]
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{"NodeID": "b", "Resources": {"CPU": 2.0}}])
    assert cluster.pinned_host_gpus(ClusterConfig(pin_cores=True)) == []  # a CPU node: nothing to pin
