"""GRPO split over two GPUs (`cluster.placement=split`: some GPUs generate, the others learn), under
`memory.plan=auto`: the vLLM engine on one GPU, the learner rank on the other, and after every step
learner rank 0 broadcasts the weights over NCCL to the engine's worker
(`actors/weight_sync.py::NcclTransport`; the colocated runs of test_grpo_gpu.py hand over CUDA IPC
handles instead). FSDP2 sends its full tensors; ZeRO-3 gathers its shards first.

- both GPUs hold a share of the run (nvidia-smi), so the layout really is split;
- after every sync the engine samples from the learner's weights (`suite.synced`, as in
  test_grpo_gpu.py), and the update moved them; with two engines on the generating GPU
  (`cluster.engines_per_gpu=2`), both, each in an NCCL group of its own;
- the learner's measured peak is within 10% of the planner's prediction for a learner GPU of its own.

Skipped where the machine has one GPU."""

from __future__ import annotations

import pytest

from tests.gpu.suite import GRPO_RECIPE, needs_gpus, planned_run, synced, train

pytestmark = [pytest.mark.gpu, needs_gpus(2)]
PEAK_TOLERANCE = 0.10
SPLIT = ["cluster.placement=split", "cluster.weight_sync=nccl", "cluster.generator_engines=1", "learner.num_ranks=1",
         "learner.lr=1e-4"]
RUNS = {
    "fsdp2": ["learner.backend=fsdp2"],
    "zero3": ["learner.backend=deepspeed", "learner.zero_stage=3"],
    # two engines on the generating GPU: NCCL takes one rank of a group per GPU, so two groups
    "fsdp2-2-engines": ["learner.backend=fsdp2", "cluster.generator_engines=2", "cluster.engines_per_gpu=2"],
}


@pytest.mark.parametrize("name", RUNS)
def test_split_run_broadcasts_the_learners_weights_over_nccl(name, smollm2, tmp_path, figures):
    run = train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / name, *SPLIT, *RUNS[name])
    planned = planned_run(run)
    figures.update(planned.figures)
    engines = 2 if "cluster.engines_per_gpu=2" in RUNS[name] else 1
    assert (run.first_line("cluster:") or "").startswith(f"cluster: split, {engines} engine(s)"), run.stdout[-2000:]
    assert sum(gib > 1.0 for gib in planned.busy.values()) >= 2, planned.busy  # engine on one GPU, learner on another
    assert synced(planned.mismatch), planned.mismatch
    assert max(run.series("grad_norm")) > 0
    assert abs(planned.measured / planned.predicted - 1) <= PEAK_TOLERANCE, (planned.measured, planned.predicted)
