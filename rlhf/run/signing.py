"""What keeps foreign code out of a resume: a signed manifest, and a run state that is data only.

A checkpoint's resumable train state holds pickles (torch.distributed.checkpoint's `.metadata`,
DeepSpeed's state files), and unpickling runs whatever code the file names. So every checkpoint
carries a manifest, written and checked here, and resume loads a checkpoint only when its manifest
carries this machine's signature (`rlhf.run.checkpoint` asks on the driver before any learner reads
a byte); the learners also read what they can with restricted unpicklers, as a second line of
defence. The driver's own run state is no pickle.

Decisions (docs/design/checkpoints.md, "Signing" and "Run state as data"):
- The key: 32 random bytes, hex, in `~/.config/rlhf/checkpoint.key` (`$RLHF_KEY_DIR/` when set,
  e.g. for tests), made on first use with mode 0600 from its first byte, outside every output
  folder. Whoever can only write a run folder (a shared disk, a downloaded checkpoint) cannot
  sign; a key readable by other users is refused, since they could.
- What is signed: the manifest's file list (every file's size and SHA-256) in a canonical JSON
  form. The signature and the key's id (a hash of the key, never the key) sit in the manifest,
  so a signed manifest vouches for every byte of the checkpoint.
- Deliberate trust, one line away: a checkpoint from elsewhere is refused naming its folder;
  copy the key file from the machine that wrote it, or, knowing where the checkpoint came from,
  sign it here with `python -m rlhf.run.signing FOLDER` (which checks every file first).
- Run state as data: the run state (step, prompt-stream position, queued rollouts, RNG states) is
  `run_state.json` plus `run_state.safetensors` for its tensors and long number lists (token ids,
  log-probs: exact, and a quarter of their JSON size). Objects are tagged dataclasses from a fixed
  list (PromptRow, Completion); anything else is refused at save. An earlier version's
  `run_state.pt` is read, in a checkpoint signed here, by torch's weights-only unpickler.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

import torch

from rlhf.errors import CheckpointError
from rlhf.types import Completion, PromptRow

KEY_DIR_ENV = "RLHF_KEY_DIR"
MANIFEST = "manifest.json"
_KEY_FILE = "checkpoint.key"
RUN_STATE, RUN_TENSORS, LEGACY_RUN_STATE = "run_state.json", "run_state.safetensors", "run_state.pt"
_RUN_TYPES = {"PromptRow": PromptRow, "Completion": Completion}  # the only objects a run state holds
_TENSOR_MIN = 16  # number lists at least this long go to run_state.safetensors


class SigningKeyError(OSError):
    """The signing key cannot be made or read safely. The message is one line."""


def key_path() -> Path:
    """Where this user's checkpoint key lives ("The key")."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    folder = os.environ.get(KEY_DIR_ENV) or config / "rlhf"
    return Path(folder).expanduser() / _KEY_FILE


def load_key() -> bytes:
    """This machine's key, made on first use ("The key"). Raises SigningKeyError (one line)."""
    path = key_path()
    if not path.exists():
        _create_key(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise SigningKeyError(f"cannot read the checkpoint signing key {path} ({e.strerror or e})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SigningKeyError(f"the checkpoint signing key {path} is open to other users, who could sign "
                        f"checkpoints with it: chmod 600 {path}")
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise SigningKeyError(f"the checkpoint signing key {path} is not 64 hex digits: delete it to make a new one "
                        f"(checkpoints signed with it then need `python -m rlhf.run.signing FOLDER`)")
    return bytes.fromhex(text)


def _create_key(path: Path) -> None:
    """Write a new key atomically: a private temp file, hard-linked into place (a concurrent
    creator's key wins, and nobody ever reads a half-written one)."""
    tmp = path.with_name(f".{_KEY_FILE}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    except OSError as e:
        raise SigningKeyError(f"cannot create the checkpoint signing key {path} ({e.strerror or e}): set "
                        f"{KEY_DIR_ENV} to a private, writable folder outside output_dir") from None
    finally:
        tmp.unlink(missing_ok=True)


def key_id(key: bytes) -> str:
    """A name for the key that reveals nothing about it."""
    return hashlib.sha256(b"rlhf-key-id:" + key).hexdigest()[:16]


def _digest(key: bytes, files: dict[str, Any]) -> str:
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(files: dict[str, Any]) -> dict[str, str]:
    """The manifest's `signature` entry for `files` ("What is signed")."""
    key = load_key()
    return {"hmac_sha256": _digest(key, files), "key_id": key_id(key)}


def signature_problem(files: dict[str, Any], signature: Any) -> str | None:
    """None when `signature` is this machine's over `files`; else what is wrong, as a phrase."""
    if not isinstance(signature, dict) or "hmac_sha256" not in signature:
        return "has an unsigned manifest"
    key = load_key()
    if signature.get("key_id") != key_id(key):
        return f"was signed with another machine's key (id {signature.get('key_id')}, this one's is {key_id(key)})"
    if not hmac.compare_digest(str(signature["hmac_sha256"]), _digest(key, files)):
        return "has a manifest changed after it was signed"
    return None


def trust_hint(folder: Path) -> str:
    """How to trust `folder` deliberately ("Deliberate trust")."""
    return (f"to trust it, copy the key file {key_path()} from the machine that wrote it, or, if you know "
            f"where it came from, sign it here with `python -m rlhf.run.signing {folder}`")


# ---------------------------------------------------------------------------------------------
# The manifest: every file's size and SHA-256, signed ("What is signed")


def write_manifest(folder: Path) -> None:
    """`folder`'s manifest: every file in it with its size and SHA-256, signed, synced to disk."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    with open(folder / MANIFEST, "w") as f:
        json.dump({"files": files, "signature": sign(files)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint folder `path`. Raises CheckpointError (one line)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not isinstance(manifest["files"], dict):
            raise TypeError
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / MANIFEST} is unreadable ({type(e).__name__})") from None


def check_against_manifest(path: Path, files: dict[str, Any]) -> None:
    """Raise CheckpointError naming the first file of `path` that is missing, truncated, changed or
    not listed in the manifest's `files`."""
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"{p} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{p} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p} does not match its checksum in the manifest")
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p != path / MANIFEST)
    extra = [name for name in extra if name not in files]
    if extra:
        raise CheckpointError(f"{path / extra[0]} is not in the manifest (added after the save?)")


def resign_checkpoint(path: Path) -> None:
    """Sign `path`'s manifest with this machine's key, after checking every file against it: a
    deliberate act of trust ("Deliberate trust")."""
    manifest = read_manifest(path)
    check_against_manifest(path, manifest["files"])
    manifest["signature"] = sign(manifest["files"])
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(path / MANIFEST)


# ---------------------------------------------------------------------------------------------
# The run state: JSON and safetensors, nothing that runs code ("Run state as data")


def write_run_state(folder: Path, state: dict[str, Any]) -> None:
    """`state` as run_state.json, its tensors and long number lists as run_state.safetensors.
    Holds JSON types, tensors, PromptRow and Completion; anything else is a TypeError."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    text = json.dumps(_encode(state, tensors))
    save_file(tensors, str(folder / RUN_TENSORS))
    (folder / RUN_STATE).write_text(text)


def read_run_state(path: Path) -> dict[str, Any]:
    """What `write_run_state` wrote (python_rng back as the tuple random.setstate takes), or an
    earlier version's run_state.pt ("Run state as data"). Raises CheckpointError (one line)."""
    from safetensors.torch import load_file

    if not (path / RUN_STATE).is_file():
        if (path / LEGACY_RUN_STATE).is_file():
            return _read_legacy_run_state(path / LEGACY_RUN_STATE)
        raise CheckpointError(f"{path} has no {RUN_STATE}")
    state = _decode(json.loads((path / RUN_STATE).read_text()), load_file(str(path / RUN_TENSORS)))
    version, internal, gauss = state["python_rng"]
    state["python_rng"] = (version, tuple(internal), gauss)
    return state


def _read_legacy_run_state(path: Path) -> dict[str, Any]:
    """An earlier version's pickled run state, in a checkpoint signed here (the caller verified
    it), through torch's weights-only unpickler: tensors, containers and the two run-state
    dataclasses are built, nothing is called."""
    import pickle

    try:
        with torch.serialization.safe_globals(list(_RUN_TYPES.values())):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path} holds objects a run state never has, so it is not loaded "
                              f"(torch's weights-only unpickler refused it)") from None


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, (list, tuple)) and (numbers := _number_tensor(obj)) is not None:
        return {**_encode(numbers, tensors), "as_list": True}
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if dataclasses.is_dataclass(obj) and _RUN_TYPES.get(type(obj).__name__) is type(obj):
        return {"__type__": type(obj).__name__,
                **{f.name: _encode(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)}}
    tagged = isinstance(obj, dict) and {"__tensor__", "__type__"} & set(obj)
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and not tagged:
        return {k: _encode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"a checkpoint's run state cannot hold {type(obj).__name__} "
                    f"(JSON types with string keys, tensors, PromptRow and Completion only)")


def _number_tensor(items: list | tuple) -> torch.Tensor | None:
    """A long list of ints (int64 range) or of floats as one tensor; exact both ways."""
    if len(items) < _TENSOR_MIN:
        return None
    if all(type(v) is int for v in items) and -2**63 <= min(items) and max(items) < 2**63:
        return torch.tensor(items, dtype=torch.int64)
    if all(type(v) is float for v in items):
        return torch.tensor(items, dtype=torch.float64)
    return None


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        tensor = tensors[obj["__tensor__"]]
        return tensor.tolist() if obj.get("as_list") else tensor
    if "__type__" in obj:
        if obj["__type__"] not in _RUN_TYPES:
            raise ValueError(f"a run state names the unknown type {obj['__type__']!r}")
        fields = {k: _decode(v, tensors) for k, v in obj.items() if k != "__type__"}
        return _RUN_TYPES[obj["__type__"]](**fields)
    return {k: _decode(v, tensors) for k, v in obj.items()}



# ---------------------------------------------------------------------------------------------
# The trust command


def main(argv: list[str] | None = None) -> int:
    """`python -m rlhf.run.signing FOLDER...`: check each checkpoint against its manifest, then sign it
    with this machine's key ("Deliberate trust")."""
    folders = sys.argv[1:] if argv is None else argv
    if not folders or any(a.startswith("-") for a in folders):
        print("usage: python -m rlhf.run.signing CHECKPOINT_FOLDER... (signs them with this machine's key "
              f"{key_path()}; only for checkpoints whose origin you trust)", file=sys.stderr)
        return 2
    for folder in folders:
        try:
            resign_checkpoint(Path(folder))
        except (CheckpointError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"signed {folder} with {key_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
