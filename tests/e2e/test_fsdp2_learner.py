"""FSDP2 learner over gloo with 2 ranks == one plain PyTorch process on the same batch (GRPO, DPO).

No Ray here: two processes from torch.multiprocessing, so a failure points at the learner itself.
One spawn of the two ranks runs every 2-rank case in turn (a fresh learner each, in the ranks'
one gloo group) and writes each case's results to its own files; the tests below check one case
each against the single-process reference. (A spawn per case cost ~10 s of imports each.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf.algo.objectives import DPOObjective, GRPOObjective
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.data.batching import shard_for_rank
from rlhf.types import PreferenceBatch, TrainBatch
from tests.support.learners import attach_reference, make_batch, make_pairs, rendezvous_store, spawn_ranks

LEARNER = LearnerConfig(lr=1e-3, micro_batch_size=2, max_grad_norm=1.0)


def _make_learner(rank: int, world: int, port: int, model_path: str, learner_cfg: LearnerConfig,
                  with_reference: bool):
    """A fresh learner (model, optimizer, seed 0); the first one made in a process joins the group."""
    from actors.learner_base import LearnerRank

    return LearnerRank(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, model_path=model_path,
        model_cfg=ModelConfig(dtype="float32"), learner_cfg=learner_cfg, temperature=1.0,
        with_reference=with_reference, seed=0, driver_store=True,
    )


def _grpo_case(learner, rank: int, world: int, batch: TrainBatch, objective, out: str, train: bool = True) -> None:
    shard = shard_for_rank(batch, rank, world)
    lp = learner.logprobs(shard)
    metrics, weights = None, {}
    if train:
        metrics = learner.train_step(shard, objective)
        # Every rank keeps the full tensors, as when each feeds the colocated engine on its own device.
        weights = {n: t for bucket in learner.iter_weight_buckets(2**20, torch.float32, keep=True) for n, t in bucket}
        assert_cast_before_gather(learner, weights)
    torch.save((rank, lp, metrics, weights), f"{out}/rank{rank}.pt")  # files, not a queue: tensors outlive the process


def assert_cast_before_gather(learner, weights: dict[str, torch.Tensor]) -> None:
    """A bf16 push gathers shards already cast to bf16: the same tensors as the fp32 ones cast after."""
    pushed = {n: t for bucket in learner.iter_weight_buckets(2**20, torch.bfloat16, keep=True) for n, t in bucket}
    assert pushed.keys() == weights.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, weights[n].to(torch.bfloat16)) for n, t in pushed.items())


def reference_step(model_path: str, batch: TrainBatch, objective) -> tuple[torch.Tensor, float, float, dict]:
    """The same step, written plainly: one process, full batch, one forward."""
    from transformers import AutoModelForCausalLM

    from rlhf.algo.logprobs import token_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNER.lr, betas=LEARNER.betas, weight_decay=LEARNER.weight_decay)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = token_logprobs(logits.float(), batch.input_ids, batch.loss_mask)
    loss, _ = objective(lp, batch, objective.num_units(batch))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), LEARNER.max_grad_norm)
    opt.step()
    return lp.detach(), float(loss.detach()), float(grad_norm), {n: p.detach().clone() for n, p in model.state_dict().items()}


# Rows 9, 7, 12 | 5, 10 tokens on ranks 0 | 1. A budget of 24 tokens gives rank 0 the micro-batches
# [12, 9] and [7] (out of row order) and rank 1 one, [10, 5], plus a dummy pass to match rank 0.
# "packed-flex": the same budget, each micro-batch one padding-free row under FlexAttention's
# per-document mask (the kernel the learner picks for packed rows on a GPU) and the fused head.
# FlexAttention has no backward on CPU: here its log-probs are checked, its gradients on a GPU
# (tests/gpu/test_learner_gpu.py).
# "packed-varlen": the same packed rows through the varlen attention path (SDPA per document on
# CPU, FlashAttention's varlen kernel on a GPU). "cast-once": each layer gathered and cast once per
# step, gradients accumulated unsharded. "padding-mask": padded rows with the mask (the default
# leaves it out: right padding cannot reach a real token through a causal kernel). "keep-logits":
# packed-varlen with the fused head keeping its logits for backward (the scored rows only).
LAYOUTS = {"fixed": LEARNER, "token-budget": replace(LEARNER, max_tokens_per_micro_batch=24),
           "packed-flex": replace(LEARNER, max_tokens_per_micro_batch=24, pack_sequences=True,
                                  attention="flex_attention"),
           "packed-varlen": replace(LEARNER, max_tokens_per_micro_batch=24, pack_sequences=True, attention="varlen"),
           "cast-once": replace(LEARNER, cast_once_per_step=True),
           "padding-mask": replace(LEARNER, padding_mask=True),
           "keep-logits": replace(LEARNER, max_tokens_per_micro_batch=24, pack_sequences=True,
                                  attention="varlen", head_keep_logits=True)}


GRPO_CASES = [*((layout, agg) for layout in ("fixed", "token-budget") for agg in ("token-mean", "seq-mean-token-mean")),
              ("packed-varlen", "token-mean"), ("cast-once", "seq-mean-token-mean"),
              ("padding-mask", "token-mean"), ("keep-logits", "token-mean")]


@pytest.mark.parametrize(("layout", "loss_agg"), GRPO_CASES)
def test_two_fsdp2_ranks_match_single_process(two_ranks, tiny_qwen2, loss_agg, layout):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_qwen2).vocab_size
    batch = make_batch(vocab)  # the batch the ranks stepped on (seeded)
    objective = GRPOObjective(loss_agg=loss_agg)
    results = [torch.load(two_ranks / f"{layout}-{loss_agg}" / f"rank{r}.pt", weights_only=False) for r in range(2)]

    ref_lp, ref_loss, ref_grad_norm, ref_weights = reference_step(str(tiny_qwen2), batch, objective)
    lp = torch.cat([results[0][1], results[1][1]])
    torch.testing.assert_close(lp, ref_lp * batch.loss_mask, atol=1e-5, rtol=1e-5)
    metrics = results[0][2]
    assert metrics.loss == pytest.approx(ref_loss, abs=1e-5)
    assert results[1][2].loss == pytest.approx(ref_loss, abs=1e-5)  # every rank reports the reduced value
    assert metrics.num_tokens == int(batch.loss_mask.sum())
    weights = results[0][3]
    assert results[1][3].keys() == weights.keys()  # each rank gathered the same full tensors
    for name, tensor in weights.items():
        assert torch.equal(results[1][3][name], tensor), name
    assert weights.keys() == ref_weights.keys()
    assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
    # Adam's first step is lr * g / (|g| + eps): for near-zero gradients float reduction order moves
    # that by up to a few % of lr, so weights are compared to 5% of lr (lr = 1e-3).
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=5e-5, rtol=0, msg=name)


def test_compiled_layers_train_like_eager_layers(tiny_qwen2, tmp_path, monkeypatch):
    """`learner.compile` with the layers cast once per step: the eager single process's log-probs,
    loss, gradient norm and updated weights. On CPU the captured graphs run through dynamo's `eager`
    backend (inductor's C++ build takes minutes on 2 cores); inductor's kernels are checked against
    eager on a GPU (tests/gpu/test_learner_gpu.py)."""
    from transformers import AutoConfig

    monkeypatch.setenv("RLHF_COMPILE_BACKEND", "eager")  # read when the learner compiles its layers

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    cfg = replace(LEARNER, compile=True, cast_once_per_step=True)
    # One rank in this process (as in _one_rank below): a spawned process would only add its imports.
    store = rendezvous_store(1)
    learner = _make_learner(0, 1, store.port, str(tiny_qwen2), cfg, with_reference=False)
    try:
        _grpo_case(learner, 0, 1, batch, GRPOObjective(), str(tmp_path))
    finally:
        _close(learner)
    _, lp, metrics, weights = torch.load(tmp_path / "rank0.pt", weights_only=False)
    ref_lp, ref_loss, ref_grad_norm, ref_weights = reference_step(str(tiny_qwen2), batch, GRPOObjective())
    torch.testing.assert_close(lp, ref_lp * batch.loss_mask, atol=1e-4, rtol=1e-4)
    assert metrics.loss == pytest.approx(ref_loss, abs=1e-4)
    assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=1e-4)
    assert weights.keys() == ref_weights.keys()  # compiling renamed nothing
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=5e-5, rtol=0, msg=name)


def test_packed_rows_under_flex_attention_match_padded_rows(two_ranks, tiny_qwen2):
    """Token-budget micro-batches packed into one row each, FlexAttention with the per-document mask
    and the fused head: the same log-probs as the plain padded forward (both ranks, every row)."""
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    lp = torch.cat([torch.load(two_ranks / "packed-flex" / f"rank{r}.pt", weights_only=False)[1] for r in range(2)])
    ref_lp = reference_step(str(tiny_qwen2), batch, GRPOObjective())[0]
    assert bool(batch.loss_mask.any())
    torch.testing.assert_close(lp, ref_lp * batch.loss_mask, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# DPO: a few steps on preference pairs, reference log-probs from the learners' frozen reference.

DPO_STEPS = 3


def _dpo_case(learner, rank: int, world: int, batch: PreferenceBatch, objective, out: str) -> None:
    shard = shard_for_rank(batch, rank, world)
    shard = attach_reference(shard, learner.logprobs(shard, reference=True))
    steps = [learner.train_step(shard, objective) for _ in range(DPO_STEPS)]
    torch.save(steps, f"{out}/rank{rank}.pt")


def reference_dpo_steps(model_path: str, batch: PreferenceBatch, objective) -> list[tuple[float, float, float]]:
    """The same steps in one process on the whole batch: (loss, grad_norm, reward accuracy) each."""
    from transformers import AutoModelForCausalLM

    from rlhf.algo.logprobs import token_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        ref_lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                               batch.input_ids, batch.loss_mask)
    batch = attach_reference(batch, ref_lp)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNER.lr, betas=LEARNER.betas, weight_decay=LEARNER.weight_decay)
    out = []
    for _ in range(DPO_STEPS):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss, metrics = objective(token_logprobs(logits, batch.input_ids, batch.loss_mask), batch, len(batch))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), LEARNER.max_grad_norm)
        opt.step()
        opt.zero_grad()
        out.append((float(loss.detach()), float(grad_norm), metrics["rewards/accuracy"] / len(batch)))
    return out


def _dpo_cfg(layout: str) -> LearnerConfig:
    return replace(LEARNER, pack_sequences=layout == "packed", share_prompts=layout == "shared",
                   micro_batch_size=2 if layout == "padded" else 4)


DPO_CASES = [("sigmoid", "padded"), ("ipo", "packed"), ("sigmoid", "shared")]


@pytest.mark.parametrize(("loss_type", "layout"), DPO_CASES, ids=["sigmoid", "ipo-packed", "sigmoid-shared-prompts"])
def test_dpo_steps_on_two_fsdp2_ranks_match_single_process(two_ranks, tiny_qwen2, loss_type, layout):
    """Chosen and rejected of a pair stay in one micro-batch (micro_batch_size=2 rows = 1 pair), the
    reference is the learners' frozen copy, losses are normalized over all ranks' pairs; with
    packing, the micro-batch runs as one padding-free row; with shared prompts, each pair's prompt
    runs once with both responses after it."""
    from transformers import AutoConfig

    batch = make_pairs(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)  # the pairs the ranks stepped on
    objective = DPOObjective(beta=0.1, loss_type=loss_type)
    steps = torch.load(two_ranks / f"dpo-{loss_type}-{layout}" / "rank0.pt", weights_only=False)
    want = reference_dpo_steps(str(tiny_qwen2), batch, objective)
    for got, (loss, grad_norm, accuracy) in zip(steps, want):
        assert got.loss == pytest.approx(loss, abs=1e-5)
        assert got.grad_norm == pytest.approx(grad_norm, rel=1e-4)
        assert got.values["rewards/accuracy"] == pytest.approx(accuracy)
    assert steps[0].loss == pytest.approx(0.6931472 if loss_type == "sigmoid" else 0.25 / 0.01, rel=1e-5)
    assert steps[-1].loss < steps[0].loss  # the same pairs three times: the loss goes down


# ------------------------------------------------------------------------------------------------
# One spawn of the two ranks for every 2-rank case above


def _cases_main(rank: int, world: int, port: int, model_path: str, batch: TrainBatch, pairs: PreferenceBatch,
                out: str) -> None:
    """Every 2-rank case in turn, each on a fresh learner (model, optimizer and seed anew) in the
    group the first one joined: `<out>/<case>/rank<rank>.pt`."""
    import os

    import torch.distributed as dist

    def folder(case: str) -> str:
        os.makedirs(f"{out}/{case}", exist_ok=True)  # both ranks make it
        return f"{out}/{case}"

    for layout, agg in GRPO_CASES:
        learner = _make_learner(rank, world, port, model_path, LAYOUTS[layout], with_reference=False)
        _grpo_case(learner, rank, world, batch, GRPOObjective(loss_agg=agg), folder(f"{layout}-{agg}"))
    learner = _make_learner(rank, world, port, model_path, LAYOUTS["packed-flex"], with_reference=False)
    _grpo_case(learner, rank, world, batch, GRPOObjective(), folder("packed-flex"), train=False)
    for loss_type, layout in DPO_CASES:
        learner = _make_learner(rank, world, port, model_path, _dpo_cfg(layout), with_reference=True)
        _dpo_case(learner, rank, world, pairs, DPOObjective(beta=0.1, loss_type=loss_type),
                  folder(f"dpo-{loss_type}-{layout}"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen2, tmp_path_factory):
    """The folder of every 2-rank case's results (one spawn of the ranks for the module)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_qwen2).vocab_size
    out = tmp_path_factory.mktemp("fsdp2-ranks")
    spawn_ranks(_cases_main, str(tiny_qwen2), make_batch(vocab), make_pairs(vocab), str(out))
    return out


def _one_rank(model_path: str, objective_kl: float):
    """One FSDP2 rank with a reference model in this process (its own one-rank group on a kernel-picked
    port), and the objective with a KL term."""
    from actors.learner_base import LearnerRank

    store = rendezvous_store(1)
    learner = LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port,
                           model_path=model_path, model_cfg=ModelConfig(dtype="float32"), learner_cfg=LEARNER,
                           temperature=1.0, with_reference=True, seed=0, driver_store=True)
    return learner, store, GRPOObjective(kl_coef=objective_kl)


def _close(learner) -> None:
    import torch.distributed as dist

    learner.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_update_on_the_rank_equals_the_driver_round_trip(tiny_qwen2):
    """`update` computes the reference and old log-probs on the rank and takes the optimizer steps
    there: the same losses, KL, gradient norms and weights as the former sequence of calls whose
    log-probs went to the driver and back."""
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    learner, _store, objective = _one_rank(str(tiny_qwen2), 0.1)
    try:
        on_rank = learner.update(replace(batch), objective, reference=True, updates=2)
        weights = {n: t.clone() for b in learner.iter_weight_buckets(2**20, torch.float32, keep=True) for n, t in b}
        assert_cast_before_gather(learner, weights)  # one rank: the local shard is the whole tensor
    finally:
        _close(learner)
    learner, _store, objective = _one_rank(str(tiny_qwen2), 0.1)
    try:
        driven = replace(batch, ref_logprobs=learner.logprobs(batch, reference=True), old_logprobs=learner.logprobs(batch))
        for _ in range(2):
            metrics = learner.train_step(driven, objective)
        expected = {n: t.clone() for b in learner.iter_weight_buckets(2**20, torch.float32, keep=True) for n, t in b}
    finally:
        _close(learner)
    assert (on_rank.loss, on_rank.grad_norm, on_rank.values["kl"]) == (metrics.loss, metrics.grad_norm,
                                                                       metrics.values["kl"])
    assert on_rank.values["kl"] > 0  # the second update moved the policy away from the reference
    assert expected.keys() == weights.keys() and all(torch.equal(expected[n], weights[n]) for n in expected)


def test_the_learner_freezes_its_heap_after_start_up_and_its_first_step(tiny_qwen2):
    """"Frozen heap": the constructor freezes what it built and the first train step what survives it,
    so later steps leave the collector only their own young objects; later steps freeze nothing more,
    and the shutdown leaves nothing frozen."""
    import gc

    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    store = rendezvous_store(1)
    learner = _make_learner(0, 1, store.port, str(tiny_qwen2), LEARNER, with_reference=False)
    try:
        built = gc.get_freeze_count()
        learner.train_step(batch, GRPOObjective())
        first, young = gc.get_freeze_count(), len(gc.get_objects())
        learner.train_step(batch, GRPOObjective())
        later = gc.get_freeze_count()
    finally:
        _close(learner)
    assert built > 100_000  # torch, transformers and the model, at least
    assert first >= built and young < first // 20
    assert later <= first  # frozen objects still die by refcount; a second freeze would add the step's
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_train_step_reports_the_collector_pausing_it(tiny_qwen2):
    """"Host stalls": a full collection inside a train step (forced here by a forward hook) shows in
    that step's `perf/gc_s` and `perf/gc_full`; a CPU learner has no caching allocator or Triton
    compiles to report."""
    import gc

    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(tiny_qwen2).vocab_size)
    store = rendezvous_store(1)
    learner = _make_learner(0, 1, store.port, str(tiny_qwen2), LEARNER, with_reference=False)
    def collect(*_) -> None:  # returns nothing, so the forward's output stands
        gc.collect()

    try:
        hook = learner.model.register_forward_hook(collect)
        paused = learner.train_step(batch, GRPOObjective()).values
        hook.remove()
    finally:
        _close(learner)
    assert paused["perf/gc_full"] >= 1 and paused["perf/gc_s"] > 0
    assert not {"perf/device_mallocs", "perf/alloc_retries", "perf/jit_compiles", "perf/jit_s"} & set(paused)
