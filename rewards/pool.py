"""Scores completions with reward functions in worker processes, with a per-sample time limit.

    with RewardPool([("rewards.answers:exact_answer", 1.0)], timeout_s=10, num_workers=2) as pool:
        rewards, metrics = pool.score(prompts, completions, rows)

Choices:
1. Processes, not threads: a reward stuck in C code (a sympy simplification) cannot be
   interrupted in a thread, but its process can be killed. Workers are fresh interpreters
   (`python -c`, talking over a socket pair): nothing is forked from a parent that holds torch,
   CUDA or Ray threads, and unlike multiprocessing's "spawn" the parent's `__main__` is not
   re-run, so an unguarded script, a notebook or a Ray worker can own a pool.
2. Functions travel as spec strings and each worker re-imports them: user functions need not be
   picklable, and every process runs the code the parent already checked at start-up.
3. A batch is cut into chunks, about four per worker, for balance. A worker runs a chunk one unit
   at a time (one sample of a plain function; the whole chunk of a batched or async function) and
   reports after each unit; the parent allows each unit `timeout_s` per sample. On a time-out it
   terminates the worker, starts a replacement and sends the chunk's remaining units again.
4. A raise, a non-number, a NaN/inf or a crashed worker scores 0 for that function and counts in
   `reward/failed`; a hang scores 0 and counts in `reward/timeouts`. The run goes on. Each cause
   has its own count (`reward/failed/<cause>`, `CAUSES`), and `reward/<name>/failed_frac` is the
   share of samples a function failed on (1.0: every one, which the GRPO loop stops on when it
   repeats: `reward.max_failed_steps`). Scoring 0 rather than dropping the sample keeps every
   group whole; a group whose rewards are all equal gets zero advantages and no gradient.
5. None means "not applicable": left out of that function's mean, 0 in the weighted sum.
6. `num_workers=0` runs everything in the calling process, for debugging: errors are still caught
   and counted and async functions still time out, but a plain function that hangs hangs the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing as mp
import numbers
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rewards.api import (RewardFn, RewardLoadError, WeightedReward, _one_line, combine, is_async, is_batched,
                         load_reward_fn, row_kwargs, run_awaitable)

logger = logging.getLogger(__name__)

OK, RAISED, TIMEOUT, NOT_A_NUMBER, NONFINITE, DIED = range(6)
CAUSES = {RAISED: "exception", NOT_A_NUMBER: "not_a_number", NONFINITE: "nonfinite", DIED: "worker_died"}
"""Failure statuses -> the `reward/failed/<cause>` metric names (a time-out is `reward/timeouts`)."""
Outcome = tuple[int, float | None, str | None]  # (status, value, error text)
Unit = tuple[int, list[int]]  # (function index, positions within the chunk)
Item = tuple[str, str, Mapping[str, Any]]  # (prompt, completion, row)

_CHUNKS_PER_WORKER = 4
_GRACE_S = 0.5  # slack on top of a unit's limit, so an async wait_for in the worker fires first
_STARTUP_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------------------------
# Running one unit: used by the workers and by the in-process mode.


def _outcome(value: Any) -> Outcome:
    if value is None:
        return (OK, None, None)
    if not isinstance(value, numbers.Real):
        shown = _one_line(repr(value), 60)
        return (NOT_A_NUMBER, None, f"returned {type(value).__name__} {shown}, not a float or None")
    value = float(value)
    if not math.isfinite(value):
        return (NONFINITE, None, f"returned {value}")
    return (OK, value, None)


def _error(e: BaseException) -> Outcome:
    return (RAISED, None, f"{type(e).__name__}: {_one_line(e)}")


async def _within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)


def _run_plain(fn: RewardFn, item: Item, timeout_s: float) -> Outcome:
    prompt, completion, row = item
    try:
        value = fn(prompt, completion, **row_kwargs(row))
        if inspect.isawaitable(value):
            value = run_awaitable(_within(value, timeout_s))
    except TimeoutError:
        return (TIMEOUT, None, None)
    except Exception as e:
        return _error(e)
    return _outcome(value)


async def _gather(fn: RewardFn, items: list[Item], timeout_s: float) -> list[Outcome]:
    async def one(prompt: str, completion: str, row: Mapping[str, Any]) -> Outcome:
        try:
            return _outcome(await asyncio.wait_for(fn(prompt, completion, **row_kwargs(row)), timeout_s))
        except TimeoutError:
            return (TIMEOUT, None, None)
        except Exception as e:
            return _error(e)

    return list(await asyncio.gather(*(one(*item) for item in items)))


def _run_batched(fn: RewardFn, items: list[Item], timeout_s: float) -> list[Outcome]:
    n = len(items)
    keys = dict.fromkeys(k for _, _, row in items for k in row_kwargs(row))
    columns = {k: [row.get(k) for _, _, row in items] for k in keys}
    try:
        values = fn([p for p, _, _ in items], [c for _, c, _ in items], **columns)
        if inspect.isawaitable(values):
            values = run_awaitable(_within(values, timeout_s * n))
        values = list(values)
        if len(values) != n:
            raise ValueError(f"returned {len(values)} values for {n} samples")
    except TimeoutError:
        return [(TIMEOUT, None, None)] * n
    except Exception as e:
        return [_error(e)] * n
    return [_outcome(v) for v in values]


def run_unit(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
             rows: Sequence[Mapping[str, Any]], positions: Iterable[int], timeout_s: float) -> list[Outcome]:
    """Outcomes of `fn` on the samples at `positions`; never raises for the function's faults."""
    items = [(prompts[i], completions[i], rows[i]) for i in positions]
    if is_batched(fn):
        return _run_batched(fn, items, timeout_s)
    if is_async(fn):
        return run_awaitable(_gather(fn, items, timeout_s))
    return [_run_plain(fn, item, timeout_s) for item in items]


def _worker_main(fd: int) -> None:
    """Worker process: load the functions, then run the units of each chunk it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(fd)
    specs, timeout_s = conn.recv()
    try:
        fns = [load_reward_fn(spec) for spec in specs]
    except Exception as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        units, prompts, completions, rows = task
        for fn_index, positions in units:
            conn.send(("unit", run_unit(fns[fn_index], prompts, completions, rows, positions, timeout_s)))


# --------------------------------------------------------------------------------------------
# The parent side.


class _Tally:
    """Per-function values of one batch, with failure and time-out counts."""

    def __init__(self, num_fns: int, n: int) -> None:
        self.values: list[list[float | None]] = [[None] * n for _ in range(num_fns)]
        self.failed = [0] * num_fns
        self.timeouts = [0] * num_fns
        self.causes = dict.fromkeys(CAUSES, 0)
        self.first_error: list[str | None] = [None] * num_fns

    def add(self, f: int, indices: list[int], outcomes: list[Outcome]) -> None:
        for i, (status, value, error) in zip(indices, outcomes, strict=True):
            self.values[f][i] = value if status == OK else 0.0
            if status == TIMEOUT:
                self.timeouts[f] += 1
            elif status != OK:
                self.failed[f] += 1
                self.causes[status] += 1
                self.first_error[f] = self.first_error[f] or error

    def summarize(self, reward: WeightedReward) -> tuple[list[float], dict[str, float]]:
        n = len(self.values[0])
        totals = [math.fsum(t.weight * (self.values[f][i] or 0.0) for f, t in enumerate(reward.terms))
                  for i in range(n)]
        metrics = {"reward/mean": math.fsum(totals) / n if n else 0.0,
                   "reward/failed": float(sum(self.failed)), "reward/timeouts": float(sum(self.timeouts))}
        if n:  # an empty batch has nothing to count
            metrics.update({f"reward/failed/{name}": float(self.causes[c]) for c, name in CAUSES.items()})
        for f, term in enumerate(reward.terms):
            if n:
                metrics[f"reward/{term.name}/failed_frac"] = (self.failed[f] + self.timeouts[f]) / n
            applicable = [v for v in self.values[f] if v is not None]
            if applicable:
                metrics[f"reward/{term.name}/mean"] = math.fsum(applicable) / len(applicable)
            if self.failed[f] or self.timeouts[f]:
                logger.warning("reward %s: %d of %d samples failed, %d timed out; first error: %s", term.name,
                               self.failed[f], n, self.timeouts[f], self.first_error[f])
        return totals, metrics


@dataclass(eq=False)
class _Task:
    indices: list[int]  # batch indices of the chunk's samples
    units: deque[Unit]  # still to run, in the worker's order


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started_at: float
    ready: bool = False
    task: _Task | None = None
    unit_started_at: float = 0.0


def _kill(worker: _Worker) -> None:
    proc = worker.process
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    worker.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill(w)
    workers.clear()


class RewardPool:
    """Weighted reward functions run in `num_workers` worker processes (0: in this process).

    `fns` is what `rewards.combine` takes (specs, `(spec, weight)` pairs, RewardFnConfig-like
    objects) or a WeightedReward. Every spec is loaded here first, so a bad spec fails now.
    `score` returns one weighted reward per sample and metrics: `reward/mean`, `reward/failed`,
    `reward/timeouts` (counts of (function, sample) pairs) and `reward/<name>/mean` per function.
    A batched or async function gets `timeout_s` times its chunk size per chunk. One `score`
    call at a time: the pool is not thread-safe.
    """

    def __init__(self, fns: Any, *, timeout_s: float = 10.0, num_workers: int = 2) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0")
        self.reward = fns if isinstance(fns, WeightedReward) else combine(fns)
        self.timeout_s = float(timeout_s)
        self._specs = [t.spec for t in self.reward.terms]
        unsendable = [t.name for t in self.reward.terms if t.spec is None]
        if num_workers and unsendable:
            raise RewardLoadError(f"reward function(s) {', '.join(unsendable)} cannot be sent to worker "
                                  "processes (lambda, closure or __main__): pass a 'module:function' spec "
                                  "or use num_workers=0")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._workers.extend(self._start_worker() for _ in range(num_workers))

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], dict[str, float]]:
        """Weighted rewards of the samples (rows[i] holds sample i's dataset fields) and metrics."""
        if not self._finalizer.alive:
            raise RuntimeError("RewardPool is closed")
        n = len(prompts)
        if len(completions) != n or len(rows) != n:
            raise ValueError(f"got {n} prompts, {len(completions)} completions and {len(rows)} rows")
        tally = _Tally(len(self.reward.terms), n)
        if not self._workers:
            for f, term in enumerate(self.reward.terms):
                outcomes = run_unit(term.fn, prompts, completions, rows, range(n), self.timeout_s)
                tally.add(f, list(range(n)), outcomes)
        elif n:
            self._score_in_workers(prompts, completions, rows, tally)
        return tally.summarize(self.reward)

    # ---- scheduling ------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = mp.Pipe()  # a socket pair; the child gets its end as an fd
        fd = child_conn.fileno()
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"from rewards.pool import _worker_main; _worker_main({fd})")
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd])
        child_conn.close()
        parent_conn.send((self._specs, self.timeout_s))
        return _Worker(proc, parent_conn, started_at=time.monotonic())

    def _units(self, size: int) -> list[Unit]:
        units: list[Unit] = []
        for f, term in enumerate(self.reward.terms):
            if is_batched(term.fn) or is_async(term.fn):
                units.append((f, list(range(size))))
            else:
                units.extend((f, [p]) for p in range(size))
        return units

    def _score_in_workers(self, prompts: Sequence[str], completions: Sequence[str],
                          rows: Sequence[Mapping[str, Any]], tally: _Tally) -> None:
        n = len(prompts)
        size = max(1, math.ceil(n / (len(self._workers) * _CHUNKS_PER_WORKER)))
        queue = deque(_Task(list(range(s, min(s + size, n))), deque(self._units(min(size, n - s))))
                      for s in range(0, n, size))
        try:
            while queue or any(w.task for w in self._workers):
                self._dispatch(queue, prompts, completions, rows)
                self._collect(queue, tally)
        except BaseException:
            for w in [w for w in self._workers if w.task is not None]:
                self._replace(w, None)  # its late results must not leak into the next call
            raise

    def _dispatch(self, queue: deque[_Task], prompts: Sequence[str], completions: Sequence[str],
                  rows: Sequence[Mapping[str, Any]]) -> None:
        for w in list(self._workers):
            if not queue:
                return
            if w.ready and w.task is None:
                task = queue.popleft()
                message = (list(task.units), [prompts[i] for i in task.indices],
                           [completions[i] for i in task.indices], [dict(rows[i]) for i in task.indices])
                try:
                    w.conn.send(message)
                except OSError:  # died while idle: nothing of this task ran yet
                    queue.appendleft(task)
                    self._replace(w, None)
                    continue
                w.task, w.unit_started_at = task, time.monotonic()

    def _limit(self, w: _Worker) -> float:
        return w.unit_started_at + self.timeout_s * len(w.task.units[0][1]) + _GRACE_S

    def _collect(self, queue: deque[_Task], tally: _Tally) -> None:
        watched = [w for w in self._workers if not w.ready or w.task is not None]
        if not watched:
            return
        deadlines = [w.started_at + _STARTUP_TIMEOUT_S if not w.ready else self._limit(w) for w in watched]
        ready = wait([w.conn for w in watched], max(0.0, min(deadlines) - time.monotonic()))
        for w in watched:
            if w.conn in ready:
                self._receive(w, queue, tally)
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now > w.started_at + _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"a reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
            if w.ready and w.task is not None and now > self._limit(w):
                f, positions = w.task.units.popleft()
                tally.add(f, [w.task.indices[p] for p in positions], [(TIMEOUT, None, None)] * len(positions))
                self._replace(w, queue)

    def _receive(self, w: _Worker, queue: deque[_Task], tally: _Tally) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            try:
                code = w.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            if not w.ready:
                raise RuntimeError(f"a reward worker exited during start-up (exit code {code}); "
                                   "its traceback is printed above") from None
            if w.task is not None:
                f, positions = w.task.units.popleft()
                error = (DIED, None, f"reward worker died (exit code {code})")
                tally.add(f, [w.task.indices[p] for p in positions], [error] * len(positions))
            self._replace(w, queue)
            return
        if kind == "error":
            raise RuntimeError(f"a reward worker could not load the reward functions: {payload}")
        if kind == "ready":
            w.ready = True
            return
        f, positions = w.task.units.popleft()
        tally.add(f, [w.task.indices[p] for p in positions], payload)
        w.unit_started_at = time.monotonic()
        if not w.task.units:
            w.task = None

    def _replace(self, w: _Worker, queue: deque[_Task] | None) -> None:
        """Kill `w` and start a fresh worker in its slot; its unfinished units go back to `queue`."""
        if queue is not None and w.task is not None and w.task.units:
            queue.appendleft(w.task)
        _kill(w)
        self._workers[self._workers.index(w)] = self._start_worker()
