"""Task data read out of pinned packages: the Game-of-24 puzzles and BIG-bench's hhh_alignment pairs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlhf.data.assets import cache_dir, data_file, is_fetched
from scripts.assets.packages import (AssetError, PackageMember, extract_member, fetch_member, one_at_a_time,
                                     pip_download)

GAME24 = PackageMember("tree-of-thoughts-llm==0.1.0", "tot/data/24/24.csv")
# A 358 MB sdist (the whole benchmark); four small JSON files of it are kept.
HHH_SUBSETS = ("harmless", "helpful", "honest", "other")
HHH_ALIGNMENT = [PackageMember("bigbench==1.0.0", f"bigbench/benchmark_tasks/hhh_alignment/{s}/task.json",
                               sdist=True) for s in HHH_SUBSETS]


@one_at_a_time
def fetch_game24(force: bool = False) -> Path:
    """The 1,362 Game-of-24 puzzles of Tree of Thoughts as `data/game24.csv`."""
    final = data_file("game24.csv")
    if is_fetched(final) and not force:
        return final
    tmp = fetch_member(GAME24, final.with_name(".game24.csv.tmp"))
    header = tmp.read_text().splitlines()[0]
    if not header.startswith("Rank,Puzzles"):
        raise AssetError(f"{GAME24.member} has an unexpected header {header!r}")
    tmp.replace(final)
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


@one_at_a_time
def fetch_hhh_alignment(force: bool = False) -> Path:
    """BIG-bench's 221 helpful/honest/harmless preference pairs as `data/hhh_alignment.jsonl`, read
    out of the `bigbench` source package without building or installing it."""
    final = data_file("hhh_alignment.jsonl")
    if is_fetched(final) and not force:
        return final
    downloads = cache_dir() / "downloads"
    rows: list[dict[str, str]] = []
    try:
        archive = pip_download(HHH_ALIGNMENT[0], downloads)
        for subset, member in zip(HHH_SUBSETS, HHH_ALIGNMENT):
            task_json = extract_member(archive, member, downloads / f"{subset}.json")
            rows += hhh_pairs(json.loads(task_json.read_text()), subset)
    finally:
        shutil.rmtree(downloads, ignore_errors=True)
    tmp = final.with_name(".hhh_alignment.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(final)
    return final
