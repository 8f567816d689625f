"""Per-step metrics: a progress bar with ETA on the console and one JSON object per line in
`<output_dir>/metrics.jsonl` (appended, so a resumed run continues the same file)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


class MetricsLogger:
    """Writes metrics.jsonl and drives a tqdm bar whose postfix shows the headline numbers."""

    HEADLINE = ("reward/mean", "loss", "kl", "rewards/accuracy", "rewards/margin", "timing/step_s")

    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, desc: str = "train"):
        from tqdm import tqdm

        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file; a resumed one appends
        else:
            _truncate_after(self.path, start_step)
        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], *, advance: bool = True) -> None:
        """Append one record. `advance=False` for records that are not a training step (the
        evaluation before training, logged as step -1)."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if advance:
            self._bar.set_postfix({k.split("/")[-1]: f"{record[k]:.4g}" for k in self.HEADLINE
                                   if isinstance(record.get(k), float)})
            self._bar.update(1)
        else:
            self._bar.write(" ".join(f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, float)))

    def close(self) -> None:
        self._bar.close()


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
