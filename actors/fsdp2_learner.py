"""FSDP2 as a learner rank's Sharding: `fully_shard` per decoder layer, fp32 master weights, bf16 compute.

The only FSDP-specific file; what every backend shares (micro-batching, the train and log-prob
loops, metrics, weight buckets, HF export) is `actors.learner_base.LearnerRank`, which holds this.

Decisions (docs/design/learners.md, "FSDP2"):
- fp32 masters: parameters are kept in fp32; `model.dtype: bfloat16` runs forward/backward in bf16
  through FSDP2's MixedPrecisionPolicy, with fp32 gradient reduction.
- One unit per layer: each decoder layer is its own FSDP unit, then the root: layer-by-layer
  all-gather overlaps with compute, and only one layer is unsharded at a time.
- Resumable state: torch.distributed.checkpoint (sharded model + optimizer) plus the scheduler; the
  HF export next to it is gathered parameter by parameter, and written first (a save that fails on
  the train state still leaves a whole model: `rlhf.run.checkpoint`, "Model first"). DCP pickles
  its `.metadata`; the driver loads only checkpoints signed on this machine (`rlhf.run.checkpoint`,
  "No foreign pickle"), and as a second defence the learner reads that file with an unpickler that
  builds only DCP's metadata classes, and DCP's non-tensor items (optimizer hyper-parameters)
  weights-only.
- LoRA (actors/learner_base.py, "LoRA"): PEFT wraps the model before `fully_shard`, so each decoder
  layer's FSDP unit holds its frozen base weights and its adapters together (FSDP2 allows mixed
  requires_grad in a unit); AdamW and gradient clipping see the adapters only. The resumable state
  is unchanged (the sharded state dict then holds base and adapter weights, the optimizer only the
  adapters' moments), so resume is exact as without LoRA.
- Gathered by unit: on more than one rank, a weight sync in the compute dtype gathers a decoder layer
  at a time through FSDP2's own unshard (one all-gather per layer, the cast fused into its copy-in), not
  one DTensor collective per tensor, whose count made the sync grow with the ranks. One rank keeps the
  per-tensor path: its shard is the whole tensor (docs/design/learners.md, "Gathered by unit").
- Cast once per step (`learner.cast_once_per_step`): FSDP2's gradient-accumulation switches keep
  every layer gathered in the compute dtype from the step's first forward to its last backward, so
  the fp32 -> bf16 cast and the all-gather happen once per step, not twice per micro-batch.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from actors.hf_model import decoder_layers, learner_model
from actors.learner_base import RankContext, make_scheduler


class FSDP2Sharding:
    """`actors.learner_base.Sharding` over FSDP2 (built inside the rank's process group)."""

    def __init__(self, ctx: RankContext, model_path: str, with_reference: bool) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.lora_targets: list[str] = []
        self._compute_dtype = getattr(torch, ctx.model_cfg.dtype)  # FSDP2's param_dtype
        self.model = self._build(model_path, trainable=True)
        self.reference = self._build(model_path, trainable=False) if with_reference else None
        # fused: one kernel over all (sharded) parameters; on CPU 5x faster than foreach (0.07 s vs
        # 0.38 s per step for 135M parameters on 2 cores).
        self.optimizer = torch.optim.AdamW(self._trainable(), lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay, fused=True)
        self.scheduler = make_scheduler(self.optimizer, self.cfg.warmup_steps)

    def _build(self, model_path: str, *, trainable: bool) -> torch.nn.Module:
        # LoRA adapters before sharding (PEFT froze the base weights), kernels too.
        model, targets = learner_model(model_path, self.cfg, self.ctx.device.kind, trainable=trainable)
        layers = decoder_layers(model)
        lora = trainable and self.cfg.lora_rank > 0
        if lora:
            self.lora_targets = targets
        mp = MixedPrecisionPolicy(param_dtype=self._compute_dtype, reduce_dtype=torch.float32)
        # reshard_after_forward=False keeps each layer's gathered weights from forward to backward
        # (ZeRO-2-like: memory for one all-gather less per layer); the frozen reference has no backward.
        # `cast_once_per_step` keeps them for the whole step.
        reshard = (self.cfg.reshard_after_forward and not self.cfg.cast_once_per_step) or not trainable
        for layer in layers:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
        model.to(self.ctx.device.torch_device(0))
        model.train(trainable)
        if not lora:
            model.requires_grad_(trainable)
        return model

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def micro_batch(self, last: bool) -> None:
        """Cast once per step: with `cast_once_per_step`, only the step's last micro-batch reshards the layers
        and reduces the gradients accumulated (unsharded, fp32) over the step."""
        if self.cfg.cast_once_per_step:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable(), self.cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_parameters(self, keep: bool | None = None, only: Callable[[str], bool] | None = None,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        # named_parameters lists a tied weight once (embeddings, not lm_head): vLLM and HF re-tie.
        if dtype is not None and dtype == self._compute_dtype and self.ctx.world_size > 1:
            yield from self._unsharded_parameters(keep, only)
            return
        for name, param in self.model.named_parameters():
            if only is None or only(name):
                yield name, full_tensor(param.detach(), dtype)

    def _unsharded_parameters(self, keep: bool | None, only: Callable[[str], bool] | None
                              ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """`full_parameters` in the compute dtype, a unit at a time ("Gathered by unit" above): FSDP2's
        own unshard (one all-gather per layer, cast on the way), each weight copied out before the
        unit reshards; ranks that do not `keep` (default: all but rank 0) get None."""
        keep = self.ctx.rank == 0 if keep is None else keep
        unit_of = {id(p): unit for unit in self.model.modules() if isinstance(unit, FSDPModule)
                   for p in _own_parameters(unit)}
        # Read while sharded: an unsharded unit's attributes are other Parameter objects.
        owners = [(n, unit_of[id(p)]) for n, p in self.model.named_parameters() if only is None or only(n)]
        root, current = self.model, None
        root.unshard()  # embeddings and final norm: first and last in name order
        try:
            for name, unit in owners:
                if unit is not root and unit is not current:
                    if current is not None:
                        current.reshard()
                    current = unit
                    unit.unshard()
                yield name, self.model.get_parameter(name).detach().clone() if keep else None
        finally:
            for unit in (current, root):
                if unit is not None:
                    unit.reshard()

    def save_state(self, folder: Path) -> None:
        """The sharded model and optimizer (torch.distributed.checkpoint) and the scheduler."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(folder))
        if self.ctx.rank == 0:
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")

    def load_state(self, folder: Path) -> None:
        """What `save_state` wrote, reading no pickle that could run code ("Resumable state")."""
        state = self._state()
        load_train_state(state, folder)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))

    def _state(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.optimizer)}


def _own_parameters(unit: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The parameters FSDP unit `unit` shards: its own, not those of the units nested in it."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield from module.parameters(recurse=False)
        stack.extend(c for c in module.children() if not isinstance(c, FSDPModule))


def full_tensor(param: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole of a (possibly sharded) parameter on every rank, cast to `dtype` before the
    all-gather so the collective moves the pushed bytes, not the fp32 master's. On a one-rank mesh
    the local shard is the whole tensor: no collective at all."""
    if dtype is not None:
        param = param.to(dtype)
    if not isinstance(param, DTensor):
        return param
    return param.to_local() if param.device_mesh.size() == 1 else param.full_tensor()


def load_train_state(state: dict[str, Any], folder: Path) -> None:
    """torch.distributed.checkpoint's load of `folder` into `state`, with `.metadata` read by
    `MetadataUnpickler` and the non-tensor items weights-only ("Resumable state")."""
    import torch.distributed.checkpoint as dcp

    reader = _SafeReader(str(folder))
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner())
    except (Exception, CheckpointException):  # CheckpointException is a BaseException
        if reader.refused is not None:  # DCP hides a failed metadata read behind "metadata is None"
            raise reader.refused from None
        raise


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
            ("torch", "Size"), ("collections", "OrderedDict"),
            *((module, name) for module in ("pathlib", "pathlib._local") for name in _PATHS)}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's `.metadata` holds: the classes of its metadata module, its storage
    records, torch sizes, dtypes, layouts and memory formats, and paths. Any other name (a planted
    pickle's `os.system`) is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class _SafeReader(FileSystemReader):
    """DCP's file reader, its `.metadata` read by MetadataUnpickler; `refused`: what it refused."""

    refused: pickle.UnpicklingError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                self.refused = pickle.UnpicklingError(f"{path}: {e}; not loaded")
                raise self.refused from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, its non-tensor items (the optimizer's hyper-parameters) unpickled
    weights-only; what the default planner then unpickles is our own re-serialization."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        buffer = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)
