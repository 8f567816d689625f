"""Architecture rules that a reviewer should not have to check by eye."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


def test_every_module_sits_in_a_named_package():
    """rlhf/ top level: contracts, config, the loops and what they share; every other module is in
    one of the sub-packages, each of which says what it holds in its docstring."""
    top = {p.name for p in (ROOT / "rlhf").glob("*.py")}
    assert top == {"__init__.py", "protocols.py", "types.py", "errors.py",  # contracts
                   "config.py", "config_checks.py", "config_loading.py",  # config
                   "grpo.py", "dpo.py", "rollouts.py", "sampling.py", "evaluate.py",  # the loops
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


@pytest.mark.alone
def test_import_is_cheap_and_light():
    code = ("import sys, time; t = time.perf_counter(); import rlhf, rewards; dt = time.perf_counter() - t; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'vllm', 'deepspeed', 'transformers'}); "
            "print(dt, heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    seconds, heavy = out.split(" ", 1)
    assert heavy.strip() == "[]"  # what makes an import slow; the bound below only catches a gross regression
    assert float(seconds) < 3.0, seconds  # ~0.1 s here; torch alone takes ~2 s


def test_readme_architecture_names_every_module_and_folder():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Architecture"):readme.index("## Python API")]
    modules = [p for d in PRODUCT for p in (ROOT / d).rglob("*") if p.suffix in {".py", ".sh"}
               and p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if f"`{p.relative_to(ROOT)}`" not in section)
    assert missing == []
    folders = {p.parent.relative_to(ROOT).parts[-1] for p in (ROOT / "rlhf").glob("*/__init__.py")}
    listed = {line.split()[0].rstrip("/") for line in section.splitlines()
              if line.startswith("  ") and "/" in line}
    assert folders <= listed


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


def test_the_docs_name_tests_that_exist():
    """Every test the README, RELIABILITY.md and the benchmarks README cite (`tests/x.py::test_y`,
    `x.py::test_y` for a file under tests/, or `::test_y` continuing a file named earlier in the
    document) is defined in that file; renaming or merging a test must update its citations."""
    import re

    tests = {p.name: p for p in sorted((ROOT / "tests").rglob("test_*.py"))}
    missing = []
    for doc in ("README.md", "RELIABILITY.md", "benchmarks/README.md"):
        current = None
        for m in re.finditer(r"([\w/]+\.py)?::(test_\w+)", (ROOT / doc).read_text()):
            current = tests.get(Path(m[1]).name) if m[1] else current
            if current is None or not re.search(rf"def {m[2]}\b", current.read_text()):
                missing.append(f"{doc}: {m[1] or '::'}{m[2]}")
    assert not missing, missing
