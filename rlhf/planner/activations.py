"""What a learner's micro-batch holds for its backward, as the memory planner (rlhf.planner.memory)
counts it: the decoder layers' activations and the LM head's working set ("Activations" and "Logits"
in docs/design/memory-planner.md, with the measurements behind each constant)."""

from __future__ import annotations

from rlhf.config import LearnerConfig
from rlhf.planner.shapes import ModelShape

ACT_HIDDEN, ACT_MLP, ACT_HEADS = 11, 4, 2  # activation elements per token per layer: 11h + 4f + 2a
LORA_FROZEN_NORMS = 2  # h per layer that LoRA does not keep: its two RMSNorms' weights are frozen
LIGER_ACT_HIDDEN, LIGER_ACT_KV, LIGER_ACT_MLP = 6, 2, 3  # with Liger's kernels: 6h + 2kv + 3f + 2a
HEAD_CHUNK_TOKENS = 1024  # rlhf.algo.logprobs.DEFAULT_CHUNK_TOKENS
FUSED_HEAD_CHUNK_TOKENS = 4096  # actors.learner_kernels.fused_head_kernels on a GPU
FUSED_HEAD_BYTES = 9  # per logit of a chunk in the compiled head's backward


def layer_activations(l: LearnerConfig, shape: ModelShape) -> float:
    """Activation elements one token keeps for backward in one decoder layer ("Activations" in
    docs/design/memory-planner.md): eager layers 11h + 4f + 2a, fitted to measured peaks, less 2h
    under LoRA (a frozen RMSNorm weight needs no copy of its normed input for a gradient). Liger's
    kernels (`learner.liger`) are counted tensor by tensor, 6h + 2kv + 3f + 2a: each RMSNorm keeps
    its bf16 input and a per-row rstd (no fp32 copies) and the projections after it the normed
    output; attention keeps q, k, v, its output and the fp32 log-sum-exp; SwiGLU keeps gate and up
    and recomputes silu, down_proj their product (eager also keeps silu's output)."""
    h, f, a = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    if not l.liger:
        hidden = ACT_HIDDEN - (LORA_FROZEN_NORMS if l.lora_rank else 0)
        return hidden * h + ACT_MLP * f + ACT_HEADS * a
    kv = shape.num_key_value_heads * shape.head_size
    return LIGER_ACT_HIDDEN * h + LIGER_ACT_KV * kv + LIGER_ACT_MLP * f + ACT_HEADS * a


def head_bytes(l: LearnerConfig, shape: ModelShape, b: int, tokens: int) -> float:
    """Bytes of the LM head's working set in a micro-batch's backward ("Logits" in
    docs/design/memory-planner.md). Unfused: [tokens x vocab] logits and their gradient. Fused: one
    chunk of logits, their fp32 copy and gradient (10 bytes a logit); with `head_kernels: fused` a
    4096-row chunk with the compiled gradient's fp32 intermediate, plus the head weight's fp32
    gradient and its cast (the eager kernels' sit in the fitted 11h); `head_keep_logits` adds every
    token's logits, kept from forward."""
    v = shape.vocab_size
    if not l.fused_head:
        return 2 * b * tokens * v
    if l.head_kernels == "fused":
        work = FUSED_HEAD_BYTES * min(tokens, FUSED_HEAD_CHUNK_TOKENS) * v + (4 + b) * v * shape.hidden_size
    else:
        work = 10 * min(tokens, HEAD_CHUNK_TOKENS) * v
    return work + (b * tokens * v if l.head_keep_logits else 0)
