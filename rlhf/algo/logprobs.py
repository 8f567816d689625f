"""Token log-probabilities and entropies from causal-LM logits, padded or packed.

Decisions:
- Alignment: a log-prob sits on the token it scores, out[:, t] = log p(ids[:, t] | ids[:, < t]),
  so out[:, 0] = 0 (nothing predicts the first token). This is the alignment of
  `TrainBatch.old_logprobs`, so masks and sampler log-probs line up without shifting.
- logsumexp: log p = logit[token] - logsumexp(logits), never log_softmax + gather: log_softmax
  writes a full [B, T, V] output (and keeps it for backward), logsumexp returns [B, T] and, for fp32
  logits at temperature 1, keeps only the logits themselves for backward.
- Chunked upcast: the fp32 upcast (and the temperature division) is done on chunks of `chunk_tokens`
  rows of the flattened [B*T, V] logits, so the transient fp32 copy of bf16 logits is bounded by a
  chunk in no-grad passes (old/ref log-probs). Under autograd every chunk's upcast input is kept for
  backward, which is the unavoidable cost of an fp32 softmax gradient.
- Temperature: logits are divided by the sampling temperature, so the learner's log-probs are those
  of the distribution the sampler drew from (needed for the PPO ratio against sampler log-probs).
- Packed rows ([1, total], sequences back to back, flash-attn `cu_seqlens`): the first token of
  every sequence gets 0, because the logit before it belongs to the previous sequence.
- Shared prompts (`share_prompts`): rows with the same prompt (a GRPO group; the chosen and
  rejected of a DPO pair) become one row, the prompt once and every completion after it, under
  a mask that lets a completion see the prompt and itself only, with positions restarting after
  the prompt. Every log-prob is the one the separate rows give (up to float order); the prompt's
  forward and backward run once per group instead of once per completion.
- Fused head: `head_logprobs` fuses the LM head with the log-softmax: log p(target) from the hidden
  states and the head's weight, chunk by chunk in forward *and* backward (the backward recomputes a
  chunk's logits from the saved hidden states and the log-sum-exp), so neither [tokens x vocab]
  logits nor their fp32 copy ever exist; the extra cost is one more head matmul per chunk.
  `keep_logits` trades that matmul for memory: forward keeps each chunk's logits (the matmul's
  dtype, [tokens x vocab] in all) for backward, where a large GPU has the room.
  `LogprobHead` puts it in a model's place of `lm_head`, so sharding wrappers (FSDP2, ZeRO-3) see
  the weight where they expect it.
"""

from __future__ import annotations

import itertools

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_TOKENS = 1024


def _next_token_stats(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, chunk_tokens: int, entropy: bool
) -> torch.Tensor:
    """[B, T] statistic of the distribution at each position predicting the *next* token.

    entropy=False: stat[:, t] = log p(ids[:, t+1] | <= t)  (stat[:, T-1] is a dummy 0-target value)
    entropy=True:  stat[:, t] = H(softmax(logits[:, t] / temperature))
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, T, V = logits.shape
    # Flatten without copying (a slice logits[:, :-1] would force a copy in reshape); the last
    # position of each row is computed and discarded by the caller.
    flat = logits.reshape(B * T, V)
    targets = next_token_targets(input_ids).reshape(B * T)
    return _row_stats(flat, targets, temperature, chunk_tokens, entropy).view(B, T)


def _row_stats(flat: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int,
               entropy: bool) -> torch.Tensor:
    """[M] log p(targets[m]) (or the entropy) of each row of flat [M, V] logits, upcast by chunks."""
    out = []
    for start in range(0, flat.shape[0], chunk_tokens):
        chunk = flat[start:start + chunk_tokens].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        lse = torch.logsumexp(chunk, dim=-1)
        if entropy:
            # H = lse - sum_v p_v * z_v, with p = softmax(z).
            out.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
        else:
            tgt = targets[start:start + chunk_tokens, None]
            out.append(chunk.gather(-1, tgt).squeeze(-1) - lse)
    return torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] the token each position predicts (ids shifted left; the last position gets a dummy 0)."""
    return torch.cat([input_ids[:, 1:], input_ids.new_zeros(input_ids.shape[0], 1)], dim=1)


def chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (log p(targets), log-sum-exp) of one chunk of logits [n, V] at `temperature`."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def chunk_logits_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """The gradient of sum(grad_out * log p(targets)) with respect to one chunk of logits, in their
    dtype: d log p(y) / d z = onehot(y) - softmax(z), with z = logits / temperature."""
    dz = -torch.exp(logits.float() / temperature - lse[:, None]) * grad_out[:, None]
    dz = dz.scatter_add(-1, targets[:, None], grad_out[:, None])
    return (dz / temperature).to(logits.dtype)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, `acc` fp32 and the product in a's dtype, upcast."""
    return acc.add_((a @ b).float())


@dataclass(frozen=True)
class HeadKernels:
    """The fused head's per-chunk work: the softmax statistics forward, the logits' gradient
    backward, and the accumulation of the head weight's gradient. Eager by default; the learner
    swaps in compiled ones (`learner.head_kernels: fused`, actors.learner_kernels)."""

    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] = chunk_logprobs
    logits_grad: Callable[..., torch.Tensor] = chunk_logits_grad
    accumulate: Callable[..., torch.Tensor] = add_product
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Rows of logits per chunk (LogprobHead's default)."""


EAGER_HEAD = HeadKernels()


class _HeadLogprobs(torch.autograd.Function):
    """log p(targets) under softmax(hidden @ weight.T / temperature), chunk by chunk: at most
    `chunk` rows of logits exist at a time, forward or backward (recomputed there), unless
    `keep_logits` keeps every chunk's logits from forward for backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, kernels: HeadKernels, keep_logits: bool) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        kept: list[torch.Tensor] = []
        for s in range(0, hidden.shape[0], chunk):
            logits = hidden[s:s + chunk] @ weight.T
            out[s:s + chunk], lse[s:s + chunk] = kernels.logprobs(logits, targets[s:s + chunk], temperature)
            if keep_logits:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, targets, lse, *kept)
        ctx.temperature, ctx.chunk, ctx.kernels = temperature, chunk, kernels
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, lse, *kept = ctx.saved_tensors
        t, chunk, kernels = ctx.temperature, ctx.chunk, ctx.kernels
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s:s + chunk]
            logits = kept[i] if kept else h @ weight.T
            dlogits = kernels.logits_grad(logits, targets[s:s + chunk], lse[s:s + chunk],
                                          grad_out[s:s + chunk], t)
            grad_hidden[s:s + chunk] = dlogits @ weight
            grad_weight = kernels.accumulate(grad_weight, dlogits.T, h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS, kernels: HeadKernels = EAGER_HEAD,
                  keep_logits: bool = False) -> torch.Tensor:
    """[..., ] fp32 log p(targets) of the LM head `weight` [V, d] applied to `hidden` [..., d]:
    equal to log_softmax(hidden @ weight.T / temperature).gather(targets), holding at most
    `chunk_tokens` rows of logits at a time, forward or backward; the per-chunk work is `kernels`'.
    `keep_logits`: backward reuses forward's logits, every row's kept, instead of recomputing them
    (only where a backward can follow: a no-grad pass keeps nothing)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    keep = keep_logits and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    flat = _HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature,
                               chunk_tokens, kernels, keep)
    return flat.view(targets.shape)


class LogprobHead(torch.nn.Module):
    """An LM head that, once given `targets`, returns their log-probs instead of the logits.

    It takes the place of a model's `lm_head` (keeping its weight Parameter, so a tied embedding
    stays tied) before the model is sharded. With `targets` None it is the plain linear head; set
    `targets` ([B, T'] for the T' positions the model keeps, e.g. `next_token_targets`) around a
    forward pass (`with head.scoring(targets, temperature):`) and the model's "logits" come back
    as [B, T'] next-token log-probs ("Fused head" in the module docstring); `keep_logits` as in
    `head_logprobs`.
    """

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int | None = None,
                 kernels: HeadKernels = EAGER_HEAD, keep_logits: bool = False) -> None:
        super().__init__()
        if head.bias is not None:
            raise ValueError("LogprobHead: LM heads with a bias are not supported")
        self.weight = head.weight
        self.chunk_tokens, self.kernels = chunk_tokens or kernels.chunk_tokens, kernels
        self.keep_logits = keep_logits
        self.targets: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.temperature = 1.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return torch.nn.functional.linear(hidden, self.weight)
        if self.rows is None:
            return head_logprobs(hidden, self.weight, self.targets, temperature=self.temperature,
                                 chunk_tokens=self.chunk_tokens, kernels=self.kernels,
                                 keep_logits=self.keep_logits)
        # Only the positions asked for pass through the head (a prompt's positions score nothing):
        # their log-probs land in place, every other position reads 0.
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.rows)
        picked = head_logprobs(flat, self.weight, self.targets.reshape(-1).index_select(0, self.rows),
                               temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                               kernels=self.kernels, keep_logits=self.keep_logits)
        out = picked.new_zeros(self.targets.numel()).index_put((self.rows,), picked)
        return out.view(self.targets.shape)

    @contextmanager
    def scoring(self, targets: torch.Tensor, temperature: float, rows: torch.Tensor | None = None
                ) -> Iterator[None]:
        """Forward passes inside return log p(targets) instead of logits; `rows`: the flat indices
        of the positions to score (the others read 0 and cost nothing), None for all."""
        self.targets, self.temperature, self.rows = targets, temperature, rows
        try:
            yield
        finally:
            self.targets = self.rows = None


def align_next_token(stat_next: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Move next-token statistics onto the token they score (shift right, 0 at t=0); mask."""
    out = torch.nn.functional.pad(stat_next[:, :-1], (1, 0))
    if mask is not None:
        out = torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Log-prob of every token under a causal LM, aligned on the scored token.

        out[b, 0] = 0
        out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]   for t >= 1
        out[b, t] = 0 where mask[b, t] is False

    Args:
        logits: [B, T, V] (any float dtype) from a causal LM run over `input_ids`.
        input_ids: [B, T] long.
        mask: optional [B, T] bool/0-1, positions to keep (e.g. the loss mask).
        temperature: the sampling temperature (> 0) the scored tokens were drawn at.
        chunk_tokens: rows of the flattened [B*T, V] logits upcast to fp32 at a time.

    Returns:
        [B, T] float32 log-probs (differentiable w.r.t. logits).
    """
    return align_next_token(_next_token_stats(logits, input_ids, temperature, chunk_tokens, entropy=False), mask)


def entropy_from_logits(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Entropy of the distribution that produced each token, aligned like `token_logprobs`.

        p_t = softmax(logits[b, t-1] / temperature)
        out[b, t] = -sum_v p_t[v] log p_t[v] = logsumexp(z) - sum_v p_t[v] z_v   (t >= 1)
        out[b, 0] = 0; out = 0 where mask is False

    Args: logits [B, T, V]; mask optional [B, T]. Returns [B, T] float32 (nats).
    """
    dummy_ids = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return align_next_token(_next_token_stats(logits, dummy_ids, temperature, chunk_tokens, entropy=True), mask)


def sequence_logprobs(token_lp: torch.Tensor, mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Log-prob of each sequence from its token log-probs.

        out[b] = sum_t mask[b, t] * token_lp[b, t]                          average=False (DPO)
        out[b] = sum_t mask[b, t] * token_lp[b, t] / max(1, sum_t mask[b, t])  average=True (SimPO, IPO)

    Args: token_lp [B, T]; mask [B, T] bool/0-1. Returns [B].
    """
    m = mask.to(token_lp.dtype)
    total = (token_lp * m).sum(-1)
    if average:
        total = total / m.sum(-1).clamp(min=1.0)
    return total


def pack_sequences(
    sequences: Sequence[Sequence[int]], *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate token sequences into one packed row (no padding).

    Returns:
        input_ids:    [1, total] long, the sequences back to back.
        position_ids: [1, total] long, restarting at 0 for every sequence (this is what lets
                      flash-attention varlen kernels and HF's packed path find the borders).
        cu_seqlens:   [N + 1] int32, cumulative lengths [0, l1, l1+l2, ..., total].
    """
    if len(sequences) == 0 or any(len(s) == 0 for s in sequences):
        raise ValueError("pack_sequences needs at least one sequence and no empty sequence")
    # Built on the host and moved once per tensor: reading lengths back from a GPU tensor, or one
    # arange per sequence there, would stall the stream once per sequence of every micro-batch.
    lengths = [len(s) for s in sequences]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    input_ids, position_ids, cu_seqlens = (t.to(device, non_blocking=True)
                                           for t in (input_ids, position_ids, cu_seqlens))
    return input_ids[None], position_ids[None], cu_seqlens


def sequence_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] bool, True on the first token of every packed sequence."""
    starts = torch.zeros(total, dtype=torch.bool, device=cu_seqlens.device)
    starts[cu_seqlens[:-1].long()] = True
    return starts


def packed_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """`token_logprobs` for a packed row: out[0, t] = 0 at the first token of every sequence.

        out[0, t] = log softmax(logits[0, t-1] / temperature)[input_ids[0, t]]  if t is not a start
        out[0, t] = 0                                               if t in cu_seqlens[:-1]

    Args: logits [1, total, V]; input_ids [1, total]; cu_seqlens [N + 1] (int, starts at 0,
    ends at total). Returns [1, total] float32.
    """
    total = input_ids.shape[1]
    if input_ids.shape[0] != 1 or int(cu_seqlens[-1]) != total:
        raise ValueError(f"packed input must be [1, total] with cu_seqlens[-1] == total, got "
                         f"{tuple(input_ids.shape)} and cu_seqlens[-1]={int(cu_seqlens[-1])}")
    keep = ~sequence_starts(cu_seqlens, total)[None]
    return token_logprobs(logits, input_ids, keep, temperature=temperature, chunk_tokens=chunk_tokens)


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, *, pad_value: float = 0.0) -> torch.Tensor:
    """Packed per-token values back to right-padded rows.

        out[i, j] = packed[0, cu_seqlens[i] + j]  for j < l_i, else pad_value

    Args: packed [1, total] (or [total]); cu_seqlens [N + 1]. Returns [N, max_i l_i].
    """
    flat = packed.reshape(-1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    rows = torch.split(flat, lengths.tolist())
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=pad_value)


@dataclass(frozen=True)
class SharedPrompts:
    """Rows of a padded batch regrouped by prompt ("Shared prompts"); built by `share_prompts`.

    input_ids, position_ids: [P, N] long, one row per distinct prompt: the prompt, then each
        completion of it (right-padded with 0).
    attention_mask: [P, 1, N, N] bool, True where a query (dim 2) may attend to a key (dim 3).
    first_column: the logits of columns >= first_column are all that is needed
        (`logits_to_keep = N - first_column`).
    rows, columns: [M] long, where the logits predicting each scored token sit.
    targets: [M] long, the scored tokens, in the row-major order of `scored`.
    scored: [B, T] bool, the original rows' loss mask (where the M log-probs go back).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    first_column: int
    rows: torch.Tensor
    columns: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor


def share_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, *,
                  device: torch.device | str | None = None) -> SharedPrompts:
    """Regroup right-padded rows [B, T] by prompt.

    A row's prompt is its tokens before the first scored one (loss_mask), its completion the rest
    of its attended tokens; rows with equal prompts share one packed row, in order of first
    appearance. In a packed row, a completion token attends to the prompt and to the tokens of its
    own completion before it; its position continues from the prompt's length. Rows that score
    nothing are left out. Every scored token needs a prompt token before it. The result lives on
    `device` (default: input_ids' device).
    """
    ids, lengths = input_ids.cpu(), attention_mask.sum(-1).tolist()
    scored = loss_mask.bool().cpu()
    packs: dict[tuple[int, ...], dict[str, list[int]]] = {}  # prompt -> its packed row, in first-seen order
    index: dict[tuple[int, ...], int] = {}  # prompt -> the number of its packed row
    rows, columns, targets = [], [], []  # per scored token: where the logits predicting it sit, and the token
    for b in range(ids.shape[0]):
        t = scored[b].nonzero().squeeze(-1)
        if not t.numel():
            continue
        start = int(t[0])
        if start == 0:
            raise ValueError(f"row {b}: its first token is scored, but nothing predicts it (no prompt)")
        prompt = tuple(ids[b, :start].tolist())
        r = index.setdefault(prompt, len(index))
        pack = packs.setdefault(prompt, {"ids": list(prompt), "pos": list(range(start)), "seg": [-1] * start})
        own = len(pack["ids"]) + (t - start)  # packed columns of the scored tokens
        columns.append(torch.where(t == start, torch.full_like(own, start - 1), own - 1))
        rows.append(torch.full_like(t, r))
        targets.append(ids[b, t])
        completion = ids[b, start:lengths[b]].tolist()
        pack["ids"] += completion
        pack["pos"] += range(start, start + len(completion))
        pack["seg"] += [b] * len(completion)
    if not packs:
        raise ValueError("share_prompts: no row scores any token")
    width = max(len(p["ids"]) for p in packs.values())

    def padded(key: str, fill: int) -> torch.Tensor:
        return torch.tensor([p[key] + [fill] * (width - len(p[key])) for p in packs.values()], dtype=torch.long)

    seg = padded("seg", -2)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # A key is visible if it is a prompt token or in the query's own completion (padding: only itself).
    visible = (seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None])
    real = seg != -2
    mask = (causal & visible & real[:, :, None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool)

    columns_t = torch.cat(columns)
    dev = input_ids.device if device is None else device
    return SharedPrompts(
        input_ids=padded("ids", 0).to(dev), position_ids=padded("pos", 0).to(dev),
        attention_mask=mask[:, None].to(dev), first_column=int(columns_t.min()),
        rows=torch.cat(rows).to(dev), columns=columns_t.to(dev), targets=torch.cat(targets).to(dev),
        scored=scored.to(dev),
    )


def shared_prompt_logprobs(
    logits: torch.Tensor, packed: SharedPrompts, *, temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Token log-probs [B, T] of the original rows (aligned like `token_logprobs`, 0 off the loss
    mask) from the logits of the packed rows.

    Args: logits [P, N - first_column, V], the model's output on `packed` with
    `logits_to_keep = N - first_column`. Returns [B, T] float32.
    """
    flat = logits[packed.rows, packed.columns - packed.first_column]  # [M, V]
    lp = _row_stats(flat, packed.targets, temperature, chunk_tokens, entropy=False)
    return torch.zeros(packed.scored.shape, dtype=lp.dtype, device=lp.device).masked_scatter(packed.scored, lp)
