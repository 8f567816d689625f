"""The learner's fast kernels, each behind a `learner.*` key and each computing what the eager,
padded model computes (tests/unit/test_learner_kernels.py on CPU; tests/gpu/test_learner_gpu.py for the
GPU-only kernels):

- `learner.liger`: Liger's Triton kernels for RMSNorm, SwiGLU and RoPE (GPU only). Eager PyTorch
  runs each of them as several elementwise kernels with fp32 round trips through memory.
- `learner.compile`: every decoder layer's forward compiled by torch.compile (regional: the layers
  share one graph; FSDP2's hooks stay eager around it). Inductor fuses the same elementwise work
  (norms, activation, rotary embedding, casts, residual adds) on any device.
- `learner.attention: varlen`: packed rows (no padding) attended by FlashAttention's
  variable-length kernel (`torch.nn.attention.varlen`), told the documents' borders (cu_seqlens)
  instead of building a mask; on CPU the same call runs SDPA document by document.
- Padded rows are right-padded, so a causal kernel gives every real token the output it has under
  the padding mask; without the mask SDPA can take its flash kernel (`learner.padding_mask`).
"""

from __future__ import annotations

import functools
import os

import torch

from rlhf.algo.logprobs import DEFAULT_CHUNK_TOKENS, HeadKernels, add_product, chunk_logits_grad, chunk_logprobs

VARLEN = "rlhf_varlen"
"""The name `learner.attention: varlen` is registered under in transformers' attention interface."""


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row is its tokens then padding (the mask never rises again along a row): then
    a causal model gives the real tokens the same outputs with or without the mask."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each packed document: q [T, H, D], k/v [T, Hkv, D] (H a multiple of
    Hkv), `cu_seqlens` [N + 1] int32 -> [T, H, D]. FlashAttention's varlen kernel on CUDA/ROCm, SDPA
    per document elsewhere (same function, slower)."""
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0))
    out = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, scale=scale, enable_gqa=kd.shape[0] != qd.shape[0]).transpose(0, 1))
    return torch.cat(out)


def _varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                              scaling: float | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                              max_length_q: int | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for `learner.attention: varlen`: [1, H, T, D] in (one packed
    row), [1, T, H, D] out; the borders come from the forward call's `cu_seq_lens_q`."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError("learner.attention=varlen attends packed rows only (learner.pack_sequences=true)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return varlen_causal_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)[None], None


def register_varlen_attention() -> str:
    """Make `VARLEN` a transformers attention implementation (idempotent); returns its name. It has
    no mask function, so transformers builds no mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, _varlen_attention_forward)
    return VARLEN


def varlen_kwargs(cu_seqlens: torch.Tensor, max_len: int | None = None) -> dict[str, object]:
    """The forward-call keywords that carry a packed row's borders to `_varlen_attention_forward`;
    pass the longest document's length where the host knows it (reading it off a GPU tensor stalls
    the stream)."""
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_len, "max_length_k": max_len}


def apply_liger(model: torch.nn.Module, device_kind: str) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in `model` (an HF causal LM, before LoRA or sharding
    wrap it). Refused in one line where they cannot run: no GPU, or a model type Liger does not know
    (Liger itself would skip it silently)."""
    if device_kind != "cuda":
        raise ValueError(f"learner.liger=true needs a CUDA or ROCm GPU (Liger's kernels are Triton); "
                         f"this learner runs on {device_kind}")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"learner.liger=true: Liger has no kernels for model type {model_type!r}; "
                         f"set learner.liger=false (learner.compile=true fuses the same work)")
    MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](model=model, rope=True, rms_norm=True, swiglu=True,
                                             cross_entropy=False, fused_linear_cross_entropy=False)


def fused_head_kernels(device_kind: str) -> HeadKernels:
    """`learner.head_kernels: fused`: the fused head's per-chunk softmax work compiled (one kernel
    forward, one backward, each reading the chunk's logits once, instead of eager passes over fp32
    copies), and on CUDA the head weight's gradient accumulated in fp32 by the matmul (addmm with
    `out_dtype`) instead of a bf16 product upcast and added. Dynamic shapes: a micro-batch's last
    chunk is shorter. `RLHF_COMPILE_BACKEND` as for `compile_layers`."""
    backend = os.environ.get("RLHF_COMPILE_BACKEND", "inductor")
    compiled = functools.partial(torch.compile, backend=backend, dynamic=True, fullgraph=True)
    accumulate = _addmm_fp32 if device_kind == "cuda" else add_product
    # On a GPU, chunks of 4096 rows: the weight gradient's fp32 accumulator [vocab x d] is read and
    # written once per chunk, so 1024-row chunks spent more time on it than on the product (H100
    # profile, benchmarks/README.md); 4096 rows of bf16 logits are 1.2 GB at a 152k vocabulary.
    chunk = 4096 if device_kind == "cuda" else DEFAULT_CHUNK_TOKENS
    return HeadKernels(compiled(chunk_logprobs), compiled(chunk_logits_grad), accumulate, chunk)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.addmm(acc, a, b, out_dtype=torch.float32)


def compile_layers(layers: torch.nn.ModuleList) -> None:
    """Each decoder layer's forward compiled in place (torch.compile). Only the forward method is
    replaced, so parameter names, hooks and sharding wrappers see the same modules; the layers share
    one compiled graph (transformers' modules are inlined, their weights are graph inputs).
    `RLHF_COMPILE_BACKEND` names another torch.compile backend: `aot_eager` checks the captured graphs
    without generating code (what the CPU tests use: inductor's C++ build takes minutes there)."""
    backend = os.environ.get("RLHF_COMPILE_BACKEND", "inductor")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
