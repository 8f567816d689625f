"""Faults of rewards and actors, and the compute dtype by CPU capability.

Unit level: injected reward faults are counted per cause, exactly; a reward failing on every
sample stops the run after `reward.max_failed_steps` steps; a fan-out whose straggler hangs ends
after `cluster.timeout_s`; bf16 becomes fp32 on a CPU capped to AVX2.
End to end (tiny recipe, real stack): a run whose reward faults on ~50% of samples finishes with
the exact counts; SIGKILL of a learner rank, of the engine and of the reward worker each end the run
in bounded time with one line; resuming after each continues exactly; a damaged latest checkpoint
is refused before Ray starts and `resume=previous` resumes from the one before.
"""

from __future__ import annotations

import collections
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.grpo import RewardFailure, RewardHealth
from tests.support.runs import kill_titled, private_ray_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from faulty_rewards import fault_of  # noqa: E402

FAULTY = str(ROOT / "tests" / "fixtures" / "faulty_rewards.py")


# ---------------------------------------------------------------------------------------------
# Rewards


def test_injected_reward_faults_score_zero_and_are_counted_per_cause(tmp_path, monkeypatch):
    from rewards import RewardPool

    completions = [f"c{i}" for i in range(40)]
    want = collections.Counter(fault_of(c) for c in completions)
    assert all(want[f] >= 2 for f in ("nonfinite", "not_a_number", "exception", "timeout", "worker_died"))
    monkeypatch.setenv("RLHF_FAULT_LOG", str(tmp_path / "faults.log"))
    # 3 s: a limit the samples that do not hang beat by far, even on a loaded machine
    with RewardPool([f"{FAULTY}:faulty"], timeout_s=3.0, num_workers=2) as pool:
        rewards, metrics = pool.score(["Q"] * 40, completions, [{}] * 40)
    assert all(math.isfinite(r) for r in rewards)
    assert [r for r, c in zip(rewards, completions) if fault_of(c)] == [0.0] * sum(1 for c in completions if fault_of(c))
    for cause in ("nonfinite", "not_a_number", "exception", "worker_died"):
        assert metrics[f"reward/failed/{cause}"] == want[cause], cause
    assert metrics["reward/timeouts"] == want["timeout"]
    assert metrics["reward/failed"] == sum(want[c] for c in want if c not in (None, "timeout"))
    assert metrics["reward/faulty/failed_frac"] == pytest.approx(1 - want[None] / 40)
    assert sorted((tmp_path / "faults.log").read_text().split()) == sorted(c for c in map(fault_of, completions) if c)
    counts = ", ".join(f"{want[c]} {c}" for c in ("exception", "not_a_number", "nonfinite", "worker_died"))
    assert re.fullmatch(rf"reward {re.escape(FAULTY)}:faulty: {40 - want[None]}/40 samples failed or timed out "
                        rf"\({want['timeout']} timed out \(reward.timeout_s=3\), {counts}; first error: .+\); "
                        r"scored 0", pool.warnings[0]), pool.warnings


def test_a_reward_failing_on_every_sample_stops_the_run_after_n_steps():
    health = RewardHealth(max_failed_steps=3)
    broken = {"reward/failed/exception": 16.0, "reward/timeouts": 0.0, "reward/always_fails/failed_frac": 1.0,
              "reward/ok/failed_frac": 0.0}
    partly = {**broken, "reward/always_fails/failed_frac": 0.5}
    health.check(broken)
    health.check(broken)
    health.check(partly)  # one good sample resets the count
    health.check(broken)
    health.check(broken)
    with pytest.raises(RewardFailure) as err:
        health.check(broken)
    assert str(err.value) == ("reward always_fails failed on every sample for 3 steps in a row "
                              "(reward.max_failed_steps=3; last step: 16 exception failures, 0 time-outs; "
                              "details in the reward worker's log)")


# ---------------------------------------------------------------------------------------------
# Compute dtype


def _decide(env: dict[str, str]) -> list[str]:
    code = ("from actors.device import compute_dtype, cpu_capability; "
            "print(compute_dtype('bfloat16', 'cpu')[0], compute_dtype('auto', 'cpu')[0], "
            "compute_dtype('auto', 'cuda')[0], compute_dtype('float32', 'cpu')[0]); print(cpu_capability())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    return out


def test_bf16_computes_in_fp32_on_a_cpu_capped_to_avx2():
    """The issue's laptop CPU, forced on any x86 host: ATen and oneDNN capped to AVX2."""
    decided, capability = _decide({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert decided.split() == ["float32", "float32", "bfloat16", "float32"]
    assert capability.startswith("ATen AVX2, oneDNN bf16 off") and capability.endswith("(emulated bf16)")


def _cache_root(env: dict[str, str]) -> str:
    code = "import os; from actors.device import isolate_cpu_compile_cache as f; f(); f(); print(os.environ['VLLM_CACHE_ROOT'])"
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


def test_vllm_compile_caches_are_kept_apart_per_cpu_capability(tmp_path):
    """An AVX-512 artifact loaded under an AVX2 cap made vLLM-CPU recompile over its mapped file
    (SIGBUS at the first weight sync): each capability gets a cache of its own, under the user's root."""
    base = {"VLLM_CACHE_ROOT": str(tmp_path)}
    capped = _cache_root({**base, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert capped == str(tmp_path / "cpu-avx2-onednn-avx2")  # called twice: nested once
    assert _cache_root({**base, "ATEN_CPU_CAPABILITY": "default"}) == str(tmp_path / "cpu-default-onednn-any")
    assert Path(_cache_root({})).parent == Path(os.path.expanduser("~/.cache/vllm"))


def test_the_settled_dtype_is_printed_once_and_is_what_actors_see(monkeypatch, capsys):
    import actors.device
    from rlhf.config import load_config
    from scripts.launch import with_compute_dtype

    monkeypatch.setattr(actors.device, "cpu_bf16", lambda: (False, "ATen AVX2, oneDNN bf16 off"))
    monkeypatch.setattr(actors.device, "detect", lambda: actors.device.CpuDevice())
    cfg = with_compute_dtype(load_config(None, ["model.dtype=bfloat16"]))
    assert cfg.model.dtype == "float32"
    assert capsys.readouterr().out == ("model.dtype: bfloat16 -> float32: this CPU has no native bf16 (ATen AVX2, "
                                       "oneDNN bf16 off), where bf16 runs many times slower than fp32\n")
    assert with_compute_dtype(load_config(None, ["model.dtype=auto"])).model.dtype == "float32"
    monkeypatch.setattr(actors.device, "cpu_bf16", lambda: (True, "ATen AVX512"))
    assert with_compute_dtype(load_config(None, ["model.dtype=auto"])).model.dtype == "bfloat16"
    assert with_compute_dtype(load_config(None, ["model.dtype=bfloat16"])).model.dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------
# A hung straggler in a fan-out


class Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def nap_until(self, end: float) -> float:
        time.sleep(max(0.0, end - time.time()))
        return end


@pytest.mark.ray
def test_a_straggler_that_hangs_is_named_after_the_timeout():
    import ray
    from ray import cloudpickle

    import actors.actor_group as ag

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # two pairs, each actor up before the 2 s limit is set (a worker process can take seconds to start)
        actors, fresh = ([ray.remote(Sleeper).options(num_cpus=0).remote() for _ in range(2)] for _ in range(2))
        assert ag.gather([a.nap.remote(0.0) for a in actors + fresh], list("abcd"), "warm-up") == [0.0] * 4
        old = ag.TIMEOUT_S
        ag.set_timeout(2.0)
        try:
            with pytest.raises(ag.ActorFailure, match=r"^learner rank 1 did not finish train_step within 2 s of "
                                                      r"the other actors \(hung; cluster.timeout_s\)$"):
                ag.gather([actors[0].nap.remote(0.1), actors[1].nap.remote(3600)], ["learner rank 0", "learner rank 1"],
                          "train_step")  # unlimited, actor 1 naps for an hour
            # A long call is no fault while every actor is still on it (the fresh pair: actor 1 still naps).
            # Both answer at one wall-clock time, 3 s on: however late either call starts, they end together.
            end = time.time() + 3.0
            assert ag.gather([a.nap_until.remote(end) for a in fresh], ["a", "b"], "long") == [end, end]
        finally:
            ag.set_timeout(old)
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------
# End to end: the tiny recipe on the real stack

STEPS = 4
E2E = [f"grpo.steps={STEPS}", "save_every=1", "learner.lr=1e-3", "data.num_train=32", "data.num_eval=4",
       f"reward.functions=[{{function: '{FAULTY}:faulty'}}]", "reward.timeout_s=1", "cluster.timeout_s=60"]
# Everything that must repeat exactly on resume (timings never do), the fault counts included.
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "grad_norm", "response_len/mean", "reward/timeouts",
                 "reward/failed/nonfinite", "reward/failed/not_a_number", "reward/failed/exception",
                 "reward/failed/worker_died"]
LAST_LINE = re.compile(r"error: (?P<actor>learner rank [01]|engine 0|reward worker) (died|became unreachable) during "
                       r"(?P<phase>[\w -]+)(\s*\(|:).*\. Resume from (?P<ckpt>\S+/checkpoints/step_\d{6}) with resume=true")


def start(out: Path, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml", f"output_dir={out}",
           *E2E, *extra]
    env = private_ray_env()
    env["RLHF_FAULT_LOG"] = str(out / "faults.log")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out / "stdout.txt", "w"),
                            stderr=open(out / "stderr.txt", "w"), start_new_session=True)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 900) -> tuple[int, str]:
    """Exit status and the one `error:` line on stderr ("" if none; among progress bars and Ray's
    notes); the process group is gone afterwards."""
    try:
        code = proc.wait(timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of Ray, if any
        except ProcessLookupError:
            pass
    errors = [s for s in re.split(r"[\r\n]", (out / "stderr.txt").read_text()) if s.startswith("error:")]
    assert len(errors) <= 1, errors
    return code, errors[0] if errors else ""


def kill_actor(proc: subprocess.Popen, title: str, ready) -> None:
    """SIGKILL the run's process whose title contains `title` once `ready()`."""
    deadline = time.time() + 600
    while not ready():
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        time.sleep(0.2)
    kill_titled(proc.pid, title)


def newer_checkpoint(out: Path, than: int):
    from rlhf.run.checkpoint import latest_checkpoint

    def ready() -> bool:
        path = latest_checkpoint(out)
        return path is not None and int(path.name.split("_")[1]) > than
    return ready


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run with the faulty reward."""
    out = tmp_path_factory.mktemp("reference")
    code, last = finish(start(out), out)
    assert code == 0, last
    return out


@pytest.mark.e2e
@pytest.mark.ray
def test_reward_faults_are_counted_exactly_and_the_run_finishes(reference):
    from rlhf.run.metrics import read_metrics

    records = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    injected = collections.Counter((reference / "faults.log").read_text().split())
    for cause in ("nonfinite", "not_a_number", "exception", "worker_died"):
        assert sum(r[f"reward/failed/{cause}"] for r in records) == injected[cause], cause
    assert sum(r["reward/timeouts"] for r in records) == injected["timeout"]
    assert sum(injected.values()) > 0
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    # The reward worker returns each step's warning line and the driver prints it on the terminal:
    # one line per step where the function failed or timed out on over reward.warn_failed_frac (0.1).
    warned = [line for line in (reference / "stdout.txt").read_text().splitlines()
              if line.startswith(f"reward {FAULTY}:faulty: ")]
    over = [r for r in records if r["reward/faulty/failed_frac"] > 0.1]
    assert over and len(warned) == len(over), warned
    assert all(re.search(r": \d+/16 samples (failed|timed out|failed or timed out) \(.*\); scored 0$", w)
               for w in warned), warned


@pytest.mark.e2e
@pytest.mark.ray
def test_killed_actors_end_the_run_with_one_line_and_resume_continues_exactly(reference, tmp_path):
    """A learner rank, then the engine, then the reward worker is SIGKILLed, each after one more
    checkpoint; each run exits 1 naming the actor (dead, not hung) and the checkpoint.
    Then the latest checkpoint is damaged: resume=true refuses it (exit 2, before Ray), and
    resume=previous continues from the one before into the uninterrupted run's metrics."""
    from rlhf.run.metrics import read_metrics

    out = tmp_path / "run"
    for n, (title, actor) in enumerate([("ray::LearnerRank", "learner rank"), ("ray::VLLMGenerator", "engine 0"),
                                        ("ray::RewardWorker", "reward worker")]):
        proc = start(out, *(["resume=true"] if n else []))
        kill_actor(proc, title, newer_checkpoint(out, than=n))
        code, last = finish(proc, out)
        assert code == 1, (code, last)  # a death, not a hang: LAST_LINE says `died`, not `did not finish`
        match = LAST_LINE.fullmatch(last)
        assert match and match["actor"].startswith(actor), last
        assert Path(match["ckpt"]).name >= f"step_{n + 1:06d}", last

    from rlhf.run.checkpoint import latest_checkpoint

    latest = latest_checkpoint(out)
    shard = sorted((latest / "train_state").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = start(out, "resume=true")
    code, last = finish(proc, out, timeout=120)
    assert code == 2 and last.startswith(f"error: the latest checkpoint is damaged: {shard} has "), last
    assert "Started a local Ray instance" not in (out / "stderr.txt").read_text()

    code, last = finish(start(out, "resume=previous"), out)
    assert code == 0, last
    want, got = read_metrics(reference / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    for w, g in zip(want, got):
        for key in DETERMINISTIC:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)
