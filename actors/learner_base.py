"""What every learner rank does the same way, whatever shards its model (FSDP2, DeepSpeed ZeRO).

One `LearnerRank` per rank (a Ray actor made by `actors.learner_group`); every public method is a
collective: all ranks call it with their own shard of the batch. What differs between backends is
held, not inherited: the rank builds the `Sharding` that `learner.backend` names (`SHARDINGS`:
FSDP2 in actors/fsdp2_learner.py, DeepSpeed ZeRO in actors/deepspeed_learner.py), which owns the
model, the reference and the optimizer and answers five calls: `backward`, `optimizer_step`,
`full_parameters` (full tensors one at a time, for weight sync and export), `current_lr`, and
`save_state`/`load_state` of its own training state.

Shared decisions, each a section of docs/design/learners.md:
- Global loss normalization: micro-batch losses are divided by the step's denominator over all
  ranks, so the gradient is the full batch's however it is split (`backward` gets loss * world_size).
- Equal pass counts: a rank with fewer rows runs zero-weight dummy micro-batches.
- Batches: `TrainBatch` (GRPO) or `PreferenceBatch` (DPO); nothing here tells them apart.
- Packed rows (`learner.pack_sequences`): a micro-batch as one padding-free row.
- Scored positions only: the head runs from the first scored token on (`logits_to_keep`).
- Shared prompts (`learner.share_prompts`): a group's prompt runs once, under a block mask.
- Fused head (`learner.fused_head`): log-probs chunk by chunk, never [tokens x vocab] logits.
- Attention kernel (`attention_kernel`): FlexAttention for packed rows on a GPU, SDPA otherwise;
  packed rows are topped up to the token budget so FlexAttention compiles once.
- LoRA (`learner.lora_rank > 0`): PEFT wraps the model before any sharding wrapper; the reference
  is the same model with its adapters off, so no reference copy exists.
- Non-finite steps: a NaN/inf loss or grad norm on any rank skips the step on all of them; what
  follows is the driver's (`rlhf.run.metrics.TrainHealth`).
- Frozen heap (`actors.worker_setup.freeze_heap`): what the constructor built, then what survives
  the first train step (compiled kernels, autotuning), is frozen out of the cyclic collector: an
  automatic full collection would otherwise walk those ~10^6 objects inside an early train step.
- Host stalls: a step reports the worst rank's collector time and, on a GPU, allocator driver calls
  and Triton compiles (`perf/gc_s`, `perf/jit_compiles`, ...: docs/monitoring.md): a slow step shows.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from actors.device import detect as detect_device
from actors.host_cores import pin_process
from actors.hf_model import attention_kernel, export_hf, unwrapped
from actors.learner_forward import Layout, forward_logprobs
from actors.learner_kernels import VARLEN
from actors.worker_setup import GcClock, JitClock, freeze_heap, gc_paused, wait_for
from rlhf.algo.objectives import is_max_metric, merge_metrics, metric_floats, reduce_metrics
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.data.batching import micro_batches
from rlhf.lora import (
    adapter_config,
    adapter_weights,
    is_adapter_name,
    lora_scale,
    merged_weights,
    save_adapter,
)
from rlhf.planner.flops import train_flops
from rlhf.protocols import Objective
from rlhf.run.metrics import nonfinite
from rlhf.types import Batch, StepMetrics, TrainBatch


SHARDINGS = {"fsdp2": "actors.fsdp2_learner:FSDP2Sharding", "deepspeed": "actors.deepspeed_learner:DeepSpeedSharding"}
"""`learner.backend` -> the Sharding class (imported only when a rank builds it)."""


@dataclass(frozen=True)
class RankContext:
    """What a Sharding needs to know of its rank."""

    rank: int
    world_size: int
    cfg: LearnerConfig
    model_cfg: ModelConfig
    device: Any  # actors.device.Device


class Sharding(Protocol):
    """How a learner backend holds the model across the ranks (built inside the rank's process group)."""

    model: torch.nn.Module
    """What the rank's forward passes run (FSDP2's sharded module, DeepSpeed's engine)."""
    reference: torch.nn.Module | None
    """The frozen reference model, when the rank was asked for one."""
    lora_targets: list[str]
    """With LoRA, the leaf module names that carry adapters."""

    def micro_batch(self, last: bool) -> None:
        """Called before each micro-batch of a train step, with whether it is the step's last (where
        a backend that accumulates unsharded reduces: FSDP2's `cast_once_per_step`)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (already scaled for averaging over ranks: "Global loss
        normalization" in actors/learner_base.py)."""

    def optimizer_step(self) -> float:
        """Reduce, clip to `learner.max_grad_norm`, step the optimizer and the scheduler, zero the
        gradients; return the global gradient norm."""

    def full_parameters(self, keep: bool | None = None, only: Callable[[str], bool] | None = None,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, full tensor) of every weight (or of those whose name passes `only`), one at a
        time; HF names, or PEFT's with LoRA; cast to `dtype` when given, before any gathering (half
        the bytes for a bf16 push of fp32 shards). A rank that does not `keep` them (default: ranks
        other than 0) may get None. A collective: every rank iterates the same names in the same order."""

    def current_lr(self) -> float:
        """The learning rate of the last optimizer step."""

    def save_state(self, folder: Path) -> None:
        """Write what exact resume needs (sharded weights, optimizer, scheduler) into `folder`."""

    def load_state(self, folder: Path) -> None:
        """Restore what `save_state` wrote, reading no pickle that could run code."""


class LearnerRank:
    """Rank bookkeeping, micro-batching, the train/log-prob loops and weight export, over the
    Sharding of `learner.backend`. `rank`/`world_size`/`master_*` come from the actor group's
    rendezvous (`driver_store`: a TCPStore the driver serves there; else rank 0 serves it).
    `start_after`: Ray object refs (in a list, so Ray passes them unresolved) to wait for before
    touching the device; the process starts and imports its backend meanwhile (colocated GPU engines
    start first: actors/cluster.py::build_cluster). `host_gpus`: the node's GPU ids under
    `cluster.pin_cores` (actors/host_cores.py), else empty. The constructor runs with the GC paused."""

    @gc_paused()
    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 model_cfg: ModelConfig, learner_cfg: LearnerConfig, temperature: float, with_reference: bool,
                 seed: int, driver_store: bool = False, start_after: list | None = None,
                 host_gpus: Sequence[str] = ()) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401  (imported before the wait)
        from actors.actor_group import load_class

        sharding_cls = load_class(SHARDINGS[learner_cfg.backend])  # imports torch.distributed, DeepSpeed
        wait_for(start_after)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.temperature = learner_cfg, temperature
        self.lora = learner_cfg.lora_rank > 0  # "LoRA" in the module docstring
        self.device = detect_device()
        pin_process(self.device.host_cores(host_gpus))
        self.model_config = AutoConfig.from_pretrained(model_path)  # model FLOPs for perf/ metrics
        self.peak_flops = self.device.peak_flops(model_cfg.dtype)
        self._transports: dict[str, object] = {}
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        self.device.set_device(0)
        self.device.share_host_threads(world_size)
        # Every collective, the small bookkeeping ones too, runs on this device: NCCL takes no CPU tensors.
        self._dev = self.device.torch_device(0)
        kernel = attention_kernel(learner_cfg, self.device.kind)
        # Packed rows under FlexAttention with a token budget are topped up to the budget (see
        # "Attention kernel" in the module docstring).
        self._layout = Layout(learner_cfg, temperature, self._dev, varlen=kernel == VARLEN,
                              fixed_pack=(learner_cfg.pack_sequences and learner_cfg.max_tokens_per_micro_batch > 0
                                          and kernel == "flex_attention"))
        if not dist.is_initialized():
            # The driver's store (actors.actor_group.host_store), joined as a client and sealed with the
            # group's secret; else env://, where rank 0 serves the store on master_port.
            from actors.actor_group import join_store

            store = join_store(master_addr, master_port) if driver_store else None
            dist.init_process_group(self.device.dist_backend, store=store, rank=rank, world_size=world_size)
        torch.manual_seed(seed)
        context = RankContext(rank, world_size, learner_cfg, model_cfg, self.device)
        self.sharding: Sharding = sharding_cls(context, model_path, with_reference)
        self._heap_settled = False  # "Frozen heap": again after the first train step
        self._gc = GcClock()  # "Host stalls"
        self._jit = JitClock.start() if self.device.kind == "cuda" else None
        freeze_heap()

    @property
    def model(self) -> torch.nn.Module:
        return self.sharding.model

    @property
    def reference(self) -> torch.nn.Module | None:
        return self.sharding.reference

    # ---------------------------------------------------------------- forward passes

    def _forward_logprobs(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """Token log-probs [b, T] of a micro-batch, aligned like TrainBatch.old_logprobs, in the
        layout `learner.*` asks for (actors.learner_forward)."""
        return forward_logprobs(model, mb, self._layout)

    def _aligned_micro_batches(self, batch: Batch) -> tuple[list[tuple[torch.Tensor, Batch]], int]:
        """This rank's (item indices, micro-batch) pairs and the count every rank must run (the max
        over ranks): fixed-size micro-batches, or token-budget ones (`learner.max_tokens_per_micro_batch`)."""
        mbs = micro_batches(batch, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch) if len(batch) else []
        count = torch.tensor([len(mbs)], device=self._dev)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mbs, int(count)

    @torch.no_grad()
    def logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """Token log-probs [rows, T] of this rank's rows (policy or reference), on CPU. With LoRA
        and no separate reference model, the reference is the policy with its adapters off."""
        model, context = (self.reference if reference else self.model), nullcontext()
        if reference and model is None and self.lora:  # the reference is the policy, adapters off
            model, context = self.model, unwrapped(self.model).disable_adapter()  # the PeftModel
        if model is None:
            raise RuntimeError("reference log-probs asked for, but the learner was built without a reference")
        was_training = model.training
        model.eval()
        mbs, count = self._aligned_micro_batches(batch)
        out, parts = torch.zeros(batch.input_ids.shape, dtype=torch.float32), []
        with context:
            for i in range(count):
                items, mb = mbs[i] if i < len(mbs) else (None, batch.dummy())
                lp = self._forward_logprobs(model, mb)
                if items is not None:
                    parts.append((items, lp))
        for items, lp in parts:  # read back after the last forward: no stall between micro-batches
            out[_item_rows(batch, items), : lp.shape[1]] = lp.cpu()
        model.train(was_training)
        return out

    def train_step(self, batch: Batch, objective: Objective) -> StepMetrics:
        """Forward/backward over micro-batches, clip, one optimizer step (none where the loss or the
        gradient is not finite: "Non-finite steps"). Metrics follow the objective's contract
        (rlhf.algo.objectives): summed over micro-batches and ranks, then reduced."""
        mbs, count = self._aligned_micro_batches(batch)
        self.device.reset_peak()
        self.device.synchronize()
        counters = self._stall_counters()
        start = time.perf_counter()
        units = torch.tensor([float(sum(objective.num_units(mb) for _, mb in mbs))], dtype=torch.float64,
                             device=self._dev)
        dist.all_reduce(units)
        denominator = max(float(units), 1.0)
        sums: dict[str, Any] = {}  # on the device until the step ends: no read-back per micro-batch
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._dev)  # what was backpropagated
        for i in range(count):
            real = i < len(mbs)
            mb = mbs[i][1] if real else batch.dummy()
            self.sharding.micro_batch(last=i == count - 1)
            lp = self._forward_logprobs(self.model, mb)
            loss, metrics = objective(lp, mb, denominator)
            if not real:
                loss, metrics = loss * 0.0, {}
            self.sharding.backward(loss * self.world_size)
            loss_sum += loss.detach()
            merge_metrics(sums, metrics)
        grad_norm, skipped = self._step_if_finite(loss_sum)
        broken = not skipped and not self._weights_finite()
        self.device.synchronize()
        seconds = time.perf_counter() - start
        stalls = {k: v - counters[k] for k, v in self._stall_counters().items()}
        flops = train_flops(self.model_config, batch.attention_mask.sum(dim=1).tolist())
        self.device.empty_cache()  # colocated: hand activation memory back before the engine's KV cache wakes
        if not self._heap_settled:  # "Frozen heap"
            freeze_heap(collect=True)
            self._heap_settled = True
        metrics = self._reduce(metric_floats(sums), grad_norm=grad_norm, num_tokens=int(batch.loss_mask.sum()))
        metrics.values.update({"train/nonfinite_skipped": float(skipped), "train/nonfinite_params": float(broken),
                               **self._perf(flops, seconds, stalls)})
        return metrics

    def update(self, batch: TrainBatch, objective: Objective, reference: bool, updates: int) -> StepMetrics:
        """`rlhf.protocols.LearnerGroup.update` on this rank's rows: their reference and old
        log-probs are computed here and stay here (the same rows, micro-batches and values the
        driver used to gather and send back)."""
        if reference:
            batch.ref_logprobs = self.logprobs(batch, reference=True)
        if updates > 1:
            batch.old_logprobs = self.logprobs(batch)
        for _ in range(updates):
            metrics = self.train_step(batch, objective)
            if nonfinite(metrics):  # reduced over ranks: every rank stops here
                break
        return metrics

    def _step_if_finite(self, loss_sum: torch.Tensor) -> tuple[float, bool]:
        """The optimizer step unless the loss or the global grad norm is NaN/inf on some rank
        ("Non-finite steps"). Returns (grad norm, skipped), the same on every rank."""
        grads = [g for g in (_local(p.grad) for p in self.model.parameters() if p.grad is not None) if g.numel()]
        squares = torch.stack(torch._foreach_norm(grads)).double().square().sum() if grads else torch.zeros(())
        check = torch.stack([(~torch.isfinite(loss_sum)).double(), squares.to(self._dev, torch.float64)])
        dist.all_reduce(check)  # [ranks with a NaN/inf loss, squared norm of the shards' gradients]
        norm = math.sqrt(float(check[1]))
        if not (check[0] == 0 and norm <= torch.finfo(torch.float32).max) and unwrapped(self.model) is self.model:
            self.model.zero_grad(set_to_none=True)
            return norm, True
        # DeepSpeed's engine keeps its gradients out of sight (no .grad here) and skips a NaN/inf
        # grad norm itself, clearing them and reporting the norm as inf.
        grad_norm = self.sharding.optimizer_step()
        return grad_norm, not math.isfinite(grad_norm)

    def _weights_finite(self) -> bool:
        """Whether every trainable weight is finite on every rank (a max-abs per local shard)."""
        local = [t.detach() for t in (_local(p) for p in self.model.parameters() if p.requires_grad) if t.numel()]
        bad = torch.zeros((), device=self._dev)
        if local:
            bad += (~torch.stack(torch._foreach_norm(local, math.inf)).isfinite()).any().to(self._dev)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _stall_counters(self) -> dict[str, float]:
        """The running counters of "Host stalls", which a train step reports the growth of: the
        collector's seconds and full collections and, on a GPU, the caching allocator's driver
        allocations and retries and the Triton kernels compiled (and their seconds)."""
        out = {"perf/gc_s": self._gc.seconds, "perf/gc_full": float(self._gc.full)}
        if self.device.kind == "cuda":
            mallocs, retries = self.device.allocator_calls()
            out.update({"perf/device_mallocs": float(mallocs), "perf/alloc_retries": float(retries)})
        if self._jit is not None:
            out.update({"perf/jit_compiles": float(self._jit.compiles), "perf/jit_s": self._jit.seconds})
        return out

    def _perf(self, flops: float, seconds: float, stalls: dict[str, float]) -> dict[str, float]:
        """Model FLOP/s of the step per device (`perf/tflops_per_device`) and, where the device's
        peak is known, `perf/mfu`: the ranks' model FLOPs over (slowest rank's seconds x ranks x peak);
        `stalls` (host pauses inside the step: "Host stalls") as their maximum over ranks."""
        total = torch.tensor([flops], dtype=torch.float64, device=self._dev)
        maxima = torch.tensor([seconds, *stalls.values()], dtype=torch.float64, device=self._dev)
        dist.all_reduce(total)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        slowest, *worst = maxima.tolist()
        per_device = float(total) / max(slowest, 1e-9) / self.world_size
        out = {"perf/tflops_per_device": per_device / 1e12, **dict(zip(stalls, worst))}
        if self.peak_flops:
            out["perf/mfu"] = per_device / self.peak_flops
        return out

    def _reduce(self, sums: dict[str, float], *, grad_norm: float, num_tokens: int) -> StepMetrics:
        """All-reduce the metric sums and apply the objective's reduction. The key set is the
        union over ranks: a rank whose share of the batch was empty has no keys of its own."""
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, sorted(sums))
        keys = sorted(set().union(*gathered))
        maxima = [k for k in keys if is_max_metric(k)]  # e.g. is/weight_max: a max over ranks, not a sum
        keys = [k for k in keys if not is_max_metric(k)]
        packed = torch.tensor([sums.get(k, 0.0) for k in keys] + [float(num_tokens)], dtype=torch.float64,
                              device=self._dev)
        dist.all_reduce(packed)
        top = torch.tensor([sums.get(k, float("-inf")) for k in maxima], dtype=torch.float64, device=self._dev)
        if maxima:
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        peak = torch.tensor([self.device.peak_memory_gib()], dtype=torch.float64, device=self._dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        packed = packed.tolist()
        values = reduce_metrics([dict(zip(keys, packed[:-1]))]) | dict(zip(maxima, top.tolist()))
        loss = values.pop("loss", 0.0)
        values.pop("weight", None)
        values["lr"] = self.sharding.current_lr()
        values["memory/learner_peak_gib"] = float(peak)  # max over ranks; CPU: resident-set high-water mark
        return StepMetrics(loss=loss, grad_norm=grad_norm, values=values, num_tokens=int(packed[-1]))

    # ---------------------------------------------------------------- weights out

    def served_weights(self, keep: bool | None = None, *, sync: bool = True, dtype: torch.dtype | None = None
                       ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """What leaves the learner, one full tensor at a time (a collective): every parameter in HF
        names (cast to `dtype` before gathering, when given); with LoRA the merged
        weights, or for a `sync` in `lora_sync: adapter` mode the adapter tensors under PEFT's file
        names (merged and adapter tensors are cast by the caller: the merge wants full precision)."""
        if not self.lora:
            return self.sharding.full_parameters(keep, dtype=dtype)
        if sync and self.cfg.lora_sync == "adapter":
            return adapter_weights(self.sharding.full_parameters(keep, only=is_adapter_name))
        return merged_weights(self.sharding.full_parameters(keep), lora_scale(self.cfg))

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype, *, keep: bool
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights a sync sends (`served_weights`), grouped into buckets of about `bucket_bytes`.

        A collective: every rank iterates and each parameter is gathered once; the ranks that
        `keep` get the full tensors, the others one empty bucket at the end. Peak extra memory on
        a keeping rank is one bucket, never the whole model.
        """
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, full in self.served_weights(keep, dtype=dtype):
            if keep:
                bucket.append((name, full.detach().to(dtype)))
                size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket or not keep:
            yield bucket

    def push_weights(self, targets: list[tuple[int, object]], transport: object) -> dict[str, Any]:
        """Send the current weights through `transport` (actors.weight_sync) to the engines in
        `targets` ((engine index, actor) pairs; empty: this rank only helps gather). Returns, once
        they all serve the new weights, {"engines": {engine index: its seconds in the update},
        "gather_s": seconds gathering and casting, "send_s": seconds handing buckets over and
        committing}. The first transport of a kind is kept, so a connection it opens (NCCL) lives on."""
        transport = self._transports.setdefault(type(transport).__name__, transport)
        gather_s = send_s = 0.0
        clock = time.perf_counter()
        for bucket in self.iter_weight_buckets(transport.bucket_bytes, transport.dtype, keep=bool(targets)):
            sent = time.perf_counter()
            gather_s += sent - clock
            if bucket:
                transport.send(bucket, targets)
            clock = time.perf_counter()
            send_s += clock - sent
        seconds = transport.finish(targets) if targets else {}  # commit: the engines serve these weights
        send_s += time.perf_counter() - clock
        dist.barrier()
        self.device.empty_cache()  # the buckets' memory, likewise
        return {"engines": seconds, "gather_s": gather_s, "send_s": send_s}

    def export_hf(self, model_path: str, out: Path, dtype: torch.dtype) -> None:
        """Write an HF folder (the source model's config/tokenizer plus our weights as safetensors)
        from rank 0, gathering one parameter at a time. A collective."""
        state = self._on_rank0(self.served_weights(sync=False), dtype)
        if self.rank == 0:
            export_hf(state, model_path, out)

    def export_adapter(self, model_path: str, out: Path) -> None:
        """LoRA: write the adapter as a PEFT folder (`adapter_model.safetensors` + config) from rank
        0, fp32 as trained. A collective; a no-op without LoRA."""
        if not self.lora:
            return
        tensors = self._on_rank0(adapter_weights(self.sharding.full_parameters(only=is_adapter_name)), torch.float32)
        if self.rank == 0:
            save_adapter(tensors, adapter_config(self.cfg, self.sharding.lora_targets, model_path), out)

    def _on_rank0(self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full tensors of `named` as CPU copies in `dtype` on rank 0, {} elsewhere. Every rank
        walks `named` to its end: producing each full tensor is a collective."""
        return {name: full.detach().to("cpu", dtype) for name, full in named if self.rank == 0}

    def save(self, path: str, model_path: str, export_dtype: str) -> None:
        """Write `path/model/` (HF safetensors + config + tokenizer, loadable by transformers and
        vLLM; LoRA merged), with LoRA `path/adapter/` (PEFT format), then `path/train_state/` (the
        Sharding's state, for exact resume). The model comes first, so a save that fails later
        still leaves it (rlhf.run.checkpoint)."""
        out = Path(path)
        self.export_hf(model_path, out / "model", getattr(torch, export_dtype))
        self.export_adapter(model_path, out / "adapter")
        self.sharding.save_state(out / "train_state")
        dist.barrier()

    def load(self, path: str) -> None:
        """Restore what `save` wrote into the Sharding (the HF export is not read back)."""
        self.sharding.load_state(Path(path) / "train_state")

    def shutdown(self) -> None:
        """Leave the process group, and nothing frozen ("Frozen heap") in a process that lives on."""
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.unfreeze()
        self._gc.close()
        if self._jit is not None:
            self._jit.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight or gradient: an FSDP2 DTensor's local shard, a ZeRO-3
    parameter's partition (`ds_tensor`), else the tensor itself."""
    if isinstance(t, DTensor):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def _item_rows(batch: Batch, items: torch.Tensor) -> torch.Tensor:
    """Rows of `batch` that its items occupy, in micro-batch row order (a PreferenceBatch's
    micro-batch holds its chosen rows, then its rejected rows)."""
    return items if batch.rows_per_item == 1 else torch.cat([items, items + len(batch)])


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
