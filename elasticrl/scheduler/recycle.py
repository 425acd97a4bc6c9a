"""Shard files of dropped iterations, kept to be overwritten instead of deleted.

Creating a file and deleting one are the costly part of storing a result batch on ext4. In
``bench/scheduler.py``'s durable stream, where each seal drops an old iteration's hundred 1 MiB
shards, ``perf`` showed the kernel allocating inodes (``find_inode_bit``, ``recently_deleted``:
ext4 skips the inodes freed in the last seconds, so each new file scans past them) and freeing and
allocating page-cache pages: about 0.9 CPU seconds per GB stored, against 0.15 s/GB to overwrite a
file that is already there (a loop of 1 MiB writes here). RocksDB and PostgreSQL recycle their log
files for the same reason.

``Recycler`` keeps up to ``max_files`` files and ``max_bytes`` bytes under ``<root>/.recycle``.
``retire`` (the store's reaper thread) moves dropped shards there and deletes what does not fit;
``take`` (the shard writer's thread) hands one out, which ``store.atomic_write`` overwrites and
truncates where it lies, then renames into place. Nothing reads a retired file: shards are read
on the event loop, which forgot the iteration before dropping it. A process that stops leaves
the directory as it is; the next one deletes it at start-up.
"""

from __future__ import annotations

import collections
import itertools
import os
import pathlib
import threading

DIRECTORY = ".recycle"
# A dropped iteration's files, in the usual runs: with 1 MiB batches, 2 GiB is 2000 batches. The
# file count binds only for small shards: 4096 single-slot engines sending a group at a time drop
# 16k shards per iteration (4 tasks each); with 4096 kept, three in four were created anew
# (bench/scheduler_scale.py's durable 4096 workers: 264-338 us per batch, against 239-253 us).
MAX_FILES = 16384
MAX_BYTES = 2 << 30


class Recycler:
    def __init__(self, root: pathlib.Path, *, max_files: int = MAX_FILES, max_bytes: int = MAX_BYTES):
        self.dir = root / DIRECTORY
        self.max_files, self.max_bytes = max_files, max_bytes
        self._lock = threading.Lock()
        self._files: collections.deque[tuple[pathlib.Path, int]] = collections.deque()
        self._bytes = 0
        self._names = itertools.count()
        if self.dir.is_dir():  # a previous process's: their names could clash with the new ones
            for path in self.dir.iterdir():
                path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._files)

    def retire(self, paths: list[pathlib.Path]) -> None:
        """Keep ``paths`` for reuse while there is room, delete the rest (files that are gone
        already are skipped)."""
        try:
            self.dir.mkdir(exist_ok=True)
        except OSError:
            pass  # then each rename below fails, and its file is deleted instead
        for path in paths:
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            with self._lock:
                keep = len(self._files) < self.max_files and self._bytes + size <= self.max_bytes
                if keep:
                    self._bytes += size
            if keep:
                target = self.dir / f"{next(self._names):012d}"
                try:
                    os.rename(path, target)
                except OSError:
                    with self._lock:
                        self._bytes -= size
                    keep = False
                else:
                    with self._lock:
                        self._files.append((target, size))
            if not keep:
                path.unlink(missing_ok=True)

    def take(self) -> pathlib.Path | None:
        """A retired file to overwrite, the oldest first, or None."""
        with self._lock:
            if not self._files:
                return None
            path, size = self._files.popleft()
            self._bytes -= size
        return path
