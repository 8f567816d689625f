"""A PNG of a run's metrics.jsonl: GRPO (reward, held-out pass@1, loss/KL, lengths, phase times) or DPO
(preference accuracy on train and held-out pairs, losses, implicit rewards, phase times), told apart by
the keys."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from rlhf.run.metrics import read_metrics

PANELS = (
    ("reward", ("reward/mean", "eval/*/pass@1")),  # held-out pass@1 is logged per task
    ("loss / kl / clip", ("loss", "kl", "clip_frac")),
    ("response length", ("response_len/mean",)),
    ("seconds per phase", ("timing/generate_s", "timing/reward_s", "timing/train_s", "timing/sync_s")),
)
DPO_PANELS = (
    ("preference accuracy", ("rewards/accuracy", "eval/reward_accuracy", "eval/logp_accuracy")),
    ("loss", ("loss", "eval/loss")),
    ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margin", "eval/margin")),
    ("seconds per phase", ("timing/reference_s", "timing/train_s", "timing/step_s")),
)


def plot_metrics(metrics_path: str | Path, out_path: str | Path | None = None, *, title: str = "") -> Path:
    """Write a 2x2 figure next to metrics.jsonl (or to `out_path`) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out = Path(out_path) if out_path else Path(metrics_path).with_suffix(".png")
    panels = DPO_PANELS if any("rewards/margin" in r for r in records) else PANELS
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, keys) in zip(axes.flat, panels):
        for key, pts in panel_series(records, keys).items():
            ax.plot(*zip(*pts), label=key, marker="." if len(pts) < 40 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or str(Path(metrics_path).parent))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def panel_series(records: list[dict[str, Any]], patterns: tuple[str, ...]
                 ) -> dict[str, list[tuple[int, float]]]:
    """Metric -> [(step, value)] for every metric the records hold that matches one of `patterns`
    (fnmatch, e.g. `eval/*/pass@1`), in the patterns' order; metrics with no value are left out."""
    present = list(dict.fromkeys(k for r in records for k in r))
    series: dict[str, list[tuple[int, float]]] = {}
    for pattern in patterns:
        for key in (k for k in present if fnmatchcase(k, pattern) and k not in series):
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                series[key] = pts
    return series
