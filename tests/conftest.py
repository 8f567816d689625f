"""Shared fixtures: tiny random-weight models built locally (no download), once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.parallel import (order_heaviest_first, pytest_configure, pytest_runtest_protocol,  # noqa: F401
                            pytest_unconfigure, pytest_xdist_make_scheduler)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Checkpoints are signed with a per-user key (rlhf.run.signing): the tests, and the runs they start as
# subprocesses, use one of their own instead of creating the user's ~/.config/rlhf/checkpoint.key.
if "RLHF_KEY_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RLHF_KEY_DIR"] = tempfile.mkdtemp(prefix="rlhf-test-keys-")
    # The process that made it outlives the runs and workers that inherit it: remove it at its exit.
    atexit.register(shutil.rmtree, os.environ["RLHF_KEY_DIR"], True)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# tests/gpu/ checks the GPU-only paths (CUDA IPC weight sync, vLLM sleep, FlexAttention's backward).
# They are collected where a GPU is (`python -m pytest tests/gpu` on the GPU machine), not on CPU CI.
collect_ignore = [] if _has_gpu() else ["gpu"]


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from rlhf.data.tiny_models import build_tiny_model

    return build_tiny_model("tiny-qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from rlhf.data.tiny_models import build_tiny_model

    return build_tiny_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    from rlhf.data.tiny_models import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="session")
def quiet_run(tmp_path_factory, tiny_reward_model):
    """One tiny GRPO run as a user starts it from a terminal (not verbose) with every tracker on and
    a reward model mixed with the task's reward function: what the terminal shows and what the
    trackers get (test_console.py), and the reward model scoring in the reward worker
    (test_reward_model.py), from one run instead of two. Yields (output_dir, finished process)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("quiet")
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml",
           f"output_dir={out}", "grpo.steps=2", "logging.backends=[jsonl,tensorboard,wandb,mlflow]",
           f"reward.functions=[{{function: rewards.tasks:arithmetic}}, "
           f"{{model: {tiny_reward_model}, weight: 0.5, batch_size: 4}}]"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["WANDB_MODE"] = "offline"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory):
    """One tiny GRPO run, its processes and listening sockets recorded in its steps, then Ctrl-C'd
    after its first checkpoint (tests/runs.py): what a local run listens on (test_listening.py) and
    how a real Ctrl-C ends it (test_failure_lines.py), from one run instead of two."""
    from tests.runs import interrupt_after_first_checkpoint

    return interrupt_after_first_checkpoint(tmp_path_factory.mktemp("interrupted"))


def pytest_collection_modifyitems(config, items):
    """`slow` tests (real models, minutes on 2 cores) run only when asked for: `-m slow`. Under
    xdist the heaviest files go first (tests/parallel.py)."""
    order_heaviest_first(items)
    expr = config.getoption("markexpr") or ""
    if "slow" in expr and "not slow" not in expr:
        return
    skip = pytest.mark.skip(reason="slow: run with `-m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
