"""Shared fixtures: tiny random-weight models built locally (no download), once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    from rlhf.models import build_tiny_model

    return build_tiny_model("tiny-qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from rlhf.models import build_tiny_model

    return build_tiny_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))
