"""A GRPO step's scored rollouts, with DAPO's sampling (Yu et al. 2025): `collect_rollouts` is the
loop's one call for generate + reward; `filter_overlong` runs on the batch built from them.

Decisions (docs/design/grpo-loop.md, "DAPO sampling", has them at length, with every metric):
- Rewards: the reward functions score the model's tokens; a multi-turn episode's environment
  reward replaces theirs where it gave one ("Rewards" in rlhf/env/episodes.py).
- Over-long shaping (`grpo.overlong: shape`): DAPO's soft length penalty (rlhf.algo.overlong) is
  added to every reward before anything looks at the rewards, so dynamic sampling sees the
  shaped rewards (a group that differs only in length is informative). A response's length is
  the number of tokens the model wrote (an episode's model tokens, not its tool outputs).
- Dynamic sampling (`grpo.dynamic_sampling`): a group whose rewards are all equal has zero
  advantages, so it is dropped, and more prompts are generated from the same stream
  (`RolloutQueue.more`) until `prompts_per_step` informative groups are kept or
  `max_sampling_rounds` generations were made; then the step trains on what it has (with none, on
  the first round as it is: a step that changes nothing but is logged). On-policy only.
- Step metrics: reward metrics are the first round's (what the step would have logged without
  dynamic sampling), engine figures add up every round, `reward/std` and the lengths are of the
  samples trained on.
- Over-long filtering (`grpo.overlong: filter`): truncated responses keep their part in their
  group's baseline and are left out of the loss by zeroing their loss-mask rows (rlhf.algo.overlong).

Metrics: `overlong/filtered_frac`, `overlong/penalty_mean`, and `dynamic/groups_dropped`,
`extra_rounds`, `informative_frac`, `short_groups`, `samples_generated`, `reward_mean`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.algo.advantages import informative_groups
from rlhf.algo.overlong import filter_truncated, overlong_penalty
from rlhf.config import GRPOConfig, RunConfig
from rlhf.env.episodes import with_env_rewards
from rlhf.protocols import RewardScorer
from rlhf.rollouts import RolloutQueue
from rlhf.run.metrics import PhaseTimer, add_engine_metrics
from rlhf.types import Completion, RolloutBatch, TrainBatch


def collect_rollouts(step: int, queue: RolloutQueue, scorer: RewardScorer, cfg: RunConfig,
                     timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
    """Step `step`'s scored rollouts (rewards, shaping, dynamic sampling) and the step's dynamic/ and
    overlong/ metrics; generation and scoring time go to the timer's `generate` and `reward` phases."""
    with timer("generate"):  # the engines hold the weights of `step` updates
        rollouts = queue.next(step)
    metrics = score(rollouts, scorer, cfg, timer)
    if not cfg.grpo.dynamic_sampling:
        return rollouts, metrics
    want, g = cfg.grpo.prompts_per_step, cfg.grpo.group_size
    keep, rounds, generated = [], [rollouts], 0
    for round in range(cfg.grpo.max_sampling_rounds):
        if round:
            with timer("generate"):
                rounds.append(queue.more(step, round))
            score(rounds[-1], scorer, cfg, timer)
        informative = informative_groups(rounds[-1].rewards, g)
        generated += len(informative)
        keep += [(round, i) for i in informative.nonzero().flatten().tolist()]
        if len(keep) >= want:
            break
    dynamic = {"dynamic/groups_dropped": float(generated - len(keep)),
               "dynamic/extra_rounds": float(len(rounds) - 1),
               "dynamic/informative_frac": len(keep) / generated,
               "dynamic/short_groups": float(max(want - len(keep), 0)),
               "dynamic/samples_generated": float(sum(len(r.completions) for r in rounds))}
    kept = select_groups(rounds, keep[:want]) if keep else rollouts
    engine: dict[str, float] = {}
    for r in rounds:
        engine = add_engine_metrics(engine, r.engine_metrics)
    kept = replace(kept, engine_metrics=engine)
    return kept, {**metrics, **dynamic, "dynamic/reward_mean": float(kept.rewards.mean())}


def score(rollouts: RolloutBatch, scorer: RewardScorer, cfg: RunConfig, timer: PhaseTimer
          ) -> dict[str, float]:
    """Set `rollouts.rewards` ("Rewards", then the penalty of "Over-long shaping") and its reward
    metrics; returns the over-long metrics."""
    g = cfg.grpo.group_size
    with timer("reward"):
        if rollouts.rewards is None:  # else scored as they finished (rlhf.partial)
            rollouts.rewards, rollouts.reward_metrics = scorer.score(
                [rollouts.rows[i // g] for i in range(len(rollouts.completions))],
                [c.model_token_ids() for c in rollouts.completions],  # the scorer decodes them, in one batch
            )
        rollouts.rewards = with_env_rewards(rollouts.rewards, rollouts.completions)
    if cfg.grpo.overlong != "shape":
        return {}
    max_len = cfg.generation.max_new_tokens
    buffer = cfg.grpo.overlong_buffer or max(max_len // 4, 1)
    lengths = torch.tensor([response_length(c) for c in rollouts.completions])
    penalty = overlong_penalty(lengths, max_len, buffer, cfg.grpo.overlong_penalty_factor)
    rollouts.rewards = rollouts.rewards + penalty
    return {"overlong/penalty_mean": float(penalty.mean())}


def response_length(c: Completion) -> int:
    """Tokens the model wrote ("Over-long shaping")."""
    return len(c.model_token_ids())


def select_groups(rounds: list[RolloutBatch], keep: list[tuple[int, int]]) -> RolloutBatch:
    """One RolloutBatch of the groups `keep` names as (round, group), in that order; reward and
    engine metrics of the first round ("Step metrics": the caller adds up the engine's)."""
    g = rounds[0].group_size
    rows, prompt_ids, completions, rewards = [], [], [], []
    for r, i in keep:
        src = rounds[r]
        rows.append(src.rows[i])
        prompt_ids.append(src.prompt_ids[i])
        completions += src.completions[i * g:(i + 1) * g]
        rewards.append(src.rewards[i * g:(i + 1) * g])
    return replace(rounds[0], rows=rows, prompt_ids=prompt_ids, completions=completions,
                   rewards=torch.cat(rewards))


def filter_overlong(batch: TrainBatch, rollouts: RolloutBatch, grpo: GRPOConfig
                    ) -> tuple[TrainBatch, dict[str, float]]:
    """With `grpo.overlong: filter`, the batch with the truncated responses out of the loss
    and `overlong/filtered_frac`; otherwise the batch as it is and no metric."""
    if grpo.overlong != "filter":
        return batch, {}
    truncated = torch.tensor([c.finish_reason == "length" for c in rollouts.completions])
    batch = replace(batch, loss_mask=filter_truncated(batch.loss_mask, truncated))
    return batch, {"overlong/filtered_frac": float(truncated.float().mean())}
