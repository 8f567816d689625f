"""HFGenerator: `transformers.generate` behind the Generator contract (`generation.backend: hf`).

The dependency-free reference backend: slow, but it needs nothing beyond transformers, runs on CPU,
and gives the same Completion as VLLMGenerator (token ids, sampled-token log-probs, finish reason; no
text: the reward scorer decodes both backends' ids the same way), so the loop and the weight syncs can
be tested without an inference engine.

Decisions:
- One batch: prompts are left-padded into one batch and repeated `n` times (`repeat_interleave`),
  so result[i*n:(i+1)*n] answer prompt i, and greedy decoding with n > 1 works too.
- No model defaults: the model's own generation defaults (`generation_config.json`: Qwen ships
  top_k=20 and repetition_penalty=1.05) are dropped at load; every sampling knob comes from
  SamplingSpec.
- Log-probs: `compute_transition_scores(..., normalize_logits=True)` over the processed scores: the
  log-prob of the sampled token under the distribution it was drawn from (logits / temperature,
  top-k/top-p renormalised; raw logits when greedy), like VLLMGenerator.
- Seeding never touches the caller's RNG: sampling runs under `torch.random.fork_rng`, seeded by
  the seed of the call's first prompt (`SamplingSpec.prompt_seed(first_index)`), or by
  (constructor seed, call count) when the call is unseeded, so a run is reproducible from its
  seed. One RNG for the whole batch: unlike vLLM's per-prompt seeds, the samples depend on how
  the prompts are batched (on the engine count, with several engines).
- Weight updates are `load_state_dict(bucket, strict=False)`: a bucket may hold any subset of the
  tensors; a name the model does not have is an error, not a silent skip.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from actors.device import detect
from actors.host_cores import pin_process
from actors.worker_setup import gc_paused, wait_for
from rlhf.config import GenerationConfig
from rlhf.types import Completion, SamplingSpec

_NO_NCCL = ("generation.backend=hf receives weights through the 'cpu' or 'cuda_ipc' weight sync; "
            "the NCCL broadcast (split placement) needs generation.backend=vllm")


class HFGenerator:
    """`rlhf.protocols.Generator` on transformers, with VLLMGenerator's weight-update methods."""

    @gc_paused()  # start-up: see actors/worker_setup.py
    def __init__(self, model_path: str, cfg: GenerationConfig, *, dtype: str, seed: int,
                 enable_sleep: bool, tensor_parallel_size: int = 1, engines_per_host: int = 1,
                 host_gpus: Sequence[str] = (), start_after: list | None = None) -> None:
        """Same signature as VLLMGenerator; `cfg`, `enable_sleep`, `tensor_parallel_size` and
        `engines_per_host` have nothing to configure here (every sampling knob arrives with each
        SamplingSpec); `host_gpus` and `start_after` as there."""
        wait_for(start_after)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers import GenerationConfig as HFGenerationConfig

        self.device = detect()
        pin_process(self.device.host_cores(host_gpus))
        self.seed = seed
        self._calls = 0
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        # Stop on what vLLM stops on: the tokenizer's EOS plus generation_config's EOS list.
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = sorted(set(eos))
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        model.generation_config = HFGenerationConfig()  # no model defaults
        self.model = model.to(self.device.torch_device(0)).eval()

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec, first_index: int = 0
                 ) -> list[Completion]:
        """`sampling.n` completions per prompt, grouped in prompt order: result[i*n:(i+1)*n].
        `first_index`: the step-wide index of prompt_ids[0] (its seed: "Seeding" in the module docstring)."""
        from transformers import GenerationConfig as HFGenerationConfig

        dev = self.device.torch_device(0)
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompt_ids], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=dev)
        # Greedy leaves the sampling knobs unset: transformers warns about any it would ignore.
        knobs = {} if sampling.temperature == 0 else dict(  # top_k 0: no top-k
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0))
        config = HFGenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            repetition_penalty=1.0,
            eos_token_id=None if sampling.ignore_eos else self.eos_ids,
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
            **knobs,
        )
        seed = sampling.prompt_seed(first_index)
        seed = seed if seed is not None else self.seed * 1_000_003 + self._calls
        self._calls += 1
        with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.repeat_interleave(sampling.n, 0),
                                      attention_mask=mask.repeat_interleave(sampling.n, 0),
                                      generation_config=config)
        scores = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        return [self._completion(row, lp, sampling.ignore_eos)
                for row, lp in zip(out.sequences[:, width:].tolist(), scores.float().tolist())]

    def _completion(self, tokens: list[int], logprobs: list[float], ignore_eos: bool) -> Completion:
        """Cut a generated row after its first EOS (kept); the rest is HF's padding."""
        eos = () if ignore_eos else self.eos_ids
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        end = len(tokens) if stop is None else stop + 1
        tokens = tokens[:end]
        return Completion(token_ids=tokens, logprobs=logprobs[:end],
                          finish_reason="length" if stop is None else "stop")

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of HF-named tensors into the model ("Weight updates")."""
        unexpected = self.model.load_state_dict(dict(named_tensors), strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"update_weights: the model has no tensors named {unexpected[:5]}")

    def update_weights_from_ipc(self, handles: list[tuple[str, tuple]]) -> None:
        """One bucket as [(name, reduce_tensor(cuda_tensor))] from a learner on the same GPU: map the
        learner's memory, copy, synchronise (the learner may then free it). GPU only, untested."""
        index = self.device.torch_device(0).index
        tensors = []
        for name, (rebuild, args) in handles:
            args = list(args)
            args[6] = index  # the device ordinal in reduce_tensor's args: same GPU, our numbering
            tensors.append((name, rebuild(*args)))
        self.update_weights(tensors)
        self.device.synchronize()

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> None:
        raise NotImplementedError(_NO_NCCL)

    def update_weights_from_nccl(self, names: list[str], dtypes: list[str], shapes: list) -> None:
        raise NotImplementedError(_NO_NCCL)

    def finish_weight_update(self) -> float:
        """Nothing to commit: each bucket is live as soon as `update_weights` returns (0 s here)."""
        return 0.0

    def sleep(self) -> None:
        """No-op: this backend keeps its weights where they are."""

    def wake(self) -> None:
        """No-op."""

    def weights_checksum(self) -> dict[str, float]:
        """float64 sum of every parameter, by HF name."""
        return {name: float(p.detach().double().sum()) for name, p in self.model.named_parameters()}

    def shutdown(self, *, process_exits: bool = False) -> None:
        """Free the model; nothing to do when the process is killed next (`process_exits`)."""
        if process_exits:
            return
        self.model = None
        gc.collect()
        self.device.empty_cache()
