"""CUDA MPS for one benchmark side (`scale.py --mps`): a control daemon of its own for the side's GPUs
(the daemon serves the GPUs of the CUDA_VISIBLE_DEVICES it starts with), whose pipe folder every
process of the side inherits, so the kernels of two engines on one GPU run side by side instead of
taking turns. Measured, not assumed: whether vLLM's sleep mode, CUDA IPC and NCCL keep working under
it is what a run with it shows.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


@contextmanager
def mps_daemon(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Start an MPS control daemon for `env`'s GPUs; yield `env` with its pipe and log folders (short
    paths under /tmp: the pipe is a Unix socket); on exit, quit it and remove the folders."""
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        raise SystemExit(f"--mps: {CONTROL} not found on PATH (CUDA MPS comes with the NVIDIA driver's tools)")
    folder = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    (folder / "pipe").mkdir()
    (folder / "log").mkdir()
    mps_env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    try:
        subprocess.run([CONTROL, "-d"], env=mps_env, check=True, timeout=60)
        yield mps_env
    finally:
        subprocess.run([CONTROL], input="quit\n", text=True, env=mps_env, timeout=60, check=False)
        shutil.rmtree(folder, ignore_errors=True)
