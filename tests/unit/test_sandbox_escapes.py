"""The escape battery of the code sandbox (rlhf.env.sandbox): programs that try to get out by every
route the interpreter offers, each judged by what it left outside (a marker file, a deleted file,
a secret in its output, a connection, a signal, a process, a full disk), never by what it says.

Run under the shipped `os` mode and under its namespaces alone (so a removed OS boundary fails
here even though the audit hook would still catch most routes), nothing gets out. Run with no
boundary at all, the same programs do get out, so these tests can fail; each part of the OS
boundary taken away lets one out; and the audit-hook mode alone lets the routes it misses through
(why it is only the named, weaker mode)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhf.env import sandbox
from rlhf.env.sandbox import Layers, SandboxLimits, isolation_problem, run_in, run_python

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=20.0, cpu_s=10, memory_mb=512, folder_mb=16, processes=16)
SHELL = 'cmd = f"echo escaped > {P[\'marker\']}"\n'



@dataclass
class Target:
    """What the battery tries to reach, planted outside the sandbox by the test."""

    tmp: Path
    marker: Path  # must never appear
    victim: Path  # must stay
    tokens: dict[str, str]  # secret name -> value, none may show in the output
    listener: socket.socket  # TCP on loopback, port 0
    unix: socket.socket  # an abstract unix socket
    helper: subprocess.Popen  # a process of "the run", its secret in its environment
    signals: list[int]
    comm: str  # the name a left-behind process gives itself

    def params(self) -> dict:
        files = {name: str(self.tmp / name) for name in ("ssh", "checkpoint")}
        return {"marker": str(self.marker), "victim": str(self.victim), "files": files,
                "port": self.listener.getsockname()[1], "unix": self.unix.getsockname()[1:].decode(),
                "helper": self.helper.pid, "pid": os.getpid(), "root": str(ROOT), "comm": self.comm}


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    tokens = {name: f"{name}-{secrets.token_hex(8)}" for name in ("ssh", "checkpoint", "environment")}
    (tmp_path / "ssh").write_text(tokens["ssh"])  # stands for ~/.ssh/id_ed25519
    (tmp_path / "checkpoint").write_text(tokens["checkpoint"])  # stands for checkpoints/step_N/model
    victim = tmp_path / "victims" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    listener = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0rlhf-escape-{secrets.token_hex(8)}")
    unix.listen()
    helper = subprocess.Popen(["sleep", "120"], env={"RLHF_RUN_SECRET": tokens["environment"]})
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    t = Target(tmp_path, tmp_path / "escaped", victim, tokens, listener, unix, helper, seen,
               f"rlhf{secrets.token_hex(5)}")
    try:
        yield t
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.kill()
        helper.wait()
        listener.close()
        unix.close()
        for pid in _processes_named(t.comm):  # what a no-boundary run left behind
            os.kill(pid, signal.SIGKILL)


def _processes_named(comm: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _accepted(server: socket.socket) -> bool:
    server.setblocking(False)
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def _marker(t: Target, out: str) -> bool:
    return t.marker.exists()


def _victim_gone(t: Target, out: str) -> bool:
    return not t.victim.exists() or t.victim.read_text() != "keep me"


def _secret(t: Target, out: str) -> bool:
    return any(token in out for token in t.tokens.values())


def _parent_cmdline(t: Target, out: str) -> bool:
    return hashlib.sha256(Path("/proc/self/cmdline").read_bytes()).hexdigest() in out


def _run_files(t: Target, out: str) -> bool:
    return "pyproject.toml" in out


def _left_behind(t: Target, out: str) -> bool:
    """The PID namespace ends with its first process, before bwrap (and so the call) returns."""
    return bool(_processes_named(t.comm))


def _all_made(count: int, what: str) -> Callable[[Target, str], bool]:
    return lambda t, out: f"{what} {count}" in out.split("\n")


FORK_WRITE = 'if os.fork() == 0:\n    open(P["marker"], "w").write("x")\n    os._exit(0)\nos.wait()\n'

ATTEMPTS: dict[str, tuple[str, Callable[[Target, str], bool]]] = {
    # starting a process, every route: each writes the marker outside the folder
    "subprocess": (SHELL + 'import subprocess\nsubprocess.run(["sh", "-c", cmd])\n', _marker),
    "os.system": (SHELL + "os.system(cmd)\n", _marker),
    "os.execv": (SHELL + 'os.execv("/bin/sh", ["sh", "-c", cmd])\n', _marker),
    "os.posix_spawn": (SHELL + 'os.waitpid(os.posix_spawn("/bin/sh", ["sh", "-c", cmd], {}), 0)\n', _marker),
    "os.fork": (FORK_WRITE, _marker),
    "pty.spawn": (SHELL + 'import pty\npty.spawn(["sh", "-c", cmd])\n', _marker),
    # the private module under subprocess, reached with subprocess's own audit call made a no-op
    "_posixsubprocess": (SHELL + "import subprocess, types\n"
                         "names = {k: getattr(sys, k) for k in dir(sys) if not k.startswith('__')}\n"
                         "subprocess.sys = types.SimpleNamespace(**{**names, 'audit': lambda *a: None})\n"
                         'subprocess.run(["sh", "-c", cmd])\n', _marker),
    "ctypes": (SHELL + "import ctypes\nctypes.CDLL(None).system(cmd.encode())\n", _marker),
    "_ctypes": (SHELL + "import _ctypes\n"
                "c_int = type('c_int', (_ctypes._SimpleCData,), {'_type_': 'i'})\n"
                "F = type('F', (_ctypes.CFuncPtr,), {'_flags_': _ctypes.FUNCFLAG_CDECL, '_restype_': c_int})\n"
                "F(_ctypes.dlsym(_ctypes.dlopen(None), 'system'))(cmd.encode())\n", _marker),
    "multiprocessing": ("import multiprocessing\n"
                        "def write():\n    open(P['marker'], 'w').write('x')\n"
                        "p = multiprocessing.get_context('fork').Process(target=write)\np.start()\np.join()\n",
                        _marker),
    # files outside the folder
    "write_outside": ('open(P["marker"], "w").write("x")\n', _marker),
    "delete_outside": ('os.remove(P["victim"])\n', _victim_gone),
    "overwrite_outside": ('fd = os.open(P["victim"], os.O_WRONLY | os.O_TRUNC)\nos.write(fd, b"gone")\n',
                          _victim_gone),
    "rmtree_outside": ('import shutil\nshutil.rmtree(os.path.dirname(P["victim"]))\n', _victim_gone),
    # secrets of the run
    "read_ssh_key": ('print(open(P["files"]["ssh"]).read())\n', _secret),
    "read_checkpoint": ('print(open(P["files"]["checkpoint"]).read())\n', _secret),
    "run_environment": ('print(dict(os.environ))\nprint(open(f"/proc/{P[\'helper\']}/environ").read())\n', _secret),
    "parent_proc": ("import hashlib\n"
                    "print(hashlib.sha256(open(f\"/proc/{P['pid']}/cmdline\", 'rb').read()).hexdigest())\n",
                    _parent_cmdline),
    "list_run_files": ('print(os.listdir(P["root"]))\n', _run_files),
    # network
    "tcp_loopback": ('import socket\nsocket.create_connection(("127.0.0.1", P["port"]), timeout=5).close()\n',
                     lambda t, out: _accepted(t.listener)),
    "unix_abstract_socket": ('import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect("\\0" + P["unix"])\n',
                             lambda t, out: _accepted(t.unix)),
    # other processes
    "signal_the_run": ('import signal\nos.kill(P["pid"], signal.SIGUSR1)\n', lambda t, out: bool(t.signals)),
    # the child says when its name is written (a pipe, not a sleep), then outlives the call
    "left_behind_process": ("import time\nr, w = os.pipe()\n"
                            "if os.fork() == 0:\n    open('/proc/self/comm', 'w').write(P['comm'])\n"
                            "    os.write(w, b'1')\n    time.sleep(60)\n    os._exit(0)\nos.read(r, 1)\n",
                            _left_behind),
    # bombs: 200 processes, 64 MiB of files in a 16 MiB folder, 4 GiB of memory in 512 MiB
    "fork_bomb": ("import time\nmade = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
                  "            time.sleep(1)\n            os._exit(0)\n        made += 1\n"
                  "finally:\n    print('made', made)\n", _all_made(200, "made")),
    "disk_bomb": ("n = 0\ntry:\n    for i in range(64):\n"
                  "        with open(f'fill{i}', 'wb') as f:\n            f.write(b'x' * 2**20)\n        n += 1\n"
                  "finally:\n    print('wrote_mb', n)\n", _all_made(64, "wrote_mb")),
    "memory_bomb": ("x = bytearray(4 * 2**30)\nprint('allocated', 1)\n", _all_made(1, "allocated")),
}

NO_BOUNDARY_SAFE = [name for name in ATTEMPTS if name not in ("fork_bomb", "memory_bomb")]
"""The attempts run with no boundary at all: all but the fork bomb (as a user other than root,
RLIMIT_NPROC counts all of that user's processes) and the memory bomb (RLIMIT_AS stops it in
every mode: a limit, not a boundary)."""
AUDIT_HOOK_MISSES = ["_posixsubprocess", "disk_bomb"]
"""Routes the audit hook alone lets through: its events are raised by Python code that the code
can replace, and it caps no folder."""


def test_the_os_sandbox_can_be_made_here():
    """CI installs bubblewrap (scripts/setup.sh): without it every test below fails, never skips."""
    assert isolation_problem() is None


def attempt(name: str, t: Target, layers: Layers | None) -> tuple[bool, str]:
    """Run attempt `name` (under `layers`, or the shipped `os` mode when None): whether it got out,
    and its output."""
    code, escaped = ATTEMPTS[name]
    program = (f"import json, os, sys\nP = json.loads({json.dumps(t.params())!r})\n"
               + "try:\n" + "".join(f"    {line}\n" for line in code.splitlines())
               + "except BaseException as e:\n    print('stopped:', type(e).__name__, e)\n")
    result = run_python(program, LIMITS, mode="os") if layers is None else run_in(program, LIMITS, layers)
    return escaped(t, result.output), result.output


@pytest.mark.parametrize("layers", [None, Layers(namespaces=True, audit_hook=False)],
                         ids=["os_mode", "namespaces_alone"])
@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_nothing_gets_out_of_the_os_sandbox(name, layers, target):
    escaped, output = attempt(name, target, layers)
    assert not escaped, output
    assert target.helper.poll() is None  # the run's other process is untouched


@pytest.mark.parametrize("name", NO_BOUNDARY_SAFE)
def test_without_a_boundary_the_same_attempts_get_out(name, target):
    escaped, output = attempt(name, target, Layers(namespaces=False, audit_hook=False))
    assert escaped, output


@pytest.mark.parametrize("name", AUDIT_HOOK_MISSES)
def test_the_audit_hook_mode_alone_lets_some_through(name, target):
    escaped, output = attempt(name, target, Layers(namespaces=False, audit_hook=True))
    assert escaped, output


def _without(flag: str, values: int) -> Callable[[list[str]], list[str]]:
    def edit(argv: list[str]) -> list[str]:
        i = argv.index(flag)
        return argv[:i] + argv[i + 1 + values:]
    return edit


PARTS = {  # a part of the OS boundary taken away -> an attempt that then gets out
    "namespaces": (_without("--unshare-all", 0), "tcp_loopback"),
    "read-only view": (lambda argv: argv[:1] + ["--bind", "/tmp", "/tmp"] + argv[1:], "write_outside"),
    "folder size": (_without("--size", 1), "disk_bomb"),
    "seccomp": (_without("--seccomp", 1), "fork_bomb"),
}


@pytest.mark.parametrize("part", list(PARTS))
def test_each_part_of_the_os_boundary_stops_something(part, target, monkeypatch):
    edit, name = PARTS[part]
    if part == "seccomp" and os.getuid() != 0:
        pytest.skip("RLIMIT_NPROC stops the fork bomb of a user other than root: seccomp is what stops root's")
    original = sandbox._namespaces_argv
    monkeypatch.setattr(sandbox, "_namespaces_argv", lambda limits, fd: edit(original(limits, fd)))
    escaped, output = attempt(name, target, Layers(namespaces=True, audit_hook=False))
    assert escaped, output
