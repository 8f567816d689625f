"""What runs inside each vLLM worker for `actors.vllm_generator.VLLMGenerator`: sent through
`LLM.collective_rpc` and called as fn(worker, *args), in the engine's process with the in-process
engine, pickled by reference when tensor parallelism spawns workers. Weight loading (from tensors,
CUDA IPC handles or an NCCL broadcast), the layer-wise reload session around it, reseeding and the
parameter checksums the tests compare."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import torch

from actors.device import detect

# (rebuild_fn, args) as returned by torch.multiprocessing.reductions.reduce_tensor(cuda_tensor)
IpcHandle = tuple[Callable[..., torch.Tensor], tuple[Any, ...]]
_IPC_DEVICE_ARG = 6  # position of the device ordinal in reduce_tensor's args (vLLM's ipc_engine uses it too)


def call_pickled(worker: Any, payload: bytes) -> Any:
    """`fn(worker, *args)` for a pickled (fn, args): how calls reach an engine core in its own
    process (VLLMGenerator._rpc)."""
    fn, args = pickle.loads(payload)
    return fn(worker, *args)


def begin_update(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.get_model())


def load_tensors(worker: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    worker.get_model().load_weights(named_tensors)


def reseed(worker: Any, seed: int) -> None:
    torch.manual_seed(seed)  # every device's default generator: what the engine's batch sampling draws from


def load_ipc(worker: Any, flat: IpcHandle, layout: list[tuple[str, tuple[int, ...], int]]) -> None:
    rebuild, args = flat
    args = list(args)
    # Same physical GPU, but the learner may see it under another ordinal: use ours.
    args[_IPC_DEVICE_ARG] = worker.device.index
    buffer = rebuild(*args)
    weights = [(name, buffer[offset: offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]
    worker.get_model().load_weights(weights)
    detect().synchronize()  # copies done before the learner may reuse the memory


def init_nccl(worker: Any, master_address: str, master_port: int, rank_offset: int,
                      world_size: int) -> None:
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_process_group,
    )

    info = NCCLWeightTransferInitInfo(master_address=master_address, master_port=master_port,
                                      rank_offset=rank_offset, world_size=world_size)
    worker.rlhf_weight_group = worker_init_process_group(info, worker.parallel_config)


def load_nccl(worker: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    group = worker.rlhf_weight_group
    model = worker.get_model()
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=worker.device)
        group.broadcast(tensor, src=0)  # on the current stream, ordered before the load's copy
        model.load_weights([(name, tensor)])  # one at a time: memory stays at one tensor
    detect().synchronize()


def finish_update(worker: Any) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from actors.worker_setup import TIED_LM_HEAD, silence_harmless_warnings

    model = worker.get_model()
    if getattr(worker.model_config.hf_config, "tie_word_embeddings", False):
        silence_harmless_warnings(TIED_LM_HEAD)  # the tied head is the embedding: nothing of its own to load
    finalize_layerwise_reload(model, worker.model_config)
    # CPU ("Packed CPU weights" in actors/vllm_generator.py): vocab layers keep their weight plus a
    # packed copy for the logits matmul. A tied LM head shares the embedding's storage, which the
    # reload rewrote, but is not reloaded itself, so its packed copy would keep the old weights:
    # re-pack every vocab layer from its weight.
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


@torch.no_grad()
def checksum(worker: Any) -> dict[str, float]:
    sums = {}
    for module_name, module in worker.get_model().named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.numel() == 0 and hasattr(module, "cpu_linear"):
                # CPU: the weight lives in a packed oneDNN/AMX handle: x = I gives W^T exactly.
                k = getattr(module, "input_size_per_partition", None) or module.input_size
                eye = torch.eye(k, dtype=module.params_dtype)
                param = module.cpu_linear(eye, param, None)
            sums[f"{module_name}.{name}" if module_name else name] = float(param.double().sum())
    return sums
