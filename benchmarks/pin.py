"""Run a command on its GPUs' share of the host's cores, as benchmark sides that run at once do
(`actors.host_cores.gpu_cores`: each GPU of the host owns an equal block of its cores):

    python -m benchmarks.pin 0 -- bash benchmarks/qwen_learn.sh _job gsm ...
    python -m benchmarks.pin --cores 0-15 -- COMMAND ...   # cores named (what benchmarks.run.pinned runs)

The GPUs are this host's nvidia-smi indices; CUDA_VISIBLE_DEVICES is not read, since a job's own
setting hides the other GPUs. Without GPUs, or given every GPU of the host, the command keeps every
core. The command replaces this process (same pid), and every process it starts inherits the cores.
"""

from __future__ import annotations

import os
import sys

from actors.host_cores import cpu_list, gpu_cores, parse_cpu_list
from benchmarks.run import gpu_query


def cores_for(gpus: list[str]) -> list[int]:
    """The cores of `gpus` among this host's GPUs; [] = every core (no GPUs, or every GPU of the host)."""
    host, cores = sorted(gpu_query("memory.total"), key=int), sorted(os.sched_getaffinity(0))
    return gpu_cores(gpus, host, cores)


def main(argv: list[str]) -> None:
    usage = "usage: python -m benchmarks.pin {GPUS | --cores LIST} -- COMMAND [ARGS...]  (GPUS: 0,1; LIST: 0-15)"
    named = argv[:1] == ["--cores"]
    if named:
        argv = argv[1:]
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(usage)
    if named:
        cpus, what = parse_cpu_list(argv[0]), "cores"
    else:
        gpus = [g.strip() for g in argv[0].split(",") if g.strip()]
        cpus, what = cores_for(gpus), f"GPU {','.join(gpus)}: cores"
    if cpus:
        os.sched_setaffinity(0, cpus)
        print(f"[pin] {what} {cpu_list(cpus)}", flush=True)
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
