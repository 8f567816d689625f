"""LoRA colocated on one GPU, both ways a sync can go: `adapter` (what `auto` must settle on where
vLLM serves adapters: only the adapter's tensors move) and `merged` (the merged weights move).
After a sync the engine's log-probs match the learner's as closely as in full fine-tuning
(test_backends_gpu: the same bound); the chosen mode and the sync seconds are recorded."""

from __future__ import annotations

import re

import pytest

from tests.gpu.suite import GRPO_RECIPE, MISMATCH_MAX, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode, expected", [("auto", "adapter"), ("merged", "merged")])
def test_lora_sync_serves_the_learners_weights(mode, expected, qwen05b, tmp_path, figures):
    run = train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / mode, f"model.path={qwen05b}",
                "learner.lora_rank=16", f"learner.lora_sync={mode}", "learner.lr=1e-4", "save_every=0",
                "generation.gpu_memory_utilization=0.3")
    line = run.first_line("learner.lora_sync:") or ""
    chosen = re.search(r"-> (\w+)|: (\w+) \(as set\)", line)
    mismatch = run.series("mismatch/logprob_abs_diff")
    figures.update(mode_line=line, chosen=chosen and (chosen[1] or chosen[2]), mismatch=mismatch,
                   sync_s=run.series("timing/sync_s"), run_s=round(run.seconds, 1))
    assert figures["chosen"] == expected, run.stdout[-2000:]
    assert len(mismatch) == 2 and max(mismatch) <= MISMATCH_MAX, mismatch
    assert max(run.series("grad_norm")) > 0
