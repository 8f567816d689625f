"""ActorGroup: N Ray actors of one class, pinned to placement-group bundles, with a rendezvous.

Placement, the torch.distributed rendezvous (its address, the store the driver serves, the seal on
it) and fan-out live here and nowhere else. The `.options(...).remote(...)` call is made in exactly
one place.

Listening sockets: the driver's store listens on the node's own address as Ray knows it (127.0.0.1
under a local Ray, `scripts.console.ray_init_kwargs`), never the wildcard; under a local Ray the
actors' gloo, NCCL and vLLM sockets are kept on loopback too (`loopback_env`). A TCPStore has no
authentication: its values are sealed with a per-group secret that the actors get through Ray
(`SealedStore`, `RENDEZVOUS_KEY_ENV`), so a client without it cannot forge what the ranks read.

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

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed import Store, TCPStore


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
    """The ActorFailure of a finished call, or None if it succeeded. A call that failed because an
    actor it waited on died (a learner rank's weight-sync fan-out to the engines) names the dead one."""
    try:
        ray.get(ref)
    except ray.exceptions.ActorDiedError as e:
        return ActorFailure(f"{label} died during {phase}: {_death_cause(e)}", lost=True)
    except ray.exceptions.RayActorError as e:  # unavailable: its node went away, or it is restarting
        return ActorFailure(f"{label} became unreachable during {phase} (its process or node is gone): "
                            f"{_death_cause(e)}", lost=True)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if e.cause is not None else e
        if isinstance(cause, ActorFailure) and cause.lost:  # it relays the death of an actor it waited on
            return ActorFailure(f"{cause} (reported by {label} during {phase})", lost=True)
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


def host_store(world_size: int, address: str | None = None) -> tuple[str, int, Any]:
    """A torch.distributed TCPStore served by this process (the driver): (address, port, store).
    It listens on `address` only (default: this node's address as Ray knows it, 127.0.0.1 under a
    local Ray started by `scripts.console.ray_init_kwargs`, the node's own IP in a cluster), never on
    the wildcard: the socket is bound here and handed to the store (`master_listen_fd`), on a port
    the kernel picks while binding. Picking a free port, closing it and handing the number to a
    process that binds it seconds later loses, now and then, to any other process binding in
    between (vLLM engines and Ray's own sockets start at the same time). The actors join as
    clients (`join_store`). Keep `store` alive as long as the process group."""
    address = address or ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(address, sock.getsockname()[1], world_size + 1, is_master=True,
                         wait_for_workers=False, use_libuv=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now, and closes it with itself
    return address, store.port, store


RENDEZVOUS_KEY_ENV = "RLHF_RENDEZVOUS_KEY"
"""Where a group's rendezvous secret is: the name of an entry of Ray's internal key-value store
(in the GCS, namespace `KV_NAMESPACE`), set by the driver in the environment of the actors of a
group with `rendezvous_store`. The secret itself travels over Ray's own channel (token-authenticated
when the cluster has token auth), never over the TCPStore, and is not in the actors' runtime env,
which Ray's runtime-env agent writes into its log."""
KV_NAMESPACE = "rlhf"


def publish_secret() -> tuple[str, str]:
    """A new random secret, stored in Ray's internal KV: (its key, the secret)."""
    from ray.experimental.internal_kv import _internal_kv_put

    key, secret = f"rendezvous-{secrets.token_hex(8)}", secrets.token_hex(32)
    _internal_kv_put(key, secret, namespace=KV_NAMESPACE)
    return key, secret


def rendezvous_secret() -> str | None:
    """In an actor of a `rendezvous_store` group: its group's secret (`RENDEZVOUS_KEY_ENV`), read
    from Ray's internal KV; None outside such a group."""
    key = os.environ.get(RENDEZVOUS_KEY_ENV)
    if not key:
        return None
    from ray.experimental.internal_kv import _internal_kv_get

    secret = _internal_kv_get(key, namespace=KV_NAMESPACE)
    if secret is None:
        raise RuntimeError(f"rendezvous secret {key} is not in Ray's internal KV (its group is shut down?)")
    return secret.decode()


def _forget_secret(key: str) -> None:
    """Remove a group's secret from Ray's internal KV; a teardown never fails on it (Ray may be
    going away)."""
    from ray.experimental.internal_kv import _internal_kv_del

    try:
        _internal_kv_del(key, namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - the secret dies with the cluster anyway
        pass


class SealedStore(Store):
    """A torch.distributed Store over another (a TCPStore client) whose values carry an HMAC-SHA256
    tag of (key, value) under its group's secret: `set` tags, `get` refuses (PermissionError,
    naming the key) a value without a valid tag. A TCPStore has no authentication; a client that
    reaches its port but lacks the secret cannot forge what the ranks read from it (the peers'
    addresses of the gloo group, NCCL's unique id): a rendezvous it rewrites fails, loudly, instead
    of connecting a rank to it. Integrity only: it can still read the values, run up the `add`
    counters and delete keys (a denial of service), and the collectives' own traffic (gloo, NCCL)
    is neither authenticated nor encrypted."""

    def __init__(self, inner: Any, secret: str) -> None:
        super().__init__()
        self._inner, self._secret = inner, secret

    def _seal(self, key: str, value: bytes | str) -> bytes:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.new(self._secret.encode(), key.encode() + b"\0" + raw, hashlib.sha256).digest() + raw

    def _open(self, key: str, sealed: bytes) -> bytes:
        tag, raw = sealed[:32], sealed[32:]
        if not hmac.compare_digest(self._seal(key, raw)[:32], tag):
            raise PermissionError(f"rendezvous key {key!r} holds a value not written by this run's ranks "
                                  f"(another client reached the store at its port)")
        return raw

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        old = self._seal(key, expected) if len(expected) else b""  # empty: the key must not exist yet
        return self._open(key, self._inner.compare_set(key, old, self._seal(key, desired)))

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def clone(self) -> SealedStore:
        return SealedStore(self._inner.clone(), self._secret)


_JOINED: list[Any] = []
"""Every sealed store this process joined, alive as long as the process: see `join_store`."""


def join_store(master_addr: str, master_port: int, secret: str | None = None) -> Any:
    """A learner's client of the driver's store (`host_store`), sealed with `secret` (default: its
    group's, `rendezvous_secret`, when it is in one); pass it to `init_process_group(store=...)`.

    A store written in Python lives on the C++ side only as long as its Python object: once that
    is collected, the process group's later calls into it fail ("fn INTERNAL ASSERT FAILED ... Not
    implemented"). gloo connects its peers inside `init_process_group`, so a store dropped after
    it went unnoticed on CPU; NCCL builds its communicators at the first collective (DeepSpeed's
    constructor, the first weight push), and every GPU run died there. So the sealed store is
    kept here for the life of the process."""
    store = TCPStore(master_addr, master_port, is_master=False, use_libuv=True)
    secret = secret or rendezvous_secret()
    if not secret:
        return store
    sealed = SealedStore(store, secret)
    _JOINED.append(sealed)
    return sealed


@ray.remote(num_cpus=0)
def node_address() -> tuple[str, int]:
    """IP of the node this runs on and a TCP port free there (the rank-0 rendezvous address),
    probed on that address only."""
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return ip, port


def loopback_interface() -> str:
    """The network interface that carries 127.0.0.1 (`lo` on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return "lo"


def loopback_env() -> dict[str, str]:
    """Under a Ray whose node address is loopback (a local run, `scripts.console.ray_init_kwargs`),
    what keeps the actors' own sockets there too: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name the
    loopback interface (gloo otherwise binds the address the host name resolves to, NCCL its first
    other interface), VLLM_HOST_IP is that address (vLLM otherwise advertises, and its world's
    store binds, the address that routes outwards). A variable the user has set is kept. Elsewhere
    {}: a cluster's actors bind their node's own address."""
    ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(ip).is_loopback:
        return {}
    name = loopback_interface()
    env = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name, "VLLM_HOST_IP": ip}
    return {var: value for var, value in env.items() if var not in os.environ}


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
    for the actors' `init_process_group` (`host_store`), sealed with a random secret of this group's
    that the actors find through Ray (`RENDEZVOUS_KEY_ENV`, `join_store`); else the group has no
    rendezvous ("", 0). Under a local Ray the actors' collectives are kept on loopback (`loopback_env`).
    With `after`, actor i whose `after(i)` is an index j gets `start_after=[actor j ready]` too: its
    constructor waits for actor j's to return (engines sharing a GPU start one at a time).
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
        after: Callable[[int], int | None] | None = None,
    ) -> None:
        def place(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        self.name = name  # actor i is "{name} {i}" in errors, e.g. "learner rank 1"
        self._secret_key: str | None = None
        env = {**loopback_env(), **(env or {})}
        if rendezvous_store:
            addr, port, self._store = host_store(len(bundles))
            self._secret_key, _ = publish_secret()
            env[RENDEZVOUS_KEY_ENV] = self._secret_key
        else:  # the engines: no rendezvous, so no Ray task (a worker process started) to find an address
            addr, port = "", 0
        remote_cls = ray.remote(cls)
        runtime_env = {"env_vars": env} if env else None
        self.actors: list[Any] = []
        for rank, b in enumerate(bundles):
            kwargs = make_kwargs(rank, addr, port)
            first = after(rank) if after else None
            if first is not None:
                kwargs["start_after"] = [self.actors[first].__ray_ready__.remote()]
            self.actors.append(remote_cls.options(
                num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=place(b), runtime_env=runtime_env
            ).remote(**kwargs))

    def __len__(self) -> int:
        return len(self.actors)

    def labels(self) -> list[str]:
        return [f"{self.name} {i}" for i in range(len(self.actors))]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` with the same arguments on every actor; wait for all results (fail fast)."""
        return gather([getattr(a, method).remote(*args, **kwargs) for a in self.actors], self.labels(), method)

    def ready_refs(self) -> list[Any]:
        """One object ref per actor, ready once its constructor has returned."""
        return [a.__ray_ready__.remote() for a in self.actors]

    def ready(self) -> None:
        """Wait until every actor's constructor has returned; one that raised is reported as failing
        during start-up, with its exception."""
        gather(self.ready_refs(), self.labels(), "start-up")

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Call `method` on actor i with `*per_rank_args[i]`; wait for all results (fail fast)."""
        refs = [getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, per_rank_args, strict=True)]
        return gather(refs, self.labels(), method)

    def shutdown(self, timeout_s: float = 10.0, **kwargs: Any) -> None:
        """Ask every actor to `shutdown(**kwargs)` (tear down process groups, engines), then kill
        them all. An actor still busy after `timeout_s` (blocked in a collective whose peer died) is
        killed anyway: a teardown must never hang."""
        try:
            ray.wait([a.shutdown.remote(**kwargs) for a in self.actors], num_returns=len(self.actors),
                     timeout=timeout_s)
        finally:
            for a in self.actors:
                ray.kill(a)
            if self._secret_key:
                _forget_secret(self._secret_key)
