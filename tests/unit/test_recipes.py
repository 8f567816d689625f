"""Recipes: `base:` includes (one level, the recipe's keys over the base's, overrides last), every
shipped recipe and base loads, no recipe restates its base, and every GPU recipe fits an H100 and
an H200 with its own GPU count as the memory planner sees it (CPU only: arithmetic on shapes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf.config import ConfigError, explicit_keys, load_config
from rlhf.planner.memory import PLAN_KEYS, applied, engines, make_plan, no_fit_message
from rlhf.planner.shapes import gpu_kind, model_shape
from rlhf.rules import run_gpus

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))
BASES = sorted((CONFIGS / "base").glob("*.yaml"))
GPU_RECIPES = [p for p in RECIPES if re.search(r"_\d+gpu", p.name)]
PLANNED_FOR = ("h100-80gb", "h200-141gb")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every non-section value (a list is one value, as a recipe replaces it)."""
    if not isinstance(data, dict):
        return {prefix: data}
    return {k: v for name, child in data.items()
            for k, v in _leaves(child, f"{prefix}.{name}" if prefix else str(name)).items()}


def _one_line_error(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------------------------------------
# `base:` on hand-written recipes

BASE = """\
grpo:
  steps: 3
  group_size: 4
learner:
  lr: 1.0e-5
  num_ranks: 2
reward:
  functions:
    - function: rewards.answers:exact_answer
    - function: rewards.format:think_answer_format
"""


def test_a_recipe_is_its_base_with_its_keys_merged_over_it_then_the_overrides(tmp_path: Path):
    _write(tmp_path / "base.yaml", BASE)
    recipe = _write(tmp_path / "recipe.yaml",
                    "base: base.yaml\ngrpo:\n  group_size: 8\nlearner:\n  lr: 2.0e-5\n")
    cfg = load_config(recipe)
    assert (cfg.grpo.steps, cfg.grpo.group_size) == (3, 8)  # a section is merged key by key
    assert (cfg.learner.lr, cfg.learner.num_ranks) == (2e-5, 2)
    assert len(cfg.reward.functions) == 2
    cfg = load_config(recipe, ["grpo.steps=9", "grpo.group_size=6"])
    assert (cfg.grpo.steps, cfg.grpo.group_size) == (9, 6)


def test_a_list_or_a_value_replaces_the_bases_whole(tmp_path: Path):
    _write(tmp_path / "base.yaml", BASE)
    recipe = _write(tmp_path / "recipe.yaml",
                    "base: base.yaml\nreward:\n  functions:\n    - function: rewards.tasks:countdown\n")
    assert [f.function for f in load_config(recipe).reward.functions] == ["rewards.tasks:countdown"]


def test_the_base_is_found_from_the_recipes_folder_not_the_working_one(tmp_path: Path, monkeypatch):
    _write(tmp_path / "shared" / "task.yaml", BASE)
    recipe = _write(tmp_path / "runs" / "recipe.yaml", "base: ../shared/task.yaml\n")
    monkeypatch.chdir(tmp_path / "shared")
    assert load_config(recipe).grpo.steps == 3


def test_the_keys_a_base_sets_are_explicit_so_memory_plan_keeps_them(tmp_path: Path):
    _write(tmp_path / "base.yaml", BASE)
    recipe = _write(tmp_path / "recipe.yaml", "base: base.yaml\nmemory:\n  plan: auto\n")
    keys = explicit_keys(recipe, ["learner.micro_batch_size=4"])
    assert {"grpo.steps", "learner.num_ranks", "memory.plan", "learner.micro_batch_size"} <= keys
    assert "base" not in keys


def test_a_base_with_a_base_of_its_own_is_refused_naming_both_files(tmp_path: Path):
    _write(tmp_path / "root.yaml", BASE)
    middle = _write(tmp_path / "middle.yaml", "base: root.yaml\n")
    recipe = _write(tmp_path / "recipe.yaml", "# a variant\nbase: middle.yaml\n")
    message = _one_line_error(recipe)
    assert message.startswith(f"{recipe}:2: its base {middle} has a base of its own ('root.yaml')"), message
    assert "one level only" in message
    itself = _write(tmp_path / "itself.yaml", "base: itself.yaml\n")
    assert "has a base of its own" in _one_line_error(itself)


@pytest.mark.parametrize("value, message", [
    ("missing.yaml", "its base {folder}/missing.yaml does not exist (base: missing.yaml"),
    ("3", "base=3 must name a YAML file"),
    ("''", "base='' must name a YAML file"),
])
def test_a_base_that_is_not_a_file_is_refused_at_its_line(tmp_path: Path, value: str, message: str):
    recipe = _write(tmp_path / "recipe.yaml", f"grpo:\n  steps: 2\nbase: {value}\n")
    assert _one_line_error(recipe).startswith(f"{recipe}:3: " + message.format(folder=tmp_path))


def test_an_error_in_a_key_of_the_base_names_the_recipes_base_line(tmp_path: Path):
    _write(tmp_path / "base.yaml", "grpo:\n  gropu_size: 4\nlearner:\n  lr: 1.0e-5\n")
    recipe = _write(tmp_path / "recipe.yaml", "algorithm: grpo\nbase: base.yaml\nlearner:\n  lr: fast\n")
    assert _one_line_error(recipe).startswith(f"{recipe}:2: unknown key 'grpo.gropu_size'")
    _write(tmp_path / "base.yaml", "learner:\n  lr: -1\n")
    assert _one_line_error(recipe).startswith(f"{recipe}:4: learner.lr='fast' has the wrong type")
    _write(tmp_path / "recipe.yaml", "algorithm: grpo\nbase: base.yaml\n")
    assert _one_line_error(recipe).startswith(f"{recipe}:2: learner.lr=-1.0 is not allowed")
    assert not _one_line_error(recipe, ["learner.lr=-2"]).startswith(str(recipe))  # the override's value


def test_a_broken_base_file_is_named_with_its_own_line(tmp_path: Path):
    base = _write(tmp_path / "base.yaml", "grpo:\n  steps: 3\n  steps: 4\n")
    recipe = _write(tmp_path / "recipe.yaml", "base: base.yaml\n")
    assert _one_line_error(recipe).startswith(f"{base}:3: 'grpo.steps' is set twice")
    _write(tmp_path / "base.yaml", "- 1\n")
    assert "must hold a mapping" in _one_line_error(recipe)


def test_base_is_no_config_key_an_override_can_set():
    assert _one_line_error(None, ["base=other.yaml"]).startswith("unknown key 'base'")


# ---------------------------------------------------------------------------------------------
# The shipped recipes

@pytest.mark.parametrize("path", RECIPES + BASES, ids=[str(p.relative_to(CONFIGS)) for p in RECIPES + BASES])
def test_every_recipe_and_base_loads(path: Path):
    assert load_config(path).algorithm in ("grpo", "dpo")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_names_its_hardware_and_a_gpu_recipe_starts_from_a_shared_base(recipe: Path):
    assert recipe.stem.endswith("_cpu") or recipe in GPU_RECIPES, f"{recipe.name}: _cpu or _<N>gpu"
    if recipe in GPU_RECIPES:
        base = str(yaml.safe_load(recipe.read_text()).get("base", ""))
        assert base.startswith("base/"), f"{recipe.name}: a GPU recipe starts from one of configs/base/"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_no_recipe_restates_a_value_of_its_base(recipe: Path):
    own = yaml.safe_load(recipe.read_text())
    if "base" not in own:
        return
    inherited = _leaves(yaml.safe_load((recipe.parent / own.pop("base")).read_text()))
    restated = sorted(k for k, v in _leaves(own).items() if k in inherited and inherited[k] == v)
    assert not restated, f"{recipe.name} restates its base's values: {', '.join(restated)}"


@pytest.mark.parametrize("base", BASES, ids=[p.name for p in BASES])
def test_a_shared_base_leaves_every_memory_key_to_its_recipes(base: Path):
    """A recipe cannot unset what its base sets, and `memory.plan: auto` keeps every key that is set:
    a memory key in a shared base would take that choice from every recipe built on it."""
    pinned = sorted(set(_leaves(yaml.safe_load(base.read_text()))) & set(PLAN_KEYS))
    assert not pinned, f"base/{base.name} sets memory keys: {', '.join(pinned)}"


@pytest.mark.parametrize("kind", PLANNED_FOR)
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[p.name for p in GPU_RECIPES])
def test_every_gpu_recipe_fits_its_gpus_as_planned(recipe: Path, kind: str):
    """As the run starts: with `memory.plan: auto` the plan keeps the keys the recipe sets and
    chooses the rest; without it the recipe runs as written, every memory key as it reads."""
    gpus = int(re.search(r"_(\d+)gpu", recipe.name).group(1))
    cfg = load_config(recipe)
    assert run_gpus(cfg, engines(cfg)) == gpus, f"{recipe.name} takes {run_gpus(cfg, engines(cfg))} GPUs"
    pinned = explicit_keys(recipe) if cfg.memory.plan == "auto" else set(PLAN_KEYS)
    gpu, shape = gpu_kind(kind), model_shape(cfg.model.path)
    plan = make_plan(cfg, shape, gpu, pinned, gpus)
    why = "" if plan.best else no_fit_message(cfg, shape, gpu, plan, pinned, gpus)
    assert plan.best is not None, f"{recipe.name} on {gpus} x {kind}: {why}"
    need = plan.best.breakdown.need
    assert need <= gpu.memory_gib, f"{recipe.name} on {kind}: needs {need:.1f} of {gpu.memory_gib:g} GiB"
    planned = applied(cfg, plan)
    assert run_gpus(planned, engines(planned)) == gpus
