"""Our GRPO run on 1 and 2 GPUs, one cluster layout after the other, on the same work: one table.

    bash benchmarks/gpu_scale.sh                                   # every layout the GPUs allow (2-GPU machine)
    .venv/bin/python benchmarks/scale.py --layouts 1gpu,2gpu-split --model outputs/bench/models/random-qwen2.5-1.5b
    .venv/bin/python benchmarks/scale.py --tiny --layouts 1gpu,2gpu-fsdp2 --steps 2   # the code path, on CPU

Layouts (LAYOUTS), each a run of scripts/train_grpo.py on the `grpo-gpu-scale` workload:
  1gpu         colocated, 1 engine + 1 FSDP2 rank on one GPU
  2gpu-fsdp2   colocated, 2 engines + 2 FSDP2 ranks (one of each per GPU)
  2gpu-zero2   colocated, 2 engines + 2 DeepSpeed ZeRO-2 ranks
  2gpu-split   split, 1 engine on GPU 0, 1 FSDP2 rank on GPU 1 (NCCL weight sync)

On a GPU machine each layout's process sees only the GPUs it uses (CUDA_VISIBLE_DEVICES: the
first n of those this script sees) and `cluster.generator_engines` stays `auto`, so the run
resolves the engine count itself; layouts needing more GPUs than are visible are skipped. On CPU
(`--tiny`) the GPU count means nothing: every layout runs, with the engine count `auto` gives on
GPU passed explicitly (on CPU `auto` means one engine), so the code path is the same.

Output: a markdown table, one column per layout (rows: see `SCALE_ROWS`), the two target lines
of the issue (2 GPUs >= 1.8x the samples/s of 1; weight sync <= 0.3 s), and one JSON line
appended to `<results>/<workload>.jsonl` with the machine, versions, git commit, the workload,
the layouts, every layout's per-step records and the summary. The running, memory sampling and
per-step conversion are benchmarks/run.py's and benchmarks/summary.py's.
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from benchmarks.run import (  # noqa: E402
    BENCH_ENV,
    PYTHON,
    git_info,
    machine_info,
    prepare_model,
    run_ours,
    step_prompt_tokens,
    versions,
    visible_gpus,
)
from benchmarks.summary import format_value, ours_grpo_steps, steady, summarize  # noqa: E402
from benchmarks.workloads import WORKLOADS, Workload, our_overrides  # noqa: E402

WORKLOAD = "grpo-gpu-scale"
BASELINE = "1gpu"
SPEEDUP_TARGET = 1.8
SYNC_TARGET_S = 0.3


@dataclass(frozen=True)
class Layout:
    """One cluster layout: the GPUs it takes and the overrides that make it."""

    gpus: int
    engines: int
    """What `cluster.generator_engines=auto` resolves to on `gpus` GPUs; passed explicitly on CPU."""
    overrides: tuple[str, ...]


LAYOUTS: dict[str, Layout] = {
    "1gpu": Layout(1, 1, ("cluster.placement=colocated", "learner.num_ranks=1", "learner.backend=fsdp2")),
    "2gpu-fsdp2": Layout(2, 2, ("cluster.placement=colocated", "learner.num_ranks=2", "learner.backend=fsdp2")),
    "2gpu-zero2": Layout(2, 2, ("cluster.placement=colocated", "learner.num_ranks=2", "learner.backend=deepspeed",
                                "learner.zero_stage=2")),
    "2gpu-split": Layout(2, 1, ("cluster.placement=split", "learner.num_ranks=1", "learner.backend=fsdp2")),
}

SCALE_ROWS: tuple[tuple[str, str], ...] = (
    # (summary key, table label)
    ("gpus", "GPUs"),
    ("engines", "engines"),
    ("learners", "learner ranks, backend"),
    ("step_s", "median step s, steps 1..N-1"),
    ("generate_s", "median generate s"),
    ("train_s", "median train s"),
    ("sync_s", "median weight sync s"),
    ("sync_engine_max_s", "max engine sync s (sync/engine*_s)"),
    ("samples_per_s", "samples/s: prompts x group / step s"),
    ("samples_per_s_per_gpu", "samples/s per GPU"),
    ("speedup", f"speedup vs {BASELINE} (samples/s)"),
    ("gen_tokens_per_s", "generation tokens/s"),
    ("engine_time_ratio", "engine time ratio, slowest/fastest"),
    ("peak_gpu_gib", "peak GPU memory GiB, nvidia-smi, all GPUs"),
    ("learner_peak_gib", "learner peak GiB, max over ranks"),
    ("peak_mem_gib", "peak host memory GiB, process tree PSS"),
    ("reward_mean", "mean reward, all steps"),
)

_CLUSTER_LINE = re.compile(r"cluster: (\w+), (\d+) engine\(s\) x TP (\d+), (\d+) (\w+) learner rank\(s\)")
_ENGINE_GEN_S = re.compile(r"gen/engine\d+_s")
_ENGINE_SYNC_S = re.compile(r"sync/engine\d+_s")


# ---------------------------------------------------------------------------------------------
# Pure parts: plain data in, plain data out (tests/test_benchmarks.py)


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
        step.update(engines=sum(1 for k in m if _ENGINE_GEN_S.fullmatch(k)),
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


def with_speedups(summaries: dict[str, dict[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, Any]]:
    """Each summary plus `speedup`: its samples/s over the baseline layout's (None without one)."""
    base = summaries.get(baseline, {}).get("samples_per_s")
    return {name: {**s, "speedup": s["samples_per_s"] / base if base and s.get("samples_per_s") else None}
            for name, s in summaries.items()}


def target_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's two targets, measured: the best 2-GPU layout's speedup, the worst median sync."""
    two = {n: s for n, s in summaries.items() if s.get("gpus") == 2 and s.get("speedup") is not None}
    if two:
        best = max(two, key=lambda n: two[n]["speedup"])
        x = two[best]["speedup"]
        scale = (f"2 GPUs vs 1: best 2-GPU layout {best} gives {x:.2f}x samples/s (target >= {SPEEDUP_TARGET}x): "
                 f"{'met' if x >= SPEEDUP_TARGET else 'missed'}")
    else:
        scale = f"2 GPUs vs 1: not measured (needs {BASELINE} and a 2-GPU layout that ran)"
    synced = {n: s["sync_s"] for n, s in summaries.items() if s.get("sync_s") is not None}
    if synced:
        worst = max(synced, key=synced.__getitem__)
        verdict = "met" if synced[worst] <= SYNC_TARGET_S else "missed"
        sync = (f"sync: max {synced[worst]:.2f} s (target <= {SYNC_TARGET_S} s): {verdict} "
                f"(median of steps 1..N-1, layout {worst})")
    else:
        sync = "sync: not measured (no layout ran)"
    return [scale, sync]


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
                     "layouts", "sides", "summary", "targets", "notes")


def build_scale_record(*, workload: dict[str, Any], time: str, command: str, git: dict[str, Any],
                       machine: dict[str, Any], versions: dict[str, str], env: dict[str, str],
                       overrides: list[str], layouts: dict[str, dict[str, Any]], sides: dict[str, dict[str, Any]],
                       notes: list[str]) -> dict[str, Any]:
    """One line of <results>/<workload>.jsonl, in the style of `summary.build_record`: `layouts`
    holds each layout's GPU count, CUDA devices and overrides, `sides` each layout's run record with its per-step
    records, `summary` the table's values of the layouts that ran, `targets` the target lines."""
    samples = workload["prompts_per_step"] * workload["group_size"]
    summary = with_speedups({name: summarize_layout(side, gpus=layouts[name]["gpus"], samples_per_step=samples)
                             for name, side in sides.items() if side.get("ok")})
    return {"workload": workload["name"], "time": time, "command": command, "git": git, "machine": machine,
            "versions": versions, "env": env, "spec": workload, "overrides": overrides, "layouts": layouts,
            "sides": sides, "summary": summary, "targets": target_lines(summary), "notes": notes}


def last_line(text: str | None) -> str:
    """The last non-blank line of a failed run's log tail."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "failed"


# ---------------------------------------------------------------------------------------------
# Running


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=_layout_list,
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all that fit the visible GPUs)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the workload's)")
    p.add_argument("--model", help="a prebuilt model folder instead of building the workload's random model")
    p.add_argument("--tiny", action="store_true", help="tiny random model, few prompts and tokens (checks the path)")
    p.add_argument("--workdir", default="outputs/bench", help="run folders and logs (default: %(default)s)")
    p.add_argument("--results", default="benchmarks/results", help="JSON lines go here (default: %(default)s)")
    p.add_argument("--side-timeout", type=float, default=3600, help="seconds before a layout's run is stopped")
    p.add_argument("--note", action="append", default=[], help="free text stored with the result (e.g. load)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of our recipe for every layout (repeatable), e.g. learner.fused_head=false")
    return p.parse_args(argv)


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


def layout_overrides(layout: Layout, *, on_gpu: bool) -> list[str]:
    """The layout's overrides; on CPU also its engine count (CPU `auto` would mean one engine)."""
    return [*layout.overrides, *([] if on_gpu else [f"cluster.generator_engines={layout.engines}"])]


def run_cluster(side_dir: Path, log: str) -> dict[str, Any] | None:
    """The cluster line of a layout's log, plus the ZeRO stage from the run's resolved config."""
    cluster = parse_cluster_line(Path(log).read_text(errors="replace"))
    config = side_dir / "run" / "config.yaml"
    if cluster is not None and config.is_file():
        cluster["zero_stage"] = yaml.safe_load(config.read_text())["learner"]["zero_stage"]
    return cluster


def run_layout(w: Workload, name: str, side_dir: Path, env: dict[str, str], *, model_path: str | None,
               on_gpu: bool, prompt_tokens: list[int], timeout: float) -> dict[str, Any]:
    """One layout's run of our training script, with its per-step records and cluster line."""
    shutil.rmtree(side_dir, ignore_errors=True)
    overrides = [*our_overrides(w, output_dir=str(side_dir / "run"), model_path=model_path),
                 *layout_overrides(LAYOUTS[name], on_gpu=on_gpu)]
    print(f"[scale] {name}: running (log: {side_dir / 'log.txt'})", flush=True)
    run = run_ours(w, overrides, side_dir, env, timeout)
    run.update(side=name, overrides=overrides, cluster=run_cluster(side_dir, run["log"]),
               steps=layout_steps(run["metrics"], prompt_tokens, w.prompts_per_step * w.group_size))
    print(f"[scale] {name}: {'ok' if run['ok'] else 'FAILED'} in {run['wall_s']:.0f} s", flush=True)
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
    """(layouts to run, notes on those skipped): on CPU every one asked for; on GPU those that fit."""
    names = asked or list(LAYOUTS)
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
    notes += args.note
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
    sides = {}
    for name in names:
        side_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[:LAYOUTS[name].gpus])} if gpus else env
        sides[name] = run_layout(w, name, workdir / w.name / name, side_env, model_path=model_path,
                                 on_gpu=bool(gpus), prompt_tokens=prompt_tokens, timeout=args.side_timeout)
    record = build_scale_record(
        workload=w.to_dict(), time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=shlex.join([Path(PYTHON).name, "benchmarks/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        git=git_info(), machine=machine_info(), versions=versions(),
        env={k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env},
        overrides=[o for o in common if not o.startswith("output_dir=")],
        layouts={n: {"gpus": LAYOUTS[n].gpus, "devices": gpus[:LAYOUTS[n].gpus],
                     "overrides": layout_overrides(LAYOUTS[n], on_gpu=bool(gpus))} for n in names},
        sides=sides, notes=notes)
    report(names, record, results_path)
    return 0 if sides and all(s["ok"] for s in sides.values()) else 1


def report(names: list[str], record: dict[str, Any], path: Path) -> None:
    """Print the table and the target lines; append the record to `path`."""
    errors = {n: last_line(s.get("error")) for n, s in record["sides"].items() if not s.get("ok")}
    print()
    print(format_scale_table(names, record["summary"], errors))
    print()
    for line in record["targets"]:
        print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print(f"\n[scale] appended to {path}")


if __name__ == "__main__":
    sys.exit(main())
