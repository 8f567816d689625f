"""GRPO over several GPUs of one host (SmolLM2-135M, tests/gpu/grpo_suite.yaml, `memory.plan=auto`):

- colocated on 2 GPUs: 2 FSDP2 learner ranks (NCCL between them) and 2 vLLM engines, each rank handing
  its engine CUDA IPC handles (`actors/weight_sync.py::engine_targets`);
- split on 4 GPUs, the seeds' layout in small: GPU 0 generates, GPUs 1-3 learn with DeepSpeed ZeRO-2,
  learner rank 0 broadcasting the weights over NCCL;
- on an 8-GPU host, the seeds' node: 8 engines beside 8 FSDP2 ranks, and GPU 0 generating for 7 ZeRO-3
  ranks (uneven shards: 512 rows over 7 ranks);
- on one GPU, two engines beside one learner rank (`rlhf.rules.engines_per_device`), both fed by it.

Each run: the cluster line names the layout, every GPU holds a share of the run, after every sync
every engine samples from the learner's weights (`suite.synced`), the update moved them, and the
learner's measured peak is within 10% of the planner's prediction. Skipped with the reason where the
machine has fewer GPUs."""

from __future__ import annotations

import pytest

from tests.gpu.suite import GRPO_RECIPE, needs_gpus, planned_run, synced, train

pytestmark = pytest.mark.gpu
PEAK_TOLERANCE = 0.10
LAYOUTS = {
    "colocated-2-engines-1gpu": (1, "cluster: colocated, 2 engine(s)",
                                 ["cluster.placement=colocated", "cluster.generator_engines=2",
                                  "learner.num_ranks=1", "learner.backend=fsdp2"]),
    "colocated-2x2": (2, "cluster: colocated, 2 engine(s)",
                      ["cluster.placement=colocated", "cluster.generator_engines=2", "learner.num_ranks=2",
                       "learner.backend=fsdp2"]),
    "split-1+3-zero2": (4, "cluster: split, 1 engine(s)",
                        ["cluster.placement=split", "cluster.weight_sync=nccl", "cluster.generator_engines=1",
                         "learner.num_ranks=3", "learner.backend=deepspeed", "learner.zero_stage=2"]),
    "colocated-8x8": (8, "cluster: colocated, 8 engine(s)",
                      ["cluster.placement=colocated", "cluster.generator_engines=8", "learner.num_ranks=8",
                       "learner.backend=fsdp2"]),
    "split-1+7-zero3": (8, "cluster: split, 1 engine(s)",
                        ["cluster.placement=split", "cluster.weight_sync=nccl", "cluster.generator_engines=1",
                         "learner.num_ranks=7", "learner.backend=deepspeed", "learner.zero_stage=3"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_gpus(g)) for n, (g, _, _) in LAYOUTS.items()])
def test_multi_gpu_layout_syncs_every_engine_every_step(name, smollm2, tmp_path, figures):
    gpus, cluster_line, overrides = LAYOUTS[name]
    run = train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / name, *overrides, "learner.lr=1e-4")
    planned = planned_run(run)
    last = [r for r in run.records if "timing/sync_s" in r][-1]
    engines = sorted(k for k in last if k.startswith("sync/engine"))
    figures.update(planned.figures, engine_sync_s={k: round(last[k], 3) for k in engines})
    assert (run.first_line("cluster:") or "").startswith(cluster_line), run.stdout[-2000:]
    assert sum(gib > 1.0 for gib in planned.busy.values()) >= gpus, planned.busy
    assert len(engines) == planned.cfg.cluster.generator_engines, engines  # every engine took the push
    assert synced(planned.mismatch), planned.mismatch
    assert max(run.series("grad_norm")) > 0
    assert abs(planned.measured / planned.predicted - 1) <= PEAK_TOLERANCE, (planned.measured, planned.predicted)
