"""scripts/setup.sh on a disk too small for a first install: one line up front, nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_first_install_on_a_full_disk_stops_before_it_writes_anything(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copytree(ROOT / "requirements", repo / "requirements")
    fake = tmp_path / "bin"
    fake.mkdir()
    df = fake / "df"  # `df -Pk`: 3 GiB available
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                  "echo '/dev/vda 263174212 260028484 3145728 99% /'\n")
    df.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "RLHF_DEVICE": "cpu", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"setup: 3 GB free on the disk of {repo}; a first install needs ~8 GB"]
    assert not (repo / ".venv").exists()
