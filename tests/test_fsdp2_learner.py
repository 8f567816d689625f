"""FSDP2 learner over gloo with 2 ranks == one plain PyTorch process on the same batch.

No Ray here: two processes from torch.multiprocessing, so a failure points at the learner itself.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlhf.batching import shard_for_rank
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.objectives import GRPOObjective
from rlhf.types import TrainBatch

LEARNER = LearnerConfig(lr=1e-3, micro_batch_size=2, max_grad_norm=1.0)


def make_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """5 rows (uneven over 2 ranks, 3 micro-batches on rank 0), ragged lengths, right padding."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompt = [9, 7, 12, 5, 10], 3
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    attn = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids[~attn] = 0
    loss_mask = attn & (torch.arange(t)[None, :] >= prompt)
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask,
                      advantages=torch.randn(len(lengths), generator=g))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, model_path: str, batch: TrainBatch, objective, out: str) -> None:
    from actors.fsdp2_learner import FSDP2Learner

    learner = FSDP2Learner(
        rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, model_path=model_path,
        model_cfg=ModelConfig(dtype="float32"), learner_cfg=LEARNER, temperature=1.0, with_reference=False, seed=0,
    )
    shard = shard_for_rank(batch, rank, world)
    lp = learner.logprobs(shard)
    metrics = learner.train_step(shard, objective)
    weights = {n: t for bucket in learner.iter_weight_buckets(2**20, torch.float32) for n, t in bucket}
    torch.save((rank, lp, metrics, weights), f"{out}/rank{rank}.pt")  # files, not a queue: tensors outlive the process
    learner.shutdown()


def reference_step(model_path: str, batch: TrainBatch, objective) -> tuple[torch.Tensor, float, float, dict]:
    """The same step, written plainly: one process, full batch, one forward."""
    from transformers import AutoModelForCausalLM

    from rlhf.logprobs import token_logprobs

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


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_two_fsdp2_ranks_match_single_process(tiny_qwen2, loss_agg, tmp_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_qwen2).vocab_size
    batch = make_batch(vocab)
    objective = GRPOObjective(loss_agg=loss_agg)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(tiny_qwen2), batch, objective, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    ref_lp, ref_loss, ref_grad_norm, ref_weights = reference_step(str(tiny_qwen2), batch, objective)
    lp = torch.cat([results[0][1], results[1][1]])
    torch.testing.assert_close(lp, ref_lp * batch.loss_mask, atol=1e-5, rtol=1e-5)
    metrics = results[0][2]
    assert metrics.loss == pytest.approx(ref_loss, abs=1e-5)
    assert results[1][2].loss == pytest.approx(ref_loss, abs=1e-5)  # every rank reports the reduced value
    assert metrics.num_tokens == int(batch.loss_mask.sum())
    weights = results[0][3]
    assert results[1][3] == {}  # only rank 0 holds full tensors
    assert weights.keys() == ref_weights.keys()
    assert metrics.grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
    # Adam's first step is lr * g / (|g| + eps): for near-zero gradients float reduction order moves
    # that by up to a few % of lr, so weights are compared to 5% of lr (lr = 1e-3).
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=5e-5, rtol=0, msg=name)
