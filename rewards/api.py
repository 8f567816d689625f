"""The reward-function contract, and how `"module:function"` specs become functions.

A reward function is a plain callable

    def my_reward(prompt: str, completion: str, **row) -> float | None

where `row` holds the dataset row's other fields (`answer`, plus task metadata such as `numbers`
and `target`) and `None` means "not applicable": the sample is left out of that function's mean
and adds 0 to the weighted sum. It may be `async def`. A function that prefers whole batches is
marked with `@batched` and takes `fn(prompts, completions, **columns) -> list[float | None]`, where
each column is a list with one entry per sample.

Functions are named by spec, `"package.module:function"` or `"path/to/file.py:function"`, so that
worker processes can re-import them (see rewards/pool.py) and a recipe can name them in YAML.
`load_reward_fn` checks everything it can at start-up (file, import, attribute, callable,
signature) and raises `RewardLoadError` with a one-line message, before any work is done.

This module imports only the standard library: `import rewards` must stay cheap.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

_BATCHED_ATTR = "__reward_batched__"
_FILE_MODULES: dict[str, str] = {}  # synthetic module name -> absolute path of the reward file


class RewardFn(Protocol):
    """`fn(prompt, completion, **row) -> float | None` (or an awaitable of it).

    Batched functions (marked with `@batched`) take lists instead:
    `fn(prompts, completions, **columns) -> list[float | None]`.
    """

    def __call__(self, prompt: str, completion: str, /, **row: Any) -> float | None | Awaitable[float | None]:
        ...


class RewardLoadError(ValueError):
    """A reward spec that cannot be turned into a usable function. The message is one line."""


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as batched: it receives lists (one entry per sample) and returns a list.

    >>> @batched
    ... def lengths(prompts, completions, **columns):
    ...     return [float(len(c)) for c in completions]
    >>> is_batched(lengths)
    True
    """
    setattr(fn, _BATCHED_ATTR, True)
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    """True for functions (or callable objects whose `__call__`) carry the `@batched` mark."""
    call = getattr(fn, "__call__", None)
    return bool(getattr(fn, _BATCHED_ATTR, False) or getattr(call, _BATCHED_ATTR, False))


def is_async(fn: Callable[..., Any]) -> bool:
    """True for `async def` functions and objects with an `async def __call__`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


# --------------------------------------------------------------------------------------------
# Loading specs.


def _one_line(text: object, limit: int = 200) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _split_spec(spec: object) -> tuple[str, str]:
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardLoadError(
            f"reward spec {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    target, _, name = spec.rpartition(":")
    if not target or not all(part.isidentifier() for part in name.split(".")):
        raise RewardLoadError(
            f"reward spec {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    return target, name


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def resolve_spec(spec: str) -> str:
    """The spec with a file path made absolute (against the cwd), so other processes find it too.

    >>> resolve_spec("rewards.answers:exact_answer")
    'rewards.answers:exact_answer'
    """
    target, name = _split_spec(spec)
    if _is_file_target(target):
        return f"{Path(target).expanduser().resolve()}:{name}"
    return spec


def _import_file(path_text: str, spec: str, kind: str = "reward") -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise RewardLoadError(f"{kind} file '{path}' does not exist (spec '{spec}')")
    # One synthetic module per file, reused on the next load so module-level state is shared.
    stem = re.sub(r"\W", "_", path.stem)
    mod_name = f"_reward_file_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    file_spec = importlib.util.spec_from_file_location(mod_name, path)
    if file_spec is None or file_spec.loader is None:
        raise RewardLoadError(f"{kind} file '{path}' cannot be imported as Python (spec '{spec}')")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[mod_name] = module  # before exec: dataclasses and pickling look the module up
    try:
        file_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise RewardLoadError(
            f"{kind} file '{path}' failed to import: {type(e).__name__}: {_one_line(e)}") from None
    _FILE_MODULES[mod_name] = str(path)
    return module


def _import_module(name: str, spec: str, kind: str = "reward") -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RewardLoadError(
            f"{kind} module '{name}' is not importable: {_one_line(e)} (spec '{spec}')") from None
    except Exception as e:
        raise RewardLoadError(f"{kind} module '{name}' failed to import: "
                              f"{type(e).__name__}: {_one_line(e)} (spec '{spec}')") from None


def _check_signature(fn: Callable[..., Any], spec: str) -> None:
    """Callable as fn(a, b, **anything): two positional slots, nothing else required positionally,
    and a **kwargs catch-all. Required keyword-only parameters are fine: they name row fields."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins carry no signature: trust them
        return
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind is kinds.VAR_KEYWORD for p in params)
    enough = len(positional) >= 2 or has_varargs
    extra_required = [p.name for p in positional[2:] if p.default is p.empty]
    if not (enough and has_varkw and not extra_required):
        shape = "(prompts, completions, **columns)" if is_batched(fn) else "(prompt, completion, **row)"
        raise RewardLoadError(f"reward function '{spec}' has signature {sig} but must accept {shape}")


def load_reward_fn(spec: str) -> RewardFn:
    """Import the function a spec names and check that it obeys the RewardFn contract.

    `spec` is `"package.module:function"` or `"path/to/file.py:function"` (relative paths are
    resolved against the current directory). Every problem raises RewardLoadError, one line.

    >>> load_reward_fn("rewards.answers:exact_answer").__name__
    'exact_answer'
    >>> load_reward_fn("rewards.answers:nope")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewards.api.RewardLoadError: reward module 'rewards.answers' has no attribute 'nope' (spec ...)
    """
    fn = load_function(spec)
    _check_signature(fn, spec)
    return fn


def load_function(spec: str, kind: str = "reward") -> Callable[..., Any]:
    """The callable a `"package.module:function"` or `"path/to/file.py:function"` spec names,
    with no check of its signature (tools use this too: `kind` names what it is in messages).
    Every problem raises RewardLoadError, one line."""
    target, name = _split_spec(spec)
    module = (_import_file(target, spec, kind) if _is_file_target(target)
              else _import_module(target, spec, kind))
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            where = f"{kind} file '{_FILE_MODULES.get(module.__name__)}'" if _is_file_target(target) \
                else f"{kind} module '{target}'"
            raise RewardLoadError(f"{where} has no attribute '{name}' (spec '{spec}')")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(f"{kind} spec '{spec}' names a {type(obj).__name__}, not a function")
    return obj


def spec_of(fn: Callable[..., Any]) -> str | None:
    """The spec that re-imports exactly `fn`, or None (lambdas, closures, `__main__` functions).

    >>> from rewards.answers import exact_answer
    >>> spec_of(exact_answer)
    'rewards.answers:exact_answer'
    >>> spec_of(lambda prompt, completion, **row: 1.0) is None
    True
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__" or inspect.ismethod(fn):
        return None
    spec = f"{_FILE_MODULES.get(module, module)}:{qualname}"
    try:
        return spec if load_reward_fn(spec) is fn else None
    except RewardLoadError:
        return None


# --------------------------------------------------------------------------------------------
# Several functions, one scorer.


@dataclass(frozen=True)
class RewardTerm:
    """One weighted function of a combination. `spec` is None for functions with no spec
    (lambdas, closures); those can only run in-process."""

    name: str
    fn: RewardFn
    weight: float
    spec: str | None


@dataclass(frozen=True)
class WeightedReward:
    """Reward = sum over terms of weight * fn(...), with None counting as 0.

    Calling it scores one sample in-process (exceptions propagate); rewards/pool.py runs the
    same terms in worker processes with time limits and failure counting.
    """

    terms: tuple[RewardTerm, ...]

    def __call__(self, prompt: str, completion: str, **row: Any) -> float:
        total = 0.0
        for term in self.terms:
            value = call_one(term.fn, prompt, completion, row)
            total += term.weight * (0.0 if value is None else float(value))
        return total


def call_one(fn: RewardFn, prompt: str, completion: str, row: Mapping[str, Any]) -> float | None:
    """Score one sample with any kind of reward function (plain, async or batched)."""
    kwargs = row_kwargs(row)
    if is_batched(fn):
        out = fn([prompt], [completion], **{k: [v] for k, v in kwargs.items()})
        out = run_awaitable(out) if inspect.isawaitable(out) else out
        return out[0]
    out = fn(prompt, completion, **kwargs)
    return run_awaitable(out) if inspect.isawaitable(out) else out


def row_kwargs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row as keyword arguments; `prompt`/`completion` columns would clash with the positionals."""
    return {k: v for k, v in row.items() if k not in ("prompt", "completion")}


def run_awaitable(awaitable: Awaitable[Any]) -> Any:
    """Run a coroutine to completion, also from a thread whose event loop is already running."""
    import asyncio

    async def main() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    from concurrent.futures import ThreadPoolExecutor  # a loop runs here (async actor): use a thread

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


def combine(specs_and_weights: Iterable[Any] | Mapping[str, float]) -> WeightedReward:
    """Build one scorer from several reward functions with weights, loading each spec now.

    Items are `(spec_or_fn, weight)`, a bare spec or function (weight 1), or any object with
    `.function` and `.weight` (e.g. rlhf.config.RewardFnConfig); a mapping is spec -> weight.

    >>> scorer = combine([("rewards.answers:exact_answer", 1.0), ("rewards.format:think_answer_format", 0.5)])
    >>> [t.name for t in scorer.terms]
    ['exact_answer', 'think_answer_format']
    >>> scorer("1+1?", "<think>easy</think><answer>2</answer>", answer="2")
    1.5
    """
    if isinstance(specs_and_weights, Mapping):
        items = list(specs_and_weights.items())
    else:
        items = list(specs_and_weights)
    terms: list[RewardTerm] = []
    names: set[str] = set()
    for item in items:
        if hasattr(item, "function") and hasattr(item, "weight"):
            target, weight = item.function, item.weight
        elif isinstance(item, tuple):
            target, weight = item
        else:
            target, weight = item, 1.0
        if isinstance(target, str):
            spec: str | None = resolve_spec(target)
            fn = load_reward_fn(spec)
        else:
            fn, spec = target, spec_of(target)
            if not callable(fn):
                raise RewardLoadError(f"reward {fn!r} is not callable")
            _check_signature(fn, spec or getattr(fn, "__qualname__", repr(fn)))
        base = spec.rpartition(":")[2].rpartition(".")[2] if spec else getattr(fn, "__name__", "reward")
        name, k = base, 2
        while name in names:  # two functions with one name (different modules) stay apart in metrics
            name, k = f"{base}_{k}", k + 1
        names.add(name)
        terms.append(RewardTerm(name=name, fn=fn, weight=float(weight), spec=spec))
    if not terms:
        raise RewardLoadError("no reward functions given")
    return WeightedReward(tuple(terms))
