"""Experiment trackers behind `logging.backends`: TensorBoard, Weights & Biases and MLflow get every
record of metrics.jsonl (which is always written, by rlhf.run.metrics), with the same keys, indexed by
the record's `step`, and the run's config attached.

Choices:
1. A tracker's package is imported only when chosen; a missing one is a one-line error at start-up
   (`check_backends`) naming the install command.
2. Each tracker writes inside the run's folder: `tensorboard/` (event files), `wandb/` (offline
   unless W&B credentials or WANDB_MODE say otherwise), `mlruns/` (MLflow file store, unless
   MLFLOW_TRACKING_URI names a server). The ids of the W&B and MLflow runs are kept in
   `trackers.json`, so a resumed run continues the same tracker runs.
3. Only numbers are tracked (the `step` key itself is the x axis). After a resume, TensorBoard
   drops the points it had from the resume step on; W&B and MLflow continue the same run, where
   steps logged between the last checkpoint and the crash appear twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from rlhf.errors import ConfigError

# backend -> (module that must import, distribution to install)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements" / "trackers.txt"


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_backends(backends: tuple[str, ...] | list[str]) -> None:
    """Raise ConfigError (one line, with the install command) when a chosen tracker's package is missing."""
    missing = [b for b in backends if b in PACKAGES and importlib.util.find_spec(PACKAGES[b][0]) is None]
    if missing:
        reqs = " ".join(_pinned(PACKAGES[b][1]) for b in missing)
        raise ConfigError(f"logging.backends={list(backends)}: {', '.join(missing)} not installed; "
                          f"install with: {sys.executable} -m pip install {reqs}")


def open_trackers(backends: tuple[str, ...] | list[str], output_dir: str | Path, *, project: str,
                  config: dict[str, Any], start_step: int = 0) -> list[Tracker]:
    """One open tracker per chosen backend other than `jsonl` (rlhf.run.metrics writes that one)."""
    check_backends(backends)
    out = Path(output_dir)
    ids_path = out / "trackers.json"
    ids = json.loads(ids_path.read_text()) if start_step and ids_path.exists() else {}
    opened = {b: TRACKERS[b](out, project=project, config=config, start_step=start_step, run_id=ids.get(b))
              for b in dict.fromkeys(backends) if b in TRACKERS}
    ids = {b: t.run_id for b, t in opened.items() if t.run_id}
    if ids:
        ids_path.write_text(json.dumps(ids) + "\n")
    return list(opened.values())


class TensorBoardTracker:
    """Event files under `<output_dir>/tensorboard/`; the config as a text entry at step 0."""

    def __init__(self, out: Path, *, config: dict[str, Any], start_step: int, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: after a resume, TensorBoard drops what an earlier process logged from here on.
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_step or None)
        self.run_id = None
        if not start_step:
            text = json.dumps(config, indent=2, default=str)
            self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds; a crash must not lose the last ones

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in `<output_dir>/wandb/`, named after the output folder. Offline unless
    WANDB_MODE is set or W&B credentials exist (`wandb sync <output_dir>/wandb/offline-run-*`
    uploads an offline run later). Every key is plotted against the record's `step`."""

    def __init__(self, out: Path, *, project: str, config: dict[str, Any], run_id: str | None,
                 **_: Any) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_credentials() else "offline")
        self.run = wandb.init(
            project=project, name=out.name, dir=str(out), config=config, mode=mode, id=run_id, resume="allow",
            settings=wandb.Settings(console="off", quiet=True, silent=True),  # the terminal is ours
        )
        self.run_id = self.run.id
        # W&B's own step only grows; ours starts at -1 (evaluation before training) and repeats
        # after a resume, so it is an ordinary key every other key is plotted against.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run in the experiment `logging.project`, named after the output folder; the config
    as flattened params. Store: MLFLOW_TRACKING_URI, else a file store in `<output_dir>/mlruns/`
    (`mlflow ui --backend-store-uri <output_dir>/mlruns`). Keys are MLflow-safe (`mlflow_key`):
    `eval/<task>/pass@k` is logged as `eval/<task>.pass_at_k`."""

    def __init__(self, out: Path, *, project: str, config: dict[str, Any], run_id: str | None,
                 **_: Any) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps the file store in maintenance mode behind this switch; it is the one
            # store that needs no server and no database package, so a run folder can hold it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            run_id = self.client.create_run(exp_id, run_name=out.name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
                self.client.log_batch(run_id, params=params[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MLflowTracker}


def mlflow_key(key: str) -> str:
    """`key` as MLflow can store it: `@` -> `_at_`, other characters MLflow refuses -> `_`, and
    every `/` after the first -> `.`. MLflow's file store keeps a metric as a file at its key's path,
    so `reward/failed` and `reward/failed/exception` could not both exist; the first `/` stays, as
    MLflow's UI groups charts by it."""
    section, sep, rest = re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_")).partition("/")
    return section + sep + rest.replace("/", ".")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _wandb_credentials() -> bool:
    """An API key in the environment or from `wandb login` (kept in ~/.netrc)."""
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())


def _pinned(dist: str) -> str:
    """`dist==version` as requirements/trackers.txt pins it (the bare name outside a checkout)."""
    if REQUIREMENTS.exists():
        for line in REQUIREMENTS.read_text().splitlines():
            if line.split("==")[0].strip().lower() == dist:
                return line.strip()
    return dist
