"""What the terminal shows, and where the libraries' output goes. The terminal keeps the run's own
lines: what the run is (`describe_run`; the cluster layout follows from actors/cluster.py), the
progress bar, errors and the end-of-run summary (rlhf/metrics.py). What vLLM, Ray, DeepSpeed,
transformers and torch print goes to files under `<output_dir>/logs/`, unless `logging.verbose=true`:

    logs/driver.log                  the driver's library loggers (Ray's start-up lines included)
    logs/<Actor>-<pid>.log           stdout and stderr of each Ray actor (VLLMGenerator, FSDP2Learner,
                                     RewardWorker, ...) and of the processes it starts
    logs/ray/                        Ray's own logs (raylet, GCS, dashboard), copied at the end of a
                                     run that started its own Ray instance

Known-harmless warnings are dropped where they are raised, by a filter on the one logger that
raises them, with the reason next to it (`HARMLESS`); every other line still reaches the files.

Also here, as they set up the same processes: the `ray.init` arguments (a Ray instance the run
starts listens on loopback only, `keep_local_ray_on_loopback`) and the worker setup hook (a
TCPStore a worker hosts listens on its advertised address only, `bind_hosted_stores_to_their_address`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from rlhf.config import RunConfig

LOG_DIR_ENV = "RLHF_LOG_DIR"
RAY_MARKERS = (":job_id:", ":task_name:", ":actor_name:")
"""Lines Ray writes into a worker's output to tell its log monitor what runs there."""
DRIVER_LOGGERS = ("ray", "vllm", "transformers", "deepspeed", "torch", "accelerate", "py.warnings")

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


def describe_run(cfg: RunConfig) -> str:
    """The resolved config in three lines: the job and its batch, the model and backends, where
    its files go."""
    if cfg.algorithm == "grpo":
        g = cfg.grpo
        job = (f"grpo, {g.steps} steps x {g.prompts_per_step} prompts x {g.group_size} samples, "
               f"<= {cfg.generation.max_new_tokens} new tokens, task {cfg.data.task}")
    else:
        d = cfg.dpo
        job = (f"dpo ({d.loss_type}, beta {d.beta}), {d.pairs_per_step} pairs per step, "
               + (f"{d.max_steps} steps" if d.max_steps else f"{d.epochs} epoch(s)") + f", data {d.dataset}")
    l = cfg.learner
    logs = "shown here (logging.verbose)" if cfg.logging.verbose else f"{Path(cfg.output_dir) / 'logs'}/"
    return "\n".join([
        f"run: {job}, lr {l.lr:g}, seed {cfg.seed}",
        f"model: {cfg.model.path} ({cfg.model.dtype}), {l.num_ranks} {l.backend} learner rank(s), "
        f"micro-batch {l.micro_batch_size}"
        + (f", generation {cfg.generation.backend}" if cfg.algorithm == "grpo" else ""),
        f"output: {cfg.output_dir}, trackers: {', '.join(cfg.logging.backends)}, library logs: {logs}",
    ])


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


def ray_init_kwargs(logs: Path, *, verbose: bool, local: bool | None = None) -> dict:
    """`ray.init` arguments: worker output to the terminal (verbose) or to files in `logs`. For a
    Ray instance the run starts itself (`local`; None: when RAY_ADDRESS is unset), one whose every
    process listens on loopback only (`keep_local_ray_on_loopback`) and that serves no dashboard
    web UI / Jobs API on port 8265 (a local run needs none; `ray job submit` needs one, on a head
    the user starts, see scripts/submit.sh)."""
    env = {} if verbose else {LOG_DIR_ENV: str(logs.resolve())}
    hook = f"{__name__}.setup_worker_process"
    kwargs = dict(log_to_driver=verbose, runtime_env={"worker_process_setup_hook": hook, "env_vars": env})
    if local is None:
        local = not os.environ.get("RAY_ADDRESS")
    if local:
        keep_local_ray_on_loopback()
        kwargs["include_dashboard"] = False
    return kwargs


def keep_local_ray_on_loopback() -> None:
    """Make a Ray instance that `ray.init()` starts in this process take 127.0.0.1 as its node
    address, and so listen on loopback only: its GCS, raylet and workers (the actors) bind their
    gRPC servers to all interfaces unless the node address is 127.0.0.1, and so do the metrics
    servers of the dashboard process, the dashboard agent and the autoscaler monitor; the agents'
    HTTP servers bind the node address. Ray 2.60 on Linux replaces a 127.0.0.1 given as
    `_node_ip_address` (or `ray start --node-ip-address`) with the address that routes outwards;
    it keeps loopback only where multi-node clusters are off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
    read once, at import, into `ray_constants.ENABLE_RAY_CLUSTER`), so this turns that flag off in
    this process. It only decides the address of a node this process starts: a driver joining a
    cluster takes its address from the node it attaches to, and Ray's processes get their address
    on their command line."""
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


@contextmanager
def driver_logs_to_file(logs: Path, *, verbose: bool) -> Iterator[None]:
    """Inside the block, the driver's library loggers (and Python warnings) write to
    `logs/driver.log` instead of the terminal (no-op when verbose)."""
    silence_harmless_warnings()
    if verbose:
        yield
        return
    handler = logging.FileHandler(logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = {}
    for name in DRIVER_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.propagate)
        logger.handlers = [handler]
        logger.propagate = False
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


def collect_ray_logs(logs: Path, session_dir: str | None) -> None:
    """After a quiet run: name each worker's file after the actor it hosted (Ray prints
    `:actor_name:<Class>` into it), drop empty ones, and copy Ray's own logs from `session_dir`
    (None when the run joined a cluster whose logs stay on its head node)."""
    for path in logs.glob("worker-*.log"):
        lines = path.read_text(errors="replace").splitlines()
        if all(line.startswith(RAY_MARKERS) for line in lines):  # a task worker that printed nothing
            path.unlink()
            continue
        actor = next((line[len(":actor_name:"):] for line in lines if line.startswith(":actor_name:")), None)
        if actor:
            path.rename(path.with_name(f"{actor}-{path.stem.split('-', 1)[1]}.log"))
    if session_dir and Path(session_dir, "logs").is_dir():
        shutil.copytree(Path(session_dir, "logs"), logs / "ray", dirs_exist_ok=True,
                        ignore_dangling_symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
