"""Policy losses as pure tensor functions: GRPO (PPO-clip, DAPO/Dr.GRPO variants), DPO, SimPO.

GRPO decisions:
- Clip-higher: PPO clipped surrogate per token with an asymmetric range [1 - clip_low, 1 +
  clip_high] (DAPO "clip-higher": a larger upper bound lets low-probability tokens grow, against
  entropy collapse). The ratio is taken against the log-probs the rollout was sampled with.
- Clamped log-ratio: the log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]
  before `exp`: exp(20) ~ 4.9e8 is finite in fp32 and bf16, and a token whose probability moved by
  e^20 is outside any trust region anyway. Inside the bound (every realistic step) the loss is
  exact.
- KL penalty: optional KL penalty to a frozen reference, added per token (GRPO paper), with the k3
  estimator by default (unbiased, always >= 0, low variance; Schulman 2020).
- Off-policy correction (`importance_weights`): the policy term of each token is multiplied by
  w = pi_prox / pi_behaviour, the learners' log-probs before the update over the engine's that
  sampled the token: truncated at a cap (`tis`, TRL's token_truncate) or zero above it (`mis`,
  TRL's token_mask). It corrects stale samples (asynchronous GRPO) and the kernels' train/inference
  mismatch; the PPO ratio stays against pi_prox, so the trust region is the current policy's
  (decoupled PPO, as in AReaL). The KL term is not weighted, as in TRL.
- Aggregations: three aggregations over tokens (`loss_agg`), see `grpo_policy_loss`. Each can divide
  by a global `denominator` instead of the local count, so that micro-batch losses add up exactly to
  the full-batch loss (gradient accumulation over micro-batches and ranks).

DPO choices: losses take summed (or, for IPO/SimPO, length-averaged) sequence log-probs; every
loss is written with logsigmoid / relu so that margins of 1e4 give finite losses and gradients.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LOG_RATIO_CLAMP = 20.0

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ISCorrection = Literal["none", "tis", "mis"]
DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With d = logprobs - ref_logprobs (log pi - log pi_ref at the sampled token):
        k1 = d                          unbiased, high variance, can be negative
        k2 = d^2 / 2                    biased, low variance, >= 0
        k3 = exp(-d) - (-d) - 1         unbiased, low variance, >= 0
    For k3 the exponent is clamped to [-20, 20] (module docstring, "Clamped log-ratio").

    Args: logprobs, ref_logprobs: same shape (e.g. [B, T]). Returns that shape.
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        neg = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"kl estimator must be one of 'k1', 'k2', 'k3', got {kind!r}")


def importance_weights(prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: ISCorrection, cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights [B, T] of the policy loss (module docstring, "Off-policy
    correction") and their statistics over masked tokens: `is/weight_mean` and `is/weight_max` of
    the raw ratio and `is/clipped_frac`, the share of tokens the cap changed (truncated or masked).

        w_t = exp(clamp(prox_t - behaviour_t, -20, 20))   (1 off the mask)
        tis: min(w_t, cap)      mis: w_t if w_t <= cap else 0      none: 1
    """
    m = mask.to(prox_logprobs.dtype)
    log_w = torch.where(m > 0, prox_logprobs - behaviour_logprobs, torch.zeros_like(prox_logprobs))
    raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    over = (raw > cap) & (m > 0)
    if mode == "tis":
        weights = raw.clamp(max=cap)
    elif mode == "mis":
        weights = raw.masked_fill(over, 0.0)
    elif mode == "none":
        weights = torch.ones_like(raw)
    else:
        raise ValueError(f"importance-sampling correction must be 'none', 'tis' or 'mis', got {mode!r}")
    stats = {"is/weight_mean": _masked_mean(raw, m),
             "is/weight_max": raw.masked_fill(m == 0, 0.0).max() if m.any() else raw.new_tensor(1.0),
             "is/clipped_frac": _masked_mean(over.to(m.dtype), m) if mode != "none" else raw.new_tensor(0.0)}
    return weights, stats


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1.0)


def aggregate_token_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: LossAgg,
    *,
    max_len: int | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (m = mask as float, N = denominator).

        token-mean:              sum_{b,t} m*l / N,  N defaults to sum_{b,t} m   (DAPO, TRL "bnpo"/"dapo")
        seq-mean-token-mean:     sum_b [sum_t m*l / sum_t m] / N,  N defaults to B   (GRPO paper)
        seq-mean-token-sum-norm: sum_b [sum_t m*l / max_len] / N,  N defaults to B;
                                 max_len defaults to T                              (Dr.GRPO)

    A given `denominator` must be the count (tokens or sequences) of the whole step, so that the
    sum over micro-batches equals the full-batch loss.
    """
    m = mask.to(per_token.dtype)
    if loss_agg == "token-mean":
        count = m.sum().clamp(min=1.0)
        return (per_token * m).sum() / (count if denominator is None else denominator)
    if loss_agg == "seq-mean-token-mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    elif loss_agg == "seq-mean-token-sum-norm":
        per_seq = (per_token * m).sum(-1) / float(max_len or per_token.shape[-1])
    else:
        raise ValueError(f"loss_agg must be 'token-mean', 'seq-mean-token-mean' or "
                         f"'seq-mean-token-sum-norm', got {loss_agg!r}")
    return per_seq.sum() / (per_seq.shape[0] if denominator is None else denominator)


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_agg: LossAgg = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    max_len: int | None = None,
    denominator: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO / DAPO / Dr.GRPO clipped policy-gradient loss.

        r_t   = exp(clamp(logprobs_t - old_logprobs_t, -20, 20))
        l_t   = -w_t * min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)
                + kl_coef * KL_k(logprobs_t, ref_logprobs_t)        (KL term only with ref_logprobs)
        w_t   = token_weights (importance weights, "Off-policy correction"), 1 when None
        loss  = aggregate_token_loss(l, mask, loss_agg, max_len, denominator)

    Args:
        logprobs: [B, T] current-policy token log-probs (with grad).
        old_logprobs: [B, T] log-probs of the policy that sampled the tokens.
        advantages: [B] (broadcast over tokens) or [B, T].
        mask: [B, T] bool or 0/1 float, True on trained (completion) tokens.
        ref_logprobs: [B, T] reference-model log-probs, or None for no KL term.
        entropy: optional [B, T] token entropies, only reported as a metric.
        max_len, denominator: see `aggregate_token_loss`.
        token_weights: [B, T] importance weights (`importance_weights`), or None.

    Returns:
        (loss scalar, metrics of detached scalars, means over masked tokens):
        clip_frac (tokens where the clipped term was selected and differs), ratio, kl
        (0 without reference) and entropy (only when given).
    """
    m = mask.to(logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    # Padding positions may hold arbitrary values; zero them so they cannot overflow to inf*0=NaN.
    log_ratio = torch.where(m > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, torch.where(m > 0, ref_logprobs, logprobs), kl_estimator)
        per_token = per_token + kl_coef * kl
    loss = aggregate_token_loss(per_token, mask, loss_agg, max_len=max_len, denominator=denominator)
    with torch.no_grad():
        return loss, _policy_metrics(m, clipped > unclipped, ratio, kl, entropy)


def _policy_metrics(m: torch.Tensor, clipped: torch.Tensor, ratio: torch.Tensor, kl: torch.Tensor,
                    entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`grpo_policy_loss`'s metrics: means over the masked tokens."""
    metrics = {"clip_frac": _masked_mean(clipped.to(m.dtype), m), "ratio": _masked_mean(ratio, m),
               "kl": _masked_mean(kl, m)}
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, m)
    return metrics


def _preference_rewards(
    chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO-family losses (reference-based). For SimPO use `simpo_loss`.

    With h = (pi_c - ref_c) - (pi_r - ref_r) (log-ratio margin) and eps = label_smoothing:
        sigmoid: -(1 - eps) log s(beta h) - eps log s(-beta h)       (DPO; eps > 0 is cDPO)
        ipo:     (h - 1 / (2 beta))^2                                (Azar et al. 2023; pass
                                                                      length-averaged log-probs)
        hinge:   relu(1 - beta h)                                    (SLiC)
        robust:  [-(1 - eps) log s(beta h) + eps log s(-beta h)] / (1 - 2 eps)
                                                                     (Chowdhury et al. 2024)
    s is the logistic sigmoid; log s is computed with logsigmoid, so |h| = 1e4 stays finite.

    Args: the four log-probs are [P] sequence log-probs (summed over completion tokens).
    Returns: (losses [P], chosen_rewards [P], rejected_rewards [P]) with
        chosen_rewards = beta (pi_c - ref_c), rejected_rewards = beta (pi_r - ref_r), detached.
    """
    chosen_logratio = policy_chosen_logps - ref_chosen_logps
    rejected_logratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratio - rejected_logratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * h)
    elif loss_type == "robust":
        if not 0.0 <= eps < 0.5:
            raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {eps}")
        losses = (-(1.0 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1.0 - 2.0 * eps)
    else:
        raise ValueError(f"dpo loss_type must be 'sigmoid', 'ipo', 'hinge' or 'robust' "
                         f"(SimPO: use simpo_loss), got {loss_type!r}")
    return (losses, *_preference_rewards(chosen_logratio, rejected_logratio, beta))


def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng et al. 2024): reference-free, on length-normalized log-probs.

    With u = beta (pi_c - pi_r) - gamma and eps = label_smoothing:
        loss = -(1 - eps) log s(u) - eps log s(-u)

    Args: policy_*_logps [P] *length-averaged* sequence log-probs (sequence_logprobs(average=True)).
        gamma is the target reward margin (TRL's `simpo_gamma`).
    Returns: (losses [P], chosen_rewards = beta pi_c [P], rejected_rewards = beta pi_r [P]).
    """
    u = beta * (policy_chosen_logps - policy_rejected_logps) - gamma
    losses = -(1.0 - label_smoothing) * F.logsigmoid(u) - label_smoothing * F.logsigmoid(-u)
    return (losses, *_preference_rewards(policy_chosen_logps, policy_rejected_logps, beta))
