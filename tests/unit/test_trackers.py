"""Experiment trackers (rlhf.run.trackers) fed by MetricsLogger: TensorBoard event files, an offline
W&B run and an MLflow file store are read back with the values of metrics.jsonl; the run's config
is attached; a missing package is one line naming the install command; the end-of-run summary."""

from __future__ import annotations

import glob
import json
import struct

import pytest

from rlhf.config import ConfigError
from rlhf.run.metrics import MetricsLogger, read_metrics, run_summary
from rlhf.run.trackers import check_backends, mlflow_key

CONFIG = {"algorithm": "grpo", "seed": 3, "learner": {"lr": 1e-5},
          "logging": {"backends": ["jsonl", "tensorboard", "wandb", "mlflow"], "project": "rlhf-test"}}
STEPS = [  # an evaluation before training (step -1), two training steps with an eval merged in
    (-1, {"eval/arith/pass@1": 0.25}),
    (0, {"reward/mean": 0.125, "loss": 0.5, "timing/step_s": 2.0, "timing/train_s": 1.5,
         "eval/arith/pass@1": 0.25, "throughput/tokens_per_s": 100.0, "kl": float("nan")}),
    (1, {"reward/mean": 0.75, "reward/failed": 0.0, "reward/failed/exception": 0.0, "loss": -0.25,
         "timing/step_s": 4.0, "timing/train_s": 3.0, "throughput/tokens_per_s": 300.0,
         "response_len/mean": 7}),
    (2, {"eval/arith/pass@1": 0.875}),
]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One MetricsLogger run with every backend; returns its folder and the numbers it logged."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path_factory.mktemp("run")
    log = MetricsLogger(out, total_steps=3, config=CONFIG, desc="test")
    for step, values in STEPS:
        log.log(step, values, advance=step >= 0)
    log.close()
    mp.undo()
    expected = {(r["step"], k): v for r in read_metrics(out / "metrics.jsonl") for k, v in r.items()
                if k != "step" and v is not None}
    return out, expected


def test_tensorboard_events_hold_the_jsonl_values(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, expected = logged_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert got == pytest.approx(expected, rel=1e-6)  # event files store float32
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 1e-05' in config_text


def test_offline_wandb_run_holds_the_jsonl_values(logged_run):
    from wandb.proto import wandb_internal_pb2

    out, expected = logged_run
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    got, config = {}, {}
    for record in _wandb_records(path, wandb_internal_pb2.Record):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            got.update({(row["step"], k): v for k, v in row.items() if not k.startswith("_") and k != "step"})
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    assert got == expected
    assert config["learner"] == {"lr": 1e-5} and config["seed"] == 3


def test_mlflow_file_store_holds_the_jsonl_values(logged_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    out, expected = logged_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-test").experiment_id])
    assert run.info.run_id == json.loads((out / "trackers.json").read_text())["mlflow"]
    got = {(m.step, key): m.value for key in {k for _, k in expected}
           for m in client.get_metric_history(run.info.run_id, mlflow_key(key))}
    assert got == expected
    assert run.data.params["learner.lr"] == "1e-05" and run.data.params["logging.project"] == "rlhf-test"
    assert run.info.status == "FINISHED"


def test_mlflow_keys_keep_their_shape():
    assert mlflow_key("eval/gsm8k/pass@8") == "eval/gsm8k.pass_at_8"
    assert mlflow_key("timing/train_s") == "timing/train_s" and mlflow_key("loss") == "loss"
    # a file store keeps each metric as a file at its key's path: a key may not be another's folder
    assert mlflow_key("reward/failed/exception") == "reward/failed.exception"


def test_summary_reads_first_and_last_steps_eval_and_phases(logged_run):
    out, _ = logged_run
    text = "\n".join(run_summary(read_metrics(out / "metrics.jsonl"), out))
    assert "done: 2 steps" in text
    assert "0.125 (step 0) -> 0.75 (step 1)" in text  # reward/mean, the GRPO headline
    assert "eval/arith/pass@1" in text and "0.25 (step -1) -> 0.875 (step 2)" in text
    assert "3 s: train 2.25" in text  # medians of step and phase seconds
    assert "200 trained" in text
    assert f"tensorboard --logdir {out / 'tensorboard'}" in text and "mlflow ui" in text


def test_missing_tracker_package_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        check_backends(("jsonl", "tensorboard", "wandb"))
    assert "\n" not in str(e.value) and "wandb not installed" in str(e.value)
    assert "-m pip install wandb==0.31.0" in str(e.value)
    check_backends(("jsonl", "tensorboard"))


def test_resumed_run_continues_the_tracker_runs(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {"logging": {"backends": ["jsonl", "tensorboard", "mlflow"], "project": "resume"}}
    for start, losses in ((0, [1.0, 2.0, 3.0]), (1, [20.0, 30.0])):  # crashed after step 2, resumed at 1
        log = MetricsLogger(tmp_path, total_steps=3, start_step=start, config=config)
        for step, loss in enumerate(losses, start):
            log.log(step, {"loss": loss})
        log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.0), (1, 20.0), (2, 30.0)]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert {m.value for m in client.get_metric_history(run.info.run_id, "loss")} == {1.0, 2.0, 3.0, 20.0, 30.0}


def test_jsonl_only_opens_no_tracker(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=1, config={"logging": {"backends": ["jsonl"]}})
    log.log(0, {"loss": 1.0, "timing/step_s": 1.0})
    log.close()
    assert log.trackers == [] and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def _wandb_records(path: str, record_type):
    """The protobuf records of a .wandb file: a 7-byte W&B header, then LevelDB-log records
    (4-byte CRC, 2-byte length, 1-byte type: full / first / middle / last) in 32 KiB blocks."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer or zero padding
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = record_type()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_the_run_plot_shows_held_out_pass_at_1_of_every_task(tmp_path):
    """GRPO logs held-out pass@1 per task (`eval/<task>/pass@1`, rlhf.evaluate); the reward panel of
    rlhf.run.plots draws each of them beside the training reward, and only at the steps that hold it."""
    from rlhf.run.plots import PANELS, panel_series, plot_metrics

    records = [{"step": 0, "reward/mean": 0.1, "eval/gsm8k/pass@1": 0.25, "eval/gsm8k/pass@4": 0.5},
               {"step": 1, "reward/mean": 0.3},
               {"step": 2, "reward/mean": 0.4, "eval/gsm8k/pass@1": 0.5, "eval/math/pass@1": 0.125}]
    series = panel_series(records, dict(PANELS)["reward"])
    assert series == {"reward/mean": [(0, 0.1), (1, 0.3), (2, 0.4)],
                      "eval/gsm8k/pass@1": [(0, 0.25), (2, 0.5)], "eval/math/pass@1": [(2, 0.125)]}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_metrics(path).stat().st_size > 0
