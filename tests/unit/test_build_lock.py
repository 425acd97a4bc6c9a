"""The watch on torch's JIT op build locks (train/build_lock.py): a lock a killed build left is
removed once stale, a live build's is left alone, and a wait is reported while it lasts."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from elasticrl.train import build_lock

pytestmark = pytest.mark.timeout(30)


def _lock(root, op: str, *, age_s: float, idle_s: float):
    directory = root / "py311_cpu" / op
    directory.mkdir(parents=True)
    obj = directory / "op.o"
    obj.write_bytes(b"x")
    lock = directory / "lock"
    lock.write_bytes(b"")
    now = time.time()
    os.utime(lock, (now - age_s, now - age_s))
    os.utime(obj, (now - idle_s, now - idle_s))
    os.utime(directory, (now - idle_s, now - idle_s))
    return lock


def test_a_stale_lock_is_removed_and_a_live_builds_lock_is_kept(tmp_path):
    stale = _lock(tmp_path, "dead_op", age_s=3600, idle_s=3600)
    building = _lock(tmp_path, "live_op", age_s=3600, idle_s=5)  # old lock, files still being written
    young = _lock(tmp_path, "new_op", age_s=5, idle_s=3600)
    found = build_lock.check_locks(tmp_path, time.time(), stale_after_s=600)
    assert {lock.parent.name: removed for lock, _, _, removed in found} == {"dead_op": True, "live_op": False, "new_op": False}
    assert not stale.exists() and building.exists() and young.exists()


def test_no_extensions_directory_is_nothing_to_watch(tmp_path):
    assert build_lock.check_locks(tmp_path / "absent", time.time()) == []


def test_the_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_lock.extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_lock.extensions_root().parts[-2:] == (".cache", "torch_extensions")


def test_a_stale_lock_goes_before_the_build_starts_and_a_wait_on_a_live_one_is_reported(tmp_path, caplog):
    stale = _lock(tmp_path, "dead_op", age_s=3600, idle_s=3600)
    live = _lock(tmp_path, "live_op", age_s=1, idle_s=1)
    caplog.set_level(logging.WARNING, logger=build_lock.__name__)
    with build_lock.BuildLockWatch(root=tmp_path, warn_after_s=0.05, stale_after_s=600):
        assert not stale.exists()  # on entry: this process may build the op itself
        deadline = time.monotonic() + 10
        while "DeepSpeed has been starting" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    assert live.exists()
    assert f"removed the stale op build lock {stale}" in caplog.text
    assert f"an op build lock exists: {live}" in caplog.text
    assert not any(t.name == "build-lock-watch" for t in threading.enumerate())


def test_a_lock_that_goes_stale_while_waited_on_is_removed(tmp_path):
    lock = _lock(tmp_path, "op", age_s=3600, idle_s=3600)
    clock = {"now": time.time() - 7200}  # at entry the lock is from the future: not stale

    with build_lock.BuildLockWatch(root=tmp_path, warn_after_s=0.02, stale_after_s=600, wall_clock=lambda: clock["now"]):
        assert lock.exists()
        clock["now"] = time.time()
        deadline = time.monotonic() + 10
        while lock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert not lock.exists()
