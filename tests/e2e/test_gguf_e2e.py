"""The real Qwen coder assembled from its GGUF parts trains two GRPO steps on CPU (`-m slow`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlhf.data import assets as cache
from scripts.assets import gguf_parts


@pytest.mark.slow
def test_real_qwen_coder_two_grpo_steps_on_cpu(tmp_path):
    """About 5 minutes on 2 cores and ~20 GB of memory (learner peak 11.6 GiB; README)."""
    folder = cache.model_dir(gguf_parts.QWEN25_CODER)
    if not cache.is_fetched(folder):
        pytest.skip(f"{folder} is not fetched: python -m scripts.assets fetch {gguf_parts.QWEN25_CODER}")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24
    assert (config["hidden_size"], config["vocab_size"]) == (896, 151936)
    import subprocess

    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_gsm8k_smollm2_cpu.yaml",
           f"model.path={gguf_parts.QWEN25_CODER}", f"output_dir={tmp_path / 'run'}", "grpo.steps=2",
           "grpo.prompts_per_step=2", "grpo.group_size=2", "generation.max_new_tokens=32",
           "eval.num_prompts=2", "eval_every=100"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
