"""The GPU suite's summary: one table on the terminal and one JSON record appended to a JSON-lines
file (tests/gpu/run.sh calls it with the per-test results conftest.py wrote).

    python tests/gpu/report.py RESULTS.json --record benchmarks/results/gpu-acceptance.jsonl [--copy-to DIR]

The record: time, command, machine (GPUs, CPU, memory), package versions, commit (RLHF_COMMIT, else
git's; a copy of the tree without .git says so), the counts, and each test's outcome, seconds and
figures. `--combine`-style reading of older records: json.loads per line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.run import git_info, machine_info, versions  # noqa: E402


def build_record(results: list[dict[str, Any]], command: str) -> dict[str, Any]:
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "skipped", "not run")}
    git = git_info()
    commit = git["commit"] or "unknown (no .git: set RLHF_COMMIT)"
    from importlib.metadata import PackageNotFoundError, version

    more = {}
    for name in ("deepspeed", "peft"):
        try:
            more[name] = version(name)
        except PackageNotFoundError:
            pass
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": command,
            "commit": commit, "dirty": git["dirty"], "machine": machine_info(), "versions": versions() | more,
            **counts, "seconds": round(sum(r["seconds"] for r in results), 1), "tests": results}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(_short(v) for v in value) + "]"
    return str(value)


def format_summary(record: dict[str, Any], width: int = 160) -> str:
    rows = [f"{'test':<62} {'result':<8} {'s':>6}  figures"]
    for r in record["tests"]:
        figs = " ".join(f"{k}={_short(v)}" for k, v in r.get("figures", {}).items())
        note = r.get("error") or r.get("reason") or ""
        text = (figs + (" | " if figs and note else "") + note)[: width - 80]
        rows.append(f"{r['test'][:62]:<62} {r['outcome']:<8} {r['seconds']:6.1f}  {text}")
    gpus = ", ".join(record["machine"].get("gpus", [])) or "no GPU"
    rows.append(f"{record['passed']} passed, {record['failed']} failed, {record['skipped']} skipped, "
                f"{record['not run']} not run in "
                f"{record['seconds']:.0f} s on {gpus} at {record['commit'][:12]}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="the JSON list conftest.py wrote (RLHF_GPU_RESULTS)")
    p.add_argument("--record", required=True, help="JSON-lines file the record is appended to")
    p.add_argument("--log", nargs="*", default=[], help="logs copied with --copy-to (pytest's output, the runs')")
    p.add_argument("--command", default="bash tests/gpu/run.sh", help="the command that ran the suite")
    p.add_argument("--copy-to", help="also copy the record file, the results and the log here")
    args = p.parse_args(argv)
    path = Path(args.results)
    results = json.loads(path.read_text()) if path.exists() else []
    record = build_record(results, args.command)
    out = Path(args.record)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print("\n" + format_summary(record))
    print(f"record appended to {out}")
    if args.copy_to:
        dest = Path(args.copy_to)
        dest.mkdir(parents=True, exist_ok=True)
        for src in (out, path, *args.log):
            if src and Path(src).exists():
                shutil.copy(src, dest / Path(src).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
