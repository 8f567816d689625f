"""How the suite runs two files at a time (tests/parallel.py): which files share a worker, which
start first, and the locks that keep an `alone` test alone."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import parallel


class FakeWorker:
    """What xdist's scheduler calls on a worker: the indices it is told to run, in order."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.indices: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.indices += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def schedule(collection: list[str]) -> list[list[str]]:
    """The files each of two workers is sent first by the suite's scheduler, until its queue runs low."""
    option = SimpleNamespace(dist="loadfile", tx=["2*popen"], numprocesses=2, loadscopereorder=True)
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = parallel.pytest_xdist_make_scheduler(config, None)
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    done: set[tuple[int, int]] = set()
    while True:  # the workers take turns finishing their next test; each finish may send more
        finished = False
        for n, w in enumerate(workers):
            pending = [i for i in w.indices if (n, i) not in done]
            if pending:
                done.add((n, pending[0]))
                sched.mark_test_complete(w, pending[0])
                finished = True
        if not finished:
            break
    return [list(dict.fromkeys(collection[i].split("::")[0] for i in w.indices)) for w in workers]


def test_files_sharing_a_session_run_go_to_one_worker_in_collection_order():
    files = [("test_console.py", 3), ("test_grpo_e2e.py", 5), ("test_listening.py", 3), ("test_reward_model.py", 1),
             ("test_x.py", 3), ("test_failure_lines.py", 1)]
    collection = [f"tests/{name}::t{i}" for name, n in files for i in range(n)]
    first, second = schedule(collection)
    # in collection order: xdist alone would start with the file of most tests (test_grpo_e2e.py)
    assert first[:2] == ["tests/test_console.py", "tests/test_reward_model.py"]
    assert second[0] == "tests/test_grpo_e2e.py"
    for pair in parallel.SAME_WORKER.items():
        assert any(set(pair) <= set(files) for files in (first, second)), (pair, first, second)
    assert sorted(first + second) == sorted(dict.fromkeys(c.split("::")[0] for c in collection))


def item(nodeid: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid)


def test_workers_start_with_the_files_that_take_longest(monkeypatch):
    items = [item("tests/test_a.py::u1"), item("tests/test_a.py::u2"), item("tests/test_console.py::e"),
             item("tests/test_faults.py::f1"), item("tests/test_reward_model.py::u"), item("tests/test_lora.py::l1"),
             item("tests/test_faults.py::f2"), item("tests/test_lora.py::l2")]
    unchanged = list(items)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    parallel.order_heaviest_first(items)
    assert items == unchanged  # no workers, no reordering
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    parallel.order_heaviest_first(items)
    assert [i.nodeid for i in items] == [
        "tests/test_lora.py::l1", "tests/test_lora.py::l2", "tests/test_faults.py::f1", "tests/test_faults.py::f2",
        "tests/test_console.py::e", "tests/test_reward_model.py::u",  # one scope: the run they share
        "tests/test_a.py::u1", "tests/test_a.py::u2"]  # not in the table: under 5 s
    assert parallel.SECONDS["tests/test_lora.py"] > parallel.SECONDS["tests/test_faults.py"] > \
        parallel.SECONDS["tests/test_console.py"] + 1 > 1


def test_the_tables_name_test_files_that_exist():
    root = Path(__file__).resolve().parents[1]
    named = set(parallel.SECONDS) | set(parallel.SAME_WORKER) | set(parallel.SAME_WORKER.values())
    assert [f for f in sorted(named) if not (root / f).is_file()] == []


def blocked(path: Path, mode: int) -> bool:
    """Whether a lock of `mode` on `path` would have to wait (a new open file: its own lock)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


@pytest.fixture
def locks(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(parallel.LOCKS_ENV, str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    return tmp_path


def test_shared_turns_run_together_and_keep_an_alone_one_out(locks):
    with parallel.turn(alone=False), parallel.turn(alone=False):  # two workers' ordinary tests
        assert not blocked(locks / "gate", fcntl.LOCK_EX)
        assert blocked(locks / "room", fcntl.LOCK_EX)
    with parallel.turn(alone=True):
        assert blocked(locks / "gate", fcntl.LOCK_EX) and blocked(locks / "room", fcntl.LOCK_SH)
    assert not blocked(locks / "gate", fcntl.LOCK_EX) and not blocked(locks / "room", fcntl.LOCK_EX)


def test_a_waiting_alone_turn_stops_new_shared_ones_until_it_has_run(locks):
    entered = threading.Event()

    def alone_test() -> None:
        with parallel.turn(alone=True):
            entered.set()

    with parallel.turn(alone=False):
        waiter = threading.Thread(target=alone_test)
        waiter.start()
        deadline = time.monotonic() + 60
        while not blocked(locks / "gate", fcntl.LOCK_EX):  # the alone turn holds the gate, waits for the room
            assert time.monotonic() < deadline, "the alone turn never took the gate"
            time.sleep(0.01)
        assert not entered.is_set()  # and a new shared turn, which starts at the gate, would wait
    waiter.join(60)
    assert entered.is_set() and not blocked(locks / "gate", fcntl.LOCK_EX)


def test_without_workers_a_turn_takes_no_lock(tmp_path, monkeypatch):
    monkeypatch.setenv(parallel.LOCKS_ENV, str(tmp_path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with parallel.turn(alone=True):
        assert list(tmp_path.iterdir()) == []
