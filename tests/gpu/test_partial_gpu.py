"""Streaming and partial rollouts on a GPU (rlhf/partial.py): GRPO colocated on SmolLM2-135M
(tests/gpu/grpo_suite.yaml at learning rate 1e-4, long-tailed forced lengths up to 192 tokens), the
CUDA engine stepped request by request, paused (its running samples read back, then aborted),
put to sleep, woken and given new weights every step:

- `stream` (on-policy): after every push the engine samples from the learner's weights
  (`suite.synced`, as test_grpo_gpu's runs), so the streaming path serves the pushed weights;
- `partial` (max_staleness 1, overprovision 2): every step completes within the bound
  (`partial/staleness_max` <= 1), long samples continue across a push (`partial/continued_frac` > 0
  on some step), the importance weights stay finite and near 1 on average.
Figures: both runs' mismatch, staleness, continued and carried figures, step and run seconds."""

from __future__ import annotations

import math

import pytest

from tests.gpu.suite import GRPO_RECIPE, synced, train

pytestmark = pytest.mark.gpu
COMMON = ["learner.lr=1e-4", "grpo.steps=4", "generation.forced_lengths=long_tail"]
MODES = {"stream": ["grpo.rollouts=stream"],
         "partial": ["grpo.rollouts=partial", "grpo.max_staleness=1", "grpo.overprovision=2"]}


def test_streaming_and_partial_rollouts_serve_the_pushed_weights_within_the_bound(smollm2, tmp_path, figures):
    runs = {name: train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / name, *COMMON, *extra)
            for name, extra in MODES.items()}
    stream, partial = runs["stream"], runs["partial"]
    for name, run in runs.items():
        figures[name] = dict(
            mismatch=[round(m, 4) for m in run.series("mismatch/logprob_abs_diff")],
            staleness_max=run.series("partial/staleness_max"), continued=run.series("partial/continued_frac"),
            carried=run.series("partial/carried_groups"), step_s=[round(s, 2) for s in run.series("timing/step_s")],
            run_s=round(run.seconds, 1))
    assert synced(stream.series("mismatch/logprob_abs_diff")), figures["stream"]
    assert max(stream.series("partial/staleness_max")) == 0 and max(stream.series("partial/carried_groups")) == 0
    assert len(partial.series("loss")) == 4 and all(math.isfinite(v) for v in partial.series("loss"))
    assert max(partial.series("partial/staleness_max")) <= 1
    assert max(partial.series("partial/continued_frac")) > 0, figures["partial"]
    assert all(0.5 < w < 1.5 for w in partial.series("is/weight_mean")), partial.series("is/weight_mean")
