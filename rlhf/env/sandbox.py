"""Run model-written Python in a throwaway child process with limits: the `python` tool's engine.

Choices, and what they do and do not guarantee (best effort, not a security boundary):
1. One fresh process per call (`python -I -S -B`): no user site, no PYTHON* variables, no
   site-packages (so no editable install of this project on the path: the standard library only),
   no bytecode written.
2. Limits set by the child's first lines, before the model's code (resource.setrlimit; not in a
   `preexec_fn`, which is unsafe in the threaded driver that runs tools): CPU seconds (RLIMIT_CPU,
   the kernel kills it), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), no core files. A
   wall-clock limit on top kills the whole process group, so `time.sleep` or a blocked read ends too.
3. A scrubbed environment: only PATH, LANG and HOME (the temp dir); none of the run's variables.
4. A throwaway working directory (tempfile), deleted after the call.
5. An audit hook (sys.addaudithook, installed before the code runs) refuses: socket creation,
   connect, bind and name lookups (no network); writes, deletes and renames outside the temp dir;
   reads and listings outside the temp dir and the Python installation's standard library;
   subprocesses, exec, fork and ctypes. Audit hooks are a CPython tripwire, not a jail: code that
   reaches raw memory (a C extension, a crafted object) could step around them. For untrusted
   models at scale run the tool inside a container or gVisor; this module is the default for
   research runs on one's own machines.
6. Output (stdout and stderr, merged) goes to an unnamed file capped by RLIMIT_FSIZE and is cut
   to `max_output_chars`; a cut output ends with a `[... truncated]` line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# The child's first code: sets the limits (choice 2), installs the audit hook, then runs main.py
# from the temp dir (its cwd). argv: the temp dir, CPU seconds, address-space and file-size bytes.
_BOOTSTRAP = r'''
import os, resource, signal, sys
ROOT = os.path.realpath(sys.argv[1])
CPU, MEMORY, FILE_SIZE = (int(a) for a in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))
resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails (EFBIG) instead of killing
READ_OK = tuple(os.path.realpath(p) for p in sys.path if p) + (ROOT,)
BLOCKED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
           "sys.setprofile", "sys.settrace", "os.chroot", "os.kill", "os.killpg"}
WRITES = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
          "os.symlink", "os.link", "os.rename", "shutil.rmtree", "shutil.move", "os.chdir"}
READS = {"os.listdir", "os.scandir", "glob.glob"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path, roots):
    if isinstance(path, int) or path is None:
        return True
    p = os.path.realpath(os.fsdecode(path))
    return any(p == r or p.startswith(r + os.sep) for r in roots)

def hook(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        write = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if not inside(path, (ROOT,) if write else READ_OK):
            raise PermissionError(f"sandbox: {'writing' if write else 'reading'} {path!r} is not allowed")
    elif event in WRITES:
        for path in args[:2] if event in ("os.rename", "os.symlink", "os.link", "shutil.move") else args[:1]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, (ROOT,)):
                raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")
    elif event in READS:
        path = args[0] if args and args[0] not in (None, "") else "."
        if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, READ_OK):
            raise PermissionError(f"sandbox: listing {path!r} is not allowed")

with open(os.path.join(ROOT, "main.py")) as f:
    SOURCE = f.read()
sys.addaudithook(hook)
sys.argv = ["main.py"]
exec(compile(SOURCE, "main.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use."""

    wall_s: float = 5.0
    """Wall-clock seconds before the process group is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS), in MiB."""
    file_mb: int = 8
    """Largest file the code may write, its captured output included (RLIMIT_FSIZE), in MiB."""
    max_output_chars: int = 2000
    """Characters of output returned; the rest is cut (choice 6)."""


@dataclass(frozen=True)
class SandboxResult:
    output: str
    """stdout and stderr merged, possibly cut."""
    returncode: int
    """The process's exit status (negative: killed by that signal)."""
    timed_out: bool
    """Killed at the wall-clock limit."""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in a fresh, limited process (module docstring) and return its output."""
    root = tempfile.mkdtemp(prefix="rlhf-sandbox-")
    try:
        with open(os.path.join(root, "main.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": root}
        with tempfile.TemporaryFile() as out:
            limits_argv = [str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.file_mb * 2**20)]
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, root, *limits_argv], cwd=root, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            text = out.read(limits.max_output_chars * 4 + 64).decode("utf-8", errors="replace")
        text = cut(text, limits.max_output_chars)
        if timed_out:
            text += f"\n[killed: wall-clock limit of {limits.wall_s:g}s]"
        elif proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
            text += f"\n[killed: CPU limit of {limits.cpu_s}s]"
        return SandboxResult(output=text, returncode=proc.returncode, timed_out=timed_out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cut(text: str, max_chars: int) -> str:
    """`text` up to `max_chars` characters, with a closing `[... truncated]` line when it was longer."""
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[... truncated at {max_chars} chars]"

