"""tests/gpu/schedule.py: each host's device calls run every GPU test exactly once and fit a call,
and the runner starts a wave's lanes together, a lane's parts in turn, under the call's deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu.schedule import (
    CALL_S,
    INSTALL_S,
    MULTI_LAYOUTS,
    REPORT_S,
    SCHEDULES,
    Lane,
    expected_seconds,
    merged_results,
    part_seconds,
    run_call,
    selects,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_test_ids() -> list[str]:
    """tests/gpu's node ids, as pytest collects them on a GPU machine."""
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    out = subprocess.run(collect, cwd=ROOT, env=os.environ | {"RLHF_COLLECT_GPU_TESTS": "1"}, capture_output=True,
                         text=True, check=False)
    ids = [line for line in out.stdout.splitlines() if line.startswith("tests/gpu/")]
    assert out.returncode == 0 and len(ids) > 20, out.stdout[-2000:] + out.stderr[-2000:]
    return ids


@pytest.mark.parametrize("gpus", sorted(SCHEDULES))
def test_each_hosts_calls_run_every_gpu_test_exactly_once(gpus, gpu_test_ids):
    parts = [p for call in SCHEDULES[gpus] for wave in call for lane in wave for p in lane.parts]
    runs = {i: sum(selects(p, i) for p in parts) for i in gpu_test_ids}
    assert {i: n for i, n in runs.items() if n != 1} == {}


@pytest.mark.parametrize("gpus", sorted(SCHEDULES))
def test_each_call_fits_the_device_limit_on_disjoint_gpus(gpus):
    for k, call in enumerate(SCHEDULES[gpus]):
        assert expected_seconds(call) + (INSTALL_S if k == 0 else 45) <= CALL_S, (gpus, k + 1)
        for wave in call:
            used = [int(g) for lane in wave for g in lane.gpus.split(",")]
            assert len(used) == len(set(used)) and max(used) < gpus, (gpus, k + 1, wave)


def test_multi_gpu_layouts_are_the_suites():
    from tests.gpu.test_multi_gpu import LAYOUTS

    assert MULTI_LAYOUTS == {name: need for name, (need, _, _) in LAYOUTS.items()}
    multi = ("tests/gpu/test_multi_gpu.py",)
    assert part_seconds(multi, 1) < part_seconds(multi, 2) < part_seconds(multi, 4)
    assert part_seconds(("tests/gpu/test_split_gpu.py",), 1) < part_seconds(("tests/gpu/test_split_gpu.py",), 2)


FAKE_RUN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    work, name = Path(sys.argv[1]), sys.argv[2]
    log = work / "log.jsonl"
    with log.open("a") as f:
        f.write(json.dumps({"event": "start", "name": name, "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
                            "deadline": int(os.environ["RLHF_GPU_DEADLINE_S"])}) + "\\n")
    if name in ("a1", "b1"):  # the first parts of the two lanes: each waits until the other has started
        other = "b1" if name == "a1" else "a1"
        end = time.time() + 60
        while '"name": "%s"' % other not in log.read_text() and time.time() < end:
            time.sleep(0.05)
    out = Path(os.environ["RLHF_GPU_COPY_TO"])
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps([{"test": name, "outcome": "passed"}]))
    with log.open("a") as f:
        f.write(json.dumps({"event": "end", "name": name}) + "\\n")
    sys.exit(3 if name == "b2" else 0)
""")


def test_a_waves_lanes_run_together_and_a_lanes_parts_in_turn(tmp_path):
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    work = tmp_path / "call"
    run = (sys.executable, str(fake), str(work))
    call = ((Lane("0", (("a1",), ("a2",))), Lane("1,2", (("b1",), ("b2",)))), (Lane("0,1,2", (("c",),)),))
    statuses = run_call(call, 300, work, run=run)

    assert statuses == {"a1": 0, "a2": 0, "b1": 0, "b2": 3, "c": 0}
    events = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    order = [(e["event"], e["name"]) for e in events]
    started = {e["name"]: e for e in events if e["event"] == "start"}
    assert {started["a1"]["gpus"], started["b1"]["gpus"], started["c"]["gpus"]} == {"0", "1,2", "0,1,2"}
    assert order.index(("start", "b1")) < order.index(("end", "a1"))  # lanes together: the barrier was met
    assert order.index(("end", "a1")) < order.index(("start", "a2"))  # parts of a lane in turn
    assert order.index(("start", "c")) > max(order.index(("end", n)) for n in ("a2", "b2"))  # waves in turn
    assert all(0 < e["deadline"] <= 300 - REPORT_S for e in started.values())
    assert started["c"]["deadline"] <= started["a1"]["deadline"]
    assert [r["test"] for r in merged_results(call, work, statuses)] == ["a1", "a2", "b1", "b2", "c"]
    (work / "b2" / "results.json").unlink()  # as if its run.sh had died before pytest wrote anything
    crashed = merged_results(call, work, statuses)[3]
    assert crashed["test"] == "b2" and crashed["outcome"] == "failed" and "exited 3" in crashed["error"]


def test_a_part_with_under_a_minute_left_is_not_started(tmp_path):
    fake = tmp_path / "fake_run.py"
    fake.write_text(FAKE_RUN)
    statuses = run_call(((Lane("0", (("a2",),)),),), REPORT_S + 30, tmp_path / "call",
                        run=(sys.executable, str(fake), str(tmp_path / "call")))
    assert statuses == {"a2": -1} and not (tmp_path / "call" / "log.jsonl").exists()
    [entry] = merged_results(((Lane("0", (("a2",),)),),), tmp_path / "call", statuses)
    assert (entry["test"], entry["outcome"]) == ("a2", "not run")  # in the record, not missing from it
