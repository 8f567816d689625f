"""Tiny random-weight models with a locally trained tokenizer: real architectures, no download.

`build_tiny_model("tiny-qwen2", out_dir)` writes an HF folder (config, safetensors, tokenizer with a
ChatML chat template, generation config) that transformers and vLLM both load. Tests and the CI
recipe use it; it takes about a second and is cached under `.cache/rlhf/models/<name>/`.

The shapes are chosen for the CPU kernels: head_dim 64 (vLLM's CPU attention supports it),
two layers, a ~1k-token byte-level BPE vocabulary so any text round-trips.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TINY_MODELS = ("tiny-qwen2", "tiny-llama")
_VERSION = "1"  # bump to rebuild cached tiny models after a change here

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Arithmetic and short English lines: enough for BPE merges that look like a real vocabulary."""
    rng = random.Random(seed)
    words = ("the answer is what how many apples does she have left total each number use "
             "think step first then add subtract multiply divide equals result question solve "
             "system user assistant you are a helpful math tutor please give final").split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        lines.append(f"What is {a} {op} {b}? The answer is {a + b}.")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + ".")
    lines.append("<think> </think> <answer> </answer> #### \\boxed{} ( ) = , : ; ! ' \" \n")
    return lines


def build_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """A byte-level BPE tokenizer trained on `_corpus`, with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def _model_config(name: str, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    if name == "tiny-qwen2":
        return Qwen2Config(**shape)
    if name == "tiny-llama":
        return LlamaConfig(**shape, head_dim=64)
    raise ValueError(f"unknown tiny model '{name}' (known: {', '.join(TINY_MODELS)})")


def build_tiny_model(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a random-weight `name` model plus tokenizer to `out_dir` (reused if already built)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    stamp = out / "rlhf_tiny.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"name": name, "seed": seed, "version": _VERSION}:
        return out
    tokenizer = build_tokenizer(seed=seed)
    config = _model_config(name, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # built on first use, e.g. inside a run: no "Writing model shards" bar
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    stamp.write_text(json.dumps({"name": name, "seed": seed, "version": _VERSION}))
    return out


def build_tiny_reward_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a random-weight tiny Qwen2 sequence classifier with one output (a reward model,
    rlhf.reward_model) plus the tiny tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_tokenizer(seed=seed)
    config = _model_config("tiny-qwen2", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
