"""Failures that come after the pre-Ray checks passed, each one line from the command line's entry
(`scripts/launch.py::cli`, in-process): the run folder turning unwritable between the check and
the start, and a first save that fails and leaves only the finished model (RELIABILITY.md, "Every
failure ends in one line")."""

from __future__ import annotations

import errno

from rlhf.run.checkpoint import checkpoint_root, latest_checkpoint, save_checkpoint
from scripts.launch import cli, ray_session
from tests.support.checkpoints import Learners, state

RECIPE = "configs/grpo_tiny_cpu.yaml"


def _cli(out, tiny_qwen2, prepare, run) -> int:
    argv = ["--config", RECIPE, f"output_dir={out}", f"model.path={tiny_qwen2}"]
    return cli("test entry", RECIPE, "grpo", argv, prepare, run)


def test_a_run_folder_unwritable_after_the_checks_is_one_line(tmp_path, tiny_qwen2, capsys):
    out = tmp_path / "run"

    def prepare(cfg):  # after check_output_dir passed: a file appears where the logs folder goes
        out.mkdir()
        (out / "logs").write_text("not a folder")
        return (str(tiny_qwen2),)  # what a script's prepare returns first: the model folder

    def run(cfg, model_path):
        with ray_session(cfg):
            raise AssertionError("Ray must not start")

    assert _cli(out, tiny_qwen2, prepare, run) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: output_dir={out}: cannot write the run folder (") and "logs" in err


def test_a_failed_first_save_points_at_the_finished_model(tmp_path, tiny_qwen2, capsys):
    out = tmp_path / "run"

    def run(cfg, model_path):  # a run whose first checkpoint (after its last step) finds the disk full
        out.mkdir(parents=True, exist_ok=True)
        save_checkpoint(out, 1, Learners(fail=OSError(errno.ENOSPC, "No space left on device")), state())

    assert _cli(out, tiny_qwen2, lambda cfg: (str(tiny_qwen2),), run) == 1
    err = capsys.readouterr().err.strip()
    kept = checkpoint_root(out) / "step_000001_model_only"
    assert "\n" not in err and err.startswith("error: the step-1 checkpoint did not fit on the disk of")
    assert err.endswith(f"No resumable checkpoint was written; the trained model is in {kept}")
    assert (kept / "model.safetensors").is_file() and latest_checkpoint(out) is None
