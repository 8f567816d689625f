"""Per-step metrics: a progress bar with ETA on the console, one JSON object per line in
`<output_dir>/metrics.jsonl` (appended, so a resumed run continues the same file), the same records
to the experiment trackers of `logging.backends`, a summary of the run at the end, and the check
that stops a run whose loss or weights stopped being finite (`TrainHealth`)."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.errors import RunError

if TYPE_CHECKING:
    from rlhf.types import StepMetrics


def add_engine_metrics(total: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """`total` with one more generation call's engine figures (`Generator.last_metrics`) added:
    per-engine tokens and seconds add up (turns of an episode, rounds of dynamic sampling); other
    figures (ratios) keep their maximum."""
    out = dict(total)
    for k, v in metrics.items():
        out[k] = out.get(k, 0.0) + v if k.endswith(("_tokens", "_s")) else max(out.get(k, v), v)
    return out


class PhaseTimer:
    """Wall-clock seconds per named phase: `with timer("generate"): ...` -> {"timing/generate_s": s}."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{name}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


class NonfiniteTraining(RunError):
    """The loss or gradient was NaN/inf for `learner.max_nonfinite_steps` steps in a row, or the
    weights became NaN/inf."""


class TrainHealth:
    """Counts consecutive optimizer steps the learners skipped for a NaN/inf loss or gradient
    (`train/nonfinite_skipped`, "Non-finite steps" in actors/learner_base.py) and stops the run
    after `learner.max_nonfinite_steps` of them (0: at the first); weights that became NaN/inf
    (`train/nonfinite_params`) stop it at once. Called right after the update, so a stopped run
    neither syncs nor saves those weights."""

    def __init__(self, max_nonfinite_steps: int, *, lr: float, max_grad_norm: float, dtype: str) -> None:
        self.max_steps, self.skipped = max_nonfinite_steps, 0
        self.keys = f"learner.lr={lr:g}, learner.max_grad_norm={max_grad_norm:g}, model.dtype={dtype}"

    @classmethod
    def from_config(cls, cfg: Any) -> TrainHealth:
        return cls(cfg.learner.max_nonfinite_steps, lr=cfg.learner.lr, max_grad_norm=cfg.learner.max_grad_norm,
                   dtype=cfg.model.dtype)

    def check(self, step: int, train: StepMetrics) -> None:
        values = f"loss {train.loss:.4g}, grad_norm {train.grad_norm:.4g}"
        if train.values.get("train/nonfinite_params"):
            raise NonfiniteTraining(f"the weights became NaN/inf in the optimizer step of step {step} ({values}); "
                                    f"nothing was saved after it. Likely cause: {self.keys}")
        self.skipped = self.skipped + 1 if train.values.get("train/nonfinite_skipped") else 0
        if self.skipped and self.skipped >= self.max_steps:
            raise NonfiniteTraining(
                f"the loss or gradient was NaN/inf for {self.skipped} step(s) in a row, each skipped without an "
                f"update (step {step}: {values}; learner.max_nonfinite_steps={self.max_steps}). "
                f"Likely cause: {self.keys}")


def nonfinite(train: StepMetrics) -> bool:
    """Whether the learners skipped this update or its weights are NaN/inf (a repeat would be no better)."""
    return bool(train.values.get("train/nonfinite_skipped") or train.values.get("train/nonfinite_params"))


class MetricsLogger:
    """Writes metrics.jsonl, feeds the trackers of `logging.backends` (rlhf.run.trackers) and drives a
    tqdm bar whose postfix shows the headline numbers; `close()` prints the run's summary.

    `config` is the run's RunConfig (or its dict); without it the `config.yaml` that the entry
    scripts write into `output_dir` is read, and without that only metrics.jsonl is written."""

    HEADLINE = {"reward/mean": "reward", "loss": "loss", "kl": "kl", "rewards/accuracy": "acc",
                "rewards/margin": "margin", "timing/step_s": "step_s"}

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, desc: str = "train",
                 config: Any = None):
        from tqdm import tqdm

        from rlhf.config import config_to_dict
        from rlhf.run.trackers import open_trackers

        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file; a resumed one appends
        else:
            _truncate_after(self.path, start_step)
        run_config = config_to_dict(config) if config is not None else _saved_config(self.output_dir)
        logging_cfg = run_config.get("logging", {})
        self.trackers = open_trackers(logging_cfg.get("backends", ["jsonl"]), self.output_dir,
                                      project=logging_cfg.get("project", "rlhf"), config=run_config,
                                      start_step=start_step)
        self._start_step, self._t0 = start_step, time.perf_counter()
        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], *, advance: bool = True) -> None:
        """Append one record. `advance=False` for records that are not a training step (the
        evaluation before training, logged as step -1)."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in list(self.trackers):
            try:
                tracker.log(step, numbers)
            except Exception as e:  # a tracker (disk, network) never stops training: jsonl has it all
                self.trackers.remove(tracker)
                self._bar.write(f"warning: {type(tracker).__name__} failed at step {step} and is off for the "
                                f"rest of the run ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
        if advance:
            self._bar.set_postfix({name: f"{record[k]:.4g}" for k, name in self.HEADLINE.items()
                                   if isinstance(record.get(k), float)})
            self._bar.update(1)
        else:
            self._bar.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in numbers.items()))

    def warn(self, line: str) -> None:
        """One line on the terminal, above the progress bar (it is not a metric: metrics.jsonl has
        the numbers behind it)."""
        self._bar.write(line)

    def close(self) -> None:
        """Close the bar and the trackers, then print the run's summary (rlhf.run.metrics.run_summary)."""
        self._bar.close()
        for tracker in self.trackers:
            tracker.close()
        lines = run_summary(read_metrics(self.path), self.output_dir, seconds=time.perf_counter() - self._t0,
                            steps_run_here=self._bar.n - self._start_step)
        print("\n".join(lines), flush=True)


def run_summary(records: list[dict[str, Any]], output_dir: str | Path, *, seconds: float | None = None,
                steps_run_here: int | None = None) -> list[str]:
    """The end-of-run summary, from metrics.jsonl's records: the headline figures averaged over the
    first and the last fifth of the steps, every evaluation figure before -> after, median step
    and phase seconds, median throughput, and where the metrics, plot, checkpoint, tracker runs and
    logs are."""
    steps = [r for r in records if "timing/step_s" in r]
    resumed = steps_run_here is not None and steps_run_here < len(steps)
    head = (f"done: {len(steps)} steps" + (f" (the last {steps_run_here} after resuming)" if resumed else "")
            + (f" in {_duration(seconds)}" if seconds is not None else ""))
    rows = _figures(records, steps)
    width = max((len(label) for label, _ in rows), default=0)
    return [head, *(f"  {label:<{width}}  {text}" for label, text in rows), *_locations(Path(output_dir))]


def _figures(records: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[tuple[str, str]]:
    rows = []
    k = min(10, max(1, len(steps) // 5))  # steps averaged at each end
    for key in ("reward/mean", "rewards/accuracy", "rewards/margin", "loss"):
        pts = [r for r in steps if isinstance(r.get(key), (int, float))]
        if len(pts) >= 2:
            first, last = pts[:k], pts[-k:]
            rows.append((key, f"{_mean(first, key):.3g} ({_span(first)}) -> "
                              f"{_mean(last, key):.3g} ({_span(last)})"))
        if key == "reward/mean" and pts:
            break  # GRPO: the reward is the headline; its loss moves by design, not towards 0
    skipped = [str(r["step"]) for r in steps if r.get("train/nonfinite_skipped")]
    if skipped:  # updates the learners dropped ("Non-finite steps", actors/learner_base.py)
        rows.append(("skipped updates", f"{len(skipped)}, NaN/inf loss or gradient (steps {', '.join(skipped[:10])})"))
    for key in sorted({k for r in records for k in r if k.startswith("eval/")}):
        pts = [r for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            before, after = pts[0], pts[-1]
            text = f"{before[key]:.3g} (step {before['step']})"
            if len(pts) > 1:
                text += f" -> {after[key]:.3g} (step {after['step']})"
            rows.append((key, text))
    if steps:
        phases = [k for k in steps[-1] if k.startswith("timing/") and k != "timing/step_s"  # loop order
                  and _median(steps, k) >= 1e-3]  # not the phases that took no time (an empty rollout queue's wait)
        rows.append(("step time (median)", f"{_median(steps, 'timing/step_s'):.3g} s: "
                     + ", ".join(f"{p[len('timing/'):-2]} {_median(steps, p):.3g}" for p in phases)))
        rates = {"throughput/tokens_per_s": "trained", "throughput/gen_tokens_per_s": "generated"}
        shown = [f"{_median(steps, key):,.0f} {name}" for key, name in rates.items() if key in steps[-1]]
        if shown:
            rows.append(("tokens/s (median)", ", ".join(shown)))
    return rows


def _locations(out: Path) -> list[str]:
    from rlhf.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out)
    where = [f"metrics: {out / 'metrics.jsonl'}, plot: {out / 'metrics.png'}",
             f"checkpoint: {ckpt}" if ckpt else None,
             f"tensorboard --logdir {out / 'tensorboard'}" if (out / "tensorboard").is_dir() else None,
             f"wandb: {out / 'wandb'}" if (out / "wandb").is_dir() else None,
             f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {out / 'mlruns'}"
             if (out / "mlruns").is_dir() else None,
             f"logs: {out / 'logs'}/" if (out / "logs").is_dir() else None]
    return [f"  {w}" for w in where if w]


def _mean(rs: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def _median(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs if isinstance(r.get(key), (int, float)))


def _span(rs: list[dict[str, Any]]) -> str:
    return f"step {rs[0]['step']}" if len(rs) == 1 else f"steps {rs[0]['step']}-{rs[-1]['step']}"


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _saved_config(output_dir: Path) -> dict[str, Any]:
    path = output_dir / "config.yaml"
    if not path.exists():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; None reads as "missing" in every tool
    return v


def _truncate_after(path: Path, start_step: int) -> None:
    """Drop records of steps >= start_step: a run that crashed after logging but before its
    checkpoint logs those steps again on resume, and the file must not hold them twice."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < start_step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
