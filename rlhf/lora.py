"""LoRA (`learner.lora_rank > 0`): which modules get adapters, the checks made before start-up,
and the two ways the learner's weights leave it (merged into the base weights, or the adapter alone).

Pure helpers: no PEFT, Ray or vLLM here (the learners wrap their model with PEFT in
actors/learner_base.py; the engine serves an adapter in actors/vllm_generator.py).

Decisions:
- Target modules: resolved here, once, into leaf names (`q_proj`, `down_proj`, ...) against the
  model's own module tree (built on the meta device from config.json: no weights read), and PEFT
  gets that explicit list. `all-linear` is every `nn.Linear` inside the decoder layers, so never
  the LM head (which the learners replace by a `LogprobHead` that PEFT must not see as linear).
- Names: PEFT calls a base weight `base_model.model.<hf name with .base_layer>` and the adapter
  `...<module>.lora_A.<adapter>.weight`. `merged_weights` turns a stream of those into the plain HF
  names with W + (alpha / r) * B @ A, so a merged push is an ordinary full-weight push;
  `adapter_weights` keeps only A and B under PEFT's file names (`...lora_A.weight`), what
  `adapter_model.safetensors` holds and vLLM loads.
- Adapter config: the one written next to the tensors is the minimal PEFT LoraConfig (r, alpha,
  targets, no bias, no rsLoRA/DoRA): `PeftModel.from_pretrained` and vLLM both read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf.config import ConfigError, LearnerConfig, RunConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"  # PEFT's name for the one adapter a model gets


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """Qualified names of the nn.Linear modules inside the decoder layers (`...layers.<i>....`)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in name]


def resolve_target_modules(requested: Iterable[str], linear_names: list[str]) -> list[str]:
    """The sorted leaf names PEFT should wrap ("Target modules"). `requested` entries are leaf names or
    dotted suffixes of module names, or `all-linear`. Raises ConfigError (one line) for an entry
    that matches no linear module of the decoder."""
    requested = list(requested)
    if "all-linear" in requested:
        return sorted({n.rsplit(".", 1)[-1] for n in linear_names})
    leaves: set[str] = set()
    for target in requested:
        hits = [n for n in linear_names if n == target or n.endswith("." + target)]
        if not hits:
            known = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
            raise ConfigError(f"learner.lora_target_modules: {target!r} matches no linear layer of the "
                              f"decoder (its linear layers: {', '.join(known)})")
        leaves.update(h.rsplit(".", 1)[-1] for h in hits)
    return sorted(leaves)


def meta_model(model_path: str | Path) -> torch.nn.Module:
    """The model's module tree on the meta device, from config.json alone (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def target_modules(cfg: LearnerConfig, model: torch.nn.Module) -> list[str]:
    """`learner.lora_target_modules` resolved against `model` ("Target modules")."""
    return resolve_target_modules(cfg.lora_target_modules, decoder_linear_names(model))


def check_lora(cfg: RunConfig, model_path: str | Path) -> None:
    """Pre-start-up checks of a LoRA run (no-op without LoRA); each failure is a ConfigError of one
    line: a target module that matches nothing, or `lora_sync: adapter` with a generator that cannot
    serve adapters (the HF generator; vLLM's own architecture check is
    `actors.vllm_lora.settle_lora_sync`). The rank's range is the config's own check."""
    lc = cfg.learner
    if lc.lora_rank <= 0:
        return
    target_modules(lc, meta_model(model_path))
    if cfg.algorithm == "grpo" and lc.lora_sync == "adapter" and cfg.generation.backend != "vllm":
        raise ConfigError(f"learner.lora_sync=adapter needs generation.backend=vllm (got "
                          f"{cfg.generation.backend!r}); use learner.lora_sync=merged")


def serves_adapters(cfg: RunConfig) -> bool:
    """Whether weight pushes carry LoRA adapters to engines serving them (`lora_sync: adapter`)."""
    return cfg.learner.lora_rank > 0 and cfg.learner.lora_sync == "adapter"


def lora_scale(cfg: LearnerConfig) -> float:
    """The factor of B @ A in the adapted weight: alpha / r."""
    return cfg.lora_alpha / cfg.lora_rank


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_file_name(name: str) -> str:
    """A PEFT parameter name as `adapter_model.safetensors` stores it (the adapter name dropped)."""
    for kind in ("A", "B"):
        name = name.replace(f".lora_{kind}.{ADAPTER_NAME}.", f".lora_{kind}.")
    return name


def hf_name(peft_name: str) -> str:
    """The plain HF name of a PEFT-wrapped base parameter ("Names")."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_weights(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The adapter tensors of a PEFT parameter stream, under their file names ("Names")."""
    for name, t in named:
        if is_adapter_name(name):
            yield adapter_file_name(name), t


def merged_weights(named: Iterable[tuple[str, torch.Tensor | None]], scale: float
                   ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """HF-named full weights of a PEFT parameter stream, each LoRA layer's weight merged:
    W + scale * B @ A (in fp32, cast back to W's dtype). Tensors may be None (a rank that does not
    keep them); the names are the same either way. Buffers one layer's W and A until its B arrives
    (PEFT registers base_layer, then lora_A, then lora_B)."""
    pending: dict[str, dict[str, torch.Tensor | None]] = {}
    for name, t in named:
        if is_adapter_name(name):
            kind = "A" if ".lora_A." in name else "B"
            module = name.split(f".lora_{kind}.")[0]
            parts = pending.setdefault(module, {})
            parts[kind] = t
            if kind == "B":
                base, a = parts.pop("W"), parts.pop("A")
                del pending[module]
                if base is not None:
                    base = (base.float() + scale * (t.float() @ a.float())).to(base.dtype)
                yield hf_name(module + ".weight"), base
        elif name.endswith(".base_layer.weight"):
            pending.setdefault(name.removesuffix(".base_layer.weight"), {})["W"] = t
        else:
            yield hf_name(name), t
    if pending:
        raise RuntimeError(f"LoRA layers without their lora_B weight: {sorted(pending)[:3]}")


def adapter_config(cfg: LearnerConfig, targets: list[str], base_model: str = "") -> dict[str, Any]:
    """The `adapter_config.json` of the adapter ("Adapter config")."""
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "task_type": None,
    }


def save_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: Path) -> None:
    """Write a PEFT adapter folder: `adapter_model.safetensors` + `adapter_config.json`."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
