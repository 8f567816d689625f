"""GPU acceptance suite plumbing (tests/gpu/run.sh): the models the tests share, the figures each
test asserts on, and the per-test results file that tests/gpu/report.py turns into the summary
table and the JSON record.

Collected only where CUDA is (tests/conftest.py). Tests that need more GPUs than the machine has
are skipped with the reason (`tests/gpu/suite.py::needs_gpus`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RESULTS_ENV = "RLHF_GPU_RESULTS"  # where pytest_sessionfinish writes the per-test results (JSON)
_results: dict[str, dict] = {}


@pytest.fixture
def figures(request) -> dict[str, object]:
    """The figures a test asserts on (name -> value), recorded whether it passes or fails."""
    values: dict[str, object] = {}
    request.node.user_properties.append(("figures", values))
    return values


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test's outcome is its call's (an interrupted test that never ran its call is `not run`);
    a failing set-up or tear-down fails it; seconds add up over the three phases."""
    entry = _results.setdefault(report.nodeid, {"test": report.nodeid.split("::", 1)[-1], "outcome": "not run",
                                                "seconds": 0.0, "figures": {}})
    entry["seconds"] += report.duration
    for name, value in report.user_properties:
        if name == "figures":
            entry["figures"] = value
    if report.failed:
        entry["outcome"] = "failed"
        entry["error"] = " ".join(str(report.longrepr).splitlines()[-1:])[:500]
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.when == "call" and entry["outcome"] == "not run":
        entry["outcome"] = "passed"
    _write_results()  # after every phase: a suite stopped at its deadline still leaves its record


def _write_results() -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(list(_results.values()), indent=1, default=str))
        tmp.replace(path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every collected test is in the record, as `not run` until it reports."""
    for item in items:
        _results.setdefault(item.nodeid, {"test": item.nodeid.split("::", 1)[-1], "outcome": "not run",
                                          "seconds": 0.0, "figures": {}})


def pytest_sessionfinish(session: pytest.Session) -> None:
    _write_results()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, the real model (scripts.assets; RLHF_WHEELHOUSE where no registry is)."""
    from scripts.assets import fetch_smollm2

    return fetch_smollm2()
