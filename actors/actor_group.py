"""ActorGroup: N Ray actors of one class, pinned to placement-group bundles, with a rendezvous.

Placement, the torch.distributed rendezvous address and fan-out live here and nowhere else.
The `.options(...).remote(...)` call is made in exactly one place.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


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

    `make_kwargs(rank, master_addr, master_port)` gives each actor's constructor arguments.
    """

    def __init__(
        self,
        cls: type,
        *,
        pg: PlacementGroup,
        bundles: Sequence[int],
        num_cpus: float,
        num_gpus: float,
        make_kwargs: Callable[[int, str, int], dict[str, Any]],
        env: dict[str, str] | None = None,
    ) -> None:
        def place(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

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

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` with the same arguments on every actor; wait for all results."""
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Call `method` on actor i with `*per_rank_args[i]`; wait for all results."""
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, per_rank_args)])

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)
