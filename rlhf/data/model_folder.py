"""What a model folder must hold, and what its config allows, checked before Ray starts: a folder
with a config.json but no weights or no tokenizer, or prompts and completions longer than the
model's positions, is one line naming what is missing or too long (not a library's traceback from
inside an engine or a learner minutes later).

A path that is not a local folder (a hub id such as `Qwen/Qwen2.5-0.5B`) is left to transformers
and vLLM to resolve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf.config import ConfigError, RunConfig

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")
"""The weight files transformers and vLLM load (an index names its shards)."""
TOKENIZERS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
"""Each a complete set of tokenizer files (fast tokenizer; sentencepiece; BPE vocab + merges; WordPiece)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
SCALED_ROPE = ("linear", "dynamic", "yarn")
"""RoPE scalings that stretch the positions by `factor` (vLLM's max_model_len counts them so)."""


def model_config(path: str | Path) -> dict[str, Any] | None:
    """`<path>/config.json` (its text model's part, for multimodal configs); None without a local
    folder. An unreadable one is a ConfigError naming the file and line."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    config = read_json_object(file)
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def read_json_object(file: Path, key: str | None = None) -> dict[str, Any]:
    """The JSON object in `file`; a ConfigError naming the file (and its line, and the config `key`
    that named it) when it is unreadable, not JSON, or not an object."""
    named = f"; {key}" if key else ""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}:{e.lineno}: invalid JSON ({e.msg}{named})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is unreadable ({type(e).__name__}: {e}{named})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, not a {type(data).__name__}{named}")
    return data


def check_model_files(path: str, key: str = "model.path") -> None:
    """A local model folder holds a valid config.json, weights (every shard its index names) and a
    tokenizer; otherwise one ConfigError line naming what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        return
    model_config(folder)
    missing = []
    present = [name for name in WEIGHTS if (folder / name).is_file()]
    if not present and not list(folder.glob("*.safetensors")):
        missing.append(f"weights ({', '.join(WEIGHTS)})")
    for index in (name for name in present if name.endswith(".index.json")):
        shards = _index_shards(folder / index)
        lost = [s for s in shards if not (folder / s).is_file()]
        if lost:
            missing.append(f"{len(lost)} of the {len(shards)} weight shards {index} names ({lost[0]}, ...)")
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZERS):
        missing.append("tokenizer files (" + ", ".join(" + ".join(files) for files in TOKENIZERS) + ")")
    if missing:
        raise ConfigError(f"{key}={path!r} has a config.json but no {' and no '.join(missing)}: not a "
                          f"complete Hugging Face model folder (save_pretrained writes the model and its "
                          f"tokenizer)", key=key)


def _index_shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{index} is not a weight index (no weight_map)") from None
    return sorted(set(weight_map.values()))


def model_positions(path: str | Path) -> int | None:
    """The longest sequence the model's config allows (RoPE scaling included), or None if unknown."""
    config = model_config(path) or {}
    base = next((config[k] for k in POSITION_KEYS if isinstance(config.get(k), int)), None)
    rope = config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if base is not None and kind in SCALED_ROPE and isinstance(rope.get("factor"), (int, float)):
        return int(base * rope["factor"])
    return base


def check_context(cfg: RunConfig, path: str, longest_prompt: int | None = None) -> None:
    """The longest sequence a run makes fits the model's positions: GRPO, data.max_prompt_tokens
    (prompts above it are dropped) plus the longest completion (generation's or evaluation's
    max_new_tokens); DPO, dpo.max_length. Otherwise one ConfigError line with the numbers."""
    positions = model_positions(path)
    if positions is None:
        return
    where = f"the {positions} positions of model.path={cfg.model.path!r} (config.json)"
    if cfg.algorithm == "dpo":
        if cfg.dpo.max_length > positions:
            raise ConfigError(f"dpo.max_length={cfg.dpo.max_length} is more than {where}; lower it to at "
                              f"most {positions}", key="dpo.max_length")
        return
    new, key = cfg.generation.max_new_tokens, "generation.max_new_tokens"
    if cfg.eval.max_new_tokens > new:
        new, key = cfg.eval.max_new_tokens, "eval.max_new_tokens"
    prompt = cfg.data.max_prompt_tokens
    if prompt + new <= positions:
        return
    longest = f" (the longest prompt here has {longest_prompt} tokens)" if longest_prompt else ""
    fixes = ([f"data.max_prompt_tokens to at most {positions - new}"] if new < positions else []) + \
            ([f"{key} to at most {positions - prompt}"] if prompt < positions else [])
    raise ConfigError(f"data.max_prompt_tokens={prompt} + {key}={new} = {prompt + new} tokens is more than "
                      f"{where}{longest}: lower {' or '.join(fixes) or 'both'}", key=key)
