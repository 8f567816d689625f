"""Learner -> generator weight sync, bucketed, with the transport chosen once by placement.

Ordering (the `rlhf.protocols.WeightSync` contract), for step k:
    learners.train_step(k)          optimizer.step() has finished on every rank
    weight_sync.push(version=k+1)   all ranks all-gather each parameter once, in the same order;
                                    rank 0 packs them into buckets of ~`bucket_bytes` and hands each
                                    bucket to the generator, which loads it before acknowledging;
                                    push returns after the last acknowledgement
    generator.generate(k+1)         samples only from weights version k+1
So a push never overlaps an optimizer step, and no generation sees a half-updated model.

Transports (the only thing that differs by placement):
    cpu       tensors through Ray's shared-memory object store (CPU runs, tests)
    cuda_ipc  CUDA IPC handles: learner and generator share the GPU (colocated), zero copy
    nccl      NCCL broadcast from learner rank 0 to the vLLM workers (split placement)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from actors.device import detect
from rlhf.config import RunConfig

_BUCKET_BYTES = 256 * 2**20  # few calls (per-call overhead vanishes), never a memory spike


def _commit(generator: Any) -> None:
    """After the last bucket, whatever the transport: the generator commits the update and from
    then on serves exactly these weights."""
    ray.get(generator.finish_weight_update.remote())


@dataclass
class ObjectStoreTransport:
    """CPU: each bucket is one Ray call whose tensors travel through the shared-memory store."""

    dtype: torch.dtype
    bucket_bytes: int = _BUCKET_BYTES

    def send(self, bucket: list[tuple[str, torch.Tensor]], generator: Any) -> None:
        ray.get(generator.update_weights.remote([(n, t.cpu()) for n, t in bucket]))

    finish = staticmethod(_commit)


@dataclass
class CudaIpcTransport:
    """Colocated on GPU: send CUDA IPC handles; the generator maps the learner's memory and
    copies from it. The bucket tensors stay referenced until the generator acknowledges."""

    dtype: torch.dtype
    bucket_bytes: int = _BUCKET_BYTES

    def send(self, bucket: list[tuple[str, torch.Tensor]], generator: Any) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        detect().synchronize()  # the bucket's gather kernels must be done before another process reads it
        handles = [(name, reduce_tensor(t.contiguous())) for name, t in bucket]
        ray.get(generator.update_weights_from_ipc.remote(handles))

    finish = staticmethod(_commit)


@dataclass
class NcclTransport:
    """Split placement: learner rank 0 broadcasts each tensor over an NCCL group that it shares
    with the generator's workers (rank 0 = learner, ranks 1.. = vLLM workers).

    The communicator is created on the first send, inside the learner process, and kept there
    (the learner caches transports by type, so the handshake happens once per run).
    """

    dtype: torch.dtype
    master_address: str
    master_port: int
    generator_world_size: int
    bucket_bytes: int = _BUCKET_BYTES
    _comm: Any = field(default=None, repr=False)

    def _connect(self, generator: Any) -> None:
        from actors.vllm_generator import open_learner_weight_group  # vLLM's own trainer-side group

        world = 1 + self.generator_world_size
        # Both ends must join concurrently: issue the generator's call, open ours, then wait.
        ready = generator.init_weight_update_group.remote(self.master_address, self.master_port, 1, world)
        self._comm = open_learner_weight_group(self.master_address, self.master_port, world)
        ray.get(ready)

    def send(self, bucket: list[tuple[str, torch.Tensor]], generator: Any) -> None:
        if self._comm is None:
            self._connect(generator)
        done = generator.update_weights_from_nccl.remote(
            [n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [tuple(t.shape) for _, t in bucket],
        )
        for _, t in bucket:
            self._comm.broadcast(t.contiguous(), src=0)
        ray.get(done)

    finish = staticmethod(_commit)


class WeightSyncer:
    """`rlhf.protocols.WeightSync` over a learner group and a generator actor."""

    def __init__(self, learners: Any, generator_actor: Any, transport: Any) -> None:
        self.learners, self.generator, self.transport = learners, generator_actor, transport

    def push(self, version: int) -> float:
        start = time.perf_counter()
        self.learners.push_weights(self.generator, self.transport)
        return time.perf_counter() - start


def choose_transport(cfg: RunConfig, device_kind: str, master_address: str, master_port: int) -> Any:
    """The one place that maps (config, placement, device) to a transport."""
    kind = cfg.cluster.weight_sync
    if kind == "auto":
        kind = "cpu" if device_kind == "cpu" else ("cuda_ipc" if cfg.cluster.placement == "colocated" else "nccl")
    dtype = getattr(torch, cfg.model.dtype)  # config dtypes are torch attribute names
    if kind == "cpu":
        return ObjectStoreTransport(dtype=dtype)
    if device_kind == "cpu":
        raise ValueError(f"cluster.weight_sync={kind!r} needs GPUs; use 'cpu' or 'auto' on a CPU machine")
    if kind == "cuda_ipc":
        if cfg.cluster.placement != "colocated":
            raise ValueError("cluster.weight_sync='cuda_ipc' needs placement 'colocated' (one shared GPU)")
        return CudaIpcTransport(dtype=dtype)
    return NcclTransport(dtype=dtype, master_address=master_address, master_port=master_port,
                         generator_world_size=cfg.cluster.generator_gpus)
