"""Fake learner groups and planted pickles for the checkpoint tests: the files a backend writes,
without starting one."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch


class Bomb:
    """A pickle that, when loaded, writes `marker`: what a planted checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def hf_export(folder: Path, tag: float = 1.0) -> None:
    """A small loadable HF-like folder: config.json and one whole safetensors file."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"w": torch.full((64, 64), tag)}, str(folder / "model.safetensors"))


class Learners:
    """A learner group that writes an HF export, then each backend's train-state files, and loads
    them as the backends' own libraries do (pickle.load, torch.load(weights_only=False)).
    `fail`: an exception raised after the export, while the train state is written."""

    FILES = {"fsdp2": [".metadata", "__0_0.distcp"], "deepspeed": ["state/mp_rank_00_model_states.pt"]}

    def __init__(self, backend: str = "fsdp2", fail: Exception | None = None) -> None:
        self.backend, self.fail, self.loaded = backend, fail, False

    def save(self, path: str) -> None:
        hf_export(Path(path) / "model")
        if self.fail is not None:
            (Path(path) / "train_state").mkdir()
            (Path(path) / "train_state" / "__0_0.distcp").write_bytes(b"partial")
            raise self.fail
        for name in self.FILES[self.backend]:
            target = Path(path) / "train_state" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name == ".metadata":
                target.write_bytes(pickle.dumps({"storage": [1, 2, 3]}))
            else:
                torch.save({"module": {"w": torch.ones(4)}}, target)

    def load(self, path: str) -> None:
        for name in self.FILES[self.backend]:
            target = Path(path) / "train_state" / name
            if name == ".metadata":
                with open(target, "rb") as f:
                    pickle.load(f)
            else:
                torch.load(target, weights_only=False)
        self.loaded = True


def state(step: int = 1) -> dict:
    """The run state a checkpoint at `step` saves."""
    return {"prompts": {"epoch": 0, "position": step, "queued": []}}
