"""Token log-probs / entropies: equal to the naive log_softmax + gather, packed == padded."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algo.logprobs import (
    entropy_from_logits,
    pack_sequences,
    packed_token_logprobs,
    sequence_logprobs,
    share_prompts,
    shared_prompt_logprobs,
    token_logprobs,
    unpack,
)


def naive_token_logprobs(logits, ids, temperature=1.0):
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return out


def test_hand_computed_two_token_vocab():
    # Logits at t=0 are [0, ln 3]: p = [1/4, 3/4]; token 1 follows -> log(3/4). t=1 predicts nothing.
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1]])
    assert_close(token_logprobs(logits, ids), torch.tensor([[0.0, math.log(0.75)]]))
    # Entropy of [1/4, 3/4] sits on token 1.
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), torch.tensor([[0.0, h]]))


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_values_and_grads(chunk_tokens, temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6))
    ours = token_logprobs(logits, ids, temperature=temperature, chunk_tokens=chunk_tokens)
    ref = naive_token_logprobs(logits, ids, temperature)
    assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    weights = torch.randn(3, 6)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-6)
    assert ours[:, 0].eq(0).all()


def test_temperature_changes_the_distribution():
    torch.manual_seed(1)
    logits, ids = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    assert_close(token_logprobs(logits, ids, temperature=0.5), token_logprobs(2 * logits, ids))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=0.0)


def test_bf16_logits_are_upcast():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 9).bfloat16()
    ids = torch.randint(0, 9, (2, 5))
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32
    assert_close(out, naive_token_logprobs(logits.float(), ids))


def test_mask_zeroes_positions():
    torch.manual_seed(3)
    logits, ids = torch.randn(2, 4, 5), torch.randint(0, 5, (2, 4))
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    out = token_logprobs(logits, ids, mask)
    assert_close(out, naive_token_logprobs(logits, ids) * mask)
    assert_close(entropy_from_logits(logits, mask), entropy_from_logits(logits) * mask)


def test_entropy_matches_naive():
    torch.manual_seed(4)
    logits = torch.randn(2, 5, 13) * 3
    p = torch.softmax(logits, -1)
    naive = -(p * torch.log(p)).sum(-1)
    ours = entropy_from_logits(logits, chunk_tokens=3)
    assert_close(ours[:, 1:], naive[:, :-1])
    assert ours[:, 0].eq(0).all()


def test_sequence_logprobs_sum_and_mean():
    lp = torch.tensor([[0.0, -1.0, -2.0, -4.0], [0.0, -3.0, -5.0, -7.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    assert_close(sequence_logprobs(lp, mask), torch.tensor([-7.0, -3.0]))
    assert_close(sequence_logprobs(lp, mask, average=True), torch.tensor([-7.0 / 3, -3.0]))
    # An all-masked row averages to 0, not NaN.
    assert_close(sequence_logprobs(lp, torch.zeros(2, 4), average=True), torch.zeros(2))


def test_pack_sequences_layout():
    ids, pos, cu = pack_sequences([[5, 6, 7], [8], [9, 10]])
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert cu.tolist() == [0, 3, 4, 6] and cu.dtype == torch.int32
    with pytest.raises(ValueError):
        pack_sequences([[1], []])


def test_packed_equals_padded():
    """A per-position 'model' (logits depend on the token and its position in its own sequence)
    gives the same scores packed or padded, so the two log-prob paths must agree exactly."""
    torch.manual_seed(5)
    V = 8
    table = torch.randn(V, 10, V)  # logits for (token, position) pairs
    seqs = [[1, 2, 3, 4], [5, 6], [7, 0, 1]]
    ids, pos, cu = pack_sequences(seqs)
    packed = packed_token_logprobs(table[ids, pos], ids, cu, temperature=0.9)

    T = max(map(len, seqs))
    padded_ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        padded_ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    padded_logits = table[padded_ids, torch.arange(T).expand(len(seqs), T)]
    padded = token_logprobs(padded_logits, padded_ids, mask, temperature=0.9)

    assert_close(unpack(packed, cu), padded)
    assert packed[0, cu[:-1].long()].eq(0).all()
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_token_logprobs(table[ids, pos], ids, torch.tensor([0, 3]))


def _rows(rows: list[tuple[list[int], list[int]]]):
    """Right-padded (prompt, completion) rows: ids, attention mask, loss mask on the completion."""
    T = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.bool)
    loss = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = True
        loss[i, len(p): len(p) + len(c)] = True
    return ids, attn, loss


def test_share_prompts_layout_hand_built():
    # Rows 0 and 2 share prompt [5, 6]; row 1 has its own; row 3 scores nothing and is left out.
    ids, attn, loss = _rows([([5, 6], [7, 8]), ([9], [3]), ([5, 6], [4]), ([2, 2], [])])
    sp = share_prompts(ids, attn, loss)
    assert sp.input_ids.tolist() == [[5, 6, 7, 8, 4], [9, 3, 0, 0, 0]]
    assert sp.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    m = sp.attention_mask[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0],   # prompt: causal
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 0, 0],   # row 0's completion: the prompt and itself
                 [1, 1, 1, 1, 0],
                 [1, 1, 0, 0, 1]]   # row 2's completion: the prompt, not row 0's tokens
    assert sp.attention_mask[1, 0].int().tolist()[2:] == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]  # padding
    # Scored tokens in row-major order: (0,2) (0,3) (1,1) (2,2), predicted from packed (row, column)
    assert sp.rows.tolist() == [0, 0, 1, 0] and sp.columns.tolist() == [1, 2, 0, 1]
    assert sp.targets.tolist() == [7, 8, 3, 4] and sp.first_column == 0
    with pytest.raises(ValueError, match="no prompt"):
        share_prompts(*_rows([([], [1, 2])]))


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama"])
def test_shared_prompts_give_the_rows_log_probs_and_gradients(model_name, request):
    """A real causal LM: every log-prob (and the gradient of their sum) is what the separate
    rows give, for GRPO-like groups and for DPO-like pairs whose two rows are not adjacent."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    p1, p2 = rnd(6), rnd(4)
    rows = [(p1, rnd(5)), (p1, rnd(3)), (p1, rnd(7)), (p2, rnd(4)), (p2, rnd(2)), (p1, rnd(1))]
    ids, attn, loss = _rows(rows)

    def grads_of(lp):
        model.zero_grad()
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids, loss, temperature=0.8)
    want_grads = grads_of(want)
    sp = share_prompts(ids, attn, loss)
    logits = model(input_ids=sp.input_ids, position_ids=sp.position_ids, attention_mask=sp.attention_mask,
                   logits_to_keep=sp.input_ids.shape[1] - sp.first_column).logits
    got = shared_prompt_logprobs(logits, sp, temperature=0.8)
    assert sp.input_ids.shape[0] == 2 and sp.input_ids.shape[1] < ids.numel()
    assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert got[~loss].eq(0).all()
    got_grads = grads_of(got)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], atol=1e-4, rtol=1e-3, msg=name)


# ------------------------------------------------------------------------------------------------
# The fused LM head + log-softmax ("Fused head" in rlhf.algo.logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_log_softmax_values_and_gradients(temperature):
    from rlhf.algo.logprobs import head_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g, dtype=torch.float64)

    plain = torch.log_softmax(hidden @ weight.T / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (plain * upstream).sum().backward()
    want = plain.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    fused = head_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=3)  # 14 rows, 5 chunks
    (fused * upstream).sum().backward()
    assert fused.dtype == torch.float32 and fused.shape == (2, 7)
    torch.testing.assert_close(fused.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, want[2], atol=1e-5, rtol=1e-5)


def _head_run(hidden, weight, targets, upstream, rows=None, **kwargs):
    """LogprobHead's log-probs on `hidden` [2, 7, d] (all positions, or the flat `rows`) and the
    gradients of sum(upstream * log-probs) with respect to hidden and weight."""
    from rlhf.algo.logprobs import LogprobHead

    linear = torch.nn.Linear(hidden.shape[-1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    head, hidden = LogprobHead(linear, **kwargs), hidden.clone().requires_grad_()
    with head.scoring(targets, temperature=0.7, rows=rows):
        out = head(hidden)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("chunk_tokens", [3, 5])  # 14 rows: chunks of 3+3+3+3+2, 5+5+4 (rows path: 9 rows)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scored_rows", [False, True], ids=["every-position", "scored-rows-only"])
def test_kept_logits_give_the_recomputed_heads_log_probs_and_gradients(chunk_tokens, dtype, scored_rows):
    """`keep_logits` (learner.head_keep_logits): backward reads forward's logits instead of
    recomputing them, so log-probs and both gradients are the recomputing head's, bit for bit, and
    log_softmax's up to the dtype's rounding; also through the `rows` path."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 16, generator=g).to(dtype)
    weight = torch.randn(50, 16, generator=g).to(dtype)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    upstream = torch.randn(2, 7, generator=g)
    rows = torch.tensor([0, 2, 3, 5, 7, 8, 9, 12, 13]) if scored_rows else None
    scored = torch.zeros(14, dtype=torch.bool)
    scored[rows if scored_rows else slice(None)] = True
    scored = scored.view(2, 7)

    kept = _head_run(hidden, weight, targets, upstream, rows, chunk_tokens=chunk_tokens, keep_logits=True)
    recomputed = _head_run(hidden, weight, targets, upstream, rows, chunk_tokens=chunk_tokens)
    for got, want in zip(kept, recomputed):
        assert torch.equal(got, want)

    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    plain = torch.log_softmax(h @ w.T / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1) * scored
    (plain * upstream.double()).sum().backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(kept[0].double(), plain.detach(), **tol)
    torch.testing.assert_close(kept[1].double(), h.grad, **tol)
    torch.testing.assert_close(kept[2].double(), w.grad, **tol)
    assert kept[1].dtype == kept[2].dtype == dtype


def test_kept_logits_are_saved_only_where_a_backward_can_follow(monkeypatch):
    """With grad: every chunk's logits saved beside the four tensors the recomputing head saves; under
    no_grad (old and reference log-probs), or with nothing requiring grad, none are kept."""
    from rlhf.algo import logprobs

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(10, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (10,), generator=g)
    out = logprobs.head_logprobs(hidden, weight, targets, chunk_tokens=4, keep_logits=True)  # 4+4+2
    saved = out.grad_fn.next_functions[0][0].saved_tensors  # the head's, under the view to targets' shape
    assert len(saved) == 4 + 3 and [t.shape for t in saved[4:]] == [(4, 50), (4, 50), (2, 50)]
    recomputing = logprobs.head_logprobs(hidden, weight, targets, chunk_tokens=4)
    assert len(recomputing.grad_fn.next_functions[0][0].saved_tensors) == 4

    flags = []
    apply = logprobs._HeadLogprobs.apply
    monkeypatch.setattr(logprobs._HeadLogprobs, "apply", lambda *args: flags.append(args[-1]) or apply(*args))
    with torch.no_grad():
        logprobs.head_logprobs(hidden, weight, targets, chunk_tokens=4, keep_logits=True)
    logprobs.head_logprobs(hidden.detach(), weight.detach(), targets, chunk_tokens=4, keep_logits=True)
    logprobs.head_logprobs(hidden, weight, targets, chunk_tokens=4, keep_logits=True)
    assert flags == [False, False, True]


@pytest.mark.parametrize("scored_rows", [False, True], ids=["every-position", "scored-rows-only"])
def test_logprob_head_in_a_model_equals_token_logprobs(tiny_qwen2, scored_rows):
    """A tiny Qwen2 with LogprobHead in place of lm_head: plain forward passes
    give the same logits; scoring gives token_logprobs' values and the same gradients, also when
    only the positions before scored tokens pass through the head (`rows`, what packed rows use)."""
    from transformers import AutoModelForCausalLM

    from rlhf.algo.logprobs import LogprobHead, align_next_token, next_token_targets

    ids = torch.randint(3, 200, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False

    def run(fused: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
        if fused:
            model.lm_head = LogprobHead(model.lm_head, chunk_tokens=8)
            tied = model.lm_head.weight is model.model.embed_tokens.weight
            assert tied == bool(model.config.tie_word_embeddings)  # the head keeps the very Parameter
            rows = mask.reshape(-1).nonzero().squeeze(-1) - 1 if scored_rows else None
            with model.lm_head.scoring(next_token_targets(ids), temperature=0.9, rows=rows):
                lp = align_next_token(model(input_ids=ids).logits, mask)
        else:
            lp = token_logprobs(model(input_ids=ids).logits, ids, mask, temperature=0.9)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model

    lp, grads, _ = run(False)
    fused_lp, fused_grads, model = run(True)
    torch.testing.assert_close(fused_lp, lp, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    plain = model(input_ids=ids).logits  # no targets set: the ordinary head again
    assert plain.shape == (3, 11, model.config.vocab_size)
