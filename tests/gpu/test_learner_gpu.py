"""Learner paths only a GPU runs: packed rows under FlexAttention's per-document mask (its Triton
backward has no CPU kernel) and the fast kernels (Liger, inductor, FlashAttention varlen) train like
padded rows, and packed rows compile no Triton kernel after the first step; one DPO run on GPU saves
a checkpoint and a resumed run repeats its next step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlhf.algo.objectives import GRPOObjective
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.types import TrainBatch
from tests.gpu.suite import resume_from, same_step, train
from tests.support.learners import ragged_batch, rendezvous_store

pytestmark = pytest.mark.gpu


def _batch(vocab: int) -> TrainBatch:
    return ragged_batch([133, 57, 258, 19, 140, 95, 201, 64], vocab=vocab, prompt=12)


def _learner(model_path: str, learner_cfg: LearnerConfig, port: int):
    """One bf16 learner rank in this process, its one-rank group joined through the store on `port`
    (`rendezvous_store(1)`, which the caller keeps alive)."""
    from actors.learner_base import LearnerRank

    return LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port,
                       model_path=model_path, model_cfg=ModelConfig(dtype="bfloat16"), learner_cfg=learner_cfg,
                       temperature=1.0, with_reference=False, seed=0, driver_store=True)


def _step(model_path: str, learner_cfg: LearnerConfig, batch: TrainBatch):
    """Log-probs and one train step of a fresh `_learner`."""
    import torch.distributed as dist

    store = rendezvous_store(1)
    learner = _learner(model_path, learner_cfg, store.port)
    try:
        lp = learner.logprobs(batch)
        metrics = learner.train_step(batch, GRPOObjective())
    finally:
        learner.shutdown()
        dist.destroy_process_group() if dist.is_initialized() else None
    return lp, metrics


def test_packed_rows_under_flex_attention_train_like_padded_rows(smollm2, figures):
    """SmolLM2-135M's real shape (GQA 9/3 heads of 64) in bf16, as GPUs train."""
    from transformers import AutoConfig

    batch = _batch(AutoConfig.from_pretrained(smollm2).vocab_size)
    base = LearnerConfig(lr=1e-5, micro_batch_size=4)
    lp, metrics = _step(str(smollm2), base, batch)
    packed = replace(base, pack_sequences=True, max_tokens_per_micro_batch=512, attention="flex_attention")
    _assert_same_step(batch, (lp, metrics), _step(str(smollm2), packed, batch), figures)


def _assert_same_step(batch: TrainBatch, want, got, figures) -> None:
    """Two learner steps on `batch` ((log-probs, metrics) each) agree within bf16's rounding; the gaps
    go to `figures`. Random tokens score about -13.7 in bf16, where two kernels round apart. Measured
    on CPU in bf16 on this batch (2026-11-25): padded rows in micro-batches of 4 vs 8 differ by mean
    0.023 / max 0.26; packed FlexAttention vs padded by mean 0.061 / max 0.42 (an H100: max 0.46);
    packed rows whose documents see each other (positions not restarting) by mean 0.42 / max 5.6."""
    (lp, metrics), (lp2, metrics2) = want, got
    gaps = (lp2 - lp)[batch.loss_mask].abs()
    figures.update(logprob_mean_gap=round(float(gaps.mean()), 4), logprob_max_gap=round(float(gaps.max()), 4),
                   loss=(metrics.loss, metrics2.loss), grad_norm=(metrics.grad_norm, metrics2.grad_norm))
    assert figures["logprob_mean_gap"] <= 0.15 and figures["logprob_max_gap"] <= 1.5, figures
    assert metrics2.loss == pytest.approx(metrics.loss, abs=2e-3)
    assert metrics2.grad_norm == pytest.approx(metrics.grad_norm, rel=3e-2)


FAST_KERNELS = {  # actors/learner_kernels.py, each against the eager rows under their padding mask
    "no-padding-mask": {},
    "liger": {"liger": True},
    "compile": {"compile": True, "cast_once_per_step": True},
    "varlen": {"pack_sequences": True, "attention": "varlen", "max_tokens_per_micro_batch": 512},
    "varlen-liger-cast": {"liger": True, "cast_once_per_step": True, "pack_sequences": True,
                          "attention": "varlen", "max_tokens_per_micro_batch": 512},
    "fused-head": {"head_kernels": "fused"},
}


@pytest.fixture
def restored_transformers():
    """Liger swaps classes and functions in transformers' modeling modules for the whole process:
    put them back, so later tests build the eager model."""
    import sys

    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the snapshot)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    modules = {n: dict(vars(m)) for n, m in sys.modules.items() if n.startswith("transformers.models.")}
    yield
    for name, saved in modules.items():
        vars(sys.modules[name]).update(saved)


@pytest.mark.parametrize("kernels", list(FAST_KERNELS))
def test_fast_kernels_train_like_eager_padded_rows(smollm2, kernels, figures, restored_transformers):
    """Each speed switch of the learner (Liger's kernels, compiled layers cast once per step, packed
    rows under FlashAttention's varlen kernel, padded rows without their mask, the fused head's
    compiled chunk kernels) on SmolLM2 in bf16:
    the eager masked rows' log-probs, loss and gradient norm, within bf16's rounding (the bounds of
    the FlexAttention test above)."""
    from transformers import AutoConfig

    batch = _batch(AutoConfig.from_pretrained(smollm2).vocab_size)
    base = LearnerConfig(lr=1e-5, micro_batch_size=4, padding_mask=True)
    fast = replace(base, padding_mask=False, **FAST_KERNELS[kernels])
    _assert_same_step(batch, _step(str(smollm2), base, batch), _step(str(smollm2), fast, batch), figures)


def _two_steps_compiles(model_path: str, learner_cfg: LearnerConfig, lengths: list[list[int]]) -> list[float]:
    """`perf/jit_compiles` of one learner's train steps on rows of these lengths (run in a fresh
    process: Triton's kernels compiled by earlier tests live in this one)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    store = rendezvous_store(1)
    learner = _learner(model_path, learner_cfg, store.port)
    try:
        return [learner.train_step(ragged_batch(rows, vocab=vocab, prompt=12), GRPOObjective()).values[
            "perf/jit_compiles"] for rows in lengths]
    finally:
        learner.shutdown()


def test_packed_rows_compile_no_triton_kernel_after_the_first_step(smollm2, figures):
    """Liger's RoPE and RMSNorm kernels take a packed row's length, and Triton compiles a kernel again
    for an integer argument that is a multiple of 16 when it was not before (or the other way): the
    rows are topped up to a multiple of 16 (`actors.learner_forward.PACK_MULTIPLE`), so a second step
    whose rows are multiples of 16 (the first's were not) compiles nothing (`perf/jit_compiles`)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    cfg = replace(LearnerConfig(lr=1e-5), **FAST_KERNELS["varlen-liger-cast"])
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        compiles = pool.submit(_two_steps_compiles, str(smollm2), cfg, [[401, 389], [400, 384]]).result()
    figures.update(jit_compiles=compiles)
    assert compiles[0] > 0 and compiles[1] == 0, figures


DPO = "configs/dpo_smollm2_cpu.yaml"
DPO_ARGS = ("dpo.max_steps=2", "save_every=1", "eval_every=0", "learner.micro_batch_size=8",
            "learner.backend=deepspeed", "learner.zero_stage=3")


def test_dpo_on_zero3_saves_and_resumes(smollm2, tmp_path, figures):
    """DPO with its frozen reference, on DeepSpeed ZeRO-3: the checkpoint a GPU run saves (DeepSpeed's
    shards, the HF export) loads, and the resumed run repeats step 1's loss."""
    full = train("scripts/train_dpo.py", DPO, tmp_path / "full", *DPO_ARGS)
    losses = full.series("loss")
    figures.update(losses=losses, run_s=round(full.seconds, 1))
    assert len(losses) == 2 and losses[0] == pytest.approx(0.6931, abs=2e-3)  # policy = reference at step 0
    resumed = resume_from(full, 1, tmp_path / "resumed", "scripts/train_dpo.py", DPO, *DPO_ARGS)
    figures.update(resumed_loss=resumed.records[-1]["loss"], resume_run_s=round(resumed.seconds, 1))
    assert resumed.records[-1]["step"] == 1
    assert not same_step(full.records[1], resumed.records[-1], ("loss",))
