"""benchmarks/mps.py: a layout's CUDA MPS daemon starts on its GPUs before the run, its pipe folder
reaches the run's environment, and it is told to quit afterwards, even when the run fails."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.mps import mps_daemon

FAKE = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "stdin": "" if "-d" in sys.argv else sys.stdin.read(),
                        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}) + "\\n")
"""


@pytest.fixture
def fake_control(tmp_path) -> tuple[dict[str, str], Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "CUDA_VISIBLE_DEVICES": "2,3"}
    return env, log


def test_the_daemon_serves_the_layouts_gpus_and_quits_after_a_failed_run(fake_control):
    env, log = fake_control
    with pytest.raises(RuntimeError, match="the run failed"), mps_daemon(env) as run_env:
        pipe = Path(run_env["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.is_dir() and len(str(pipe / "control")) < 100  # a Unix socket path
        assert Path(run_env["CUDA_MPS_LOG_DIRECTORY"]).is_dir() and run_env["CUDA_VISIBLE_DEVICES"] == "2,3"
        raise RuntimeError("the run failed")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(c["argv"], c["stdin"], c["gpus"]) for c in calls] == [(["-d"], "", "2,3"), ([], "quit\n", "2,3")]
    assert calls[0]["pipe"] == calls[1]["pipe"] == str(pipe)
    assert not pipe.parent.exists()  # the folders are removed


def test_without_the_mps_tools_it_is_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    with pytest.raises(SystemExit, match="^--mps: nvidia-cuda-mps-control not found on PATH"), mps_daemon(env):
        pass


def test_scale_refuses_mps_without_gpus_before_running_anything(tmp_path):
    from benchmarks.scale import main

    with pytest.raises(SystemExit, match="^scale.py: --mps needs CUDA GPUs"):
        main(["--tiny", "--mps", "--layouts", "1gpu", "--workdir", str(tmp_path)])
    assert not any(tmp_path.iterdir())
