"""Two test files at a time (`scripts/test.sh`: pytest-xdist, `-n 2 --dist loadfile`).

Most of the suite's time is ~50 launches of the real stack. Their start-ups are CPU-bound, but
their steps leave a core idle at times (the driver waits on the engine, a rank on its peer,
everything on the reward worker), and so do the unit tests: a second file's work fills that. On
the 2-core CI machine (2026-11-26): 22 min 49 s one file at a time, 19-21 min two at a time, 18.5
once tests/test_ray_job.py no longer ran alone; each file then takes 1.6-2x as long. Three rules
keep it free of timing luck and of doubled work (hooks imported by tests/conftest.py; without
xdist none of this does anything):

1. Files that read one session-scoped run (`quiet_run`, `interrupted_run` in conftest.py) go to the
   same worker (`SAME_WORKER`), so the run happens once.
2. The files that take longest start first (`SECONDS`), so the run does not end with one long
   file on one worker while the other has nothing left.
3. A test marked `alone` asserts something about wall time (a limit in seconds that a sample or a
   tool must beat, a step that overlaps generation with training): nothing runs beside it. No test
   hands out a port it found free in the range every `bind(0)` draws from: learner ranks spawned by
   tests join a store the test serves (`tests/test_fsdp2_learner.py::rendezvous_store`), and
   tests/test_ray_job.py's `ray start` takes ports below that range (`QUIET_PORTS`). Every
   test takes a shared lock on one file for its whole protocol (fixtures included) and an `alone`
   one an exclusive lock; a second file, the gate, stops new shared takers while an `alone` test
   waits, so it cannot be starved.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

# file -> the file whose worker runs it too (they read the same session-scoped run)
SAME_WORKER = {
    "tests/test_reward_model.py": "tests/test_console.py",  # quiet_run
    "tests/test_failure_lines.py": "tests/test_listening.py",  # interrupted_run
}
# Seconds each file took in a one-at-a-time run on the 2-core CI machine (0619927, 2026-11-26, 22:49 in
# all); a file not listed took under 5. Only the order they give matters (rule 2): refresh the table
# when a file's share changes a lot.
SECONDS = {
    "tests/test_lora.py": 188,
    "tests/test_faults.py": 153,
    "tests/test_grpo_e2e.py": 131,
    "tests/test_ray_job.py": 103,
    "tests/test_dpo_e2e.py": 102,
    "tests/test_evaluate.py": 91,
    "tests/test_fsdp2_learner.py": 76,
    "tests/test_deepspeed_learner.py": 52,
    "tests/test_multi_engine_e2e.py": 49,
    "tests/test_dapo_sampling.py": 47,
    "tests/test_async_grpo.py": 44,
    "tests/test_nonfinite.py": 38,
    "tests/test_benchmarks.py": 34,
    "tests/test_plan_check.py": 32,
    "tests/test_console.py": 28,
    "tests/test_tools_e2e.py": 27,
    "tests/test_failure_lines.py": 25,
    "tests/test_reward_pool.py": 25,
    "tests/test_engines.py": 24,
    "tests/test_checkpoint_safety.py": 22,
    "tests/test_gguf_parts.py": 15,
    "tests/test_listening.py": 12,
    "tests/test_vllm_generator.py": 8,
    "tests/test_bad_input.py": 8,
    "tests/test_config.py": 6,
    "tests/test_tools.py": 5,
}
LOCKS_ENV = "RLHF_TEST_LOCKS"  # the folder of the two lock files, made by the controller


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # The controller, before its workers start (they inherit its environment).
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="rlhf-test-locks-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and LOCKS_ENV in os.environ:
        shutil.rmtree(os.environ.pop(LOCKS_ENV), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with rule 1, keeping the collection order of rule 2 (xdist would otherwise
    start the files with the most tests first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return SharedRunScheduling(config, log)


def order_heaviest_first(items: list[pytest.Item]) -> None:
    """Rule 2, in place, in the workers only (every worker must collect the same order; a run
    without xdist keeps the files in their usual order). Stable: within a file nothing moves."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost: dict[str, float] = defaultdict(float)
    for file in dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items):
        cost[scope_of(file)] += SECONDS.get(file, 1)
    position = {scope: i for i, scope in enumerate(dict.fromkeys(scope_of(item.nodeid) for item in items))}
    items.sort(key=lambda item: (-cost[scope_of(item.nodeid)], position[scope_of(item.nodeid)]))


def scope_of(nodeid: str) -> str:
    """The unit a worker takes whole: a test's file, or the file it shares a run with (rule 1)."""
    file = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(file, file)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with turn(alone=item.get_closest_marker("alone") is not None):
        yield


@contextmanager
def turn(*, alone: bool) -> Iterator[None]:
    """Rule 3: the test's turn, shared or (alone) exclusive; a no-op without workers."""
    locks = os.environ.get(LOCKS_ENV)
    if not locks or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(Path(locks) / "gate", "a") as gate, open(Path(locks) / "room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases both locks
