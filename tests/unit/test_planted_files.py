"""The two files a run reads weights-only outside the signed checkpoint machinery (RELIABILITY.md,
"No pickle read from disk is ever executed"): DPO's reference log-prob cache in the run folder and
FSDP2's scheduler state. A pickle planted in either never runs; the cache is refused in one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from rlhf.config import ConfigError, LearnerConfig, ModelConfig, RunConfig, load_config
from rlhf.data.preferences import PreferenceData
from tests.support.checkpoints import Bomb
from tests.support.learners import rendezvous_store


def _dpo_config(out: Path) -> RunConfig:
    return load_config("configs/dpo_tiny_cpu.yaml", [f"output_dir={out}"])


@pytest.mark.parametrize("planted", ["a pickle", "a tensor, not the cache"])
def test_a_planted_reference_cache_is_refused_in_one_line_and_never_runs(tmp_path, planted):
    from rlhf.dpo import ReferenceLogps

    marker = tmp_path / "pwned"
    cfg = _dpo_config(tmp_path / "run")
    assert cfg.dpo.loss_type != "simpo"  # SimPO reads no cache
    path = tmp_path / "run" / "reference_logps.pt"
    path.parent.mkdir()
    torch.save({"fingerprint": "x", "eval": Bomb(marker)} if planted == "a pickle" else torch.zeros(3), path)
    with pytest.raises(ConfigError) as err:
        ReferenceLogps.prepare(cfg, learners=None, data=PreferenceData(train=[], eval=[]), pad_id=0, start_step=0)
    line = str(err.value)
    assert not marker.exists()
    assert "\n" not in line and line.startswith(f"{path} is not a reference log-prob cache this program wrote")
    assert line.endswith("delete it to score the reference again")
    if planted == "a pickle":
        assert "Unsupported global: GLOBAL exec" in line and "could run code" in line


def test_a_planted_scheduler_state_never_runs(tiny_qwen2, tmp_path):
    """An FSDP2 rank saves its state, the scheduler file is swapped for a pickle, and loading refuses
    it before the pickle's code runs (FSDP2's `scheduler.pt` is loaded weights-only)."""
    import torch.distributed as dist

    from actors.learner_base import LearnerRank

    store = rendezvous_store(1)
    learner = LearnerRank(rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port,
                          model_path=str(tiny_qwen2), model_cfg=ModelConfig(dtype="float32"),
                          learner_cfg=LearnerConfig(backend="fsdp2", micro_batch_size=4), temperature=1.0,
                          with_reference=False, seed=0, driver_store=True)
    marker = tmp_path / "pwned"
    try:
        folder = tmp_path / "train_state"
        folder.mkdir()
        learner.sharding.save_state(folder)
        assert (folder / "scheduler.pt").is_file()
        learner.sharding.load_state(folder)  # what it wrote loads
        torch.save({"last_epoch": Bomb(marker)}, folder / "scheduler.pt")
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            learner.sharding.load_state(folder)
    finally:
        learner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not marker.exists()
