"""Checkpoints: a save killed at any point leaves the previous one loadable and is ignored by
resume; a damaged latest checkpoint is refused with one line naming the file and the previous
good one, which `resume=previous` loads. (The real learners' save/load round trip is checked
end to end in test_grpo_e2e.py and test_faults.py; here fake learners write the files.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.run.checkpoint import (CheckpointError, checkpoint_to_resume, latest_checkpoint, load_checkpoint,
                                 save_checkpoint)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_key(tmp_path, monkeypatch):
    """This test's own signing key (rlhf.run.signing), never the user's; subprocesses inherit it."""
    monkeypatch.setenv("RLHF_KEY_DIR", str(tmp_path / "key"))


class FakeLearners:
    """Writes an HF-like model file and two shards of train state, as the learner ranks do."""

    def __init__(self, tag: bytes = b"w") -> None:
        self.tag, self.loaded = tag, None

    def save(self, path: str) -> None:
        out = Path(path)
        (out / "model").mkdir(parents=True)
        (out / "model" / "model.safetensors").write_bytes(self.tag * 4096)
        (out / "train_state").mkdir()
        for rank in range(2):
            (out / "train_state" / f"__{rank}_0.distcp").write_bytes(self.tag * 1000 + bytes([rank]))

    def load(self, path: str) -> None:
        self.loaded = (Path(path) / "model" / "model.safetensors").read_bytes()[:1]


def two_checkpoints(out: Path) -> tuple[Path, Path]:
    first = save_checkpoint(out, 1, FakeLearners(b"a"), {"prompts": {"cursor": 1}})
    second = save_checkpoint(out, 2, FakeLearners(b"b"), {"prompts": {"cursor": 2}})
    return first, second


def fresh(path: Path) -> Path:
    """The same folder under a new Path object: a check made in another process (the resume)."""
    import rlhf.run.checkpoint

    rlhf.run.checkpoint._verified.clear()
    return path


def test_save_is_complete_with_manifest_and_loads(tmp_path):
    first, second = two_checkpoints(tmp_path)
    assert latest_checkpoint(tmp_path) == second
    assert (second / "manifest.json").is_file() and not list((tmp_path / "checkpoints").glob(".tmp_*"))
    fresh(second)
    assert checkpoint_to_resume(tmp_path, True) == second
    assert checkpoint_to_resume(tmp_path, "previous") == first
    assert checkpoint_to_resume(tmp_path, False) is None
    learners = FakeLearners()
    assert load_checkpoint(second, learners)["prompts"] == {"cursor": 2} and learners.loaded == b"b"


KILL_POINTS = {
    # inside the learners' save: half the shards written
    "learners-save": "FakeLearners.save = lambda self, path: (Path(path, 'model').mkdir(parents=True), "
                     "Path(path, 'model', 'model.safetensors').write_bytes(b'x' * 10), die())",
    # all files written, the manifest half written
    "manifest": "import json; json.dump = lambda obj, f, **kw: (f.write('{\"files\": {'), f.flush(), die())",
    # everything written, killed just before the rename
    "rename": "Path.rename = lambda self, target: die()",
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_save_killed_at_any_point_leaves_the_previous_checkpoint(tmp_path, point):
    script = "\n".join([
        "import os, signal, sys",
        "from pathlib import Path",
        f"sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]",
        "from test_checkpoint_integrity import FakeLearners",
        "from rlhf.run.checkpoint import save_checkpoint",
        "def die(): os.kill(os.getpid(), signal.SIGKILL)",
        f"save_checkpoint({str(tmp_path)!r}, 1, FakeLearners(b'a'), {{'prompts': {{'cursor': 1}}}})",
        KILL_POINTS[point],
        f"save_checkpoint({str(tmp_path)!r}, 2, FakeLearners(b'b'), {{'prompts': {{'cursor': 2}}}})",
    ])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr  # SIGKILL, mid-save
    first = tmp_path / "checkpoints" / "step_000001"
    assert (tmp_path / "checkpoints" / ".tmp_step_000002").is_dir()  # the interrupted save, ignored
    assert latest_checkpoint(tmp_path) == first
    assert checkpoint_to_resume(tmp_path, True) == fresh(first)
    learners = FakeLearners()
    assert load_checkpoint(first, learners)["prompts"] == {"cursor": 1} and learners.loaded == b"a"
    # the next save of that step replaces the leftover
    assert save_checkpoint(tmp_path, 2, FakeLearners(b"b"), {"prompts": {}}) == tmp_path / "checkpoints" / "step_000002"
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-7])


def flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": (lambda c: truncate(c / "train_state" / "__1_0.distcp"),
                        r"train_state/__1_0.distcp has 994 bytes, the manifest says 1001 \(truncated\?\)"),
    "missing shard": (lambda c: (c / "train_state" / "__0_0.distcp").unlink(), r"train_state/__0_0.distcp is missing"),
    "changed byte": (lambda c: flip_byte(c / "model" / "model.safetensors"),
                     r"model/model.safetensors does not match its checksum"),
    "broken manifest": (lambda c: (c / "manifest.json").write_text("{"), r"manifest.json is unreadable"),
    "added file": (lambda c: (c / "train_state" / "__2_0.distcp").write_bytes(b"x"),
                   r"train_state/__2_0.distcp is not in the manifest \(added after the save\?\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_is_refused_and_previous_falls_back(tmp_path, damage):
    first, second = two_checkpoints(tmp_path)
    harm, message = DAMAGE[damage]
    harm(second)
    fresh(second)
    with pytest.raises(CheckpointError) as err:
        checkpoint_to_resume(tmp_path, True)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"the latest checkpoint is damaged: {second}/")
    assert line.endswith(f"the previous good checkpoint is {first}: resume from it with resume=previous")
    assert __import__("re").search(message, line), line
    assert checkpoint_to_resume(tmp_path, "previous") == first


def test_resume_previous_needs_an_earlier_good_checkpoint(tmp_path):
    only = save_checkpoint(tmp_path, 1, FakeLearners(), {"prompts": {}})
    with pytest.raises(CheckpointError, match=f"resume=previous: no good checkpoint before {only}"):
        checkpoint_to_resume(tmp_path, "previous")
    truncate(only / "run_state.json")
    fresh(only)
    with pytest.raises(CheckpointError, match="no earlier checkpoint is good: start again without resume"):
        checkpoint_to_resume(tmp_path, True)
