"""Every way a run ends short is one line naming the cause and the next action (RELIABILITY.md):

- an output_dir that holds an earlier run is refused before Ray starts, unless resume=true
  continues it or overwrite=true deletes it first (one line says what was deleted); resume=true
  with nothing to resume says it starts afresh;
- a resume that does not fit its checkpoint (model shape, learner backend, LoRA, DeepSpeed ranks,
  data) names what differs, before Ray starts;
- a RunError or Ctrl-C during the run is one line (Ctrl-C: exit 130, the latest checkpoint and
  how to resume), its traceback in `<output_dir>/logs/driver.log`; a real Ctrl-C also shuts Ray down;
- a failing copy of the logs at the end never replaces the error the run ends with.

The in-process tests replace `ray.init` by a function that raises `ReachedRay`: a run that gets
that far passed every check made before Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.run.checkpoint import MANIFEST, checkpoint_root, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY_GRPO = ["--config", "configs/grpo_tiny_cpu.yaml"]


class ReachedRay(Exception):
    """Raised in place of ray.init: every check before Ray starts has passed."""


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_failure_lines_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ray_init(monkeypatch):
    """ray.init raises ReachedRay; the tests run from the repository root."""
    import ray

    def reached(*args, **kwargs):
        raise ReachedRay

    monkeypatch.setattr(ray, "init", reached)
    monkeypatch.chdir(ROOT)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


class FakeLearners:
    """Writes a checkpoint as the FSDP2 learners lay it out: model/ with the model's config.json,
    train_state/ with DCP's .metadata and a shard."""

    def __init__(self, model_config: Path | None = None) -> None:
        self.model_config = model_config

    def save(self, path: str) -> None:
        out = Path(path)
        (out / "model").mkdir(parents=True)
        if self.model_config is not None:
            shutil.copy(self.model_config, out / "model" / "config.json")
        (out / "model" / "model.safetensors").write_bytes(b"w" * 64)
        (out / "train_state").mkdir()
        (out / "train_state" / ".metadata").write_bytes(b"m")
        (out / "train_state" / "__0_0.distcp").write_bytes(b"s" * 64)


def earlier_run(out: Path, steps: int = 3, checkpoint: bool = True, overrides: tuple[str, ...] = ()) -> None:
    """What a finished GRPO run of the tiny recipe leaves in `out`: config.yaml, metrics.jsonl,
    logs/, and (with `checkpoint`) a checkpoint of its last step whose data state is that of the
    recipe's prompts, so that resume=true with the same settings fits it."""
    from rlhf.data.assets import resolve_model_path
    from scripts.launch import write_run_config

    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml", [f"output_dir={out}", *overrides])
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "driver.log").write_text("an earlier run's log\n")
    write_run_config(cfg, out)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.0}) + "\n" for s in range(steps)))
    if checkpoint:
        _, _, stream, _ = _script("train_grpo").prepare_run(cfg)
        model_config = Path(resolve_model_path(cfg.model.path)) / "config.json"
        save_checkpoint(out, steps, FakeLearners(model_config), {"prompts": stream.state_dict()})


# ---------------------------------------------------------------------------------------------
# An earlier run in output_dir


@pytest.mark.parametrize("checkpoint", [True, False], ids=["with a checkpoint", "metrics only"])
def test_an_earlier_run_is_refused_in_one_line_naming_the_choices(checkpoint, tmp_path, ray_init, capsys):
    out = tmp_path / "run"
    earlier_run(out, checkpoint=checkpoint)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code = _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}"])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    last = f"latest checkpoint {checkpoint_root(out) / 'step_000003'}" if checkpoint else "no checkpoint"
    assert lines[0] == (f"error: output_dir={out} holds an earlier run (3 steps in metrics.jsonl, {last}); "
                        + ("continue it with resume=true, " if checkpoint else "")
                        + "write to another output_dir, or start afresh there with overwrite=true (deletes its "
                          "checkpoints, metrics and logs)")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing touched


@pytest.mark.parametrize("leftovers", ["nothing", "a run that died before its first step"])
def test_an_empty_folder_or_a_run_that_never_logged_a_step_is_no_earlier_run(leftovers, tmp_path, ray_init):
    out = tmp_path / "run"
    out.mkdir()
    if leftovers != "nothing":
        earlier_run(out, steps=0, checkpoint=False)  # config.yaml, logs/, an empty metrics.jsonl
        (checkpoint_root(out) / ".tmp_step_000001").mkdir(parents=True)  # a first save killed mid-way
    with pytest.raises(ReachedRay):
        _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}"])


def test_overwrite_deletes_the_earlier_run_and_says_so_in_one_line(tmp_path, ray_init, capsys):
    out = tmp_path / "run"
    earlier_run(out)
    elsewhere = tmp_path / "big_disk" / "tensorboard"  # a symlinked folder keeps its link
    elsewhere.mkdir(parents=True)
    (elsewhere / "events.out").write_text("old events\n")
    (out / "tensorboard").symlink_to(elsewhere)
    (out / "notes.txt").write_text("mine, not the run's\n")
    with pytest.raises(ReachedRay):
        _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}", "overwrite=true"])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("overwrite=true")]
    assert said == [f"overwrite=true: deleted the earlier run in {out} (3 steps in metrics.jsonl, latest "
                    f"checkpoint {checkpoint_root(out) / 'step_000003'}): checkpoints, metrics.jsonl, logs, "
                    f"tensorboard, config.yaml"]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert "an earlier run's log" not in (out / "logs" / "driver.log").read_text()  # the new run's logs/
    assert (out / "notes.txt").read_text() == "mine, not the run's\n"
    assert (out / "tensorboard").is_symlink() and not any(elsewhere.iterdir())


def test_overwrite_deletes_nothing_when_bad_input_stops_the_run(tmp_path, ray_init, capsys):
    out = tmp_path / "run"
    earlier_run(out)
    code = _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}", "overwrite=true", "data.task=nosuch"])
    assert code == 2 and "unknown data.task 'nosuch'" in capsys.readouterr().err
    assert (out / "metrics.jsonl").is_file() and (checkpoint_root(out) / "step_000003" / MANIFEST).is_file()


def test_resume_with_nothing_to_resume_says_it_starts_afresh(tmp_path, ray_init, capsys):
    out = tmp_path / "run"
    earlier_run(out, checkpoint=False)
    with pytest.raises(ReachedRay):
        _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}", "resume=true"])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume=")]
    assert said == [f"resume=true: no complete checkpoint in {checkpoint_root(out)}, so the run starts afresh at "
                    f"step 0 (its metrics.jsonl, 3 steps, is replaced)"]


# ---------------------------------------------------------------------------------------------
# A resume that does not fit its checkpoint


def test_a_resume_that_fits_its_checkpoint_reaches_ray(tmp_path, ray_init, capsys):
    out = tmp_path / "run"
    earlier_run(out)
    with pytest.raises(ReachedRay):
        _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}", "resume=true"])
    assert "error" not in capsys.readouterr().err


RESUME_MISMATCHES = {
    "another model": ((), ["model.path=tiny-llama"], "the model's model_type is qwen2 in the checkpoint, llama in model.path"),
    "another backend": ((), ["learner.backend=deepspeed"], "learner.backend is fsdp2 there, deepspeed here"),
    "LoRA added": ((), ["learner.lora_rank=8"], "learner.lora_rank is 0 there, 8 here"),
    "other data": ((), ["data.num_train=32"],
                   "it was trained on other data (64 prompts there, 32 here; data.num_train is 64 there, 32 here)"),
    "other prompt template": ((), ["data.prompt_template='Q: {question}'"],
                              "(64 prompts there, 64 here; data.prompt_template is {question} Answer with a number. "
                              "there, Q: {question} here)"),
    "DeepSpeed ranks": (("learner.backend=deepspeed", "learner.num_ranks=1"), ["learner.backend=deepspeed"],
                        "learner.num_ranks is 1 there, 2 here"),
}


@pytest.mark.parametrize("case", list(RESUME_MISMATCHES))
def test_a_resume_that_does_not_fit_its_checkpoint_is_one_line_naming_what_differs(case, tmp_path, ray_init, capsys):
    saved_with, resumed_with, differs = RESUME_MISMATCHES[case]
    out = tmp_path / "run"
    earlier_run(out, overrides=saved_with)
    if "learner.backend=deepspeed" in saved_with:  # DeepSpeed's files, not DCP's
        state = checkpoint_root(out) / "step_000003" / "train_state"
        (state / ".metadata").rename(state / "latest")
    code = _script("train_grpo").main([*TINY_GRPO, f"output_dir={out}", "resume=true", *resumed_with])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: resume=true: {checkpoint_root(out) / 'step_000003'} does not fit this run: ")
    assert differs in lines[0] and lines[0].endswith(
        "Resume with the settings it was saved with, or start afresh in another output_dir (or with overwrite=true)")


# ---------------------------------------------------------------------------------------------
# Failures during the run: one line, the traceback in the log file


def _cli(tmp_path: Path, run, *overrides: str) -> int:
    """The entry scripts' cli with the tiny recipe, `run` in place of the real one."""
    from rlhf.data.assets import resolve_model_path
    from scripts.launch import cli

    try:
        return cli("doc", "configs/grpo_tiny_cpu.yaml", "grpo", [f"output_dir={tmp_path}", *overrides],
                   lambda cfg: (resolve_model_path(cfg.model.path),), run)
    except KeyboardInterrupt:  # would end the test session itself
        pytest.fail("KeyboardInterrupt escaped cli")


def _ran_until(checkpoint_step: int | None, exc: BaseException):
    """A stand-in for the scripts' `run`: leaves what a run had written (logs, metrics of 3 steps,
    a checkpoint), then fails with `exc`."""
    def run(cfg, *prepared):
        out = Path(cfg.output_dir)
        (out / "logs").mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
        if checkpoint_step is not None:
            save_checkpoint(out, checkpoint_step, FakeLearners(), {"prompts": {}})
        raise exc
    return run


def test_ctrl_c_during_the_run_is_one_line_naming_the_checkpoint_and_exit_130(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = _cli(tmp_path, _ran_until(2, KeyboardInterrupt()))
    lines = _error_lines(capsys.readouterr().err)
    assert code == 130 and lines == [f"error: interrupted (Ctrl-C) after 3 steps. Resume from "
                                     f"{checkpoint_root(tmp_path) / 'step_000002'} with resume=true"]
    assert "KeyboardInterrupt" in (tmp_path / "logs" / "driver.log").read_text()


def test_sigterm_during_the_run_ends_it_like_ctrl_c_with_exit_143(tmp_path, monkeypatch, capsys):
    """A scheduler's or `kill`'s SIGTERM once Ray is up is taken as a Ctrl-C (Ray shut down, one line
    naming the checkpoint, 143), not as Ray's handler takes it in a driver (log and die on the spot,
    leaving Ray's agents behind: seen on a real run). `ray.init` here installs such a handler, as
    Ray's does; the caller's handler is back afterwards."""
    import os
    import signal
    import time

    import ray

    import scripts.console
    from scripts.launch import ray_session

    class Context:
        address_info = {"session_dir": str(tmp_path / "session")}

    def rays_handler(*args):
        pytest.fail("Ray's handler ran: the run died on the spot")

    def init(*args, **kwargs):
        signal.signal(signal.SIGTERM, rays_handler)
        return Context()

    shut_down = []
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shut_down.append(True))
    monkeypatch.setattr(scripts.console, "collect_ray_logs", lambda logs, session_dir: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def terminated_after_a_checkpoint(cfg, *prepared):
        with ray_session(cfg) as out:
            (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
            save_checkpoint(out, 2, FakeLearners(), {"prompts": {}})
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises in here
            raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.chdir(ROOT)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = _cli(tmp_path, terminated_after_a_checkpoint)
        assert signal.getsignal(signal.SIGTERM) is rays_handler  # ours was only for the run's time
    finally:
        signal.signal(signal.SIGTERM, before)
    lines = _error_lines(capsys.readouterr().err)
    assert code == 143 and lines == [f"error: interrupted (SIGTERM) after 3 steps. Resume from "
                                     f"{checkpoint_root(tmp_path) / 'step_000002'} with resume=true"]
    assert shut_down == [True] and "Terminated" in (tmp_path / "logs" / "driver.log").read_text()


def test_ctrl_c_before_any_checkpoint_says_to_start_again_with_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = _cli(tmp_path, _ran_until(None, KeyboardInterrupt()))
    lines = _error_lines(capsys.readouterr().err)
    assert code == 130 and lines == ["error: interrupted (Ctrl-C) after 3 steps. No checkpoint was written; start "
                                     "it again with overwrite=true (save_every=K keeps one every K steps)"]


def test_ctrl_c_before_the_run_starts_is_one_line(tmp_path, monkeypatch, capsys):
    from scripts.launch import cli

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.chdir(ROOT)
    try:
        code = cli("doc", "configs/grpo_tiny_cpu.yaml", "grpo", [f"output_dir={tmp_path}"], interrupted, None)
    except KeyboardInterrupt:  # would end the test session itself
        pytest.fail("KeyboardInterrupt escaped cli")
    assert code == 130 and _error_lines(capsys.readouterr().err) == [
        "error: interrupted (Ctrl-C) before the run started; run the command again to start it"]


def test_a_run_error_is_one_line_and_its_traceback_goes_to_the_log(tmp_path, monkeypatch, capsys):
    from rlhf.errors import RunError

    monkeypatch.chdir(ROOT)
    code = _cli(tmp_path, _ran_until(2, RunError("the disk is full")))
    err = capsys.readouterr().err
    assert code == 1 and _error_lines(err) == [f"error: the disk is full. Resume from "
                                               f"{checkpoint_root(tmp_path) / 'step_000002'} with resume=true"]
    log = (tmp_path / "logs" / "driver.log").read_text()
    assert "Traceback" in log and "RunError: the disk is full" in log and "Traceback" not in err


def test_a_failing_log_copy_never_replaces_the_error_the_run_ends_with(tmp_path, monkeypatch, capsys):
    """ray_session's finally copies Ray's logs (scripts/console.py); on a full disk that copy raises.
    The run's own error must still be what propagates, and the copy's failure one warning line."""
    import ray

    import scripts.console
    from rlhf.errors import RunError
    from scripts.launch import ray_session

    class Context:
        address_info = {"session_dir": str(tmp_path / "session")}

    def disk_full(logs, session_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ray, "init", lambda *a, **k: Context())
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(scripts.console, "collect_ray_logs", disk_full)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(ROOT / "configs/grpo_tiny_cpu.yaml", [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(RunError, match="the learners stopped"):
        with ray_session(cfg):
            raise RunError("the learners stopped")
    err = capsys.readouterr().err
    warnings = [line for line in _error_lines(err) if line.startswith("warning:")]
    assert warnings == [f"warning: the run's logs were not all gathered into {tmp_path / 'run' / 'logs'} ([Errno 28] "
                        f"No space left on device); Ray's own logs stay in {tmp_path / 'session'}/logs"]
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# A real Ctrl-C
