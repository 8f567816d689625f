"""The `rlhf` command (pyproject's [project.scripts]): the same code as the scripts in scripts/.

Called in-process through the entry function pyproject names (the venv's installed `rlhf` may come
from another checkout), and once as `python -m scripts.cli`.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from scripts import cli

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["--config", "configs/grpo_tiny_cpu.yaml", "--gpu", "h100-80gb"]


def entry_point():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["rlhf"]
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def test_pyproject_installs_the_command_and_its_package():
    assert entry_point() is cli.main
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert "scripts*" in packages["include"]


def test_help_names_every_subcommand(capsys):
    assert entry_point()(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "dpo", "plan", "eval", "submit"):
        assert f"  {name} " in out


def test_plan_is_scripts_plan(capsys):
    from scripts import plan

    assert entry_point()(["plan", *PLAN]) == 0
    via_command = capsys.readouterr().out
    assert plan.main(PLAN) == 0
    assert capsys.readouterr().out == via_command
    assert via_command.splitlines()[-1].startswith("generation.gpu_memory_utilization=")


@pytest.mark.parametrize("argv, status", [([], 2), (["bogus"], 2), (["plan", "--gpu", "v100"], 2)])
def test_bad_command_lines_exit_2_with_one_line(capsys, argv, status):
    assert entry_point()(argv) == status
    if argv:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ")


def test_subcommands_reach_their_scripts():
    for name, (where, _) in cli.COMMANDS.items():
        if name == "submit":
            assert (ROOT / where).is_file() and cli.SUBMIT == ROOT / where
        else:
            assert callable(importlib.import_module(where).main), name


def test_python_dash_m_runs_the_same_command():
    out = subprocess.run([sys.executable, "-m", "scripts.cli", "plan", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: rlhf plan ") and "--gpu" in out
