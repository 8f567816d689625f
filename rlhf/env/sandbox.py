"""Run model-written Python in a fresh, limited process: the engine of the `python` tool, and the
runner an environment of your own (`env.environment`) calls for the code it executes.

`env.sandbox` picks the boundary (`use_mode`, set from the config when the episodes are built):
- `os` (the default): each call runs under bubblewrap in its own user, mount, PID, IPC, UTS,
  cgroup and network namespaces, as uid/gid 65534 with no capabilities and no new privileges,
  under a seccomp filter that refuses new processes (threads run) and a few kernel interfaces no
  script needs. Its file system is a read-only root holding only /usr (and the /lib, /bin links),
  the Python installation's prefix and the loader cache; its folder is a private, size-capped
  tmpfs, the only writable place. So: no network (a loopback of its own), no files, environment
  or processes of the run, and the namespace dies with the call. Why bubblewrap: one small
  binary in every distribution, tens of milliseconds a call, where a container per call costs a
  daemon and far more. Not guaranteed: the kernel itself (a bug reachable from an unprivileged
  process is reachable here), CPU and memory shared with the run (the limits below bound them),
  and what the read-only view holds (/usr, the Python installation) can be read.
- `audit_hook`: the same process without namespaces; the only barrier is an audit hook
  (sys.addaudithook), a CPython tripwire that code can step around (RELIABILITY.md). Accepted
  only by name: where the `os` boundary cannot be made the run refuses to start (`refusal`).
In both: `python -I -S -B` (standard library only), an environment of PATH, LANG, HOME and TMPDIR
(the folder) only, the code read from stdin, and limits set by the child's first lines before the
code runs (not in a `preexec_fn`, unsafe in the threaded driver): CPU seconds, address space, file
size, processes (RLIMIT_NPROC), no core files. In `os` mode the audit hook stays on as a second
layer. A wall-clock limit kills the whole process group (and so the PID namespace). Output (stdout
and stderr merged) goes to an unnamed file capped by RLIMIT_FSIZE and is cut to
`max_output_chars`, ending with a `[... truncated]` line.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

SandboxMode = Literal["os", "audit_hook"]

# The child's first code: reads the code from stdin, sets the limits, installs the audit hook (when
# asked), then runs main.py from its folder. argv: the folder, CPU seconds, address-space and
# file-size bytes, processes, 1/0 for the audit hook.
_BOOTSTRAP = r'''
import os, resource, signal, sys
ROOT = os.path.realpath(sys.argv[1])
CPU, MEMORY, FILE_SIZE, PROCESSES, AUDIT = (int(a) for a in sys.argv[2:7])
SOURCE = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
os.chdir(ROOT)
with open("main.py", "wb") as f:
    f.write(SOURCE)
resource.setrlimit(resource.RLIMIT_CPU, (CPU, CPU + 1))
resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
resource.setrlimit(resource.RLIMIT_NPROC, (PROCESSES, PROCESSES))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails (EFBIG) instead of killing

def hook(event, args, ROOT=ROOT, READ_OK=tuple(os.path.realpath(p) for p in sys.path if p) + (ROOT,),
         BLOCKED=frozenset({"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
                            "socket.gethostbyname", "socket.sendto", "subprocess.Popen", "os.system", "os.exec",
                            "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen",
                            "ctypes.dlsym", "ctypes.cdata", "sys.setprofile", "sys.settrace", "os.chroot",
                            "os.kill", "os.killpg"}),
         WRITES=frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                           "os.symlink", "os.link", "os.rename", "shutil.rmtree", "shutil.move", "os.chdir"}),
         READS=frozenset({"os.listdir", "os.scandir", "glob.glob"}),
         WRITE_FLAGS=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, os=os):
    def inside(path, roots):
        if isinstance(path, int) or path is None:
            return True
        p = os.path.realpath(os.fsdecode(path))
        return any(p == r or p.startswith(r + os.sep) for r in roots)

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

if AUDIT:
    sys.addaudithook(hook)
del hook
sys.argv = ["main.py"]
exec(compile(SOURCE, "main.py", "exec"), {"__name__": "__main__"})
'''

FOLDER = "/sandbox"
"""The code's folder (cwd, HOME, TMPDIR) inside the namespaces: a tmpfs of its own."""


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
    folder_mb: int = 64
    """Size of the folder's tmpfs in `os` mode, all files together, in MiB."""
    processes: int = 16
    """Processes and threads at once (RLIMIT_NPROC, which binds no process of root; in `os` mode no
    new process starts at all: the `os` boundary)."""
    max_output_chars: int = 2000
    """Characters of output returned; the rest is cut."""


@dataclass(frozen=True)
class SandboxResult:
    output: str
    """stdout and stderr merged, possibly cut."""
    returncode: int
    """The process's exit status (negative: killed by that signal)."""
    timed_out: bool
    """Killed at the wall-clock limit."""


@dataclass(frozen=True)
class Layers:
    """What stands between the code and the machine; `MODES` names the two a run may choose. Other
    combinations exist for the escape tests (tests/unit/test_sandbox_escapes.py), which show what each
    layer stops."""

    namespaces: bool
    """bubblewrap's namespaces and read-only view (the `os` boundary)."""
    audit_hook: bool
    """The audit hook inside the process (the `audit_hook` boundary)."""


MODES: dict[str, Layers] = {"os": Layers(namespaces=True, audit_hook=True),
                            "audit_hook": Layers(namespaces=False, audit_hook=True)}
_mode: SandboxMode = "os"


def use_mode(mode: SandboxMode) -> None:
    """Make `mode` (the run's `env.sandbox`) what `run_python` uses when not given one."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"sandbox mode {mode!r}: one of {', '.join(MODES)}")
    _mode = mode


def current_mode() -> SandboxMode:
    """The mode `run_python` uses when not given one (`use_mode`; `os` unless the run chose otherwise)."""
    return _mode


def describe_mode(mode: SandboxMode) -> str:
    """The run header's line saying which boundary the code of tools and environments runs in."""
    if MODES[mode].namespaces:
        return "sandbox: os (tool and environment code: own namespaces, no network, none of the run's files)"
    return "sandbox: audit_hook (tool and environment code: an audit hook only, NOT a security boundary)"


class SandboxUnavailable(RuntimeError):
    """The `os` boundary cannot be made on this machine (`refusal` says why and what to set)."""


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), mode: SandboxMode | None = None
               ) -> SandboxResult:
    """Run `code` as a script in a fresh, limited process under `mode` (default: the run's
    `env.sandbox`) and return its output. In `os` mode where the boundary cannot be made it
    raises SandboxUnavailable rather than run the code with less."""
    layers = MODES[mode or _mode]
    if layers.namespaces and (message := refusal()):
        raise SandboxUnavailable(message)
    return run_in(code, limits, layers)


def run_in(code: str, limits: SandboxLimits, layers: Layers) -> SandboxResult:
    """`run_python` under exactly `layers`, unchecked (the escape tests and benchmarks call this)."""
    host_folder = None if layers.namespaces else tempfile.mkdtemp(prefix="rlhf-sandbox-")
    folder = host_folder or FOLDER
    try:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder}
        limits_argv = [str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.file_mb * 2**20),
                       str(limits.processes), str(int(layers.audit_hook))]
        argv, pass_fds = [sys.executable, "-I", "-S", "-B"], ()
        if layers.namespaces:
            pass_fds = (_seccomp_fd(),)
            argv = [*_namespaces_argv(limits, pass_fds[0]), *_interpreter()]
        with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as out:
            source.write(code.encode("utf-8", errors="surrogateescape"))
            source.seek(0)
            try:
                proc = subprocess.Popen([*argv, "-c", _BOOTSTRAP, folder, *limits_argv], cwd=host_folder or "/",
                                        env=env, stdin=source, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, close_fds=True, pass_fds=pass_fds)
            finally:
                for fd in pass_fds:
                    os.close(fd)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            text = out.read(limits.max_output_chars * 4 + 64).decode("utf-8", errors="replace")
        # bwrap reports a command killed by signal N as exit status 128 + N
        returncode = 128 - proc.returncode if layers.namespaces and proc.returncode > 128 else proc.returncode
        text = cut(text, limits.max_output_chars)
        if timed_out:
            text += f"\n[killed: wall-clock limit of {limits.wall_s:g}s]"
        elif returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            text += f"\n[killed: CPU limit of {limits.cpu_s}s]"
        return SandboxResult(output=text, returncode=returncode, timed_out=timed_out)
    finally:
        if host_folder:
            shutil.rmtree(host_folder, ignore_errors=True)


def _interpreter() -> list[str]:
    """The base interpreter (a virtual environment's python is a link to it), isolated."""
    return [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "-I", "-S", "-B"]


def _namespaces_argv(limits: SandboxLimits, seccomp_fd: int) -> list[str]:
    """bubblewrap's command line for one call (the `os` boundary): every namespace, an unprivileged user, the
    seccomp filter read from `seccomp_fd`, the read-only view of what the interpreter needs, the
    folder's tmpfs, then the root made read-only."""
    bwrap, optional = _bwrap()
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--seccomp", str(seccomp_fd), "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr links, or folders
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    interpreter = os.path.dirname(_interpreter()[0])
    for path in {os.path.realpath(sys.base_prefix), interpreter}:
        if path != "/usr" and not path.startswith("/usr/"):
            argv += ["--ro-bind", path, path]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev"]
    if "--size" in optional:
        argv += ["--size", str(limits.folder_mb * 2**20)]
    argv += ["--tmpfs", FOLDER, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", FOLDER]
    return argv + (["--disable-userns"] if "--disable-userns" in optional else [])


# The seccomp filter of the `os` boundary, per machine: its AUDIT_ARCH, clone, clone3 and the calls
# refused outright.
_SYSCALLS = {
    "x86_64": (0xC000003E, 56, 435, {"fork": 57, "vfork": 58, "ptrace": 101, "add_key": 248, "request_key": 249,
                                     "keyctl": 250, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323,
                                     "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, 220, 435, {"ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219,
                                       "perf_event_open": 241, "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425}),
}


@functools.cache
def seccomp_program(machine: str) -> bytes:
    """Classic BPF over `struct seccomp_data` (nr at 0, arch at 4, args[0] at 16): every other ABI
    (i386, x32) and the refused calls fail with EPERM; clone3 with ENOSYS (so libc falls back to
    clone); clone only with CLONE_THREAD. So threads run and no new process starts, whoever the
    user is (RLIMIT_NPROC does not bind a process of the host's root, which the sandbox user maps
    to when the run is root)."""
    arch, clone, clone3, refused = _SYSCALLS[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),
               (load, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, eperm),
               (jeq, 0, 1, clone3), (ret, 0, 0, enosys)]
    for nr in refused.values():
        program += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    program += [(jeq, 0, 3, clone), (load, 0, 0, 16), (jset, 1, 0, 0x00010000), (ret, 0, 0, eperm), (ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def _seccomp_fd() -> int:
    """A pipe's read end holding this machine's filter, for bwrap's `--seccomp`."""
    read, write = os.pipe()
    os.write(write, seccomp_program(platform.machine()))
    os.close(write)
    return read


@functools.cache
def _bwrap() -> tuple[str, frozenset[str]]:
    """bwrap's path and which of its newer flags it has (`--size` 0.7, `--disable-userns` 0.8);
    ("", {}) when it is not installed."""
    path = shutil.which("bwrap")
    if path is None:
        return "", frozenset()
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        usage = ""
    return path, frozenset(f for f in ("--size", "--disable-userns") if f in usage)


@functools.cache
def isolation_problem() -> str | None:
    """Why the `os` boundary cannot be made here (bwrap missing, or it cannot create the namespaces
    or start the interpreter inside them), or None; probed once per process."""
    if not _bwrap()[0]:
        return "bwrap is not installed (Debian/Ubuntu package: bubblewrap)"
    if platform.machine() not in _SYSCALLS:
        return f"no seccomp filter for machine {platform.machine()!r} (rlhf.env.sandbox knows {', '.join(_SYSCALLS)})"
    result = run_in("print('isolated')", SandboxLimits(wall_s=30), Layers(namespaces=True, audit_hook=False))
    if result.output.strip() == "isolated" and result.returncode == 0:
        return None
    lines = [line.strip() for line in result.output.splitlines() if line.strip()]
    return f"bwrap cannot isolate the code here ({lines[0] if lines else f'exit status {result.returncode}'})"


def refusal() -> str | None:
    """The one-line refusal of `env.sandbox=os` where its boundary cannot be made, or None."""
    problem = isolation_problem()
    if problem is None:
        return None
    return (f"env.sandbox=os: the code that tools and environments run cannot be isolated here: {problem}; "
            f"make user namespaces and bubblewrap available, or set env.sandbox=audit_hook to accept the "
            f"weaker audit-hook mode (not a security boundary)")


def cut(text: str, max_chars: int) -> str:
    """`text` up to `max_chars` characters, with a closing `[... truncated]` line when it was longer."""
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[... truncated at {max_chars} chars]"
