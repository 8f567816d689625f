"""The Hugging Face model as the learner ranks use it: loaded in fp32 with the chosen attention
kernel and the fused log-prob head ("Attention kernel" and "Fused head" in actors/learner_base.py),
wrapped with LoRA adapters ("LoRA" there), reached through a backend's wrapper, and exported as an
HF folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlhf.algo.logprobs import EAGER_HEAD, HeadKernels, LogprobHead
from rlhf.config import LearnerConfig


def attention_kernel(cfg: LearnerConfig, device_kind: str) -> str:
    """The learner's attention implementation ("Attention kernel"): `learner.attention`, where `auto` is
    FlexAttention for packed rows on a GPU and SDPA otherwise, and `varlen` our registered
    FlashAttention varlen path (actors.learner_kernels)."""
    if cfg.attention == "varlen":
        from actors.learner_kernels import register_varlen_attention

        return register_varlen_attention()
    if cfg.attention != "auto":
        return cfg.attention
    return "flex_attention" if cfg.pack_sequences and device_kind == "cuda" else "sdpa"


def load_hf_model(model_path: str, *, gradient_checkpointing: bool, fused_head: bool,
                  attention: str = "sdpa", liger_on: str | None = None,
                  head_kernels: HeadKernels = EAGER_HEAD, keep_logits: bool = False) -> torch.nn.Module:
    """The model in fp32 (master weights; the backend casts for compute) with the `attention`
    kernel, Liger's kernels when `liger_on` names the device kind (actors.learner_kernels), its LM
    head a `LogprobHead` when `fused_head` (swapped before any sharding wrapper sees the model),
    keeping its logits for backward when `keep_logits`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attention)
    if liger_on is not None:
        from actors.learner_kernels import apply_liger

        apply_liger(model, liger_on)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if fused_head:
        model.set_output_embeddings(LogprobHead(model.get_output_embeddings(), kernels=head_kernels,
                                                keep_logits=keep_logits))
    return model


def learner_model(model_path: str, cfg: LearnerConfig, device_kind: str, *, trainable: bool
                  ) -> tuple[torch.nn.Module, list[str]]:
    """The model a learner backend shards, and its LoRA target names: loaded with the configured
    kernels, LoRA adapters on a trainable one (`wrap_lora`), then each decoder layer compiled
    (`learner.compile`), all before any sharding wrapper sees it."""
    if cfg.head_kernels == "fused":
        from actors.learner_kernels import fused_head_kernels

        head_kernels = fused_head_kernels(device_kind)
    else:
        head_kernels = EAGER_HEAD
    model = load_hf_model(model_path, gradient_checkpointing=trainable and cfg.gradient_checkpointing,
                          fused_head=cfg.fused_head, attention=attention_kernel(cfg, device_kind),
                          liger_on=device_kind if cfg.liger else None, head_kernels=head_kernels,
                          keep_logits=cfg.head_keep_logits)
    layers, targets = decoder_layers(model), []
    if trainable and cfg.lora_rank > 0:
        model, targets = wrap_lora(model, cfg)
    if cfg.compile:
        from actors.learner_kernels import compile_layers

        compile_layers(layers)
    return model, targets


def wrap_lora(model: torch.nn.Module, cfg: LearnerConfig) -> tuple[torch.nn.Module, list[str]]:
    """The model with LoRA adapters on `learner.lora_target_modules` (rlhf.lora) and the resolved
    target leaf names. PEFT freezes every base parameter; only lora_A/lora_B train. B starts at 0,
    so the wrapped model computes exactly the base model until the first update."""
    from peft import LoraConfig, get_peft_model

    from rlhf.lora import target_modules

    targets = target_modules(cfg, model)
    if cfg.gradient_checkpointing:  # frozen embeddings: checkpointed layers need an input that requires grad
        model.enable_input_require_grads()
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets, bias="none")
    return get_peft_model(model, config), targets


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM, under a PEFT wrapper or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """A learner's model without DeepSpeed's engine around it (the engine holds it in `.module`)."""
    return getattr(model, "module", model)


def output_head(model: torch.nn.Module) -> LogprobHead:
    """The LogprobHead of a learner's model."""
    return unwrapped(model).get_output_embeddings()


def export_hf(state: dict[str, torch.Tensor], model_path: str, out: Path) -> None:
    """An HF folder: the source model's config/tokenizer files plus `state` as safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    tensors = {k: v.contiguous() for k, v in state.items()}
    # Tied embeddings share storage; safetensors refuses aliases, and HF re-ties on load.
    seen: dict[int, str] = {}
    for k in list(tensors):
        ptr = state[k].data_ptr()
        if ptr in seen:
            del tensors[k]
        seen[ptr] = k
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
