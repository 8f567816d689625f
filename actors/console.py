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
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
    """Ray's `worker_process_setup_hook` for every worker of the run: drop the harmless warnings
    and, on a quiet run (LOG_DIR_ENV set), send this process's stdout and stderr, and so those of
    the processes it starts, to `<logs>/worker-<pid>.log` (renamed after its actor at the end)."""
    silence_harmless_warnings()
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(Path(folder) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def ray_init_kwargs(logs: Path, *, verbose: bool) -> dict:
    """`ray.init` arguments: worker output to the terminal (verbose) or to files in `logs`."""
    env = {} if verbose else {LOG_DIR_ENV: str(logs.resolve())}
    hook = f"{__name__}.setup_worker_process"
    return dict(log_to_driver=verbose, runtime_env={"worker_process_setup_hook": hook, "env_vars": env})


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
