"""What runs in the reward pool's processes (rewards.pool): one unit of samples, a runner that runs
units one at a time, and the zygote that imports the functions once and forks the runners.

Also the in-process mode's runner: `run_unit` never raises for a reward function's faults; each
sample's outcome is a status (`OK` or a failure cause), a value and an error text.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import os
import signal
import socket
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from rewards.api import RewardFn, _one_line, is_async, is_batched, load_reward_fn, row_kwargs, run_awaitable

OK, RAISED, TIMEOUT, NOT_A_NUMBER, NONFINITE, DIED = range(6)
CAUSES = {RAISED: "exception", NOT_A_NUMBER: "not_a_number", NONFINITE: "nonfinite", DIED: "worker_died"}
"""Failure statuses -> the `reward/failed/<cause>` metric names (a time-out is `reward/timeouts`)."""
Outcome = tuple[int, float | None, str | None]  # (status, value, error text)
Item = tuple[str, str, Mapping[str, Any]]  # (prompt, completion, row)


# --------------------------------------------------------------------------------------------
# Running one unit: in a runner, or in the calling process (num_workers=0).


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


def runner_main(conn: Connection, fns: list[RewardFn], timeout_s: float) -> None:
    """A runner (forked from the zygote): run each unit it is sent, in its main thread, and answer."""
    while (task := _recv(conn)) is not None:
        f, prompts, completions, rows = task
        conn.send(run_unit(fns[f], prompts, completions, rows, range(len(prompts)), timeout_s))


def zygote_main(fd: int) -> None:
    """The zygote ("Processes, not threads" in rewards/pool.py): load the functions once, then fork a
    runner per request, hand its end of a socket pair to the pool, and kill or reap runners; its runners
    go with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(fd)
    specs, timeout_s = conn.recv()
    try:
        fns = [load_reward_fn(spec) for spec in specs]
    except Exception as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    runners: set[int] = set()
    try:
        while (request := _recv(conn)) is not None:
            kind, pid = request
            if kind == "kill" and pid in runners:  # a child not yet reaped: its pid cannot have been reused
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                runners.discard(pid)
            elif kind == "fork":
                runners.add(_fork_runner(conn, fns, timeout_s))
            runners -= {pid for pid in list(runners) if os.waitpid(pid, os.WNOHANG)[0]}  # reap the ended
    finally:
        for pid in runners:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _recv(conn: Connection) -> Any:
    """The next message, or None once the other end is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _fork_runner(conn: Connection, fns: list[RewardFn], timeout_s: float) -> int:
    """Fork a runner and hand the pool its end of a new socket pair: ("runner", pid), then the fd."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the runner: whatever happens, it never returns into the zygote's loop
        try:
            conn.close()
            ours.close()
            runner_main(Connection(theirs.detach()), fns, timeout_s)
        finally:
            os._exit(0)
    theirs.close()
    conn.send(("runner", pid))
    send_handle(conn, ours.fileno(), 0)
    ours.close()
    return pid
