"""The real learners' checkpoints (FSDP2, FSDP2 + LoRA, DeepSpeed; one rank each, in turn in one
spawned process): their size matches the disk-space preflight's estimate and the model export is
written first."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import rlhf.run.checkpoint as ckpt
from rlhf.config import load_config
from rlhf.planner.shapes import model_shape

ROOT = Path(__file__).resolve().parents[2]


CASES = [("fsdp2", 0), ("fsdp2", 8), ("deepspeed", 0)]


@pytest.fixture(autouse=True)
def fresh_estimates():
    """No estimate cached by an earlier test."""
    ckpt._estimates.clear()


def _learner_ranks(model_path: str, out: str, key_dir: str) -> None:
    """Each case in turn, one rank each (a fresh learner and process group per case, in one spawned
    process: a spawn per case only repeated its imports): `<out>/<backend>-<lora>/full` and `/failed`."""
    import torch.distributed.checkpoint as dcp

    from actors.learner_base import LearnerRank as cls
    from rlhf.algo.objectives import GRPOObjective
    from rlhf.config import GRPOConfig, LearnerConfig, ModelConfig
    from tests.support.learners import make_batch

    os.environ["RLHF_KEY_DIR"] = key_dir
    save = dcp.save
    for backend, lora in CASES:
        case = f"{out}/{backend}-{lora}"
        cfg = LearnerConfig(lr=1e-3, micro_batch_size=2, backend=backend, zero_stage=2, num_ranks=1, lora_rank=lora)
        # One rank: rank 0 serves its own store on an ephemeral port (0), which nobody else joins.
        learner = cls(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, model_path=model_path,
                      model_cfg=ModelConfig(dtype="float32"), learner_cfg=cfg, temperature=1.0, with_reference=False,
                      seed=0)
        learner.train_step(make_batch(1024), GRPOObjective.from_config(GRPOConfig(), max_len=16))
        learner.save(f"{case}/full", model_path, "float32")

        # The same save on a disk that fills up while the train state is written.
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        dcp.save = full
        if backend == "deepspeed":
            learner.sharding.engine.save_checkpoint = full
        try:
            learner.save(f"{case}/failed", model_path, "float32")
        except OSError:
            pass
        dcp.save = save
        learner.shutdown()


@pytest.fixture(scope="module")
def saved(tiny_qwen2, tmp_path_factory) -> Path:
    """The folder of every case's checkpoints, saved under this module's own signing key, never the
    user's (one spawned process for the module)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ckpt-sizes")
    proc = mp.get_context("spawn").Process(target=_learner_ranks, args=(str(tiny_qwen2), str(out), str(out / "key")))
    proc.start()
    proc.join(timeout=600)
    assert proc.exitcode == 0
    return out


@pytest.mark.parametrize("backend,lora", CASES)
def test_real_checkpoint_size_matches_the_estimate_and_model_comes_first(saved, tmp_path, tiny_qwen2, backend, lora,
                                                                           monkeypatch):
    monkeypatch.setenv("RLHF_KEY_DIR", str(saved / "key"))
    case = saved / f"{backend}-{lora}"
    real = ckpt._folder_bytes(case / "full")
    cfg = load_config(ROOT / "configs" / "grpo_tiny_cpu.yaml", [f"output_dir={tmp_path / 'run'}",
                      f"learner.backend={backend}", f"learner.lora_rank={lora}", "learner.zero_stage=2"])
    estimate = ckpt.checkpoint_bytes(cfg, model_shape(str(tiny_qwen2)), tiny_qwen2)
    assert abs(estimate - real) <= 0.2 * real, (estimate, real)
    assert ckpt.complete_hf_export(case / "failed" / "model")  # written before the train state failed
