"""Multi-turn episodes (rlhf.env.episodes) driven by a scripted generator and the tiny ChatML tokenizer:
token ids reused as the engine produced them, masks that leave out tool tokens, engine log-probs on
exactly the model's tokens, endings by cause, and one TrainBatch for episodes of different lengths."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rlhf.algo.advantages import grpo_advantages
from rlhf.config import ConfigError, EnvConfig, config_from_dict
from rlhf.data.batching import rollouts_to_batch
from rlhf.data.tiny_models import build_tokenizer
from rlhf.env.episodes import (
    ChatSuffix,
    EpisodeSampler,
    Observation,
    ToolEnvironment,
    run_episodes,
    with_env_rewards,
)
from rlhf.env.tools import ToolBox
from rlhf.run.preflight import check_files
from rlhf.types import PromptRow, RolloutBatch, SamplingSpec
from tests.support.episodes import SCRIPT, ScriptedGenerator, add, call, prompt_ids

G = 4
GUESS_ENV = Path(__file__).parents[1] / "fixtures" / "guess_env.py"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()



def episodes(tok, *, max_turns=4, budget=400, script=SCRIPT, tools=None):
    rows = [PromptRow(prompt="What is 2 + 3?", answer="5"), PromptRow(prompt="What is 1 + 4?", answer="5")]
    prompts = [prompt_ids(tok, r.prompt) for r in rows]
    gen = ScriptedGenerator(tok, script)
    box = ToolBox(tools or {"add": add}, timeout_s=2.0)
    spec = SamplingSpec(n=G, max_new_tokens=budget, seed=7)
    completions, metrics = run_episodes(gen, rows, prompts, spec, ToolEnvironment(box), ChatSuffix(tok),
                                        max_turns=max_turns, decode=tok.decode)
    return rows, prompts, gen, completions, metrics


def test_token_ids_are_reused_and_tool_tokens_masked(tok):
    rows, prompts, gen, completions, metrics = episodes(tok)
    # Turn 1 is the single-turn call; later turns are one call over the active episodes, n=1, seeded.
    assert gen.calls[0][1].n == G and gen.calls[0][0] == prompts
    assert all(s.n == 1 and s.seed is not None for _, s in gen.calls[1:])
    c = completions[1]  # prompt 0, sample 1: call, tool output, answer
    text_of = lambda ids: tok.decode(ids)  # noqa: E731
    model = [t for t, m in zip(c.token_ids, c.mask) if m]
    tool = [t for t, m in zip(c.token_ids, c.mask) if not m]
    assert text_of(tool) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert text_of(model).startswith("k=1 <tool_call>")
    assert text_of(model).endswith("The answer is 5.<|im_end|>")
    # The second turn's prompt was exactly prompt + the engine's first turn + the tool suffix.
    second_prompt = prompts[0] + c.token_ids[: len(c.mask) - c.mask[::-1].index(False)]
    assert second_prompt in gen.calls[1][0]
    # Engine log-probs on the model's tokens, 0 on the tool's.
    for t, m, lp in zip(c.token_ids, c.mask, c.logprobs):
        assert lp == (-t / 1000 if m else 0.0)
    assert c.model_token_ids() == model


def test_episodes_end_by_cause_and_count_tool_errors(tok):
    _, _, _, completions, metrics = episodes(tok, max_turns=4)
    assert metrics["env/end/answer"] == pytest.approx(6 / 8)  # samples 0, 1, 2 of both prompts
    assert metrics["env/end/max_turns"] == pytest.approx(2 / 8)  # sample 3 calls forever
    assert metrics["env/end/token_budget"] == 0
    # per prompt: sample 1 one call, sample 2 three bad ones, sample 3 four (the environment runs the
    # last turn's call too, then max_turns ends the episode before its output is appended)
    assert metrics["env/tool_calls"] == 2 * (1 + 3 + 4)
    assert metrics["env/tool_errors"] == 2 * 3
    assert metrics["env/turns_mean"] == pytest.approx((1 + 2 + 4 + 4) / 4)
    assert metrics["env/turns_max"] == 4
    assert metrics["gen/engine0_tokens"] == 10.0 * 4  # four generate calls, summed
    bad = tok.decode([t for t, m in zip(completions[2].token_ids, completions[2].mask) if not m])
    assert "invalid JSON" in bad and "unknown tool 'search'" in bad and "wrong arguments for add" in bad
    assert all(c.finish_reason == "stop" and c.reward is None for c in completions)


def test_token_budget_ends_an_episode(tok):
    # 60 tokens: sample 3's calls outgrow it (the turn is cut at the budget, finish "length").
    _, _, _, completions, metrics = episodes(tok, max_turns=20, budget=60)
    assert metrics["env/end/token_budget"] > 0
    assert all(len(c.token_ids) <= 60 for c in completions)
    assert any(c.finish_reason == "length" for c in completions)


def test_tool_output_that_would_pass_the_budget_ends_the_episode(tok):
    def shout(text: str) -> str:
        return "A" * 5000

    script = {k: [call("shout", '{"text": "hi"}'), "done"] for k in range(G)}
    _, _, _, completions, metrics = episodes(tok, budget=100, script=script, tools={"shout": shout})
    assert metrics["env/end/token_budget"] == 1.0
    assert all(all(c.mask) for c in completions)  # no tool tokens were appended


def test_episodes_of_different_lengths_make_one_train_batch(tok):
    rows, prompts, _, completions, metrics = episodes(tok)
    rollouts = RolloutBatch(rows=rows, prompt_ids=prompts, completions=completions, group_size=G)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    batch = rollouts_to_batch(rollouts, grpo_advantages(rewards, G), pad_id=tok.pad_token_id)
    assert batch.input_ids.shape[0] == 8
    assert len({len(c.token_ids) for c in completions}) > 2  # lengths really differ
    for i, c in enumerate(completions):
        p = prompts[i // G]
        row = batch.input_ids[i]
        assert row[: len(p) + len(c.token_ids)].tolist() == p + c.token_ids
        # the loss mask, token by token: the model's tokens only, never prompt, tool or padding
        expected = [False] * len(p) + c.mask + [False] * (row.numel() - len(p) - len(c.token_ids))
        assert batch.loss_mask[i].tolist() == expected
        lp = batch.sampler_logprobs[i]
        assert torch.allclose(lp[batch.loss_mask[i]], -row[batch.loss_mask[i]].float() / 1000)
        assert (lp[~batch.loss_mask[i]] == 0).all()
    masked = sum(c.mask.count(False) for c in completions) / sum(len(c.mask) for c in completions)
    assert metrics["env/masked_token_frac"] == pytest.approx(masked)


def test_a_user_environment_in_a_few_lines(tok):
    class Guess:
        def __init__(self, row: PromptRow):
            self.answer, self.turns = row.answer, 0

        def step(self, turn: str) -> Observation:
            self.turns += 1
            if self.answer in turn or self.turns == 2:
                return Observation(done=True, reward=float(self.answer in turn))
            return Observation(messages=[{"role": "user", "content": "Try again."}])

    script = {k: ["maybe 4", "The answer is 5."] if k % 2 else ["The answer is 5."] for k in range(G)}
    rows = [PromptRow(prompt="What is 2 + 3?", answer="5")]
    prompts = [prompt_ids(tok, rows[0].prompt)]
    completions, metrics = run_episodes(ScriptedGenerator(tok, script), rows, prompts,
                                        SamplingSpec(n=G, max_new_tokens=200, seed=1), Guess, ChatSuffix(tok),
                                        max_turns=3, decode=tok.decode)
    assert [c.reward for c in completions] == [1.0] * G
    assert metrics["env/turns_mean"] == 1.5
    retry = tok.decode([t for t, m in zip(completions[1].token_ids, completions[1].mask) if not m])
    assert retry == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"


def test_an_environment_from_the_config(tok):
    """`env.environment` names a user file's class; its episodes, rewards and endings, checked by hand."""
    script = {0: ["The answer is 5."],                        # right at once
              1: ["maybe 4", "The answer is 5."],             # right on the second try
              2: ["maybe 4"],                                 # never: max_turns ends it
              3: ["no idea", "still none", "5"]}              # right on the last allowed turn
    gen = ScriptedGenerator(tok, script)
    env = EnvConfig(environment=f"{GUESS_ENV}:Guess", max_turns=3)
    sampler = EpisodeSampler.from_config(env, gen, tok)
    assert isinstance(sampler.environment, type) and sampler.environment.__name__ == "Guess"
    rows = [PromptRow(prompt="What is 2 + 3?", answer="5")]
    prompts = [prompt_ids(tok, rows[0].prompt)]
    completions, metrics = sampler(rows, prompts, SamplingSpec(n=G, max_new_tokens=400, seed=3))
    assert [c.reward for c in completions] == [1.0, 1.0, None, 1.0]
    assert metrics["env/end/answer"] == 3 / 4 and metrics["env/end/max_turns"] == 1 / 4
    assert metrics["env/turns_mean"] == (1 + 2 + 3 + 3) / 4 and metrics["env/turns_max"] == 3
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tok.eos_token_id]
    retry = ids("\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n")
    # sample 1: its first turn, the user's "try again" (masked, log-prob 0), its second turn
    first, second = ids("k=1 maybe 4") + eos, ids("The answer is 5.") + eos
    assert completions[1].token_ids == first + retry + second
    assert completions[1].mask == [True] * len(first) + [False] * len(retry) + [True] * len(second)
    lp = lambda turn: [-t / 1000 for t in turn]  # noqa: E731  (ScriptedGenerator's log-probs)
    assert completions[1].logprobs == lp(first) + [0.0] * len(retry) + lp(second)
    # sample 2: three turns, two retries between them, none after the last (max_turns)
    turn = ids("maybe 4") + eos
    assert completions[2].token_ids == ids("k=2 maybe 4") + eos + retry + turn + retry + turn
    assert completions[0].token_ids == ids("k=0 The answer is 5.") + eos and all(completions[0].mask)
    # the environment's reward replaces the reward functions' score; the max_turns episode (None) keeps theirs
    assert with_env_rewards(torch.full((G,), 0.25), completions).tolist() == [1.0, 1.0, 0.25, 1.0]


def test_no_tools_and_no_environment_is_single_turn(tok):
    assert EpisodeSampler.from_config(EnvConfig(), ScriptedGenerator(tok), tok) is None


@pytest.mark.parametrize("spec,message", [
    (f"{GUESS_ENV}:Nope", "has no attribute 'Nope'"),
    (f"{GUESS_ENV}:NOT_CALLABLE", "names a int, not a function"),
    (f"{GUESS_ENV}:no_row", "has signature () but must take one argument, the PromptRow"),
    ("no_such_module_xyz:Env", "environment module 'no_such_module_xyz' is not importable"),
    ("/nonexistent/env.py:Env", "environment file '/nonexistent/env.py' does not exist"),
])
def test_a_bad_environment_spec_is_one_line(tok, spec, message):
    gen = ScriptedGenerator(tok)
    sampler = lambda: EpisodeSampler.from_config(EnvConfig(environment=spec), gen, tok)  # noqa: E731
    launch = lambda: check_files(config_from_dict({"env": {"environment": spec}}))  # noqa: E731
    for attempt in (sampler, launch):  # the loop's loader, and the launch's check before Ray starts
        with pytest.raises(ConfigError) as e:
            attempt()
        line = str(e.value)
        assert "\n" not in line and line.startswith("env.environment: ") and message in line
        assert e.value.key == "env.environment"


@pytest.mark.parametrize("env,message", [
    ({"environment": "no_colon"}, "env.environment='no_colon' is not allowed: 'package.module:Name' or"),
    ({"environment": f"{GUESS_ENV}:Guess", "tools": ["rlhf.env.tools:calculator"]},
     "is not allowed: unset while env.tools is set"),
])
def test_a_malformed_environment_spec_or_one_beside_tools_is_refused(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"env": env})
