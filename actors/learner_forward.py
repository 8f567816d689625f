"""One micro-batch through the learner's model to token log-probs, in the layout `learner.*` asks for
(packed rows, scored positions only, shared prompts, fused head and attention kernel, each a decision
of actors/learner_base.py): padded rows, one packed row, or rows that share their prompt.

Every layout returns the same [b, T] log-probs, aligned like TrainBatch.old_logprobs (tested against
each other in tests/unit/test_learner_kernels.py and tests/e2e/test_fsdp2_learner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.hf_model import output_head
from actors.learner_kernels import right_padded, varlen_kwargs
from rlhf.algo.logprobs import (
    align_next_token,
    next_token_targets,
    pack_sequences,
    packed_token_logprobs,
    sequence_starts,
    share_prompts,
    shared_prompt_logprobs,
    token_logprobs,
)
from rlhf.config import LearnerConfig
from rlhf.types import Batch

PACK_MULTIPLE = 16
"""Packed rows are topped up to a multiple of this many tokens. Triton specializes a kernel on
whether each integer argument is a multiple of 16, and Liger's RoPE and RMSNorm kernels take the
row's length: a row whose length is a multiple of 16 for the first time (or no longer one) would
compile them again inside a train step."""


@dataclass(frozen=True)
class Layout:
    """How a rank lays out its micro-batches: its learner section, the sampling temperature, the
    device, and whether packed rows are topped up to the token budget (FlexAttention: one shape,
    one compilation) or carry their borders to the varlen kernel."""

    cfg: LearnerConfig
    temperature: float
    device: torch.device
    fixed_pack: bool = False
    varlen: bool = False


def forward_logprobs(model: torch.nn.Module, mb: Batch, layout: Layout) -> torch.Tensor:
    """Token log-probs [b, T] of a micro-batch under `layout`."""
    cfg, dev = layout.cfg, layout.device
    if cfg.share_prompts and bool(mb.loss_mask.any()):  # shared prompts
        shared = share_prompts(mb.input_ids, mb.attention_mask, mb.loss_mask, device=dev)
        logits = model(input_ids=shared.input_ids, position_ids=shared.position_ids,
                       attention_mask=shared.attention_mask, use_cache=False,
                       logits_to_keep=shared.input_ids.shape[1] - shared.first_column).logits
        return shared_prompt_logprobs(logits, shared, temperature=layout.temperature)
    if not cfg.pack_sequences or (mb.input_ids.shape[0] == 1 and not layout.varlen):
        return _padded(model, mb, layout)
    return _packed(model, mb, layout)


def _padded(model: torch.nn.Module, mb: Batch, layout: Layout) -> torch.Tensor:
    """Scored positions only: the head only from the position before the first scored token on.
    Right-padded rows go without the padding mask unless `learner.padding_mask` (actors.learner_kernels)."""
    dev = layout.device
    ids, mask = mb.input_ids.to(dev, non_blocking=True), mb.loss_mask.to(dev, non_blocking=True)
    start = first_scored_column(mb.loss_mask)
    keep_mask = layout.cfg.padding_mask or not right_padded(mb.attention_mask)
    attention_mask = mb.attention_mask.to(dev, non_blocking=True) if keep_mask else None
    kwargs = dict(input_ids=ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=ids.shape[1] - start + 1)
    if layout.cfg.fused_head:  # fused head: the model returns next-token log-probs, no logits
        with output_head(model).scoring(next_token_targets(ids[:, start - 1:]), layout.temperature):
            tail = align_next_token(model(**kwargs).logits, mask[:, start - 1:])
    else:  # bf16 logits stay bf16: token_logprobs upcasts chunk by chunk, never the whole [b, T, V]
        tail = token_logprobs(model(**kwargs).logits, ids[:, start - 1:], mask[:, start - 1:],
                              temperature=layout.temperature)
    return torch.nn.functional.pad(tail, (start - 1, 0))


def _packed(model: torch.nn.Module, mb: Batch, layout: Layout) -> torch.Tensor:
    """Packed rows: one padding-free row. Without an attention mask transformers reads the documents off
    the restarting position ids; the varlen kernel is told their borders instead."""
    cfg, dev = layout.cfg, layout.device
    lengths = mb.attention_mask.sum(-1).tolist()
    sequences = [row[:n].tolist() for row, n in zip(mb.input_ids, lengths)]
    total = sum(lengths)
    # A filler document (its own block of the mask or its own varlen document, its outputs dropped)
    # tops the row up: to the token budget for FlexAttention (one shape, so its kernel compiles
    # once), else to a multiple of PACK_MULTIPLE.
    target = cfg.max_tokens_per_micro_batch if layout.fixed_pack else -(-total // PACK_MULTIPLE) * PACK_MULTIPLE
    if total < target:
        sequences.append([0] * (target - total))
    packed, positions, cu = pack_sequences(sequences, device=dev)
    kwargs = dict(input_ids=packed, position_ids=positions, use_cache=False)
    if layout.varlen:
        kwargs |= varlen_kwargs(cu, max(len(s) for s in sequences))
    if cfg.fused_head:  # the head only where the next token is scored: not on a prompt's positions
        scored = mb.loss_mask[mb.attention_mask.bool()].nonzero().squeeze(-1) - 1  # packing order, host
        rows = scored.to(dev, non_blocking=True)
        with output_head(model).scoring(next_token_targets(packed), layout.temperature, rows):
            flat = align_next_token(model(**kwargs).logits, ~sequence_starts(cu, packed.shape[1])[None])[0]
    else:
        flat = packed_token_logprobs(model(**kwargs).logits, packed, cu, temperature=layout.temperature)[0]
    out = torch.zeros(mb.input_ids.shape, dtype=flat.dtype, device=dev)
    # row-major order = packing order
    out = out.masked_scatter(mb.attention_mask.to(dev, non_blocking=True), flat[:total])
    return out.masked_fill(~mb.loss_mask.to(dev, non_blocking=True).bool(), 0.0)


def first_scored_column(loss_mask: torch.Tensor) -> int:
    """The first column any row scores (at least 1: column 0 is never scored); 1 for an all-False
    mask (a dummy micro-batch)."""
    cols = loss_mask.bool().any(0).nonzero()
    return max(1, int(cols[0])) if cols.numel() else 1
