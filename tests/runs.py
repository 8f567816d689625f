"""Helpers for tests that drive a whole training run as a subprocess, and interrupt it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlhf.run.checkpoint import MANIFEST, checkpoint_root

ROOT = Path(__file__).resolve().parents[1]


def kill_after_first_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 600) -> None:
    """SIGKILL the run's whole process group (driver, Ray, vLLM, learners) once its step-1
    checkpoint is complete, then leave only that checkpoint: a later one, or the `.tmp_` folder of
    a save the kill interrupted, is removed so that `resume=true` continues from step 1."""
    first = checkpoint_root(out) / "step_000001"
    deadline = time.time() + timeout
    while not (first / MANIFEST).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert (first / MANIFEST).exists(), "the run never wrote its first checkpoint"
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it finished on its own in the meantime
        pass
    proc.wait()
    for path in checkpoint_root(out).iterdir():
        if path != first:
            shutil.rmtree(path)


def kill_titled(root_pid: int, title: str) -> None:
    """SIGKILL the first descendant of `root_pid` whose command line contains `title`. Processes
    that exit while the tree is read (Ray starts and reaps helpers all the time) are skipped."""
    import psutil

    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if title in " ".join(p.cmdline()):
                p.send_signal(signal.SIGKILL)
                return
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process titled {title}")


def private_ray_env() -> dict[str, str]:
    """This environment without RAY_ADDRESS: the run starts a private local Ray instance."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def run_training(script: str, config: str, output_dir: Path, *overrides: str, wait: bool = True,
                 timeout: float = 900) -> subprocess.CompletedProcess | subprocess.Popen:
    """`script --config config output_dir=... overrides` from the repository root, on a private
    Ray: finished, its output captured; or with `wait=False` running in its own process group (for
    `kill_after_first_checkpoint`), its output discarded."""
    cmd = [sys.executable, script, "--config", config, f"output_dir={output_dir}", *overrides]
    if wait:
        return subprocess.run(cmd, cwd=ROOT, env=private_ray_env(), capture_output=True, text=True, timeout=timeout)
    return subprocess.Popen(cmd, cwd=ROOT, env=private_ray_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
