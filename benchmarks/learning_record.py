"""Learning records of the runs of benchmarks/qwen_learn.sh: one line per run while they go, and a finished
run's metrics.jsonl turned into the record in docs/ with a plot.

    python benchmarks/learning_record.py status outputs/qwen_learn      # step, latest eval, state
    python benchmarks/learning_record.py record outputs/qwen_learn/gsm  # docs/<recipe>_metrics.jsonl, .png
    python benchmarks/learning_record.py record outputs/qwen_learn/gsm-4gpu \\
        --baseline docs/grpo_gsm8k_qwen2.5-coder-0.5b_1gpu_metrics.jsonl  # + time to its final pass@1

A run folder holds the run's metrics.jsonl and config.yaml and the driver's info.json (recipe, GPUs,
commit, start), pid and exit.json (exit status, end); `qwen_learn.sh collect` packs the same layout. The
record's first line names the GPU, the commit and the wall time, and gives every held-out evaluation
as [step, value, training seconds]; the run's own lines follow unchanged. Training seconds add up the
steps' and the evaluations' timings (start-up left out), so runs on different GPU counts compare.
A DPO record is `<recipe>_preferences.jsonl`: `*qwen*coder*metrics*` names the GRPO pass@1 records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
GRPO_EVAL = re.compile(r"^eval/.+/pass@\d+$")
DPO_EVAL = ("eval/reward_accuracy", "eval/logp_accuracy", "eval/margin")


@dataclass
class Run:
    """A run folder, read: the driver's info and exit files, the run's config and metrics records."""

    path: Path
    info: dict[str, Any]
    exit: dict[str, Any] | None
    config: dict[str, Any]
    lines: list[str]

    @classmethod
    def load(cls, path: str | Path) -> Run:
        path = Path(path)
        info, exit_, config, metrics = (path / name for name in
                                        ("info.json", "exit.json", "config.yaml", "metrics.jsonl"))
        return cls(path, json.loads(info.read_text()) if info.is_file() else {},
                   json.loads(exit_.read_text()) if exit_.is_file() else None,
                   yaml.safe_load(config.read_text()) if config.is_file() else {},
                   [line for line in metrics.read_text().splitlines() if line] if metrics.is_file() else [])

    @cached_property
    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]

    @property
    def algorithm(self) -> str:
        return self.config.get("algorithm", "grpo")

    @property
    def name(self) -> str:
        """The recipe's file name without .yaml (the record's name), else the output folder's."""
        recipe = self.info.get("recipe") or ""
        return Path(recipe).stem if recipe else self.path.name


def eval_curves(records: list[dict[str, Any]], algorithm: str) -> dict[str, list[list[float]]]:
    """Held-out figure -> [[step, value, training seconds when it was measured], ...]. GRPO evaluates
    before the step its record holds (and once more after the last); DPO after it (and at step -1)."""
    curves: dict[str, list[list[float]]] = {}
    seconds = 0.0
    for r in records:
        seconds += r.get("timing/eval_s", 0.0)
        if algorithm == "dpo":
            seconds += r.get("timing/step_s", 0.0)
        keys = DPO_EVAL if algorithm == "dpo" else [k for k in r if GRPO_EVAL.match(k)]
        for key in keys:
            if isinstance(r.get(key), (int, float)):
                curves.setdefault(key, []).append([r["step"], r[key], round(seconds, 3)])
        if algorithm != "dpo":
            seconds += r.get("timing/step_s", 0.0)
    return curves


def training_seconds(records: list[dict[str, Any]]) -> float:
    """The steps' and the evaluations' seconds: the run less its start-up."""
    return sum(r.get("timing/step_s", 0.0) + r.get("timing/eval_s", 0.0) for r in records)


def pass1_key(curves: dict[str, Any]) -> str | None:
    return next((k for k in curves if k.endswith("/pass@1")), None)


def reach(points: list[list[float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or above `target`; None if none got there."""
    return next((s for _, v, s in points if v >= target), None)


def header(run: Run, baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record's first line: what ran where, at which commit, how long, and the evaluations."""
    records = run.records
    curves = eval_curves(records, run.algorithm)
    steps = [r for r in records if "timing/step_s" in r]
    train_key = ("rewards/accuracy", "rewards/margin") if run.algorithm == "dpo" else ("reward/mean",)
    k = min(5, max(1, len(steps) // 5))  # steps averaged at each end
    names = run.info.get("gpu_names") or []
    visible = [d for d in str(run.info.get("cuda_visible_devices", "")).split(",") if d]
    ended, started = (run.exit or {}).get("ended"), run.info.get("started")
    head = {
        "record": run.name,
        "recipe": run.info.get("recipe"),
        "overrides": run.info.get("overrides", []),
        "algorithm": run.algorithm,
        "task": (run.config.get("dpo", {}).get("dataset") if run.algorithm == "dpo"
                 else run.config.get("data", {}).get("task")),
        "model": run.config.get("model", {}).get("path"),
        "gpu": names[0] if len(set(names)) == 1 else ", ".join(names) or "unknown",
        "gpus": len(names) or len(visible),
        "commit": run.info.get("commit", "unknown"),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)) if started else None,
        "wall_s": round(ended - started, 1) if ended and started else None,
        "train_s": round(training_seconds(records), 1),
        "exit_code": (run.exit or {}).get("rc"),
        "steps": len(steps),
        "train": {key: {"start": _mean(steps[:k], key), "end": _mean(steps[-k:], key)} for key in train_key},
        "eval": {key: {"start": pts[0][1], "end": pts[-1][1], "gain": round(pts[-1][1] - pts[0][1], 6),
                       "points": pts} for key, pts in curves.items()},
    }
    if baseline is not None:
        head["reached"] = reached(curves, baseline)
    return head


def reached(curves: dict[str, list[list[float]]], baseline: dict[str, Any]) -> dict[str, Any]:
    """Training seconds to the baseline record's final pass@1, here and in the baseline, and the speed-up.
    A run that ends below that figure (a few points are noise on 256 problems) also gets `common`: the
    same for its own final figure, the lower of the two, which both runs reach."""
    key = pass1_key(baseline["eval"])
    if key is None or key not in curves:
        raise SystemExit(f"the baseline {baseline.get('record')} and this run share no pass@1 figure")
    points = baseline["eval"][key]["points"]

    def timing(target: float) -> dict[str, Any]:
        here, there = reach(curves[key], target), reach(points, target)
        return {"target": target, "seconds": here, "baseline_seconds": there,
                "speedup": round(there / here, 3) if here and there else None}

    out = {"baseline": baseline.get("record"), "baseline_gpus": baseline.get("gpus"), "figure": key,
           **timing(baseline["eval"][key]["end"])}
    if out["seconds"] is None:
        out["common"] = timing(curves[key][-1][1])  # reached nowhere here: the final is below the target
    return out


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def write_record(run: Run, docs: Path, baseline: Path | None = None) -> tuple[Path, Path]:
    """docs/<recipe>_metrics.jsonl (GRPO) or _preferences.jsonl (DPO), and docs/<recipe>.png."""
    if not run.lines:
        raise SystemExit(f"{run.path}: no metrics.jsonl records")
    base = json.loads(baseline.read_text().splitlines()[0]) if baseline else None
    head = header(run, base)
    docs.mkdir(parents=True, exist_ok=True)
    out = docs / f"{run.name}_{'preferences' if run.algorithm == 'dpo' else 'metrics'}.jsonl"
    out.write_text("\n".join([json.dumps(head), *run.lines]) + "\n")
    return out, plot(run, head, docs / f"{run.name}.png")


def plot(run: Run, head: dict[str, Any], out: Path) -> Path:
    """GRPO: reward and held-out pass@k against step and against training minutes. DPO: the 2x2 of
    rlhf.run.plots (preference accuracy, losses, implicit rewards, phase times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{head['record']}: {head['gpus']} x {head['gpu']}, commit {str(head['commit'])[:10]}"
    if run.algorithm == "dpo":
        from rlhf.run.plots import plot_metrics

        return plot_metrics(run.path / "metrics.jsonl", out, title=title)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    reward = [(r["step"], r["reward/mean"]) for r in run.records if "reward/mean" in r]
    if reward:
        by_step.plot(*zip(*reward), label="reward/mean", alpha=0.6)
    for i, (key, e) in enumerate(head["eval"].items(), start=1):
        steps, values, seconds = zip(*e["points"])
        by_step.plot(steps, values, marker="o", label=key, color=f"C{i}")
        by_time.plot([s / 60 for s in seconds], values, marker="o", label=key, color=f"C{i}")
    for ax, xlabel in ((by_step, "step"), (by_time, "training minutes")):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def status_line(run: Run) -> str:
    """`TASK step S/N  <latest held-out figure>  running | exit RC | stopped  M min  GPU x`."""
    records = run.records
    steps = [r for r in records if "timing/step_s" in r]
    total = run.config.get("grpo", {}).get("steps") if run.algorithm == "grpo" else None
    step = f"step {steps[-1]['step'] + 1 if steps else 0}" + (f"/{total}" if total else "")
    curves = eval_curves(records, run.algorithm)
    key = pass1_key(curves) or next((k for k in DPO_EVAL if k in curves), None)
    shown = [key] + (["eval/margin"] if key and key != "eval/margin" and "eval/margin" in curves else [])
    latest = "  ".join(f"{k} {curves[k][-1][1]:.3f} (step {curves[k][-1][0]})" for k in shown if k)
    started = run.info.get("started")
    if run.exit is not None:
        state, until = f"exit {run.exit.get('rc')}", run.exit.get("ended")
    else:
        pid = run.path / "pid"
        alive = pid.is_file() and _alive(pid.read_text().strip())
        state, until = ("running" if alive else "stopped (no exit.json)"), time.time()
    minutes = f"  {(until - started) / 60:.1f} min" if started and until else ""
    gpus = run.info.get("cuda_visible_devices", "?")
    return f"{run.path.name:<10} {step:<11} {latest or 'no eval yet'}  {state}{minutes}  GPU {gpus}"


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="one line per run folder under ROOT")
    s.add_argument("root", type=Path)
    r = sub.add_parser("record", help="a finished run folder -> docs/<recipe>_metrics.jsonl and .png")
    r.add_argument("run", type=Path)
    r.add_argument("--docs", type=Path, default=ROOT / "docs")
    r.add_argument("--baseline", type=Path, help="a record whose final pass@1 this run's time is measured to")
    args = p.parse_args(argv)
    if args.command == "status":
        runs = sorted(d for d in args.root.glob("*") if (d / "info.json").is_file())
        print("\n".join(status_line(Run.load(d)) for d in runs) or f"no runs under {args.root}")
        return 0
    run = Run.load(args.run)
    out, png = write_record(run, args.docs, args.baseline)
    head = json.loads(out.read_text().splitlines()[0])
    for key, e in head["eval"].items():
        print(f"{key}: {e['start']:.3f} -> {e['end']:.3f} ({e['gain']:+.3f})")
    if "reached" in head:
        print(f"reached: {json.dumps(head['reached'])}")
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
