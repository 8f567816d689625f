"""Which of a host's CPU cores a GPU's processes run on (`cluster.pin_cores`), and pinning them there.

One rule for the whole project: each GPU of a host owns an equal block of the host's cores, in GPU
order (64 cores and 4 GPUs: 16 each, what a one-GPU machine of that family has). An engine's decode
loop is host-bound (scheduling, sampling, detokenizing), and unpinned processes of other GPUs (their
engines, compile workers, OpenMP pools) preempt it: on a 4-GPU host, two benchmark sides that ran
at once unpinned decoded ~1.5x slower than pinned (docs/design/devices.md, "Host cores"). The
benchmarks pin whole sides by this rule (benchmarks/pin.py); a run pins each engine and learner
rank by it. Torch-free, so the benchmark launcher imports it without importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def gpu_cores(gpus: Sequence[str], host_gpus: Sequence[str], cores: Sequence[int]) -> list[int]:
    """The cores of `gpus` when each of `host_gpus` owns an equal block of `cores`, in their order;
    [] = leave the process where it is: no GPU of `host_gpus` among `gpus`, every GPU of the host
    (nothing to split), or fewer cores than GPUs."""
    mine = [host_gpus.index(g) for g in gpus if g in host_gpus]
    if not mine or len(mine) == len(host_gpus) or len(cores) < len(host_gpus):
        return []
    ordered, n, k = sorted(cores), len(cores), len(host_gpus)
    return sorted(c for i in mine for c in ordered[i * n // k:(i + 1) * n // k])


def host_gpu_ids(env: Mapping[str, str], count: int) -> list[str]:
    """The GPU ids Ray hands out on a node started with `env` and `count` GPUs: its
    CUDA_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES on ROCm) where set, else 0..count-1."""
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if env.get(name):
            return [g.strip() for g in env[name].split(",") if g.strip()]
    return [str(i) for i in range(count)]


def cpu_list(cpus: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2,5" (taskset's notation)."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def parse_cpu_list(spec: str) -> list[int]:
    """"0-2,5" -> `[0, 1, 2, 5]`: the inverse of `cpu_list`."""
    spans = (p.partition("-") for p in spec.split(",") if p)
    return sorted({c for a, _, b in spans for c in range(int(a), int(b or a) + 1)})


def pin_process(cores: Sequence[int]) -> None:
    """Every thread of this process, and so every thread and process it starts later, on `cores`
    (`os.sched_setaffinity` sets one thread; the threads already running are set one by one)."""
    if not cores:
        return
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
