"""Fixtures of the end-to-end tests: one real run each, shared by the tests of one module that read it.

Each is used by one module only, so that `--dist loadfile` (scripts/test.sh) runs it once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def quiet_run(tmp_path_factory, tiny_reward_model):
    """One tiny GRPO run as a user starts it from a terminal (not verbose) with every tracker on and
    a reward model mixed with the task's reward function: what the terminal shows and what the
    trackers get, and the reward model scoring in the reward worker (both in test_console.py).
    Yields (output_dir, finished process)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("quiet")
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml",
           f"output_dir={out}", "grpo.steps=2", "logging.backends=[jsonl,tensorboard,wandb,mlflow]",
           f"reward.functions=[{{function: rewards.tasks:arithmetic}}, "
           f"{{model: {tiny_reward_model}, weight: 0.5, batch_size: 4}}]"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["WANDB_MODE"] = "offline"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory):
    """One tiny GRPO run, its processes and listening sockets recorded in its steps, then Ctrl-C'd
    after its first checkpoint (tests/support/runs.py): what a local run listens on and how a real
    Ctrl-C ends it (both in test_listening.py), from one run instead of two."""
    from tests.support.runs import interrupt_after_first_checkpoint

    return interrupt_after_first_checkpoint(tmp_path_factory.mktemp("interrupted"))
