"""From rollouts to padded training tensors, and from a batch to per-rank, per-micro-batch pieces."""

from __future__ import annotations

import torch

from rlhf.types import RolloutBatch, TrainBatch


def rollouts_to_batch(rollouts: RolloutBatch, advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Concatenate prompt and completion ids of every rollout into a right-padded [B, T] batch.

    Rollout i is prompt i // G followed by completion i. The loss mask covers completion tokens
    only; the sampler's log-probs are placed at the positions of the tokens they score.
    """
    g = rollouts.group_size
    seqs = [rollouts.prompt_ids[i // g] + c.token_ids for i, c in enumerate(rollouts.completions)]
    b, t = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.bool)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    sampler_lp = torch.zeros((b, t), dtype=torch.float32)
    for i, (seq, c) in enumerate(zip(seqs, rollouts.completions)):
        p = len(seq) - len(c.token_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = True
        loss_mask[i, p : len(seq)] = True
        sampler_lp[i, p : len(seq)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        advantages=advantages.to(torch.float32),
        sampler_logprobs=sampler_lp,
    )


def shard_for_rank(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """Rank `rank`'s contiguous share of the rows. Shares differ by at most one row; a rank may get
    none when B < world_size (it still joins the collectives with an empty batch)."""
    bounds = torch.linspace(0, len(batch), world_size + 1).round().long().tolist()
    return batch.select(slice(bounds[rank], bounds[rank + 1]))


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Split into micro-batches of at most `size` rows, each trimmed to its own longest sequence
    (right padding beyond it is dead compute)."""
    out = []
    for start in range(0, len(batch), size):
        mb = batch.select(slice(start, start + size))
        t = int(mb.attention_mask.sum(dim=1).max())
        out.append(_trim(mb, t))
    return out


def _trim(batch: TrainBatch, t: int) -> TrainBatch:
    cut = slice(None), slice(0, t)
    return TrainBatch(
        input_ids=batch.input_ids[cut],
        attention_mask=batch.attention_mask[cut],
        loss_mask=batch.loss_mask[cut],
        advantages=batch.advantages,
        old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs[cut],
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[cut],
        sampler_logprobs=None if batch.sampler_logprobs is None else batch.sampler_logprobs[cut],
    )
