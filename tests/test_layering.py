"""Architecture rules that a reviewer should not have to check by eye."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package,forbidden", [
    ("rlhf", {"actors", "scripts", "ray", "vllm", "deepspeed"}),
    ("rewards", {"rlhf", "actors", "scripts", "ray", "vllm", "deepspeed", "torch"}),
])
def test_layers_import_only_downwards(package, forbidden):
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & forbidden)
                 for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_torch_cuda_only_in_the_device_module():
    allowed = {ROOT / "actors" / "device.py"}
    hits = [str(p.relative_to(ROOT)) for d in ("rlhf", "actors", "rewards", "scripts")
            for p in (ROOT / d).rglob("*.py") if p not in allowed and "torch.cuda" in p.read_text()]
    assert hits == []


def test_only_the_backend_files_import_their_engines():
    owners = {"vllm": {"vllm_generator.py"}, "deepspeed": {"deepspeed_learner.py"}}
    for engine, files in owners.items():
        users = {p.name for p in (ROOT / "actors").glob("*.py") if engine in imported_modules(p)}
        assert users <= files, (engine, users)


def test_import_is_cheap_and_light():
    code = ("import sys, time; t = time.perf_counter(); import rlhf, rewards; dt = time.perf_counter() - t; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'vllm', 'deepspeed', 'transformers'}); "
            "print(dt, heavy)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    seconds, heavy = out.split(" ", 1)
    assert heavy.strip() == "[]"
    assert float(seconds) < 0.5 and wall < 2.0
