"""The GPU-only paths, on one CUDA device: run on the GPU machine with `python -m pytest tests/gpu -v`.

- FlexAttention's backward (it has none on CPU): a packed-row train step under FlexAttention
  gives the loss, gradients and updated weights of the padded SDPA step.
- The colocated stack on a GPU (Ray + vLLM with sleep level 2 + FSDP2 + CUDA IPC weight sync +
  per-call seeds): after every sync the engine samples from the learner's weights (train/inference
  log-prob mismatch at fp32 noise), and a run resumed from a checkpoint repeats the uninterrupted
  run's next step.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlhf.config import LearnerConfig, ModelConfig
from rlhf.metrics import read_metrics
from rlhf.objectives import GRPOObjective
from rlhf.types import TrainBatch
from tests.runs import run_training

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lengths, prompt = [33, 17, 58, 9, 40, 25], 6
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    attn = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids[~attn] = 0
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=attn & (torch.arange(t)[None, :] >= prompt),
                      advantages=torch.randn(len(lengths), generator=g))


def _step(model_path: str, learner_cfg: LearnerConfig, batch: TrainBatch, dtype: str = "bfloat16"):
    from actors.fsdp2_learner import FSDP2Learner

    learner = FSDP2Learner(rank=0, world_size=1, master_addr="127.0.0.1", master_port=29533, model_path=model_path,
                           model_cfg=ModelConfig(dtype=dtype), learner_cfg=learner_cfg, temperature=1.0,
                           with_reference=False, seed=0)
    lp = learner.logprobs(batch)
    metrics = learner.train_step(batch, GRPOObjective())
    weights = {n: t.cpu() for b in learner.iter_weight_buckets(2**24, torch.float32, keep=True) for n, t in b}
    return lp, metrics, weights


def test_packed_rows_under_flex_attention_train_like_padded_rows(tiny_qwen2):
    """bf16 compute, as on GPUs (FlexAttention's Triton backward has no fp32 kernel choice on an
    H100: inductor's NoValidChoicesError); so bf16 tolerances."""
    from transformers import AutoConfig

    batch = _batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    base = LearnerConfig(lr=1e-3, micro_batch_size=2)
    lp, metrics, _ = _step(str(tiny_qwen2), base, batch)
    packed = replace(base, pack_sequences=True, max_tokens_per_micro_batch=96)  # attention auto: flex on a GPU
    lp2, metrics2, _ = _step(str(tiny_qwen2), packed, batch)
    torch.testing.assert_close(lp2, lp, atol=3e-2, rtol=0)
    assert metrics2.loss == pytest.approx(metrics.loss, abs=1e-3)
    assert metrics2.grad_norm == pytest.approx(metrics.grad_norm, rel=2e-2)


COMMON = ["model.path=tiny-qwen2", "model.dtype=float32", "learner.lr=1e-3", "grpo.prompts_per_step=8",
          "grpo.group_size=4", "generation.max_new_tokens=16", "generation.gpu_memory_utilization=0.2",
          "generation.enforce_eager=true", "data.num_train=64", "data.num_eval=4", "save_every=1", "eval_every=0",
          "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"]


def _train(out: Path, *extra: str) -> None:
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *COMMON, *extra, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_colocated_gpu_run_syncs_every_step_and_resumes(tmp_path):
    full = tmp_path / "full"
    _train(full, "grpo.steps=3")
    records = read_metrics(full / "metrics.jsonl")
    mismatch = [r["mismatch/logprob_abs_diff"] for r in records]
    print(f"\nmismatch per step (fp32, lr 1e-3): {mismatch}; sync s: {[r['timing/sync_s'] for r in records]}")
    assert all(m < 1e-3 for m in mismatch), mismatch  # a missed sync moves log-probs by ~1e-1 at this lr
    assert all(r["grad_norm"] > 0.1 for r in records)

    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003")
    kept = [r for r in records if r["step"] < 2]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    _train(resumed, "grpo.steps=3", "resume=true")
    again = read_metrics(resumed / "metrics.jsonl")[-1]
    assert again["step"] == 2
    for key in ("reward/mean", "response_len/mean", "loss"):
        assert again[key] == pytest.approx(records[2][key], rel=1e-3, abs=1e-5), key
