"""Over-long responses (DAPO, Yu et al. 2025, section 3.4): pure tensor functions.

A response cut at the length cap (finish_reason "length") has no ending, so its reward says
little about what the model did. `grpo.overlong` picks one of two remedies:
- `filter`: the truncated responses are left out of the loss. Their loss-mask rows are zeroed
  (not their advantages): a zero advantage would still count their tokens in the token-mean
  denominator (diluting every other token's gradient) and still apply the KL term to them.
  With a zeroed mask they are in no sum and no count; `GRPOObjective.num_units` counts only the
  sequences with a loss token for the seq-mean aggregations, so those stay right too. They still
  take part in their group's baseline (the advantages are computed before the filter), as in DAPO.
- `shape`: the soft over-long punishment, added to the reward before the advantages. With cap L
  (generation.max_new_tokens) and buffer B (grpo.overlong_buffer):
      penalty(len) = 0                       len <= L - B
                   = ((L - B) - len) / B     L - B < len <= L
  times `grpo.overlong_penalty_factor`: 0 up to L - B, falling linearly to -factor at L.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft length penalty (module docstring, `shape`).

    Args:
        lengths: [N] response lengths in tokens (<= max_len).
        max_len: L, the generation cap.
        buffer: B in [1, L], the length span over which the penalty grows from 0 to -factor.
        factor: the penalty at len = L is -factor.

    Returns:
        [N] float32 penalties, <= 0, to be added to the rewards.
    """
    if not 1 <= buffer <= max_len:
        raise ValueError(f"buffer must be in [1, max_len={max_len}], got {buffer}")
    free = max_len - buffer
    over = (lengths.float() - free).clamp(min=0.0)
    return -factor * over / buffer


def filter_truncated(loss_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask [B, T] with the rows of truncated responses (`truncated`: [B] bool) all False
    (module docstring, `filter`)."""
    if truncated.shape != loss_mask.shape[:1]:
        raise ValueError(f"truncated must be [B={loss_mask.shape[0]}], got shape {tuple(truncated.shape)}")
    return loss_mask & ~truncated.to(loss_mask.device).bool().unsqueeze(1)
