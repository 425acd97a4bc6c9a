"""Dropped shard files are overwritten by new shards instead of deleted (``scheduler/recycle.py``)."""

from __future__ import annotations

import os
import pathlib

import pytest

from elasticrl.scheduler import recycle
from elasticrl.scheduler.store import TrajectoryStore, encode_shard
from tests.unit.test_shard_formats import RUN, received

pytestmark = pytest.mark.timeout(30)


def big_and_small():
    return [(received(f"t{i:02d}"), list(range(50))) for i in range(6)], [(received("s00"), [])]


def test_a_new_shard_overwrites_a_dropped_one_and_reads_back_exactly(tmp_path):
    s = TrajectoryStore(tmp_path)
    big, small = big_and_small()
    old = s.write_shard(RUN, 1, big)
    inode = (s.iteration_dir(RUN, 1) / old).stat().st_ino
    s.drop(RUN, 1)
    s.settle(5.0)
    assert s.shard_names(RUN, 1) == set() and len(s.recycler) == 1
    name = s.write_shard(RUN, 2, small)  # shorter than the file it reuses: the rest is cut off
    path = s.iteration_dir(RUN, 2) / name
    assert path.stat().st_ino == inode and len(s.recycler) == 0
    assert path.read_bytes() == encode_shard(RUN, 2, small)
    assert [g.task_id for g, _ in s.read_shard(RUN, 2, name)] == ["s00"]
    assert list((tmp_path / recycle.DIRECTORY).iterdir()) == []
    again = s.write_shard(RUN, 2, big)  # nothing left to reuse: a new file
    assert (s.iteration_dir(RUN, 2) / again).read_bytes() == encode_shard(RUN, 2, big)


def test_the_recycler_keeps_at_most_its_bounds_and_deletes_the_rest(tmp_path):
    paths = []
    for i, size in enumerate([10, 10, 10, 10]):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(b"x" * size)
    r = recycle.Recycler(tmp_path, max_files=3, max_bytes=25)
    r.retire([*paths, tmp_path / "already-gone"])
    assert len(r) == 2  # 30 bytes would pass max_bytes
    assert not any(p.exists() for p in paths)
    kept = sorted(p.name for p in r.dir.iterdir())
    assert [r.take().name, r.take().name, r.take()] == [*kept, None]
    r.retire([tmp_path / "nothing"])
    assert len(r) == 0


def store_with_a_retired_shard(tmp_path):
    """A store that wrote one small shard in iteration 1 and dropped it (so retired its file)."""
    s = TrajectoryStore(tmp_path)
    _, small = big_and_small()
    s.write_shard(RUN, 1, small)
    s.drop(RUN, 1)
    s.settle(5.0)
    return s, small


def test_a_retired_file_that_vanished_is_replaced_by_a_new_one(tmp_path):
    s, small = store_with_a_retired_shard(tmp_path)
    for path in (tmp_path / recycle.DIRECTORY).iterdir():
        path.unlink()
    name = s.write_shard(RUN, 2, small)
    assert (s.iteration_dir(RUN, 2) / name).read_bytes() == encode_shard(RUN, 2, small)


def test_a_start_up_deletes_a_previous_process_s_retired_files_and_reads_no_run_from_them(tmp_path):
    store_with_a_retired_shard(tmp_path)
    assert len(list((tmp_path / recycle.DIRECTORY).iterdir())) == 1
    again = TrajectoryStore(tmp_path)
    assert list((tmp_path / recycle.DIRECTORY).iterdir()) == [] and len(again.recycler) == 0
    assert again.remove_dropped(set()) == []


def test_a_recycled_file_is_overwritten_where_it_lies_and_renamed_into_place_once(tmp_path, monkeypatch):
    s, small = store_with_a_retired_shard(tmp_path)
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "rename", lambda *a: renames.append(a) or pytest.fail("no rename before the write"))
    monkeypatch.setattr(os, "replace", lambda src, dst: renames.append((src, dst)) or real_replace(src, dst))
    name = s.write_shard(RUN, 2, small)
    [(src, dst)] = renames
    assert pathlib.Path(src).parent == tmp_path / recycle.DIRECTORY and dst == s.iteration_dir(RUN, 2) / name
    assert not list(s.iteration_dir(RUN, 2).glob("*.tmp"))


def test_a_write_that_fails_into_a_recycled_file_leaves_no_shard_and_drops_the_file(tmp_path, monkeypatch):
    import errno

    from elasticrl.scheduler import store

    s, small = store_with_a_retired_shard(tmp_path)

    def disk_full(fd, buffers):
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_all", disk_full)
    with pytest.raises(OSError, match="No space"):
        s.write_shard(RUN, 2, small)
    assert s.shard_names(RUN, 2) == set() and not list(s.iteration_dir(RUN, 2).iterdir())
    assert list((tmp_path / recycle.DIRECTORY).iterdir()) == []  # half overwritten: not kept
