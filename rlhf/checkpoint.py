"""Checkpoints that survive a crash mid-save and refuse to load when damaged.

Layout of `<output_dir>/checkpoints/step_000042/`:
    model/          HF safetensors + config + tokenizer (transformers and vLLM load it)
    train_state/    the learner backend's own resumable state (sharded model + optimizer)
    run_state.pt    step, prompt-stream position, driver RNG state
    manifest.json   every other file's size and SHA-256; written last, so it marks a complete save

Choices:
1. A save writes into `.tmp_step_000042/`, then the manifest, then renames the folder. A rename is
   atomic on one filesystem, so a save killed at any point leaves a hidden temp folder that
   nothing reads (the next save of that step replaces it) and the previous checkpoints untouched.
2. Resuming verifies the checkpoint against its manifest first (a truncated or missing file,
   e.g. a lost shard, or a changed byte). A damaged one is never loaded: the error is one line
   naming the file and the previous good checkpoint, which `resume=previous` resumes from.
3. Hashing costs about a second per GB on one core, at save and once more at resume; a
   checkpoint is verified once per process however often it is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf.protocols import LearnerGroup

_PREFIX = "step_"
MANIFEST = "manifest.json"
_verified: set[Path] = set()  # choice 3


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded (choice 2). The message is one line."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders whose save finished (they have a manifest), oldest first."""
    root = checkpoint_root(output_dir)
    return sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / MANIFEST).is_file())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def save_checkpoint(output_dir: str | Path, step: int, learners: LearnerGroup, extra: dict[str, Any]) -> Path:
    """Checkpoint taken after `step` steps. `extra` (data position etc.) goes in run_state.pt."""
    root = checkpoint_root(output_dir)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp_{_PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed save of this step left
    tmp.mkdir(parents=True)
    learners.save(str(tmp))
    state = {"step": step, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(), **extra}
    torch.save(state, tmp / "run_state.pt")
    _write_manifest(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(root)
    _verified.add(final)
    return final


def _write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    with open(folder / MANIFEST, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or changed."""
    if path in _verified:
        return
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path / MANIFEST} is unreadable ({type(e).__name__})") from None
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"{p} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p} does not match its checksum in the manifest")
    _verified.add(path)


def checkpoint_to_resume(output_dir: str | Path, mode: bool | Literal["previous"]) -> Path | None:
    """The verified checkpoint a run with `resume=mode` continues from: `true`, the latest one;
    `previous`, the newest good one before the latest (the fallback when the latest is damaged).
    None when there is none to resume (a fresh start). Raises CheckpointError (one line)."""
    done = complete_checkpoints(output_dir) if mode else []
    if not done:
        return None
    if mode == "previous":
        for path in reversed(done[:-1]):
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError as e:
                print(f"resume=previous: skipping {path.name}: {e}")
        raise CheckpointError(f"resume=previous: no good checkpoint before {done[-1]}")
    try:
        verify_checkpoint(done[-1])
    except CheckpointError as e:
        raise CheckpointError(f"the latest checkpoint is damaged: {e}; {_fallback(done[:-1])}") from None
    return done[-1]


def _fallback(older: list[Path]) -> str:
    for path in reversed(older):
        try:
            verify_checkpoint(path)
            return f"the previous good checkpoint is {path}: resume from it with resume=previous"
        except CheckpointError:
            continue
    return "no earlier checkpoint is good: start again without resume"


def load_checkpoint(path: Path, learners: LearnerGroup) -> dict[str, Any]:
    """Restore learners and driver RNG from `path`; returns run_state (with 'step')."""
    learners.load(str(path))
    state = torch.load(path / "run_state.pt", weights_only=False)
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state


def resume(output_dir: str | Path, mode: bool | Literal["previous"], learners: LearnerGroup, stream: Any) -> int:
    """Restore the checkpoint `resume=mode` names (`checkpoint_to_resume`) into `learners` and the
    data `stream` (anything with load_state_dict, saved under run_state's "prompts"); return its
    step, or 0 for a fresh start."""
    path = checkpoint_to_resume(output_dir, mode)
    if path is None:
        return 0
    state = load_checkpoint(path, learners)
    stream.load_state_dict(state["prompts"])
    print(f"resumed from {path} (step {state['step']})")
    return int(state["step"])
