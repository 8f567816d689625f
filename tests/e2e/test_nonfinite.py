"""A NaN/inf loss, gradient or weight never reaches a checkpoint.

Unit level (one FSDP2 rank in a spawned process, rendezvous through a file, no port): a step whose
loss is NaN with finite gradients, and one whose gradients are NaN, are skipped (weights, AdamW
state and scheduler untouched, `train/nonfinite_skipped` = 1) and the next clean step is finite;
DeepSpeed (ZeRO-2) skips NaN gradients and says so;
lr=1e30 is stopped by `TrainHealth` after `learner.max_nonfinite_steps` skipped steps; lr=1e39 makes
the weights inf in one finite step, which stops the run at once. `TrainHealth`'s counting on its own.
The DPO loop's counting, on scripted step metrics. End to end: the tiny GRPO recipe with learner.lr=1e30 exits 1 with one `error:` line naming the
likely keys, and every checkpoint it left holds finite weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlhf.algo.objectives import GRPOObjective
from rlhf.config import LearnerConfig, ModelConfig
from rlhf.run.metrics import NonfiniteTraining, TrainHealth
from rlhf.types import StepMetrics
from tests.support.learners import make_batch

GRPO = GRPOObjective(loss_agg="token-mean")


class NanLoss(GRPOObjective):
    """GRPO whose backpropagated loss is NaN while its gradient stays finite (a NaN constant added)."""

    def __call__(self, logprobs, batch, denominator):
        loss, metrics = super().__call__(logprobs, batch, denominator)
        return loss + float("nan"), metrics


def _learner(model_path: str, lr: float, backend: str = "fsdp2"):
    from actors.learner_base import LearnerRank

    cfg = LearnerConfig(lr=lr, micro_batch_size=2, max_grad_norm=1.0, backend=backend)
    return LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, model_path=model_path,
               model_cfg=ModelConfig(dtype="float32"), learner_cfg=cfg, temperature=1.0, with_reference=False, seed=0)


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in learner.iter_weight_buckets(2**20, torch.float32, keep=True) for n, t in bucket}


def _until_stopped(learner, batch, health: TrainHealth, steps: int = 8) -> tuple[list, str]:
    """Train steps until `health` stops them: [(metrics, weights all finite)] and the error's text."""
    seen = []
    for step in range(steps):
        metrics = learner.train_step(batch, GRPO)
        seen.append((metrics, all(bool(t.isfinite().all()) for t in _weights(learner).values())))
        try:
            health.check(step, metrics)
        except NonfiniteTraining as e:
            return seen, str(e)
    return seen, ""


def _nan_advantage(batch):
    return replace(batch, advantages=batch.advantages.clone().index_fill_(0, torch.tensor([0]), math.nan))


def _rank_main(rank: int, model_path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", 1), rank=0, world_size=1)
    learner = _learner(model_path, lr=1e-3)
    batch = make_batch(learner.model_config.vocab_size)
    nan_batch = _nan_advantage(batch)
    res = {"initial": _weights(learner)}
    res["nan_loss"] = (learner.train_step(batch, NanLoss(loss_agg="token-mean")), _weights(learner))
    res["nan_grad"] = (learner.train_step(nan_batch, GRPO), _weights(learner), len(learner.sharding.optimizer.state),
                       learner.sharding.scheduler.last_epoch)
    res["clean"] = (learner.train_step(batch, GRPO), _weights(learner))
    for lr in (1e30, 1e39):
        health = TrainHealth(3, lr=lr, max_grad_norm=1.0, dtype="float32")
        res[f"lr{lr:.0e}".replace("+", "")] = _until_stopped(_learner(model_path, lr=lr), batch, health)
    # DeepSpeed (ZeRO-2), on a fresh learner in the same process and group (a spawn of its own only
    # repeated the imports).
    learner = _learner(model_path, lr=1e-3, backend="deepspeed")
    ds = {"initial": _weights(learner)}
    ds["nan_grad"] = (learner.train_step(nan_batch, GRPO), _weights(learner))
    ds["clean"] = (learner.train_step(batch, GRPO), _weights(learner))
    res["deepspeed"] = ds
    torch.save(res, f"{out}/result.pt")
    dist.destroy_process_group()


def _spawn(target, model_path: str, out: Path) -> dict:
    """Run `target(0, model_path, out)` in a spawned process (one rank); its results."""
    proc = mp.get_context("spawn").Process(target=target, args=(0, model_path, str(out)))
    proc.start()
    proc.join(timeout=600)
    assert proc.exitcode == 0
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def results(tiny_qwen2, tmp_path_factory) -> dict:
    return _spawn(_rank_main, str(tiny_qwen2), tmp_path_factory.mktemp("nonfinite"))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_loss_with_finite_gradients_is_skipped(results):
    metrics, weights = results["nan_loss"]
    assert metrics.values["train/nonfinite_skipped"] == 1.0 and metrics.values["train/nonfinite_params"] == 0.0
    assert math.isfinite(metrics.grad_norm)  # the gradient was fine: the loss alone decided
    assert _same(weights, results["initial"])


def test_nan_gradients_are_skipped_and_leave_no_trace(results):
    metrics, weights, adam_states, scheduler_steps = results["nan_grad"]
    assert metrics.values["train/nonfinite_skipped"] == 1.0 and math.isnan(metrics.grad_norm)
    assert _same(weights, results["initial"])
    assert adam_states == 0 and scheduler_steps == 0  # no optimizer or scheduler step happened
    clean, after = results["clean"]
    assert clean.values["train/nonfinite_skipped"] == 0.0 and math.isfinite(clean.grad_norm)
    assert all(bool(t.isfinite().all()) for t in after.values())  # no NaN gradient was left behind
    assert not _same(after, results["initial"])


def test_deepspeed_skips_nan_gradients_and_reports_it(results):
    """DeepSpeed's engine holds the gradients itself: its own step skips a NaN/inf grad norm, and
    the learner reports that step as skipped (the next clean step updates as usual)."""
    res = results["deepspeed"]
    metrics, weights = res["nan_grad"]
    assert metrics.values["train/nonfinite_skipped"] == 1.0 and not math.isfinite(metrics.grad_norm)
    assert _same(weights, res["initial"])
    clean, after = res["clean"]
    assert clean.values["train/nonfinite_skipped"] == 0.0 and clean.values["train/nonfinite_params"] == 0.0
    assert all(bool(t.isfinite().all()) for t in after.values()) and not _same(after, res["initial"])


def test_lr_1e30_is_stopped_after_max_nonfinite_steps_without_nan_weights(results):
    """The first update (finite gradient, lr 1e30) leaves huge but finite weights; every later
    forward pass is NaN, so those steps are skipped until the third in a row stops the run."""
    seen, error = results["lr1e30"]
    assert [m.values["train/nonfinite_skipped"] for m, _ in seen] == [0.0, 1.0, 1.0, 1.0]
    assert [m.values["train/nonfinite_params"] for m, _ in seen] == [0.0] * 4
    assert all(finite for _, finite in seen)
    assert error == ("the loss or gradient was NaN/inf for 3 step(s) in a row, each skipped without an update "
                     "(step 3: loss nan, grad_norm nan; learner.max_nonfinite_steps=3). Likely cause: "
                     "learner.lr=1e+30, learner.max_grad_norm=1, model.dtype=float32")


def test_weights_that_become_inf_stop_at_once(results):
    seen, error = results["lr1e39"]
    assert len(seen) == 1  # the first update: finite loss and gradient, weights inf
    metrics, finite = seen[0]
    assert not finite and metrics.values["train/nonfinite_params"] == 1.0
    assert metrics.values["train/nonfinite_skipped"] == 0.0 and math.isfinite(metrics.grad_norm)
    assert error.startswith("the weights became NaN/inf in the optimizer step of step 0 (loss ")


def _step(skipped: bool = False, broken: bool = False) -> StepMetrics:
    return StepMetrics(loss=math.nan if skipped else 0.5, grad_norm=math.nan if skipped else 1.0,
                       values={"train/nonfinite_skipped": float(skipped), "train/nonfinite_params": float(broken)})


def test_train_health_counts_skipped_steps_in_a_row():
    health = TrainHealth(3, lr=1e30, max_grad_norm=1.0, dtype="bfloat16")
    for step, skipped in enumerate([True, True, False, True, True]):  # a good step resets the count
        health.check(step, _step(skipped))
    with pytest.raises(NonfiniteTraining) as err:
        health.check(5, _step(True))
    assert str(err.value) == ("the loss or gradient was NaN/inf for 3 step(s) in a row, each skipped without an "
                              "update (step 5: loss nan, grad_norm nan; learner.max_nonfinite_steps=3). Likely "
                              "cause: learner.lr=1e+30, learner.max_grad_norm=1, model.dtype=bfloat16")
    with pytest.raises(NonfiniteTraining, match="for 1 step"):
        TrainHealth(0, lr=1.0, max_grad_norm=1.0, dtype="float32").check(0, _step(True))  # 0: the first stops
    with pytest.raises(NonfiniteTraining, match="^the weights became NaN/inf in the optimizer step of step 7"):
        TrainHealth(3, lr=1.0, max_grad_norm=1.0, dtype="float32").check(7, _step(broken=True))


def test_the_run_summary_names_skipped_updates():
    from rlhf.run.metrics import run_summary

    records = [{"step": i, "timing/step_s": 1.0, "reward/mean": 0.5, "train/nonfinite_skipped": float(i in (2, 3))}
               for i in range(5)]
    assert "  skipped updates     2, NaN/inf loss or gradient (steps 2, 3)" in run_summary(records, "out")


class ScriptedLearners:
    """A LearnerGroup whose steps report what `script` says: "ok", "skip" (NaN loss) or "broken" weights."""

    def __init__(self, script: list[str]) -> None:
        self.script = iter(script)

    def train_step(self, batch, objective) -> StepMetrics:
        kind = next(self.script)
        values = {k: 0.0 for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                                   "logps/chosen", "logps/rejected")}
        return StepMetrics(loss=math.nan if kind == "skip" else 0.5, grad_norm=math.nan if kind == "skip" else 1.0,
                           values={**values, "train/nonfinite_skipped": float(kind == "skip"),
                                   "train/nonfinite_params": float(kind == "broken")})


@pytest.mark.parametrize("script,saved,stopped_at", [
    (["ok", "ok", "skip", "skip", "skip", "ok"], [1, 2, 3, 4], "step 4: loss nan"),
    (["ok", "broken", "ok"], [1], "optimizer step of step 1"),
])
def test_dpo_stops_before_saving_after_nonfinite_steps(tmp_path, monkeypatch, script, saved, stopped_at):
    """The DPO loop counts skipped steps like GRPO's, and the stop comes before that step's save."""
    import rlhf.dpo as dpo
    from rlhf.config import load_config
    from rlhf.data.preferences import PreferenceData
    from rlhf.types import PreferencePair

    saves = []
    monkeypatch.setattr(dpo, "save_checkpoint", lambda out, step, *args, **kwargs: saves.append(step))
    cfg = load_config(None, ["algorithm=dpo", f"output_dir={tmp_path}", "dpo.loss_type=simpo", "dpo.max_steps=6",
                             "dpo.pairs_per_step=1", "save_every=1"])
    data = PreferenceData(train=[PreferencePair([1, 2], [3, 4], [5])] * 4, eval=[])
    with pytest.raises(NonfiniteTraining, match=stopped_at):
        dpo.run_dpo(cfg, ScriptedLearners(script), data, pad_id=0)
    assert saves == saved


@pytest.mark.e2e
@pytest.mark.ray
def test_grpo_with_lr_1e30_exits_with_one_line_and_no_nonfinite_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from rlhf.run.checkpoint import checkpoint_root
    from tests.support.runs import run_training

    out = tmp_path / "run"
    # A dense reward: advantages are non-zero, so the first update really moves the weights.
    proc = run_training("scripts/train_grpo.py", "configs/grpo_tiny_cpu.yaml", out, "learner.lr=1e30",
                        "save_every=1", "grpo.steps=6",
                        "reward.functions=[{function: tests/fixtures/dense_rewards.py:digit_fraction}]")
    errors = [s for s in re.split(r"[\r\n]", proc.stderr) if s.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "NaN/inf" in errors[0] and "learner.lr=1e+30" in errors[0], errors[0]
    saved = sorted(checkpoint_root(out).glob("step_*/model/model.safetensors")) if checkpoint_root(out).is_dir() else []
    for path in saved:
        assert all(bool(t.isfinite().all()) for t in load_file(path).values()), path
    assert len(saved) < 6  # stopped before the end, and the final save did not happen
