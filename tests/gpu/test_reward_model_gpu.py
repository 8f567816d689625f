"""A learned reward model served on the GPU (issue 41), with the stand-in reward model of
configs/grpo_arithmetic_smollm2_rm_1gpu.yaml (SmolLM2-135M's decoder and a seeded one-output head,
built by benchmarks/reward_model.py from the staged SmolLM2):

- the reward worker's served path (bf16 on the GPU, token-budget batches, offloaded between calls)
  scores the samples the CPU path (fp32, rows in order) scores, within bf16's rounding;
- a GRPO run of the suite's recipe with it (colocated, `memory.plan=auto`) completes; the learner's
  measured peak is within 10% of the planner's prediction, the reward worker's within 10% of the
  planner's `reward_scoring`, the whole GPU under 95%; its samples/s and share of the step are
  recorded (the README's figures come from benchmarks/reward_model.py and this run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.reward_model import build_stand_in, samples
from rlhf.config import load_config
from rlhf.planner.memory import breakdown
from rlhf.planner.shapes import gpu_kind_of_device, model_shape
from tests.gpu.suite import GRPO_RECIPE, device_gib, train

pytestmark = pytest.mark.gpu
PEAK_TOLERANCE = 0.10
# bf16 through 30 layers against fp32, as shares of the fp32 scores' spread (max - min). The stand-in's
# random head gives a narrow spread, so bf16's rounding alone moves a score by up to ~8% of it (2% on
# average; bf16 against fp32 on a CPU, the same samples). A wrong path (pooling the wrong token, padding
# leaking into a score, a batch mixed up) moves scores by the order of the spread and breaks `corr`.
BF16_MAX_GAP, BF16_MEAN_GAP, MIN_CORR = 0.15, 0.05, 0.98


@pytest.fixture(scope="module")
def stand_in_rm(smollm2, tmp_path_factory) -> Path:
    return build_stand_in(tmp_path_factory.mktemp("rm") / "smollm2-135m", source=str(smollm2))


def test_served_scores_equal_the_cpu_paths(stand_in_rm, smollm2, figures):
    from transformers import AutoTokenizer

    from actors.reward_worker import RewardWorker
    from rlhf.scoring import PoolScorer

    cfg = load_config(None, [f"reward.functions=[{{model: {stand_in_rm}, batch_size: 8}}]",
                             "reward.model_device=gpu", "reward.max_tokens_per_batch=16384"])
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rows, responses = samples(64, 192, tokenizer)  # fp32 on the CPU: ~1 sample/s on 2 cores
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    served = RewardWorker(cfg.reward, str(smollm2), offload=True)  # in this process: it sees the GPU
    cpu = PoolScorer(cfg.reward.functions, tokenizer=tokenizer, timeout_s=30, num_workers=0)
    try:
        assert served.device.kind == "cuda"
        got, metrics, _ = served.score(rows, ids)
        want, _ = cpu.score(rows, ids)
    finally:
        served.close()
        cpu.close()
    spread = float(want.max() - want.min())
    gap, mean_gap = float((got - want).abs().max()), float((got - want).abs().mean())
    corr = float(torch.corrcoef(torch.stack([got, want]))[0, 1])
    name = f"rm_{stand_in_rm.name}"
    figures.update(max_abs_gap=round(gap, 4), mean_abs_gap=round(mean_gap, 4), spread=round(spread, 4),
                   corr=round(corr, 5),
                   samples_per_s=round(metrics[f"reward/{name}/samples_per_s"], 1),
                   reward_peak_gib=round(metrics["memory/reward_peak_gib"], 3))
    assert spread > 0, spread
    assert gap <= BF16_MAX_GAP * spread and mean_gap <= BF16_MEAN_GAP * spread, (gap, mean_gap, spread)
    assert corr > MIN_CORR, corr


def test_a_run_with_the_served_reward_model_keeps_the_plan(stand_in_rm, smollm2, tmp_path, figures):
    run = train("scripts/train_grpo.py", GRPO_RECIPE, tmp_path / "rm",
                f"reward.functions=[{{function: tests/fixtures/dense_rewards.py:digit_fraction}}, "
                f"{{model: {stand_in_rm}, weight: 0.1}}]", "reward.model_device=gpu",
                "reward.max_tokens_per_batch=16384", "learner.lr=1e-4")
    cfg = load_config(tmp_path / "rm" / "config.yaml")  # as run: the plan settled
    gpu = gpu_kind_of_device(torch.cuda.get_device_name(0), device_gib())
    bd = breakdown(cfg, model_shape(cfg.model.path), gpu)
    measured = max(run.series("memory/learner_peak_gib"))
    reward_measured = max(run.series("memory/reward_peak_gib"))
    name = f"rm_{stand_in_rm.name}"
    share = [t / s for t, s in zip(run.series(f"reward/{name}/time_s"), run.series("timing/step_s"))]
    figures.update(plan=(run.first_line("memory plan for") or "").split(": ", 1)[-1],
                   placement=run.first_line("placement:"),
                   learner_peak_gib=round(measured, 2), predicted_peak_gib=round(bd.learner_peak, 2),
                   peak_ratio=round(measured / bd.learner_peak, 3),
                   reward_peak_gib=round(reward_measured, 3), predicted_reward_gib=round(bd.reward_scoring, 3),
                   reward_peak_ratio=round(reward_measured / bd.reward_scoring, 3),
                   samples_per_s=[round(v, 1) for v in run.series(f"reward/{name}/samples_per_s")],
                   step_share=[round(v, 4) for v in share], gpu_peak_gib=round(run.gpu_peak_gib, 1),
                   gpu_gib=round(device_gib(), 1), run_s=round(run.seconds, 1), startup=run.startup)
    assert run.first_line("memory plan for"), run.stdout[-2000:]
    assert "reward worker @" in (run.first_line("placement:") or "")
    assert len(run.series(f"reward/{name}/mean")) == cfg.grpo.steps
    assert abs(measured / bd.learner_peak - 1) <= PEAK_TOLERANCE, (measured, bd.learner_peak)
    assert abs(reward_measured / bd.reward_scoring - 1) <= PEAK_TOLERANCE, (reward_measured, bd.reward_scoring)
    assert run.gpu_peak_gib <= 0.95 * device_gib(), (run.gpu_peak_gib, device_gib())
