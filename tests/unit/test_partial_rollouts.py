"""Streaming and partial rollouts (rlhf.partial) against a deterministic fake engine.

The fake decodes one token per tick for every running sample, up to its request's limit; a token's
id and log-prob say which key and which weight version made it, so each check reads the truth off
the tokens: per-token versions, the staleness bound (also after a checkpoint round trip), the
importance weights against a reference computed by hand, exact resume, and samples an engine
aborted on its own being continued, never trained.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo.losses import importance_weights
from rlhf.config import load_config
from rlhf.data.batching import rollouts_to_batch
from rlhf.data.lengths import forced_lengths
from rlhf.data.stream import PromptStream
from rlhf.partial import RolloutStream
from rlhf.types import Completion, PromptRow, SampleRequest


def logprob_of(version: int) -> float:
    return -0.5 - 0.25 * version


class FakeStream:
    """`rlhf.protocols.SampleStream`: `room` samples decode at once (the rest wait), one token a tick.
    Token t of sample `key` is key * 1000 + position; its log-prob tells the engine's version."""

    def __init__(self, room: int = 1000) -> None:
        self.room, self.version = room, 0
        self.running: dict[int, list] = {}  # key -> [request, tokens so far]
        self.waiting: list[SampleRequest] = []
        self.abort_once: set[int] = set()  # keys the engine aborts by itself at their next token
        self.ticks = 0
        self.fail = False
        self.turn_tokens = None  # key -> tokens after which a request stops ("stop"), for episodes
        self.added: dict[int, list[int]] = {}  # key -> ticks at which its requests came

    def add(self, requests, sampling):
        assert sampling.n >= 2
        self.waiting += list(requests)
        for r in requests:
            self.added.setdefault(r.key, []).append(self.ticks)

    def _fill(self):
        while self.waiting and len(self.running) < self.room:
            r = self.waiting.pop(0)
            assert r.key not in self.running
            self.running[r.key] = [r, []]

    def poll(self, timeout_s=None):
        if self.fail:
            raise RuntimeError("engine 0 died during stream")
        self._fill()
        while self.running:
            self.ticks += 1
            done = []
            for key, (r, toks) in list(self.running.items()):
                toks.append(key * 1000 + len(r.prompt_ids) + len(toks))
                if key in self.abort_once:
                    self.abort_once.discard(key)
                    done.append((key, self._completion(r, toks, "abort")))
                elif len(toks) == r.max_new_tokens:
                    done.append((key, self._completion(r, toks, "length")))
                elif self.turn_tokens and len(toks) == self.turn_tokens(key):
                    done.append((key, self._completion(r, toks, "stop")))
            for key, _ in done:
                del self.running[key]
            if done:
                return done
        return []

    def _completion(self, r, toks, reason):
        return Completion(list(toks), [logprob_of(self.version)] * len(toks), reason)

    def pause(self):
        out = [(key, self._completion(r, toks, "abort")) for key, (r, toks) in self.running.items()]
        self.running, self.waiting = {}, []
        return out

    def last_metrics(self):
        return {"gen/engine0_s": 1.0}


def _config(rollouts="partial", staleness=2, over=2.0, steps=8, extra=()):
    return load_config(None, [f"grpo.rollouts={rollouts}", f"grpo.max_staleness={staleness}",
                              f"grpo.overprovision={over}", f"grpo.steps={steps}", "grpo.prompts_per_step=4",
                              "grpo.group_size=2", "generation.max_new_tokens=40",
                              "generation.forced_lengths=long_tail", *extra])


def _stream(cfg, engine=None):
    engine = engine or FakeStream()
    prompts = PromptStream([(PromptRow(prompt=str(i)), [i, i]) for i in range(1000)], seed=0)
    return RolloutStream(engine, prompts, cfg), engine


def _run(stream, engine, steps):
    out = []
    for step in steps:
        out.append(stream.next(step))
        stream.finish()
        engine.version = step + 1  # the push after the step
    return out


def _check_tokens(rollouts, step, staleness):
    """Every trained token is the fake's own (key, position), its log-prob its version's, its version
    within the bound; and the sample ended."""
    g = rollouts.group_size
    for i, c in enumerate(rollouts.completions):
        assert c.finish_reason in ("stop", "length")
        prompt = rollouts.prompt_ids[i // g]
        keys = {t // 1000 for t in c.token_ids}
        assert len(keys) == 1
        assert [t % 1000 for t in c.token_ids] == list(range(len(prompt), len(prompt) + len(c.token_ids)))
        assert c.logprobs == [logprob_of(v) for v in c.versions]
        assert c.versions == sorted(c.versions) and step - staleness <= min(c.versions) and max(c.versions) <= step
        assert len(c.versions) == len(c.token_ids)


def test_streaming_on_policy_trains_every_step_on_its_own_groups():
    cfg = _config(rollouts="stream", staleness=0, over=1.0)
    stream, engine = _stream(cfg)
    runs = _run(stream, engine, range(4))
    for step, r in enumerate(runs):
        _check_tokens(r, step, 0)
        assert r.version == step and len(r.rows) == 4
        assert [row.prompt for row in r.rows] == [p.prompt for p in r.rows]  # stream order
        lengths = [len(c.token_ids) for c in r.completions]
        want = [n for gid in range(4 * step, 4 * step + 4) for n in forced_lengths("long_tail", 40, 0, gid, 2)]
        assert lengths == want  # the forced lengths of groups 4k..4k+3, untouched
        assert r.engine_metrics["partial/carried_groups"] == 0
        assert r.engine_metrics["partial/continued_frac"] == 0


def test_partial_rollouts_keep_the_bound_and_carry_long_samples():
    cfg = _config(steps=10)
    stream, engine = _stream(cfg)
    runs = _run(stream, engine, range(10))
    trained = []
    for step, r in enumerate(runs):
        _check_tokens(r, step, 2)
        m = r.engine_metrics
        assert m["partial/staleness_max"] <= 2
        assert len(r.rows) == 4 + m["partial/extra_groups"] and m["partial/extra_groups"] >= 0
        trained += [c.token_ids[0] // 1000 // 2 for c in r.completions[::2]]
    assert len(trained) == len(set(trained))  # no group twice
    continued = [r.engine_metrics["partial/continued_frac"] for r in runs]
    assert max(continued) > 0  # long samples ran across versions
    assert sum(r.engine_metrics["partial/carried_groups"] for r in runs) > 0
    # Running groups never exceed ceil(2 * 4); untrained never (2 + 1) * 4
    assert max(r.engine_metrics["partial/carried_groups"] for r in runs) <= 12


def test_importance_weights_are_per_token_of_the_version_that_sampled_it():
    cfg = _config(steps=6)
    stream, engine = _stream(cfg)
    runs = _run(stream, engine, range(6))
    step = next(k for k, r in enumerate(runs) if r.engine_metrics["partial/continued_frac"] > 0)
    r = runs[step]
    r.rewards = torch.zeros(len(r.completions))
    batch = rollouts_to_batch(r, torch.zeros(len(r.completions)), pad_id=0)
    learner = torch.full(batch.loss_mask.shape, logprob_of(step))  # the policy being trained: version `step`
    weights, _ = importance_weights(learner, batch.sampler_logprobs, batch.loss_mask, "tis", cap=2.0)
    for i, c in enumerate(r.completions):  # by hand: w_t = min(exp(logp_step - logp_{version(t)}), 2)
        start = len(r.prompt_ids[i // 2])
        want = [min(math.exp(logprob_of(step) - logprob_of(v)), 2.0) for v in c.versions]
        assert weights[i, start:start + len(want)].tolist() == pytest.approx(want)
    assert any(len(set(c.versions)) > 1 for c in r.completions)


def test_a_resumed_stream_continues_exactly_and_keeps_the_bound():
    cfg = _config(steps=9)
    stream, engine = _stream(cfg)
    want = _run(stream, engine, range(9))
    first, engine1 = _stream(cfg)
    _run(first, engine1, range(4))
    state = first.state_dict()
    assert state["partial"]["groups"] and any(s["token_ids"] and s["finish_reason"] is None
                                              for g in state["partial"]["groups"] for s in g["samples"])
    again, engine2 = _stream(cfg)
    again.load_state_dict(state)
    engine2.version = 4
    got = _run(again, engine2, range(4, 9))
    for k, (a, b) in enumerate(zip(want[4:], got), start=4):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        assert [c.versions for c in a.completions] == [c.versions for c in b.completions]
        assert b.engine_metrics["partial/staleness_max"] <= 2
        _check_tokens(b, k, 2)


def test_a_sample_the_engine_aborted_is_continued_and_counted_never_trained_short(capsys):
    cfg = _config(rollouts="stream", staleness=0, over=1.0, steps=2)
    stream, engine = _stream(cfg)
    engine.abort_once = {0, 3}
    r = stream.next(0)
    assert r.engine_metrics["partial/aborted_samples"] == 2
    assert "step 0: the engines aborted 2 samples by themselves" in capsys.readouterr().out
    _check_tokens(r, 0, 0)
    lengths = [len(c.token_ids) for c in r.completions]
    assert lengths == [n for gid in range(4) for n in forced_lengths("long_tail", 40, 0, gid, 2)]


def test_an_engine_failure_stops_the_step_before_anything_is_trained():
    cfg = _config(rollouts="stream", staleness=0, over=1.0, steps=2)
    stream, engine = _stream(cfg)
    engine.fail = True
    with pytest.raises(RuntimeError, match="died during stream"):
        stream.next(0)


@pytest.mark.parametrize("overrides, message", [
    (["grpo.rollouts=partial"], "grpo.max_staleness=0 is not allowed: >= 1 with grpo.rollouts=partial"),
    (["grpo.rollouts=stream", "grpo.max_staleness=1"], "0 with grpo.rollouts=stream"),
    (["grpo.rollouts=partial", "grpo.max_staleness=1", "grpo.overprovision=3"], "grpo.overprovision=3.0 is not"),
    (["grpo.rollouts=stream", "generation.backend=hf"], "streaming needs vLLM"),
    (["grpo.rollouts=stream", "grpo.dynamic_sampling=true"], "false with grpo.rollouts=stream"),
    (["grpo.rollouts=partial", "grpo.max_staleness=1", "env.tools=[rlhf.env.tools:calculator]"],
     "environment is not checkpointed"),
    (["generation.forced_lengths=long_tail", "generation.backend=hf"], "per-sample limits are vLLM"),
])
def test_streaming_settings_that_cannot_run_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_long_tail_lengths_have_the_promised_shape():
    import numpy as np

    lengths = np.array([n for g in range(4000) for n in forced_lengths("long_tail", 16384, 0, g, 8)])
    assert 1400 < np.median(lengths) < 1650
    assert 0.007 < (lengths > 12288).mean() < 0.013
    assert lengths.max() <= 16384 and lengths.min() >= 1
    assert forced_lengths("long_tail", 16384, 0, 7, 8) == forced_lengths("long_tail", 16384, 0, 7, 8)
    assert forced_lengths("none", 64, 0, 7, 3) == [64, 64, 64]


class FakeScorer:
    """Reward = the sample's length / 100; metrics as the reward pool's (a mean, a fraction, counts, seconds)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, rows, token_ids):
        self.calls += 1
        r = torch.tensor([len(t) / 100 for t in token_ids])
        return r, {"reward/mean": float(r.mean()), "reward/f/failed_frac": float((r > 0.1).float().mean()),
                   "reward/failed": float((r > 0.1).sum()), "reward/f/time_s": 0.5,
                   "reward/f/samples_per_s": len(token_ids) / 0.5}


def test_groups_are_scored_as_they_finish_and_metrics_merge_as_one_call():
    cfg = _config(steps=4)
    scorer = FakeScorer()
    engine = FakeStream()
    prompts = PromptStream([(PromptRow(prompt=str(i)), [i, i]) for i in range(1000)], seed=0)
    stream = RolloutStream(engine, prompts, cfg, scorer)
    runs = _run(stream, engine, range(4))
    for r in runs:
        lengths = torch.tensor([len(c.token_ids) / 100 for c in r.completions])
        assert torch.equal(r.rewards, lengths)
        _, whole = FakeScorer().score(r.rows, [c.token_ids for c in r.completions])
        merged = dict(r.reward_metrics)
        assert merged.pop("reward/f/time_s") == pytest.approx(0.5 * len(r.rows))
        assert merged.pop("reward/f/samples_per_s") == pytest.approx(len(r.completions) / (0.5 * len(r.rows)))
        for key in ("reward/f/time_s", "reward/f/samples_per_s"):
            whole.pop(key)
        assert merged == pytest.approx(whole)
    assert scorer.calls >= sum(len(r.rows) for r in runs)  # one call a group, each as it completed


def test_on_a_split_layout_the_engines_go_on_while_the_learners_train():
    """cluster.placement=split: after a window the engines keep generating (version k) until `finish`,
    which pauses them before the push; the bound and the versions hold all the same."""
    import threading

    cfg = _config(steps=6, extra=["cluster.placement=split"])
    stream, engine = _stream(cfg)
    assert stream.run_ahead
    on_policy = _config(rollouts="stream", staleness=0, over=1.0, extra=["cluster.placement=split"])
    assert not _stream(on_policy)[0].run_ahead  # what it made meanwhile would be a version old
    ticks, trained = [], []
    for step in range(6):
        r = stream.next(step)
        _check_tokens(r, step, 2)
        assert r.engine_metrics["partial/staleness_max"] <= 2
        trained += [c.token_ids[0] // 1000 // 2 for c in r.completions[::2]]
        before = engine.ticks
        stream._ahead.result(timeout=30)  # the fake decodes until it runs dry, at once: let it
        ticks.append(engine.ticks - before)
        stream.finish()
        assert not engine.running and stream._ahead is None
        engine.version = step + 1
    assert len(trained) == len(set(trained)) and sum(ticks) > 0  # decoding went on between steps
    assert threading.active_count() < 50


class Inline:
    """An Executor that runs each job at once: the environment's answers in a deterministic order."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future


class CountTurns:
    """Done with reward = turns once the model has written `row.answer` turns; else one more user message."""

    def __init__(self, row):
        self.need, self.seen = int(row.answer), 0

    def step(self, turn):
        from rlhf.env.episodes import Observation

        self.seen += 1
        if self.seen >= self.need:
            return Observation(done=True, reward=float(self.seen))
        return Observation(messages=[{"role": "user", "content": "more"}])


def test_streamed_episodes_advance_each_on_its_own_turns():
    """grpo.rollouts=stream with an environment: an episode's next turn is sent the tick its last turn
    ended (its environment answered at once), whatever the other episodes do; each comes back as one
    completion, tool tokens masked, with the environment's reward."""
    from rlhf.env.episodes import EpisodeSampler, EpisodeStream

    cfg = _config(rollouts="stream", staleness=0, over=1.0, steps=2, extra=["generation.forced_lengths=none"])
    engine = FakeStream()
    engine.turn_tokens = lambda key: 1 + key % 4  # turns of different lengths
    sampler = EpisodeSampler(None, CountTurns, lambda messages, last: [7, 7], lambda ids: " ".join(map(str, ids)),
                             max_turns=5)
    prompts = PromptStream([(PromptRow(prompt=str(i), answer=str(1 + i % 3)), [i, i]) for i in range(100)], seed=0)
    stream = RolloutStream(engine, prompts, cfg, episodes=sampler)
    stream.episodes._pool = Inline()
    r = stream.next(0)
    for i, c in enumerate(r.completions):
        need, key = int(r.rows[i // 2].answer), c.token_ids[0] // 1000
        assert c.reward == need and c.finish_reason == "stop"
        assert c.mask == ([True] * (1 + key % 4) + [False, False]) * (need - 1) + [True] * (1 + key % 4)
        assert [t for t, m in zip(c.token_ids, c.mask) if not m] == [7, 7] * (need - 1)
        ends, adds = [], engine.added[key]
        for turn in range(need - 1):  # turn t + 1 came the tick turn t ended: t+1 turns of this episode's length
            ends.append(adds[turn] + 1 + key % 4)
        assert adds[1:] == ends
    assert r.engine_metrics["env/turns_max"] == 3 and r.engine_metrics["env/end/answer"] == 1.0
