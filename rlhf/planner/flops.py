"""Model FLOPs of training, from a decoder's config alone: the numerator of MFU.

Convention (PaLM, appendix B; what torchtitan and nanochat report): a forward+backward pass costs
6 FLOPs per parameter that multiplies an activation, per token, plus the attention scores and
their weighted sum, 12 * layers * (heads * head_dim) * sequence length per token. Embedding lookups
count nothing; the LM head counts in full. These are *model* FLOPs: work the learner skips (the LM
head on prompt positions) or adds (activation recomputation) does not change them, so MFU compares
systems on the same work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def matmul_params(config: Any) -> int:
    """Parameters of the decoder's matrix multiplications (attention, MLP, LM head) of an HF
    Llama/Qwen2-style config (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
    `num_key_value_heads`, `intermediate_size`, `vocab_size`, optional `head_dim`)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # q and o; k and v
    mlp = 3 * d * config.intermediate_size  # gate, up, down
    return layers * (attention + mlp) + config.vocab_size * d


def train_flops_per_token(config: Any, seq_len: float) -> float:
    """FLOPs of one forward+backward per token of a sequence of `seq_len` tokens (module docstring)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * matmul_params(config) + 12.0 * config.num_hidden_layers * heads * head_dim * seq_len


def train_flops(config: Any, lengths: Sequence[int]) -> float:
    """Model FLOPs of one forward+backward over sequences of these token counts."""
    return sum(n * train_flops_per_token(config, n) for n in lengths)
