"""DeepSpeed ZeRO-2/3 as a learner rank's Sharding, interchangeable with `actors.fsdp2_learner.FSDP2Sharding`.

The only file that runs `deepspeed` (actors/torch_extensions.py builds its ops at set-up); what every
backend shares (micro-batching, the train and log-prob loops, metrics, weight buckets, HF export) is
`actors.learner_base.LearnerRank`, which holds this.

Decisions (docs/design/learners.md, "DeepSpeed ZeRO", has the reasons at length):
- Accumulation is the learner's: LearnerRank runs a variable number of micro-batches per step, each
  loss already divided by the step's global denominator, so the engine runs with
  `managed_gradient_accumulation: false` and `gradient_accumulation_steps: 1`: `backward` only
  accumulates, `step()` is the boundary where ZeRO reduces, clips, steps AdamW and the scheduler.
- Optimizer and precision: torch's AdamW as a client optimizer (the same update as FSDP2), or
  DeepSpeedCPUAdam with `learner.offload_optimizer`. `model.dtype: bfloat16` is DeepSpeed's bf16
  mode: bf16 module and compute, fp32 masters made from the bf16-cast module, fp32 gradients.
- Reference model: a ZeRO-3 inference engine for both stages, the only stage that shards a frozen
  model (ZeRO-2 shards optimizer state and gradients, which it has none of).
- User JSON: `learner.deepspeed_config` is merged over the generated config; the keys the learner
  owns (batch sizes, accumulation, ZeRO stage, clipping, dtype, optimizer, scheduler) are set again
  after the merge, and HF Trainer's "auto" placeholders are dropped.
- Resumable state: DeepSpeed's own checkpoint (`engine.save_checkpoint`) under `train_state/`,
  written after the HF export (`rlhf.run.checkpoint`, "Model first"). Its files are pickles; the
  driver loads only checkpoints signed on this machine (`rlhf.run.checkpoint`, "No foreign
  pickle"), and the engine's reader is swapped for a weights-only one (`weights_only_load`).
- LoRA (actors/learner_base.py, "LoRA"): PEFT wraps the model before `deepspeed.initialize` and the
  optimizer gets only the adapters, so ZeRO keeps fp32 masters and moments for them alone.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def _hidden(module: str) -> Iterator[None]:
    """`import module` fails inside (unless it is imported already): DeepSpeed's autotuner imports
    mlflow when it is installed (the trackers extra), ~3 s of every learner process's start, for
    logging autotuning runs that no learner makes. The driver's tracker imports mlflow itself."""
    hide = module not in sys.modules
    if hide:
        sys.modules[module] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hide:
            del sys.modules[module]


with _hidden("mlflow"):
    import deepspeed

from actors.hf_model import learner_model
from actors.learner_base import RankContext, make_scheduler
from actors.torch_extensions import clear_stale_build_locks
from rlhf.config import LearnerConfig, ModelConfig

_TAG = "state"  # one DeepSpeed checkpoint per train_state/ folder
# Keys the learner sets itself; a user's deepspeed_config cannot change them.
_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
          "managed_gradient_accumulation", "gradient_clipping", "bf16", "fp16", "optimizer", "scheduler")


class DeepSpeedSharding:
    """`actors.learner_base.Sharding` over DeepSpeed ZeRO (built inside the rank's process group)."""

    def __init__(self, ctx: RankContext, model_path: str, with_reference: bool) -> None:
        cfg = ctx.cfg
        if cfg.offload_params and cfg.zero_stage != 3:
            raise ValueError("learner.offload_params needs learner.zero_stage=3: ZeRO-2 keeps the full "
                             "parameters on every rank (learner.offload_optimizer works with both stages)")
        self.ctx, self.cfg = ctx, cfg
        deepspeed.utils.logger.setLevel(logging.WARNING)
        config = train_config(cfg, ctx.model_cfg, ctx.world_size, pin_memory=ctx.device.kind == "cuda")
        clear_stale_build_locks()  # DeepSpeed builds its ops (CPU Adam, shm collectives) just in time
        model, self.lora_targets = learner_model(model_path, cfg, ctx.device.kind, trainable=True)  # LoRA
        trainable = [p for p in model.parameters() if p.requires_grad]
        if cfg.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                         adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = make_scheduler(optimizer, cfg.warmup_steps)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=self.scheduler,
                                               config=config)
        self.model = self.engine  # its forward returns the HF output (.logits)
        self.reference = self._reference(model_path, config) if with_reference else None

    def _reference(self, model_path: str, train_cfg: dict[str, Any]) -> torch.nn.Module:
        """The frozen reference as a ZeRO-3 inference engine: parameters sharded, no optimizer."""
        model, _ = learner_model(model_path, self.cfg, self.ctx.device.kind, trainable=False)
        model.requires_grad_(False)
        zero: dict[str, Any] = {"stage": 3}
        if "offload_param" in train_cfg["zero_optimization"]:
            zero["offload_param"] = train_cfg["zero_optimization"]["offload_param"]
        config = {k: train_cfg[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps", "bf16")}
        engine, *_ = deepspeed.initialize(model=model, config={**config, "zero_optimization": zero})
        engine.eval()
        return engine

    def micro_batch(self, last: bool) -> None:
        """Nothing: the engine handles its accumulation boundary in `optimizer_step`."""

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self.engine.step()  # the accumulation boundary: reduce, clip, AdamW, scheduler, zero grads
        return float(self.engine.get_global_grad_norm())

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_parameters(self, keep: bool | None = None, only: Callable[[str], bool] | None = None,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        # named_parameters lists a tied weight once (embeddings, not lm_head): vLLM and HF re-tie.
        keep = self.ctx.rank == 0 if keep is None else keep
        for name, param in self.engine.module.named_parameters():
            if only is not None and not only(name):
                continue
            if self.cfg.zero_stage == 2:  # every rank holds the full (compute-dtype) parameters
                yield name, param.detach().to(dtype or param.dtype)
                continue
            # ZeRO-3: gather this one parameter on every rank; the ranks that keep it copy it out.
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                full = param.detach().to(dtype or param.dtype, copy=True) if keep else None
            yield name, full

    def save_state(self, folder: Path) -> None:
        """DeepSpeed's checkpoint: fp32 master weights, optimizer and scheduler state, one shard per rank."""
        self.engine.save_checkpoint(str(folder), tag=_TAG)

    def load_state(self, folder: Path) -> None:
        """What `save_state` wrote, reading no pickle that could run code ("Resumable state")."""
        self.engine.checkpoint_engine.load = weights_only_load
        loaded, _ = self.engine.load_checkpoint(str(folder), tag=_TAG, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")


def weights_only_load(path: str, map_location: Any = None) -> Any:
    """A DeepSpeed state file through torch's weights-only unpickler ("Resumable state"): tensors, plain
    containers and DeepSpeed's loss-scaler, ZeRO-stage and fragment-address records; a pickle
    that names anything else is refused before it runs."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


def train_config(cfg: LearnerConfig, model_cfg: ModelConfig, world_size: int, *,
                 pin_memory: bool) -> dict[str, Any]:
    """The training engine's DeepSpeed config: generated, the user's JSON merged over it, then the
    keys the learner owns set again ("User JSON" in the module docstring)."""
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {"zero_optimization": zero}
    if model_cfg.dtype == "bfloat16":  # as FSDP2's reduce_dtype: reduce and accumulate gradients in fp32
        config.update(communication_data_type="fp32", data_types={"grad_accum_dtype": "fp32"})
    if cfg.deepspeed_config:
        user = _drop_auto(json.loads(Path(cfg.deepspeed_config).read_text()))
        config = _merge(config, {k: v for k, v in user.items() if k not in _OWNED})
    config["zero_optimization"]["stage"] = cfg.zero_stage
    config.update(
        train_micro_batch_size_per_gpu=cfg.micro_batch_size,
        train_batch_size=cfg.micro_batch_size * world_size,
        gradient_accumulation_steps=1,
        managed_gradient_accumulation=False,
        gradient_clipping=cfg.max_grad_norm,
        bf16={"enabled": model_cfg.dtype == "bfloat16"},
    )
    return config


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base`, sections recursively."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _drop_auto(config: dict[str, Any]) -> dict[str, Any]:
    """HF Trainer configs say "auto" where the trainer fills a value in; DeepSpeed's defaults apply."""
    return {k: _drop_auto(v) if isinstance(v, dict) else v for k, v in config.items() if v != "auto"}
