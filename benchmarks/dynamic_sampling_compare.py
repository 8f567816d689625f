"""Dynamic sampling off vs on, on the SmolLM2 CPU recipe: reward per generated sample and per second.

    .venv/bin/python benchmarks/dynamic_sampling_compare.py [--off OFF.jsonl --on ON.jsonl --png OUT.png]

Reads two GRPO metrics.jsonl files (defaults: docs/grpo_dynamic_sampling_smollm2_cpu_{off,on}_metrics.jsonl),
prints a markdown table and writes one PNG (default docs/grpo_dynamic_sampling_smollm2_cpu.png): reward/mean
against cumulative generated samples and against cumulative step seconds, both sides.

Generated samples of a step: (1 + dynamic/extra_rounds) x prompts_per_step x group_size, since every
extra round generates another prompts_per_step prompts (rlhf.rollouts.RolloutQueue.more). Seconds: the
sum of timing/step_s (start-up and checkpoints left out). `reward/mean` is the first round's reward
on both sides ("Step metrics" in rlhf.sampling), i.e. the policy's reward on fresh prompts. Gain: mean reward of
the last k steps minus that of the first k steps, divided by the run's samples (per 1000) or minutes.
Since the reward saturates near 1, the table also gives the samples and seconds until the mean reward
of `WINDOW` consecutive steps first reaches `TARGET` (n/a when it never does).
"""

from __future__ import annotations

import argparse
import json
import math
from itertools import accumulate
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"
STEM = "grpo_dynamic_sampling_smollm2_cpu"
TARGET, WINDOW = 0.8, 3
ROWS = (  # (summary key, table label, format)
    ("steps", "steps", "{:.0f}"),
    ("first_reward", "reward/mean, first {k} steps", "{:.3f}"),
    ("last_reward", "reward/mean, last {k} steps", "{:.3f}"),
    ("samples", "generated samples", "{:.0f}"),
    ("seconds", "step seconds (sum of timing/step_s)", "{:.0f}"),
    ("gain_per_1k_samples", "reward gain per 1000 samples", "{:.4f}"),
    ("gain_per_minute", "reward gain per minute", "{:.4f}"),
    ("samples_to_target", f"generated samples until the {WINDOW}-step mean reward >= {TARGET}", "{:.0f}"),
    ("seconds_to_target", f"step seconds until the {WINDOW}-step mean reward >= {TARGET}", "{:.0f}"),
    ("informative_frac", "informative fraction (mean)", "{:.3f}"),
)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The step records (those with timing/step_s) of a metrics.jsonl file, in order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if "timing/step_s" in r]


def samples_per_step(records: list[dict[str, Any]], prompts_per_step: int, group_size: int) -> list[int]:
    """Samples generated at each step: first round plus extra rounds, prompts_per_step prompts each."""
    return [(1 + int(r.get("dynamic/extra_rounds", 0))) * prompts_per_step * group_size for r in records]


def summarize(records: list[dict[str, Any]], prompts_per_step: int = 6, group_size: int = 8,
              k: int = 5) -> dict[str, float]:
    """The table's figures for one run (see the module docstring)."""
    rewards = [float(r["reward/mean"]) for r in records]
    first, last = sum(rewards[:k]) / len(rewards[:k]), sum(rewards[-k:]) / len(rewards[-k:])
    per_step = samples_per_step(records, prompts_per_step, group_size)
    samples = sum(per_step)
    step_s = [float(r["timing/step_s"]) for r in records]
    seconds = sum(step_s)
    fracs = [float(r["dynamic/informative_frac"]) for r in records if "dynamic/informative_frac" in r]
    reached = next((i for i in range(WINDOW - 1, len(rewards))
                    if sum(rewards[i - WINDOW + 1:i + 1]) / WINDOW >= TARGET), None)
    nan = float("nan")
    return {"steps": len(records), "first_reward": first, "last_reward": last, "samples": samples,
            "seconds": seconds, "gain_per_1k_samples": (last - first) / samples * 1000,
            "gain_per_minute": (last - first) / seconds * 60,
            "samples_to_target": nan if reached is None else sum(per_step[:reached + 1]),
            "seconds_to_target": nan if reached is None else sum(step_s[:reached + 1]),
            "informative_frac": sum(fracs) / len(fracs) if fracs else nan}


def table(summaries: dict[str, dict[str, float]], k: int = 5) -> str:
    """A markdown table, one column per run."""
    names = list(summaries)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key, label, fmt in ROWS:
        cells = " | ".join("n/a" if math.isnan(v := summaries[n][key]) else fmt.format(v) for n in names)
        lines.append(f"| {label.format(k=k)} | {cells} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], out: Path, prompts_per_step: int, group_size: int) -> None:
    """reward/mean against cumulative generated samples (left) and cumulative step seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        rewards = [r["reward/mean"] for r in records]
        samples = list(accumulate(samples_per_step(records, prompts_per_step, group_size)))
        seconds = list(accumulate(r["timing/step_s"] for r in records))
        left.plot(samples, rewards, marker=".", label=name)
        right.plot(seconds, rewards, marker=".", label=name)
    for ax, xlabel in ((left, "generated samples (cumulative)"), (right, "step seconds (cumulative)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward/mean (first round)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO SmolLM2-135M CPU: dynamic sampling off vs on")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--off", default=DOCS / f"{STEM}_off_metrics.jsonl", type=Path)
    p.add_argument("--on", default=DOCS / f"{STEM}_on_metrics.jsonl", type=Path)
    p.add_argument("--png", default=DOCS / f"{STEM}.png", type=Path)
    p.add_argument("--prompts-per-step", default=6, type=int)
    p.add_argument("--group-size", default=8, type=int)
    p.add_argument("-k", default=5, type=int, help="steps averaged at each end")
    args = p.parse_args(argv)
    runs = {"dynamic sampling off": read_jsonl(args.off), "dynamic sampling on": read_jsonl(args.on)}
    summaries = {n: summarize(r, args.prompts_per_step, args.group_size, args.k) for n, r in runs.items()}
    print(table(summaries, args.k))
    plot(runs, args.png, args.prompts_per_step, args.group_size)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
