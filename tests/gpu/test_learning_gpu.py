"""A real model still learns on one GPU: SmolLM2-135M-Instruct on the GPU arithmetic recipe
(configs/grpo_arithmetic_smollm2_1gpu.yaml: sums and differences up to 100, 128 prompts x 8
samples a step), shortened to fit the suite. The margin was measured on an H100 first (README,
"Testing on a GPU"): mean reward of the first five steps against the last five."""

from __future__ import annotations

import pytest

from tests.gpu.suite import MISMATCH_MAX, train

pytestmark = pytest.mark.gpu
STEPS = 40
MARGIN = 0.15


def test_smollm2_learns_arithmetic(smollm2, tmp_path, figures):
    run = train("scripts/train_grpo.py", "configs/grpo_arithmetic_smollm2_1gpu.yaml", tmp_path / "learn",
                f"grpo.steps={STEPS}", "eval_every=0", "generation.enforce_eager=true", timeout=300)
    reward = run.series("reward/mean")
    early, late = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    figures.update(reward_first5=round(early, 3), reward_last5=round(late, 3), run_s=round(run.seconds, 1),
                   median_step_s=sorted(run.series("timing/step_s"))[len(reward) // 2],
                   mismatch_max=round(max(run.series("mismatch/logprob_abs_diff")), 4))
    assert len(reward) == STEPS
    assert late - early >= MARGIN, reward
    assert figures["mismatch_max"] <= MISMATCH_MAX
