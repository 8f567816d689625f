"""RewardPool: weighted sums, None, failures, time-outs, async and batched functions, clean shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewards import RewardLoadError, RewardPool

USER = str(Path(__file__).parent / "fixtures" / "user_rewards.py")


def fn(name: str) -> str:
    return f"{USER}:{name}"


def _children() -> set[int]:
    """Live child processes of this process (Linux /proc)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                pids.add(int(entry.name))
    return pids


@pytest.mark.parametrize("num_workers", [0, 2])
def test_weighted_sum_and_none(num_workers):
    completions = ["answer 42", "nope", "42!", "nothing"]
    rows = [{"answer": 42, "kind": "a"}, {"answer": 42, "kind": "a"}, {"answer": 42, "kind": "b"},
            {"answer": 1}]
    specs = [(fn("contains_answer"), 1.0), (fn("only_kind_a"), 2.0)]
    with RewardPool(specs, num_workers=num_workers) as pool:
        rewards, metrics = pool.score(["Q"] * 4, completions, rows)
    assert rewards == [2.0, 1.0, 1.0, 0.0]
    assert metrics["reward/contains_answer/mean"] == 0.5
    assert metrics["reward/only_kind_a/mean"] == 0.5  # the two None rows are left out
    assert metrics["reward/mean"] == 1.0
    assert metrics["reward/failed"] == 0 and metrics["reward/timeouts"] == 0


def test_work_runs_in_worker_processes_and_is_spread():
    n = 16
    with RewardPool([fn("process_id")], num_workers=2) as pool:
        deadline = time.monotonic() + 30
        while not all(w.ready for w in pool._workers) and time.monotonic() < deadline:
            pool.score(["Q"], ["C"], [{}])  # start-up messages are read while scoring
            time.sleep(0.05)
        rewards, _ = pool.score(["Q"] * n, ["C"] * n, [{"delay": 0.02}] * n)
    pids = set(rewards)
    assert os.getpid() not in pids and len(pids) == 2


@pytest.mark.parametrize("bad", ["always_raises", "returns_text", "batched_wrong_length"])
def test_failing_reward_scores_zero_and_is_counted(bad):
    with RewardPool([(fn("constant_one"), 1.0), (fn(bad), 5.0)], num_workers=1) as pool:
        rewards, metrics = pool.score(["Q"] * 3, ["a", "b", "c"], [{}] * 3)
    assert rewards == [1.0, 1.0, 1.0]
    assert metrics["reward/failed"] == 3
    assert metrics[f"reward/{bad}/mean"] == 0.0


def test_missing_column_is_a_failure_not_a_crash():
    with RewardPool([fn("contains_answer")], num_workers=0) as pool:
        rewards, metrics = pool.score(["Q"], ["42"], [{}])
    assert rewards == [0.0] and metrics["reward/failed"] == 1


def test_hanging_reward_times_out_and_the_pool_recovers():
    with RewardPool([(fn("hangs_on_marker"), 1.0)], timeout_s=1.0, num_workers=2) as pool:
        pool.score(["Q"], ["ok"], [{}])  # wait for start-up so the timing below measures the hang
        first_pids = {w.process.pid for w in pool._workers}
        start = time.monotonic()
        rewards, metrics = pool.score(["Q"] * 6, ["ok", "hang", "ok", "ok", "ok", "ok"], [{}] * 6)
        elapsed = time.monotonic() - start
        assert rewards == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        assert metrics["reward/timeouts"] == 1 and metrics["reward/failed"] == 0
        assert elapsed < 10
        replaced = first_pids - {w.process.pid for w in pool._workers}
        assert len(replaced) == 1
        rewards, metrics = pool.score(["Q"] * 4, ["ok"] * 4, [{}] * 4)  # still works
        assert rewards == [1.0] * 4 and metrics["reward/timeouts"] == 0
    for pid in first_pids:
        assert pid not in _children()


def test_plain_sleeping_reward_times_out():
    with RewardPool([(fn("constant_one"), 1.0), (fn("hangs"), 1.0)], timeout_s=0.5, num_workers=1) as pool:
        rewards, metrics = pool.score(["Q"], ["C"], [{}])
    assert rewards == [1.0] and metrics["reward/timeouts"] == 1


def test_crashing_worker_counts_as_failure():
    with RewardPool([fn("dies_on_marker")], num_workers=1) as pool:
        rewards, metrics = pool.score(["Q"] * 3, ["ok", "die", "ok"], [{}] * 3)
    assert rewards == [1.0, 0.0, 1.0]
    assert metrics["reward/failed"] == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_async_reward(num_workers):
    completions = ["a", "ab", "abc", "hang"]
    specs = [(fn("async_length_parity"), 1.0), (fn("async_hangs_on_marker"), 10.0)]
    with RewardPool(specs, timeout_s=0.5, num_workers=num_workers) as pool:
        rewards, metrics = pool.score(["Q"] * 4, completions, [{}] * 4)
    assert rewards == [11.0, 10.0, 11.0, 0.0]
    assert metrics["reward/timeouts"] == 1  # the in-worker asyncio time-out: no process killed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batched_reward(num_workers):
    n = 20
    completions = [f"{i}" for i in range(n)]
    rows = [{"answer": i if i % 2 else -1} for i in range(n)]
    with RewardPool([(fn("batched_length"), 1.0), (fn("batched_sees_columns"), 100.0)],
                    num_workers=num_workers) as pool:
        rewards, metrics = pool.score(["Q"] * n, completions, rows)
    assert rewards == [len(c) + (100.0 if i % 2 else 0.0) for i, c in enumerate(completions)]
    assert metrics["reward/failed"] == 0


def test_shipped_rewards_in_workers():
    specs = [("rewards.tasks:countdown", 1.0), ("rewards.format:think_answer_format", 0.5)]
    completions = ["<think>x</think><answer>(1 + 2) * 3</answer>", "<answer>1 + 2 + 3</answer>"]
    with RewardPool(specs, num_workers=1) as pool:
        rewards, _ = pool.score(["Q"] * 2, completions, [{"numbers": [1, 2, 3], "target": 9}] * 2)
    assert rewards == [1.5, 0.0]


def test_bad_specs_fail_at_construction():
    with pytest.raises(RewardLoadError, match="has no attribute 'missing'"):
        RewardPool([(fn("missing"), 1.0)], num_workers=1)
    with pytest.raises(RewardLoadError, match="cannot be sent to worker processes"):
        RewardPool([(lambda prompt, completion, **row: 1.0, 1.0)], num_workers=1)
    with RewardPool([(lambda prompt, completion, **row: 1.0, 1.0)], num_workers=0) as pool:
        assert pool.score(["Q"], ["C"], [{}])[0] == [1.0]


def test_no_leftover_processes_after_close():
    before = _children()
    pool = RewardPool([fn("constant_one")], num_workers=3)
    pids = {w.process.pid for w in pool._workers}
    assert pids <= _children()
    assert pool.score(["Q"] * 5, ["C"] * 5, [{}] * 5)[0] == [1.0] * 5
    pool.close()
    pool.close()  # idempotent
    assert not (_children() - before)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["Q"], ["C"], [{}])


def test_empty_batch_and_mismatched_lengths():
    with RewardPool([fn("constant_one")], num_workers=1) as pool:
        empty = {"reward/mean": 0.0, "reward/failed": 0.0, "reward/timeouts": 0.0}
        assert pool.score([], [], []) == ([], empty)
        with pytest.raises(ValueError, match="got 2 prompts, 1 completions"):
            pool.score(["Q", "Q"], ["C"], [{}, {}])


def test_pool_in_an_unguarded_script_and_cleanup_at_exit(tmp_path):
    # No `if __name__ == "__main__"` guard and no close(): workers must neither re-run the
    # script (multiprocessing's spawn would) nor outlive the interpreter.
    script = tmp_path / "script.py"
    script.write_text(
        "from rewards import RewardPool\n"
        "pool = RewardPool(['rewards.answers:exact_answer'], num_workers=2)\n"
        "print(pool.score(['Q'] * 2, ['6', '7'], [{'answer': '6'}] * 2)[0])\n"
        "print(*[w.process.pid for w in pool._workers])\n")
    repo = str(Path(__file__).parents[1])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=repo,
                         env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[1.0, 0.0]"
    for pid in map(int, lines[1].split()):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
