"""Multi-turn episodes: the model writes a turn, an environment answers (tool outputs) or ends the
episode, until an answer, `env.max_turns` or the token budget.

    class Guess:                                   # a whole environment
        def __init__(self, row: PromptRow): self.answer = row.answer
        def step(self, turn: str) -> Observation:
            return Observation(done=True, reward=float(self.answer in turn))

    completions, metrics = run_episodes(generator, rows, prompt_ids, sampling, Guess, suffix)

Decisions (each a section of docs/design/episodes.md):
- Environments: a callable `row -> episode` whose episode has `step(turn_text) -> Observation`
  (messages to append, or `done` with an optional reward). `ToolEnvironment` is the built-in one
  (`env.tools`); your own is named by `env.environment`, loaded like a reward function; never both.
- One call per turn: one `Generator.generate` over every active episode of the step, so turns batch
  across engines. The first turn samples a prompt's G episodes as a single-turn step would; later
  turns are n=1 prompts seeded outside the prompts' range, so episodes are reproducible.
- No re-tokenization: the next turn's prompt is the previous prompt's ids, the ids the engine
  produced, then the tokenized environment messages (`ChatSuffix`): the learner trains on exactly
  what the engine saw and sampled.
- One row per episode: one `Completion` whose `mask` is True on the model's tokens only, with the
  engine's log-probs there and 0 elsewhere.
- Token budget: `sampling.max_new_tokens` covers the whole episode, so a row is never longer than a
  single-turn one; reaching it ends the episode (`token_budget`).
- Rewards: an episode ended with `Observation.reward` keeps it; otherwise `reward.functions` score
  the model's own tokens (`Completion.model_token_ids`: tool outputs left out).
- Streamed episodes (`EpisodeStream`, `grpo.rollouts: stream`): each episode's next turn is sent as
  soon as the environment has read its last one, never waiting for the step's other episodes.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rewards.api import RewardLoadError, load_function
from rlhf.errors import ConfigError
from rlhf.protocols import Generator, SampleStream
from rlhf.run.metrics import add_engine_metrics
from rlhf.env.sandbox import MODES, SandboxMode, use_mode
from rlhf.env.tools import ToolBox, parse_tool_calls
from rlhf.types import Completion, PromptRow, SampleRequest, SamplingSpec, mix_seed

if TYPE_CHECKING:
    from rlhf.config import EnvConfig

ENDS = ("answer", "max_turns", "token_budget")
"""Why an episode ended: the model answered (or the environment said done), it used `max_turns`
turns, or the token budget ran out ("Token budget")."""


@dataclass
class Observation:
    """An environment's answer to one model turn."""

    messages: list[dict[str, str]] = field(default_factory=list)
    """Chat messages appended after the turn (e.g. `{"role": "tool", "content": ...}`)."""
    done: bool = False
    """The episode is over (the turn was the answer)."""
    reward: float | None = None
    """The episode's reward when `done`; None leaves it to reward.functions ("Rewards")."""
    counts: dict[str, int] = field(default_factory=dict)
    """Events of this step to add to the metrics (`tool_calls`, `tool_errors`, `tool_timeouts`)."""


class Episode(Protocol):
    def step(self, turn: str) -> Observation: ...


Environment = Callable[[PromptRow], Episode]
"""`row -> episode` ("Environments"): a class taking a PromptRow is one."""


def load_environment(spec: str) -> Environment:
    """The environment `env.environment` names ("Environments"), through the reward loader; a spec that
    does not import, names nothing callable or takes other than one argument (the row) is a
    one-line ConfigError naming `env.environment`."""
    try:
        environment = load_function(spec, kind="environment")
    except RewardLoadError as e:
        raise ConfigError(f"env.environment: {e}", key="env.environment") from None
    try:
        signature = inspect.signature(environment)
    except (TypeError, ValueError):  # no signature to check (some builtins): the first step will say
        return environment
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigError(f"env.environment: '{spec}' has signature {signature} but must take one "
                          f"argument, the PromptRow", key="env.environment") from None
    return environment


@dataclass
class ToolEpisode:
    """The built-in episode: run the turn's tool calls, or end on a turn without one."""

    toolbox: ToolBox

    def step(self, turn: str) -> Observation:
        calls = parse_tool_calls(turn)
        if not calls:
            return Observation(done=True)
        results = [self.toolbox.run(call) for call in calls]
        counts = Counter(tool_calls=len(results), tool_errors=sum(r.status == "error" for r in results),
                         tool_timeouts=sum(r.status == "timeout" for r in results))
        messages = [{"role": "tool", "content": r.text} for r in results]
        return Observation(messages=messages, counts=dict(counts))


@dataclass
class ToolEnvironment:
    """`row -> ToolEpisode` over one shared ToolBox."""

    toolbox: ToolBox

    def __call__(self, row: PromptRow) -> ToolEpisode:
        return ToolEpisode(self.toolbox)


class ChatSuffix:
    """Token ids of environment messages rendered by the tokenizer's chat template, as they follow an
    assistant turn the engine ended ("No re-tokenization").

    The template renders a fixed conversation ending in an assistant turn whose content is a marker,
    then the messages and the next assistant prompt; the text after the marker is the suffix. When
    the engine's turn ended with the token that closes a turn (EOS, e.g. `<|im_end|>`) that token's
    text is dropped from the suffix: the engine already produced it. Works for ChatML (role `tool`
    as its own turn) and Qwen2.5's template (tool messages wrapped in a user turn's
    `<tool_response>`) alike, since the template decides."""

    MARKER = "\x00RLHF-TURN\x00"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, messages: list[dict[str, str]], last_token: int | None) -> list[int]:
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.MARKER}]
        text = self.tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
        text = text[text.index(self.MARKER) + len(self.MARKER):]
        if last_token is not None:
            closing = self.tokenizer.decode([last_token])
            if closing and text.startswith(closing):
                text = text[len(closing):]
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass
class _Run:
    """One episode in progress."""

    prompt_ids: list[int]
    episode: Episode
    token_ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    end: str | None = None
    reward: float | None = None
    counts: Counter = field(default_factory=Counter)


def run_episodes(generator: Generator, rows: Sequence[PromptRow], prompt_ids: Sequence[list[int]],
                 sampling: SamplingSpec, environment: Environment,
                 suffix: Callable[[list[dict[str, str]], int | None], list[int]],
                 *, max_turns: int, decode: Callable[[list[int]], str], workers: int = 8
                 ) -> tuple[list[Completion], dict[str, float]]:
    """`sampling.n` episodes per prompt, grouped like `Generator.generate`'s completions
    (result[i*n:(i+1)*n] answer prompt i), and the step's metrics (`env/...`, summed engine figures).

    `suffix(messages, last_token)` tokenizes environment messages (`ChatSuffix`); `decode` turns a
    turn's ids into the text the environment reads."""
    g, budget = sampling.n, sampling.max_new_tokens
    runs = [_Run(list(p), environment(row)) for row, p in zip(rows, prompt_ids) for _ in range(g)]
    engine: dict[str, float] = {}
    # Turn 1: the groups as single-turn ("One call per turn" in the module docstring).
    completions = generator.generate(prompt_ids, sampling)
    active = list(range(len(runs)))
    turn = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env") as pool:
        while True:
            engine = add_engine_metrics(engine, generator.last_metrics())
            turn_text = {i: decode(_take_turn(runs[i], c, budget)) for i, c in zip(active, completions)}
            stepping = [i for i in active if runs[i].end is None]
            for i, obs in zip(stepping, pool.map(lambda i: runs[i].episode.step(turn_text[i]), stepping)):
                _observe(runs[i], obs, suffix, max_turns, budget)
            active = [i for i in active if runs[i].end is None]
            if not active:
                break
            turn += 1
            left = max(budget - len(runs[i].token_ids) for i in active)
            spec = replace(sampling, n=1, max_new_tokens=left, seed=sampling.prompt_seed(2**40 + turn))
            completions = generator.generate([runs[i].prompt_ids + runs[i].token_ids for i in active], spec)
    return [_completion(r) for r in runs], _metrics(runs, engine)


def _take_turn(run: _Run, c: Completion, budget: int) -> list[int]:
    """Append the engine's turn (cut at the budget) to the episode; the turn's ids."""
    ids, lps = c.token_ids[: budget - len(run.token_ids)], c.logprobs[: budget - len(run.token_ids)]
    run.token_ids += ids
    run.logprobs += lps
    run.mask += [True] * len(ids)
    run.turns += 1
    if len(run.token_ids) >= budget and (c.finish_reason == "length" or len(ids) < len(c.token_ids)):
        run.end = "token_budget"
    return ids


def _observe(run: _Run, obs: Observation, suffix: Callable, max_turns: int, budget: int) -> None:
    """Apply the environment's answer: end the episode, or append its messages' tokens."""
    run.counts.update(obs.counts)
    if obs.done:
        run.end, run.reward = "answer", obs.reward
        return
    if run.turns >= max_turns:
        run.end = "max_turns"
        return
    ids = suffix(obs.messages, run.token_ids[-1] if run.token_ids else None)
    if len(run.token_ids) + len(ids) >= budget:  # no room left for the model to write
        run.end = "token_budget"
        return
    run.token_ids += ids
    run.logprobs += [0.0] * len(ids)
    run.mask += [False] * len(ids)


def _completion(run: _Run) -> Completion:
    return Completion(token_ids=run.token_ids, logprobs=run.logprobs,
                      finish_reason="length" if run.end == "token_budget" else "stop",
                      mask=run.mask, reward=run.reward)


def _metrics(runs: list[_Run], engine: dict[str, float]) -> dict[str, float]:
    """The step's episode figures: turns, tool calls by outcome, masked tokens, endings by cause."""
    n = len(runs)
    counts = sum((r.counts for r in runs), Counter())
    tokens = sum(len(r.mask) for r in runs)
    masked = sum(len(r.mask) - sum(r.mask) for r in runs)
    out = {
        "env/turns_mean": sum(r.turns for r in runs) / n,
        "env/turns_max": float(max(r.turns for r in runs)),
        "env/tool_calls": float(counts["tool_calls"]),
        "env/tool_calls_per_episode": counts["tool_calls"] / n,
        "env/tool_errors": float(counts["tool_errors"]),
        "env/tool_timeouts": float(counts["tool_timeouts"]),
        "env/masked_token_frac": masked / max(tokens, 1),
        **{f"env/end/{cause}": sum(r.end == cause for r in runs) / n for cause in ENDS},
    }
    return {**engine, **out}


@dataclass
class EpisodeSampler:
    """What the rollout queue calls instead of `Generator.submit` when `env.tools` or
    `env.environment` is set: `sampler(rows, prompt_ids, sampling) -> (completions, metrics)`
    (run_episodes, synchronous); the metrics carry `env/sandbox_isolated` (1: `env.sandbox=os`)."""

    generator: Generator
    environment: Environment
    suffix: ChatSuffix
    decode: Callable[[list[int]], str]
    max_turns: int
    sandbox: SandboxMode = "os"

    @classmethod
    def from_config(cls, env: EnvConfig, generator: Generator, tokenizer: Any) -> EpisodeSampler | None:
        """The episodes of `env.environment`, or of the tool environment of `env.tools`; None when
        neither is set (single-turn GRPO). Validation refuses both at once ("Environments"). Sets the mode
        of the code they run (`rlhf.env.sandbox.run_python`) to `env.sandbox`."""
        if env.environment:
            environment: Environment = load_environment(env.environment)
        elif env.tools:
            box = ToolBox.from_specs(env.tools, timeout_s=env.tool_timeout_s,
                                     max_output_chars=env.max_tool_output_chars)
            environment = ToolEnvironment(box)
        else:
            return None
        use_mode(env.sandbox)
        return cls(generator, environment, ChatSuffix(tokenizer), tokenizer.decode, env.max_turns, env.sandbox)

    def __call__(self, rows: Sequence[PromptRow], prompt_ids: Sequence[list[int]], sampling: SamplingSpec
                 ) -> tuple[list[Completion], dict[str, float]]:
        completions, metrics = run_episodes(self.generator, rows, prompt_ids, sampling, self.environment,
                                            self.suffix, max_turns=self.max_turns, decode=self.decode)
        return completions, {**metrics, "env/sandbox_isolated": float(MODES[self.sandbox].namespaces)}


class EpisodeStream:
    """A SampleStream of whole episodes over the engines' stream of turns ("Streamed episodes"). A
    request is an episode's first turn (`start` names its row first); each turn that ends is read by
    the environment in a thread pool and the episode's next turn is sent at once, seeded from
    (request seed, tokens so far); a key comes back from `poll` when its episode ends, as one
    Completion of all its turns (mask, environment reward). Episodes end within a window (on-policy
    streaming): `pause` with one still running is an error."""

    def __init__(self, turns: SampleStream, sampler: EpisodeSampler, pool: Any = None) -> None:
        """`pool`: where the environments read turns (an Executor; default 8 threads)."""
        self.turns, self.sampler = turns, sampler
        self._pool = pool or ThreadPoolExecutor(8, thread_name_prefix="env")
        self._rows: dict[int, PromptRow] = {}
        self._runs: dict[int, tuple[_Run, int, int | None]] = {}  # key -> (run, token budget, seed)
        self._stepping: dict[Future, int] = {}  # the environment reading a turn, -> key
        self._on_engines = 0  # turns sent and not back
        self._carried: dict[int, int] = {}  # tokens of a turn the engine aborted and that goes on
        self._ended: list[_Run] = []  # since the last pause, for the metrics
        self._done: list[tuple[int, Completion]] = []
        self._sampling: SamplingSpec | None = None
        self._metrics: dict[str, float] = {}

    def start(self, key: int, row: PromptRow) -> None:
        self._rows[key] = row

    def add(self, requests: Sequence[SampleRequest], sampling: SamplingSpec) -> None:
        self._sampling = sampling
        for r in requests:
            run = _Run(list(r.prompt_ids), self.sampler.environment(self._rows.pop(r.key)))
            self._runs[r.key] = (run, r.max_new_tokens, r.seed)
        self._on_engines += len(requests)
        self.turns.add(requests, sampling)

    def poll(self, timeout_s: float | None = None) -> list[tuple[int, Completion]]:
        end = None if timeout_s is None else time.perf_counter() + timeout_s
        while not self._done and (end is None or time.perf_counter() < end):
            for future in [f for f in self._stepping if f.done()]:
                self._observed(self._stepping.pop(future), future.result())
            if self._done:
                break
            left = None if end is None else max(end - time.perf_counter(), 0.0)
            if self._on_engines:
                for key, c in self.turns.poll(left):
                    self._on_engines -= 1
                    self._turn_ended(key, c)
            elif self._stepping:
                wait(list(self._stepping), timeout=left, return_when=FIRST_COMPLETED)
            else:
                return []
        done, self._done = self._done, []
        return done

    def pause(self) -> list[tuple[int, Completion]]:
        if self._runs:
            raise RuntimeError(f"{len(self._runs)} episodes still running at a pause: episodes end within a window")
        finished = self.turns.pause()
        self._metrics = {**self.turns.last_metrics(), **_metrics(self._ended, {})} if self._ended else {}
        self._metrics["env/sandbox_isolated"] = float(MODES[self.sampler.sandbox].namespaces)
        self._ended = []
        return finished

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _turn_ended(self, key: int, c: Completion) -> None:
        run, budget, _ = self._runs[key]
        start = len(run.token_ids) - self._carried.pop(key, 0)  # where this turn began
        if c.finish_reason not in ("stop", "length"):  # the engine aborted it: the same turn goes on
            run.token_ids += c.token_ids
            run.logprobs += c.logprobs
            run.mask += [True] * len(c.token_ids)
            self._carried[key] = len(run.token_ids) - start
            return self._send(key)
        _take_turn(run, c, budget)
        if run.end is not None:
            return self._end(key)
        turn = self.sampler.decode(run.token_ids[start:])
        self._stepping[self._pool.submit(run.episode.step, turn)] = key

    def _observed(self, key: int, obs: Observation) -> None:
        run, budget, _ = self._runs[key]
        _observe(run, obs, self.sampler.suffix, self.sampler.max_turns, budget)
        if run.end is not None:
            return self._end(key)
        self._send(key)

    def _send(self, key: int) -> None:
        run, budget, seed = self._runs[key]
        seed = None if seed is None else mix_seed(seed, len(run.token_ids))
        self._on_engines += 1
        self.turns.add([SampleRequest(key, run.prompt_ids + run.token_ids, budget - len(run.token_ids), seed)],
                       self._sampling)

    def _end(self, key: int) -> None:
        run, _, _ = self._runs.pop(key)
        self._ended.append(run)
        self._done.append((key, _completion(run)))


def with_env_rewards(rewards: torch.Tensor, completions: Sequence[Completion]) -> torch.Tensor:
    """The reward functions' scores with each episode's environment reward, where it gave one, in
    their place ("Rewards")."""
    env = [(i, c.reward) for i, c in enumerate(completions) if c.reward is not None]
    if not env:
        return rewards
    out = rewards.clone()
    for i, r in env:
        out[i] = r
    return out
