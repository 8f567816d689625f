"""Process set-up of a vLLM engine (actors/vllm_generator.py): where its engine core runs, and the
socket folders vLLM leaves behind. No vLLM import: it runs before the engine is built."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def engine_process_env(*, separate: bool) -> str:
    """What vLLM reads from the environment when an engine is built: the engine core inline or in
    its own process (where our RPCs, functions and IPC handles, travel pickled), and a private
    folder for its ZMQ socket files, which vLLM leaves behind; returned for shutdown to remove."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    if separate:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    sweep_stale_socket_folders(tempfile.gettempdir())
    folder = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix=f"{_SOCKETS}{os.getpid()}-")
    return folder


_SOCKETS = "rlhf-vllm-ipc-"  # + the creating process's pid + "-" + random


def sweep_stale_socket_folders(root: str) -> list[str]:
    """Remove the socket folders (`engine_process_env`) of engines whose process is gone: a run killed
    outright never reaches `shutdown`. Only this user's, only where the pid in the name is dead.
    Returns what it removed."""
    removed = []
    for path in Path(root).glob(f"{_SOCKETS}*-*"):
        pid = path.name[len(_SOCKETS):].split("-", 1)[0]
        if not pid.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
