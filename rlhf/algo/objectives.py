"""Training objectives the learners call: picklable frozen dataclasses over `rlhf.algo.losses`.

An objective is called once per micro-batch, `objective(logprobs, batch, denominator)`, where
`logprobs` are the current policy's token log-probs [B, T] (aligned like `TrainBatch`) and
`denominator` is the sum of `objective.num_units(mb)` over every micro-batch of every rank in the
optimizer step. Dividing by that global count (instead of each micro-batch's own) makes the
micro-batch losses add up exactly to the loss of the whole batch, whatever the split.

Gradient contract for learners: the sum over micro-batches *and ranks* of the returned losses is
the step loss, so gradients must be summed across ranks. Under DDP/FSDP, which average gradients
over the world, multiply the loss by the world size before `backward()`.

Metrics contract: every call returns 0-d tensors (on the log-probs' device: reading each back would
stall an accelerator once per micro-batch) or floats, that are *sums over the micro-batch*:
  "loss"    the micro-batch's share of the step loss (already divided by `denominator`);
  "weight"  how many units the other metrics are weighted by (masked tokens for GRPO, pairs for DPO);
  others    metric * weight (e.g. clip_frac times the number of masked tokens).
  *_max     a maximum (e.g. is/weight_max), combined by max instead (`is_max_metric`).
Sum the dicts key by key over micro-batches and ranks (an all-reduce SUM; MAX for the *_max
keys: `merge_metrics`, which keeps tensors on their device), then call `reduce_metrics`, which
reads them back at once (`metric_floats`), keeps "loss", "weight" and the maxima and divides
every other key by "weight".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import torch

from rlhf.algo.logprobs import sequence_logprobs
from rlhf.algo.losses import (ISCorrection, KLEstimator, LossAgg, dpo_loss, grpo_policy_loss,
                              importance_weights, simpo_loss)
from rlhf.config import DPOConfig, GRPOConfig
from rlhf.types import PreferenceBatch, TrainBatch

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


def is_max_metric(key: str) -> bool:
    """Whether metric `key` is combined by max over micro-batches and ranks (else by sum)."""
    return key.endswith("_max")


def merge_metrics(total: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """Add one micro-batch's (or rank's) metrics into `total`, in place: sums, maxima for *_max.
    Tensors stay tensors on their device (no read-back per micro-batch); floats stay floats."""
    for key, value in part.items():
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        if key not in total:
            total[key] = value
        elif is_max_metric(key):
            both = (total[key], value)
            total[key] = (max(both) if not any(isinstance(v, torch.Tensor) for v in both)
                          else torch.maximum(*(torch.as_tensor(v, dtype=torch.float64) for v in both)))
        else:
            total[key] = total[key] + value
    return total


def metric_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """`metrics` as python floats, its tensors read back in one transfer (one stall, not one a key)."""
    tensors = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not tensors:
        return {k: float(v) for k, v in metrics.items()}
    device = metrics[tensors[0]].device
    read = torch.stack([metrics[k].to(device, torch.float64).reshape(()) for k in tensors]).tolist()
    floats = dict(zip(tensors, read))
    return {k: floats[k] if k in floats else float(v) for k, v in metrics.items()}


def reduce_metrics(parts: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Combine objective metrics of several micro-batches (and ranks) into step metrics.

        out["loss"] = sum_i parts[i]["loss"];  out["weight"] = W = sum_i parts[i]["weight"]
        out[k]      = max_i parts[i][k]        for k ending in _max
        out[k]      = sum_i parts[i][k] / W    for every other key (0 when W == 0)

    Passing a single dict that is already the key-wise sum over ranks is equally valid.
    """
    total: dict[str, Any] = {}
    for part in parts:
        merge_metrics(total, part)
    total = metric_floats(total)
    weight = total.get("weight", 0.0)
    return {k: v if k in ("loss", "weight") or is_max_metric(k) else (v / weight if weight > 0 else 0.0)
            for k, v in total.items()}


@dataclass(frozen=True)
class GRPOObjective:
    """Clipped GRPO/DAPO/Dr.GRPO policy loss on a `TrainBatch` (see `rlhf.algo.losses.grpo_policy_loss`).

    max_len: Dr.GRPO's constant normalizer, required with loss_agg="seq-mean-token-sum-norm":
    the completion-length cap (generation.max_new_tokens), as TRL's `max_completion_length`.
    The padded width T is no substitute: micro-batches are trimmed to different widths.

    `batch.old_logprobs=None` means strictly on-policy (one update per step): old = current
    log-probs detached, so the ratio is exactly 1. With `batch.sampler_logprobs` the metrics also
    carry "mismatch/logprob_abs_diff", the mean |log p_learner - log p_sampler| over masked tokens.

    is_correction (`tis`/`mis`, cap `is_cap`): each token's policy term is weighted by old (the
    proximal policy) over the sampler's probability ("Off-policy correction" in rlhf.algo.losses);
    the metrics then carry `is/weight_mean`, `is/weight_max` and `is/clipped_frac`. Needs
    `batch.sampler_logprobs`.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    max_len: int | None = None
    is_correction: ISCorrection = "none"
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.loss_agg not in get_args(LossAgg):
            raise ValueError(f"loss_agg must be one of {get_args(LossAgg)}, got {self.loss_agg!r}")
        if self.kl_estimator not in get_args(KLEstimator):
            raise ValueError(f"kl_estimator must be one of {get_args(KLEstimator)}, "
                             f"got {self.kl_estimator!r}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, "
                             f"got {self.clip_low}, {self.clip_high}")
        if self.loss_agg == "seq-mean-token-sum-norm" and not self.max_len:
            raise ValueError("loss_agg='seq-mean-token-sum-norm' (Dr.GRPO) needs max_len, the completion "
                             "length cap: GRPOObjective.from_config(cfg.grpo, "
                             "max_len=cfg.generation.max_new_tokens)")

    @classmethod
    def from_config(cls, cfg: GRPOConfig, *, max_len: int | None = None,
                    quantized_rollouts: bool = False) -> GRPOObjective:
        """From the `grpo` config section; max_len = generation.max_new_tokens (needed by Dr.GRPO).
        `is_correction: auto` is tis where the engine samples from another policy than the learner's:
        asynchronous generation (max_staleness > 0) or quantized rollouts (generation.quantization);
        else none."""
        correction = cfg.is_correction
        if correction == "auto":
            correction = "tis" if cfg.max_staleness > 0 or quantized_rollouts else "none"
        return cls(clip_low=cfg.clip_low, clip_high=cfg.clip_high, loss_agg=cfg.loss_agg,
                   kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, max_len=max_len,
                   is_correction=correction, is_cap=cfg.is_cap)

    def num_units(self, batch: TrainBatch) -> float:
        """This batch's share of the step denominator: masked tokens (token-mean) or the sequences
        with at least one (a row filtered out of the loss, rlhf.algo.overlong, counts in neither)."""
        if self.loss_agg == "token-mean":
            return float(batch.loss_mask.sum())
        return float((batch.loss_mask.sum(-1) > 0).sum())

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) for one micro-batch; logprobs [B, T]. Metrics per the module docstring:
        loss, weight (masked tokens), clip_frac, ratio, kl and, with sampler log-probs,
        mismatch/logprob_abs_diff (each times weight)."""
        if self.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs batch.ref_logprobs (reference-model log-probs)")
        dev = logprobs.device

        def here(t: torch.Tensor) -> torch.Tensor:  # host -> device without waiting for the queue
            return t.to(dev, non_blocking=True)

        mask = here(batch.loss_mask)
        old = logprobs.detach() if batch.old_logprobs is None else here(batch.old_logprobs)
        ref = None if batch.ref_logprobs is None else here(batch.ref_logprobs)
        weights, is_stats = None, {}
        if self.is_correction != "none":
            if batch.sampler_logprobs is None:
                raise ValueError(f"is_correction={self.is_correction!r} needs batch.sampler_logprobs (the engine's)")
            weights, is_stats = importance_weights(old, here(batch.sampler_logprobs), mask, self.is_correction,
                                                   self.is_cap)
        loss, stats = grpo_policy_loss(
            logprobs, old, here(batch.advantages), mask, clip_low=self.clip_low, clip_high=self.clip_high,
            loss_agg=self.loss_agg, ref_logprobs=ref, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator, max_len=self.max_len, denominator=denominator, token_weights=weights,
        )
        weight = mask.sum(dtype=torch.float64)
        metrics = {"loss": loss.detach().double(), "weight": weight}
        # means as weighted sums; a maximum (is/weight_max) as it is: reduce_metrics takes the max
        metrics.update({k: v.detach().double() if is_max_metric(k) else v.detach().double() * weight
                        for k, v in (stats | is_stats).items()})
        if batch.sampler_logprobs is not None:
            diff = (logprobs.detach() - here(batch.sampler_logprobs)).abs()
            metrics["mismatch/logprob_abs_diff"] = diff.masked_fill(~mask.bool(), 0.0).sum(dtype=torch.float64)
        return loss, metrics


@dataclass(frozen=True)
class DPOObjective:
    """DPO-family loss on a `PreferenceBatch` (sigmoid/cDPO, ipo, hinge, robust; simpo).

    Log-probs per pair are summed over response tokens (DPO); IPO and SimPO use the per-token
    average instead (TRL 1.16 normalizes IPO by length; SimPO is defined on it), obtained by
    dividing the policy and reference sums by the response length. Reported rewards are
    beta * (log-ratio) in the space the loss uses, so per-token for IPO and SimPO.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    @classmethod
    def from_config(cls, cfg: DPOConfig) -> DPOObjective:
        return cls(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                   simpo_gamma=cfg.simpo_gamma)

    @staticmethod
    def sequence_logps(token_lp: torch.Tensor, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs split into (chosen [P], rejected [P]); token_lp [2P, T]."""
        return sequence_logprobs(token_lp, batch.loss_mask.to(token_lp.device, non_blocking=True)).chunk(2)

    def num_units(self, batch: PreferenceBatch) -> float:
        """This batch's share of the step denominator: the number of pairs."""
        return float(len(batch))

    def __call__(
        self, logprobs: torch.Tensor, batch: PreferenceBatch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(sum of per-pair losses / denominator, metrics); logprobs [2P, T]. Metrics (times
        weight = P): rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin,
        logps/chosen, logps/rejected (summed log-probs)."""
        chosen, rejected = self.sequence_logps(logprobs, batch)
        if self.loss_type in ("ipo", "simpo"):
            lengths = batch.loss_mask.to(logprobs.device, non_blocking=True).sum(-1).clamp(min=1).to(logprobs.dtype)
            len_c, len_r = lengths.chunk(2)
        else:
            len_c = len_r = torch.ones((), dtype=logprobs.dtype, device=logprobs.device)
        if self.loss_type == "simpo":
            losses, r_c, r_r = simpo_loss(chosen / len_c, rejected / len_r, beta=self.beta,
                                          gamma=self.simpo_gamma, label_smoothing=self.label_smoothing)
        else:
            if batch.ref_chosen_logps is None or batch.ref_rejected_logps is None:
                raise ValueError(f"loss_type={self.loss_type!r} needs batch.ref_chosen_logps and "
                                 f"batch.ref_rejected_logps")
            ref_c = batch.ref_chosen_logps.to(logprobs.device, non_blocking=True)
            ref_r = batch.ref_rejected_logps.to(logprobs.device, non_blocking=True)
            losses, r_c, r_r = dpo_loss(chosen / len_c, rejected / len_r, ref_c / len_c, ref_r / len_r,
                                        beta=self.beta, loss_type=self.loss_type,  # type: ignore[arg-type]
                                        label_smoothing=self.label_smoothing)
        loss = losses.sum() / denominator
        sums = {"loss": loss.detach(), "rewards/chosen": r_c.sum(), "rewards/rejected": r_r.sum(),
                "rewards/accuracy": (r_c > r_r).sum(), "rewards/margin": (r_c - r_r).sum(),
                "logps/chosen": chosen.detach().sum(), "logps/rejected": rejected.detach().sum()}
        metrics = {"weight": float(len(batch))} | {k: v.detach().double() for k, v in sums.items()}
        return loss, metrics
