"""What the terminal shows, and where the libraries' output goes. The terminal keeps the run's own
lines: what the run is (`describe_run`; the cluster layout follows from actors/cluster.py), the
progress bar, errors and the end-of-run summary (rlhf/run/metrics.py). What vLLM, Ray, DeepSpeed,
transformers and torch print goes to files under `<output_dir>/logs/`, unless `logging.verbose=true`:

    logs/driver.log                  the driver's library loggers (Ray's start-up lines included)
    logs/<Actor>-<pid>.log           stdout and stderr of each Ray actor (VLLMGenerator, LearnerRank,
                                     RewardWorker, ...) and of the processes it starts
    logs/ray/                        Ray's own logs (raylet, GCS, dashboard), copied at the end of a
                                     run that started its own Ray instance

Known-harmless warnings are dropped where they are raised (actors/worker_setup.py, `HARMLESS`, in
the driver too); every other line still reaches the files.

Also here, as they set up the same processes: the `ray.init` arguments (a Ray instance the run
starts listens on loopback only, `keep_local_ray_on_loopback`), which name the workers' setup hook
(`actors.worker_setup.setup_worker_process`: its output to the log files, and a TCPStore a worker
hosts listening on its advertised address only).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from actors.worker_setup import LOG_DIR_ENV, setup_worker_process, silence_harmless_warnings
from rlhf.config import RunConfig

WORKER_NICENESS = "RAY_worker_niceness"
"""Ray starts its workers, so every actor of a run, at niceness 15: any busy process at the default 0
then takes ~30x their CPU share. A run's actors are its workload, so its runtime environment starts
them at 0, as Ray does for a job's own supervisor actor (docs/testing.md has the measurement)."""

RAY_MARKERS = (":job_id:", ":task_name:", ":actor_name:")
"""Lines Ray writes into a worker's output to tell its log monitor what runs there."""
DRIVER_LOGGERS = ("ray", "vllm", "transformers", "deepspeed", "torch", "accelerate", "py.warnings")


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


def ray_init_kwargs(logs: Path, *, verbose: bool, local: bool | None = None) -> dict:
    """`ray.init` arguments: worker output to the terminal (verbose) or to files in `logs`. For a
    Ray instance the run starts itself (`local`; None: when RAY_ADDRESS is unset), one whose every
    process listens on loopback only (`keep_local_ray_on_loopback`) and that serves no dashboard
    web UI / Jobs API on port 8265 (a local run needs none; `ray job submit` needs one, on a head
    the user starts, see scripts/submit.sh)."""
    env = {WORKER_NICENESS: "0", **({} if verbose else {LOG_DIR_ENV: str(logs.resolve())})}
    hook = f"{setup_worker_process.__module__}.setup_worker_process"
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
