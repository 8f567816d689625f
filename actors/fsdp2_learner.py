"""FSDP2 learner rank: one process of the learner group, training with `fully_shard`.

The only FSDP-specific file. One instance per rank (a Ray actor made by `actors.learner_group`);
every public method is a collective: all ranks call it with their own shard of the batch.

Choices:
1. Parameters are kept in fp32 (master weights); `model.dtype: bfloat16` runs forward/backward in
   bf16 through FSDP2's MixedPrecisionPolicy, with fp32 gradient reduction.
2. Each decoder layer is its own FSDP unit, then the root: layer-by-layer all-gather overlaps with
   compute, and only one layer is unsharded at a time.
3. Loss normalization is global: each rank's micro-batch losses are divided by the whole step's
   denominator (tokens or sequences over all ranks), so gradients are exactly those of the
   full-batch loss however the batch is split. FSDP averages gradients over ranks, so the loss
   is multiplied by world_size first.
4. Every rank runs the same number of forward/backward passes (FSDP's collectives need it): a
   rank with fewer rows runs zero-weight dummy micro-batches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from actors.device import detect as detect_device
from rlhf.batching import micro_batches
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.logprobs import token_logprobs
from rlhf.objectives import reduce_metrics
from rlhf.protocols import Objective
from rlhf.types import StepMetrics, TrainBatch



class FSDP2Learner:
    """One rank. `rank`/`world_size`/`master_*` come from the actor group's rendezvous."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_path: str,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        temperature: float,
        with_reference: bool,
        seed: int,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg, self.temperature = learner_cfg, temperature
        self.device = detect_device()
        self._transports: dict[str, object] = {}
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.device.set_device(0)
        # Every collective, the small bookkeeping ones too, runs on this device: NCCL takes no CPU tensors.
        self._dev = self.device.torch_device(0)
        dist.init_process_group(self.device.dist_backend, rank=rank, world_size=world_size)
        torch.manual_seed(seed)
        self.model = self._build(model_path, model_cfg, trainable=True)
        self.reference = self._build(model_path, model_cfg, trainable=False) if with_reference else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=learner_cfg.lr, betas=learner_cfg.betas,
            weight_decay=learner_cfg.weight_decay,
        )
        warmup = learner_cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def _build(self, model_path: str, model_cfg: ModelConfig, *, trainable: bool) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if trainable and model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, model_cfg.dtype), reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to(self.device.torch_device(0))
        model.train(trainable)
        model.requires_grad_(trainable)
        return model

    # ---------------------------------------------------------------- forward passes

    def _forward_logprobs(self, model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        dev = self._dev
        logits = model(input_ids=mb.input_ids.to(dev), attention_mask=mb.attention_mask.to(dev)).logits
        # bf16 logits stay bf16: token_logprobs upcasts chunk by chunk, never the whole [b, T, V].
        return token_logprobs(logits, mb.input_ids.to(dev), mb.loss_mask.to(dev),
                              temperature=self.temperature)

    def _aligned_micro_batches(self, batch: TrainBatch) -> tuple[list[TrainBatch], int]:
        """This rank's micro-batches and the count every rank must run (the max over ranks)."""
        mbs = micro_batches(batch, self.cfg.micro_batch_size) if len(batch) else []
        count = torch.tensor([len(mbs)], device=self._dev)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return mbs, int(count)

    @staticmethod
    def _dummy(like: TrainBatch) -> TrainBatch:
        """One padding token with an empty loss mask: keeps collectives in step, adds nothing."""
        one = torch.zeros((1, 1), dtype=torch.long)
        empty = torch.zeros((1, 1), dtype=torch.bool)
        zeros = torch.zeros((1, 1))
        return TrainBatch(
            input_ids=one, attention_mask=~empty, loss_mask=empty, advantages=torch.zeros(1),
            old_logprobs=None if like.old_logprobs is None else zeros,
            ref_logprobs=None if like.ref_logprobs is None else zeros,
            sampler_logprobs=None if like.sampler_logprobs is None else zeros,
        )

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Token log-probs [b, T] of this rank's rows (policy or reference), on CPU."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs asked for, but the learner was built without a reference")
        mbs, count = self._aligned_micro_batches(batch)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        row = 0
        for i in range(count):
            mb = mbs[i] if i < len(mbs) else self._dummy(batch)
            lp = self._forward_logprobs(model, mb).cpu()
            if i < len(mbs):
                out[row : row + len(mb), : lp.shape[1]] = lp
                row += len(mb)
        return out

    def train_step(self, batch: TrainBatch, objective: Objective) -> StepMetrics:
        """Forward/backward over micro-batches, clip, one optimizer step. Metrics follow the
        objective's contract (rlhf.objectives): summed over micro-batches and ranks, then reduced."""
        mbs, count = self._aligned_micro_batches(batch)
        self.device.reset_peak()
        units = torch.tensor([float(sum(objective.num_units(mb) for mb in mbs))], dtype=torch.float64,
                             device=self._dev)
        dist.all_reduce(units)
        denominator = max(float(units), 1.0)
        sums: dict[str, float] = {}
        for i in range(count):
            real = i < len(mbs)
            mb = mbs[i] if real else self._dummy(batch)
            lp = self._forward_logprobs(self.model, mb)
            loss, metrics = objective(lp, mb, denominator)
            if not real:
                loss, metrics = loss * 0.0, {}
            (loss * self.world_size).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.device.empty_cache()  # colocated: hand activation memory back before the engine's KV cache wakes
        return self._reduce(sums, grad_norm=float(grad_norm), num_tokens=int(batch.loss_mask.sum()))

    def _reduce(self, sums: dict[str, float], *, grad_norm: float, num_tokens: int) -> StepMetrics:
        """All-reduce the metric sums and apply the objective's reduction. The key set is the
        union over ranks: a rank whose share of the batch was empty has no keys of its own."""
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, sorted(sums))
        keys = sorted(set().union(*gathered))
        packed = torch.tensor([sums.get(k, 0.0) for k in keys] + [float(num_tokens)], dtype=torch.float64,
                              device=self._dev)
        dist.all_reduce(packed)
        peak = torch.tensor([self.device.peak_memory_gib()], dtype=torch.float64, device=self._dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        packed = packed.tolist()
        values = reduce_metrics([dict(zip(keys, packed[:-1]))])
        loss = values.pop("loss", 0.0)
        values.pop("weight", None)
        values["lr"] = self.scheduler.get_last_lr()[0]
        values["memory/learner_peak_gib"] = float(peak)  # max over ranks; CPU: resident-set high-water mark
        return StepMetrics(loss=loss, grad_norm=grad_norm, values=values, num_tokens=int(packed[-1]))

    # ---------------------------------------------------------------- weights out

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) parameters in HF names, grouped into buckets of about `bucket_bytes`.

        A collective: every rank iterates, each parameter is all-gathered once, and only rank 0
        keeps the full tensors (others yield empty buckets). Peak extra memory on rank 0 is one
        bucket, never the whole model.
        """
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, param in self.model.state_dict().items():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if self.rank == 0:
                bucket.append((name, full.detach().to(dtype)))
                size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket or self.rank != 0:
            yield bucket

    def push_weights(self, generator: object, transport: object) -> None:
        """Send the current weights to `generator` through `transport` (actors.weight_sync):
        every rank helps gather, rank 0 sends. Returns once the generator has loaded them.
        The first transport of a kind is kept, so a connection it opens (NCCL) lives on."""
        transport = self._transports.setdefault(type(transport).__name__, transport)
        for bucket in self.iter_weight_buckets(transport.bucket_bytes, transport.dtype):
            if self.rank == 0 and bucket:
                transport.send(bucket, generator)
        if self.rank == 0:
            transport.finish(generator)  # commit: the generator now serves exactly these weights
        dist.barrier()
        self.device.empty_cache()  # the buckets' memory, likewise

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: str, model_path: str, export_dtype: str) -> None:
        """Write `path/model/` (HF safetensors + config + tokenizer, loadable by transformers and
        vLLM) and `path/train_state/` (sharded model + optimizer, exact resume) plus scheduler."""
        import torch.distributed.checkpoint as dcp

        out = Path(path)
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            _export_hf(full, model_path, out / "model", getattr(torch, export_dtype))
        state = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }
        dcp.save(state, checkpoint_id=str(out / "train_state"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), out / "train_state" / "scheduler.pt")
        dist.barrier()

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        out = Path(path)
        state = {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }
        dcp.load(state, checkpoint_id=str(out / "train_state"))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(torch.load(out / "train_state" / "scheduler.pt", weights_only=True))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _export_hf(state: dict[str, torch.Tensor], model_path: str, out: Path, dtype: torch.dtype) -> None:
    """An HF folder: the source model's config/tokenizer files plus our weights as safetensors."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    tensors = {k: v.to(dtype).contiguous() for k, v in state.items()}
    # Tied embeddings share storage; safetensors refuses aliases, and HF re-ties on load.
    seen: dict[int, str] = {}
    for k in list(tensors):
        ptr = state[k].data_ptr()
        if ptr in seen:
            del tensors[k]
        seen[ptr] = k
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

