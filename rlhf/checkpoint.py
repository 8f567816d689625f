"""Checkpoints that survive a crash mid-save: write into a temp folder, then rename.

Layout of `<output_dir>/checkpoints/step_000042/`:
    model/         HF safetensors + config + tokenizer (transformers and vLLM load it)
    train_state/   the learner backend's own resumable state (sharded model + optimizer)
    run_state.pt   step, prompt-stream position, driver RNG state
A rename is atomic on one filesystem, so `latest_checkpoint` only ever sees complete folders.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhf.protocols import LearnerGroup

_PREFIX = "step_"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    root = checkpoint_root(output_dir)
    done = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / "run_state.pt").is_file())
    return done[-1] if done else None


def save_checkpoint(output_dir: str | Path, step: int, learners: LearnerGroup, extra: dict[str, Any]) -> Path:
    """Checkpoint taken after `step` steps. `extra` (data position etc.) goes in run_state.pt."""
    root = checkpoint_root(output_dir)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp_{_PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    learners.save(str(tmp))
    state = {"step": step, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(), **extra}
    torch.save(state, tmp / "run_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(path: Path, learners: LearnerGroup) -> dict[str, Any]:
    """Restore learners and driver RNG from `path`; returns run_state (with 'step')."""
    learners.load(str(path))
    state = torch.load(path / "run_state.pt", weights_only=False)
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state


def resume_from_latest(output_dir: str | Path, learners: LearnerGroup, stream: Any) -> int:
    """Restore the newest checkpoint under `output_dir` into `learners` and the data `stream`
    (anything with load_state_dict, saved under run_state's "prompts"); return its step, or 0."""
    path = latest_checkpoint(output_dir)
    if path is None:
        return 0
    state = load_checkpoint(path, learners)
    stream.load_state_dict(state["prompts"])
    print(f"resumed from {path} (step {state['step']})")
    return int(state["step"])
