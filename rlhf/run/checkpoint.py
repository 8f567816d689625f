"""Checkpoints that survive a crash mid-save, refuse to load when damaged or foreign, and fit the disk.

Layout of `<output_dir>/checkpoints/step_000042/`:
    model/                 HF safetensors + config + tokenizer (transformers and vLLM load it)
    adapter/               with LoRA: the adapter alone, PEFT format
    train_state/           the learner backend's own resumable state (sharded model + optimizer)
    run_state.json         step, prompt-stream position and queued rollouts, driver RNG state
    run_state.safetensors  the run state's tensors and long number lists (torch RNG, token ids)
    manifest.json          every other file's size and SHA-256, signed; written last: a complete save

Decisions, each a section of docs/design/checkpoints.md:
- Atomic saves: a save writes `.tmp_step_000042/`, then the manifest, then renames the folder, so
  a save killed at any point leaves the previous checkpoints untouched and nothing that looks whole.
- Verified resume: a checkpoint is checked against its manifest first; a damaged one is never
  loaded, and the one-line error names the file and the previous good checkpoint.
- Hashing once: about a second per GB, so a checkpoint is verified once per process.
- No foreign pickle: the train state holds pickles, so the driver loads only checkpoints whose
  manifest this machine signed (rlhf.run.signing); the run state is JSON + safetensors.
- Rotation (`keep_checkpoints=N`): older complete checkpoints go after each complete save, each
  renamed to a hidden `.del_` folder first.
- Model first: the learners write the HF export before the train state, and a failed save keeps a
  complete export as `step_000042_model_only/`; a full disk is a one-line RunError.
- Preflight: before Ray starts, `preflight_checkpoints` makes the signing key and checks that the
  checkpoints that will coexist fit the disk (`checkpoint_bytes`).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch

from rlhf.errors import CheckpointError, ConfigError, RunError
from rlhf.protocols import LearnerGroup
from rlhf.rules import checkpoint_due, learner_state
from rlhf.run import signing
from rlhf.run.signing import MANIFEST, read_run_state, write_run_state

if TYPE_CHECKING:
    from rlhf.config import RunConfig
    from rlhf.planner.shapes import ModelShape

_PREFIX = "step_"
_verified: set[Path] = set()  # hashing once
_estimates: dict[Path, int] = {}  # resolved output_dir -> estimated bytes of one checkpoint (preflight)
_DISK_FULL = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]", "StorageFull")


class UntrustedCheckpoint(CheckpointError):
    """A checkpoint whose manifest this machine did not sign ("No foreign pickle")."""


class CheckpointSaveError(RunError):
    """A save that found the disk full ("Model first")."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders whose save finished (they have a manifest), oldest first."""
    root = checkpoint_root(output_dir)
    return sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and (p / MANIFEST).is_file())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


# ---------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(output_dir: str | Path, step: int, learners: LearnerGroup, extra: dict[str, Any], *,
                    keep: int = 0) -> Path:
    """Checkpoint taken after `step` steps: the learners' files (HF export first), the run state
    with `extra` (data position etc.), the signed manifest, the rename ("Atomic saves"). Then, with
    `keep=N > 0`, older checkpoints beyond the newest N are deleted ("Rotation"). A failed save keeps
    its complete HF export; a full disk raises CheckpointSaveError ("Model first")."""
    root = checkpoint_root(output_dir)
    final, tmp = root / _name(step), root / f".tmp_{_name(step)}"
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed save of this step left
    tmp.mkdir(parents=True)
    try:
        learners.save(str(tmp))
        state = {"step": step, "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(), **extra}
        write_run_state(tmp, state)
        signing.write_manifest(tmp)
    except Exception as e:
        _failed_save(Path(output_dir), step, tmp, e)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(root)
    _verified.add(final)
    prune_checkpoints(output_dir, keep, newest=final)
    return final


def prune_checkpoints(output_dir: str | Path, keep: int, *, newest: Path | None = None) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep` (0: keep all), never `newest`
    (the one just written), and what a killed deletion left ("Rotation"). Returns those deleted."""
    root = checkpoint_root(output_dir)
    for leftover in root.glob(".del_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0:
        return []
    old = [p for p in complete_checkpoints(output_dir)[:-keep] if p != newest]
    for path in old:
        trash = root / f".del_{path.name}"
        path.rename(trash)  # out of the complete set at once
        _verified.discard(path)
        shutil.rmtree(trash, ignore_errors=True)
    return old


def _failed_save(output_dir: Path, step: int, tmp: Path, error: Exception) -> NoReturn:
    """Keep the save's complete HF export, drop the rest, and re-raise; a full disk becomes one
    line saying what it needed, what survived and what to do ("Model first")."""
    root = checkpoint_root(output_dir)
    kept: Path | None = root / f"{_name(step)}_model_only"
    if complete_hf_export(tmp / "model"):
        shutil.rmtree(kept, ignore_errors=True)
        (tmp / "model").rename(kept)
    else:
        kept = None
    written = _folder_bytes(tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # hand back what the partial save took
    if not is_disk_full(error):
        if kept is not None:
            print(f"the step-{step} save failed; its complete HF model export is kept in {kept}",
                  file=sys.stderr)
        raise error
    previous = latest_checkpoint(output_dir)
    if kept is not None:
        survived = (f"the trained weights survive as an HF model folder in {kept} (load it, or train on from it "
                    f"with model.path={kept})")
    else:
        survived = "the model export did not survive either"
    survived += f"; the previous complete checkpoint is {previous}" if previous else \
        "; no complete checkpoint exists"
    free = shutil.disk_usage(root).free
    raise CheckpointSaveError(
        f"the step-{step} checkpoint did not fit on the disk of {root}: it needs {_needed(output_dir, written)}, "
        f"{_size(free)} is free now that the partial save is deleted; {survived}; make room there, or set "
        f"keep_checkpoints=1, a larger save_every or an output_dir on a bigger disk") from None


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT here, or named in the message of a learner's failure (an ActorFailure)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(s in str(error) for s in _DISK_FULL)


def _needed(output_dir: Path, written: int) -> str:
    """One checkpoint's size: the previous one's (exact), else the preflight's estimate."""
    previous = latest_checkpoint(output_dir)
    if previous is not None:
        try:
            files = json.loads((previous / MANIFEST).read_text())["files"]
            return f"about {_size(sum(f['bytes'] for f in files.values()))} (the size of {previous.name})"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    estimate = _estimates.get(output_dir.resolve())
    if estimate:
        return f"about {_size(estimate)} (estimated)"
    return f"more than the {_size(written)} it wrote"


def complete_hf_export(folder: Path) -> bool:
    """Whether `folder` is a loadable HF export: a config.json, and every safetensors shard (those
    of the index, else model.safetensors) whole: its header parses and its size is exactly header
    plus data ("Model first")."""
    try:
        json.loads((folder / "config.json").read_text())
        index = folder / "model.safetensors.index.json"
        shards = (set(json.loads(index.read_text())["weight_map"].values()) if index.is_file()
                  else {"model.safetensors"})
        return all(_whole_safetensors(folder / name) for name in shards)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _whole_safetensors(path: Path) -> bool:
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            return False
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return size == 8 + n + end


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Verifying against the signed manifest (rlhf.run.signing)


def verify_checkpoint(path: Path) -> None:
    """Raise UntrustedCheckpoint unless this machine signed the manifest ("No foreign pickle"), then
    CheckpointError naming the first file that is missing, truncated, changed or unlisted."""
    if path in _verified:
        return
    manifest = signing.read_manifest(path)
    problem = signing.signature_problem(manifest["files"], manifest.get("signature"))
    if problem:
        raise UntrustedCheckpoint(f"{path} {problem}: its train state is pickled, and unpickling can run code, "
                                  f"so it is not loaded; {signing.trust_hint(path)}")
    signing.check_against_manifest(path, manifest["files"])
    _verified.add(path)


# ---------------------------------------------------------------------------------------------
# Resuming


def checkpoint_to_resume(output_dir: str | Path, mode: bool | Literal["previous"]) -> Path | None:
    """The verified checkpoint a run with `resume=mode` continues from: `true`, the latest one;
    `previous`, the newest good one before the latest (the fallback when the latest is damaged).
    None when there is none to resume (a fresh start). Raises CheckpointError (one line); one not
    signed here is never skipped over silently (UntrustedCheckpoint)."""
    done = complete_checkpoints(output_dir) if mode else []
    if not done:
        return None
    if mode == "previous":
        for path in reversed(done[:-1]):
            try:
                verify_checkpoint(path)
                return path
            except UntrustedCheckpoint:
                raise
            except CheckpointError as e:
                print(f"resume=previous: skipping {path.name}: {e}")
        raise CheckpointError(f"resume=previous: no good checkpoint before {done[-1]}")
    try:
        verify_checkpoint(done[-1])
    except UntrustedCheckpoint:
        raise
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
    """Restore learners and driver RNG from `path`, verified first ("Verified resume"); returns the run
    state (with 'step')."""
    verify_checkpoint(path)
    state = read_run_state(path)
    learners.load(str(path))
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


# ---------------------------------------------------------------------------------------------
# Disk space, checked before Ray starts ("Preflight")


def checkpoint_bytes(cfg: RunConfig, shape: ModelShape, model_path: str | Path) -> int:
    """Estimated size of one checkpoint, whatever the number of ranks: the HF export (b*P for P
    parameters in `model.dtype`'s b bytes, plus the source folder's other files: tokenizer,
    config; LoRA: the adapter, 4L) and the train state the backend keeps
    (`rlhf.rules.learner_state(...).saved`: FSDP2 12P, or 4P + 12L with LoRA; DeepSpeed 12P, plus
    the module b*P under ZeRO-2; with LoRA b*P + 12L)."""
    p, b = shape.params(), 4 if cfg.model.dtype == "float32" else 2
    lora = shape.lora_params(cfg.learner.lora_rank) if cfg.learner.lora_rank else 0
    folder = Path(model_path)
    other = sum(f.stat().st_size for f in folder.iterdir()
                if f.is_file() and not f.name.endswith((".safetensors", ".bin"))) if folder.is_dir() else 0
    export = b * p + other + 4 * lora
    return int(export + learner_state(cfg.learner, b, p, lora).saved)


def _coexisting(cfg: RunConfig, start: int) -> tuple[int, bool]:
    """How many checkpoints the run's remaining saves leave on disk at once (with
    keep_checkpoints=N: N, plus the one being written), and whether that count is exact (a DPO
    run sized by epochs has a step count only the data tells)."""
    steps = cfg.grpo.steps if cfg.algorithm == "grpo" else cfg.dpo.max_steps
    keep = cfg.keep_checkpoints
    if cfg.save_every < 0:
        return 0, True
    if not steps:
        return (keep + 1 if keep else 1), False
    saves = sum(1 for s in range(start + 1, steps + 1) if checkpoint_due(s, steps, cfg.save_every))
    return (min(saves, keep + 1) if keep else saves), True


def check_checkpoint_space(cfg: RunConfig, model_path: str | Path) -> None:
    """Raise ConfigError (one line) when the checkpoints that will coexist do not fit the free
    space of output_dir's disk ("Preflight")."""
    from rlhf.planner.shapes import model_shape

    try:
        shape = model_shape(str(model_path))
    except (ValueError, KeyError, TypeError):  # a config.json the planner cannot read: nothing to estimate
        return
    one = checkpoint_bytes(cfg, shape, model_path)
    out = Path(cfg.output_dir)
    _estimates[out.resolve()] = one
    latest = latest_checkpoint(out) if cfg.resume else None
    count, exact = _coexisting(cfg, int(latest.name[len(_PREFIX):]) if latest else 0)
    if count == 0:
        return
    folder = next(p for p in (checkpoint_root(out), *checkpoint_root(out).absolute().parents) if p.exists())
    free = shutil.disk_usage(folder).free
    if count * one <= free:
        return
    shrink = [] if cfg.keep_checkpoints == 1 or count == 1 else ["keep_checkpoints=1"]
    if cfg.save_every > 0 and count > 1:
        shrink.append(f"a larger save_every (now {cfg.save_every})")
    if not cfg.learner.lora_rank:
        shrink.append("learner.lora_rank=16 (no optimizer state for the base weights)")
    raise ConfigError(
        f"checkpoints need {'at least ' if not exact else ''}{count} x {_size(one)} = {_size(count * one)} under "
        f"{checkpoint_root(out)} (keep_checkpoints={cfg.keep_checkpoints}, save_every={cfg.save_every}), but "
        f"{folder} has {_size(free)} free: set {', '.join(shrink + ['an output_dir on a bigger disk'])}")


def preflight_checkpoints(cfg: RunConfig, model_path: str | Path) -> None:
    """What the checkpoints need, checked before Ray starts (scripts/launch.py cli): the signing
    key exists (made now) outside output_dir ("No foreign pickle"), and the disk has room.
    Raises ConfigError (one line)."""
    try:
        signing.load_key()
    except OSError as e:
        raise ConfigError(str(e)) from None
    key = signing.key_path().resolve()
    if key.is_relative_to(Path(cfg.output_dir).resolve()):
        raise ConfigError(f"the checkpoint signing key {key} is inside output_dir={cfg.output_dir}, where whoever "
                          f"writes checkpoints could read it: set {signing.KEY_DIR_ENV} to a folder outside it")
    check_checkpoint_space(cfg, model_path)
