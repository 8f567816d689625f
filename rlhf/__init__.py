"""rlhf: RL post-training for LLMs (GRPO, DPO). The algorithm core: pure PyTorch, no Ray/vLLM.

    from rlhf import grpo_advantages, grpo_policy_loss, dpo_loss, load_config

Names are imported lazily (PEP 562), so `import rlhf` is instant and pulls in torch only when a
tensor function is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # algorithm math
    "grpo_advantages": "rlhf.algo.advantages",
    "grpo_policy_loss": "rlhf.algo.losses",
    "kl_estimate": "rlhf.algo.losses",
    "dpo_loss": "rlhf.algo.losses",
    "simpo_loss": "rlhf.algo.losses",
    "token_logprobs": "rlhf.algo.logprobs",
    "sequence_logprobs": "rlhf.algo.logprobs",
    "packed_token_logprobs": "rlhf.algo.logprobs",
    "pack_sequences": "rlhf.algo.logprobs",
    "entropy_from_logits": "rlhf.algo.logprobs",
    "unpack": "rlhf.algo.logprobs",
    "aggregate_token_loss": "rlhf.algo.losses",
    "PreferenceBatch": "rlhf.types",
    "reduce_metrics": "rlhf.algo.objectives",
    "GRPOObjective": "rlhf.algo.objectives",
    "DPOObjective": "rlhf.algo.objectives",
    # config
    "RunConfig": "rlhf.config",
    "ConfigError": "rlhf.config",
    "load_config": "rlhf.config",
    # loops and data
    "run_grpo": "rlhf.grpo",
    "PromptRow": "rlhf.types",
    "TrainBatch": "rlhf.types",
    "Completion": "rlhf.types",
    "SamplingSpec": "rlhf.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlhf' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs only
    from rlhf.algo.advantages import grpo_advantages
    from rlhf.algo.logprobs import (entropy_from_logits, pack_sequences, packed_token_logprobs,
                                    sequence_logprobs, token_logprobs, unpack)
    from rlhf.algo.losses import aggregate_token_loss, dpo_loss, grpo_policy_loss, kl_estimate, simpo_loss
    from rlhf.algo.objectives import DPOObjective, GRPOObjective, reduce_metrics
    from rlhf.config import ConfigError, RunConfig, load_config
    from rlhf.grpo import run_grpo
    from rlhf.types import Completion, PreferenceBatch, PromptRow, SamplingSpec, TrainBatch
