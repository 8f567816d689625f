"""The run folder (`output_dir`) before a run starts: an earlier run is never overwritten by
accident, and a resume is checked against the checkpoint it continues, all before Ray starts.

Decisions:
- What an earlier run is: a folder with a complete checkpoint or a `metrics.jsonl` holding at
  least one record. A folder that is empty, or holds only what a run that died before its first
  step leaves (`config.yaml`, `logs/`, tracker folders), is not: a new run starts there as usual.
- Resume or overwrite: into an earlier run's folder, a run starts only with `resume=true` (it
  continues the run), or `overwrite=true`, which first deletes the files a run writes (`RUN_FILES`)
  and says so in one line; anything else in the folder is left alone. Without either it is refused
  in one line naming the folder, its last step and checkpoint, and the three ways on.
- Resume checked first (`check_resume`): a resume is checked against its checkpoint before Ray
  starts, so that a mismatch is one line naming what differs instead of a library's traceback from
  inside a learner: the model's shape (`<checkpoint>/model/config.json` against `model.path`'s
  `config.json`), the keys whose checkpoint the learners cannot load otherwise (`MUST_MATCH`, from
  the run's `config.yaml`; the learner backend also from the checkpoint's own files), and the data,
  whose prompt-stream fingerprint in the run state must be the current data's.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from rlhf.config import ConfigError, RunConfig, config_to_dict
from rlhf.run.checkpoint import checkpoint_root, checkpoint_to_resume, complete_checkpoints

RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.png", "logs", "tensorboard", "wandb", "mlruns",
             "trackers.json", "reference_logps.pt", "config.yaml")
"""What a training run writes into its output_dir: all of it goes with overwrite=true ("Resume or
overwrite")."""

SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
"""config.json keys that set the parameters' names and shapes."""

MUST_MATCH = ("algorithm", "learner.backend", "learner.lora_rank", "learner.lora_target_modules")
"""Keys a checkpoint must be resumed with: another value cannot load its train_state."""
DEEPSPEED_MUST_MATCH = ("learner.zero_stage", "learner.num_ranks")
"""DeepSpeed's train_state is partitioned per rank and stage (FSDP2's DCP reshards on load)."""
DATA_KEYS = ("seed", "data", "dpo.dataset", "dpo.num_train", "dpo.num_eval", "dpo.max_length",
             "dpo.max_prompt_length", "dpo.truncation", "dpo.on_malformed", "model.path")
"""Keys whose change changes the prompts or pairs a run streams (named when the data differ)."""


# ---------------------------------------------------------------------------------------------
# An earlier run


def metrics_steps(output_dir: str | Path) -> list[int]:
    """The `step` of each complete record of `<output_dir>/metrics.jsonl` (a torn last line, from
    a kill mid-write, is skipped)."""
    path = Path(output_dir) / "metrics.jsonl"
    steps = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return steps


def steps_done(steps: list[int]) -> str:
    """`3 steps` for records of steps 0-2 (a record's step is 0-based, a checkpoint's the count)."""
    n = max(steps, default=-1) + 1
    return f"{n} step{'' if n == 1 else 's'}"


def earlier_run(output_dir: str | Path) -> str | None:
    """What the earlier run in `output_dir` got to ("What an earlier run is"), e.g. `3 steps in metrics.jsonl,
    latest checkpoint .../step_000003`; None when there is none."""
    steps, done = metrics_steps(output_dir), complete_checkpoints(output_dir)
    if not steps and not done:
        return None
    logged = f"{steps_done(steps)} in metrics.jsonl" if steps else "no metrics.jsonl"
    return f"{logged}, " + (f"latest checkpoint {done[-1]}" if done else "no checkpoint")


def check_run_folder(cfg: RunConfig) -> Path | None:
    """Before anything else runs: the verified checkpoint to resume from (None for a fresh start).
    Refuses (ConfigError) a fresh start into an earlier run's folder without overwrite=true, and
    prints one line when resume finds nothing to resume."""
    out = cfg.output_dir
    if cfg.resume:
        path = checkpoint_to_resume(out, cfg.resume)  # verified: a damaged one is one line too
        if path is None:
            steps = metrics_steps(out)
            replaced = f" (its metrics.jsonl, {steps_done(steps)}, is replaced)" if steps else ""
            print(f"resume={str(cfg.resume).lower()}: no complete checkpoint in {checkpoint_root(out)}, "
                  f"so the run starts afresh at step 0{replaced}")
        return path
    found = earlier_run(out)
    if found is None or cfg.overwrite:
        return None
    resume = "continue it with resume=true, " if complete_checkpoints(out) else ""
    raise ConfigError(f"output_dir={out} holds an earlier run ({found}); {resume}write to another "
                      f"output_dir, or start afresh there with overwrite=true (deletes its checkpoints, "
                      f"metrics and logs)", key="output_dir")


def clear_earlier_run(output_dir: str | Path) -> str | None:
    """overwrite=true: delete the earlier run's files (RUN_FILES; nothing else in the folder) and
    return the line that says so; None when the folder holds no earlier run ("What an earlier run is")."""
    out = Path(output_dir)
    found = earlier_run(out)
    if found is None:
        return None
    gone = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    for name in gone:
        _delete(out / name)
    return f"overwrite=true: deleted the earlier run in {out} ({found}): {', '.join(gone)}"


def _delete(path: Path) -> None:
    """A file or folder; a symlinked folder (checkpoints on another disk) keeps its link and loses
    its contents, so that the new run's files go where the old run's went."""
    if path.is_symlink() and path.is_dir():
        for child in path.iterdir():
            _delete(child)
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# ---------------------------------------------------------------------------------------------
# A resume against its checkpoint


def check_resume(cfg: RunConfig, model_path: str, stream: Any) -> None:
    """Resume checked first: for `resume` set and a checkpoint found, raise ConfigError naming what differs
    between the checkpoint and this run (the model's shape, MUST_MATCH keys, the data behind
    `stream`, anything with PromptStream's `state_dict`)."""
    if not cfg.resume:
        return
    with contextlib.redirect_stdout(io.StringIO()):  # check_run_folder printed its lines already
        path = checkpoint_to_resume(cfg.output_dir, cfg.resume)
    if path is None:
        return
    saved = _saved_config(cfg.output_dir)
    differences = _shape_differences(path / "model" / "config.json", Path(model_path) / "config.json")
    differences += _setting_differences(cfg, saved, path)
    if not differences:
        differences = _data_differences(cfg, saved, path, stream)
    if differences:
        raise ConfigError(f"resume={str(cfg.resume).lower()}: {path} does not fit this run: "
                          f"{'; '.join(differences)}. Resume with the settings it was saved with, or start "
                          f"afresh in another output_dir (or with overwrite=true)", key="resume")


def _saved_config(output_dir: str) -> dict[str, Any]:
    path = Path(output_dir) / "config.yaml"
    try:
        saved = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        saved = None
    return saved if isinstance(saved, dict) else {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shape_differences(saved_path: Path, current_path: Path) -> list[str]:
    """`key: X in the checkpoint, Y in model.path` for each SHAPE_KEY both config.json files set."""
    saved, current = _read_json(saved_path), _read_json(current_path)
    saved, current = saved.get("text_config", saved), current.get("text_config", current)
    return [f"the model's {k} is {saved[k]} in the checkpoint, {current[k]} in model.path ({current_path})"
            for k in SHAPE_KEYS if k in saved and k in current and saved[k] != current[k]]


def _lookup(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _backend_on_disk(path: Path) -> str | None:
    """The learner backend whose files the checkpoint's train_state holds (DCP's `.metadata` is
    FSDP2's; DeepSpeed writes a `latest` tag file)."""
    state = path / "train_state"
    if (state / ".metadata").is_file():
        return "fsdp2"
    return "deepspeed" if (state / "latest").is_file() else None


def _setting_differences(cfg: RunConfig, saved: dict[str, Any], path: Path) -> list[str]:
    now = config_to_dict(cfg)
    keys = list(MUST_MATCH) + (list(DEEPSPEED_MUST_MATCH) if cfg.learner.backend == "deepspeed" else [])
    if not cfg.learner.lora_rank and not _lookup(saved, "learner.lora_rank"):
        keys.remove("learner.lora_target_modules")  # no adapters either way
    was = {k: _lookup(saved, k) for k in keys}
    was["learner.backend"] = _backend_on_disk(path) or was["learner.backend"]
    return [f"{k} is {_show(was[k])} there, {_show(_lookup(now, k))} here"
            for k in keys if was[k] is not None and was[k] != _lookup(now, k)]


def _show(value: Any) -> str:
    return f"[{', '.join(map(str, value))}]" if isinstance(value, list) else str(value)


def _data_differences(cfg: RunConfig, saved: dict[str, Any], path: Path, stream: Any) -> list[str]:
    """The data keys that differ, when the checkpoint's prompt stream is not this run's."""
    from rlhf.run.checkpoint import read_run_state  # JSON + safetensors (an earlier version's run_state.pt)

    was = read_run_state(path).get("prompts", {})
    now = stream.state_dict()
    if all(was.get(k) == now[k] for k in ("seed", "num_items", "fingerprint")):
        return []
    current = config_to_dict(cfg)
    changed = [f"{k} is {_show(_lookup(saved, k))} there, {_show(_lookup(current, k))} here"
               for k in _leaf_keys(saved, DATA_KEYS) if _lookup(saved, k) != _lookup(current, k)]
    what = "pairs" if cfg.algorithm == "dpo" else "prompts"
    return [f"it was trained on other data ({was.get('num_items')} {what} there, {now['num_items']} here"
            + (f"; {', '.join(changed)}" if changed else ": the data files or the tokenizer changed") + ")"]


def _leaf_keys(saved: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """`keys` with each section among them expanded to the dotted keys under it in `saved`."""
    out = []
    for key in keys:
        value = _lookup(saved, key)
        out += [f"{key}.{k}" for k in value] if isinstance(value, dict) else [key]
    return out
