"""Batches and spawned gloo ranks for the learner tests (FSDP2, DeepSpeed, LoRA, planted files).

The ranks join a TCPStore this process serves on a port the kernel picked while binding, so no
test depends on a free port staying free."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from rlhf.algo.objectives import DPOObjective
from rlhf.types import PreferenceBatch, TrainBatch


def make_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """5 rows (uneven over 2 ranks, 3 micro-batches on rank 0), ragged lengths, right padding."""
    return ragged_batch([9, 7, 12, 5, 10], vocab=vocab, prompt=3, seed=seed)


def ragged_batch(lengths: list[int], *, vocab: int, prompt: int, seed: int = 0) -> TrainBatch:
    """Right-padded rows of these lengths, random tokens, the first `prompt` columns unscored, random
    advantages (seeded)."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    attn = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ids[~attn] = 0
    loss_mask = attn & (torch.arange(t)[None, :] >= prompt)
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask,
                      advantages=torch.randn(len(lengths), generator=g))


def rendezvous_store(world: int):
    """A TCPStore served by this process on a port the kernel picked while binding; the ranks join
    it as clients (`LearnerRank(driver_store=True)`). Not a free port picked, closed and handed to
    rank 0: another process (the other test worker's Ray, say) can take it in between."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False, use_libuv=True)


def spawn_ranks(target, *args, world: int = 2) -> None:
    """Run `target(rank, world, port, *args)` in `world` spawned processes, `port` the store they
    join (`rendezvous_store`); all must exit 0."""
    ctx = mp.get_context("spawn")
    store = rendezvous_store(world)
    procs = [ctx.Process(target=target, args=(r, world, store.port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)  # a bound, not a wait: a spawn may run several cases (test_fsdp2_learner.py)
        assert p.exitcode == 0


def make_pairs(vocab: int, seed: int = 1) -> PreferenceBatch:
    """5 pairs (3 + 2 over 2 ranks): shared prompts, ragged chosen/rejected lengths."""
    from rlhf.data.batching import pairs_to_batch
    from rlhf.types import PreferencePair

    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    pairs = [PreferencePair(ids(p), ids(c), ids(r)) for p, c, r in [(3, 4, 6), (5, 2, 3), (2, 7, 1), (4, 3, 3), (3, 5, 2)]]
    return pairs_to_batch(pairs, pad_id=0)


def attach_reference(batch: PreferenceBatch, token_lp: torch.Tensor) -> PreferenceBatch:
    """`batch` with the sequence log-probs of `token_lp` as its reference."""
    chosen, rejected = DPOObjective.sequence_logps(token_lp, batch)
    return PreferenceBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, chosen, rejected)
