"""benchmarks/dynamic_sampling_compare.py's table arithmetic on a synthetic 3-step metrics.jsonl
(numbers computed by hand; no plotting, no Ray)."""

from __future__ import annotations

import json
import math

import pytest

import benchmarks.dynamic_sampling_compare as compare
from benchmarks.dynamic_sampling_compare import read_jsonl, samples_per_step, summarize, table

STEPS = [  # prompts_per_step=2, group_size=4: 8 samples per round
    {"step": s, "reward/mean": reward, "timing/step_s": seconds, "dynamic/extra_rounds": extra,
     "dynamic/informative_frac": frac}
    for s, (reward, seconds, extra, frac) in enumerate([(0.2, 10.0, 0.0, 1.0), (0.4, 20.0, 2.0, 0.5),
                                                        (0.6, 30.0, 1.0, 0.75)])
]


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in STEPS] + [json.dumps({"step": 3, "eval/pass@1": 0.5}), ""]
    path.write_text("\n".join(lines))
    return read_jsonl(path)


def test_samples_count_every_round(records):
    assert len(records) == 3  # the record without timing/step_s is not a step
    assert samples_per_step(records, 2, 4) == [8, 24, 16]


@pytest.mark.parametrize("k, first, last, per_1k, per_min", [
    (1, 0.2, 0.6, 0.4 / 48 * 1000, 0.4),  # gain 0.4 over 48 samples, 60 s
    (2, 0.3, 0.5, 0.2 / 48 * 1000, 0.2),
])
def test_summary(records, k, first, last, per_1k, per_min):
    s = summarize(records, prompts_per_step=2, group_size=4, k=k)
    assert s["samples"] == 48 and s["seconds"] == pytest.approx(60.0)
    assert (s["first_reward"], s["last_reward"]) == (pytest.approx(first), pytest.approx(last))
    assert s["gain_per_1k_samples"] == pytest.approx(per_1k)
    assert s["gain_per_minute"] == pytest.approx(per_min)
    assert s["informative_frac"] == pytest.approx(0.75)


def test_without_dynamic_metrics(records):
    off = [{k: v for k, v in r.items() if not k.startswith("dynamic/")} for r in records]
    s = summarize(off, prompts_per_step=2, group_size=4, k=1)
    assert s["samples"] == 24 and s["gain_per_1k_samples"] == pytest.approx(0.4 / 24 * 1000)
    assert math.isnan(s["informative_frac"])
    md = table({"off": s, "on": summarize(records, 2, 4, k=1)}, k=1).splitlines()
    assert md[0] == "| | off | on |" and "| generated samples | 24 | 48 |" in md
    assert "| reward/mean, first 1 steps | 0.200 | 0.200 |" in md
    assert "| informative fraction (mean) | n/a | 0.750 |" in md


@pytest.mark.parametrize("target, samples, seconds", [(0.25, 32, 30.0), (0.35, 48, 60.0)])
def test_samples_to_target(records, monkeypatch, target, samples, seconds):
    monkeypatch.setattr(compare, "WINDOW", 2)  # 2-step means: 0.3 after step 1, 0.5 after step 2
    monkeypatch.setattr(compare, "TARGET", target)
    s = summarize(records, prompts_per_step=2, group_size=4)
    assert (s["samples_to_target"], s["seconds_to_target"]) == (samples, pytest.approx(seconds))
    monkeypatch.setattr(compare, "TARGET", 0.9)
    assert math.isnan(summarize(records, 2, 4)["samples_to_target"])
