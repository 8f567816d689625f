"""A real model still learns on one GPU, and a run resumed from its checkpoint repeats the next step:
SmolLM2-135M-Instruct on the shipped GPU arithmetic recipe (configs/grpo_arithmetic_smollm2_1gpu.yaml:
sums and differences up to 100, 128 prompts x 8 samples a step, FSDP2), shortened to 20 steps to fit
the suite. The margin: the mean reward of the first five steps against the last five. The recipe's
H100 run of 2026-11-24 (docs/grpo_arithmetic_smollm2_1gpu_metrics.jsonl) reads 0.105 over steps 0-4
and 0.41 over steps 15-19, so 0.15 leaves room for another seed's or kernel's noise."""

from __future__ import annotations

import pytest

from tests.gpu.suite import resume_from, same_step, train

pytestmark = pytest.mark.gpu
RECIPE = "configs/grpo_arithmetic_smollm2_1gpu.yaml"
STEPS, SAVED = 20, 10
ARGS = (f"grpo.steps={STEPS}", f"save_every={SAVED}", "eval_every=0", "data.num_train=4096",
        "generation.enforce_eager=true")
MARGIN = 0.15
MISMATCH_FLOOR_MAX = 0.06  # sampled text at temperature 1 from a model still unsure of its answers


# Every learner speed key at once (actors/learner_kernels.py): the run must learn as the eager one does.
FAST_LEARNER = ("learner.liger=true", "learner.cast_once_per_step=true", "learner.pack_sequences=true",
                "learner.attention=varlen", "learner.max_tokens_per_micro_batch=16384", "learner.head_kernels=fused")


def test_smollm2_learns_arithmetic_and_resumes_exactly(smollm2, tmp_path, figures):
    run = train("scripts/train_grpo.py", RECIPE, tmp_path / "learn", *ARGS)
    learned(run, figures)

    # Every sync serves the learner's weights: no step's train/inference gap rises above the bf16
    # floor step 0 shows (the loaded weights, pushed once), which then falls as the policy sharpens
    # (the recipe's H100 run: 0.0426 at step 0, 0.0431 at most, 0.014 by step 24).
    mismatch = run.series("mismatch/logprob_abs_diff")
    figures.update(mismatch_step0=round(mismatch[0], 4))
    assert mismatch[0] <= MISMATCH_FLOOR_MAX and max(mismatch) <= 1.15 * mismatch[0] + 0.005, mismatch

    # the resumed run trains step SAVED once more (grpo.steps=SAVED+1) and must repeat it exactly
    resumed = resume_from(run, SAVED, tmp_path / "resumed", "scripts/train_grpo.py", RECIPE, *ARGS,
                          f"grpo.steps={SAVED + 1}")
    again = resumed.records[-1]
    figures.update(resume_run_s=round(resumed.seconds, 1), loss=run.records[SAVED]["loss"], resumed_loss=again["loss"])
    assert again["step"] == SAVED
    assert not same_step(run.records[SAVED], again, ("reward/mean", "response_len/mean", "loss"))


def test_smollm2_learns_arithmetic_with_the_fast_learner_kernels(smollm2, tmp_path, figures):
    """The same run with Liger, packed varlen rows, the fused head and one cast per step: the reward
    rises by the same margin (learning unchanged by the speed keys)."""
    run = train("scripts/train_grpo.py", RECIPE, tmp_path / "fast", *ARGS, *FAST_LEARNER)
    learned(run, figures)
    mfu = sorted(run.series("perf/mfu"))
    figures.update(learner_mfu=round(mfu[len(mfu) // 2], 3) if mfu else None)


def learned(run, figures) -> None:
    """The mean reward of the first and the last five steps, checked `MARGIN` apart; figures of the run."""
    reward = run.series("reward/mean")
    early, late = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    step_s = sorted(run.series("timing/step_s"))
    figures.update(reward_first5=round(early, 3), reward_last5=round(late, 3), run_s=round(run.seconds, 1),
                   median_step_s=round(step_s[len(step_s) // 2], 2),
                   median_sync_s=round(sorted(run.series("timing/sync_s"))[len(step_s) // 2], 3),
                   mismatch_max=round(max(run.series("mismatch/logprob_abs_diff")), 4),
                   startup=run.startup)
    assert len(reward) == STEPS
    assert late - early >= MARGIN, reward
