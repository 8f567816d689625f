"""What the terminal shows: one tiny end-to-end run with every tracker on prints fewer than 60 lines
(the config summary, the progress bar, the end-of-run summary) while the engine, learner, driver
and Ray logs land under <output_dir>/logs/; plus the pieces (worker output redirection, the
harmless-warning filter, log collection, a missing tracker package) at the unit level."""

from __future__ import annotations

import logging

import pytest

from actors.worker_setup import HARMLESS, TIED_LM_HEAD, silence_harmless_warnings
from rlhf.config import ConfigError, load_config
from rlhf.run.metrics import read_metrics
from scripts.console import collect_ray_logs, driver_logs_to_file, ray_init_kwargs

# `quiet_run` (conftest.py): the tiny recipe with every tracker on, run as from a terminal.


@pytest.mark.e2e
@pytest.mark.ray
def test_quiet_terminal_shows_config_progress_and_summary(quiet_run):
    out, proc = quiet_run
    # Terminal lines end in "\n"; the progress bar redraws one line with "\r".
    lines = [ln for stream in (proc.stdout, proc.stderr) if stream for ln in stream.rstrip("\n").split("\n")]
    assert len(lines) < 60, "\n".join(lines)
    text = proc.stdout + proc.stderr
    for expected in ("run: grpo, 2 steps x 4 prompts x 4 samples", "model: tiny-qwen2 (float32)",
                     "cluster: colocated", "placement: engines", "grpo: 100%", "done: 2 steps", "reward/mean",
                     "step time (median)",
                     f"checkpoint: {out / 'checkpoints'}", f"logs: {out / 'logs'}"):
        assert expected in text, expected
    for noise in ("VLLMGenerator pid=", "INFO", "Started a local Ray instance", "Loading weights"):
        assert noise not in text, noise


@pytest.mark.e2e
@pytest.mark.ray
def test_engine_learner_and_ray_logs_are_files(quiet_run):
    logs = quiet_run[0] / "logs"
    engine, learners = list(logs.glob("VLLMGenerator-*.log")), list(logs.glob("LearnerRank-*.log"))
    assert len(engine) == 1 and len(learners) == 2  # (an actor that printed nothing leaves no file)
    engine_log = engine[0].read_text()
    # vLLM's own output is kept here: its weight loader's progress line. (Its INFO lines were there when
    # this file ran alone but missing in one full-suite run from a clean clone; cause not found yet.)
    assert "Loading safetensors checkpoint shards" in engine_log
    assert "RotaryEmbedding: Failed to load weights" not in engine_log  # silenced at its logger
    assert "Started a local Ray instance" in (logs / "driver.log").read_text()
    assert (logs / "ray" / "raylet.out").stat().st_size > 0 and (logs / "ray" / "gcs_server.out").exists()


@pytest.mark.e2e
@pytest.mark.ray
def test_run_feeds_every_tracker(quiet_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = quiet_run[0]
    rewards = [r["reward/mean"] for r in read_metrics(out / "metrics.jsonl")]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx(rewards)
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")) and (out / "mlruns").is_dir()


def test_verbose_keeps_worker_output_on_the_terminal(tmp_path):
    quiet, verbose = ray_init_kwargs(tmp_path, verbose=False), ray_init_kwargs(tmp_path, verbose=True)
    assert quiet["log_to_driver"] is False
    assert quiet["runtime_env"]["env_vars"] == {"RLHF_LOG_DIR": str(tmp_path), "RAY_worker_niceness": "0"}
    assert verbose["log_to_driver"] is True and verbose["runtime_env"]["env_vars"] == {"RAY_worker_niceness": "0"}
    with driver_logs_to_file(tmp_path, verbose=True):
        assert not (tmp_path / "driver.log").exists()


@pytest.mark.e2e
@pytest.mark.ray
def test_a_runs_workers_are_not_niced(tmp_path):
    """Ray starts workers at niceness 15, where any busy process at 0 starves them (scripts/console.py,
    WORKER_NICENESS): a run's actors and tasks get the driver's 0."""
    import os

    import ray

    ray.init(num_cpus=1, **ray_init_kwargs(tmp_path, verbose=True, local=True))
    try:
        assert ray.get(ray.remote(num_cpus=0.5)(lambda: os.nice(0)).remote(), timeout=120) == os.nice(0) == 0
    finally:
        ray.shutdown()


def test_driver_library_logs_go_to_the_file_and_come_back(tmp_path, capsys):
    before = logging.getLogger("transformers").handlers[:]
    with driver_logs_to_file(tmp_path, verbose=False):
        logging.getLogger("transformers.tokenization").warning("a library warning")
    assert "a library warning" in (tmp_path / "driver.log").read_text()
    assert "a library warning" not in capsys.readouterr().err
    assert logging.getLogger("transformers").handlers == before


def test_harmless_warnings_are_dropped_and_others_kept(caplog):
    (name,) = HARMLESS
    logger = logging.getLogger(name)
    saved, logger.filters = logger.filters, []  # an engine built in this process may have added some
    with caplog.at_level(logging.WARNING, logger=name):
        silence_harmless_warnings()
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "ParallelLMHead")  # harmful unless the head is tied
        silence_harmless_warnings(TIED_LM_HEAD)
        silence_harmless_warnings(TIED_LM_HEAD)
        logger.warning("%s: Failed to load weights", "ParallelLMHead")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure stays visible
    assert [r.getMessage() for r in caplog.records] == ["ParallelLMHead: Failed to load weights",
                                                        "QKVParallelLinear: Failed to load weights"]
    assert len(logger.filters) == 2
    logger.filters = saved


def test_start_ups_run_with_the_collector_paused_and_restore_it():
    import gc

    from actors.worker_setup import gc_paused

    @gc_paused()
    def start() -> bool:
        return gc.isenabled()

    assert gc.isenabled() and start() is False and gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("a constructor that raises")
    assert gc.isenabled()
    gc.disable()  # paused by a caller already: left as it was
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_worker_files_are_named_after_their_actor(tmp_path):
    (tmp_path / "worker-11.log").write_text(":job_id:01\n:actor_name:VLLMGenerator\nINFO engine up\n")
    (tmp_path / "worker-12.log").write_text(":job_id:01\n:task_name:node_address\n")
    (tmp_path / "worker-13.log").write_text("")
    collect_ray_logs(tmp_path, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["VLLMGenerator-11.log"]


def test_missing_tracker_fails_before_ray_starts(tmp_path, monkeypatch):
    import importlib.util

    import ray

    from scripts.launch import ray_session

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = load_config("configs/grpo_tiny_cpu.yaml",
                      [f"output_dir={tmp_path}", "logging.backends=[jsonl,mlflow]"])
    with pytest.raises(ConfigError, match=r"mlflow not installed; install with: .* mlflow-skinny==3\.17\.2"):
        with ray_session(cfg):
            pass
    assert not ray.is_initialized()


@pytest.mark.e2e
@pytest.mark.ray
def test_a_run_scores_with_a_reward_model_in_the_reward_worker(quiet_run, tiny_reward_model):
    """Ray + vLLM-CPU: the reward worker loads the model and each step logs its mean and the mixed
    reward. The run is `quiet_run` (rewards: the arithmetic function + 0.5 x this model), which the
    tests above read too."""
    from rlhf.run.metrics import read_metrics

    records = read_metrics(quiet_run[0] / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        mixed = record["reward/arithmetic/mean"] + 0.5 * record[f"reward/rm_{tiny_reward_model.name}/mean"]
        assert record["reward/mean"] == pytest.approx(mixed, abs=1e-5)
