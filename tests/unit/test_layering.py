"""Architecture rules that a reviewer should not have to check by eye."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("rlhf", "actors", "rewards", "scripts")
LOOPS = {"rlhf.grpo", "rlhf.dpo", "rlhf.rollouts", "rlhf.sampling", "rlhf.evaluate"}
"""The training and evaluation loops: what rlhf/algo and rlhf/data serve, and never import."""


def imported_modules(path: Path) -> set[str]:
    """Top-level packages `path` imports (function-level imports included)."""
    return {name.split(".")[0] for name in imported_names(path)}


def imported_names(path: Path) -> set[str]:
    """Full dotted names of every module `path` imports; `from rlhf import x` counts as `rlhf.x`,
    or as the module `rlhf` re-exports `x` from."""
    import rlhf

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "rlhf":
                names.update(rlhf._EXPORTS.get(a.name, f"rlhf.{a.name}") for a in node.names)
    return names


def python_files(*folders: str) -> list[Path]:
    return [p for d in folders for p in sorted((ROOT / d).rglob("*.py"))]


@pytest.mark.parametrize("package,forbidden", [
    ("rlhf", {"actors", "scripts", "ray", "vllm", "deepspeed"}),
    ("rewards", {"rlhf", "actors", "scripts", "ray", "vllm", "deepspeed", "torch"}),
    ("actors", {"scripts"}),
])
def test_layers_import_only_downwards(package, forbidden):
    """scripts -> actors -> rlhf -> rewards, sub-packages of rlhf included."""
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & forbidden)
                 for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("package", ["rlhf/algo", "rlhf/data"])
def test_algorithm_and_data_never_import_a_loop(package):
    offenders = {str(p.relative_to(ROOT)): sorted(imported_names(p) & LOOPS) for p in python_files(package)}
    assert not {k: v for k, v in offenders.items() if v}


def test_algorithm_math_imports_only_contracts_config_and_itself():
    allowed = {"rlhf.config", "rlhf.types", "rlhf.errors"}
    for path in python_files("rlhf/algo"):
        ours = {m for m in imported_names(path) if m.split(".")[0] in {"rlhf", *PRODUCT}}
        assert {m for m in ours if m not in allowed and not m.startswith("rlhf.algo.")} == set(), path


def running_nodes(tree: ast.AST):
    """Every node of `tree` except what sits under `if TYPE_CHECKING:` (it never runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
                stack.extend(child.orelse)
            else:
                stack.append(child)


def import_graph(root: Path, package: str = "rlhf") -> dict[str, set[str]]:
    """Module -> the modules of `package` (under `root`) it imports, at module level or inside a
    function. `from p import x` is the module `p.x` when there is one, else `p`; `from rlhf import x`
    is the module `rlhf` re-exports `x` from."""
    import rlhf

    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        names = set()
        for node in running_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                parts = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parts + [node.module or ""]).strip(".") if node.level else node.module
                names.update(rlhf._EXPORTS.get(a.name, f"{base}.{a.name}") if base == "rlhf" else f"{base}.{a.name}"
                             for a in node.names)
        targets = {_longest_module_prefix(name, files) for name in names} - {None, module}
        graph[module] = targets
    return graph


def _longest_module_prefix(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of `graph` as [a, b, ..., a] (depth-first, in name order), or [] when it has none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(node)
        return []

    return next((cycle for node in sorted(graph) if (cycle := visit(node))), [])


def test_rlhf_has_no_import_circle():
    """No circle among rlhf/'s modules, so each can be read, imported and tested after the ones it
    uses: the one-line errors live in rlhf/errors.py, which imports nothing of ours, and user code
    (tools, environments) is loaded by the launch (rlhf/run/preflight.py), not by the validation a
    config runs when it is built. Imports inside functions count: a deferred import still makes two
    modules that each need the other, and the circle closes the day it moves to the top. Imports
    under `if TYPE_CHECKING:` do not: they never run."""
    graph = import_graph(ROOT)
    assert "rlhf.run.signing" in graph["rlhf.run.checkpoint"]  # `from rlhf.run import signing` is seen
    cycle = find_cycle(graph)
    assert cycle == [], "import circle: " + " -> ".join(cycle)


def test_the_import_graph_sees_deferred_imports_and_skips_type_checking(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from pkg.c import C\n\ndef f():\n    from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("from .c import C\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert find_cycle({**graph, "pkg.c": set()}) == []


def test_every_module_sits_in_a_named_package():
    """rlhf/ top level: contracts, config, the loops and what they share; every other module is in
    one of the sub-packages, each of which says what it holds in its docstring."""
    top = {p.name for p in (ROOT / "rlhf").glob("*.py")}
    assert top == {"__init__.py", "protocols.py", "types.py", "errors.py",  # contracts
                   "config.py", "config_checks.py", "config_loading.py",  # config
                   "grpo.py", "dpo.py", "rollouts.py", "partial.py", "sampling.py", "evaluate.py",  # the loops
                   "scoring.py", "reward_model.py",  # what training and evaluation, learners and engines share
                   "lora.py",
                   "rules.py"}  # rules derived from a config that the cluster, planner and loops all ask
    for package in ("algo", "data", "run", "planner", "env"):
        assert ast.get_docstring(ast.parse((ROOT / "rlhf" / package / "__init__.py").read_text())), package


def cuda_uses(path: Path) -> list[int]:
    """Lines of `path` that reach `torch.cuda` in code: `torch.cuda.x`, `import torch.cuda`,
    `from torch import cuda`, `from torch.cuda import x`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("torch.cuda") or (node.module == "torch"
                                                         and any(a.name == "cuda" for a in node.names))):
            lines.append(node.lineno)
    return lines


DEVICE_MODULE = "actors/device.py"
CUDA_EXCEPTIONS = {
    # The TRL side of the TRL-vs-ours benchmark runs TRL's trainers, not ours: its device choice is
    # TRL's `use_cpu`, decided the way a TRL user would.
    "benchmarks/trl_grpo.py": "TRL's own device flag",
    "benchmarks/trl_dpo.py": "TRL's own device flag",
    # Shared by the TRL and standalone sides: the peak memory and profiler of a process that may
    # hold no actor of ours.
    "benchmarks/sidecommon.py": "peak memory of another stack's process",
    # A standalone script (no project imports) that builds random-weight models where it is fastest.
    "benchmarks/models.py": "standalone model builder",
}
"""Files outside the product that reach torch.cuda themselves, each with why."""


def test_torch_cuda_only_in_the_device_module():
    # A plain grep over the product (docstrings included), then the AST over benchmarks/ too.
    hits = [str(p.relative_to(ROOT)) for p in python_files(*PRODUCT)
            if str(p.relative_to(ROOT)) != DEVICE_MODULE and "torch.cuda" in p.read_text()]
    assert hits == []
    users = {str(p.relative_to(ROOT)) for p in python_files(*PRODUCT, "benchmarks") if cuda_uses(p)}
    assert users == {DEVICE_MODULE, *CUDA_EXCEPTIONS}


def test_only_the_backend_files_import_their_engines():
    # the vLLM backend is the engine actor and what runs inside its workers
    # ... and DeepSpeed's learner, plus the set-up step that builds its CPU ops
    owners = {"vllm": {"vllm_generator.py", "vllm_lora.py", "vllm_worker.py"}, "deepspeed": {"deepspeed_learner.py", "torch_extensions.py"}}
    for engine, files in owners.items():
        users = {p.name for p in (ROOT / "actors").glob("*.py") if engine in imported_modules(p)}
        assert users <= files, (engine, users)


DYNAMIC_IMPORTS = {"importlib.import_module", "import_module", "__import__"}


def modules_imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module name `path` imports, anywhere in the file: `import a.b`, `from a import b` (as
    `a` and `a.b`), relative imports resolved against the file's package, and
    `importlib.import_module("a.b")` / `__import__("a.b")` with a literal name."""
    package = path.relative_to(root).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = (*package[: len(package) + 1 - node.level], *([node.module] if node.module else []))
            base = ".".join(parts) if node.level else node.module
            names |= {base, *(f"{base}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in DYNAMIC_IMPORTS and node.args:
            name = node.args[0]
            names.update([name.value] if isinstance(name, ast.Constant) and isinstance(name.value, str) else [])
    return names


def test_training_never_imports_the_fetch_tools():
    """Fetching models and data (from the hub, or GGUF parts out of a package registry's wheels) is
    an environment tool, scripts/assets/, that a user runs before training (`python -m scripts.assets
    fetch`); no other product file imports it, so a training run never fetches. Messages may still
    name its command."""
    tools = ROOT / "scripts" / "assets"
    users = {}
    for path in python_files(*PRODUCT):
        used = sorted(m for m in modules_imported(path) if m.split(".")[:2] == ["scripts", "assets"])
        if used and not path.is_relative_to(tools):
            users[str(path.relative_to(ROOT))] = used
    assert users == {}


def test_the_import_reader_sees_relative_deferred_and_dynamic_imports(tmp_path):
    (tmp_path / "scripts").mkdir()
    tool = tmp_path / "scripts" / "tool.py"
    tool.write_text("from scripts import assets\n\ndef f():\n    from .assets import models\n"
                    "    import importlib\n    importlib.import_module('scripts.assets.packages')\n")
    found = modules_imported(tool, tmp_path)
    assert found >= {"scripts.assets", "scripts.assets.models", "scripts.assets.packages"}, found


def test_import_is_light():
    """`import rlhf, rewards` pulls in none of the heavy libraries (what makes an import slow: torch
    alone takes seconds); how long it takes is a benchmark's business, not this suite's."""
    code = ("import sys; import rlhf, rewards; heavy = {'torch', 'ray', 'vllm', 'deepspeed', 'transformers'}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_product_files_and_functions_stay_small():
    """A file a newcomer can read in one sitting (<= 500 lines) and functions that fit a screen
    (<= 60 lines): past that, a module is holding two things."""
    long_files, long_functions = [], []
    for path in python_files(*PRODUCT):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if text.count("\n") > 500:
            long_files.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append((name, node.name, node.end_lineno - node.lineno + 1))
    assert not long_files and not long_functions, (long_files, long_functions)


MODULE_DOCSTRING_LINES = 30


def test_module_docstrings_stay_short():
    """A module docstring states what the module is and the decisions it embodies, each with its
    reason, in at most 30 lines. Measurements (with their machine and date), derivations and
    histories go stale in code: they belong in docs/design/, which the docstring points to."""
    long = {}
    for path in python_files(*PRODUCT):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MODULE_DOCSTRING_LINES:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert long == {}, f"module docstrings over {MODULE_DOCSTRING_LINES} lines (path: lines): {long}"


NUMBERED_CITATION = re.compile(r"\b(?:choices?|points?)(?:\s|#)+\d+", re.IGNORECASE)
"""A citation of a list item by its number ("choice 4", "points 2-3", across a comment's line break)."""


def test_decisions_are_cited_by_name_not_by_number():
    """A decision is cited by its name ("Update sessions" in actors/vllm_generator.py), by the
    function or constant that holds it, or by a docs/design/ section: never as "choice 4", a number
    that silently points elsewhere once its list is reordered, and that no search finds."""
    hits = []
    for path in python_files(*PRODUCT):
        text = path.read_text()
        hits += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}"
                 for m in NUMBERED_CITATION.finditer(text)]
    assert hits == []
