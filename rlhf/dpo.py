"""Offline DPO on the learner group: the whole loop in `run_dpo`, one named call per phase.

Decisions (each a config key):
- Pairs together: chosen and rejected of every pair sit in one `PreferenceBatch` (chosen rows, then
  rejected rows); learner micro-batches keep the two rows of a pair together, so one forward pass
  scores both. The loss is `dpo.loss_type` (sigmoid/cDPO with label smoothing, ipo, hinge, robust)
  or SimPO, normalized by the step's pair count over all ranks.
- Reference log-probs: by default the frozen reference model on the learner group scores each
  batch just before its update. With `dpo.precompute_ref` the policy itself scores the whole
  dataset in one pass before the first update (at step 0 it *is* the reference) and no reference
  model is ever built; the sums are cached in `<output_dir>/reference_logps.pt` and reused on
  resume. SimPO uses no reference at all.
- Data order: pairs stream through an epoch-shuffled, resumable `PromptStream` seeded with the run
  seed; the run is `dpo.max_steps` steps, or ceil(epochs * pairs / pairs_per_step).
- Evaluation: with `eval_every > 0`, held-out pairs are scored before training (logged as step -1),
  every N steps and at the end: eval/loss, eval/reward_accuracy (implicit reward of chosen above
  rejected: DPO's preference accuracy), eval/margin, and eval/logp_accuracy (the policy's own summed
  log-prob ranks chosen above rejected, meaningful before training too).
- Non-finite steps: a step whose loss or gradient is NaN/inf is skipped by the learners;
  `learner.max_nonfinite_steps` of them in a row, or weights that became NaN/inf, stop the run
  before the next save (`rlhf.run.metrics.TrainHealth`).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.algo.objectives import DPOObjective, reduce_metrics
from rlhf.config import ConfigError, DPOConfig, RunConfig
from rlhf.data.batching import pairs_to_batch
from rlhf.data.preferences import PreferenceData
from rlhf.data.stream import PromptStream
from rlhf.protocols import LearnerGroup
from rlhf.rules import checkpoint_due, scores_reference
from rlhf.run.checkpoint import resume, save_checkpoint
from rlhf.run.metrics import MetricsLogger, PhaseTimer, TrainHealth
from rlhf.types import PreferenceBatch, PreferencePair, StepMetrics

SCORING_CHUNK_PAIRS = 64
"""Pairs per learner call when scoring a whole split (reference pass, evaluation)."""


def run_dpo(cfg: RunConfig, learners: LearnerGroup, data: PreferenceData, pad_id: int) -> None:
    """Train for `dpo_steps(cfg.dpo, ...)` steps (continuing from the latest checkpoint if `cfg.resume`)."""
    stream = PromptStream(list(enumerate(data.train)), seed=cfg.seed)
    total = dpo_steps(cfg.dpo, len(data.train))
    start = resume(cfg.output_dir, cfg.resume, learners, stream)
    objective = DPOObjective.from_config(cfg.dpo)
    reference = ReferenceLogps.prepare(cfg, learners, data, pad_id, start_step=start)
    log = MetricsLogger(cfg.output_dir, total_steps=total, start_step=start, desc="dpo")
    health = TrainHealth.from_config(cfg)
    if cfg.eval_every and start == 0:
        log.log(-1, evaluate_pairs(learners, data.eval, reference.eval, objective, pad_id), advance=False)
    for step in range(start, total):
        timer, t0 = PhaseTimer(), time.perf_counter()
        indexed = stream.take(cfg.dpo.pairs_per_step)
        batch = pairs_to_batch([pair for _, pair in indexed], pad_id)
        with timer("reference"):
            reference.fill(batch, [i for i, _ in indexed])
        with timer("train"):
            train = learners.train_step(batch, objective)
        health.check(step, train)  # NaN/inf: skipped steps counted, broken weights never saved
        timer.seconds["timing/step_s"] = time.perf_counter() - t0
        record = step_metrics(train, batch, timer.seconds, epoch=stream.epoch)
        last = step + 1 == total
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
            record.update(evaluate_pairs(learners, data.eval, reference.eval, objective, pad_id))
        log.log(step, record)
        if checkpoint_due(step + 1, total, cfg.save_every):
            save_checkpoint(cfg.output_dir, step + 1, learners, {"prompts": stream.state_dict()}, keep=cfg.keep_checkpoints)
    log.close()


def dpo_steps(dpo: DPOConfig, num_pairs: int) -> int:
    """Optimizer steps of the run: dpo.max_steps, else enough for dpo.epochs passes."""
    return dpo.max_steps or math.ceil(dpo.epochs * num_pairs / dpo.pairs_per_step)


def step_metrics(train: StepMetrics, batch: PreferenceBatch, seconds: dict[str, float], *, epoch: int
                 ) -> dict[str, float]:
    """The per-step record of metrics.jsonl."""
    tokens = float(batch.attention_mask.sum())
    return {
        "loss": train.loss,
        **{k: train.values[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracy",
                                        "rewards/margin", "logps/chosen", "logps/rejected")},
        "grad_norm": train.grad_norm,
        **{k: v for k, v in train.values.items() if not k.startswith(("rewards/", "logps/"))},
        "epoch": epoch,
        "pairs": len(batch),
        **seconds,
        "throughput/tokens_per_s": tokens / seconds["timing/step_s"],
    }


# ---------------------------------------------------------------------------------------------
# Reference log-probs


def score_pairs(learners: LearnerGroup, pairs: list[PreferencePair], pad_id: int, *, reference: bool
                ) -> torch.Tensor:
    """Summed response log-probs [N, 2] (chosen, rejected) of every pair, in chunks."""
    out = []
    for start in range(0, len(pairs), SCORING_CHUNK_PAIRS):
        batch = pairs_to_batch(pairs[start:start + SCORING_CHUNK_PAIRS], pad_id)
        chosen, rejected = DPOObjective.sequence_logps(learners.logprobs(batch, reference=reference), batch)
        out.append(torch.stack([chosen, rejected], dim=1))
    return torch.cat(out) if out else torch.zeros((0, 2))


def _fingerprint(data: PreferenceData) -> str:
    return hashlib.sha256(repr((data.train, data.eval)).encode()).hexdigest()[:16]


def _load_cache(path: Path) -> dict | None:
    """`reference_logps.pt` read weights-only (no pickle from disk runs), None where there is none.
    A file that holds anything else (planted, or not written by this program) is refused in one
    line rather than skipped: something wrote into the run's folder."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((ln.split("WeightsUnpickler error:")[1].split(". ")[0].strip()
                    for ln in str(e).splitlines() if "WeightsUnpickler error:" in ln), type(e).__name__)
        raise ConfigError(f"{path} is not a reference log-prob cache this program wrote: it holds objects "
                          f"a weights-only load refuses ({why[:160]}), and unpickling them could run code; "
                          f"delete it to score the reference again") from None
    if not isinstance(cached, dict) or not {"fingerprint", "eval"} <= cached.keys():
        raise ConfigError(f"{path} is not a reference log-prob cache this program wrote (keys "
                          f"{sorted(cached) if isinstance(cached, dict) else type(cached).__name__}); "
                          f"delete it to score the reference again")
    return cached


@dataclass
class ReferenceLogps:
    """Summed reference log-probs (chosen, rejected) per pair, from a cache or the reference model.

    train: [N, 2] for every training pair (precompute_ref), or None: `fill` asks the reference
           model on the learners for each batch. Unused (None, and no model) for SimPO.
    eval:  [M, 2] for the held-out pairs, always computed once and cached.
    """

    learners: LearnerGroup
    needed: bool
    train: torch.Tensor | None
    eval: torch.Tensor | None

    @classmethod
    def prepare(cls, cfg: RunConfig, learners: LearnerGroup, data: PreferenceData, pad_id: int, *,
                start_step: int) -> ReferenceLogps:
        """Load `<output_dir>/reference_logps.pt` when it matches the data, else compute and save it.

        Without a reference model, the scores come from the policy, which is only the reference
        before the first update: a resumed precompute_ref run needs the cache it wrote at step 0.
        """
        if cfg.dpo.loss_type == "simpo":
            return cls(learners, needed=False, train=None, eval=None)
        path = Path(cfg.output_dir) / "reference_logps.pt"
        fingerprint = _fingerprint(data)
        cached = _load_cache(path)
        if cached is not None and cached["fingerprint"] == fingerprint:
            return cls(learners, needed=True, train=cached.get("train"), eval=cached["eval"])
        use_model = scores_reference(cfg)
        if not use_model and start_step > 0:
            raise RuntimeError(f"dpo.precompute_ref: {path} is missing or was written for other data; the "
                               f"policy is no longer the reference after step 0, so resume cannot rebuild it")
        print(f"reference log-probs: scoring {len(data.eval)} eval"
              + ("" if use_model else f" and {len(data.train)} train") + " pairs")
        ref = cls(learners, needed=True,
                  train=None if use_model else score_pairs(learners, data.train, pad_id, reference=False),
                  eval=score_pairs(learners, data.eval, pad_id, reference=use_model))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"fingerprint": fingerprint, "train": ref.train, "eval": ref.eval}, path)
        return ref

    def fill(self, batch: PreferenceBatch, indices: list[int]) -> None:
        """Set batch.ref_chosen_logps / ref_rejected_logps for the training pairs `indices`."""
        if not self.needed:
            return
        if self.train is not None:
            sums = self.train[torch.tensor(indices)]
        else:
            lp = self.learners.logprobs(batch, reference=True)
            sums = torch.stack(DPOObjective.sequence_logps(lp, batch), dim=1)
        batch.ref_chosen_logps, batch.ref_rejected_logps = sums[:, 0].contiguous(), sums[:, 1].contiguous()


# ---------------------------------------------------------------------------------------------
# Held-out evaluation


def evaluate_pairs(learners: LearnerGroup, pairs: list[PreferencePair], ref: torch.Tensor | None,
                   objective: DPOObjective, pad_id: int) -> dict[str, float]:
    """eval/* metrics of the current policy on held-out pairs ("Evaluation"); {} without pairs."""
    if not pairs:
        return {}
    parts, logp_wins = [], 0.0
    for start in range(0, len(pairs), SCORING_CHUNK_PAIRS):
        batch = pairs_to_batch(pairs[start:start + SCORING_CHUNK_PAIRS], pad_id)
        if ref is not None:
            chunk = ref[start:start + len(batch)]
            batch.ref_chosen_logps, batch.ref_rejected_logps = chunk[:, 0], chunk[:, 1]
        lp = learners.logprobs(batch)
        _, metrics = objective(lp, batch, float(len(pairs)))
        parts.append(metrics)
        chosen, rejected = DPOObjective.sequence_logps(lp, batch)
        logp_wins += float((chosen > rejected).sum())
    m = reduce_metrics(parts)
    return {
        "eval/loss": m["loss"],
        "eval/reward_accuracy": m["rewards/accuracy"],
        "eval/margin": m["rewards/margin"],
        "eval/logp_accuracy": logp_wins / len(pairs),
        "eval/pairs": float(len(pairs)),
    }
