"""Scores completions with reward functions in separate processes, with time limits per sample
that bound a step: a hanging sample does not hold up the others.

    with RewardPool([("rewards.answers:exact_answer", 1.0)], timeout_s=10, num_workers=2) as pool:
        rewards, metrics = pool.score(prompts, completions, rows)

Decisions (each a section of docs/design/rewards.md):
- Processes, not threads: a reward stuck in C code cannot be interrupted in a thread, but its
  process can be killed. A fresh interpreter, the zygote (rewards/runners.py), imports the
  functions and forks the runners, so nothing is forked from a parent holding torch, CUDA or Ray
  threads, and the parent's `__main__` is never re-run.
- Functions by spec: they travel as spec strings and are re-imported, so they need not be
  picklable, and every process runs the code the parent already checked.
- Scheduling: each runner runs one unit (a sample, or a chunk of a batched or async function) at a
  time, so a crash is charged to the unit that caused it. A unit running past `timeout_s / 20`
  (at most `_SUSPECT_MAX_S`) retires its runner and a fresh one takes its lane, so hangs overlap
  instead of queueing; once no unit has finished for a whole limit, the rest time out at once.
- Failures score 0: a raise, a non-number, a NaN/inf or a crashed runner scores 0 and counts per
  cause (`reward/failed/<cause>`, `CAUSES`); a hang counts in `reward/timeouts`. Scoring 0 rather
  than dropping the sample keeps every group whole.
- None means not applicable: left out of that function's mean, 0 in the weighted sum.
- In-process mode: `num_workers=0` runs everything in the caller, for debugging (a plain function
  that hangs hangs the caller).
- Warnings: after each `score`, `warnings` holds one line per function that failed or timed out on
  more than `warn_failed_frac` of the samples; the caller prints it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle
from typing import Any

from rewards.api import RewardLoadError, WeightedReward, combine, is_async, is_batched
from rewards.runners import CAUSES, DIED, OK, TIMEOUT, Outcome, run_unit

__all__ = ["CAUSES", "RewardPool", "run_unit"]

logger = logging.getLogger(__name__)

_CHUNKS_PER_WORKER = 4
_GRACE_S = 0.5  # slack on top of a unit's limit, so an async wait_for in the runner fires first
_SUSPECT_MAX_S = 0.25  # a unit running longer (or past timeout_s / 20) retires its runner ("Scheduling")
_STARTUP_TIMEOUT_S = 120.0
_TICK_S = 0.02  # the scheduler's longest sleep between looks at the clock


class _Tally:
    """Per-function values of one batch, with failure and time-out counts."""

    def __init__(self, num_fns: int, n: int) -> None:
        self.values: list[list[float | None]] = [[None] * n for _ in range(num_fns)]
        self.timeouts = [0] * num_fns
        self.causes = [dict.fromkeys(CAUSES, 0) for _ in range(num_fns)]  # failures per cause, per function
        self.first_error: list[str | None] = [None] * num_fns

    def add(self, f: int, indices: list[int], outcomes: list[Outcome]) -> None:
        for i, (status, value, error) in zip(indices, outcomes, strict=True):
            self.values[f][i] = value if status == OK else 0.0
            if status == TIMEOUT:
                self.timeouts[f] += 1
            elif status != OK:
                self.causes[f][status] += 1
                self.first_error[f] = self.first_error[f] or error

    def summarize(self, reward: WeightedReward) -> tuple[list[float], dict[str, float]]:
        n = len(self.values[0])
        totals = [math.fsum(t.weight * (self.values[f][i] or 0.0) for f, t in enumerate(reward.terms))
                  for i in range(n)]
        failed = [sum(c.values()) for c in self.causes]
        metrics = {"reward/mean": math.fsum(totals) / n if n else 0.0,
                   "reward/failed": float(sum(failed)), "reward/timeouts": float(sum(self.timeouts))}
        if n:  # an empty batch has nothing to count
            metrics.update({f"reward/failed/{name}": float(sum(c[s] for c in self.causes))
                            for s, name in CAUSES.items()})
        for f, term in enumerate(reward.terms):
            if n:
                metrics[f"reward/{term.name}/failed_frac"] = (failed[f] + self.timeouts[f]) / n
            applicable = [v for v in self.values[f] if v is not None]
            if applicable:
                metrics[f"reward/{term.name}/mean"] = math.fsum(applicable) / len(applicable)
            if failed[f] or self.timeouts[f]:
                logger.warning("reward %s: %d of %d samples failed, %d timed out; first error: %s", term.name,
                               failed[f], n, self.timeouts[f], self.first_error[f])
        return totals, metrics

    def warnings(self, reward: WeightedReward, above: float, timeout_s: float) -> list[str]:
        """One line per function that failed or timed out on more than `above` of the samples ("Warnings")."""
        n, lines = len(self.values[0]), []
        for f, term in enumerate(reward.terms):
            failed = {CAUSES[s]: k for s, k in self.causes[f].items() if k}
            bad = sum(failed.values()) + self.timeouts[f]
            if not n or bad <= above * n:
                continue
            parts = ([f"{self.timeouts[f]} timed out (reward.timeout_s={timeout_s:g})"] if self.timeouts[f] else [])
            parts += [f"{k} {cause}" for cause, k in failed.items()]
            what = ("failed or timed out" if self.timeouts[f] else "failed") if failed else "timed out"
            cause = f"reward.timeout_s={timeout_s:g}" if not failed else ", ".join(parts)
            first = f"; first error: {self.first_error[f]}" if failed else ""
            lines.append(f"reward {term.spec or term.name}: {bad}/{n} samples {what} ({cause}{first}); scored 0")
        return lines


@dataclass(eq=False)
class _Unit:
    f: int  # function index
    indices: list[int]  # batch indices of its samples


@dataclass(eq=False)
class _Runner:
    pid: int
    conn: Connection
    unit: _Unit | None = None
    started_at: float = 0.0
    retired: bool = False  # its unit ran past the suspect time: a fresh runner took its lane ("Scheduling")


@dataclass(eq=False)
class _Zygote:
    process: subprocess.Popen
    conn: Connection
    started_at: float
    ready: bool = False


@dataclass(eq=False)
class _Step:
    queue: deque[_Unit]  # units not yet started
    progress: float  # when a unit last finished in time (or the zygote became ready): the stall clock
    window: float  # the stall limit: timeout_s times the largest unit


def _stop(zygote: _Zygote | None, runners: list[_Runner]) -> None:
    """Ask every runner and the zygote to exit (the zygote kills what is left); kill a lingering zygote."""
    conns = [r.conn for r in runners] + ([zygote.conn] if zygote else [])
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(None)
    if zygote is not None:
        try:
            zygote.process.wait(2.0)
        except subprocess.TimeoutExpired:
            zygote.process.kill()
            zygote.process.wait()
    for conn in conns:
        conn.close()
    runners.clear()


class RewardPool:
    """Weighted reward functions run in `num_workers` runner processes (0: in this process).

    `fns` is what `rewards.combine` takes (specs, `(spec, weight)` pairs, RewardFnConfig-like
    objects) or a WeightedReward. Every spec is loaded here first, so a bad spec fails now.
    `score` returns one weighted reward per sample and metrics: `reward/mean`, `reward/failed`,
    `reward/timeouts` (counts of (function, sample) pairs) and `reward/<name>/mean` per function;
    `warnings` then holds the lines of "Warnings". One `score` call at a time: not thread-safe.
    """

    def __init__(self, fns: Any, *, timeout_s: float = 10.0, num_workers: int = 2,
                 warn_failed_frac: float = 0.1) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0")
        self.reward = fns if isinstance(fns, WeightedReward) else combine(fns)
        self.timeout_s, self.num_workers, self.warn_failed_frac = float(timeout_s), num_workers, warn_failed_frac
        self.warnings: list[str] = []
        self._suspect_s = min(_SUSPECT_MAX_S, self.timeout_s / 20)
        self._specs = [t.spec for t in self.reward.terms]
        unsendable = [t.name for t in self.reward.terms if t.spec is None]
        if num_workers and unsendable:
            raise RewardLoadError(f"reward function(s) {', '.join(unsendable)} cannot be sent to worker "
                                  "processes (lambda, closure or __main__): pass a 'module:function' spec "
                                  "or use num_workers=0")
        self._runners: list[_Runner] = []
        self._forking = 0  # runners asked of the zygote, not yet handed over
        self._zygote = self._start_zygote() if num_workers else None
        self._finalizer = weakref.finalize(self, _stop, self._zygote, self._runners)
        if self._zygote is not None:
            self._fill_lanes()  # forked as soon as the zygote is up

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the processes (idempotent)."""
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
        if self._zygote is None:
            for f, term in enumerate(self.reward.terms):
                outcomes = run_unit(term.fn, prompts, completions, rows, range(n), self.timeout_s)
                tally.add(f, list(range(n)), outcomes)
        elif n:
            self._score_in_runners(prompts, completions, rows, tally)
        self.warnings = tally.warnings(self.reward, self.warn_failed_frac, self.timeout_s)
        return tally.summarize(self.reward)

    # ---- scheduling ("Scheduling" in the module docstring) ---------------------------------

    def _start_zygote(self) -> _Zygote:
        parent_conn, child_conn = mp.Pipe()  # a socket pair; the child gets its end as an fd
        fd = child_conn.fileno()
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"from rewards.runners import zygote_main; zygote_main({fd})")
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd])
        child_conn.close()
        parent_conn.send((self._specs, self.timeout_s))
        return _Zygote(proc, parent_conn, started_at=time.monotonic())

    def _units(self, n: int) -> deque[_Unit]:
        """One unit per sample of a plain function; per chunk (about four per runner) of a batched
        or async one, which runs its chunk in one call or one event loop."""
        size = max(1, math.ceil(n / (self.num_workers * _CHUNKS_PER_WORKER)))
        units: deque[_Unit] = deque()
        for s in range(0, n, size):
            chunk = list(range(s, min(s + size, n)))
            for f, term in enumerate(self.reward.terms):
                whole = is_batched(term.fn) or is_async(term.fn)
                units.extend([_Unit(f, chunk)] if whole else [_Unit(f, [i]) for i in chunk])
        return units

    def _score_in_runners(self, prompts: Sequence[str], completions: Sequence[str],
                          rows: Sequence[Mapping[str, Any]], tally: _Tally) -> None:
        units = self._units(len(prompts))
        step = _Step(units, time.monotonic(), self.timeout_s * max(len(u.indices) for u in units) + _GRACE_S)
        try:
            while step.queue or any(r.unit for r in self._runners):
                self._dispatch(step, prompts, completions, rows)
                self._collect(step, tally)
                self._expire(step, tally)
        except BaseException:
            for r in [r for r in self._runners if r.unit is not None]:
                self._end(r, kill=True)  # its late answer must not leak into the next call
            raise

    def _dispatch(self, step: _Step, prompts: Sequence[str], completions: Sequence[str],
                  rows: Sequence[Mapping[str, Any]]) -> None:
        """Keep `num_workers` runners that are not retired, and give each idle one the next unit."""
        self._fill_lanes()
        for r in [r for r in self._runners if r.unit is None and not r.retired]:
            if not step.queue:
                return
            unit = step.queue.popleft()
            message = (unit.f, [prompts[i] for i in unit.indices], [completions[i] for i in unit.indices],
                       [dict(rows[i]) for i in unit.indices])
            try:
                r.conn.send(message)
            except OSError:  # died while idle: nothing of this unit ran
                step.queue.appendleft(unit)
                self._end(r, kill=False)
                continue
            r.unit, r.started_at = unit, time.monotonic()

    def _fill_lanes(self) -> None:
        """Ask the zygote for runners until `num_workers` of them are not retired ("Scheduling")."""
        for _ in range(self.num_workers - sum(not r.retired for r in self._runners) - self._forking):
            try:
                self._zygote.conn.send(("fork", 0))
            except OSError:
                raise RuntimeError(f"the reward pool's process died (exit code {self._zygote.process.poll()})") from None
            self._forking += 1

    def _collect(self, step: _Step, tally: _Tally) -> None:
        z = self._zygote
        watched = [r.conn for r in self._runners if r.unit is not None] + [z.conn] * (not z.ready or self._forking > 0)
        for conn in wait(watched, _TICK_S):
            if conn is z.conn:
                self._from_zygote(step)
                continue
            r = next(r for r in self._runners if r.conn is conn)
            try:
                outcomes = r.conn.recv()
            except (EOFError, OSError):  # it crashed (os._exit, a segfault, the OOM killer)
                outcomes = [(DIED, None, "reward worker died (its process ended)")] * len(r.unit.indices)
                self._end(r, kill=False)
            else:
                if r.retired:
                    self._end(r, kill=False)
            tally.add(r.unit.f, r.unit.indices, outcomes)
            r.unit, step.progress = None, time.monotonic()

    def _from_zygote(self, step: _Step) -> None:
        z = self._zygote
        try:
            kind, payload = z.conn.recv()
        except (EOFError, OSError):
            code = z.process.poll()
            if not z.ready:
                raise RuntimeError(f"the reward pool's process exited during start-up (exit code {code}); "
                                   "its traceback is printed above") from None
            raise RuntimeError(f"the reward pool's process died (exit code {code})") from None
        if kind == "error":
            raise RuntimeError(f"a reward worker could not load the reward functions: {payload}")
        if kind == "ready":
            z.ready, step.progress = True, time.monotonic()
            return
        self._runners.append(_Runner(payload, Connection(recv_handle(z.conn))))  # ("runner", pid), then its socket
        self._forking -= 1

    def _expire(self, step: _Step, tally: _Tally) -> None:
        """Time-outs, retirements and the stall rule of "Scheduling"."""
        now = time.monotonic()
        z = self._zygote
        if not z.ready and now > z.started_at + _STARTUP_TIMEOUT_S:
            raise RuntimeError(f"a reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        for r in [r for r in self._runners if r.unit is not None]:
            ran = now - r.started_at
            if ran > self.timeout_s * len(r.unit.indices) + _GRACE_S:
                tally.add(r.unit.f, r.unit.indices, [(TIMEOUT, None, None)] * len(r.unit.indices))
                self._end(r, kill=True)
            elif ran > self._suspect_s:
                r.retired = True
        if step.queue and z.ready and now > step.progress + step.window:
            for unit in step.queue:  # nothing finished for a whole limit: every lane is stuck on a hang
                tally.add(unit.f, unit.indices, [(TIMEOUT, None, None)] * len(unit.indices))
            step.queue.clear()

    def _end(self, r: _Runner, *, kill: bool) -> None:
        """Drop runner `r`: killed by the zygote (hung, or its answer is no longer wanted), or asked to exit."""
        self._runners.remove(r)
        with contextlib.suppress(OSError):
            self._zygote.conn.send(("kill", r.pid)) if kill else r.conn.send(None)
        r.conn.close()
