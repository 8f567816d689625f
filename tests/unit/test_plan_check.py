"""benchmarks/plan_check.py (issue 14's GPU checks of the memory planner): the overrides leave every
memory key to the plan, the prediction is read from the run's config, the verdicts, the table, the
target lines and --combine, on hand-made runs; the random models' shapes are the planner's; the
launch refuses 7B FSDP2 on one GPU; one tiny configuration end to end on CPU. No GPU numbers here:
those are the harness's output on a GPU machine, never a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks.models import SHAPES
from benchmarks.plan_check import (
    CONFIGS,
    PLAN_RECORD_KEYS,
    RECIPE,
    WORKLOAD,
    build_plan_record,
    check_overrides,
    check_workload,
    combine_latest,
    describe_check,
    format_plan_table,
    gpu_indices,
    gpu_overrides,
    h200_line,
    hub_id,
    oom_kind,
    peak_verdict,
    pinned_memory_keys,
    plan_fits,
    plan_of_run,
    refusal,
    summarize_check,
)
from benchmarks.scale import layout_steps
from benchmarks.workloads import REPO_MODELS, our_overrides
from rlhf.config import config_to_dict, load_config
from rlhf.planner.memory import PLAN_KEYS, predicted_learner_peak_gib
from rlhf.planner.shapes import KNOWN_SHAPES, shape_from_config

REPO = Path(__file__).resolve().parents[2]


def own_keys(name):
    """The memory keys a configuration sets itself (its backend, ZeRO stage, learner ranks)."""
    return {o.split("=", 1)[0] for o in CONFIGS[name].overrides} & set(PLAN_KEYS)


# ---------------------------------------------------------------------------------------------
# What each run is told: no memory key but the configuration's own


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("on_gpu", [True, False])
def test_overrides_leave_every_memory_key_to_the_plan(tmp_path, tiny, on_gpu):
    base = WORKLOAD.tiny() if tiny else WORKLOAD
    assert any(o.startswith("learner.micro_batch_size=") for o in our_overrides(base, output_dir="x"))
    for name, check in CONFIGS.items():
        w = check_workload(base, check, tiny=tiny)
        overrides = check_overrides(w, check, output_dir=str(tmp_path / name), model_path=hub_id(w.model),
                                    gpu=["memory.gpu=h200-141gb"], on_gpu=on_gpu)
        passed = {o.split("=", 1)[0] for o in overrides} & set(PLAN_KEYS)
        assert passed == own_keys(name), name
        # The recipe's only memory key is the backend, which every configuration sets itself.
        assert pinned_memory_keys(REPO / RECIPE, overrides) == own_keys(name) | {"learner.backend"} == own_keys(name)
        cfg = load_config(REPO / w.recipe, overrides)
        assert (cfg.memory.plan, cfg.memory.gpu) == ("auto", "h200-141gb")
        assert cfg.cluster.generator_engines == ("auto" if on_gpu else check.engines)
        assert (cfg.grpo.group_size, cfg.generation.ignore_eos) == (base.group_size, True)
        if not tiny:
            assert (cfg.generation.max_new_tokens, cfg.grpo.steps) == (256, check.steps or 3)
            assert cfg.grpo.prompts_per_step == (check.prompts_per_step or 64)
    # A recipe that sets memory keys would pin them: refused rather than measured as a plan.
    with pytest.raises(ValueError, match="generation.gpu_memory_utilization.*learner.num_ranks"):
        check_overrides(replace(WORKLOAD, recipe="configs/grpo_gsm8k_qwen2.5-1.5b_1gpu.yaml"), CONFIGS["1.5b-fsdp2"],
                        output_dir="x", model_path=None, gpu=["memory.gpu=h100-80gb"], on_gpu=True)


def test_gpu_kind_from_the_device_name():
    assert gpu_overrides("NVIDIA H200", 140.4) == ["memory.gpu=h200-141gb"]
    assert gpu_overrides("NVIDIA H100 80GB HBM3", 79.6) == ["memory.gpu=h100-80gb"]
    assert gpu_overrides("NVIDIA H200", 140.4, "h100-80gb") == ["memory.gpu=h100-80gb"]  # the H100 plan on an H200
    assert gpu_overrides("NVIDIA L40S", 44.99) == ["memory.gpu=h100-80gb", "memory.gpu_memory_gib=45.0"]
    assert gpu_indices("1", {"0": "H200", "1": "H200"}) == ["1"]
    assert gpu_indices(None, {"1": "H200", "0": "H200"}) == ["0", "1"]
    assert gpu_indices("GPU-5d1c", {"0": "H200"}) == ["0"]  # UUIDs: every GPU


def test_random_models_have_the_planners_shapes():
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    assert set(SHAPES) <= REPO_MODELS
    for name, config in SHAPES.items():
        shape = shape_from_config({**config, "model_type": "qwen2"})
        assert shape == KNOWN_SHAPES[name.removeprefix("random:")], name
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
        assert sum(p.numel() for p in model.parameters()) == shape.params(), name
    assert hub_id("random:qwen2.5-7b") == "Qwen/Qwen2.5-7B" and hub_id("tiny-qwen2") is None


def test_which_configurations_the_planner_can_place():
    def fits(name, kind):
        check = CONFIGS[name]
        return plan_fits(check_workload(WORKLOAD, check, tiny=False), check, [f"memory.gpu={kind}"], True)

    for kind in ("h100-80gb", "h200-141gb"):
        assert all(fits(n, kind) for n in ("0.5b-fsdp2", "1.5b-fsdp2", "1.5b-zero3", "1.5b-split")), kind
        assert not fits("7b-fsdp2", kind)  # 16 bytes a parameter on one GPU: 113 GiB before vLLM
    assert fits("7b-fsdp2-2gpu", "h200-141gb") and not fits("7b-fsdp2-2gpu", "h100-80gb")
    assert plan_fits(WORKLOAD.tiny(), CONFIGS["7b-fsdp2"], ["memory.gpu=h100-80gb"], False)  # tiny model


def test_prediction_comes_from_the_config_the_run_used(tmp_path):
    """The launch's own plan (with_memory_plan), through config.yaml, back to its prediction."""
    from scripts.launch import with_memory_plan, write_run_config

    check = CONFIGS["1.5b-fsdp2"]
    overrides = check_overrides(check_workload(WORKLOAD, check, tiny=False), check, output_dir=str(tmp_path),
                                model_path="Qwen/Qwen2.5-1.5B", gpu=["memory.gpu=h100-80gb"], on_gpu=True)
    base = load_config(REPO / RECIPE, overrides)
    planned = with_memory_plan(base, str(REPO / RECIPE), overrides)
    used = yaml.safe_load(write_run_config(planned, tmp_path).read_text())
    plan = plan_of_run(used, base)
    assert plan["gpu"] == "h100-80gb" and plan["gpu_memory_gib"] == pytest.approx(79.2)
    assert any(line.startswith("learner.max_tokens_per_micro_batch=") for line in plan["lines"])
    assert any(line.startswith("generation.gpu_memory_utilization=") for line in plan["lines"])
    assert not any(line.startswith("learner.backend=") for line in plan["lines"])  # pinned: as set
    assert plan["predicted"]["learner_peak"] == pytest.approx(predicted_learner_peak_gib(planned, "h100-80gb"))
    assert plan["predicted"]["tokens"] == planned.learner.max_tokens_per_micro_batch
    assert plan["learner_s"] > 0
    assert plan_of_run(config_to_dict(base), base)["lines"] == []  # no plan applied: nothing changed


# ---------------------------------------------------------------------------------------------
# Verdicts, table, targets, record, --combine on hand-made runs


def test_peak_verdicts_and_log_reading():
    assert peak_verdict(105.0, 100.0, on_gpu=True) == "met"
    assert peak_verdict(110.0, 100.0, on_gpu=True) == peak_verdict(90.0, 100.0, on_gpu=True) == "met"  # inclusive
    assert peak_verdict(111.0, 100.0, on_gpu=True) == peak_verdict(89.0, 100.0, on_gpu=True) == "missed"
    assert peak_verdict(None, 100.0, on_gpu=True) is None and peak_verdict(5.0, None, on_gpu=True) is None
    assert peak_verdict(2.0, 0.1, on_gpu=False) == "n/a (CPU)"  # RSS, not GPU allocations
    assert oom_kind("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") == "gpu"
    assert oom_kind("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.") \
        == "host"
    assert oom_kind("ValueError: Free memory on device (20.1/139.8 GiB) on startup is less than desired GPU "
                    "memory utilization (0.15, 21.0 GiB).") == "gpu"  # vLLM's share did not fit beside the learner
    assert oom_kind("error: learner rank 0 died") is None
    log = "model.dtype: ...\nerror: memory.plan=auto: the recipe needs 153.5 GiB per GPU as set, more than 79.2 GiB\n"
    assert refusal(log) == "memory.plan=auto: the recipe needs 153.5 GiB per GPU as set, more than 79.2 GiB"
    assert refusal("error: model.path='x' does not exist") is None


def _metrics(peaks, step_s=(20.0, 10.0, 12.0)):
    return [{"step": -1, "eval/pass@1": 0.0}] + [
        {"step": k, "timing/step_s": s, "timing/generate_s": s / 2, "timing/train_s": s / 2 - 1, "timing/sync_s": 0.3,
         "timing/reward_s": 0.01, "response_len/mean": 256.0, "reward/mean": 0.01, "memory/learner_peak_gib": p,
         "gen/engine0_s": s / 2, "gen/engine0_tokens": 1000.0, "sync/engine0_s": 0.2}
        for k, (s, p) in enumerate(zip(step_s, peaks))]


def _run(predicted, peaks, *, gpu="h200-141gb", device="NVIDIA H200", step_s=(20.0, 10.0, 12.0), host="h1", **extra):
    """A configuration's run record as plan_check.run_check builds it (64 samples per step)."""
    bd = {"learner_peak": predicted, "need": predicted + 30.0, "margin": 14.0, "tokens": 24576, "vllm_kv": 20.0,
          "vllm_kv_needed": 10.5}
    run = {"ok": True, "on_gpu": True, "host": host, "time": "t", "oom": None, "refused": None,
           "steps": layout_steps(_metrics(peaks, step_s), [1000] * len(peaks), 64), "devices": [device],
           "gpu_peaks": [predicted + 20.0],
           "plan": {"gpu": gpu, "lines": ["learner.max_tokens_per_micro_batch=24576"], "predicted": bd,
                    "learner_s": 5.0},
           "cluster": {"placement": "colocated", "engines": 1, "tp": 1, "ranks": 1, "backend": "fsdp2"}}
    return {**run, **extra}


def _runs():
    return {
        "0.5b-fsdp2": _run(50.0, [48.0, 52.0, 51.0]),                       # 1.04x
        "1.5b-fsdp2": _run(100.0, [95.0, 108.0, 109.0], step_s=(20.0, 8.0, 8.0)),  # 1.09x, 8 samples/s
        "1.5b-fsdp2-h100plan": _run(60.0, [57.0, 62.0, 61.0], gpu="h100-80gb", step_s=(20.0, 11.0, 11.0)),
        "1.5b-zero3": _run(60.0, [70.0, 72.0, 71.0]),                       # 1.2x: missed
        "1.5b-split": _run(70.0, [66.0, 69.0, 68.0], gpu_peaks=[126.0, 85.0],  # 0.986x; GPU 0 is vLLM's
                           cluster={"placement": "split", "engines": 1, "tp": 1, "ranks": 1, "backend": "fsdp2"}),
        "7b-fsdp2": {"ok": False, "steps": [], "refused": "memory.plan=auto: the recipe needs 153.5 GiB per GPU",
                     "oom": None, "plan": None, "error": "error: memory.plan=auto: ..."},
        "7b-fsdp2-2gpu": _run(119.0, [118.0], ok=False, oom="gpu",
                              error="x\ntorch.OutOfMemoryError: CUDA out of memory"),
    }


def _summaries(runs):
    return {name: summarize_check(run, gpus=CONFIGS[name].gpus, samples_per_step=64) for name, run in runs.items()}


def test_check_summary_and_lines():
    s = _summaries(_runs())
    one = s["1.5b-fsdp2"]
    assert one["learner_peak_gib"] == 109.0 and one["predicted_peak_gib"] == 100.0  # max over steps
    assert one["peak_ratio"] == pytest.approx(1.09) and one["peak_verdict"] == "met"
    assert one["predicted_gpu_gib"] == 116.0 and one["gpu_peak_gib"] == 120.0  # need - margin; nvidia-smi
    assert one["samples_per_s"] == 8.0 and one["outcome"] == "ran" and one["micro_batch_tokens"] == 24576
    assert s["1.5b-zero3"]["peak_verdict"] == "missed"
    assert s["1.5b-split"]["gpu_peak_gib"] == 85.0  # the learner's GPU, not the engine's
    assert s["7b-fsdp2"]["outcome"] == "refused before start" and s["7b-fsdp2"]["peak_verdict"] is None
    assert s["7b-fsdp2-2gpu"]["outcome"] == "OOM (gpu)"
    assert describe_check("1.5b-fsdp2", one) == [
        "1.5b-fsdp2: ran",
        "  planned for h200-141gb: learner.max_tokens_per_micro_batch=24576",
        "  learner peak: predicted 100.0 GiB, measured 109 GiB (1.09x): within +-10%: met",
        "  learner GPU peak, nvidia-smi: 120 GiB (predicted busiest phase + contexts: 116.0 GiB)",
        "  OOM: no | samples/s: 8",
    ]
    assert describe_check("7b-fsdp2", s["7b-fsdp2"]) == [
        "7b-fsdp2: refused before start: memory.plan=auto: the recipe needs 153.5 GiB per GPU",
        "  OOM: no | samples/s: -"]


def test_targets_table_and_record():
    runs = _runs()
    configs = {n: {"gpus": CONFIGS[n].gpus, "samples_per_step": 64, "overrides": []} for n in runs}
    record = build_plan_record(workload=WORKLOAD.to_dict(), time="t", command="c", git={"commit": "abc"},
                               machine={"host": "h1"}, versions={}, env={}, configs=configs, checks=runs, notes=[])
    assert tuple(record) == PLAN_RECORD_KEYS
    assert record["targets"] == [
        "learner peak within +-10% of the prediction: 5 of 6 configurations (target >= 4): met; outside: 1.5b-zero3",
        "no planned run OOMs: missed: 7b-fsdp2-2gpu (gpu) (6 run(s))",
        "refused before start (no plan fits): 7b-fsdp2",
        "H200 plan vs H100 plan on an H200 (1.5b-fsdp2 vs 1.5b-fsdp2-h100plan): 1.38x samples/s "
        "(target >= 1.3x): met; train 1.50x faster (predicted 1.00x); on an H100 the H100 plan's vLLM share "
        "held the step's KV cache (20.0 of 10.5 GiB)",
    ]
    json.dumps(record)  # one JSON line
    names = list(runs)
    errors = {"7b-fsdp2-2gpu": "torch.OutOfMemoryError: CUDA"}
    lines = format_plan_table(names, record["summary"], errors).splitlines()
    assert lines[0] == "| metric | " + " | ".join(names) + " |"
    assert "| outcome | ran | ran | ran | ran | ran | refused before start | OOM (gpu) |" in lines
    assert "| within +-10% | met | met | met | missed | met | - | met |" in lines
    assert ("| planned for (memory.gpu) | h200-141gb | h200-141gb | h100-80gb | h200-141gb | h200-141gb | - "
            "| h200-141gb |") in lines
    assert lines[-1] == "7b-fsdp2-2gpu failed: torch.OutOfMemoryError: CUDA"


def test_h200_line_needs_both_plans_on_an_h200():
    s = _summaries(_runs())
    slower = {**s, "1.5b-fsdp2": {**s["1.5b-fsdp2"], "samples_per_s": 6.4}}
    assert "1.10x samples/s (target >= 1.3x): missed" in h200_line(slower)
    on_h100 = {**s, "1.5b-fsdp2-h100plan": {**s["1.5b-fsdp2-h100plan"], "devices": ["NVIDIA H100 80GB HBM3"]}}
    assert h200_line(on_h100).startswith("H200 plan vs H100 plan on an H200: not measured")
    h100_planned = {**s, "1.5b-fsdp2": {**s["1.5b-fsdp2"], "plan_gpu": "h100-80gb"}}
    assert "not measured" in h200_line(h100_planned)
    apart = {**s, "1.5b-fsdp2": {**s["1.5b-fsdp2"], "host": "h2"}}
    assert h200_line(apart).endswith("; NOT one machine: h2 vs h1")
    short = {**s, "1.5b-fsdp2-h100plan": {**s["1.5b-fsdp2-h100plan"], "vllm_kv_gib": 5.0}}
    assert "vLLM share did not hold the step's KV cache (5.0 of 10.5 GiB)" in h200_line(short)


def test_combine_takes_the_latest_run_of_each_configuration(tmp_path, capsys):
    from benchmarks.plan_check import main

    def record(time, names, peak):
        runs = {n: _run(100.0, [peak], host=f"host-{time}") for n in names}
        configs = {n: {"gpus": CONFIGS[n].gpus, "samples_per_step": 64, "overrides": []} for n in names}
        return build_plan_record(workload=WORKLOAD.to_dict(), time=time, command="c", git={"commit": "0123456789ab"},
                                 machine={"host": "m"}, versions={}, env={}, configs=configs, checks=runs, notes=[])

    records = [record("t1", ["0.5b-fsdp2", "1.5b-fsdp2"], 50.0), record("t2", ["1.5b-fsdp2"], 101.0),
               record("t3", ["1.5b-zero3"], 102.0)]
    configs, checks, notes = combine_latest(records, list(CONFIGS))
    assert list(checks) == ["0.5b-fsdp2", "1.5b-fsdp2", "1.5b-zero3"]  # CONFIGS order; the rest never ran
    assert [checks[n]["host"] for n in checks] == ["host-t1", "host-t2", "host-t3"]
    assert notes[1] == "1.5b-fsdp2 from the run of t on host-t2 (commit 0123456789)"
    results = tmp_path / "results"
    results.mkdir()
    (results / "plan-check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--combine", "--results", str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| metric | 0.5b-fsdp2 | 1.5b-fsdp2 | 1.5b-zero3 |" in out
    assert "| measured learner peak GiB, max over steps and ranks | 50 | 101 | 102 |" in out
    assert "learner peak within +-10% of the prediction: 2 of 3 configurations (target >= 4): missed; " \
           "outside: 0.5b-fsdp2" in out
    stored = [json.loads(line) for line in (results / "plan-check.jsonl").read_text().splitlines()]
    assert len(stored) == 4 and list(stored[-1]["checks"]) == list(checks)  # the combined record, appended
    assert combine_latest(stored, list(CONFIGS))[1] == checks  # combining again changes nothing


# ---------------------------------------------------------------------------------------------
# The real launch


def test_launch_refuses_7b_fsdp2_on_one_gpu_before_anything_starts(tmp_path):
    """What the 7b-fsdp2 run does on a GPU machine, here on CPU: the plan for an H100 is computed
    from the hub id's shape and fits nowhere, so the script stops with one line and exit 2."""
    check = CONFIGS["7b-fsdp2"]
    w = check_workload(WORKLOAD, check, tiny=False)
    overrides = check_overrides(w, check, output_dir=str(tmp_path / "run"), model_path=hub_id(w.model),
                                gpu=["memory.gpu=h100-80gb"], on_gpu=True)
    proc = subprocess.run([sys.executable, "scripts/train_grpo.py", "--config", w.recipe, *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = refusal(proc.stderr)
    assert line is not None and "130.8 GiB per GPU" in line and "79.2 GiB (h100-80gb)" in line
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(("visible", "sampled"), [(None, ["0", "1", "2", "3"]), ("2,3", ["2", "3"]),
                                                  ("GPU-8a1f,GPU-77c2", ["0", "1", "2", "3"])])
def test_gpu_peaks_are_sampled_on_the_gpus_the_process_may_use(monkeypatch, visible, sampled):
    """Jobs beside a run on the host's other GPUs are not its memory: CUDA_VISIBLE_DEVICES's indices
    only (UUIDs cannot be matched to nvidia-smi's indices here: every GPU then)."""
    import benchmarks.plan_check as plan_check

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(plan_check.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(plan_check, "nvidia_smi", lambda field: [(str(i), "H100", 10.0 + i) for i in range(4)])
    with plan_check.sampled_gpus(poll_s=60) as peaks:
        pass
    assert sorted(peaks) == sampled and all(peaks[i] == ("H100", 10.0 + int(i)) for i in sampled)
