"""From rollouts to padded training tensors, and from a batch to per-rank, per-micro-batch pieces."""

from __future__ import annotations

import torch

from rlhf.types import PreferenceBatch, RolloutBatch, TrainBatch


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


Batch = TrainBatch | PreferenceBatch


def shard_for_rank(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous share of the items (rows, or pairs of rows). Shares differ by at
    most one item; a rank may get none when there are fewer items than ranks (it still joins the
    collectives with an empty batch)."""
    bounds = torch.linspace(0, len(batch), world_size + 1).round().long().tolist()
    return batch.select(slice(bounds[rank], bounds[rank + 1]))


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Split into micro-batches of at most `size` sequences (a preference pair counts as two and is
    never split), each trimmed to its own longest sequence (right padding beyond it is dead compute)."""
    per = max(1, size // batch.rows_per_item)
    out = []
    for start in range(0, len(batch), per):
        mb = batch.select(slice(start, start + per))
        out.append(mb.trim(int(mb.attention_mask.sum(dim=1).max())))
    return out
