"""The GPU suite as device calls of at most ten minutes each, for hosts of 1, 2 and 4 GPUs: which parts
of tests/gpu run on which GPUs in each call, and the runner that starts a call's lanes at once.

    python3 tests/gpu/schedule.py                        # this host's calls, with the seconds each should take
    python3 tests/gpu/schedule.py --call 1 --deadline 560 --copy-to "$OUT"   # run call 1 (then 2, ...)

A call is waves run one after the other; a wave is lanes run at the same time on disjoint GPUs
(`CUDA_VISIBLE_DEVICES`); a lane runs its parts in turn, each one `bash tests/gpu/run.sh PART`
whose deadline is what is left of the call's. A part is pytest arguments: a test file, and `-k
WORD` where a file is split. The call ends with one record of every part's tests in
DIR/callK/record.jsonl (DIR: --copy-to, else outputs/gpu-suite), each part's logs beside it: append
the record to benchmarks/results/gpu-acceptance.jsonl. Set RLHF_COMMIT where the tree has no .git.
tests/unit/test_gpu_schedule.py checks that each host's calls run every test exactly once and fit
their calls by the SECONDS below (measured; docs/testing.md). Only the standard library here: the
runner starts before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
Part = tuple[str, ...]
LEARNER, GRPO, RM, FP8 = (("tests/gpu/test_learner_gpu.py",), ("tests/gpu/test_grpo_gpu.py",),
                          ("tests/gpu/test_reward_model_gpu.py",), ("tests/gpu/test_fp8_gpu.py",))
SPLIT, MULTI = ("tests/gpu/test_split_gpu.py",), ("tests/gpu/test_multi_gpu.py",)
PARTIAL = ("tests/gpu/test_partial_gpu.py",)
LEARNS_RESUMES = ("tests/gpu/test_learning_gpu.py", "-k", "resumes_exactly")
LEARNS_FAST = ("tests/gpu/test_learning_gpu.py", "-k", "fast")
MULTI_COLOCATED, MULTI_SPLIT = (*MULTI, "-k", "colocated"), (*MULTI, "-k", "split")

# Seconds a part takes on one H100/H200 beside other lanes, the larger of the two where both were
# measured (test_multi_gpu.py: per layout that its lane's GPUs allow; tests that skip take SKIP_S).
SECONDS: dict[Part, float] = {
    LEARNER: 345, GRPO: 395, RM: 260, FP8: 180, SPLIT: 285, LEARNS_RESUMES: 300, LEARNS_FAST: 200,
    PARTIAL: 200,  # not yet measured: two SmolLM2 runs of test_grpo_gpu's ~100 s each
}
MULTI_LAYOUTS = {"colocated-2-engines-1gpu": 1, "colocated-2x2": 2, "split-1+3-zero2": 4, "colocated-8x8": 8,
                 "split-1+7-zero3": 8}  # test_multi_gpu.py's LAYOUTS: the GPUs each needs
LAYOUT_S, SKIP_S, SPLIT_GPUS = 100.0, 15.0, 2
INSTALL_S = 130.0  # the first call on a fresh machine unpacks the staged packages (later calls ~45 s)
CALL_S = 600.0  # a device call's limit
REPORT_S = 25.0  # kept back from a part's deadline for run.sh to write its record


@dataclass(frozen=True)
class Lane:
    gpus: str  # CUDA_VISIBLE_DEVICES
    parts: tuple[Part, ...]


Wave = tuple[Lane, ...]
Call = tuple[Wave, ...]

SCHEDULES: dict[int, tuple[Call, ...]] = {
    1: (((Lane("0", (LEARNER, SPLIT)),),),
        ((Lane("0", (GRPO, MULTI)),),),
        ((Lane("0", (LEARNS_RESUMES, FP8)),),),
        ((Lane("0", (LEARNS_FAST, RM)),),),
        ((Lane("0", (PARTIAL,)),),)),
    2: (((Lane("0", (LEARNER,)), Lane("1", (RM, FP8))),),
        ((Lane("0", (GRPO,)), Lane("1", (LEARNS_RESUMES, LEARNS_FAST))),),
        ((Lane("0,1", (SPLIT, MULTI)),),),
        ((Lane("0", (PARTIAL,)),),)),
    4: (((Lane("0", (LEARNS_RESUMES,)), Lane("1", (GRPO,)), Lane("2", (LEARNER,)), Lane("3", (RM, FP8))),),
        ((Lane("0,1", (SPLIT,)), Lane("2,3", (MULTI_COLOCATED, LEARNS_FAST))),
         (Lane("0,1,2,3", (MULTI_SPLIT,)),)),
        ((Lane("0", (PARTIAL,)),),)),
}


def schedule_for(gpus: int) -> tuple[Call, ...]:
    """The calls of the largest schedule this host's GPU count allows (8 GPUs run the 4-GPU one)."""
    fits = [n for n in SCHEDULES if n <= gpus]
    if not fits:
        raise SystemExit("schedule.py: no GPU visible (nvidia-smi lists none)")
    return SCHEDULES[max(fits)]


def part_seconds(part: Part, gpus: int) -> float:
    """A part's seconds on a lane of `gpus` GPUs."""
    if part[0] == MULTI[0]:
        runs = sum(need <= gpus and _matches(part, name) for name, need in MULTI_LAYOUTS.items())
        return LAYOUT_S * runs + SKIP_S
    return SKIP_S if part == SPLIT and gpus < SPLIT_GPUS else SECONDS[part]


def expected_seconds(call: Call) -> float:
    """A call's seconds by SECONDS: each wave lasts as long as its longest lane."""
    return sum(max(sum(part_seconds(p, len(ln.gpus.split(","))) for p in ln.parts) for ln in wave) for wave in call)


def selects(part: Part, node_id: str) -> bool:
    """Whether pytest runs `node_id` for `part` (a file, and `-k WORD` matched in the test's name)."""
    return node_id.startswith(part[0] + "::") and _matches(part, node_id.split("::", 1)[1])


def _matches(part: Part, name: str) -> bool:
    return len(part) < 3 or part[2].lower() in name.lower()


def part_name(part: Part) -> str:
    return Path(part[0]).stem.removeprefix("test_") + ("-" + part[2] if len(part) > 2 else "")


def run_lane(lane: Lane, deadline: float, work: Path, run: tuple[str, ...], statuses: dict[str, int]) -> None:
    """The lane's parts in turn on its GPUs, each under what is left of the call's deadline; a part
    with less than a minute left is not started (status -1: `merged_results` says so in the record)."""
    for part in lane.parts:
        name, left = part_name(part), deadline - time.time() - REPORT_S
        if left < 60:
            print(f"[schedule] {name}: not started, {left:.0f} s left", flush=True)
            statuses[name] = -1
            continue
        out = work / name
        env = os.environ | {"CUDA_VISIBLE_DEVICES": lane.gpus, "RLHF_GPU_DEADLINE_S": str(int(left)),
                            "RLHF_GPU_COPY_TO": str(out), "RLHF_GPU_RECORD": str(work / f"{name}.jsonl")}
        with open(work / f"{name}.out", "w") as log:
            statuses[name] = subprocess.run([*run, *part], cwd=REPO, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, check=False).returncode
        print(f"[schedule] {name} on GPU(s) {lane.gpus}: exit {statuses[name]}", flush=True)


def run_call(call: Call, deadline_s: float, work: Path, run: tuple[str, ...] = ("bash", "tests/gpu/run.sh")
             ) -> dict[str, int]:
    """Every wave of `call` in turn, the lanes of a wave at the same time; returns each part's exit
    status (-1: not started). Each part's results land in `work/NAME/`."""
    deadline, statuses = time.time() + deadline_s, {}
    work.mkdir(parents=True, exist_ok=True)
    for wave in call:
        threads = [threading.Thread(target=run_lane, args=(lane, deadline, work, run, statuses)) for lane in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return statuses


def merged_results(call: Call, work: Path, statuses: dict[str, int]) -> list[dict]:
    """Every part's per-test results (conftest.py's results.json), in the call's order of parts; a
    part that left none is one entry of its own ("not run": not started, "failed": its run.sh ended
    before pytest wrote any), so that no part goes missing from the record unsaid."""
    merged = []
    for name in (part_name(p) for wave in call for lane in wave for p in lane.parts):
        results = work / name / "results.json"
        if results.exists():
            merged += json.loads(results.read_text())
            continue
        status = statuses.get(name, -1)
        merged.append({"test": name, "outcome": "not run" if status < 0 else "failed", "seconds": 0.0, "figures": {},
                       "error": "not started: too little of the call's time left" if status < 0
                       else f"run.sh exited {status} without results (see {name}.out)"})
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, help="the host's GPU count (default: nvidia-smi's)")
    p.add_argument("--call", type=int, help="run this call (1-based); without it, print the schedule")
    p.add_argument("--deadline", type=float, default=CALL_S - 40, help="seconds for the whole call")
    p.add_argument("--copy-to", type=Path, help="copy the call's record and every part's logs here")
    args = p.parse_args(argv)
    gpus = args.gpus or len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                         check=False).stdout.strip().splitlines())
    calls = schedule_for(gpus)
    if args.call is None:
        for i, call in enumerate(calls, 1):
            waves = " then ".join(" | ".join(f"GPU {ln.gpus}: " + ", ".join(map(part_name, ln.parts)) for ln in w)
                                  for w in call)
            print(f"call {i}/{len(calls)} (~{expected_seconds(call):.0f} s): {waves}")
        return 0
    if not 1 <= args.call <= len(calls):
        raise SystemExit(f"schedule.py: --call must be 1..{len(calls)} on {gpus} GPU(s)")
    start, work = time.time(), Path(args.copy_to or REPO / "outputs" / "gpu-suite") / f"call{args.call}"
    setup = "source benchmarks/common.sh && source tests/gpu/install.sh && "
    subprocess.run(["bash", "-c", setup + "$PY -m scripts.assets fetch smollm2-135m-instruct"], cwd=REPO,
                   check=True)  # once, before the lanes would race to build it
    call = calls[args.call - 1]
    statuses = run_call(call, args.deadline - (time.time() - start), work)
    (work / "results.json").write_text(json.dumps(merged_results(call, work, statuses), indent=1))
    subprocess.run(["bash", "-c", setup + '$PY tests/gpu/report.py "$@"', "report", str(work / "results.json"),
                    "--record", str(work / "record.jsonl"),
                    "--command", f"python3 tests/gpu/schedule.py --gpus {gpus} --call {args.call}"],
                   cwd=REPO, check=True)
    return 0 if all(s == 0 for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
