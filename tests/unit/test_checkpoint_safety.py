"""Checkpoints are safe to resume and never cost a run its weights or its disk:

- no pickle planted in a checkpoint runs (run state, FSDP2's DCP `.metadata`, DeepSpeed's state
  files), even when the attacker rewrites the manifest's checksums: the driver refuses a
  checkpoint this machine did not sign, in one line, before any learner loads; the learners'
  own readers refuse such pickles too;
- `keep_checkpoints=N` deletes only complete checkpoints older than the newest N;
- the disk-space preflight refuses, in one line and before Ray, a run whose checkpoints cannot fit;
  its estimate matches the real learners' checkpoints;
- a save that fails keeps the complete HF export, and a full disk is one line.

Fake learner groups write the files here; the real learners run in spawned single-rank processes
only where their own files matter (sizes, save order, readers).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rlhf.run.checkpoint as ckpt
from rlhf.config import ConfigError, load_config
from rlhf.errors import RunError
from rlhf.planner.shapes import model_shape
from rlhf.run import signing
from rlhf.run.checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    UntrustedCheckpoint,
    checkpoint_to_resume,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rlhf.types import Completion, PromptRow
from tests.support.checkpoints import Bomb, Learners, hf_export, state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_key(tmp_path, monkeypatch):
    """This test's own signing key, never the user's; subprocesses inherit it."""
    monkeypatch.setenv("RLHF_KEY_DIR", str(tmp_path / "key"))
    ckpt._verified.clear()
    ckpt._estimates.clear()


def rewrite_manifest(folder: Path, how: str) -> None:
    """What an attacker who can write the folder does after planting a file: recompute every
    checksum, and drop the signature, keep the old one, or sign with their own machine's key."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": signing._sha256(p)}
    manifest["files"] = files
    if how == "unsigned":
        manifest.pop("signature")
    elif how == "their key":
        key = os.urandom(32)
        manifest["signature"] = {"hmac_sha256": signing._digest(key, files), "key_id": signing.key_id(key)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def plant(folder: Path, where: str, marker: Path) -> None:
    if where == "run_state":  # an earlier version's pickled run state, in place of the JSON one
        for name in ("run_state.json", "run_state.safetensors"):
            (folder / name).unlink()
        torch.save({"step": 1, "prompts": Bomb(marker)}, folder / "run_state.pt")
    elif where == "fsdp2 .metadata":
        (folder / "train_state" / ".metadata").write_bytes(pickle.dumps(Bomb(marker)))
    else:
        torch.save({"module": Bomb(marker)}, folder / "train_state" / "state" / "mp_rank_00_model_states.pt")


# ---------------------------------------------------------------------------------------------
# 1. No planted pickle runs


@pytest.mark.parametrize("how", ["unsigned", "stale signature", "their key"])
@pytest.mark.parametrize("where", ["run_state", "fsdp2 .metadata", "deepspeed state"])
def test_planted_pickle_is_refused_before_anything_loads(tmp_path, where, how):
    marker = tmp_path / "pwned"
    backend = "deepspeed" if where == "deepspeed state" else "fsdp2"
    path = save_checkpoint(tmp_path / "run", 1, Learners(backend), state())
    plant(path, where, marker)
    rewrite_manifest(path, how)
    ckpt._verified.clear()  # the resume is another process
    with pytest.raises(UntrustedCheckpoint) as err:
        checkpoint_to_resume(tmp_path / "run", True)
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(path))
    assert str(signing.key_path()) in line and f"python -m rlhf.run.signing {path}" in line
    learners = Learners(backend)
    with pytest.raises(UntrustedCheckpoint):  # loading it directly verifies too
        load_checkpoint(path, learners)
    assert not learners.loaded and not marker.exists()


def test_unsigned_checkpoint_is_one_error_line_from_the_command_line_before_ray(tmp_path):
    """The real command line on a planted checkpoint: exit 2, one `error:` line naming the folder,
    no traceback; RAY_ADDRESS points at nothing, so a started Ray would fail differently."""
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    path = save_checkpoint(out, 1, Learners(), state())
    plant(path, "fsdp2 .metadata", marker)
    rewrite_manifest(path, "unsigned")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_tiny_cpu.yaml",
                           f"output_dir={out}", "resume=true"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {path} has an unsigned manifest"), lines[0]
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_fsdp2_reader_refuses_a_planted_metadata_pickle(tmp_path):
    """Defence in depth, should a planted file be signed after all: FSDP2's load reads DCP's
    `.metadata` with an unpickler that only builds DCP's metadata classes, and DCP's non-tensor
    items weights-only. A real DCP checkpoint still round-trips."""
    import torch.distributed.checkpoint as dcp

    from actors.fsdp2_learner import _SafePlanner, load_train_state

    saved = {"w": torch.arange(6.0), "optim": {"lr": 0.1, "betas": (0.9, 0.99), "step": torch.tensor(3.0)}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ts"), no_dist=True)
    into = {"w": torch.zeros(6), "optim": {"lr": 0.0, "betas": (0.0, 0.0), "step": torch.tensor(0.0)}}
    load_train_state(into, tmp_path / "ts")
    assert torch.equal(into["w"], saved["w"]) and into["optim"]["lr"] == 0.1 and into["optim"]["betas"] == (0.9, 0.99)

    marker = tmp_path / "pwned"
    (tmp_path / "ts" / ".metadata").write_bytes(pickle.dumps(Bomb(marker)))
    with pytest.raises(pickle.UnpicklingError, match="builtins.exec is not allowed"):
        load_train_state(into, tmp_path / "ts")
    import io

    buffer = io.BytesIO()
    torch.save(Bomb(marker), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        _SafePlanner().load_bytes(None, buffer)
    assert not marker.exists()


def test_deepspeed_reader_refuses_a_planted_state_pickle(tmp_path):
    """Defence in depth for DeepSpeed: the learner's load swaps the engine's checkpoint reader
    (torch.load with weights_only=False) for a weights-only one before DeepSpeed reads a file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from actors.deepspeed_learner import DeepSpeedSharding, weights_only_load

    good = tmp_path / "good.pt"
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "w": torch.ones(2)}, good)
    assert weights_only_load(str(good))["zero_stage"] == ZeroStageEnum.gradients

    marker, planted = tmp_path / "pwned", tmp_path / "train_state" / "state" / "mp_rank_00_model_states.pt"
    planted.parent.mkdir(parents=True)
    torch.save({"module": Bomb(marker)}, planted)

    class Engine:  # DeepSpeedEngine's load path: every state file through its checkpoint engine
        checkpoint_engine = TorchCheckpointEngine()

        def load_checkpoint(self, folder, **kwargs):
            return self.checkpoint_engine.load(str(planted), map_location="cpu"), None

    with pytest.raises(pickle.UnpicklingError):
        DeepSpeedSharding.load_state(SimpleNamespace(engine=Engine()), tmp_path / "train_state")
    assert not marker.exists()


def test_old_pickled_run_state_loads_only_signed_and_weights_only(tmp_path):
    """An earlier version's run_state.pt: refused unsigned (above), read once its folder is
    deliberately signed here, and even then a planted object in it is refused."""
    path = save_checkpoint(tmp_path, 1, Learners(), state())
    for name in ("run_state.json", "run_state.safetensors"):
        (path / name).unlink()
    old = {"step": 1, "python_rng": __import__("random").getstate(), "torch_rng": torch.get_rng_state(),
           "prompts": {"queued": [{"rows": [PromptRow("1+1?", "2")], "completions": [Completion([5], [-0.5], "stop")]}]}}
    torch.save(old, path / "run_state.pt")
    rewrite_manifest(path, "unsigned")
    assert signing.main([str(path)]) == 0  # the deliberate act of trust
    got = load_checkpoint(path, Learners())
    assert got["prompts"]["queued"][0]["completions"][0] == Completion([5], [-0.5], "stop")

    marker = tmp_path / "pwned"
    torch.save({**old, "prompts": Bomb(marker)}, path / "run_state.pt")
    assert signing.main([str(path)]) == 1  # a file that does not match its manifest is never signed
    rewrite_manifest(path, "unsigned")  # an old checkpoint whose pickled run state was planted
    assert signing.main([str(path)]) == 0  # ... and trusted by mistake
    with pytest.raises(CheckpointError, match="weights-only unpickler refused it") as err:
        load_checkpoint(path, Learners())
    assert "\n" not in str(err.value) and not marker.exists()


def test_trust_is_deliberate_copy_the_key_or_sign_here(tmp_path, monkeypatch):
    """A checkpoint written under another key is refused; copying that key here, or signing the
    folder here (which first checks every file), makes it load. A damaged one is never signed."""
    path = save_checkpoint(tmp_path / "run", 1, Learners(), state())
    theirs = signing.key_path().read_bytes()
    monkeypatch.setenv("RLHF_KEY_DIR", str(tmp_path / "other-machine"))
    ckpt._verified.clear()
    with pytest.raises(UntrustedCheckpoint, match="signed with another machine's key"):
        checkpoint_to_resume(tmp_path / "run", True)
    signing.key_path().write_bytes(theirs)  # copy the key file over
    assert checkpoint_to_resume(tmp_path / "run", True) == path

    monkeypatch.setenv("RLHF_KEY_DIR", str(tmp_path / "third-machine"))
    ckpt._verified.clear()
    with pytest.raises(UntrustedCheckpoint):
        checkpoint_to_resume(tmp_path / "run", True)
    assert signing.main([str(path)]) == 0
    assert checkpoint_to_resume(tmp_path / "run", True) == path

    (path / "model" / "config.json").write_text("{}")
    assert signing.main([str(path)]) == 1  # does not match its manifest: not signed


def test_signing_key_is_private_and_outside_output_dir(tmp_path, monkeypatch):
    key = signing.load_key()
    path = signing.key_path()
    assert path == tmp_path / "key" / "checkpoint.key" and len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and signing.load_key() == key  # made once
    path.chmod(0o644)
    with pytest.raises(signing.SigningKeyError, match="open to other users"):
        signing.load_key()
    path.chmod(0o600)
    monkeypatch.setenv("RLHF_KEY_DIR", str(tmp_path / "run" / "keys"))
    cfg = load_config(ROOT / "configs" / "grpo_tiny_cpu.yaml", [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="is inside output_dir"):
        ckpt.preflight_checkpoints(cfg, tmp_path)


def test_run_state_is_json_and_safetensors_and_round_trips_exactly(tmp_path):
    rows = [PromptRow([{"role": "user", "content": "2+2?"}], "4", {"level": 3, "tags": ["a"]})]
    completions = [Completion(list(range(40)), [-(i + 0.1) / 7 for i in range(40)], "length"),
                   Completion([1, 2], [-0.25, float("-inf")], "stop")]
    queued = [{"step": 2, "version": 1, "rows": rows, "prompt_ids": [list(range(30))], "completions": completions,
               "engine_metrics": {"gen/engine0_s": 0.5}}]
    path = save_checkpoint(tmp_path, 1, Learners(), {"prompts": {"epoch": 0, "position": 4, "queued": queued}})
    assert not list(path.glob("*.pt")) and json.loads((path / "run_state.json").read_text())["step"] == 1
    got = load_checkpoint(path, Learners())
    assert got["prompts"]["queued"] == queued and got["step"] == 1
    with pytest.raises(TypeError, match="cannot hold object"):
        save_checkpoint(tmp_path, 2, Learners(), {"prompts": {"x": object()}})


# ---------------------------------------------------------------------------------------------
# 2. keep_checkpoints


def test_keep_checkpoints_deletes_only_complete_older_ones(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, Learners(), state(step), keep=2)
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005"]
    # a failed save prunes nothing: the newest N stay the newest complete ones
    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(tmp_path, 6, Learners(fail=RuntimeError("boom")), state(), keep=1)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    # the one just written is never deleted, even behind a later-numbered one (resume=previous)
    save_checkpoint(tmp_path, 3, Learners(), state(), keep=1)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000003", "step_000005"]
    # a deletion killed half-way left a hidden folder: never complete, removed by the next save
    (root / "step_000005").rename(root / ".del_step_000005")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000003"]
    save_checkpoint(tmp_path, 7, Learners(), state(), keep=0)  # keep=0: keep all
    assert not list(root.glob(".del_*")) and [p.name for p in complete_checkpoints(tmp_path)] == [
        "step_000003", "step_000007"]


# ---------------------------------------------------------------------------------------------
# 3. Disk-space preflight


def tiny_cfg(tmp_path, *overrides):
    return load_config(ROOT / "configs" / "grpo_tiny_cpu.yaml", [f"output_dir={tmp_path / 'run'}", *overrides])


def fake_free(monkeypatch, free: int) -> None:
    """The disk under output_dir has `free` bytes free (for the preflight)."""
    usage = SimpleNamespace(total=free, used=0, free=free)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage)


def test_preflight_counts_the_checkpoints_that_coexist(tmp_path, tiny_qwen2, monkeypatch):
    one = ckpt.checkpoint_bytes(tiny_cfg(tmp_path), model_shape(str(tiny_qwen2)), tiny_qwen2)
    cases = {("grpo.steps=4", "save_every=2"): 2, ("grpo.steps=10", "save_every=1"): 10,
             ("grpo.steps=10", "save_every=1", "keep_checkpoints=1"): 2, ("grpo.steps=10", "save_every=0"): 1}
    for overrides, count in cases.items():
        fake_free(monkeypatch, count * one)  # exactly enough
        ckpt.check_checkpoint_space(tiny_cfg(tmp_path, *overrides), tiny_qwen2)
        fake_free(monkeypatch, count * one - 1)
        with pytest.raises(ConfigError) as err:
            ckpt.check_checkpoint_space(tiny_cfg(tmp_path, *overrides), tiny_qwen2)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"checkpoints need {count} x "), line
        assert f"{tmp_path / 'run' / 'checkpoints'}" in line and "an output_dir on a bigger disk" in line
        assert ("set keep_checkpoints=1" in line) == (count > 1 and "keep_checkpoints=1" not in overrides)
    lora = tiny_cfg(tmp_path, "learner.lora_rank=8")
    assert ckpt.checkpoint_bytes(lora, model_shape(str(tiny_qwen2)), tiny_qwen2) < 0.6 * one


def test_save_every_minus_one_saves_nothing_and_needs_no_disk(tmp_path, tiny_qwen2, monkeypatch):
    """`save_every=-1` (benchmarks): no step is due, not even the last, and the preflight asks for no space."""
    from rlhf.rules import checkpoint_due

    assert [s for s in range(1, 11) if checkpoint_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 11) if checkpoint_due(s, 10, 0)] == [10]
    assert not any(checkpoint_due(s, 10, -1) for s in range(1, 11))
    fake_free(monkeypatch, 0)
    ckpt.check_checkpoint_space(tiny_cfg(tmp_path, "grpo.steps=10", "save_every=-1"), tiny_qwen2)
    with pytest.raises(ConfigError, match=r"^save_every=-2 is not allowed: an integer >= -1 "):
        tiny_cfg(tmp_path, "save_every=-2")


def test_preflight_stops_the_command_line_before_ray(tmp_path, monkeypatch, capsys):
    import importlib.util

    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.chdir(ROOT)
    fake_free(monkeypatch, 1000)
    spec = importlib.util.spec_from_file_location("_safety_train_grpo", ROOT / "scripts" / "train_grpo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--config", "configs/grpo_tiny_cpu.yaml", f"output_dir={tmp_path / 'run'}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: checkpoints need 2 x ") and "0.0 MB free" in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# 4. A failed save keeps the weights; a full disk is one line


def enospc_in_learner() -> Exception:
    from actors.actor_group import ActorFailure

    return ActorFailure("learner rank 1 failed during save: OSError: [Errno 28] No space left on device: "
                        "'/x/.tmp_step_000003/train_state/__1_0.distcp'")


@pytest.mark.parametrize("failure", ["driver", "learner"])
def test_full_disk_keeps_the_model_export_and_is_one_line(tmp_path, failure):
    previous = save_checkpoint(tmp_path, 2, Learners(), state())
    error = OSError(errno.ENOSPC, "No space left on device") if failure == "driver" else enospc_in_learner()
    with pytest.raises(CheckpointSaveError) as err:
        save_checkpoint(tmp_path, 3, Learners(fail=error), state())
    assert isinstance(err.value, RunError)
    kept = tmp_path / "checkpoints" / "step_000003_model_only"
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"the step-3 checkpoint did not fit on the disk of {tmp_path}")
    assert f"(the size of {previous.name})" in line and "is free now" in line
    assert f"survive as an HF model folder in {kept}" in line and f"previous complete checkpoint is {previous}" in line
    assert "keep_checkpoints=1" in line
    from safetensors.torch import load_file

    assert (kept / "config.json").is_file() and torch.equal(load_file(kept / "model.safetensors")["w"],
                                                             torch.ones(64, 64))
    assert latest_checkpoint(tmp_path) == previous and not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_failed_save_without_a_whole_export_says_so(tmp_path):
    class Truncating(Learners):
        def save(self, path: str) -> None:
            hf_export(Path(path) / "model")
            shard = Path(path) / "model" / "model.safetensors"
            shard.write_bytes(shard.read_bytes()[:-10])  # the export itself hit the full disk
            raise OSError(errno.ENOSPC, "No space left on device")

    ckpt._estimates[tmp_path.resolve()] = 7_000_000_000  # what the preflight estimated
    with pytest.raises(CheckpointSaveError) as err:
        save_checkpoint(tmp_path, 1, Truncating(), state())
    line = str(err.value)
    assert "it needs about 7.0 GB (estimated)" in line and "the model export did not survive" in line
    assert "no complete checkpoint exists" in line
    assert not (tmp_path / "checkpoints" / "step_000001_model_only").exists()


def test_other_failures_keep_the_export_and_raise_as_they_were(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="^boom$"):
        save_checkpoint(tmp_path, 4, Learners(fail=RuntimeError("boom")), state())
    assert ckpt.complete_hf_export(tmp_path / "checkpoints" / "step_000004_model_only")
    assert "step_000004_model_only" in capsys.readouterr().err
