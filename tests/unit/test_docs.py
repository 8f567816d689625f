"""The written layer: the docs site builds with warnings and broken links as errors, its generated
pages hold what the code holds, the README stays a front door, and what the pages cite exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "docs" / "hooks"
PRODUCT = ("rlhf", "actors", "rewards", "scripts")
DOCS = sorted((ROOT / "docs").rglob("*.md"))
WRITTEN = [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "benchmarks" / "README.md", *DOCS]
"""Every Markdown file a reader meets: the README, the two files the site includes, the pages."""

sys.path.insert(0, str(HOOKS))
import generated  # noqa: E402  (the hook and its modules live in docs/hooks, outside any package)
import recipes_table  # noqa: E402
import reference  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it: `mkdocs build --strict` with this venv's mkdocs."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2: not a build warning
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags dropped."""
    return re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text())


def test_the_site_builds_strict_with_every_page_in_the_nav(site):
    for doc in DOCS:
        page = doc.relative_to(ROOT / "docs").with_suffix("")
        built = site / page.parent / "index.html" if page.name == "index" else site / page / "index.html"
        assert built.is_file(), f"{doc} was not built"


def test_the_config_reference_names_every_key(site):
    from rlhf.config import config_keys

    text = page_text(site, "config")
    assert [k for k in config_keys() if k not in text] == []
    assert "<!-- generated" not in (site / "config" / "index.html").read_text()


def test_the_recipes_page_lists_every_recipe(site):
    text = page_text(site, "recipes")
    recipes = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.yaml"))
    assert [r for r in recipes if r not in text] == []
    assert all(f"{n} GPUs" in text for n in (2, 4, 8)), "the sections the README and index link to"


def test_the_reliability_page_holds_every_promise(site):
    text = page_text(site, "reliability")
    lines = (ROOT / "RELIABILITY.md").read_text().splitlines()
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings and [h for h in headings if h.split(":")[0] not in text] == []


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    text = "\n".join(lines)
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text), "commit hashes belong in docs/"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated measurements belong in docs/results.md"
    for command in ("bash scripts/quickstart.sh", "bash scripts/test.sh", "rlhf train", "rlhf submit"):
        assert command in text


def test_the_readme_test_command_is_what_ci_runs():
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_architecture_page_names_every_module_and_folder():
    page = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for d in PRODUCT for p in (ROOT / d).rglob("*") if p.suffix in {".py", ".sh"}
               and p.name != "__init__.py"]
    assert sorted(str(p.relative_to(ROOT)) for p in modules if f"`{p.relative_to(ROOT)}`" not in page) == []
    folders = {p.parent.name for d in PRODUCT for p in (ROOT / d).glob("*/__init__.py")}
    tree = [line for line in page.splitlines() if line.startswith("  ") and "/" in line]
    listed = {line.split()[0].rstrip("/") for line in tree}
    assert folders - listed == set()


def test_the_docs_name_tests_that_exist():
    """Every `tests/x.py::test_y` (or `x.py::test_y`, or `::test_y` after a file named earlier in the
    same document) names a test defined in that file, wherever under tests/ the file now lives."""
    tests = {p.name: p for p in sorted((ROOT / "tests").rglob("test_*.py"))}
    missing = []
    for doc in WRITTEN:
        current = None
        for m in re.finditer(r"([\w/]+\.py)?::(test_\w+)", doc.read_text()):
            current = tests.get(Path(m[1]).name) if m[1] else current
            if current is None or not re.search(rf"def {m[2]}\b", current.read_text()):
                missing.append(f"{doc.relative_to(ROOT)}: {m[1] or '::'}{m[2]}")
    assert missing == []


def test_the_docs_name_recipes_and_images_that_exist():
    """Every `configs/x.yaml` (one followed by `:line` quotes an error message, not a recipe), every
    recipe in the README's table (named there without `configs/`) and every image a page shows."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    missing = [f"README.md: {name}" for name in re.findall(r"`([\w.-]+\.yaml)`", "\n".join(rows))
               if not (ROOT / "configs" / name).is_file()]
    for doc in WRITTEN:
        text = doc.read_text()
        named = re.findall(r"\bconfigs/[\w.-]+\.yaml(?!:\d)", text)
        missing += [f"{doc.relative_to(ROOT)}: {name}" for name in named if not (ROOT / name).is_file()]
        for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
            if not (doc.parent / image).is_file():
                missing.append(f"{doc.relative_to(ROOT)}: {image}")
    assert missing == []


def test_the_readme_reward_example_loads_and_scores(tmp_path):
    from rewards.api import load_reward_fn

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# my_rewards\.py\n.*?)```", readme, re.DOTALL)[1]
    (tmp_path / "my_rewards.py").write_text(code)
    reward = load_reward_fn(f"{tmp_path / 'my_rewards.py'}:ends_with_answer")
    assert reward("Calculate 3 + 5.", "Let me add.\n8", answer="8") == 1.0
    assert reward("Calculate 3 + 5.", "9", answer="8") == 0.0
    assert reward("Say hi.", "hi", answer=None) is None


def test_config_sections_follow_nested_dataclasses(tmp_path):
    source = tmp_path / "config.py"
    source.write_text('''
from dataclasses import dataclass, field
from typing import Literal

@dataclass(frozen=True, kw_only=True)
class Term:
    weight: float = 1.0
    """How much it counts | in the sum."""

@dataclass(frozen=True, kw_only=True)
class Inner:
    mode: Literal["a", "b"] = "a"
    terms: tuple[Term, ...] = (Term(),)

@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run."""
    names: tuple[str, ...] = ("x",)
    inner: Inner = field(default_factory=Inner)
''')
    sections = reference.config_sections(source)
    assert [(s.prefix, s.cls) for s in sections] == [
        ("", "RunConfig"), ("inner.", "Inner"), ("inner.terms[].", "Term")]
    assert [(f.name, f.type, f.default) for f in sections[1].fields] == [
        ("mode", "a | b", "a"), ("terms", "tuple[Term, ...]", "(Term(),)")]
    assert reference.config_defaults(source) == {
        "names": ["x"], "inner.mode": "a", "inner.terms": "(Term(),)", "inner.terms[].weight": 1.0}
    assert "| `inner.terms[].weight` | `float` | `1.0` | How much it counts \\| in the sum. |" in (
        reference.config_reference(source))


def test_a_recipe_row_reads_its_base(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "grpo_gsm8k_1gpu.yaml").write_text(
        "model:\n  path: Qwen/Qwen2.5-1.5B-Instruct\ndata:\n  task: gsm8k\ngrpo:\n  max_staleness: 1\n")
    variant = tmp_path / "configs" / "grpo_gsm8k_split.yaml"
    variant.write_text("base: grpo_gsm8k_1gpu.yaml\nlearner:\n  num_ranks: 3\n  backend: deepspeed\n"
                       "cluster:\n  placement: split\n  generator_engines: 1\n")
    defaults = reference.config_defaults(ROOT / "rlhf" / "config.py")
    row = recipes_table.recipe(variant, tmp_path, defaults)
    assert (row.task, row.model, row.gpus) == ("gsm8k", "Qwen/Qwen2.5-1.5B-Instruct", 4)
    assert (row.layout, row.notes) == ("split, 3 ZeRO-3 ranks", "async")


def test_an_included_file_keeps_its_links_inside_the_site():
    source, docs = ROOT / "benchmarks" / "README.md", ROOT / "docs"

    def rewrite(text: str, page_dir: str = "") -> str:
        return generated.LINK.sub(lambda m: generated.site_link(m, source, page_dir, docs), text)

    assert rewrite("[the layering](../tests/unit/test_layering.py)") == "the layering (`tests/unit/test_layering.py`)"
    assert rewrite("![curve](../docs/grpo_smollm2_cpu.png)") == "![curve](grpo_smollm2_cpu.png)"
    assert rewrite("[results](../docs/results.md#scaling)", "design") == "[results](../results.md#scaling)"
    assert rewrite("[TRL](https://github.com/huggingface/trl) [up](#results)") == (
        "[TRL](https://github.com/huggingface/trl) [up](#results)")
