"""A build lock left by a killed op build is deleted; one a live builder holds is kept."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from actors.torch_extensions import CPU_OPS, build_cpu_ops, build_root, clear_stale_build_locks


def test_a_lock_nobody_holds_is_deleted_and_a_held_one_kept(tmp_path, capsys):
    stale, live = tmp_path / "cpu_adam" / "lock", tmp_path / "shm_comm" / "lock"
    stale.parent.mkdir()
    live.parent.mkdir()
    stale.touch()  # its builder was killed: nobody has it open
    # A live builder: another process that created the lock the way FileBaton does and holds it open.
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; os.open({str(live)!r}, os.O_CREAT | os.O_EXCL); "
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert clear_stale_build_locks(tmp_path) == [stale]
        assert not stale.exists() and live.exists()
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and f"deleted a stale build lock {stale}" in out
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert clear_stale_build_locks(tmp_path) == [live]  # its holder died: now it is stale too


def test_no_build_folder_is_nothing_to_do(tmp_path):
    assert clear_stale_build_locks(tmp_path / "absent") == []


def test_build_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_root().name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}_")


def test_setup_builds_only_the_ops_a_host_lacks(tmp_path):
    """scripts/setup.sh builds DeepSpeed's CPU ops once per host: ops whose folder holds a built
    library are left alone (nothing imported, nothing compiled), and each name is the folder
    DeepSpeed's own builder uses."""
    from deepspeed.ops import op_builder

    for op, builder in CPU_OPS.items():
        assert getattr(op_builder, builder).NAME == op
        (tmp_path / op).mkdir()
        (tmp_path / op / f"{op}.so").write_bytes(b"")
    assert build_cpu_ops(tmp_path) == []


def test_a_failed_op_build_fails_setup_naming_the_op(tmp_path, monkeypatch):
    """Each op builds in its own process (their compiles overlap); one that fails makes the build,
    and so scripts/setup.sh, fail with the op's name, after the others have finished."""
    import actors.torch_extensions as ext

    monkeypatch.setattr(ext, "CPU_OPS", {"no_such_op": "NoSuchBuilder", "cpu_adam": "CPUAdamBuilder"})
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # built already: not rebuilt
    with pytest.raises(RuntimeError, match=r"^building DeepSpeed's no_such_op failed"):
        ext.build_cpu_ops(tmp_path)
