"""The runner's pure parts: per-step records in one shape, their summary, ratios, the table and
the JSON line, nvidia-smi's per-GPU figures, the waves sides run in. No timing, no subprocesses:
tests/unit/test_benchmarks.py and tests/unit/test_bench_parallel.py check these directly.

Per-step record (every side, every workload; absent phases are 0):
    step, step_s, generate_s, sync_s, reward_s, train_s, gen_tokens, train_tokens,
    reward_mean, response_len_mean                       (GRPO)
    step, step_s, train_s, train_tokens, loss, accuracy, margin          (DPO)
`train_tokens` counts the prompt + response tokens the learner trained on (no padding).

Steady state: medians skip step 0, which carries one-off costs (first weight sync of TRL's
vLLM, allocator warm-up, lazy initialisation); start-up before step 0 is reported on its own.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

TUNED = "-tuned"
"""Suffix of the tuned row's sides (`ours-tuned`, `trl-vllm-tuned`): compared with `ours-tuned`."""

GRPO_ROWS: tuple[tuple[str, str, str], ...] = (
    # (summary key, table label, "lower"/"higher" is better)
    ("startup_s", "start-up s, launch to step 0", "lower"),
    ("step_s", "median step s, steps 1..N-1", "lower"),
    ("samples_per_s", "trained samples/s, steps 1..N-1", "higher"),
    ("generate_s", "median generate s", "lower"),
    ("gen_tokens_per_s", "generation tokens/s", "higher"),
    ("train_s", "median train s", "lower"),
    ("train_tokens_per_s", "train tokens/s: prompt+completion / train s", "higher"),
    ("mfu", "learner MFU (perf/mfu), median of steps 1..N-1", "higher"),
    ("mfu_min", "learner MFU, lowest of steps 1..N-1", "higher"),
    ("sync_s", "weight sync s", "lower"),
    ("reward_s", "reward s", "lower"),
    ("gpu_busy", "GPU busy share after start-up (nvidia-smi utilization, 1 s samples)", "higher"),
    ("peak_mem_gib", "peak memory GiB, process tree PSS", "lower"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi, busiest GPU of the side", "lower"),
    ("gpus", "GPUs (nvidia-smi index)", ""),
    ("cpus", "host cores (pinned beside other sides)", ""),
    ("micro_batch", "learner micro-batch", ""),
    ("response_len_mean", "mean completion tokens", ""),
    ("reward_mean", "mean reward, all steps", "higher"),
)
DPO_ROWS: tuple[tuple[str, str, str], ...] = (
    ("startup_s", "start-up s, launch to step 0", "lower"),
    ("step_s", "median step s, steps 1..N-1", "lower"),
    ("train_tokens_per_s", "train tokens/s: chosen+rejected / step s", "higher"),
    ("mfu", "learner MFU (perf/mfu), median of steps 1..N-1", "higher"),
    ("mfu_min", "learner MFU, lowest of steps 1..N-1", "higher"),
    ("peak_mem_gib", "peak memory GiB, process tree PSS", "lower"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi, busiest GPU of the side", "lower"),
    ("gpus", "GPUs (nvidia-smi index)", ""),
    ("cpus", "host cores (pinned beside other sides)", ""),
    ("micro_batch", "learner micro-batch", ""),
    ("loss_last", "loss, last step", "lower"),
    ("accuracy_mean", "reward accuracy, mean of all steps", "higher"),
    ("margin_last", "reward margin, last step", "higher"),
)
PER_STEP = {"grpo": (("reward", "reward/mean per step"),),
            "dpo": (("loss", "loss per step"), ("accuracy", "reward accuracy per step"),
                    ("margin", "reward margin per step"))}


# ---------------------------------------------------------------------------------------------
# Our metrics.jsonl -> per-step records


ENGINE_GEN_S = re.compile(r"gen/engine\d+_s")  # one engine's own seconds for a step's generation


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
        samples = m.get("response/count", completions_per_step)  # partial rollouts: more when groups are due
        gen_tokens = float(m["response_len/mean"]) * samples
        out.append({
            "step": step, "step_s": m["timing/step_s"], "generate_s": m.get("timing/generate_s", 0.0),
            "sync_s": m.get("timing/sync_s", 0.0), "reward_s": m.get("timing/reward_s", 0.0),
            "train_s": m.get("timing/train_s", 0.0), "gen_tokens": gen_tokens,
            "train_tokens": float(prompt_tokens[step]) * samples / completions_per_step + gen_tokens,
            "samples": samples, "reward_mean": m["reward/mean"],
            "response_len_mean": m["response_len/mean"], "learner_peak_gib": m.get("memory/learner_peak_gib"),
            "mfu": m.get("perf/mfu"),
            "staleness": m.get("async/staleness", 0.0),
            "engine_s": max((v for k, v in m.items() if ENGINE_GEN_S.fullmatch(k)), default=None),
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
            "learner_peak_gib": m.get("memory/learner_peak_gib"), "mfu": m.get("perf/mfu"),
        })
    return out


# ---------------------------------------------------------------------------------------------
# nvidia-smi, per GPU


def parse_gpu_query(text: str, unit: float = 1024) -> dict[str, float]:
    """`nvidia-smi --query-gpu=index,<field> --format=csv,noheader,nounits` -> index -> value / unit
    (MiB -> GiB by default); lines without a number (`[N/A]`) are left out."""
    out = {}
    for line in text.splitlines():
        index, _, value = (x.strip() for x in line.partition(","))
        try:
            out[index] = float(value) / unit
        except ValueError:
            continue
    return out


def merge_peaks(peaks: dict[str, float], sample: dict[str, float], watched: Iterable[str] | None) -> dict[str, float]:
    """`peaks` raised to one sample of `parse_gpu_query`, for the GPUs in `watched` (None: all)."""
    watched = sample if watched is None else watched
    return {**peaks, **{i: max(peaks.get(i, 0.0), sample[i]) for i in watched if i in sample}}


# ---------------------------------------------------------------------------------------------
# Summaries


def steady(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that count for timing: all but step 0 (all of them if there is only one); where
    generation ran ahead of the loop (a step with `staleness` > 0, asynchronous GRPO), the last step
    too, when two are left: no next generation overlaps its training, so it is shorter than the rest."""
    timed = list(steps[1:]) if len(steps) > 1 else list(steps)
    ahead = any(s.get("staleness") for s in steps)
    return timed[:-1] if ahead and len(timed) > 1 else timed


def generation_seconds(step: dict[str, Any]) -> float:
    """A step's generation time for its tokens/s: the loop's wait, or where generation ran ahead of
    the loop (`staleness` > 0, the wait is near 0) the slowest engine's own seconds."""
    return step["engine_s"] if step.get("staleness") and step.get("engine_s") else step["generate_s"]


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _rate(num: float, den: float) -> float | None:
    return num / den if den and den > 0 else None


def micro_batch_text(side: dict[str, Any]) -> str | None:
    """A side's learner micro-batch: TRL's per-device batch x accumulation (`trl_config`), ours in
    sequences or as a token budget (`memory_keys`, from the run's resolved config)."""
    trl, ours = side.get("trl_config") or {}, side.get("memory_keys") or {}
    if "per_device_train_batch_size" in trl:
        return f"{trl['per_device_train_batch_size']} x {trl['gradient_accumulation_steps']} accumulated"
    if ours.get("learner.max_tokens_per_micro_batch"):
        return f"<= {ours['learner.max_tokens_per_micro_batch']} tokens"
    return str(ours["learner.micro_batch_size"]) if ours.get("learner.micro_batch_size") else None


def summarize(side: dict[str, Any], algorithm: str) -> dict[str, Any]:
    """Table values of one side record (`steps`, `startup_s`, `peak_mem_gib`, `peak_gpu_gib`,
    `gpus`, `cpus`, and `micro_batch_text`'s keys)."""
    steps = side.get("steps") or []
    timed = steady(steps)
    out: dict[str, Any] = {
        "startup_s": side.get("startup_s"),
        "peak_mem_gib": side.get("peak_mem_gib"),
        "peak_gpu_gib": side.get("peak_gpu_gib"),
        "gpus": ",".join(side.get("gpus") or []) or None,
        "cpus": side.get("cpus"),
        "micro_batch": micro_batch_text(side),
        "steps": len(steps),
        "step_s": _median([s["step_s"] for s in timed]),
        "train_s": _median([s.get("train_s") for s in timed]),
        "train_tokens_per_s": _median([_rate(s.get("train_tokens", 0.0), s.get("train_s")) for s in timed]),
        "mfu": _median([s.get("mfu") for s in timed]),
        "mfu_min": min((s["mfu"] for s in timed if s.get("mfu") is not None), default=None),
        "gpu_busy": busy_share(side.get("gpu_busy_samples") or [], side.get("startup_s")),
    }
    if algorithm == "grpo":
        out.update(
            generate_s=_median([s["generate_s"] for s in timed]),
            samples_per_s=_median([_rate(s["samples"], s["step_s"]) for s in timed if "samples" in s]),
            gen_tokens_per_s=_median([_rate(s["gen_tokens"], generation_seconds(s)) for s in timed]),
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


def busy_share(samples: Sequence[Sequence[float]], startup_s: float | None) -> float | None:
    """The mean of (seconds since launch, utilization 0..1) samples taken after start-up: the share of
    the steps' time a kernel ran on the side's GPUs (None without samples or start-up time)."""
    after = [u for t, u in samples if startup_s is not None and t >= startup_s]
    return sum(after) / len(after) if after else None


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


def base_side(side: str) -> str:
    """The side `side` is compared with: `ours-tuned` for the tuned row, else `ours`."""
    return f"ours{TUNED}" if side.endswith(TUNED) else "ours"


def format_table(summaries: dict[str, dict[str, Any]], algorithm: str, *, errors: dict[str, str] | None = None,
                 base: str = "ours") -> str:
    """A markdown table: one row per metric, a column per side, and `<base>/<side>` after each
    other side. `summaries` must hold `base` first; per-step curves follow as extra rows."""
    rows = GRPO_ROWS if algorithm == "grpo" else DPO_ROWS
    others = [s for s in summaries if s != base]
    header = ["metric", base]
    for s in others:
        header += [s, f"{base}/{s}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ours = summaries.get(base, {})
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
               "schedule", "sides", "summary", "ratios", "notes")


def build_record(*, workload: dict[str, Any], time: str, command: str, git: dict[str, Any],
                 machine: dict[str, Any], versions: dict[str, str], env: dict[str, str], overrides: list[str],
                 sides: dict[str, dict[str, Any]], notes: list[str], schedule: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """One line of benchmarks/results/<workload>.jsonl: where, what, how the sides were scheduled
    (`schedule`: concurrent or not, each wave's GPUs), every side's per-step records, and the
    table's values with ratios <base>/<side> (`base_side`)."""
    algorithm = workload["algorithm"]
    summary = {name: summarize(side, algorithm) for name, side in sides.items() if side.get("steps")}
    ratio = {name: ratios(summary[base_side(name)], s, algorithm) for name, s in summary.items()
             if name != base_side(name) and base_side(name) in summary}
    return {"workload": workload["name"], "time": time, "command": command, "git": git, "machine": machine,
            "versions": versions, "env": env, "spec": workload, "overrides": overrides, "schedule": schedule,
            "sides": sides, "summary": summary, "ratios": ratio, "notes": notes}


# ---------------------------------------------------------------------------------------------
# Scheduling and reporting


def waves(needs: dict[str, int], gpus: list[str], parallel: bool) -> list[dict[str, list[str]]]:
    """The sides in waves, each with its GPUs (`needs`: how many a side takes). With `parallel` and
    two or more GPUs, a wave holds as many sides as have disjoint GPUs, first fit in order;
    otherwise one side a wave. A side gets its first free GPUs, all of them if it needs more."""
    out, pending = [], list(needs)
    while pending:
        free, wave = list(gpus), {}
        for side in list(pending):
            n = min(needs[side], len(gpus))
            if wave and (not parallel or len(gpus) < 2 or n > len(free)):
                continue
            wave[side], free = free[:n], free[n:]
            pending.remove(side)
        out.append(wave)
    return out


def out_of_memory(record: dict[str, Any]) -> bool:
    """Whether a side died of CUDA out-of-memory (its exception, or the log tail in its error)."""
    text = f"{record.get('error') or ''}\n{record.get('traceback') or ''}"
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


def latest_side_records(records: Sequence[dict[str, Any]], sides: Sequence[str]
                        ) -> tuple[dict[str, dict[str, Any]], list[str], list[str], dict[str, Any]]:
    """The latest record of each side with steps among a results file's `records`: (side records,
    the overrides of the first found, notes naming the runs they come from, the newest of those runs).
    The newest run's machine, versions and commit describe the combination, not the machine that
    combines (sides are usually combined away from the GPU host they ran on)."""
    found: dict[str, dict[str, Any]] = {}
    overrides: list[str] = []
    notes = []
    newest: dict[str, Any] = {}
    for side in sides:
        rec = next((r for r in reversed(records) if r["sides"].get(side, {}).get("steps")), None)
        if rec is None:
            continue
        found[side] = rec["sides"][side]
        overrides = overrides or rec["overrides"]
        newest = max(newest, rec, key=lambda r: r.get("time", ""))
        notes.append(f"{side} from the run of {rec['time']} (commit {rec['git']['commit'][:10]}, "
                     f"load {rec['machine'].get('load_avg_1_5_15')})")
    return found, overrides, notes, newest


PHASES = (("generate_s", "generate"), ("train_s", "train"), ("sync_s", "weight sync"), ("reward_s", "reward"))


def plot_step_phases(summaries: dict[str, dict[str, Any]], out: Path, title: str) -> Path | None:
    """A GRPO record's sides as horizontal bars of their median step, split into the median phases
    (`PHASES`) and the rest ("other": the step's median less the phases' medians, never below 0),
    each bar labelled with its step seconds; None when no side has a step time."""
    sides = [name for name, s in summaries.items() if s.get("step_s")]
    if not sides:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.6 * len(sides)))
    left = [0.0] * len(sides)
    parts = [*PHASES, ("other", "other")]
    for key, label in parts:
        if key == "other":
            widths = [max(0.0, summaries[n]["step_s"] - sum(summaries[n].get(k) or 0.0 for k, _ in PHASES))
                      for n in sides]
        else:
            widths = [summaries[n].get(key) or 0.0 for n in sides]
        ax.barh(sides, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    for y, name in enumerate(sides):
        ax.annotate(f"{summaries[name]['step_s']:.1f} s", (left[y], y), xytext=(4, -3),
                    textcoords="offset points", fontsize=8)
    ax.invert_yaxis()  # sides top to bottom in the record's order
    ax.set(xlabel="median step s, steps 1..N-1", title=title, xlim=(0, max(left) * 1.15))
    below = -0.12 - 0.45 / len(sides)  # under the x label, whatever the bars' count
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, below), fontsize=8, ncol=len(parts))
    ax.grid(axis="x", alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def report_text(record: dict[str, Any]) -> str:
    """A record as the runner prints it: the table of `ours` and the TRL sides, the tuned row's
    table, the in-loop generation efficiency (with ours-gen), failures and notes."""
    summary, algorithm, out = record["summary"], record["spec"]["algorithm"], []
    errors = {s: (r.get("error") or "failed").strip().splitlines()[-1]
              for s, r in record["sides"].items() if not r.get("ok")}
    for base in ("ours", f"ours{TUNED}"):
        ran = [s for s in record["sides"] if base_side(s) == base]
        if not ran:
            continue
        if base != "ours":
            out.append("\ntuned row: ours under memory.plan=auto, TRL at the largest per-device batch that fits "
                       "(same samples per step)")
        names = [base, *(s for s in ran if s not in (base, "ours-gen"))]
        out.append(format_table({s: summary[s] for s in names if s in summary}, algorithm, base=base,
                                errors={s: e for s, e in errors.items() if base_side(s) == base}))
    gen, ours = summary.get("ours-gen"), summary.get("ours")
    if gen and ours and gen.get("gen_tokens_per_s") and ours.get("gen_tokens_per_s"):
        loop, alone = ours["gen_tokens_per_s"], gen["gen_tokens_per_s"]
        out.append(f"\nstandalone generation (our VLLMGenerator on step 0's batch): {alone:,.0f} tokens/s; in the "
                   f"loop {loop:,.0f} tokens/s: generation efficiency {loop / alone:.2f}")
    schedule = record.get("schedule") or {}
    if schedule.get("concurrent"):
        out.append("\nsides ran at the same time, each on its own GPUs: " + " | then ".join(
            ", ".join(f"{s} on GPU {','.join(g)}" for s, g in wave.items()) for wave in schedule["waves"]))
    out += [f"note: {note}" for note in record["notes"]]
    return "\n".join(out)


def last_line(text: str | None) -> str:
    """The last non-blank line of a failed run's log tail."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "failed"


def usable(run: dict[str, Any]) -> bool:
    """Whether a side's (or scale layout's) run counts: it finished, or it was stopped (its time limit,
    `--deadline`) after at least one step past step 0, whose figures then stand for it (`stopped_line`)."""
    return bool(run.get("ok")) or len(run.get("steps") or []) >= 2


def stopped_line(name: str, run: dict[str, Any], planned: int) -> str:
    """One line under the table for a side or layout that was stopped but counts (`usable`)."""
    done = len(run["steps"])
    why = f"at its {run['timeout_s']:.0f} s limit" if run.get("timed_out") else f"({last_line(run.get('error'))})"
    return f"{name} was stopped {why} after {done} of {planned} steps: its figures are steps 1-{done - 1}"
