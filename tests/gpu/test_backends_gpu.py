"""Each learner backend colocated with one vLLM engine on one GPU, under `memory.plan=auto` for the
device's own kind, on Qwen2.5-0.5B's shape (random weights, real tokenizer): the engine starts,
nothing runs out of memory, the learner's measured peak is within 10% of the planner's prediction
and the whole GPU (nvidia-smi) stays under 95%; after every sync the engine samples from the
learner's weights (log-prob mismatch); a run resumed from its step-1 checkpoint repeats step 1."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import load_config
from rlhf.planner import breakdown, gpu_kind_of_device, model_shape
from tests.gpu.suite import GRPO_RECIPE, MISMATCH_MAX, device_gib, resume_from, same_step, train

pytestmark = pytest.mark.gpu
BACKENDS = {
    "fsdp2": ["learner.backend=fsdp2"],
    "zero2": ["learner.backend=deepspeed", "learner.zero_stage=2"],
    "zero3": ["learner.backend=deepspeed", "learner.zero_stage=3"],
}
PEAK_TOLERANCE = 0.10


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_under_the_plan_syncs_every_step_and_resumes(backend, qwen05b, tmp_path, figures):
    overrides = [f"model.path={qwen05b}", "memory.plan=auto", *BACKENDS[backend]]
    full = train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / "full", *overrides)
    cfg = load_config(tmp_path / "full" / "config.yaml")  # the plan applied
    gpu = gpu_kind_of_device(torch.cuda.get_device_name(0), device_gib())
    predicted = breakdown(cfg, model_shape(str(qwen05b)), gpu).learner_peak
    measured = max(full.series("memory/learner_peak_gib"))
    mismatch = full.series("mismatch/logprob_abs_diff")
    figures.update(plan=full.first_line("memory plan for"), run_s=round(full.seconds, 1),
                   mismatch=[round(m, 4) for m in mismatch], sync_s=full.series("timing/sync_s"),
                   step_s=full.series("timing/step_s"), learner_peak_gib=round(measured, 2),
                   predicted_peak_gib=round(predicted, 2), peak_ratio=round(measured / predicted, 3),
                   gpu_peak_gib=round(full.gpu_peak_gib, 1), gpu_gib=round(device_gib(), 1),
                   mfu=full.series("perf/mfu"))
    assert figures["plan"], full.stdout[-2000:]
    assert len(mismatch) == 2 and max(mismatch) <= MISMATCH_MAX, mismatch
    assert abs(measured / predicted - 1) <= PEAK_TOLERANCE, (measured, predicted)
    assert full.gpu_peak_gib <= 0.95 * device_gib(), (full.gpu_peak_gib, device_gib())

    resumed = resume_from(full, 1, tmp_path / "resumed", "scripts/train_grpo.py", GRPO_RECIPE, *overrides)
    again = resumed.records[-1]
    figures.update(resume_run_s=round(resumed.seconds, 1), resumed_step1_loss=again["loss"],
                   step1_loss=full.records[1]["loss"])
    assert again["step"] == 1
    assert not same_step(full.records[1], again, ("reward/mean", "response_len/mean", "loss"))
