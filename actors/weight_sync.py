"""Learner -> generator weight sync, bucketed, with the transport chosen once by placement.

Ordering (the `rlhf.protocols.WeightSync` contract), for step k:
    learners.train_step(k)          optimizer.step() has finished on every rank
    weight_sync.push(version=k+1)   all ranks all-gather each parameter once, in the same order;
                                    rank 0 packs them into buckets of ~`bucket_bytes` and hands each
                                    bucket to the generator, which loads it before acknowledging;
                                    push returns after the last acknowledgement
    generator.generate(k+1)         samples only from weights version k+1
So a push never overlaps an optimizer step, and no generation sees a half-updated model.

Several engines (data-parallel generation): each learner rank has a list of target engines and
sends every bucket to all of them at once, so the time does not grow with the engine count:
    cpu       rank 0 puts each bucket in the object store once; every engine reads it from there
    cuda_ipc  colocated: learner rank r hands the engine on its own GPU the full weights (FSDP2 and
              ZeRO gather full tensors on every rank anyway); ranks feed their engines in parallel
    nccl      split: one NCCL group, learner rank 0 plus every engine's workers; one broadcast per
              tensor reaches all engines (K groups where K engines share a GPU: NcclTransport)
Which rank feeds which engine is decided in one place, `engine_targets`.

Transports (the only thing that differs by placement):
    cpu       tensors through Ray's shared-memory object store (CPU runs, tests)
    cuda_ipc  CUDA IPC handles: learner and generator share the GPU (colocated), zero copy
    nccl      NCCL broadcast from learner rank 0 to the vLLM workers (split placement)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from actors.actor_group import gather
from actors.device import detect
from rlhf.config import RunConfig
from rlhf.lora import serves_adapters

_BUCKET_BYTES = 256 * 2**20  # few calls (per-call overhead vanishes), never a memory spike
# Colocated GPUs: a sync runs between the learner's step and the next generation, when the
# activations are gone, so a bucket four times larger (fewer round trips, one IPC handle per GiB)
# costs memory that sits idle then.
_IPC_BUCKET_BYTES = 2**30

Engines = list[tuple[int, Any]]  # (engine index, engine actor) pairs a learner rank sends to


def _labels(engines: Engines) -> list[str]:
    return [f"engine {i}" for i, _ in engines]


def _commit(engines: Engines) -> dict[int, float]:
    """After the last bucket, whatever the transport: every engine commits the update and from
    then on serves exactly these weights. Returns each engine's seconds in the update session."""
    seconds = gather([e.finish_weight_update.remote() for _, e in engines], _labels(engines), "weight sync")
    return {i: float(s) for (i, _), s in zip(engines, seconds)}


@dataclass
class ObjectStoreTransport:
    """CPU: each bucket is put in Ray's shared-memory store once; every engine loads it from there."""

    dtype: torch.dtype
    bucket_bytes: int = _BUCKET_BYTES

    def send(self, bucket: list[tuple[str, torch.Tensor]], engines: Engines) -> None:
        ref = ray.put([(n, t.cpu()) for n, t in bucket])
        gather([e.update_weights.remote(ref) for _, e in engines], _labels(engines), "weight sync")

    finish = staticmethod(_commit)


@dataclass
class CudaIpcTransport:
    """Colocated on GPU: the bucket is copied into one flat buffer whose CUDA IPC handle the engine on
    this learner's GPU opens (one handle per bucket: opening one costs ~1 ms, so per-tensor handles
    cost ~0.3 s a sync for 1.5B). A new buffer per bucket, never a reused one: the engine keeps views
    of a layer's tensors until the layer's last tensor arrives, possibly in the next bucket (vLLM's
    layerwise reload), and torch's CUDA IPC keeps the buffer alive until the engine lets go of it.
    (Measured: reusing one buffer corrupted the layers split across buckets, log-prob mismatch 0.57.)"""

    dtype: torch.dtype
    bucket_bytes: int = _IPC_BUCKET_BYTES

    def send(self, bucket: list[tuple[str, torch.Tensor]], engines: Engines) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        flat = torch.cat([t.reshape(-1).to(self.dtype) for _, t in bucket])
        layout, offset = [], 0
        for name, t in bucket:
            layout.append((name, tuple(t.shape), offset))
            offset += t.numel()
        detect().synchronize()  # the copies must be done before another process reads the buffer
        gather([e.update_weights_from_ipc.remote(reduce_tensor(flat), layout) for _, e in engines],
               _labels(engines), "weight sync")

    finish = staticmethod(_commit)


@dataclass
class NcclTransport:
    """Split placement: learner rank 0 broadcasts each tensor to the engines' workers over NCCL. A
    group holds rank 0 and at most one engine per GPU (NCCL allows one rank of a group per device),
    so K engines a GPU (`cluster.engines_per_gpu`; engines e // K share one) make K groups, engine e
    in group e % K (its workers = ranks 1 + i*tp ... i*tp + tp, i its place in the group); a bucket
    is broadcast once per group, the groups in turn, so an engine waits in NCCL only while its own
    group receives.

    The communicators are created on the first send, inside the learner process, and kept there
    (the learner caches transports by type, so the handshakes happen once per run).
    """

    dtype: torch.dtype
    master_address: str
    master_ports: tuple[int, ...]  # one per group: K
    engine_tp: int
    bucket_bytes: int = _BUCKET_BYTES
    _comms: list[Any] = field(default_factory=list, repr=False)

    def groups(self, engines: Engines) -> list[Engines]:
        k = len(self.master_ports)
        return [[(e, actor) for e, actor in engines if e % k == j] for j in range(k)]

    def _connect(self, engines: Engines) -> None:
        from actors.vllm_generator import open_learner_weight_group  # vLLM's own trainer-side group

        for port, group in zip(self.master_ports, self.groups(engines)):
            world = 1 + len(group) * self.engine_tp
            # Every end must join concurrently: issue the engines' calls, open ours, then wait.
            ready = [actor.init_weight_update_group.remote(self.master_address, port, 1 + i * self.engine_tp, world)
                     for i, (_, actor) in enumerate(group)]
            self._comms.append(open_learner_weight_group(self.master_address, port, world))
            gather(ready, _labels(group), "weight-sync NCCL handshake")

    def send(self, bucket: list[tuple[str, torch.Tensor]], engines: Engines) -> None:
        if not self._comms:
            self._connect(engines)
        meta = ([n for n, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                [tuple(t.shape) for _, t in bucket])
        for comm, group in zip(self._comms, self.groups(engines)):
            done = [actor.update_weights_from_nccl.remote(*meta) for _, actor in group]
            for _, t in bucket:
                comm.broadcast(t.contiguous(), src=0)
            gather(done, _labels(group), "weight sync")

    finish = staticmethod(_commit)


class WeightSyncer:
    """`rlhf.protocols.WeightSync` over a learner group and its engines; `targets[r]` are the
    engines learner rank r feeds (`engine_targets`)."""

    def __init__(self, learners: Any, targets: list[Engines], transport: Any) -> None:
        self.learners, self.targets, self.transport = learners, targets, transport

    def push(self, version: int) -> dict[str, float]:
        return self.learners.push_weights(self.targets, self.transport)


def engine_targets(transport: Any, engines: list[Any], num_ranks: int, beside: list[int | None]) -> list[Engines]:
    """Which engines each learner rank sends to: with CUDA IPC, rank r feeds the engines on its own
    GPU (`beside[e]`: the rank on engine e's GPU; several engines may share one); otherwise rank 0
    feeds them all."""
    if isinstance(transport, CudaIpcTransport):
        return [[(e, engine) for e, engine in enumerate(engines) if beside[e] == r] for r in range(num_ranks)]
    return [list(enumerate(engines)) if r == 0 else [] for r in range(num_ranks)]


def choose_transport(cfg: RunConfig, device_kind: str, rendezvous: Callable[[], tuple[str, int]]) -> Any:
    """The one place that maps (config, placement, device) to a transport. LoRA adapters
    (`learner.lora_sync: adapter`) always go through the object store: they are small (rank 16 on a
    7B model: ~40M parameters), and the engine writes them to a folder on its host anyway
    ("LoRA adapters" in actors/vllm_generator.py). `rendezvous()` gives an NCCL group's (address, free port)
    on learner rank 0's node; it is called only for NCCL (a Ray task: a worker process to start), once
    per group."""
    kind = cfg.cluster.weight_sync
    if serves_adapters(cfg):
        kind = "cpu"
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
    addresses: set[tuple[str, int]] = set()  # one group per engine on a GPU, each on a port of its own
    while len(addresses) < cfg.cluster.engines_per_gpu:  # a port handed out twice is asked for again
        addresses.add(rendezvous())
    (master_address,) = {a for a, _ in addresses}
    return NcclTransport(dtype=dtype, master_address=master_address,
                         master_ports=tuple(sorted(port for _, port in addresses)), engine_tp=cfg.cluster.generator_tp)
