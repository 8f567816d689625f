"""The learner's fast paths (actors/learner_kernels.py) compute what the eager, masked model computes.

Whole train steps under each path are compared with a plain PyTorch step in tests/e2e/test_fsdp2_learner.py
(`packed-varlen`, `cast-once`, `padding-mask`, compiled layers); Liger's kernels and FlashAttention's
varlen kernel run on GPUs only and are checked there (tests/gpu/test_learner_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from actors.learner_kernels import (
    apply_liger,
    fused_head_kernels,
    register_varlen_attention,
    right_padded,
    varlen_causal_attention,
    varlen_kwargs,
)
from rlhf.errors import ConfigError


def test_right_padding_is_told_apart_from_other_masks():
    assert right_padded(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]))
    assert not right_padded(torch.tensor([[0, 1, 1, 1]]))  # left padding
    assert not right_padded(torch.tensor([[1, 0, 1, 0]]))  # a hole


def _block_causal_reference(q, k, v, lengths):
    """Dense attention over the whole packed row under a block-diagonal causal mask, in float64."""
    t = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v.double())


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_attention_is_block_causal_attention(heads, kv_heads):
    lengths = [5, 1, 9, 3]
    g = torch.Generator().manual_seed(0)
    t, d = sum(lengths), 8
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    out = varlen_causal_attention(q, k, v, cu, max(lengths))
    assert out.shape == (t, heads, d)
    torch.testing.assert_close(out.double(), _block_causal_reference(q, k, v, lengths), atol=1e-5, rtol=1e-5)
    assert varlen_kwargs(cu)["max_length_q"] == 9


def test_a_packed_model_under_varlen_equals_the_padded_model_with_its_mask(tiny_qwen2):
    """The registered implementation inside a real model: every document of a packed row gets the
    hidden states its padded row gets under the padding mask, and unpacked input is refused."""
    from transformers import AutoModelForCausalLM

    from rlhf.algo.logprobs import pack_sequences

    padded = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32,
                                                  attn_implementation=register_varlen_attention())
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3, 11]
    rows = [torch.randint(3, padded.config.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    with torch.no_grad():
        want = padded.model(input_ids=ids, attention_mask=mask).last_hidden_state[mask]
        flat, positions, cu = pack_sequences([r.tolist() for r in rows])
        got = packed.model(input_ids=flat, position_ids=positions, **varlen_kwargs(cu)).last_hidden_state[0]
        with pytest.raises(ValueError, match="learner.pack_sequences=true"):
            packed.model(input_ids=ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_liger_is_refused_in_one_line_off_a_gpu(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^learner.liger=true needs a CUDA or ROCm GPU .*runs on cpu$"):
        apply_liger(model, "cpu")


@pytest.mark.parametrize(("overrides", "key"), [
    ({"attention": "varlen"}, "learner.attention"),
    ({"compile": True, "backend": "deepspeed"}, "learner.compile"),
    ({"compile": True, "liger": True}, "learner.compile"),
    ({"cast_once_per_step": True, "backend": "deepspeed"}, "learner.cast_once_per_step"),
    ({"head_kernels": "fused", "fused_head": False}, "learner.head_kernels"),
    ({"head_keep_logits": True, "fused_head": False}, "learner.head_keep_logits"),
])
def test_kernel_keys_that_cannot_apply_are_refused_naming_the_key(overrides, key):
    from dataclasses import replace

    from rlhf.config import RunConfig

    cfg = RunConfig()
    with pytest.raises(ConfigError) as e:  # a RunConfig validates itself as it is built
        replace(cfg, learner=replace(cfg.learner, **overrides))
    assert e.value.key == key and "\n" not in str(e.value)


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recompute", "keep-logits"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_kernels_equal_the_eager_head(temperature, keep_logits, monkeypatch):
    """`learner.head_kernels: fused`: the per-chunk statistics and the logits' gradient traced whole
    by torch.compile (one graph each, dynamic in the chunk's rows: the last chunk is shorter) give
    the eager head's log-probs and gradients, also from the logits kept by `learner.head_keep_logits`.
    On CPU the graphs are checked through `aot_eager`; inductor's generated kernels run in the GPU
    suite (tests/gpu/test_learner_gpu.py, fused-head)."""
    from rlhf.algo.logprobs import head_logprobs

    monkeypatch.setenv("RLHF_COMPILE_BACKEND", "aot_eager")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)
    results = []
    for kernels in (None, fused_head_kernels("cpu")):
        hidden.grad = weight.grad = None
        extra = {} if kernels is None else {"kernels": kernels, "keep_logits": keep_logits}
        out = head_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=4, **extra)  # 4+4+4+2
        (out * upstream).sum().backward()
        results.append((out.detach(), hidden.grad.clone(), weight.grad.clone()))
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("varlen", [False, True], ids=["position-ids", "varlen"])
def test_packed_rows_are_topped_up_to_a_multiple_of_16_tokens_and_score_as_padded_rows(tiny_qwen2, varlen):
    """`actors.learner_forward.PACK_MULTIPLE`: 21 tokens of three documents reach the model as one row of
    32 (Triton compiles Liger's kernels once per divisibility of the row's length by 16), and the
    filler document changes no log-prob of the padded rows."""
    from actors.hf_model import load_hf_model
    from actors.learner_forward import PACK_MULTIPLE, Layout, forward_logprobs
    from rlhf.config import LearnerConfig
    from rlhf.types import TrainBatch

    padded, model = (load_hf_model(str(tiny_qwen2), gradient_checkpointing=False, fused_head=True, attention=a)
                     for a in ("sdpa", register_varlen_attention() if varlen else "sdpa"))
    g, lengths = torch.Generator().manual_seed(2), [7, 3, 11]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    ids[mask] = torch.randint(3, model.config.vocab_size, (sum(lengths),), generator=g)
    scored = mask & (torch.arange(max(lengths))[None, :] >= 2)
    batch = TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=scored, advantages=torch.zeros(len(lengths)))
    shapes = []
    model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    cpu = torch.device("cpu")
    with torch.no_grad():
        want = forward_logprobs(padded, batch, Layout(LearnerConfig(), 1.0, cpu))
        got = forward_logprobs(model, batch, Layout(LearnerConfig(pack_sequences=True, attention=(
            "varlen" if varlen else "sdpa")), 1.0, cpu, varlen=varlen))
    assert PACK_MULTIPLE == 16 and shapes == [(1, 32)]
    assert bool(got[scored].ne(0).all())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
