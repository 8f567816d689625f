"""GRPO, on-policy or with generation running ahead: the whole loop in `run_grpo`, one named call per phase.

Algorithmic choices (each a config key):
1. Group-relative advantages: G completions per prompt, A = (r - mean_group) / std_group;
   `grpo.scale_by_std=false` drops the std (Dr.GRPO).
2. PPO-clip objective with asymmetric clip [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
   With one update per step (the default) the policy that sampled is the one being trained,
   so old log-probs are the current ones detached: no extra forward pass.
   With `grpo.updates_per_step > 1` the learners recompute old log-probs once before updating.
3. KL to a frozen reference only when `grpo.kl_coef > 0` (k1/k2/k3 estimators); otherwise no
   reference model exists at all.
4. Token-level loss normalization by default (`token-mean`), over the whole step's tokens on all
   ranks, so micro-batching and sharding never change the gradient.
5. Weights are pushed to the generator after every optimizer step, before the next generation.
   The generator may be several engines (data parallel); the loop sees one Generator.
6. With `eval_every=N > 0`, pass@k on a fixed held-out subset (rlhf.evaluate) before steps 0, N,
   2N, ... (merged into that step's record of metrics.jsonl: the policy after that many updates)
   and once more after the last step (a record of its own, `step` = grpo.steps).
7. A reward that fails on a sample (raises, hangs, returns NaN or a non-number, crashes its
   worker) scores 0 there and is counted per cause (rewards.pool choice 4); one that fails on
   every sample for `reward.max_failed_steps` steps in a row stops the run (`RewardFailure`).
   An update whose loss or gradient is NaN/inf is skipped by the learners; `learner.max_nonfinite_steps`
   of them in a row, or weights that became NaN/inf, stop the run before anything is synced or
   saved (`rlhf.run.metrics.TrainHealth`).
8. Rollouts come from a queue (rlhf.rollouts): with `grpo.max_staleness=s > 0` the engines
   generate step k+s while the learners train on step k (asynchronous GRPO), and the loop waits
   for them before pushing weights. The overlap is only in that schedule; each step still reads
   generate, reward, train, sync. Stale samples are corrected by importance weights
   (`grpo.is_correction`, rlhf.algo.losses point 5); `async/staleness` logs the lag. Colocated on a
   GPU, the engines sleep while the learners train, so there the overlap is nil.
9. DAPO's sampling (rlhf.sampling), each off by default: `grpo.dynamic_sampling` drops groups whose
   rewards are all equal and generates more prompts until the step has `prompts_per_step`
   informative groups (at most `grpo.max_sampling_rounds` generations); `grpo.overlong` filters
   truncated responses out of the loss or adds a soft length penalty to their reward.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf.algo.advantages import grpo_advantages
from rlhf.algo.objectives import GRPOObjective
from rlhf.config import RunConfig
from rlhf.data.batching import rollouts_to_batch
from rlhf.data.stream import PromptStream
from rlhf.env.episodes import EpisodeSampler
from rlhf.errors import RunError
from rlhf.evaluate import EvalSet, Evaluator
from rlhf.protocols import Cluster, Generator
from rlhf.rollouts import RolloutQueue
from rlhf.rules import scores_reference
from rlhf.run.checkpoint import resume, save_checkpoint
from rlhf.run.metrics import MetricsLogger, PhaseTimer, TrainHealth
from rlhf.sampling import collect_rollouts, filter_overlong
from rlhf.types import RolloutBatch, StepMetrics, TrainBatch


def run_grpo(cfg: RunConfig, cluster: Cluster, prompts: PromptStream, tokenizer: Any,
             eval_set: EvalSet | None = None) -> None:
    """Train for `cfg.grpo.steps` steps (continuing from the latest checkpoint if `cfg.resume`).

    `prompts` yields (PromptRow, prompt token ids) pairs; `tokenizer` decodes nothing here, it
    supplies the pad id and, with `eval_every > 0`, renders the held-out prompts (choice 6) unless
    `eval_set` holds them already (the scripts load it before Ray starts).
    """
    episodes = EpisodeSampler.from_config(cfg.env, cluster.generator, tokenizer)  # multi-turn with env.tools
    rollout_queue = RolloutQueue(cluster.generator, prompts, cfg, episodes)  # choice 8
    start = resume(cfg.output_dir, cfg.resume, cluster.learners, rollout_queue)
    objective = GRPOObjective.from_config(cfg.grpo, max_len=cfg.generation.max_new_tokens,
                                          quantized_rollouts=cfg.generation.quantization != "none")
    evaluator = Evaluator.from_config(cfg, tokenizer, eval_set) if cfg.eval_every else None
    cluster.weight_sync.push(version=start)  # the generator starts from the learners' weights
    # The final evaluation is one more tick of the progress bar.
    total = cfg.grpo.steps + (evaluator is not None)
    log = MetricsLogger(cfg.output_dir, total_steps=total, start_step=start, desc="grpo")
    reward_health = RewardHealth(cfg.reward.max_failed_steps)
    train_health = TrainHealth.from_config(cfg)
    for step in range(start, cfg.grpo.steps):
        evals = evaluate_if_due(evaluator, cluster.generator, step, cfg.eval_every)
        timer, t0 = PhaseTimer(), time.perf_counter()
        # generate and reward; dynamic sampling and over-long shaping when on (choice 9)
        rollouts, sampling_metrics = collect_rollouts(step, rollout_queue, cluster.rewards, cfg, timer)
        reward_health.check(rollouts.reward_metrics)
        advantages = grpo_advantages(rollouts.rewards, cfg.grpo.group_size, scale_by_std=cfg.grpo.scale_by_std)
        batch, overlong_metrics = filter_overlong(
            rollouts_to_batch(rollouts, advantages, tokenizer.pad_token_id), rollouts, cfg.grpo)  # choice 9
        with timer("train"):
            train_metrics = update_policy(cluster, batch, objective, cfg)
        train_health.check(step, train_metrics)  # before the weights go anywhere
        with timer("wait_rollouts"):  # weights change only between generations
            rollout_queue.finish()
        with timer("sync"):
            sync_metrics = cluster.weight_sync.push(version=step + 1)
        timer.seconds["timing/step_s"] = time.perf_counter() - t0
        log.log(step, {**step_metrics(step, rollouts, batch, train_metrics, timer.seconds), **rollouts.engine_metrics,
                       **sync_metrics, **sampling_metrics, **overlong_metrics, **evals})
        if step + 1 == cfg.grpo.steps or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            save_checkpoint(cfg.output_dir, step + 1, cluster.learners, {"prompts": rollout_queue.state_dict()},
                            keep=cfg.keep_checkpoints)
    if evaluator is not None:  # the trained policy
        log.log(cfg.grpo.steps, evaluator(cluster.generator))
        evaluator.close()
    log.close()


class RewardFailure(RunError):
    """A reward function failed on every sample of `reward.max_failed_steps` steps in a row."""


class RewardHealth:
    """Counts consecutive steps on which some reward function failed on every sample (choice 7)."""

    def __init__(self, max_failed_steps: int) -> None:
        self.max_failed_steps, self.failed_steps = max_failed_steps, 0

    def check(self, metrics: dict[str, float]) -> None:
        dead = [k.removeprefix("reward/").removesuffix("/failed_frac") for k, v in metrics.items()
                if k.endswith("/failed_frac") and v == 1.0]
        self.failed_steps = self.failed_steps + 1 if dead else 0
        if self.failed_steps >= self.max_failed_steps:
            causes = ", ".join(f"{int(v)} {k.removeprefix('reward/failed/')}" for k, v in metrics.items()
                               if k.startswith("reward/failed/") and v) or "none"
            timeouts = int(metrics.get("reward/timeouts", 0))
            raise RewardFailure(
                f"reward {', '.join(dead)} failed on every sample for {self.failed_steps} steps in a row "
                f"(reward.max_failed_steps={self.max_failed_steps}; last step: {causes} failures, "
                f"{timeouts} time-outs; details in the reward worker's log)")


def evaluate_if_due(evaluator: Evaluator | None, generator: Generator, step: int, every: int
                    ) -> dict[str, float]:
    """pass@k of the current weights before steps 0, N, 2N, ... (`eval_every=N`); {} otherwise."""
    if evaluator is None or step % every:
        return {}
    return evaluator(generator)


def update_policy(cluster: Cluster, batch: TrainBatch, objective: GRPOObjective, cfg: RunConfig) -> StepMetrics:
    """Reference/old log-probs when the objective needs them, then the optimizer update(s), all
    on the learners. The generator sleeps meanwhile, so colocated learners get its device memory."""
    cluster.generator.sleep()
    metrics = cluster.learners.update(batch, objective, reference=scores_reference(cfg),
                                      updates=cfg.grpo.updates_per_step)
    cluster.generator.wake()
    return metrics


def step_metrics(step: int, rollouts: RolloutBatch, batch: TrainBatch, train: StepMetrics,
                 seconds: dict[str, float]) -> dict[str, float]:
    """The per-step record of metrics.jsonl."""
    r = rollouts.rewards
    lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions], dtype=torch.float32)
    gen_tokens = float(lengths.sum())
    # The engines' own tokens and seconds (every round of dynamic sampling; with generation running
    # ahead, the loop's wait is shorter than the engines' time).
    engine = {k: v for k, v in rollouts.engine_metrics.items() if k.startswith("gen/engine")}
    engine_s = [v for k, v in engine.items() if k.endswith("_s")]
    engine_tokens = sum(v for k, v in engine.items() if k.endswith("_tokens")) or gen_tokens
    return {
        "reward/mean": float(r.mean()),
        "reward/std": float(r.std()) if r.numel() > 1 else 0.0,
        **rollouts.reward_metrics,
        "loss": train.loss,
        "grad_norm": train.grad_norm,
        "kl": train.values.get("kl", 0.0),
        "clip_frac": train.values.get("clip_frac", 0.0),
        "mismatch/logprob_abs_diff": train.values.get("mismatch/logprob_abs_diff", 0.0),
        **{k: v for k, v in train.values.items() if k not in ("kl", "clip_frac", "mismatch/logprob_abs_diff")},
        "response_len/mean": float(lengths.mean()),
        "response_len/max": float(lengths.max()),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in rollouts.completions) / len(lengths),
        **seconds,
        "throughput/tokens_per_s": (gen_tokens + float(batch.attention_mask.sum())) / seconds["timing/step_s"],
        "throughput/gen_tokens_per_s": engine_tokens / max(max(engine_s, default=seconds["timing/generate_s"]), 1e-9),
        "async/version": float(rollouts.version),
        "async/staleness": float(step - rollouts.version),
    }
