"""The runner's pure parts: per-step records in one shape, their summary, ratios, the table and
the JSON line. No timing, no subprocesses: tests/test_benchmarks.py checks these directly.

Per-step record (every side, every workload; absent phases are 0):
    step, step_s, generate_s, sync_s, reward_s, train_s, gen_tokens, train_tokens,
    reward_mean, response_len_mean                       (GRPO)
    step, step_s, train_s, train_tokens, loss, accuracy, margin          (DPO)
`train_tokens` counts the prompt + response tokens the learner trained on (no padding).

Steady state: medians skip step 0, which carries one-off costs (first weight sync of TRL's
vLLM, allocator warm-up, lazy initialisation); start-up before step 0 is reported on its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

GRPO_ROWS: tuple[tuple[str, str, str], ...] = (
    # (summary key, table label, "lower"/"higher" is better)
    ("startup_s", "start-up s, launch to step 0", "lower"),
    ("step_s", "median step s, steps 1..N-1", "lower"),
    ("generate_s", "median generate s", "lower"),
    ("gen_tokens_per_s", "generation tokens/s", "higher"),
    ("train_s", "median train s", "lower"),
    ("train_tokens_per_s", "train tokens/s: prompt+completion / train s", "higher"),
    ("sync_s", "weight sync s", "lower"),
    ("reward_s", "reward s", "lower"),
    ("peak_mem_gib", "peak memory GiB, process tree PSS", "lower"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi", "lower"),
    ("response_len_mean", "mean completion tokens", ""),
    ("reward_mean", "mean reward, all steps", "higher"),
)
DPO_ROWS: tuple[tuple[str, str, str], ...] = (
    ("startup_s", "start-up s, launch to step 0", "lower"),
    ("step_s", "median step s, steps 1..N-1", "lower"),
    ("train_tokens_per_s", "train tokens/s: chosen+rejected / step s", "higher"),
    ("peak_mem_gib", "peak memory GiB, process tree PSS", "lower"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi", "lower"),
    ("loss_last", "loss, last step", "lower"),
    ("accuracy_mean", "reward accuracy, mean of all steps", "higher"),
    ("margin_last", "reward margin, last step", "higher"),
)
PER_STEP = {"grpo": (("reward", "reward/mean per step"),),
            "dpo": (("loss", "loss per step"), ("accuracy", "reward accuracy per step"),
                    ("margin", "reward margin per step"))}


# ---------------------------------------------------------------------------------------------
# Our metrics.jsonl -> per-step records


def ours_grpo_steps(metrics: Sequence[dict[str, Any]], prompt_tokens: Sequence[int], completions_per_step: int
                    ) -> list[dict[str, Any]]:
    """Our GRPO metrics.jsonl records -> per-step records. `prompt_tokens[k]` is the prompt token
    count of step k's sequences (each prompt counted group_size times); evaluation-only records
    (no `timing/step_s`) are skipped."""
    out = []
    for m in metrics:
        if "timing/step_s" not in m:
            continue
        step = int(m["step"])
        gen_tokens = float(m["response_len/mean"]) * completions_per_step
        out.append({
            "step": step, "step_s": m["timing/step_s"], "generate_s": m.get("timing/generate_s", 0.0),
            "sync_s": m.get("timing/sync_s", 0.0), "reward_s": m.get("timing/reward_s", 0.0),
            "train_s": m.get("timing/train_s", 0.0), "gen_tokens": gen_tokens,
            "train_tokens": float(prompt_tokens[step]) + gen_tokens, "reward_mean": m["reward/mean"],
            "response_len_mean": m["response_len/mean"], "learner_peak_gib": m.get("memory/learner_peak_gib"),
        })
    return out


def ours_dpo_steps(metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our DPO metrics.jsonl records -> per-step records (the before-training evaluation, step -1,
    and other records without `timing/step_s` are skipped)."""
    out = []
    for m in metrics:
        if "timing/step_s" not in m or int(m["step"]) < 0:
            continue
        step_s = m["timing/step_s"]
        out.append({
            "step": int(m["step"]), "step_s": step_s, "train_s": step_s,
            "train_tokens": m["throughput/tokens_per_s"] * step_s, "loss": m["loss"],
            "accuracy": m["rewards/accuracy"], "margin": m["rewards/margin"],
            "learner_peak_gib": m.get("memory/learner_peak_gib"),
        })
    return out


# ---------------------------------------------------------------------------------------------
# Summaries


def steady(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that count for timing: all but step 0 (all of them if there is only one)."""
    return list(steps[1:]) if len(steps) > 1 else list(steps)


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _rate(num: float, den: float) -> float | None:
    return num / den if den and den > 0 else None


def summarize(side: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """Table values of one side record (`steps`, `startup_s`, `peak_mem_gib`, `peak_gpu_gib`)."""
    steps = side.get("steps") or []
    timed = steady(steps)
    out: dict[str, Any] = {
        "startup_s": side.get("startup_s"),
        "peak_mem_gib": side.get("peak_mem_gib"),
        "peak_gpu_gib": side.get("peak_gpu_gib"),
        "steps": len(steps),
        "step_s": _median([s["step_s"] for s in timed]),
        "train_s": _median([s.get("train_s") for s in timed]),
        "train_tokens_per_s": _median([_rate(s.get("train_tokens", 0.0), s.get("train_s")) for s in timed]),
    }
    if algorithm == "grpo":
        out.update(
            generate_s=_median([s["generate_s"] for s in timed]),
            gen_tokens_per_s=_median([_rate(s["gen_tokens"], s["generate_s"]) for s in timed]),
            sync_s=_median([s.get("sync_s") for s in timed]),
            reward_s=_median([s.get("reward_s") for s in timed]),
            response_len_mean=_mean([s.get("response_len_mean") for s in steps]),
            reward_mean=_mean([s.get("reward_mean") for s in steps]),
            reward_per_step=[s.get("reward_mean") for s in steps],
        )
    else:
        out.update(
            loss_last=steps[-1]["loss"] if steps else None,
            accuracy_mean=_mean([s["accuracy"] for s in steps]),
            margin_last=steps[-1]["margin"] if steps else None,
            loss_per_step=[s["loss"] for s in steps],
            accuracy_per_step=[s["accuracy"] for s in steps],
            margin_per_step=[s["margin"] for s in steps],
        )
    return out


def ratios(ours: dict[str, Any], other: dict[str, Any], algorithm: str) -> dict[str, float | None]:
    """ours / other for every numeric table row (None where either side has no value or other is 0)."""
    rows = GRPO_ROWS if algorithm == "grpo" else DPO_ROWS
    out = {}
    for key, _, _ in rows:
        a, b = ours.get(key), other.get(key)
        out[key] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
    return out


# ---------------------------------------------------------------------------------------------
# The table


def format_value(v: Any) -> str:
    """A table cell: `-` for None, 3 significant digits below 100, thousands separators above."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def format_table(summaries: dict[str, dict[str, Any]], algorithm: str, *, errors: dict[str, str] | None = None
                 ) -> str:
    """A markdown table: one row per metric, a column per side, and `ours/<side>` after each other
    side. `summaries` must hold "ours" first; per-step curves follow as extra rows."""
    rows = GRPO_ROWS if algorithm == "grpo" else DPO_ROWS
    others = [s for s in summaries if s != "ours"]
    header = ["metric", "ours"]
    for s in others:
        header += [s, f"ours/{s}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ours = summaries.get("ours", {})
    ratio = {s: ratios(ours, summaries[s], algorithm) for s in others}
    for key, label, better in rows:
        if all(summaries[s].get(key) is None for s in summaries):
            continue
        cells = [label + (f" ({better} is better)" if better and key not in ("startup_s",) else ""),
                 format_value(ours.get(key))]
        for s in others:
            cells += [format_value(summaries[s].get(key)), format_value(ratio[s][key])]
        lines.append("| " + " | ".join(cells) + " |")
    for key, label in PER_STEP[algorithm]:
        cells = [label, " ".join(format_value(v) for v in ours.get(f"{key}_per_step", [])) or "-"]
        for s in others:
            cells += [" ".join(format_value(v) for v in summaries[s].get(f"{key}_per_step", [])) or "-", ""]
        lines.append("| " + " | ".join(cells) + " |")
    for side, error in (errors or {}).items():
        lines.append(f"\n{side} failed: {error}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The JSON line


RECORD_KEYS = ("workload", "time", "command", "git", "machine", "versions", "env", "spec", "overrides",
               "sides", "summary", "ratios", "notes")


def build_record(*, workload: dict[str, Any], time: str, command: str, git: dict[str, Any],
                 machine: dict[str, Any], versions: dict[str, str], env: dict[str, str], overrides: list[str],
                 sides: dict[str, dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """One line of benchmarks/results/<workload>.jsonl: where, what, every side's per-step
    records, and the table's values with ratios ours/<side>."""
    algorithm = workload["algorithm"]
    summary = {name: summarize(side, algorithm) for name, side in sides.items() if side.get("steps")}
    ratio = {name: ratios(summary["ours"], s, algorithm) for name, s in summary.items()
             if name != "ours" and "ours" in summary}
    return {"workload": workload["name"], "time": time, "command": command, "git": git, "machine": machine,
            "versions": versions, "env": env, "spec": workload, "overrides": overrides, "sides": sides,
            "summary": summary, "ratios": ratio, "notes": notes}
