"""What the memory planner plans for: GPU kinds (memory, dense bf16 peak, links) and model shapes
(from a model folder's `config.json`, or the table `KNOWN_SHAPES` for hub ids that cannot be read
offline). Numbers only: nothing here allocates or imports a model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class GpuKind:
    """A GPU as the planner sees it: memory per device and dense bf16 peak."""

    name: str
    memory_gib: float
    peak_tflops: float
    device_names: tuple[str, ...] = ()
    """Substrings of the device names (as PyTorch reports them) that are this kind."""


GPU_KINDS: dict[str, GpuKind] = {k.name: k for k in (
    GpuKind("h100-80gb", 79.2, 989.0, ("H100",)),
    GpuKind("h200-141gb", 139.8, 989.0, ("H200",)),
    GpuKind("mi300x-192gb", 191.5, 1307.0, ("MI300X",)),
    # One MI250X package is two devices to PyTorch: per device ("GPU memory" in rlhf/planner/memory.py).
    GpuKind("mi250x-128gb", 64.0, 191.5, ("MI250X", "MI250")),
    GpuKind("a100-80gb", 79.2, 312.0, ("A100",)),
)}


def gpu_kind(name: str, memory_gib: float = 0.0) -> GpuKind:
    """The kind called `name`, with `memory_gib` replacing its memory when > 0."""
    if name not in GPU_KINDS:
        raise ConfigError(f"unknown GPU kind {name!r}: known are {', '.join(GPU_KINDS)} and auto; for any "
                          f"other GPU give its memory (--gpu-memory-gib G, memory.gpu_memory_gib=G)")
    kind = GPU_KINDS[name]
    return dataclasses.replace(kind, memory_gib=memory_gib) if memory_gib > 0 else kind


def gpu_kind_of_device(device_name: str, memory_gib: float) -> GpuKind:
    """The kind of a detected device (by name), with its measured memory; an unknown device plans
    with its own memory and the H100's peak (the peak only ranks candidates of one GPU)."""
    for kind in GPU_KINDS.values():
        if any(s in device_name for s in kind.device_names):
            return dataclasses.replace(kind, memory_gib=memory_gib)
    return GpuKind(device_name, memory_gib, GPU_KINDS["h100-80gb"].peak_tflops)


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2-style decoder's shape, with HF config.json's names (so rlhf.planner.flops reads it)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """q/k/v biases (Qwen2 has them)."""
    head_dim: int = 0
    """0: hidden_size // num_attention_heads."""

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_attention_heads * self.head_size, self.num_key_value_heads * self.head_size
        attention = h * q * 2 + h * kv * 2 + ((q + 2 * kv) if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h  # + two RMSNorm weights

    def params(self) -> int:
        """Every parameter: embeddings, the head unless tied, the layers, the final norm."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * self.layer_params() \
            + self.hidden_size

    def lora_params(self, rank: int) -> int:
        """LoRA adapter parameters of rank `rank` on every linear layer of the decoder (A: r x in,
        B: out x r); other target lists are counted the same (an upper bound)."""
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_size, self.num_key_value_heads * self.head_size
        per_layer = (h + q) * 2 + (h + kv) * 2 + (h + f) * 3
        return rank * per_layer * self.num_hidden_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_size * dtype_bytes


def _qwen2(h: int, layers: int, heads: int, kv: int, f: int, vocab: int, tied: bool) -> ModelShape:
    return ModelShape(h, layers, heads, kv, f, vocab, tied, attention_bias=True)


# Shapes of hub models, for when config.json cannot be read (offline). Keys: the model's name,
# lower case, without an `-instruct` suffix.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": _qwen2(2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824, 152064, False),
    # scripts/assets/gguf_parts.py's de-quantized Qwen2.5-Coder: the GGUF keeps its output layer (untied)
    "qwen2.5-coder-0.5b": _qwen2(896, 24, 14, 2, 4864, 151936, False),
    "meta-llama-3-8b": ModelShape(4096, 32, 32, 8, 14336, 128256, False),
    "llama-3.1-8b": ModelShape(4096, 32, 32, 8, 14336, 128256, False),
    "smollm2-135m": ModelShape(576, 30, 9, 3, 1536, 49152, True),
    "smollm2-360m": ModelShape(960, 32, 15, 5, 2560, 49152, True),
    "smollm2-1.7b": ModelShape(2048, 24, 32, 32, 8192, 49152, True),
    # rlhf.data.tiny_models' random test models (vocab: the 1024-token tokenizer it builds)
    "tiny-qwen2": ModelShape(128, 2, 2, 1, 256, 1024, False, attention_bias=True),
    "tiny-llama": ModelShape(128, 2, 2, 1, 256, 1024, False, head_dim=64),
}


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """A ModelShape from a parsed HF config.json."""
    heads = config["num_attention_heads"]
    return ModelShape(
        hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        head_dim=config.get("head_dim") or 0)


def model_shape(path: str) -> ModelShape:
    """The shape of `model.path`: its config.json (a local folder, or a built-in name's cached
    folder), else the table of known hub models by name."""
    from rlhf.data.assets import model_dir  # light: no transformers import

    for folder in (Path(path).expanduser(), model_dir(path) if "/" not in path else None):
        if folder is not None and (folder / "config.json").is_file():
            return shape_from_config(json.loads((folder / "config.json").read_text()))
    name = path.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
    if name not in KNOWN_SHAPES:
        raise ConfigError(f"model.path={path!r}: no config.json to read and not a known shape "
                          f"({', '.join(KNOWN_SHAPES)}); give a local model folder")
    return KNOWN_SHAPES[name]
