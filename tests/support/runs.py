"""Helpers for tests that drive a whole training run as a subprocess, and interrupt it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf.run.checkpoint import MANIFEST, checkpoint_root
from tests.support.processes import listeners, run_processes

ROOT = Path(__file__).resolve().parents[2]


def kill_after_first_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 600) -> None:
    """SIGKILL the run's whole process group (driver, Ray, vLLM, learners) once its step-1
    checkpoint is complete, then leave only that checkpoint: a later one, or the `.tmp_` folder of
    a save the kill interrupted, is removed so that `resume=true` continues from step 1."""
    first = checkpoint_root(out) / "step_000001"
    deadline = time.time() + timeout
    while not (first / MANIFEST).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert (first / MANIFEST).exists(), (
        f"the run never wrote its first checkpoint (exit code {proc.poll()}):\n{_tail(run_log(out))}")
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
    `kill_after_first_checkpoint`), its output in `run_log(output_dir)` (a file: no pipe to fill)."""
    cmd = [sys.executable, script, "--config", config, f"output_dir={output_dir}", *overrides]
    if wait:
        return subprocess.run(cmd, cwd=ROOT, env=private_ray_env(), capture_output=True, text=True, timeout=timeout)
    with open(run_log(output_dir), "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=private_ray_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_log(output_dir: Path) -> Path:
    """Where a run started with `run_training(..., wait=False)` writes its stdout and stderr: beside
    its output directory, so that a checkpoint clean-up or `resume` never touches it."""
    return output_dir.with_name(output_dir.name + ".log")


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} is missing)"


@dataclass
class InterruptedRun:
    """A tiny GRPO run Ctrl-C'd (SIGINT to its process group) once its first checkpoint was complete."""

    out: Path
    pid: int  # the driver's (its session's id too)
    returncode: int
    stderr: str
    processes: dict[int, str]  # pid -> command line of every process of the run, while it was in its steps
    listening: list[tuple[int, str, int, str]]  # (pid, ip, port, kind) of those processes' listening sockets
    left: list[str]  # command lines of the run's session processes still alive 30 s after the driver exited


def interrupt_after_first_checkpoint(tmp: Path) -> InterruptedRun:
    """Start the tiny GRPO recipe (500 steps, a checkpoint each) in its own session; once its step-1
    checkpoint is complete, record its processes and their listening sockets (every actor is up and
    the rendezvous store is served), then SIGINT its process group as a terminal's Ctrl-C does and
    wait for it to exit and for its session to empty. One such run serves tests/e2e/test_listening.py
    (its sockets and its Ctrl-C). Whatever of the run is left at the end is SIGKILLed."""
    out = tmp / "run"
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml",
           f"output_dir={out}", "grpo.steps=500", "save_every=1", "data.num_train=16", "data.num_eval=0"]
    with open(tmp / "stdout", "w") as stdout, open(tmp / "stderr", "w") as stderr:  # no pipe to fill
        proc = subprocess.Popen(cmd, cwd=ROOT, env=private_ray_env(), stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=_default_sigint)
    processes: dict[int, str] = {}
    try:
        first = checkpoint_root(out) / "step_000001" / MANIFEST
        deadline = time.time() + 600
        while not first.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.exists(), f"the run never wrote its first checkpoint:\n{(tmp / 'stderr').read_text()[-3000:]}"
        processes = run_processes(proc.pid)
        listening = listeners(set(processes))
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
        deadline = time.time() + 30
        while _session_processes(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
        left = [" ".join(_cmdline(p)) for p in _session_processes(proc.pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_if_unchanged(processes)
    stderr_text = (tmp / "stderr").read_text()
    return InterruptedRun(out, proc.pid, proc.returncode, stderr_text, processes, listening, left)


def _default_sigint() -> None:
    """In the run's process, before exec: SIGINT back to its default, as in a terminal's foreground
    job. A test session started in the background by a non-interactive shell (`pytest &`) ignores
    SIGINT, the run would inherit that, and Python then installs no KeyboardInterrupt handler: the
    Ctrl-C would go unheard (seen when the suite was started that way: the run went on to step 107)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _session_processes(sid: int) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def _kill_if_unchanged(processes: dict[int, str]) -> None:
    """SIGKILL each recorded process of a run that still runs the same command line (a pid that
    exited and was reused by another process is left alone)."""
    import psutil

    for pid, cmd in processes.items():
        try:
            p = psutil.Process(pid)
            if " ".join(p.cmdline()) == cmd:
                p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
