"""Our GRPO run over 1, 2, 4 (and 8) GPUs of one host, one run per cluster layout: one table, one plot.

    bash benchmarks/gpu_scale.sh                                   # the colocated line that fits the GPUs
    .venv/bin/python benchmarks/scale.py --layouts 1gpu,4gpu-split-zero2 --model outputs/bench/models/random-qwen2.5-1.5b
    .venv/bin/python benchmarks/scale.py --prompts 256             # strong scaling: the same 256 x 8 step everywhere
    .venv/bin/python benchmarks/scale.py --weak 64                 # weak scaling: 64 prompts per GPU
    .venv/bin/python benchmarks/scale.py --engines-per-gpu 2       # two engines on each GPU that generates
    .venv/bin/python benchmarks/scale.py --engines-per-gpu 2 --mps # ... their kernels side by side (CUDA MPS)
    .venv/bin/python benchmarks/scale.py --tiny --layouts 1gpu,2gpu-fsdp2 --steps 2   # the code path, on CPU
    bash benchmarks/gpu_scale.sh --prompts 256 --deadline 520      # a record in 520 s, whatever finished

Layouts (`LAYOUTS`), each a run of scripts/train_grpo.py on the `grpo-gpu-scale` workload: colocated
(an engine and a learner rank per GPU: FSDP2, ZeRO-2, ZeRO-3) and split (some GPUs generate, the
others learn: the seeds' layout, and its asynchronous variant). Without `--layouts`, the colocated
FSDP2 line (`DEFAULT_LAYOUTS`) that fits the visible GPUs.

Layouts that need disjoint GPUs run at the same time (`summary.waves`, first fit in the order
given; `--in-turn` runs one at a time), each process seeing only its own GPUs
(CUDA_VISIBLE_DEVICES), so the one-GPU baseline is measured on the same host in the same run. On
CPU (`--tiny`) the GPU count means nothing: layouts run in turn, with the engine count that `auto`
gives on GPUs passed explicitly, so the code path is the same.

Output: a markdown table, one column per layout (rows: `SCALE_ROWS`), the target lines
(`target_lines`), a PNG of samples/s against GPUs with the ideal line (`--plot`), and one JSON
line appended to `<results>/<workload>.jsonl` (machine, versions, commit, the layouts and their
GPUs, every layout's per-step records, the summary). Running, memory sampling and per-step
conversion are benchmarks/run.py's and benchmarks/summary.py's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from benchmarks.mps import mps_daemon  # noqa: E402
from benchmarks.run import (  # noqa: E402
    BENCH_ENV,
    MIN_SIDE_S,
    PYTHON,
    failure_lines,
    git_info,
    keep_side,
    machine_info,
    prepare_model,
    run_ours,
    run_waves,
    side_env,
    step_prompt_tokens,
    versions,
    visible_gpus,
)
from benchmarks.summary import (  # noqa: E402
    ENGINE_GEN_S,
    format_value,
    last_line,
    ours_grpo_steps,
    steady,
    stopped_line,
    summarize,
    usable,
    waves,
)
from benchmarks.workloads import WORKLOADS, Workload, our_overrides  # noqa: E402

WORKLOAD = "grpo-gpu-scale"
BASELINE = "1gpu"
SPEEDUP_TARGETS = {2: 1.8, 4: 3.4}  # samples/s against 1 GPU's, on the same work
WEAK_TARGET = 0.9  # weak scaling: samples/s per GPU against 1 GPU's
SYNC_TARGET_S = 0.3


@dataclass(frozen=True)
class Layout:
    """One cluster layout: the GPUs it takes and the overrides that make it."""

    gpus: int
    engines: int
    """What `cluster.generator_engines=auto` resolves to on `gpus` GPUs; passed explicitly on CPU."""
    overrides: tuple[str, ...]

    @property
    def colocated(self) -> bool:
        return "cluster.placement=colocated" in self.overrides


def _learner(backend: str, zero_stage: int) -> tuple[str, ...]:
    """A layout's learner keys: its backend, and for DeepSpeed its stage and no FSDP2-only cast
    (`cast_once_per_step`, which the workload's `LEARNER_KERNELS` turn on and config validation
    refuses with DeepSpeed)."""
    if backend != "deepspeed":
        return (f"learner.backend={backend}",)
    return (f"learner.backend={backend}", f"learner.zero_stage={zero_stage}", "learner.cast_once_per_step=false")


def _colocated(gpus: int, backend: str = "fsdp2", zero_stage: int = 0) -> Layout:
    """An engine and a learner rank on every GPU."""
    return Layout(gpus, gpus, ("cluster.placement=colocated", f"learner.num_ranks={gpus}",
                               *_learner(backend, zero_stage)))


def _split(gpus: int, engines: int, backend: str = "fsdp2", zero_stage: int = 0, staleness: int = 0) -> Layout:
    """`engines` GPUs generate, the others learn; `staleness` > 0: asynchronous GRPO."""
    extra = (f"grpo.max_staleness={staleness}",) if staleness else ()
    return Layout(gpus, engines, ("cluster.placement=split", f"cluster.generator_engines={engines}",
                                  f"learner.num_ranks={gpus - engines}", *_learner(backend, zero_stage), *extra))


LAYOUTS: dict[str, Layout] = {
    "1gpu": _colocated(1),
    "2gpu-fsdp2": _colocated(2),
    "2gpu-zero2": _colocated(2, "deepspeed", 2),
    "2gpu-split": _split(2, 1),
    "2gpu-split-async": _split(2, 1, staleness=1),
    "4gpu-fsdp2": _colocated(4),
    "4gpu-zero2": _colocated(4, "deepspeed", 2),
    "4gpu-zero3": _colocated(4, "deepspeed", 3),
    "4gpu-split-zero2": _split(4, 1, "deepspeed", 2),  # the seeds' layout on 4 GPUs
    "4gpu-split-zero2-async": _split(4, 1, "deepspeed", 2, staleness=1),
    "4gpu-split-fsdp2": _split(4, 2),
    "4gpu-split-fsdp2-async": _split(4, 2, staleness=1),
    "8gpu-fsdp2": _colocated(8),
    "8gpu-split-zero2": _split(8, 1, "deepspeed", 2),
    "8gpu-split-zero3": _split(8, 1, "deepspeed", 3),
}
DEFAULT_LAYOUTS = ("1gpu", "2gpu-fsdp2", "4gpu-fsdp2", "8gpu-fsdp2")

SCALE_ROWS: tuple[tuple[str, str], ...] = (
    # (summary key, table label)
    ("gpus", "GPUs"),
    ("engines", "engines"),
    ("learners", "learner ranks, backend"),
    ("step_s", "median step s, steps 1..N-1"),
    ("generate_s", "median generate s"),
    ("train_s", "median train s"),
    ("mfu", "learner MFU (perf/mfu), median of steps 1..N-1"),
    ("sync_s", "median weight sync s"),
    ("sync_engine_max_s", "max engine sync s (sync/engine*_s)"),
    ("samples_per_s", "samples/s: prompts x group / step s"),
    ("samples_per_s_per_gpu", "samples/s per GPU"),
    ("speedup", f"speedup vs {BASELINE} (samples/s)"),
    ("gen_tokens_per_s", "generation tokens/s"),
    ("engine_time_ratio", "engine time ratio, slowest/fastest"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi, busiest GPU of the layout"),
    ("learner_peak_gib", "learner peak GiB, max over ranks"),
    ("peak_mem_gib", "peak host memory GiB, process tree PSS"),
    ("reward_mean", "mean reward, all steps"),
)

_CLUSTER_LINE = re.compile(r"cluster: (\w+), (\d+) engine\(s\) x TP (\d+), (\d+) (\w+) learner rank\(s\)")
_ENGINE_SYNC_S = re.compile(r"sync/engine\d+_s")


# ---------------------------------------------------------------------------------------------
# Pure parts: plain data in, plain data out (tests/unit/test_benchmarks.py)


def parse_cluster_line(log_text: str) -> dict[str, Any] | None:
    """The training script's `cluster: ...` line -> placement, engines, TP, ranks, backend
    (None when the run died before printing it)."""
    m = _CLUSTER_LINE.search(log_text)
    if m is None:
        return None
    placement, engines, tp, ranks, backend = m.groups()
    return {"placement": placement, "engines": int(engines), "tp": int(tp), "ranks": int(ranks),
            "backend": backend}


def layout_steps(metrics: Sequence[dict[str, Any]], prompt_tokens: Sequence[int], completions_per_step: int
                 ) -> list[dict[str, Any]]:
    """`summary.ours_grpo_steps` records plus the per-engine figures of each step: `engines`
    (engines that generated), `engine_time_ratio` and `sync_engine_max_s` (the slowest engine's
    weight load)."""
    timed = [m for m in metrics if "timing/step_s" in m]
    steps = ours_grpo_steps(timed, prompt_tokens, completions_per_step)
    for step, m in zip(steps, timed):
        syncs = [v for k, v in m.items() if _ENGINE_SYNC_S.fullmatch(k)]
        step.update(engines=sum(1 for k in m if ENGINE_GEN_S.fullmatch(k)),
                    engine_time_ratio=m.get("gen/engine_time_ratio"),
                    sync_engine_max_s=max(syncs) if syncs else None)
    return steps


def _learners(cluster: dict[str, Any]) -> str:
    """'2 fsdp2', '2 deepspeed ZeRO-2'."""
    backend = cluster["backend"]
    if backend == "deepspeed" and cluster.get("zero_stage"):
        backend += f" ZeRO-{cluster['zero_stage']}"
    return f"{cluster['ranks']} {backend}"


def summarize_layout(run: dict[str, Any], *, gpus: int, samples_per_step: int) -> dict[str, Any]:
    """Table values of one layout's run record (`steps` from `layout_steps`, `cluster`, and
    launch()'s `peak_mem_gib`/`peak_gpu_gib`). Timings are medians of steps 1..N-1
    (`summary.steady`); the engine sync is the slowest engine of any of those steps."""
    steps = run.get("steps") or []
    timed = steady(steps)
    out = summarize(run, "grpo")
    cluster = run.get("cluster")
    step_s = out["step_s"]
    syncs = [s["sync_engine_max_s"] for s in timed if s.get("sync_engine_max_s") is not None]
    ratios = [s["engine_time_ratio"] for s in timed if s.get("engine_time_ratio") is not None]
    samples_per_s = samples_per_step / step_s if step_s else None
    out.update(
        gpus=gpus,
        engines=cluster["engines"] if cluster else max((s.get("engines", 0) for s in steps), default=None),
        learners=_learners(cluster) if cluster else None,
        sync_engine_max_s=max(syncs) if syncs else None,
        engine_time_ratio=statistics.median(ratios) if ratios else None,
        learner_peak_gib=max((s["learner_peak_gib"] for s in steps if s.get("learner_peak_gib") is not None),
                             default=None),
        samples_per_s=samples_per_s,
        samples_per_s_per_gpu=samples_per_s / gpus if samples_per_s else None,
    )
    return out


def fastest_first(schedule: list[dict[str, list[str]]]) -> list[dict[str, list[str]]]:
    """The waves ordered for a `--deadline`: the wave whose smallest layout has the most GPUs (the
    shortest steps) first, the one-GPU baseline's last. Each wave's share is taken from the time
    left, so what the fast waves leave unused goes to the slow one, whose steps need it."""
    return sorted(schedule, key=lambda wave: -min(len(g) for g in wave.values()))


def with_speedups(summaries: dict[str, dict[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Each summary plus `speedup`: its samples/s over the baseline layout's (None without one)."""
    base = summaries.get(baseline, {}).get("samples_per_s")
    return {name: {**s, "speedup": s["samples_per_s"] / base if base and s.get("samples_per_s") else None}
            for name, s in summaries.items()}


def target_lines(summaries: dict[str, dict[str, Any]], weak: bool = False) -> list[str]:
    """The issue's targets, measured: per GPU count, the best layout's speedup over 1 GPU (the same
    work: `SPEEDUP_TARGETS`) or, with `weak` (prompts per GPU fixed), its samples/s per GPU against
    1 GPU's (`WEAK_TARGET`); and the worst median sync."""
    lines = []
    base = summaries.get(BASELINE, {})
    for gpus, target in SPEEDUP_TARGETS.items():
        ran = {n: s for n, s in summaries.items() if s.get("gpus") == gpus and s.get("speedup") is not None}
        if not ran:
            lines.append(f"{gpus} GPUs vs 1: not measured (needs {BASELINE} and a {gpus}-GPU layout that ran)")
            continue
        best = max(ran, key=lambda n: ran[n]["speedup"])
        if weak:
            share = ran[best]["samples_per_s_per_gpu"] / base["samples_per_s_per_gpu"]
            lines.append(f"{gpus} GPUs vs 1, weak: {best} keeps {share:.0%} of 1 GPU's samples/s per GPU "
                         f"(target >= {WEAK_TARGET:.0%}): {'met' if share >= WEAK_TARGET else 'missed'}")
        else:
            x = ran[best]["speedup"]
            lines.append(f"{gpus} GPUs vs 1: best {gpus}-GPU layout {best} gives {x:.2f}x samples/s "
                         f"(target >= {target}x): {'met' if x >= target else 'missed'}")
    synced = {n: s["sync_s"] for n, s in summaries.items() if s.get("sync_s") is not None}
    if synced:
        worst = max(synced, key=synced.__getitem__)
        verdict = "met" if synced[worst] <= SYNC_TARGET_S else "missed"
        lines.append(f"sync: max {synced[worst]:.2f} s (target <= {SYNC_TARGET_S} s): {verdict} "
                     f"(median of steps 1..N-1, layout {worst})")
    else:
        lines.append("sync: not measured (no layout ran)")
    return lines


def plot_scaling(summaries: dict[str, dict[str, Any]], out: Path, title: str) -> Path | None:
    """samples/s against GPUs, one point per layout that ran, and the ideal line (1 GPU's samples/s
    times the GPUs); None when nothing ran."""
    points = [(s["gpus"], s["samples_per_s"], n) for n, s in summaries.items() if s.get("samples_per_s")]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    base = summaries.get(BASELINE, {}).get("samples_per_s")
    top = max(g for g, _, _ in points)
    if base:
        ax.plot([1, top], [base, base * top], "--", color="grey", label="ideal (1 GPU x GPUs)")
    for gpus, rate, name in sorted(points):
        ax.plot(gpus, rate, "o")
        ax.annotate(name, (gpus, rate), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set(xlabel="GPUs", ylabel="samples/s (prompts x group / step s)", title=title)
    ax.set_xticks(sorted({g for g, _, _ in points} | {1}))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def format_scale_table(layouts: Sequence[str], summaries: dict[str, dict[str, Any]], errors: dict[str, str]
                       ) -> str:
    """A markdown table, one row per metric and one column per layout, in `layouts` order; a
    layout in `errors` shows `failed` in every cell and its last log line below the table."""
    lines = ["| metric | " + " | ".join(layouts) + " |", "|" + "---|" * (len(layouts) + 1)]
    for key, label in SCALE_ROWS:
        if all(summaries.get(n, {}).get(key) is None for n in layouts if n not in errors):
            continue
        cells = ["failed" if n in errors else format_value(summaries.get(n, {}).get(key)) for n in layouts]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [f"\n{name} failed: {error}" for name, error in errors.items()]
    return "\n".join(lines)


SCALE_RECORD_KEYS = ("workload", "time", "command", "git", "machine", "versions", "env", "spec", "overrides",
                     "layouts", "sides", "summary", "targets", "notes", "scaling", "schedule")


def build_scale_record(*, workload: dict[str, Any], time: str, command: str, git: dict[str, Any],
                       machine: dict[str, Any], versions: dict[str, str], env: dict[str, str],
                       overrides: list[str], layouts: dict[str, dict[str, Any]], sides: dict[str, dict[str, Any]],
                       notes: list[str], weak: bool = False, schedule: list[dict[str, list[str]]] | None = None
                       ) -> dict[str, Any]:
    """One line of <results>/<workload>.jsonl, in the style of `summary.build_record`: `layouts`
    holds each layout's GPU count, CUDA devices, prompts per step and overrides, `sides` each layout's
    run record with its per-step records, `summary` the table's values of the layouts that ran,
    `targets` the target lines, `schedule` the waves the layouts ran in."""
    def samples(name: str) -> int:
        return layouts[name].get("prompts_per_step", workload["prompts_per_step"]) * workload["group_size"]

    summary = with_speedups({name: summarize_layout(side, gpus=layouts[name]["gpus"], samples_per_step=samples(name))
                             for name, side in sides.items() if usable(side)})
    return {"workload": workload["name"], "time": time, "command": command, "git": git, "machine": machine,
            "versions": versions, "env": env, "spec": workload, "overrides": overrides, "layouts": layouts,
            "sides": sides, "summary": summary, "targets": target_lines(summary, weak), "notes": notes,
            "scaling": "weak" if weak else "strong", "schedule": schedule}


# ---------------------------------------------------------------------------------------------
# Running


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=_layout_list,
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (default: those of {', '.join(DEFAULT_LAYOUTS)} "
                        "that fit the visible GPUs)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--prompts", type=int, help="prompts per step on every layout (strong scaling; default: the "
                                                  "workload's)")
    size.add_argument("--weak", type=int, metavar="P", help="P prompts per step per GPU (weak scaling)")
    p.add_argument("--engines-per-gpu", type=int, default=1, metavar="K",
                   help="K vLLM engine processes beside each learner rank (colocated) or on each generating "
                        "GPU (split; default: 1)")
    p.add_argument("--mps", action="store_true",
                   help="each layout under a CUDA MPS daemon of its own (benchmarks/mps.py): engines sharing a "
                        "GPU run their kernels side by side")
    p.add_argument("--in-turn", action="store_true", help="one layout at a time, even where GPUs are free")
    p.add_argument("--no-pin", action="store_true",
                   help="layouts at the same time keep every host core (default: each on its GPUs' share)")
    p.add_argument("--plot", help="PNG of samples/s against GPUs (default: <results>/<workload>.png)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the workload's)")
    p.add_argument("--model", help="a prebuilt model folder instead of building the workload's random model")
    p.add_argument("--tiny", action="store_true", help="tiny random model, few prompts and tokens (checks the path)")
    p.add_argument("--workdir", default="outputs/bench", help="run folders and logs (default: %(default)s)")
    p.add_argument("--results", default="benchmarks/results", help="JSON lines go here (default: %(default)s)")
    p.add_argument("--side-timeout", type=float, default=3600, help="seconds before a layout's run is stopped")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="seconds for the whole benchmark, the record included: each wave of layouts gets an "
                        "equal share of the time left, a layout stopped at its share still counts with the "
                        f"steps it finished, and a wave with under {MIN_SIDE_S:.0f} s left is not started")
    p.add_argument("--note", action="append", default=[], help="free text stored with the result (e.g. load)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of our recipe for every layout (repeatable), e.g. learner.fused_head=false")
    args = p.parse_args(argv)
    if args.engines_per_gpu < 1:
        p.error(f"--engines-per-gpu: an integer >= 1, got {args.engines_per_gpu}")
    return args


def name_list(text: str, known: Iterable[str], what: str) -> list[str]:
    """A comma-separated argument of names out of `known` (argparse's error otherwise)."""
    known = list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown) or '(none)'}; "
                                         f"known: {', '.join(known)}")
    return names


def _layout_list(text: str) -> list[str]:
    return name_list(text, LAYOUTS, "layout")


def layout_overrides(layout: Layout, *, on_gpu: bool, prompts: int | None = None, engines_per_gpu: int = 1
                     ) -> list[str]:
    """The layout's overrides; on CPU also its engine count (CPU `auto` would mean one engine);
    with `prompts`, the step's prompts; with `engines_per_gpu` K > 1, K engines beside each learner
    rank (colocated) or on each generating GPU (split: `cluster.engines_per_gpu`)."""
    named = not on_gpu or engines_per_gpu > 1
    engines = [f"cluster.generator_engines={layout.engines * engines_per_gpu}"] if named else []
    if engines_per_gpu > 1 and not layout.colocated:
        engines.append(f"cluster.engines_per_gpu={engines_per_gpu}")
    return [*layout.overrides, *engines, *([f"grpo.prompts_per_step={prompts}"] if prompts else [])]


def layout_prompts(args: argparse.Namespace, layout: Layout) -> int | None:
    """Prompts per step of a layout's run: `--prompts` on every layout, `--weak` per GPU, else the
    workload's (None)."""
    return args.weak * layout.gpus if args.weak else args.prompts


def run_cluster(side_dir: Path, log: str) -> dict[str, Any] | None:
    """The cluster line of a layout's log, plus the ZeRO stage from the run's resolved config."""
    cluster = parse_cluster_line(Path(log).read_text(errors="replace"))
    config = side_dir / "run" / "config.yaml"
    if cluster is not None and config.is_file():
        cluster["zero_stage"] = yaml.safe_load(config.read_text())["learner"]["zero_stage"]
    return cluster


def run_layout(w: Workload, name: str, side_dir: Path, env: dict[str, str], *, model_path: str | None,
               prompt_tokens: list[int], timeout: float, layout_keys: list[str], prompts: int | None = None
               ) -> dict[str, Any]:
    """One layout's run of our training script (`layout_keys`: its `layout_overrides`), with its
    per-step records and cluster line."""
    shutil.rmtree(side_dir, ignore_errors=True)
    overrides = [*our_overrides(w, output_dir=str(side_dir / "run"), model_path=model_path), *layout_keys]
    cores = f" on cores {env['BENCH_CPUS']}" if env.get("BENCH_CPUS") else ""
    print(f"[scale] {name}: running{cores} (log: {side_dir / 'log.txt'})", flush=True)
    run = run_ours(w, overrides, side_dir, env, timeout)
    run.update(side=name, timeout_s=timeout, overrides=overrides, cluster=run_cluster(side_dir, run["log"]),
               steps=layout_steps(run["metrics"], prompt_tokens, (prompts or w.prompts_per_step) * w.group_size))
    status = "ok" if run["ok"] else "STOPPED at its time limit" if run.get("timed_out") else "FAILED"
    if not run["ok"] and run["steps"]:
        status += f" after {len(run['steps'])} step(s)"
    print(f"[scale] {name}: {status} in {run['wall_s']:.0f} s", flush=True)
    if not run["ok"] and run.get("error"):  # why, where the call's output is all that comes back
        print(failure_lines(name, run["error"], tag="scale"), flush=True)
    return run


def resolve_workload(args: argparse.Namespace) -> Workload:
    w = WORKLOADS[WORKLOAD].tiny() if args.tiny else WORKLOADS[WORKLOAD]
    if args.steps:
        w = replace(w, steps=args.steps)
    if args.model:
        w = replace(w, model=args.model)
    if args.set:
        w = replace(w, extra=(*w.extra, *args.set))
    return w


def choose_layouts(asked: list[str] | None, gpus: int, on_gpu: bool) -> tuple[list[str], list[str]]:
    """(layouts to run, notes on those skipped): on CPU every one asked for (default: `DEFAULT_LAYOUTS`);
    on GPU those that fit the visible GPUs."""
    names = asked or list(DEFAULT_LAYOUTS)
    if not on_gpu:
        return names, []
    run = [n for n in names if LAYOUTS[n].gpus <= gpus]
    return run, [f"{n} skipped: needs {LAYOUTS[n].gpus} GPUs, {gpus} visible" for n in names if n not in run]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = resolve_workload(args)
    env = {**os.environ, **BENCH_ENV}
    gpus = visible_gpus(env)
    if w.device == "cuda" and not gpus:
        raise SystemExit(f"{w.name} needs CUDA GPUs and none are visible; --tiny runs the same layouts on CPU")
    names, notes = choose_layouts(args.layouts, len(gpus), on_gpu=bool(gpus))
    prompts = {n: layout_prompts(args, LAYOUTS[n]) for n in names}
    keys = {n: layout_overrides(LAYOUTS[n], on_gpu=bool(gpus), prompts=prompts[n],
                                engines_per_gpu=args.engines_per_gpu) for n in names}
    notes += args.note
    if args.mps:
        if not gpus:
            raise SystemExit("scale.py: --mps needs CUDA GPUs (MPS shares a GPU between processes)")
        notes.append("CUDA MPS: a control daemon per layout, on its GPUs")
    if args.engines_per_gpu > 1:
        notes.append(f"{args.engines_per_gpu} engines beside each learner rank (colocated) or on each generating "
                     f"GPU (split: cluster.engines_per_gpu={args.engines_per_gpu})")
    if not gpus:
        notes.append("CPU: GPUs are nominal (every layout shares the host's cores); engines passed explicitly")
    for note in notes:
        print(f"[scale] {note}", flush=True)
    workdir = (REPO / args.workdir).resolve()
    results_path = REPO / args.results / f"{w.name}.jsonl"
    print(f"[scale] {w.name}: {w.description} | layouts: {', '.join(names) or '(none)'}", flush=True)
    model_path = prepare_model(w, workdir)
    # Every layout's run folder differs; the rest of the workload's overrides is common.
    common = our_overrides(w, output_dir=str(workdir / w.name), model_path=model_path)
    prompt_tokens = step_prompt_tokens(w, common)
    schedule = waves({n: LAYOUTS[n].gpus for n in names}, gpus, parallel=not args.in_turn)
    if args.deadline is not None and gpus:
        schedule = fastest_first(schedule)
    if any(len(wave) > 1 for wave in schedule):
        print("[scale] waves: " + " | then ".join(", ".join(f"{n} on GPU {','.join(g)}" for n, g in wave.items())
                                                 for wave in schedule), flush=True)

    # --deadline: each wave may take an equal share of the time left (what one leaves unused passes on
    # to the waves after it, the slowest last: `fastest_first`).
    end = None if args.deadline is None else time.monotonic() + args.deadline

    def run(name: str, devices: list[str], pin: bool, timeout: float) -> dict[str, Any]:
        layout_env = side_env(env, devices, pin=pin) if gpus else env
        with mps_daemon(layout_env) if args.mps else nullcontext(layout_env) as layout_env:
            result = run_layout(w, name, workdir / w.name / name, layout_env, model_path=model_path,
                                prompt_tokens=prompt_tokens, timeout=timeout, layout_keys=keys[name],
                                prompts=prompts[name])
        keep_side(results_path, keys[name], result)  # kept at once: a call stopped later still has it
        return result

    sides = run_waves(schedule, run, args, end, tag="scale")
    devices = {n: g for wave in schedule for n, g in wave.items()}
    record = build_scale_record(
        workload=w.to_dict(), time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=shlex.join([Path(PYTHON).name, "benchmarks/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        git=git_info(), machine=machine_info(), versions=versions(),
        env={k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env},
        overrides=[o for o in common if not o.startswith("output_dir=")],
        layouts={n: {"gpus": LAYOUTS[n].gpus, "devices": devices[n],
                     "prompts_per_step": prompts[n] or w.prompts_per_step, "overrides": keys[n]}
                 for n in names},
        sides={n: sides[n] for n in names}, notes=notes, weak=bool(args.weak), schedule=schedule)
    plot = Path(args.plot) if args.plot else results_path.with_suffix(".png")
    report(names, record, results_path, plot)
    return 0 if sides and all(s["ok"] for s in sides.values()) else 1


def report(names: list[str], record: dict[str, Any], path: Path, plot: Path) -> None:
    """Print the table and the target lines; append the record to `path`; the scaling plot to `plot`."""
    errors = {n: last_line(s.get("error")) for n, s in record["sides"].items() if not usable(s)}
    print()
    print(format_scale_table(names, record["summary"], errors))
    for name, side in record["sides"].items():
        if usable(side) and not side.get("ok"):
            print(stopped_line(name, side, record["spec"]["steps"]))
    print()
    for line in record["targets"]:
        print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print(f"\n[scale] appended to {path}")
    drawn = plot_scaling(record["summary"], plot, f"{record['workload']}, {record['scaling']} scaling")
    if drawn is not None:
        print(f"[scale] plot: {drawn}")


if __name__ == "__main__":
    sys.exit(main())
