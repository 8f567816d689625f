"""From rollouts to padded training tensors, and from a batch to per-rank, per-micro-batch pieces."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from rlhf.types import Batch, PreferenceBatch, PreferencePair, RolloutBatch, TrainBatch


def pad_sequences(seqs: list[list[int]], prompt_lens: list[int], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask) [B, T]; the loss mask covers each row's
    tokens after its first `prompt_lens[i]` (the response)."""
    lengths = torch.tensor([len(s) for s in seqs])
    columns = torch.arange(int(lengths.max()))[None, :]
    attention_mask = columns < lengths[:, None]
    loss_mask = attention_mask & (columns >= torch.tensor(prompt_lens)[:, None])
    input_ids = torch.full(attention_mask.shape, pad_id, dtype=torch.long)
    input_ids[attention_mask] = flat_tensor(seqs, np.int64)  # row-major
    return input_ids, attention_mask, loss_mask


def flat_tensor(lists: Sequence[Sequence[int | float]], dtype: type[np.generic]) -> torch.Tensor:
    """The items of `lists` concatenated into one 1-D tensor. numpy reads a long Python list ~4x
    faster than `torch.tensor` does: a step's 2048 rollouts are ~0.7M token ids and 0.5M log-probs."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(lists), dtype=dtype, count=sum(map(len, lists))))


def rollouts_to_batch(rollouts: RolloutBatch, advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Concatenate prompt and completion ids of every rollout into a right-padded [B, T] batch.

    Rollout i is prompt i // G followed by completion i. The loss mask covers completion tokens
    only (of a multi-turn episode, those its `mask` marks as the model's); the sampler's log-probs are placed at the positions of the tokens they score.
    """
    g = rollouts.group_size
    prompts = [rollouts.prompt_ids[i // g] for i in range(len(rollouts.completions))]
    seqs = [p + c.token_ids for p, c in zip(prompts, rollouts.completions)]
    input_ids, attention_mask, loss_mask = pad_sequences(seqs, [len(p) for p in prompts], pad_id)
    sampler_lp = torch.zeros(input_ids.shape, dtype=torch.float32)  # the completions' positions: loss_mask's
    sampler_lp[loss_mask] = flat_tensor([c.logprobs for c in rollouts.completions], np.float32)
    for i, (p, c) in enumerate(zip(prompts, rollouts.completions)):
        if c.mask is not None:  # a multi-turn episode: its model tokens only (rlhf.env.episodes)
            loss_mask[i, len(p) : len(p) + len(c.token_ids)] = torch.tensor(c.mask, dtype=torch.bool)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        advantages=advantages.to(torch.float32),
        sampler_logprobs=sampler_lp,
    )


def pairs_to_batch(pairs: list[PreferencePair], pad_id: int) -> PreferenceBatch:
    """P pairs -> a [2P, T] PreferenceBatch: rows 0..P-1 prompt+chosen, rows P..2P-1 prompt+rejected,
    so one forward pass scores both responses of every pair. Reference log-probs are left unset."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    input_ids, attention_mask, loss_mask = pad_sequences(seqs, [len(p.prompt_ids) for p in pairs] * 2, pad_id)
    return PreferenceBatch(input_ids, attention_mask, loss_mask)


def even_shards(count: int, parts: int) -> list[range]:
    """`count` items cut into `parts` contiguous ranges, in order, sizes differing by at most one
    (the larger ones first). Concatenating the ranges gives back 0..count-1; a part gets an empty
    range when there are fewer items than parts.

    The one sharding rule of the project: learner ranks get rows (or pairs) this way, and
    generation engines get whole prompts, so a GRPO group never spans two engines and the
    engines' answers, concatenated, are in prompt order."""
    if parts < 1 or count < 0:
        raise ValueError(f"cannot cut {count} items into {parts} parts")
    size, extra = divmod(count, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + size + (p < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def shard_for_rank(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous share of the items (rows, or pairs of rows), per `even_shards`; a
    rank may get none when there are fewer items than ranks (it still joins the collectives with
    an empty batch)."""
    part = even_shards(len(batch), world_size)[rank]
    return batch.select(slice(part.start, part.stop))


def micro_batch_items(batch: Batch, size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Item indices (rows, or pairs of rows) of each micro-batch of `batch`.

    Fixed (`max_tokens` = 0): consecutive runs of `size` sequences, a preference pair counting two.
    Token budget (`max_tokens` > 0): items sorted by length, longest first, and binned greedily
    while (rows in the bin) x (its longest row) <= max_tokens, i.e. the micro-batch's padded size;
    an item longer than the budget goes alone. Similar lengths share a micro-batch, so little of it
    is padding, and short rows go many to a pass. The loss is normalised by the whole step's
    denominator (rlhf.algo.objectives), so how items are grouped never changes the gradient.
    """
    count, per_item = len(batch), batch.rows_per_item
    if not max_tokens:
        per = max(1, size // per_item)
        return [torch.arange(start, min(start + per, count)) for start in range(0, count, per)]
    lengths = batch.attention_mask.sum(dim=1).view(per_item, count).amax(dim=0)  # an item's longest row
    return [torch.tensor(sorted(b)) for b in token_budget_bins(lengths.tolist(), max_tokens, per_item)]


def token_budget_bins(lengths: Sequence[int], max_tokens: int, rows_per_item: int = 1) -> list[list[int]]:
    """Indices of items of these lengths binned for padded passes: longest first (ties in order), a
    bin filled while (its rows) x (its longest row) <= max_tokens; an item longer than the budget
    goes alone. The one rule for learner micro-batches (`micro_batch_items`) and reward-model
    batches (rlhf.reward_model.reward_batches)."""
    bins: list[list[int]] = []
    longest = 0
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        if not bins or (len(bins[-1]) + 1) * rows_per_item * longest > max_tokens:
            bins.append([])
            longest = lengths[item]
        bins[-1].append(item)
    return bins


def micro_batches(batch: Batch, size: int, max_tokens: int = 0) -> list[tuple[torch.Tensor, Batch]]:
    """(item indices, micro-batch) pairs per `micro_batch_items`, each micro-batch trimmed to its own
    longest sequence (right padding beyond it is dead compute)."""
    out = []
    for items in micro_batch_items(batch, size, max_tokens):
        mb = batch.select(items)
        out.append((items, mb.trim(int(mb.attention_mask.sum(dim=1).max()))))
    return out
