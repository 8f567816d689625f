"""Issue 14's GPU checks of the memory planner: predicted vs measured learner peak, no OOM, and the
H200 plan's speed against the H100 plan's on one H200. One table, from one or many device calls.

    bash benchmarks/gpu_plan.sh --configs 1.5b-fsdp2            # one configuration (or a few) per device call ...
    bash benchmarks/gpu_plan.sh --combine                       # ... then one table from the latest of each
    .venv/bin/python benchmarks/plan_check.py --tiny --configs 1.5b-fsdp2 --steps 2   # the code path, on CPU

Each configuration (CONFIGS) is one run of scripts/train_grpo.py with `memory.plan=auto` and
`memory.gpu=<kind>` on grpo-gpu-scale's work (random-weight Qwen2.5 shapes from benchmarks/models.py,
arithmetic prompts, 64 prompts x 8 samples, 256 tokens with ignore_eos, dense reward), 3 steps.

Choices:
1. No memory key is passed unless it defines the configuration. The recipe,
   configs/grpo_gsm8k_qwen2.5-1.5b_1gpu_planned.yaml, sets only `learner.backend`; the workload's
   overrides lose every key of `rlhf.planner.memory.PLAN_KEYS` (`our_overrides` sets the micro-batch); each
   configuration adds its placement, backend, ZeRO stage and ranks, pinned on purpose
   (`check_overrides` refuses any other pinned memory key). The plan chooses the rest: micro-batch
   token budget, checkpointing, `reshard_after_forward`, offload, vLLM's `gpu_memory_utilization`.
2. `memory.gpu` is the kind of the run's GPU, named from nvidia-smi (this process never touches
   CUDA: a context of its own would sit on the GPU it measures; the models are built by a child
   process for the same reason); an unknown GPU plans as `h100-80gb` with its own memory.
3. Predicted: `rlhf.planner.memory.breakdown` of the config the run used (its `<output_dir>/config.yaml`:
   the applied plan, the settled dtype). Measured: the largest `memory/learner_peak_gib` of any
   step (torch.cuda.max_memory_allocated, max over ranks, reset every step). Target: within +-10%
   on at least four configurations. nvidia-smi's peak of the learner GPUs (sampled every second)
   is shown beside the planner's busiest phase plus contexts (`need` less the fragmentation
   margin), without a target: it also holds the caching allocator's spare blocks.
4. OOM is read from the logs (CUDA's error: gpu; Ray's memory monitor: host). A configuration no
   plan fits stops with one `error:` line before anything starts: reported as refused, no OOM. Its
   model is not built for that: the run names the hub id of the same shape (KNOWN_SHAPES), all
   that the planner reads.
5. H200 vs H100: on an H200, `1.5b-fsdp2` (planned for it) against `1.5b-fsdp2-h100plan`
   (`memory.gpu=h100-80gb`), one after the other on one machine; target >= 1.3x samples/s.
   `memory.gpu` only changes what is planned for, and every planned value is absolute (token
   budget, checkpointing, sharding) except `generation.gpu_memory_utilization`, a share of the
   device vLLM runs on: on the H200 the H100 plan's share gives vLLM 139.8/79.2 = 1.77x the bytes
   planned. Kept so: it is the H100 plan exactly as `memory.gpu=h100-80gb` launches it, more KV
   cache can only help the H100 side, and the line says whether the share held the step's KV cache
   on an H100 anyway. Rescaling the share would pin it, and a pinned share is planned as a share
   of the H100's 79.2 GiB, which changes the rest of the plan.
6. 7B: FSDP2 keeps fp32 masters, gradients and Adam state on the GPU (16 bytes a parameter, 113
   GiB), so `7b-fsdp2` fits no single GPU and is expected refused; `7b-fsdp2-2gpu` shards it over
   two H200s (32 prompts, 2 steps: its start-up alone takes minutes). One GPU with ZeRO-3 and an
   offloaded optimizer is left out: that is ~120 GB of host memory on machines of 128 GiB, and the
   planner does not model host memory.
7. `--tiny` runs every configuration with the tiny random Qwen2 on CPU, planned for an H100:
   `memory.gpu` names a kind, so the launch plans and applies it without looking at the device
   (scripts/launch.py::with_memory_plan; `auto` would plan nothing on CPU). The learner peak on CPU
   is the resident-set high-water mark, so the verdict reads n/a.

Output per configuration: the planned `key=value` lines, predicted and measured learner peak, their
ratio and verdict, nvidia-smi's peak, the outcome (ran, refused, OOM), samples/s; then a markdown
table, the target lines, and one JSON line appended to `<results>/plan-check.jsonl`. `--combine`
builds the table from the latest stored run of each configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from benchmarks.models import DEFAULT_TOKENIZER, SHAPES  # noqa: E402
from benchmarks.run import BENCH_ENV, PYTHON, git_info, machine_info, run_ours, versions  # noqa: E402
from benchmarks.run import step_prompt_tokens  # noqa: E402
from benchmarks.scale import last_line, layout_steps, name_list, run_cluster, summarize_layout, visible_gpus  # noqa: E402
from benchmarks.summary import format_value  # noqa: E402
from benchmarks.workloads import WORKLOADS, Workload, our_overrides  # noqa: E402
from rlhf.config import RunConfig, config_from_dict, explicit_keys, load_config  # noqa: E402
from rlhf.planner.memory import PLAN_KEYS, breakdown, learner_seconds, make_plan  # noqa: E402
from rlhf.planner.shapes import GPU_KINDS, gpu_kind, gpu_kind_of_device, model_shape, shape_from_config  # noqa: E402

RECIPE = "configs/grpo_gsm8k_qwen2.5-1.5b_1gpu_planned.yaml"
WORKLOAD = replace(WORKLOADS["grpo-gpu-scale"], name="plan-check", recipe=RECIPE, steps=3, micro_batch_size=0,
                   gpu_extra=(),  # the recipe's own (eager) learner: each configuration names its kernels
                   description="grpo-gpu-scale's work under memory.plan=auto: Qwen2.5-shaped random weights, "
                               "64 prompts x 8 samples, 256 tokens (ignore_eos), one run per configuration")
TOLERANCE = 0.10
MIN_WITHIN = 4
SPEEDUP_TARGET = 1.3
H200_PAIR = ("1.5b-fsdp2", "1.5b-fsdp2-h100plan")  # (planned for the H200 it runs on, planned for an H100)


@dataclass(frozen=True)
class Check:
    """One configuration: its model, GPUs, and the keys that define it (pinned on purpose)."""

    model: str
    gpus: int
    overrides: tuple[str, ...]
    engines: int = 1
    """What `cluster.generator_engines=auto` gives on `gpus` GPUs; passed explicitly on CPU."""
    plan_gpu: str = ""
    """`memory.gpu` of the plan; empty: the kind of the GPU the run gets (or --gpu)."""
    prompts_per_step: int = 0
    """0: the workload's."""
    steps: int = 0
    """0: the workload's."""


COLOCATED_FSDP2 = ("cluster.placement=colocated", "learner.backend=fsdp2")
CONFIGS: dict[str, Check] = {
    "0.5b-fsdp2": Check("random:qwen2.5-0.5b", 1, COLOCATED_FSDP2),
    "1.5b-fsdp2": Check("random:qwen2.5-1.5b", 1, COLOCATED_FSDP2),
    "1.5b-fsdp2-h100plan": Check("random:qwen2.5-1.5b", 1, COLOCATED_FSDP2, plan_gpu="h100-80gb"),
    "1.5b-zero3": Check("random:qwen2.5-1.5b", 1, ("cluster.placement=colocated", "learner.backend=deepspeed",
                                                   "learner.zero_stage=3")),
    "7b-fsdp2": Check("random:qwen2.5-7b", 1, COLOCATED_FSDP2, prompts_per_step=32, steps=2),
    "1.5b-split": Check("random:qwen2.5-1.5b", 2, ("cluster.placement=split", "learner.backend=fsdp2")),
    "7b-fsdp2-2gpu": Check("random:qwen2.5-7b", 2, (*COLOCATED_FSDP2, "learner.num_ranks=2"), engines=2,
                           prompts_per_step=32, steps=2),
}

PLAN_ROWS: tuple[tuple[str, str], ...] = (
    # (summary key, table label)
    ("gpus", "GPUs"),
    ("plan_gpu", "planned for (memory.gpu)"),
    ("learners", "learner ranks, backend"),
    ("outcome", "outcome"),
    ("micro_batch_tokens", "micro-batch tokens (planned)"),
    ("predicted_peak_gib", "predicted learner peak GiB"),
    ("learner_peak_gib", "measured learner peak GiB, max over steps and ranks"),
    ("peak_ratio", "measured / predicted"),
    ("peak_verdict", f"within +-{TOLERANCE:.0%}"),
    ("predicted_gpu_gib", "predicted GPU use GiB, busiest phase + contexts"),
    ("gpu_peak_gib", "GPU peak GiB, nvidia-smi, busiest learner GPU"),
    ("step_s", "median step s, steps 1..N-1"),
    ("generate_s", "median generate s"),
    ("train_s", "median train s"),
    ("predicted_learner_s", "predicted train s"),
    ("samples_per_s", "samples/s: prompts x group / step s"),
)


# ---------------------------------------------------------------------------------------------
# Pure parts: plain data in, plain data out (tests/unit/test_plan_check.py)


def check_workload(w: Workload, check: Check, *, tiny: bool, steps: int | None = None) -> Workload:
    """The workload of one configuration: its model and sizes (tiny: the tiny workload's, which
    runs every configuration on the tiny model); `steps` wins over both."""
    if not tiny:
        w = replace(w, model=check.model, prompts_per_step=check.prompts_per_step or w.prompts_per_step,
                    steps=check.steps or w.steps)
    return replace(w, steps=steps) if steps else w


def pinned_memory_keys(recipe: str | Path, overrides: Sequence[str]) -> set[str]:
    """The planner's keys that the recipe or the overrides set (the plan keeps them as set)."""
    return explicit_keys(recipe, list(overrides)) & set(PLAN_KEYS)


def check_overrides(w: Workload, check: Check, *, output_dir: str, model_path: str | None,
                    gpu: Sequence[str], on_gpu: bool) -> list[str]:
    """Overrides of `w.recipe` for one configuration's run: the workload's without any memory key,
    the configuration's own keys, the engine count on CPU, `memory.plan=auto` and `gpu` (the
    `memory.gpu...` keys). Raises ValueError if a memory key other than the configuration's own
    would be pinned."""
    base = [o for o in our_overrides(w, output_dir=output_dir, model_path=model_path)
            if o.split("=", 1)[0] not in PLAN_KEYS]
    engines = [] if on_gpu else [f"cluster.generator_engines={check.engines}"]
    out = [*base, *check.overrides, *engines, "memory.plan=auto", *gpu]
    own = {o.split("=", 1)[0] for o in check.overrides}
    extra = pinned_memory_keys(REPO / w.recipe, out) - own
    if extra:
        raise ValueError(f"memory keys pinned outside the configuration: {', '.join(sorted(extra))}")
    return out


def gpu_overrides(device_name: str, memory_gib: float, kind: str = "") -> list[str]:
    """`memory.gpu` (and `memory.gpu_memory_gib` for an unknown GPU) for a device, or for `kind`."""
    if kind:
        return [f"memory.gpu={kind}"]
    found = gpu_kind_of_device(device_name, memory_gib)
    if found.name in GPU_KINDS:
        return [f"memory.gpu={found.name}"]
    return ["memory.gpu=h100-80gb", f"memory.gpu_memory_gib={memory_gib:.1f}"]


def key_value(key: str, value: Any) -> str:
    """`key=value` as an override is written (booleans as true/false)."""
    return f"{key}={json.dumps(value) if isinstance(value, bool) else value}"


def plan_of_run(used: dict[str, Any], base: RunConfig) -> dict[str, Any]:
    """What the plan set and what it predicts, from the run's config.yaml (`used`) and the config
    before the plan (`base`): the GPU planned for, the `key=value` lines of the memory keys it
    changed, the breakdown (GiB) and the predicted learner seconds."""
    cfg = config_from_dict(used)
    gpu = gpu_kind(cfg.memory.gpu, cfg.memory.gpu_memory_gib)
    shape = model_shape(cfg.model.path)

    def get(c: RunConfig, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(c, section), name)

    lines = [key_value(k, get(cfg, k)) for k in PLAN_KEYS if get(cfg, k) != get(base, k)]
    return {"gpu": gpu.name, "gpu_memory_gib": gpu.memory_gib, "lines": lines,
            "predicted": dataclasses.asdict(breakdown(cfg, shape, gpu)),
            "learner_s": learner_seconds(cfg, shape, gpu)}


GPU_OOM_SIGNS = ("cuda out of memory", "outofmemoryerror", "cuda error: out of memory",
                 "less than desired gpu memory utilization", "no available memory for the cache blocks")
"""Lower-case log text of a GPU out of memory: PyTorch's, and vLLM finding less free memory than its
planned share at start-up, or no room for a KV cache in it."""


def oom_kind(log_text: str) -> str | None:
    """"host" for Ray's memory monitor, "gpu" for GPU_OOM_SIGNS, else None."""
    low = log_text.lower()
    if "running low on memory" in low:
        return "host"
    return "gpu" if any(sign in low for sign in GPU_OOM_SIGNS) else None


def refusal(log_text: str) -> str | None:
    """The launch's one-line refusal when no plan fits, else None."""
    return next((line.removeprefix("error: ").strip() for line in log_text.splitlines()
                 if line.startswith("error: memory.plan=auto:")), None)


def peak_verdict(measured: float | None, predicted: float | None, *, on_gpu: bool) -> str | None:
    """met / missed (+-TOLERANCE), n/a on CPU (RSS is no GPU allocation), None unmeasured."""
    if measured is None or not predicted:
        return None
    if not on_gpu:
        return "n/a (CPU)"
    return "met" if abs(measured / predicted - 1) <= TOLERANCE + 1e-9 else "missed"


def outcome(run: dict[str, Any]) -> str:
    """What became of a configuration's run, in words."""
    if run.get("refused"):
        return "refused before start"
    if run.get("oom"):
        return f"OOM ({run['oom']})"
    if run.get("timed_out"):
        return "stopped at --side-timeout"
    return "ran" if run.get("ok") else "failed"


def summarize_check(run: dict[str, Any], *, gpus: int, samples_per_step: int) -> dict[str, Any]:
    """Table values of one configuration's run record: scale.py's per-layout summary, plus the
    plan, predicted and measured peaks, the verdict and the outcome."""
    out = summarize_layout(run, gpus=gpus, samples_per_step=samples_per_step)
    plan = run.get("plan") or {}
    bd = plan.get("predicted") or {}
    predicted = bd.get("learner_peak")
    measured = out["learner_peak_gib"]
    gpu_peaks = run.get("gpu_peaks") or []
    cluster = run.get("cluster") or {}
    if cluster.get("placement") == "split":  # the engines' GPUs come first; the learners' follow
        gpu_peaks = gpu_peaks[cluster["engines"] * cluster["tp"]:]
    out.update(
        plan_gpu=plan.get("gpu"), planned=plan.get("lines"), outcome=outcome(run), refused=run.get("refused"),
        oom=run.get("oom"), devices=run.get("devices") or [], host=run.get("host"), time=run.get("time"),
        micro_batch_tokens=bd.get("tokens"), predicted_peak_gib=predicted,
        peak_ratio=measured / predicted if measured is not None and predicted else None,
        peak_verdict=peak_verdict(measured, predicted, on_gpu=bool(run.get("on_gpu"))),
        predicted_gpu_gib=bd["need"] - bd["margin"] if bd else None,
        gpu_peak_gib=max(gpu_peaks) if gpu_peaks else run.get("peak_gpu_gib"),
        predicted_learner_s=plan.get("learner_s"),
        vllm_kv_gib=bd.get("vllm_kv"), vllm_kv_needed_gib=bd.get("vllm_kv_needed"),
    )
    return out


def describe_check(name: str, s: dict[str, Any]) -> list[str]:
    """A configuration's lines: the plan, the peaks and the verdict, the outcome and speed."""
    planned = s.get("planned")
    lines = [f"{name}: {s['outcome']}" + (f": {s['refused']}" if s.get("refused") else "")]
    if planned is not None:
        lines.append(f"  planned for {s['plan_gpu']}: " + (" ".join(planned) or "(the recipe as written)"))
    if s.get("predicted_peak_gib") is not None:
        measured = s.get("learner_peak_gib")
        ratio = f" ({s['peak_ratio']:.2f}x)" if s.get("peak_ratio") is not None else ""
        lines.append(f"  learner peak: predicted {s['predicted_peak_gib']:.1f} GiB, measured "
                     f"{format_value(measured)} GiB{ratio}: within +-{TOLERANCE:.0%}: "
                     f"{s.get('peak_verdict') or 'not measured'}")
        lines.append(f"  learner GPU peak, nvidia-smi: {format_value(s.get('gpu_peak_gib'))} GiB (predicted busiest "
                     f"phase + contexts: {s['predicted_gpu_gib']:.1f} GiB)")
    lines.append(f"  OOM: {s['oom'] or 'no'} | samples/s: {format_value(s.get('samples_per_s'))}")
    return lines


def h200_line(summaries: dict[str, dict[str, Any]]) -> str:
    """The H200 plan against the H100 plan of the same recipe, both run on an H200."""
    fast, slow = (summaries.get(n) or {} for n in H200_PAIR)
    on_h200 = all(s.get("devices") and all("H200" in d for d in s["devices"]) for s in (fast, slow))
    planned = fast.get("plan_gpu") == "h200-141gb" and slow.get("plan_gpu") == "h100-80gb"
    if not (on_h200 and planned and fast.get("samples_per_s") and slow.get("samples_per_s")):
        return (f"H200 plan vs H100 plan on an H200: not measured (needs {H200_PAIR[0]} planned for h200-141gb "
                f"and {H200_PAIR[1]}, both run on an H200)")
    x = fast["samples_per_s"] / slow["samples_per_s"]
    line = (f"H200 plan vs H100 plan on an H200 ({' vs '.join(H200_PAIR)}): {x:.2f}x samples/s "
            f"(target >= {SPEEDUP_TARGET}x): {'met' if x >= SPEEDUP_TARGET else 'missed'}")
    if fast.get("train_s") and slow.get("train_s"):
        line += f"; train {slow['train_s'] / fast['train_s']:.2f}x faster"
    if fast.get("predicted_learner_s") and slow.get("predicted_learner_s"):
        line += f" (predicted {slow['predicted_learner_s'] / fast['predicted_learner_s']:.2f}x)"
    kv, needed = slow.get("vllm_kv_gib"), slow.get("vllm_kv_needed_gib")
    if kv is not None and needed is not None:
        held = "held" if kv >= needed else "did not hold"
        line += f"; on an H100 the H100 plan's vLLM share {held} the step's KV cache ({kv:.1f} of {needed:.1f} GiB)"
    if fast.get("host") != slow.get("host"):
        line += f"; NOT one machine: {fast.get('host')} vs {slow.get('host')}"
    return line


def target_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets, measured: peaks within +-10% on >= 4 configurations, no planned run
    OOMs (refusals listed apart), the H200 plan >= 1.3x the H100 plan's samples/s on an H200."""
    judged = {n: s["peak_verdict"] for n, s in summaries.items() if s.get("peak_verdict") in ("met", "missed")}
    within = [n for n, v in judged.items() if v == "met"]
    missed = [n for n, v in judged.items() if v == "missed"]
    verdict = "met" if len(within) >= MIN_WITHIN else "missed" if judged else "not measured (no GPU run)"
    lines = [f"learner peak within +-{TOLERANCE:.0%} of the prediction: {len(within)} of {len(judged)} "
             f"configurations (target >= {MIN_WITHIN}): {verdict}"
             + (f"; outside: {', '.join(missed)}" if missed else "")]
    ran = [n for n, s in summaries.items() if not s.get("refused")]
    ooms = [f"{n} ({s['oom']})" for n, s in summaries.items() if s.get("oom")]
    lines.append(f"no planned run OOMs: {'missed: ' + ', '.join(ooms) if ooms else 'met'} ({len(ran)} run(s))")
    refused = [n for n, s in summaries.items() if s.get("refused")]
    if refused:
        lines.append(f"refused before start (no plan fits): {', '.join(refused)}")
    lines.append(h200_line(summaries))
    return lines


def format_plan_table(names: Sequence[str], summaries: dict[str, dict[str, Any]], errors: dict[str, str]) -> str:
    """A markdown table, one row per metric and one column per configuration, in `names` order;
    rows no configuration has a value for are left out; failures' last log lines below."""
    lines = ["| metric | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for key, label in PLAN_ROWS:
        if all(summaries.get(n, {}).get(key) is None for n in names):
            continue
        lines.append(f"| {label} | " + " | ".join(format_value(summaries.get(n, {}).get(key)) for n in names) + " |")
    lines += [f"\n{name} failed: {error}" for name, error in errors.items()]
    return "\n".join(lines)


PLAN_RECORD_KEYS = ("workload", "time", "command", "git", "machine", "versions", "env", "spec", "configs",
                    "checks", "summary", "targets", "notes")


def build_plan_record(*, workload: dict[str, Any], time: str, command: str, git: dict[str, Any],
                      machine: dict[str, Any], versions: dict[str, str], env: dict[str, str],
                      configs: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]], notes: list[str]
                      ) -> dict[str, Any]:
    """One line of <results>/plan-check.jsonl: `configs` holds each configuration's GPUs, devices,
    overrides and samples per step, `checks` its run record (per-step records, the plan and its
    prediction), `summary` the table's values, `targets` the target lines."""
    summary = {n: summarize_check(run, gpus=configs[n]["gpus"], samples_per_step=configs[n]["samples_per_step"])
               for n, run in checks.items()}
    return {"workload": workload["name"], "time": time, "command": command, "git": git, "machine": machine,
            "versions": versions, "env": env, "spec": workload, "configs": configs, "checks": checks,
            "summary": summary, "targets": target_lines(summary), "notes": notes}


def combine_latest(records: Sequence[dict[str, Any]], names: Sequence[str]
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """The latest stored run of each configuration in `names` (refused and failed runs count: they
    are results too): (configs, checks, notes naming where each came from)."""
    configs, checks, notes = {}, {}, []
    for name in names:
        rec = next((r for r in reversed(records) if name in r.get("checks", {})), None)
        if rec is None:
            continue
        configs[name], checks[name] = rec["configs"][name], rec["checks"][name]
        notes.append(f"{name} from the run of {checks[name].get('time') or rec['time']} on "
                     f"{checks[name].get('host') or rec['machine'].get('host')} (commit {rec['git']['commit'][:10]})")
    return configs, checks, notes


def choose_configs(asked: list[str] | None, gpus: int, on_gpu: bool) -> tuple[list[str], list[str]]:
    """(configurations to run, notes on those skipped): on CPU every one asked for; on GPU those
    that fit the visible GPUs."""
    names = asked or list(CONFIGS)
    if not on_gpu:
        return names, []
    run = [n for n in names if CONFIGS[n].gpus <= gpus]
    return run, [f"{n} skipped: needs {CONFIGS[n].gpus} GPUs, {gpus} visible" for n in names if n not in run]


# ---------------------------------------------------------------------------------------------
# Running


@contextmanager
def sampled_gpus(poll_s: float = 1.0) -> Iterator[dict[str, tuple[str, float]]]:
    """nvidia-smi's memory.used of every GPU this process may use (CUDA_VISIBLE_DEVICES's indices
    where it is set: jobs beside it on the host's other GPUs are not its memory), once a second
    while the block runs: index -> (name, peak GiB), filled in place; empty without nvidia-smi."""
    peaks: dict[str, tuple[str, float]] = {}
    stop = threading.Event()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [d.strip() for d in (visible or "").split(",") if d.strip()]
    mine = set(entries) if entries and all(d.isdigit() for d in entries) else None  # UUIDs: no filter

    def sample_once() -> None:
        for index, name, used in nvidia_smi("memory.used"):
            if mine is None or index in mine:
                peaks[index] = (name, max(used, peaks.get(index, (name, 0.0))[1]))

    def sample() -> None:
        while not stop.wait(poll_s):
            sample_once()

    thread = threading.Thread(target=sample, daemon=True)
    if shutil.which("nvidia-smi"):
        sample_once()  # the block's start, however short the block
        thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


def nvidia_smi(field: str) -> list[tuple[str, str, float]]:
    """(index, name, `field` in GiB) of every GPU; [] without nvidia-smi or on an error."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu=index,name,{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
        return [(i, name, float(mib) / 1024) for i, name, mib in rows]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def build_model(name: str, out_root: Path, tokenizer: str) -> str:
    """benchmarks/models.py in a child process (built once, reused): a model built in this process
    would leave its CUDA context and cached blocks on the GPU the runs measure."""
    proc = subprocess.run([PYTHON, "benchmarks/models.py", name, "--out", str(out_root), "--tokenizer", tokenizer],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building {name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def hub_id(model: str) -> str | None:
    """The hub id of a random model's shape (`random:qwen2.5-7b` -> `Qwen/Qwen2.5-7B`), None for others."""
    if model not in SHAPES:
        return None
    return "Qwen/Qwen2.5-" + model.rsplit("-", 1)[1].upper()


def plan_fits(w: Workload, check: Check, gpu: list[str], on_gpu: bool) -> bool:
    """Whether the launch will find a plan for this configuration, from the model's shape alone
    (the same arithmetic as scripts/launch.py::with_memory_plan; the tiny model always fits)."""
    if w.model not in SHAPES:
        return True
    overrides = check_overrides(w, check, output_dir="unused", model_path=hub_id(w.model), gpu=gpu, on_gpu=on_gpu)
    cfg = load_config(REPO / w.recipe, overrides)
    shape = shape_from_config({**SHAPES[w.model], "model_type": "qwen2"})
    kind = gpu_kind(cfg.memory.gpu, cfg.memory.gpu_memory_gib)
    return make_plan(cfg, shape, kind, pinned_memory_keys(REPO / w.recipe, overrides)).best is not None


def gpu_indices(visible: str | None, found: Iterable[str]) -> list[str]:
    """nvidia-smi indices of the GPUs a run sees: CUDA_VISIBLE_DEVICES when it lists indices, else
    every one `found`."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    return entries if entries and all(e.isdigit() for e in entries) else sorted(found)


def tail(path: Path, size: int = 1 << 20) -> str:
    """The last `size` bytes of a log, as text."""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode(errors="replace")


def run_check(w: Workload, name: str, side_dir: Path, env: dict[str, str], *, gpu: list[str], on_gpu: bool,
              models: Path, tokenizer: str, timeout: float) -> dict[str, Any]:
    """One configuration's run of our training script: its per-step records, the plan it ran
    with and its prediction, the GPU peaks, OOM or refusal."""
    check = CONFIGS[name]
    shutil.rmtree(side_dir, ignore_errors=True)
    refused = not plan_fits(w, check, gpu, on_gpu)
    model_path = hub_id(w.model) if refused else (build_model(w.model, models, tokenizer) if w.model in SHAPES
                                                   else None)
    overrides = check_overrides(w, check, output_dir=str(side_dir / "run"), model_path=model_path, gpu=gpu,
                                on_gpu=on_gpu)
    print(f"[plan] {name}: running{' (expected refused: no plan fits)' if refused else ''} "
          f"(log: {side_dir / 'log.txt'})", flush=True)
    with sampled_gpus() as peaks:
        run = run_ours(w, overrides, side_dir, env, timeout)
    used = side_dir / "run" / "config.yaml"
    logs = [Path(run["log"]), *sorted((side_dir / "run" / "logs").glob("**/*"))]  # the actors' logs too
    text = "\n".join(tail(p) for p in logs if p.is_file())
    devices = [i for i in gpu_indices(env.get("CUDA_VISIBLE_DEVICES"), peaks) if i in peaks]
    base = load_config(REPO / w.recipe, overrides)
    run.update(config=name, overrides=overrides, on_gpu=on_gpu, timed_out=run["wall_s"] > timeout,
               host=platform.node(),
               time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               cluster=run_cluster(side_dir, run["log"]), oom=None if run["ok"] else oom_kind(text),
               refused=refusal(text),
               plan=plan_of_run(yaml.safe_load(used.read_text()), base) if used.is_file() else None,
               gpu_peaks=[peaks[i][1] for i in devices], devices=[peaks[i][0] for i in devices],
               steps=layout_steps(run["metrics"], step_prompt_tokens(w, overrides), w.prompts_per_step * w.group_size)
               if run["metrics"] else [])
    print(f"[plan] {name}: {outcome(run)} in {run['wall_s']:.0f} s", flush=True)
    return run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=_config_list,
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default: all that fit the visible GPUs)")
    p.add_argument("--combine", action="store_true",
                   help="run nothing: one table from the latest stored record of each configuration")
    p.add_argument("--gpu", choices=sorted(GPU_KINDS),
                   help="plan for this GPU kind (default: the GPU found; on CPU h100-80gb)")
    p.add_argument("--steps", type=int, help="optimizer steps of every configuration (default: each one's)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random model on CPU, planned for an H100 (checks the path)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="Qwen2 tokenizer for the random models")
    p.add_argument("--workdir", default="outputs/bench", help="run folders, models and logs (default: %(default)s)")
    p.add_argument("--results", default="benchmarks/results", help="JSON lines go here (default: %(default)s)")
    p.add_argument("--side-timeout", type=float, default=3600,
                   help="seconds before a configuration's run is stopped (its steps so far are kept)")
    p.add_argument("--note", action="append", default=[], help="free text stored with the result")
    return p.parse_args(argv)


def _config_list(text: str) -> list[str]:
    return name_list(text, CONFIGS, "configuration")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = replace(WORKLOAD.tiny(), micro_batch_size=0) if args.tiny else WORKLOAD  # the micro-batch is the plan's
    results_path = REPO / args.results / f"{w.name}.jsonl"
    env = {**os.environ, **BENCH_ENV}
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join([Path(PYTHON).name, "benchmarks/plan_check.py", *given])
    if args.combine:
        if not results_path.is_file():
            raise SystemExit(f"--combine: {results_path} does not exist")
        records = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
        configs, checks, notes = combine_latest(records, args.configs or list(CONFIGS))
        return report(list(checks), configs, checks, [*notes, *args.note], w, command, env, results_path)
    gpus = visible_gpus(env)
    if not args.tiny and not gpus:
        raise SystemExit(f"{w.name} needs CUDA GPUs and none are visible; --tiny runs the same path on CPU")
    names, notes = choose_configs(args.configs, len(gpus), on_gpu=bool(gpus))
    notes += args.note
    if not gpus:
        notes.append("CPU: GPUs are nominal, planned for h100-80gb unless --gpu; learner peaks are RSS (n/a)")
    inventory = {i: (name, gib) for i, name, gib in nvidia_smi("memory.total")}
    workdir = (REPO / args.workdir).resolve()
    print(f"[plan] {w.name}: {w.description} | configurations: {', '.join(names) or '(none)'}", flush=True)
    for note in notes:
        print(f"[plan] {note}", flush=True)
    configs, checks = {}, {}
    for name in names:
        check = CONFIGS[name]
        cw = check_workload(w, check, tiny=args.tiny, steps=args.steps)
        devices = gpus[:check.gpus]
        device_name, memory_gib = inventory.get(devices[0], ("", 0.0)) if devices else ("", 0.0)
        kind = check.plan_gpu or args.gpu or ("" if gpus else "h100-80gb")
        side_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(devices)} if gpus else env
        checks[name] = run_check(cw, name, workdir / w.name / name, side_env,
                                 gpu=gpu_overrides(device_name, memory_gib, kind), on_gpu=bool(gpus),
                                 models=workdir / "models", tokenizer=args.tokenizer, timeout=args.side_timeout)
        configs[name] = {"gpus": check.gpus, "devices": devices, "model": cw.model, "steps": cw.steps,
                         "samples_per_step": cw.prompts_per_step * cw.group_size,
                         "overrides": [o for o in checks[name]["overrides"] if not o.startswith("output_dir=")]}
    return report(names, configs, checks, notes, w, command, env, results_path)


def report(names: list[str], configs: dict[str, dict[str, Any]], checks: dict[str, dict[str, Any]],
           notes: list[str], w: Workload, command: str, env: dict[str, str], path: Path) -> int:
    """Print each configuration's lines, the table and the target lines; append the record."""
    record = build_plan_record(
        workload=w.to_dict(), time=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=command, git=git_info(), machine=machine_info(), versions=versions(),
        env={k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env},
        configs=configs, checks=checks, notes=notes)
    print()
    for name in names:
        print("\n".join(describe_check(name, record["summary"][name])))
    errors = {n: last_line(r.get("error")) for n, r in checks.items()
              if not r.get("ok") and not r.get("refused")}
    print()
    print(format_plan_table(names, record["summary"], errors))
    print()
    for line in [*record["targets"], *(f"note: {n}" for n in notes)]:
        print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    print(f"\n[plan] appended to {path}")
    return 0 if checks and all(r.get("ok") or r.get("refused") for r in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
