"""Build folders of just-in-time compiled ops (DeepSpeed's CPU Adam, its shared-memory collectives).

`torch.utils.cpp_extension` builds an op once per host under `TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions/py311_cu130/<op>/`) and serialises builders with a `lock` file that
the builder creates and deletes. A builder killed mid-build (a timed-out test, an OOM kill, a
Ctrl-C) leaves the file behind, and every later run waits on it forever, silently.

The lock carries no owner, but its builder holds it open from creation to deletion
(`torch.utils.file_baton.FileBaton`), so a lock that no process on this host has open is stale:
`clear_stale_build_locks` deletes those, saying so in one line each. A lock some process holds is
left alone, and so is one whose owner has a process whose open files cannot be read (/proc hides
them), or any lock where there is no /proc.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def build_root() -> Path:
    """The folder holding one build folder per op, as `torch.utils.cpp_extension` names it."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Delete every `<root>/<op>/lock` that no process holds open; return the deleted paths."""
    root = build_root() if root is None else root
    locks = sorted(root.glob("*/lock")) if root.is_dir() else []
    if not locks:
        return []
    held, hidden_uids = _open_files()
    cleared = []
    for lock in locks:
        try:
            owner = lock.stat().st_uid
        except FileNotFoundError:
            continue
        if lock.resolve() in held or owner in hidden_uids or not Path("/proc/self/fd").is_dir():
            continue
        try:
            lock.unlink()
        except FileNotFoundError:  # its builder just finished
            continue
        print(f"deleted a stale build lock {lock} (left by a build that was killed; no process holds it)",
              flush=True)
        cleared.append(lock)
    return cleared


def _open_files() -> tuple[set[Path], set[int]]:
    """Every file some process of this host has open (from /proc), and the users owning a process
    whose open files could not be read."""
    held: set[Path] = set()
    hidden: set[int] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            entries = list(fd_dir.iterdir())
        except FileNotFoundError:  # the process ended meanwhile
            continue
        except PermissionError:
            try:
                hidden.add(fd_dir.parent.stat().st_uid)
            except FileNotFoundError:
                pass
            continue
        for entry in entries:
            try:
                held.add(Path(os.readlink(entry)))
            except OSError:
                continue
    return held, hidden


# DeepSpeed's JIT ops a CPU learner uses: shared-memory collectives (every multi-rank ZeRO run) and
# CPU Adam (`learner.offload_optimizer`). Built once per host, 1-2 min on 2 cores.
CPU_OPS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}


def build_cpu_ops(root: Path | None = None) -> list[str]:
    """Build the DeepSpeed ops of CPU_OPS that `root` lacks (a `.so` in the op's folder), so that
    the first run (or test) does not stop for the compiler; the ops built."""
    root = build_root() if root is None else root
    missing = [op for op in CPU_OPS if not list((root / op).glob("*.so"))]
    if not missing:
        return []
    clear_stale_build_locks(root)
    # One process per op, so that their compiles overlap: the collectives are one translation unit,
    # CPU Adam two, and each takes a core for ~30 s.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    builds = {op: subprocess.Popen([sys.executable, "-c", "from deepspeed.ops import op_builder; "
                                    f"op_builder.{CPU_OPS[op]}().load(verbose=False)"], env=env)
              for op in missing}
    failed = [op for op, build in builds.items() if build.wait() != 0]
    if failed:
        raise RuntimeError(f"building DeepSpeed's {', '.join(failed)} failed: the compiler's messages are above")
    return missing


if __name__ == "__main__":  # scripts/setup.sh: `python -m actors.torch_extensions build`
    import time

    if sys.argv[1:] != ["build"]:
        raise SystemExit("usage: python -m actors.torch_extensions build")
    start = time.perf_counter()
    built = build_cpu_ops()
    print(f"setup: DeepSpeed CPU ops {'built: ' + ', '.join(built) if built else 'up to date'} "
          f"({time.perf_counter() - start:.0f} s, {build_root()})")
