"""What the TRL and standalone sides share: argument parsing, the resolved config, the output record.

Each side is a separate process started by benchmarks/run.py; it writes one JSON object (the
"side record") to `--out`: `{"side", "ok", "error", "startup_s", "steps": [...], ...}`. A side that
fails, or is stopped at its time limit, still writes its record, with `ok: false` and the exception,
so the runner can report it (and use the steps it finished).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

T0 = float(os.environ.get("BENCH_T0", time.time()))
"""Wall-clock time the runner launched this process (start-up is measured from here)."""


def side_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="our YAML recipe (the same one our side runs)")
    p.add_argument("--out", required=True, help="where to write the side record (JSON)")
    p.add_argument("--ignore-eos", action="store_true", help="fixed-length completions")
    p.add_argument("--profile-step", type=int, default=None, help="write a torch.profiler trace of this step")
    p.add_argument("--trace-dir", default="benchmarks/results/traces", help="where traces go (%(default)s)")
    p.add_argument("overrides", nargs="*", help="the key=value overrides our side gets")
    return p


def load_run_config(recipe: str, overrides: list[str]) -> Any:
    from rlhf.config import load_config

    return load_config(recipe, overrides)


def peak_memory() -> dict[str, float]:
    """This process's own high-water marks: resident set (and CUDA allocator where there is a GPU).
    torch is not imported here: a side stopped before it used torch writes its record at once."""
    torch = sys.modules.get("torch")
    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch is not None and torch.cuda.is_available():
        out["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class Stopped(BaseException):
    """The runner stopped this side (SIGTERM at its `--side-timeout`): not an `Exception`, so no
    handler inside the trainer takes it for an error of its own and carries on."""


def _stopped(signum: int, _frame: Any) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name} (the runner's time limit)")


def run_side(name: str, out: str, body: Callable[[dict[str, Any]], None]) -> int:
    """Run `body(record)` and write `record` to `out` whatever happens, a stop by the runner
    included (the steps finished until then stand); exit status 1 on failure."""
    record: dict[str, Any] = {"side": name, "ok": False, "error": None, "steps": [], "notes": []}
    status, previous = 0, signal.signal(signal.SIGTERM, _stopped)
    try:
        body(record)
        record["ok"] = True
    except BaseException as e:  # the runner reports it; a failed side must not kill the benchmark
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
        status = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    record.update(peak_memory())
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1, default=str))
    return status


class Profiler:
    """torch.profiler over one span (CPU, plus CUDA when present), exported as a Chrome trace
    (open it in https://ui.perfetto.dev) and a text table of the top ops by self time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._prof = None
        self._wall = 0.0

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=True, with_stack=False)
        self._wall = time.perf_counter()
        self._prof.__enter__()

    def stop(self) -> str:
        """End the span; write the trace, the top-ops table (`.txt`) and, with a GPU, where the GPU's
        time went by kernel kind (`.kernels.json`, `kernel_kinds`)."""
        import torch
        from torch.autograd import DeviceType

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._wall
        self._prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        events = self._prof.key_averages()
        self.path.with_suffix(".txt").write_text(events.table(sort_by=sort, row_limit=30) + "\n")
        if torch.cuda.is_available():
            kernels = [(e.key, e.self_device_time_total / 1e6) for e in events if e.device_type == DeviceType.CUDA]
            summary = kernel_kinds(kernels, wall)
            self.path.with_suffix(".kernels.json").write_text(json.dumps(summary, indent=1) + "\n")
        return str(self.path)


# Kernel kinds by name, first match wins (cuBLAS/CUTLASS GEMMs, FlashAttention and SDPA kernels,
# NCCL collectives, Triton kernels (Liger, torch.compile), PyTorch's own elementwise/copy/reduction kernels).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "varlen", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "matmul")),
    ("collective", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("triton", ("triton", "swiglu", "rope", "liger")),
    ("copy/cast", ("copy", "cast", "cat_", "catarray", "fill")),
    ("reduction/softmax", ("reduce", "softmax", "logsumexp", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index")),
)


def kernel_kinds(kernels: list[tuple[str, float]], wall_s: float) -> dict[str, Any]:
    """GPU seconds per kernel kind (`KERNEL_KINDS`) for [(kernel name, seconds)], with each kind's
    share of the kernels' total and the span's `wall_s`; `idle_s` is the span's time with no kernel
    running (launch gaps, host work, waits), assuming kernels do not overlap."""
    kinds: dict[str, float] = {}
    for name, seconds in kernels:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    busy = sum(kinds.values())
    share = {k: round(v / busy, 4) if busy else 0.0 for k, v in kinds.items()}
    return {"wall_s": wall_s, "kernel_s": busy, "idle_s": max(0.0, wall_s - busy),
            "kinds_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "kinds_share": share}


def step_clock(record: dict[str, Any], args: argparse.Namespace, close_step: Callable[[float], None]) -> type:
    """A transformers `TrainerCallback` class that times every optimizer step of a TRL trainer:
    `record["startup_s"]` when training begins, `close_step(step_s)` at the end of each step
    (logging between steps counts toward the next one), and a torch.profiler trace of step
    `args.profile_step` into `args.trace_dir` (its summary in `record["trace"]`)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.profiler: Profiler | None = None

        def on_train_begin(self, args_, state, control, **kw):
            self.last = time.perf_counter()
            record["startup_s"] = time.time() - T0

        def on_step_begin(self, args_, state, control, **kw):
            if args.profile_step is not None and state.global_step == args.profile_step:
                self.profiler = Profiler(f"{args.trace_dir}/{record['side']}_step{args.profile_step}.json")
                self.profiler.start()

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            if self.profiler is not None:
                record["trace"] = self.profiler.stop()
                self.profiler = None
            close_step(now - self.last)
            self.last = time.perf_counter()

    return StepClock
