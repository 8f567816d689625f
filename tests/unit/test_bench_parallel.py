"""benchmarks/run.py's scheduling of sides over GPUs (`--parallel`), its per-GPU memory peaks and
the tuned row (`--tuned`), on CPU: canned nvidia-smi output and stand-in sides, no training run.
No timings: those are the benchmark's output, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.summary import build_record, merge_peaks, out_of_memory, parse_gpu_query, report_text, waves
from benchmarks.workloads import (
    WORKLOADS,
    side_plan,
    trl_batch_candidates,
    trl_dpo_kwargs,
    trl_grpo_kwargs,
    trl_tuned_overrides,
)
from rlhf.config import explicit_keys, load_config
from rlhf.planner.memory import PLAN_KEYS

GRPO_GPU_SIDES = {"ours": 1, "trl-vllm": 1, "ours-gen": 1}


# ---------------------------------------------------------------------------------------------
# Which side runs when, on which GPUs


def test_one_gpu_or_none_runs_the_sides_in_turn():
    assert waves(GRPO_GPU_SIDES, [], parallel=True) == [{"ours": []}, {"trl-vllm": []}, {"ours-gen": []}]
    assert waves(GRPO_GPU_SIDES, ["0"], parallel=True) == [{"ours": ["0"]}, {"trl-vllm": ["0"]}, {"ours-gen": ["0"]}]


def test_two_gpus_run_ours_and_trl_at_once_then_the_rest():
    assert waves(GRPO_GPU_SIDES, ["0", "1"], parallel=True) == [{"ours": ["0"], "trl-vllm": ["1"]}, {"ours-gen": ["0"]}]
    # Without --parallel the same host runs them in turn, each on the first GPU.
    assert waves(GRPO_GPU_SIDES, ["0", "1"], parallel=False) == [{"ours": ["0"]}, {"trl-vllm": ["0"]},
                                                                 {"ours-gen": ["0"]}]
    # CUDA_VISIBLE_DEVICES=2,3: the GPUs handed out are those.
    assert waves({"ours": 1, "trl-vllm": 1}, ["2", "3"], parallel=True) == [{"ours": ["2"], "trl-vllm": ["3"]}]


def test_four_gpus_fit_every_side_with_disjoint_gpus():
    needs = {**GRPO_GPU_SIDES, "ours-tuned": 1, "trl-vllm-tuned": 1}
    assert waves(needs, ["0", "1", "2", "3"], parallel=True) == [
        {"ours": ["0"], "trl-vllm": ["1"], "ours-gen": ["2"], "ours-tuned": ["3"]}, {"trl-vllm-tuned": ["0"]}]
    # A two-GPU side takes two; one that needs more than the host has runs alone on all of them.
    assert waves({"ours": 2, "trl-vllm": 1, "ours-gen": 1}, ["0", "1", "2", "3"], parallel=True) == [
        {"ours": ["0", "1"], "trl-vllm": ["2"], "ours-gen": ["3"]}]
    assert waves({"ours": 3, "trl-vllm": 1}, ["0", "1"], parallel=True) == [{"ours": ["0", "1"]}, {"trl-vllm": ["0"]}]


def test_gpus_needed_follow_the_config(tmp_path):
    from benchmarks.workloads import gpus_needed

    w = WORKLOADS["grpo-gpu"]
    for side in ("ours", "trl-vllm", "ours-gen", "ours-tuned", "trl-vllm-tuned"):
        assert gpus_needed(*side_plan(w, side, str(tmp_path), str(tmp_path / "model")), side) == 1
    base = side_plan(w, "ours", str(tmp_path), str(tmp_path / "model"))[1]
    two = [*base, "learner.num_ranks=2"]
    assert gpus_needed(w, two, "ours") == 2
    split = [*two, "cluster.placement=split"]
    assert gpus_needed(w, split, "ours") == 4  # grpo-gpu's two engines, then 2 learner ranks
    assert gpus_needed(w, [*split, "cluster.generator_engines=auto"], "ours") == 3  # `auto` engines count as one


def test_visible_gpus_from_cuda_visible_devices():
    assert run.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert run.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def _args(**kw):
    base = dict(parallel=True, side_timeout=60, threads=None, trl_batch=0, no_pin=False, results=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("gpus", [[], ["0"]])
def test_parallel_falls_back_to_in_turn_below_two_gpus(monkeypatch, tmp_path, capsys, gpus):
    monkeypatch.setattr(run, "visible_gpus", lambda env: gpus)
    calls = []
    monkeypatch.setattr(run, "run_side", lambda w, side, g, *a, **kw: calls.append((side, g)) or
                        {"side": side, "ok": True, "gpus": g, "overrides": [side]})
    results, overrides, schedule = run.run_sides(WORKLOADS["grpo-gpu"], ["ours", "trl-vllm"], _args(),
                                                 model_path=str(tmp_path / "model"), workdir=tmp_path, env={})
    assert calls == [("ours", gpus), ("trl-vllm", gpus)] and overrides == ["ours"]
    assert schedule == {"concurrent": False, "waves": [{"ours": gpus}, {"trl-vllm": gpus}]}
    assert f"[bench] --parallel: {len(gpus)} GPU(s) for this workload, so the sides run in turn" in capsys.readouterr().out


def test_two_gpus_run_both_sides_at_once_and_a_failure_keeps_the_other_record(monkeypatch, tmp_path):
    monkeypatch.setattr(run, "visible_gpus", lambda env: ["0", "1"])
    both_started = threading.Barrier(2, timeout=30)  # each side waits for the other: they overlap, or this fails

    def side(w, name, gpus, *a, **kw):
        both_started.wait()
        if name == "trl-vllm":
            raise RuntimeError("side crashed")
        return {"side": name, "ok": True, "gpus": gpus, "overrides": []}

    monkeypatch.setattr(run, "run_side", side)
    results, _, schedule = run.run_sides(WORKLOADS["grpo-gpu"], ["ours", "trl-vllm"], _args(),
                                         model_path=str(tmp_path / "model"), workdir=tmp_path, env={})
    assert schedule == {"concurrent": True, "waves": [{"ours": ["0"], "trl-vllm": ["1"]}]}
    assert results["ours"]["ok"] and results["ours"]["gpus"] == ["0"]
    assert not results["trl-vllm"]["ok"] and results["trl-vllm"]["gpus"] == ["1"]
    assert "RuntimeError: side crashed" in results["trl-vllm"]["error"]


def test_a_side_runs_pinned_with_its_own_ray_folder_and_keeps_its_record(monkeypatch, tmp_path):
    w = WORKLOADS["grpo-gpu"].tiny()
    metrics = [{"step": k, "timing/step_s": 2.0, "response_len/mean": 16.0, "reward/mean": 0.5} for k in range(3)]
    seen = []

    def fake_ours(sw, overrides, side_dir, env, timeout):
        seen.append((env["CUDA_VISIBLE_DEVICES"], env["RAY_TMPDIR"]))
        return {"ok": True, "metrics": metrics if len(seen) == 1 else [{"step": 0, "timing/step_s": 1.0}],
                "wall_s": 1.0}

    monkeypatch.setattr(run, "run_ours", fake_ours)
    monkeypatch.setattr(run, "step_prompt_tokens", lambda w, overrides: [100] * w.steps)
    env = {"RAY_TMPDIR": str(tmp_path / "ray")}
    ok = run.run_side(w, "ours", ["1"], _args(), model_path=None, workdir=tmp_path, env=env)
    assert [s["step"] for s in ok["steps"]] == [0, 1, 2] and ok["gpus"] == ["1"]
    bad = run.run_side(w, "ours", ["1"], _args(), model_path=None, workdir=tmp_path, env=env)
    assert not bad["ok"] and "KeyError" in bad["error"]  # the run's record stays, saying why it has no steps
    (gpu, ray_ok), (_, ray_bad) = seen
    assert gpu == "1" and ray_ok != ray_bad and ray_ok.startswith(env["RAY_TMPDIR"])
    assert bad["ray_tmpdir"] == ray_bad and (tmp_path / "ray").is_dir()
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == [ray_bad.rsplit("/", 1)[1]]  # a failed side's stays


# ---------------------------------------------------------------------------------------------
# GPU memory: per GPU the side was given, never summed over the host


NVIDIA_SMI = "0, 40960\n1, 1024\n2, [N/A]\n\n"


def test_nvidia_smi_per_gpu_parsing_and_peaks():
    assert parse_gpu_query(NVIDIA_SMI) == {"0": 40.0, "1": 1.0}
    assert parse_gpu_query("") == {}
    peaks = {}
    for sample in ({"0": 10.0, "1": 70.0}, {"0": 30.0, "1": 5.0}, {"0": 20.0}):
        peaks = merge_peaks(peaks, sample, ["0"])
    assert peaks == {"0": 30.0}  # GPU 1 belongs to another side
    assert merge_peaks({"0": 1.0}, {"0": 0.5, "1": 2.0}, None) == {"0": 1.0, "1": 2.0}  # unpinned: every GPU


def test_launch_keeps_the_peak_of_each_gpu_it_was_given(monkeypatch, tmp_path):
    """The side ends only once all three samples were taken (it waits for the flag the fourth query
    leaves), so the peak is the same however busy the machine is."""
    samples, flag = iter([{"0": 70.0, "1": 3.0}, {"0": 71.0, "1": 9.0}, {"0": 72.0, "1": 6.0}]), tmp_path / "sampled"

    def gpu_query(field: str, unit: float = 1024) -> dict[str, float]:
        if field == "utilization.gpu":
            return {"0": 100.0, "1": 40.0}
        sample = next(samples, None)
        if sample is None:
            flag.touch()
        return sample or {"0": 72.0, "1": 6.0}

    monkeypatch.setattr(run, "gpu_query", gpu_query)
    wait = f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)"
    out = run.launch([sys.executable, "-c", wait], env={"CUDA_VISIBLE_DEVICES": "1"},
                     log=tmp_path / "log.txt", metrics=None, timeout=60, poll_s=0.05)
    assert out["returncode"] == 0
    assert out["peak_gpu_gib_per_gpu"] == {"1": 9.0} and out["peak_gpu_gib"] == 9.0  # GPU 0's 72 GiB is not its
    assert out["gpu_busy_samples"] and all(u == 0.4 for _, u in out["gpu_busy_samples"])  # GPU 1's alone


# ---------------------------------------------------------------------------------------------
# The tuned row


def test_sides_of_adds_the_tuned_row():
    w = WORKLOADS["grpo-gpu"]
    assert run.sides_of(w, None) == ["ours", "trl-vllm", "ours-gen"]
    assert run.sides_of(w, None, tuned=True) == ["ours", "trl-vllm", "ours-tuned", "trl-vllm-tuned", "ours-gen"]
    assert run.sides_of(w, ["trl-vllm-tuned"]) == ["trl-vllm-tuned"]


def test_tuned_sides_keep_the_samples_per_step(tmp_path):
    w = WORKLOADS["grpo-gpu"]
    model = str(tmp_path / "model")
    base_w, base = side_plan(w, "ours", str(tmp_path / "a"), model)
    tuned_w, tuned = side_plan(w, "ours-tuned", str(tmp_path / "b"), model)
    assert tuned_w.recipe == w.planned_recipe and "memory.plan=auto" in tuned
    # Nothing the planner chooses is pinned, but the backend the recipe names.
    assert explicit_keys(tuned_w.recipe, tuned) & set(PLAN_KEYS) == {"learner.backend"}
    ours, ours_tuned = load_config(base_w.recipe, base), load_config(tuned_w.recipe, tuned)
    samples = ours.grpo.prompts_per_step * ours.grpo.group_size
    assert samples == ours_tuned.grpo.prompts_per_step * ours_tuned.grpo.group_size == 512
    assert ours_tuned.memory.plan == "auto" and ours_tuned.generation.max_new_tokens == 512
    for batch in (64, 32):
        cfg = load_config(w.recipe, trl_tuned_overrides(w, base, batch))
        trl = trl_grpo_kwargs(cfg, use_vllm=True, ignore_eos=True, output_dir="x", use_cpu=False)
        assert trl["per_device_train_batch_size"] == batch
        assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == samples
    dpo = WORKLOADS["dpo-cpu"]
    cfg = load_config(dpo.recipe, trl_tuned_overrides(dpo, side_plan(dpo, "trl", str(tmp_path), None)[1], 4))
    trl = trl_dpo_kwargs(cfg, output_dir="x", use_cpu=True)
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (4, 2)  # 8 pairs a step


def test_trl_batch_rule_starts_by_gpu_memory_and_halves():
    w = WORKLOADS["grpo-gpu"]  # 512 completions a step, micro-batch 16
    assert trl_batch_candidates(w, 79.2) == [32, 16, 8, 4, 2, 1]
    assert trl_batch_candidates(w, 139.8) == [32, 16, 8, 4, 2, 1]  # 64 ran out of memory on an H200
    assert trl_batch_candidates(w, None) == [16, 8, 4, 2, 1]  # CPU, or an unknown GPU
    assert trl_batch_candidates(w, 79.2, fixed=128) == [128]
    with pytest.raises(ValueError, match="does not divide"):
        trl_batch_candidates(w, 79.2, fixed=48)
    assert trl_batch_candidates(w.tiny(), 79.2) == [16, 8, 4, 2, 1]  # capped at the step's 16 samples
    assert out_of_memory({"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"})
    assert not out_of_memory({"error": "ValueError: no KV cache blocks"})


def test_record_and_tables_of_a_concurrent_run_with_the_tuned_row():
    def side(step_s, gpus, **extra):
        steps = [{"step": k, "step_s": step_s, "generate_s": 1.0, "gen_tokens": 100.0, "train_s": 1.0,
                  "train_tokens": 200.0, "reward_mean": 0.5} for k in range(3)]
        return {"ok": True, "steps": steps, "gpus": gpus, "peak_gpu_gib": 60.0, **extra}

    sides = {"ours": side(20.0, ["0"], memory_keys={"learner.micro_batch_size": 16}),
             "trl-vllm": side(30.0, ["1"], trl_config={"per_device_train_batch_size": 16,
                                                       "gradient_accumulation_steps": 32}),
             "ours-tuned": side(15.0, ["0"], memory_keys={"learner.max_tokens_per_micro_batch": 12288}),
             "trl-vllm-tuned": side(25.0, ["1"], trl_config={"per_device_train_batch_size": 32,
                                                             "gradient_accumulation_steps": 16})}
    schedule = {"concurrent": True, "waves": [{"ours": ["0"], "trl-vllm": ["1"]},
                                              {"ours-tuned": ["0"], "trl-vllm-tuned": ["1"]}]}
    record = build_record(workload=WORKLOADS["grpo-gpu"].to_dict(), time="t", command="c", git={"commit": "abc"},
                          machine={}, versions={}, env={}, overrides=[], sides=sides, notes=[], schedule=schedule)
    assert record["schedule"] == schedule
    assert record["ratios"]["trl-vllm"]["step_s"] == pytest.approx(20 / 30)
    assert record["ratios"]["trl-vllm-tuned"]["step_s"] == pytest.approx(15 / 25)  # against ours-tuned
    json.dumps(record)
    lines = report_text(record).splitlines()
    assert "| metric | ours | trl-vllm | ours/trl-vllm |" in lines
    assert "| metric | ours-tuned | trl-vllm-tuned | ours-tuned/trl-vllm-tuned |" in lines
    assert "| GPUs (nvidia-smi index) | 0 | 1 | - |" in lines
    assert "| learner micro-batch | <= 12288 tokens | 32 x 16 accumulated | - |" in lines
    assert "| peak GPU memory GiB, nvidia-smi, busiest GPU of the side (lower is better) | 60 | 60 | 1 |" in lines
    assert lines[-1] == ("sides ran at the same time, each on its own GPUs: ours on GPU 0, trl-vllm on GPU 1 | "
                         "then ours-tuned on GPU 0, trl-vllm-tuned on GPU 1")


def test_sides_at_once_get_their_own_rendezvous_port():
    """Two TRL sides at once on one host both bound torch.distributed's default 29500 (EADDRINUSE on
    the H100 host): a side pinned to GPUs gets a port of its own; the caller's MASTER_PORT wins."""
    ports = {g: run.side_master_port({}, [g, "9"])["MASTER_PORT"] for g in "0123"}
    assert ports == {"0": "29500", "1": "29510", "2": "29520", "3": "29530"}
    assert run.side_master_port({}, []) == {}
    assert run.side_master_port({"MASTER_PORT": "1234"}, ["2"]) == {}


# ---------------------------------------------------------------------------------------------
# Host cores: sides at once each on their GPUs' share (the rule itself: tests/unit/test_host_cores.py)


def test_side_env_pins_only_when_asked(monkeypatch):
    monkeypatch.setattr(run.os, "sched_getaffinity", lambda pid: set(range(64)))
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/bin"}
    pinned = run.side_env(env, ["2"], pin=True)
    assert pinned == {**env, "CUDA_VISIBLE_DEVICES": "2", "MASTER_PORT": "29520", "BENCH_CPUS": "32-47"}
    assert "BENCH_CPUS" not in run.side_env(env, ["2"], pin=False)
    assert run.side_env(env, [], pin=True) == env  # CPU workloads: unchanged


def test_a_pinned_command_and_the_processes_it_starts_run_on_its_cores(tmp_path):
    core = min(os.sched_getaffinity(0))
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    grandchild = f"subprocess.run([sys.executable, '-c', {child!r}])"
    cmd = [sys.executable, "-c", f"import subprocess, sys; {child}; {grandchild}"]
    out = subprocess.run(run.pinned(cmd, str(core)), capture_output=True, text=True, check=True, cwd=run.REPO).stdout
    assert out.splitlines() == [f"[pin] cores {core}", f"[{core}]", f"[{core}]"]
    assert run.pinned(cmd, None) == cmd and run.pinned(cmd, "") == cmd


def test_launch_runs_a_side_on_its_cores_and_records_them(monkeypatch, tmp_path):
    monkeypatch.setattr(run, "gpu_query", lambda field, unit=1024: {})
    core = min(os.sched_getaffinity(0))
    out = run.launch([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                     env={**os.environ, "BENCH_CPUS": str(core)}, log=tmp_path / "log.txt", metrics=None,
                     timeout=60, poll_s=0.05)
    assert out["returncode"] == 0 and out["cpus"] == str(core)
    assert (tmp_path / "log.txt").read_text().splitlines()[1:] == [f"[pin] cores {core}", f"[{core}]"]


@pytest.mark.parametrize(("parallel", "no_pin", "pinned"),
                         [(True, False, True), (True, True, False), (False, False, False)])
def test_only_sides_that_run_at_once_are_pinned(monkeypatch, tmp_path, parallel, no_pin, pinned):
    monkeypatch.setattr(run, "visible_gpus", lambda env: ["0", "1"])
    calls = {}
    monkeypatch.setattr(run, "run_side", lambda w, side, g, *a, pin=False, **kw: calls.update({side: pin}) or
                        {"side": side, "ok": True, "gpus": g, "overrides": []})
    run.run_sides(WORKLOADS["grpo-gpu"], ["ours", "trl-vllm"], _args(parallel=parallel, no_pin=no_pin),
                  model_path=str(tmp_path / "model"), workdir=tmp_path, env={})
    assert calls == {"ours": pinned, "trl-vllm": pinned}


def test_a_tuned_trl_side_out_of_memory_above_the_workloads_batch_is_the_untuned_run():
    """TRL at 32 per device ran out of memory beside TRL at 16 (the workload's own): 16 is the largest
    that fits, and its run already exists, so the tuned row shows it instead of a failure."""
    w = WORKLOADS["grpo-gpu"]
    oom = {"side": "trl-vllm-tuned", "ok": False, "error": "torch.OutOfMemoryError: CUDA out of memory",
           "tries": [{"per_device_batch": 32, "ok": False, "oom": True, "wall_s": 150.0}]}
    untuned = {"side": "trl-vllm", "ok": True, "steps": [{"step": 0}], "gpus": ["1"]}
    results, notes = run.tuned_from_untuned({"trl-vllm": untuned, "trl-vllm-tuned": oom}, w)
    tuned = results["trl-vllm-tuned"]
    assert tuned["ok"] and tuned["steps"] == untuned["steps"] and tuned["side"] == "trl-vllm-tuned"
    assert tuned["per_device_batch"] == 16 and tuned["tries"][-1] == {
        "per_device_batch": 16, "ok": True, "oom": False, "reused": "trl-vllm"}
    assert notes == [("trl-vllm-tuned: per-device batch 32 ran out of memory; 16 is the largest that fits, "
                      "and its run is trl-vllm's")]
    assert results["trl-vllm"] is untuned
    no_oom = {**oom, "tries": [{"per_device_batch": 32, "ok": False, "oom": False, "wall_s": 76.0}]}
    below = {**oom, "tries": [{"per_device_batch": 8, "ok": False, "oom": True, "wall_s": 9.0}]}  # under 16
    for other in (no_oom, below):
        assert run.tuned_from_untuned({"trl-vllm": untuned, "trl-vllm-tuned": other}, w) == (
            {"trl-vllm": untuned, "trl-vllm-tuned": other}, [])
    failed_base = {**untuned, "ok": False}
    assert run.tuned_from_untuned({"trl-vllm": failed_base, "trl-vllm-tuned": oom}, w)[1] == []


@pytest.mark.parametrize("first_try_s", [100.0, 250.0])
def test_a_tuned_trl_sides_tries_share_its_time(monkeypatch, tmp_path, capsys, first_try_s):
    """Batch 32 runs out of memory after `first_try_s` of the side's 300 s (a fake clock): batch 16
    gets what is left (200 s), or, with 50 s left (under MIN_SIDE_S), is not tried and the record
    says why. Before, each try had the whole 300 s and a call's deadline passed."""
    from types import SimpleNamespace

    clock, limits = {"now": 0.0}, []
    monkeypatch.setattr(run, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    monkeypatch.setattr(run, "gpu_query", lambda field, unit=1024: {"0": 139.8})

    def try_batch(name, script, w, overrides, side_dir, env, timeout, extra):
        limits.append((side_dir.name, timeout))
        clock["now"] += first_try_s if side_dir.name == "batch32" else 60.0
        if side_dir.name == "batch32":
            return {"side": name, "ok": False, "error": "torch.OutOfMemoryError: CUDA out of memory", "wall_s": 1.0}
        return {"side": name, "ok": True, "steps": [{"step": 0}], "wall_s": 1.0}

    monkeypatch.setattr(run, "run_script_side", try_batch)
    r = run.run_trl_tuned("trl-vllm-tuned", "s.py", WORKLOADS["grpo-gpu"], [], tmp_path, {}, 300.0, [],
                          gpus=["0"], fixed=0)
    if first_try_s == 100.0:
        assert limits == [("batch32", 300.0), ("batch16", 200.0)] and r["ok"] and r["per_device_batch"] == 16
    else:
        assert limits == [("batch32", 300.0)] and not r["ok"] and [t["per_device_batch"] for t in r["tries"]] == [32]
        assert r["per_device_batch"] == 32 and "learner.micro_batch_size=32" in r["overrides"]  # the try that ran
        assert r["error"].endswith("per-device batch 16 not tried: 50 s of the side's 300 s left")
        assert "[bench] trl-vllm-tuned: per-device batch 16 not tried: 50 s" in capsys.readouterr().out


def test_a_failed_side_prints_why_as_it_fails(monkeypatch, tmp_path, capsys):
    """A device call that runs past its limit returns its output and not the record, so a failed side
    prints the tail of its error as it ends (before: only "FAILED in 203 s")."""
    w = WORKLOADS["grpo-gpu"].tiny()
    log = "\n".join(f"line {k}" for k in range(30)) + "\ntorch.OutOfMemoryError: CUDA out of memory."
    monkeypatch.setattr(run, "run_ours", lambda *a: {"ok": False, "metrics": [], "wall_s": 203.0, "error": log})
    r = run.run_side(w, "ours-tuned", [], _args(), model_path=None, workdir=tmp_path,
                     env={"RAY_TMPDIR": str(tmp_path / "ray")})
    out = capsys.readouterr().out
    assert not r["ok"] and "[bench] ours-tuned: FAILED in 203 s" in out
    assert "[bench] ours-tuned | torch.OutOfMemoryError: CUDA out of memory." in out
    assert "[bench] ours-tuned | line 19" in out and "line 18" not in out  # the last 12 lines
    monkeypatch.setattr(run, "run_ours", lambda *a: {"ok": False, "metrics": [], "wall_s": 203.0, "error": "x",
                                                     "timed_out": True})
    run.run_side(w, "ours-tuned", [], _args(), model_path=None, workdir=tmp_path,
                 env={"RAY_TMPDIR": str(tmp_path / "ray")}, timeout=200.0)
    assert "[bench] ours-tuned: FAILED in 203 s (stopped at its 200 s limit)" in capsys.readouterr().out


def test_a_side_is_kept_as_it_ends_and_combine_finds_it(monkeypatch, tmp_path):
    """Each finished side goes to `<workload>.sides.jsonl` at once (a device call stopped before the
    run's record keeps it); `--combine` reads that file beside the results file, newest by time."""
    w = WORKLOADS["grpo-gpu"].tiny()
    metrics = [{"step": k, "timing/step_s": 2.0, "response_len/mean": 16.0, "reward/mean": 0.5} for k in range(3)]
    monkeypatch.setattr(run, "run_ours", lambda *a: {"ok": True, "metrics": metrics, "wall_s": 1.0})
    monkeypatch.setattr(run, "step_prompt_tokens", lambda w, overrides: [100] * w.steps)
    results = tmp_path / "res"
    r = run.run_side(w, "ours", [], _args(results=str(results)), model_path=None, workdir=tmp_path,
                     env={"RAY_TMPDIR": str(tmp_path / "ray")})
    kept = [json.loads(line) for line in (results / f"{w.name}.sides.jsonl").read_text().splitlines()]
    assert len(kept) == 1 and kept[0]["sides"]["ours"]["steps"] == r["steps"] and kept[0]["overrides"] == r["overrides"]
    assert kept[0]["git"]["commit"] and kept[0]["time"]
    path = results / f"{w.name}.jsonl"
    older = {**kept[0], "time": "2000-01-01T00:00:00+00:00", "sides": {"ours": {**r, "steps": [{"step": 9}]}}}
    path.write_text(json.dumps(older) + "\n")
    found, overrides, notes, _ = run.combine_latest(path, ["ours"])
    assert found["ours"]["steps"] == r["steps"] and overrides == r["overrides"] and len(notes) == 1
    (results / f"{w.name}.sides.jsonl").unlink()
    assert run.combine_latest(path, ["ours"])[0]["ours"]["steps"] == [{"step": 9}]
    with pytest.raises(SystemExit, match="does not exist"):
        run.combine_latest(tmp_path / "none.jsonl", ["ours"])


def test_gpu_rows_run_the_learner_kernels_and_the_tiny_variant_does_not(tmp_path):
    """grpo-gpu and grpo-gpu-scale carry the measured kernel keys (no `--set` needed to reproduce a
    recorded row); the tuned row keeps them but leaves the token budget to the planner; the CPU
    variant (`tiny()`) runs none of them."""
    from benchmarks.workloads import LEARNER_KERNELS, our_overrides

    w = WORKLOADS["grpo-gpu"]
    plain = our_overrides(w, output_dir="x")
    assert set(LEARNER_KERNELS) <= set(plain) and "cluster.generator_engines=2" in plain
    assert set(LEARNER_KERNELS) <= set(our_overrides(WORKLOADS["grpo-gpu-scale"], output_dir="x"))
    _, tuned = side_plan(w, "ours-tuned", str(tmp_path / "t"), None)
    assert "learner.liger=true" in tuned and "learner.attention=varlen" in tuned
    assert not [o for o in tuned if o.startswith("learner.max_tokens_per_micro_batch")]
    cfg = load_config(w.recipe, plain)
    assert cfg.learner.liger and cfg.learner.pack_sequences and cfg.learner.max_tokens_per_micro_batch == 16384
    tiny = our_overrides(w.tiny(), output_dir="x")
    assert not set(LEARNER_KERNELS) & set(tiny) and not [o for o in tiny if o.startswith("cluster.generator")]
    assert our_overrides(replace(w, extra=(*w.extra, "learner.liger=false")), output_dir="x")[-1] == (
        "learner.liger=false")  # --set comes last: it wins


def test_a_stopped_side_leaves_nothing_and_its_leader_cleans_up_first(tmp_path):
    """`stop_group`: SIGTERM reaches the side's leader alone (ours shuts its Ray down on it), then
    SIGKILL takes what is left of its process group (here a child that ignores SIGTERM), well inside
    the grace."""
    import signal
    import time

    from benchmarks.run import STOP_GRACE_S, stop_group

    done = tmp_path / "cleaned"
    leader = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(300)'],"
        " stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(done)!r}, 'w').close(), sys.exit(143)))\n"
        "print(child.pid, flush=True)  # only now: the handler is in place\n"
        "time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    start = time.monotonic()
    stop_group(proc)
    assert time.monotonic() - start < STOP_GRACE_S / 2
    assert proc.returncode == 143 and done.exists()  # the leader ran its own clean-up
    def running(pid: int) -> bool:  # a zombie waiting for whoever adopted it counts as gone
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    for _ in range(100):
        if not running(child):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the leader's child outlived the stop")


def test_a_side_stopped_at_its_limit_writes_the_steps_it_finished(tmp_path):
    """`benchmarks.sidecommon.run_side`: the runner's SIGTERM (`stop_group`) ends a TRL side with its
    record written, the steps finished so far in it and the stop as its error, not with nothing."""
    from benchmarks.run import stop_group

    out = tmp_path / "side.json"
    side = (
        "import sys, time\n"
        "from benchmarks.sidecommon import run_side\n"
        "def body(record):\n"
        "    record['steps'] += [{'step': 0, 'step_s': 2.0}, {'step': 1, 'step_s': 1.0}]\n"
        "    print('two steps', flush=True)\n"
        "    time.sleep(300)\n"
        f"sys.exit(run_side('trl-vllm', {str(out)!r}, body))\n")
    proc = subprocess.Popen([sys.executable, "-c", side], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.readline().strip() == "two steps"
    stop_group(proc)
    record = json.loads(out.read_text())
    assert proc.returncode == 1 and not record["ok"]
    assert [s["step"] for s in record["steps"]] == [0, 1]
    assert record["error"] == "Stopped: stopped by SIGTERM (the runner's time limit)"


@pytest.mark.parametrize("first_side_s", [400.0, 100.0])
def test_a_deadline_shares_the_time_between_sides_in_turn(monkeypatch, tmp_path, capsys, first_side_s):
    """`--deadline 500` on one GPU, ours then TRL in turn (`run.wave_timeout`, as scale.py's layouts):
    ours may take 235 s, half of the 470 s left once 30 s are kept for stopping and the record. When
    ours takes 400 s (a fake clock), TRL (70 s left, under 90) is not started and its record says so;
    when ours takes 100 s, TRL gets the 370 s that are left."""
    import time
    from types import SimpleNamespace

    clock, limits = {"now": 1000.0}, {}
    monkeypatch.setattr(run, "time", SimpleNamespace(monotonic=lambda: clock["now"], time=time.time, sleep=time.sleep))
    monkeypatch.setattr(run, "visible_gpus", lambda env: ["0"])

    def side(w, name, gpus, *a, timeout=None, **kw):
        limits[name] = timeout
        clock["now"] += first_side_s if name == "ours" else 0.0
        return {"side": name, "ok": True, "gpus": gpus, "overrides": []}

    monkeypatch.setattr(run, "run_side", side)
    results, _, _ = run.run_sides(WORKLOADS["grpo-gpu"], ["ours", "trl-vllm"], _args(side_timeout=3600.0, deadline=500.0),
                                  model_path=str(tmp_path / "model"), workdir=tmp_path, env={}, end=1500.0)
    assert limits["ours"] == 235.0
    if first_side_s == 400.0:
        assert "trl-vllm" not in limits and not results["trl-vllm"]["ok"]
        assert results["trl-vllm"]["error"] == "not started: 70 s of --deadline 500 left"
        assert "[bench] trl-vllm: not started: 70 s of --deadline 500 left" in capsys.readouterr().out
    else:
        assert limits["trl-vllm"] == 370.0 and results["trl-vllm"]["ok"]


def test_a_side_stopped_after_some_steps_counts_and_the_record_says_so(monkeypatch, tmp_path):
    """A side stopped at its limit after step 0 and more (`summary.usable`) keeps its figures in the
    table, and the record's notes say which steps they are (`summary.stopped_line`)."""
    steps = [{"step": k, "step_s": 30.0 - k, "generate_s": 20.0, "gen_tokens": 262144, "train_s": 9.0} for k in range(3)]
    monkeypatch.setattr(run, "prepare_model", lambda w, workdir: str(tmp_path / "model"))
    monkeypatch.setattr(run, "visible_gpus", lambda env: ["0"])
    monkeypatch.setattr(run, "run_side", lambda w, name, gpus, *a, timeout=None, **kw: {
        "side": name, "ok": False, "timed_out": True, "timeout_s": 235.0, "gpus": gpus, "overrides": [],
        "steps": steps, "wall_s": 235.0, "error": "Stopped: stopped by SIGTERM (the runner's time limit)"})
    rc = run.main(["--workload", "grpo-gpu", "--only", "trl-vllm", "--workdir", str(tmp_path / "work"),
                   "--results", str(tmp_path / "results")])
    [record] = [json.loads(line) for line in (tmp_path / "results" / "grpo-gpu.jsonl").read_text().splitlines()]
    assert rc == 1 and record["summary"]["trl-vllm"]["step_s"] == 28.5  # steps 1-2
    assert "trl-vllm was stopped at its 235 s limit after 3 of 5 steps: its figures are steps 1-2" in record["notes"]


def test_gpu_busy_share_is_the_mean_utilization_after_start_up():
    from benchmarks.run import busy_sample
    from benchmarks.summary import busy_share, summarize

    assert parse_gpu_query("0, 87\n1, [N/A]\n", unit=1) == {"0": 87.0}
    assert busy_sample({"0": 80.0, "1": 40.0, "2": 0.0}, ["0", "1"]) == pytest.approx(0.6)
    assert busy_sample({}, None) is None and busy_sample({"3": 10.0}, ["0"]) is None
    samples = [(1.0, 0.0), (5.0, 0.1), (10.0, 0.9), (11.0, 0.5)]
    assert busy_share(samples, 10.0) == pytest.approx(0.7)  # start-up's idle seconds left out
    assert busy_share(samples, None) is None and busy_share([], 3.0) is None
    assert summarize({"steps": [], "gpu_busy_samples": samples, "startup_s": 5.0}, "grpo")["gpu_busy"] == \
        pytest.approx(0.5)


def test_a_side_whose_sampling_fails_is_stopped_not_left_running(monkeypatch, tmp_path):
    """An exception inside `launch` (here nvidia-smi's sample) stops the side's process group before it
    propagates: nothing of a side outlives the runner (a GPU machine keeps no stray run)."""
    import os

    import time

    pid_file = tmp_path / "pid"

    def broken(field: str, unit: float = 1024) -> dict[str, float]:
        deadline = time.monotonic() + 60  # the side is up first, so that there is something to stop
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("nvidia-smi answered garbage")

    monkeypatch.setattr(run, "gpu_query", broken)
    child = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)"
    with pytest.raises(RuntimeError, match="garbage"):
        run.launch([sys.executable, "-c", child], env={}, log=tmp_path / "log.txt", metrics=None, timeout=60,
                   poll_s=0.05)
    assert not run._RUNNING
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)
