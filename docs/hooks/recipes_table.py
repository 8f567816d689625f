"""The recipes page's tables, read from `configs/*.yaml` at every docs build.

Each recipe is read as a run reads it (`rlhf.config_loading.read_recipe`: a `base: other.yaml`
supplies the keys the recipe leaves out). The GPU count comes from the file name (`_cpu`, `_4gpu`)
where it says, else from the layout (colocated: one GPU per learner rank; split: the engines' GPUs
plus the learners').
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference import config_defaults
from rlhf.config_loading import read_recipe

GPU_COUNTS = (1, 2, 4, 8)
"""Sections the page always has, so links to them hold before a recipe of that size exists."""


@dataclass(frozen=True)
class Recipe:
    """What the table says of one recipe file."""

    path: str
    algorithm: str
    task: str
    model: str
    gpus: int | None  # None: CPU
    layout: str
    notes: str


@dataclass(frozen=True)
class Settings:
    """A recipe's keys over the config's defaults, looked up by dotted key (`learner.num_ranks`)."""

    data: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return self.defaults[key]
            node = node[part]
        return node


def gpu_count(stem: str, s: Settings) -> int | None:
    """GPUs the recipe is written for; None for a CPU recipe. Without a count in the name, a split
    layout with `generator_engines: auto` counts one engine (its node may give it more)."""
    if re.search(r"(^|_)cpu(_|$)", stem):
        return None
    named = re.search(r"(\d+)gpu", stem)
    if named:
        return int(named[1])
    if s["cluster.placement"] != "split":
        return int(s["learner.num_ranks"])
    engines = s["cluster.generator_engines"] if isinstance(s["cluster.generator_engines"], int) else 1
    return engines * int(s["cluster.generator_tp"]) + int(s["learner.num_ranks"])


def layout(s: Settings) -> str:
    """Placement and learner backend in a few words: `split, 7 FSDP2 ranks`, `colocated, 2 ZeRO-3 ranks`."""
    ranks, backend = int(s["learner.num_ranks"]), s["learner.backend"].upper()
    if backend == "DEEPSPEED":
        backend = f"ZeRO-{s['learner.zero_stage']}"
    learners = f"{ranks} {backend} rank{'s' if ranks > 1 else ''}"
    return learners if s["algorithm"] == "dpo" else f"{s['cluster.placement']}, {learners}"


def notes(s: Settings) -> str:
    """The recipe's switches a reader chooses it for."""
    marks = {
        "LoRA": s["learner.lora_rank"],
        "async": s["grpo.max_staleness"],
        "planned": s["memory.plan"] == "auto",
        "dynamic sampling": s["grpo.dynamic_sampling"],
        "tools": s["env.tools"] or s["env.environment"],
        "several nodes": s["cluster.placement_strategy"] != "PACK",
    }
    return ", ".join(name for name, on in marks.items() if on)


def recipe(path: Path, root: Path, defaults: Mapping[str, Any]) -> Recipe:
    """One recipe's row: its keys over the config's defaults."""
    s = Settings(read_recipe(path)[0], defaults)
    task = s["dpo.dataset"] if s["algorithm"] == "dpo" else s["data.task"]
    return Recipe(path.relative_to(root).as_posix(), s["algorithm"], str(task), str(s["model.path"]),
                  gpu_count(path.stem, s), layout(s), notes(s))


def recipes(root: Path) -> list[Recipe]:
    """Every recipe in `root/configs`, in order of task, model and file name."""
    defaults = config_defaults(root / "rlhf" / "config.py")
    found = [recipe(p, root, defaults) for p in sorted((root / "configs").glob("*.yaml"))]
    return sorted(found, key=lambda r: (r.task, r.model, r.path))


def table(rows: list[Recipe]) -> list[str]:
    out = ["| recipe | algorithm | task | model | layout | also |", "|---|---|---|---|---|---|"]
    out += [f"| `{r.path}` | {r.algorithm} | `{r.task}` | `{r.model}` | {r.layout} | {r.notes or '-'} |"
            for r in rows]
    return out


def recipes_page(root: Path) -> str:
    """Markdown: one section per device size (CPU, then 1, 2, 4, 8 GPUs and any other count)."""
    rows = recipes(root)
    sizes = sorted({r.gpus for r in rows if r.gpus is not None} | set(GPU_COUNTS))
    out = []
    for size in [None, *sizes]:
        title = "CPU" if size is None else f"{size} GPU{'s' if size > 1 else ''}"
        chosen = [r for r in rows if r.gpus == size]
        out += [f"### {title}", ""]
        out += table(chosen) if chosen else ["No recipe of this size yet: see [the layouts](scaling.md) "
                                             "for the overrides that run a recipe on this many GPUs."]
        out.append("")
    return "\n".join(out)
