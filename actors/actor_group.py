"""ActorGroup: N Ray actors of one class, pinned to placement-group bundles, with a rendezvous.

Placement, the torch.distributed rendezvous address and fan-out live here and nowhere else.
The `.options(...).remote(...)` call is made in exactly one place.

Fan-out waits with `gather`: results come back in call order, but the first actor that dies or
raises ends the wait at once with an `ActorFailure` naming it and the phase. A plain
`ray.get(list)` would instead wait on the first actor of the list, which may be blocked forever in
a collective whose peer has just died.

Time limit (`cluster.timeout_s`, `TIMEOUT_S` here): the actors of a `gather` run the same work in
lockstep (collectives, weight-sync buckets), so once the first has answered, the others must
answer within the limit; one that does not is reported as hung, by name. A call's own length is
never limited (a long step of a large model is not a fault), nor are the engines' independent
shards (`gather_timed`), and a dead process is reported by Ray at once.
The driver sets the limit from the config (`set_timeout`); actors get it through the environment.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class ActorFailure(RuntimeError):
    """An actor died or raised while the driver waited on it. The message is one line: which actor
    (`learner rank 1`, `engine 0`), in which phase, and why. `lost`: the actor itself is gone (its
    process or node died), rather than a call that raised."""

    def __init__(self, message: str, *, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost

    def __reduce__(self):  # raised inside an actor (a weight-sync fan-out), it crosses to the driver
        return ActorFailure, (str(self),), {"lost": self.lost}


TIMEOUT_ENV = "RLHF_CLUSTER_TIMEOUT_S"
TIMEOUT_S = float(os.environ.get(TIMEOUT_ENV, 120.0))
"""Seconds the rest of a fan-out may take once its first actor has answered (module docstring)."""


def set_timeout(seconds: float) -> None:
    """Set `TIMEOUT_S` for this process (the driver, from `cluster.timeout_s`)."""
    global TIMEOUT_S
    TIMEOUT_S = float(seconds)


def gather(refs: Sequence[ray.ObjectRef], labels: Sequence[str], phase: str) -> list[Any]:
    """ray.get(refs) of calls in lockstep, failing fast: the first failure among them, or an actor
    still busy `TIMEOUT_S` after the first answer, raises ActorFailure."""
    return gather_timed(refs, labels, phase, straggler_s=TIMEOUT_S)[0]


def gather_timed(refs: Sequence[ray.ObjectRef], labels: Sequence[str], phase: str, *,
                 straggler_s: float | None = None) -> tuple[list[Any], list[float]]:
    """ray.get(refs), failing fast, plus the seconds from this call until each result was ready
    (issue the calls just before: that is each actor's wall time for its share). `straggler_s`:
    the limit after the first answer (None: independent work, no limit)."""
    start = time.perf_counter()
    pending = dict(zip(refs, labels, strict=True))
    seconds: dict[ray.ObjectRef, float] = {}
    while pending:
        limit = None
        if seconds and straggler_s is not None:
            limit = max(0.0, start + min(seconds.values()) + straggler_s - time.perf_counter())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=limit)
        if not ready:
            raise ActorFailure(f"{', '.join(pending.values())} did not finish {phase} within {straggler_s:g} s of "
                               f"the other actors (hung; cluster.timeout_s)", lost=True)
        seconds[ready[0]] = time.perf_counter() - start
        label = pending.pop(ready[0])
        failure = _failure(ready[0], label, phase)
        if failure is not None:
            raise _root_cause(failure, pending, phase) from None
    return ray.get(list(refs)), [seconds[r] for r in refs]  # all done: no waiting left


def _failure(ref: ray.ObjectRef, label: str, phase: str) -> ActorFailure | None:
    """The ActorFailure of a finished call, or None if it succeeded."""
    try:
        ray.get(ref)
    except ray.exceptions.ActorDiedError as e:
        return ActorFailure(f"{label} died during {phase}: {_death_cause(e)}", lost=True)
    except ray.exceptions.RayActorError as e:  # unavailable: its node went away, or it is restarting
        return ActorFailure(f"{label} became unreachable during {phase} (its process or node is gone): "
                            f"{_death_cause(e)}", lost=True)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if e.cause is not None else e
        return ActorFailure(f"{label} failed during {phase}: {type(cause).__name__}: {_one_line(str(cause))}",
                            lost=False)
    return None


def _root_cause(failure: ActorFailure, pending: dict[ray.ObjectRef, str], phase: str,
                grace_s: float = 5.0) -> ActorFailure:
    """An actor that raised may only be reporting a peer's death (a collective whose other end
    vanished). Give the other actors `grace_s` to finish or fail, and name a dead one first."""
    if pending and not failure.lost:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        for ref in done:
            other = _failure(ref, pending[ref], phase)
            if other is not None and other.lost:
                return ActorFailure(f"{other} (then {failure})", lost=True)
    return failure


def _death_cause(e: Exception) -> str:
    """The useful part of Ray's actor-death message (its first sentence names the cause). An actor
    whose constructor raised: the exception itself, i.e. the traceback's last line."""
    raw = getattr(e, "error_msg", None) or str(e)
    if getattr(e, "actor_init_failed", False):
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", raw).splitlines() if line.strip()]
        exception = next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)),
                         lines[-1] if lines else raw)
        return f"its constructor raised {_one_line(exception)}"
    text = _one_line(raw)
    for marker in ("The actor is dead because ", "The actor died because ", "temporarily unavailable: ", "because "):
        if marker in text:
            return text.split(marker, 1)[1].split(". ")[0].rstrip(".")
    return text


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())  # no terminal colours
    return line if len(line) <= limit else line[: limit - 3] + "..."


def host_store(world_size: int) -> tuple[str, int, Any]:
    """A torch.distributed TCPStore served by this process (the driver) on a port the kernel picks
    while binding: (address, port, store). The actors join it as clients. Picking a free port,
    closing it and handing the number to an actor that binds it seconds later loses, now and then,
    to any other process binding or connecting in between (vLLM engines and Ray's own sockets start
    at the same time). Keep `store` alive as long as the process group."""
    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", 0, world_size + 1, is_master=True, wait_for_workers=False, use_libuv=True)
    return ray.util.get_node_ip_address(), store.port, store


@ray.remote(num_cpus=0)
def node_address() -> tuple[str, int]:
    """IP of the node this runs on and a free TCP port there (the rank-0 rendezvous address)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def load_class(spec: str) -> type:
    """'package.module:Class' -> the class, imported only now (keeps vLLM/DeepSpeed out of the
    driver until a backend is actually chosen)."""
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class ActorGroup:
    """`num_actors` instances of `cls`; actor i sits on bundle `bundles[i]` of `pg`.

    `make_kwargs(rank, master_addr, master_port)` gives each actor's constructor arguments. With
    `rendezvous_store`, (master_addr, master_port) is a TCPStore this group serves from the driver
    for the actors' `init_process_group` (`host_store`); else a free port on bundle 0's node.
    """

    def __init__(
        self,
        cls: type,
        *,
        name: str,
        pg: PlacementGroup,
        bundles: Sequence[int],
        num_cpus: float,
        num_gpus: float,
        make_kwargs: Callable[[int, str, int], dict[str, Any]],
        env: dict[str, str] | None = None,
        rendezvous_store: bool = False,
    ) -> None:
        def place(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        self.name = name  # actor i is "{name} {i}" in errors, e.g. "learner rank 1"
        if rendezvous_store:
            addr, port, self._store = host_store(len(bundles))
        else:
            addr, port = ray.get(node_address.options(scheduling_strategy=place(bundles[0])).remote())
        remote_cls = ray.remote(cls)
        runtime_env = {"env_vars": env} if env else None
        self.actors = [
            remote_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=place(b), runtime_env=runtime_env
            ).remote(**make_kwargs(rank, addr, port))
            for rank, b in enumerate(bundles)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def labels(self) -> list[str]:
        return [f"{self.name} {i}" for i in range(len(self.actors))]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` with the same arguments on every actor; wait for all results (fail fast)."""
        return gather([getattr(a, method).remote(*args, **kwargs) for a in self.actors], self.labels(), method)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Call `method` on actor i with `*per_rank_args[i]`; wait for all results (fail fast)."""
        refs = [getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, per_rank_args, strict=True)]
        return gather(refs, self.labels(), method)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every actor to `shutdown()` (tear down process groups, engines), then kill them all.
        An actor still busy after `timeout_s` (blocked in a collective whose peer died) is killed
        anyway: a teardown must never hang."""
        try:
            ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        finally:
            for a in self.actors:
                ray.kill(a)
