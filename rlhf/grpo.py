"""GRPO, on-policy or with generation running ahead: the whole loop in `run_grpo`, one named call per phase.

Decisions (each a config key; docs/design/grpo-loop.md gives the reasons):
- Group-relative advantages: G completions per prompt, A = (r - mean_group) / std_group;
  `grpo.scale_by_std=false` drops the std (Dr.GRPO).
- PPO-clip objective with the asymmetric clip [1 - clip_low, 1 + clip_high] (DAPO clip-higher). With
  one update per step the old log-probs are the current ones detached: no extra forward pass.
- KL only when asked: a frozen reference exists only with `grpo.kl_coef > 0`.
- Token-level normalization (`token-mean`) over the whole step's tokens on all ranks, so
  micro-batching and sharding never change the gradient.
- Weights pushed every step, after the optimizer step and before the next generation; several
  engines are one Generator to the loop.
- Evaluation: with `eval_every=N > 0`, pass@k (rlhf.evaluate) before steps 0, N, 2N, ... (in that
  step's record) and once after the last step.
- Failures: a reward that fails on a sample scores 0 and is counted per cause; one that fails on
  every sample for `reward.max_failed_steps` steps stops the run (`RewardHealth`). NaN/inf updates
  are skipped by the learners and stop the run when they repeat (`rlhf.run.metrics.TrainHealth`).
- Asynchronous rollouts (`RolloutQueue`): with `grpo.max_staleness=s > 0` the engines generate step
  k+s while the learners train on step k, and the loop waits for them before pushing weights; stale
  samples are corrected by importance weights (`grpo.is_correction`).
- Streaming and partial rollouts (`RolloutStream`, `grpo.rollouts: stream | partial`): samples are
  taken as each finishes; with `partial` a step trains on the first groups to finish and the others
  continue under the next weights, at most max_staleness versions old when trained.
- DAPO sampling (rlhf.sampling), off by default: `grpo.dynamic_sampling` and `grpo.overlong`.
- Learning-signal watch (`SignalWatch`): a step whose groups all scored one reward each cannot move
  the policy, so in a run's first steps it is said at once, with its likeliest cause; later, a stall
  (few informative groups for several steps in a row) is said once, until the signal comes back.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf.algo.advantages import grpo_advantages, informative_groups
from rlhf.algo.objectives import GRPOObjective
from rlhf.config import RunConfig
from rlhf.data.batching import rollouts_to_batch
from rlhf.data.stream import PromptStream
from rlhf.env.episodes import EpisodeSampler
from rlhf.errors import RunError
from rlhf.evaluate import EvalSet, Evaluator
from rlhf.partial import RolloutStream
from rlhf.protocols import Cluster, Generator
from rlhf.rollouts import RolloutQueue
from rlhf.rules import checkpoint_due, scores_reference
from rlhf.run.checkpoint import resume, save_checkpoint
from rlhf.run.metrics import MetricsLogger, PhaseTimer, TrainHealth
from rlhf.sampling import collect_rollouts, filter_overlong
from rlhf.types import RolloutBatch, StepMetrics, TrainBatch


def run_grpo(cfg: RunConfig, cluster: Cluster, prompts: PromptStream, tokenizer: Any,
             eval_set: EvalSet | None = None) -> None:
    """Train for `cfg.grpo.steps` steps (continuing from the latest checkpoint if `cfg.resume`).

    `prompts` yields (PromptRow, prompt token ids) pairs; `tokenizer` decodes nothing here, it
    supplies the pad id and, with `eval_every > 0`, renders the held-out prompts ("Evaluation") unless
    `eval_set` holds them already (the scripts load it before Ray starts).
    """
    episodes = EpisodeSampler.from_config(cfg.env, cluster.generator, tokenizer)  # multi-turn with env.tools
    rollout_queue = (RolloutQueue(cluster.generator, prompts, cfg, episodes) if cfg.grpo.rollouts == "batch"
                     else RolloutStream(cluster.generator, prompts, cfg, cluster.rewards, episodes))
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
    signal_watch = SignalWatch(start, cfg.generation.max_new_tokens)
    for step in range(start, cfg.grpo.steps):
        evals = evaluate_if_due(evaluator, cluster.generator, step, cfg.eval_every)
        timer, t0 = PhaseTimer(), time.perf_counter()
        # generate and reward; dynamic sampling and over-long shaping when on (DAPO sampling)
        rollouts, sampling_metrics = collect_rollouts(step, rollout_queue, cluster.rewards, cfg, timer)
        reward_health.check(rollouts.reward_metrics)
        signal = learning_signal(rollouts)
        if warning := signal_watch.check(step, rollouts, signal["reward/informative_frac"]):
            log.warn(warning)
        advantages = grpo_advantages(rollouts.rewards, cfg.grpo.group_size, scale_by_std=cfg.grpo.scale_by_std)
        batch, overlong_metrics = filter_overlong(
            rollouts_to_batch(rollouts, advantages, tokenizer.pad_token_id), rollouts, cfg.grpo)
        with timer("train"):
            train_metrics = update_policy(cluster, batch, objective, cfg)
        train_health.check(step, train_metrics)  # before the weights go anywhere
        with timer("wait_rollouts"):  # weights change only between generations
            rollout_queue.finish()
        with timer("sync"):
            sync_metrics = cluster.weight_sync.push(version=step + 1)
        timer.seconds["timing/step_s"] = time.perf_counter() - t0
        log.log(step, {**step_metrics(step, rollouts, batch, train_metrics, timer.seconds), **rollouts.engine_metrics,
                       **sync_metrics, **sampling_metrics, **overlong_metrics, **signal, **evals})
        if checkpoint_due(step + 1, cfg.grpo.steps, cfg.save_every):
            save_checkpoint(cfg.output_dir, step + 1, cluster.learners, {"prompts": rollout_queue.state_dict()},
                            keep=cfg.keep_checkpoints)
    if evaluator is not None:  # the trained policy
        log.log(cfg.grpo.steps, evaluator(cluster.generator))
        evaluator.close()
    log.close()


FLAT_WARNING_STEPS = 3  # flat rewards warning: the first steps of a run (or of a resumed part) are checked
STALL_STEPS, STALL_FRAC = 5, 0.05  # a stall: this many steps in a row under this share of informative groups


def learning_signal(rollouts: RolloutBatch) -> dict[str, float]:
    """`reward/informative_frac`: the share of groups whose rewards differ (the only ones with a
    non-zero advantage)."""
    return {"reward/informative_frac": float(informative_groups(rollouts.rewards, rollouts.group_size).float().mean())}


def flat_rewards_warning(step: int, rollouts: RolloutBatch, max_new_tokens: int) -> str:
    """One line for a step whose groups all scored one reward each ("Flat rewards warning"), naming
    the likeliest cause: truncated responses, no reward anywhere, or every response rewarded alike."""
    r, groups = rollouts.rewards, len(rollouts.rows)
    truncated = sum(c.finish_reason == "length" for c in rollouts.completions) / len(rollouts.completions)
    if truncated >= 0.5:
        cause = (f"{truncated:.0%} of the responses stopped at generation.max_new_tokens={max_new_tokens} "
                 "before an answer: raise it")
    elif float(r.max()) == float(r.min()):
        cause = (f"every response scored {float(r.min()):.3g}: check that the prompt template asks for the "
                 "answer format the reward function parses (data.prompt_template), or pick a task the model "
                 "can sometimes solve")
    else:
        cause = ("each prompt's responses all scored alike: raise grpo.group_size or generation.temperature, "
                 "or turn on grpo.dynamic_sampling")
    return (f"warning: step {step}: no learning signal, all {groups} groups scored one reward each (mean "
            f"{float(r.mean()):.3g}), so every advantage is 0 and this update cannot change the policy; {cause}")


class SignalWatch:
    """Which steps' learning signal is worth a line on the terminal ("Learning-signal watch"): each of
    the first FLAT_WARNING_STEPS steps of a run (or of a resumed part) with no informative group; and
    a stall, the signal lost after it was there: STALL_STEPS steps in a row under STALL_FRAC after a
    step at or above it, said once, and again only after the next such step. A collapsed run (every
    group alike on short answers) is said mid-run this way, not found in the metrics after it ends;
    a hard task's sparse first steps are not a stall."""

    def __init__(self, start: int, max_new_tokens: int):
        self.start, self.max_new_tokens = start, max_new_tokens
        self.low: list[float] = []  # informative_frac of the current run of low steps
        self.seen = self.said = False

    def check(self, step: int, rollouts: RolloutBatch, informative_frac: float) -> str | None:
        if informative_frac >= STALL_FRAC:
            self.low, self.seen, self.said = [], True, False
        elif self.seen:
            self.low.append(informative_frac)
        if informative_frac == 0 and step < self.start + FLAT_WARNING_STEPS:
            return flat_rewards_warning(step, rollouts, self.max_new_tokens)
        if len(self.low) < STALL_STEPS or self.said:
            return None
        self.said = True
        return stall_warning(step, rollouts, self.low)


def stall_warning(step: int, rollouts: RolloutBatch, fracs: list[float]) -> str:
    """One line for a stall ("Learning-signal watch"): how long, the reward and response length the
    policy settled on, and the settings that bring variety back."""
    lengths = [len(c.token_ids) for c in rollouts.completions]
    return (f"warning: step {step}: learning has stalled: under {STALL_FRAC:.0%} of groups scored more than "
            f"one reward on each of the last {len(fracs)} steps (mean {sum(fracs) / len(fracs):.1%}; reward "
            f"mean {float(rollouts.rewards.mean()):.3g}, responses {sum(lengths) / len(lengths):.0f} tokens "
            "on average), so the updates barely move the policy; more variety or a slower update may bring the "
            "signal back: raise generation.temperature or grpo.group_size, lower learner.lr, set "
            "grpo.kl_coef > 0, or turn on grpo.dynamic_sampling")


class RewardFailure(RunError):
    """A reward function failed on every sample of `reward.max_failed_steps` steps in a row."""


class RewardHealth:
    """Counts consecutive steps on which some reward function failed on every sample ("Failures")."""

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
        "response/count": float(len(lengths)),
        "response_len/mean": float(lengths.mean()),
        "response_len/max": float(lengths.max()),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in rollouts.completions) / len(lengths),
        **seconds,
        "throughput/tokens_per_s": (gen_tokens + float(batch.attention_mask.sum())) / seconds["timing/step_s"],
        "throughput/gen_tokens_per_s": engine_tokens / max(max(engine_s, default=seconds["timing/generate_s"]), 1e-9),
        "async/version": float(rollouts.version),
        "async/staleness": float(step - rollouts.version),
    }
