"""A watch on torch's JIT op build locks while DeepSpeed initializes.

DeepSpeed compiles a small op at its first use on a machine (``deepspeed_shm_comm`` on CPU), through
``torch.utils.cpp_extension``, which takes ``<extensions root>/<python+device>/<op>/lock`` by
creating that file and waits, with no deadline and no message, for as long as it exists. A build
killed midway (a SIGKILLed node, a test run stopped) leaves the file behind, and every later
DeepSpeed process on that machine then hangs in ``deepspeed.initialize``.

``BuildLockWatch`` runs beside the initialization: after ``warn_after_s`` it logs each lock it
finds (its path, its age, how long nothing in its build directory changed) every ``warn_after_s``,
and it removes a lock that is stale: older than ``stale_after_s`` with nothing in its directory
written for as long (a build writes its sources, ninja file and objects within seconds; the op
here takes ~40 s to build on two cores). A process still building keeps changing its directory,
so its lock is left alone.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WARN_AFTER_S = 60.0
STALE_AFTER_S = 600.0


def extensions_root() -> pathlib.Path:
    """Where torch builds JIT ops: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``
    (``torch.utils.cpp_extension.get_default_build_root``)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(os.path.expanduser("~")) / ".cache" / "torch_extensions"


def build_locks(root: pathlib.Path) -> list[pathlib.Path]:
    """Every op build lock under ``root`` (``<root>/<python+device>/<op>/lock``)."""
    try:
        return sorted(root.glob("*/*/lock"))
    except OSError:
        return []


def last_write(directory: pathlib.Path) -> float:
    """The newest modification time of ``directory`` and the files in it, one level down (a
    build writes its objects there and in ``build/``-like subdirectories of ninja's)."""
    newest = 0.0
    try:
        newest = directory.stat().st_mtime
        for entry in os.scandir(directory):
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    except OSError:
        pass
    return newest


def check_locks(root: pathlib.Path, now: float, *, stale_after_s: float = STALE_AFTER_S) -> list[tuple[pathlib.Path, float, float, bool]]:
    """Look at each build lock under ``root`` at wall time ``now``: (path, its age, seconds since
    its directory last changed, removed). A stale lock is removed here."""
    found = []
    for lock in build_locks(root):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue  # released meanwhile
        idle = now - last_write(lock.parent)
        removed = False
        if age >= stale_after_s and idle >= stale_after_s:
            try:
                lock.unlink()
                removed = True
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("could not remove the stale op build lock %s: %s", lock, exc)
        found.append((lock, age, idle, removed))
    return found


class BuildLockWatch:
    """A daemon thread, from ``__enter__`` to ``__exit__``: see the module docstring."""

    def __init__(self, *, root: pathlib.Path | None = None, warn_after_s: float = WARN_AFTER_S,
                 stale_after_s: float = STALE_AFTER_S, wall_clock: Callable[[], float] = time.time):
        self.root = extensions_root() if root is None else root
        self.warn_after_s, self.stale_after_s = warn_after_s, stale_after_s
        self.wall_clock = wall_clock
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "BuildLockWatch":
        # Locks that are stale already go now, so that this process builds the op itself: removed
        # while it waits, its wait ends with no op built, and the initialization fails (clearly).
        self._report(0.0)
        self._thread = threading.Thread(target=self._run, name="build-lock-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._done.wait(self.warn_after_s):
            self._report(time.monotonic() - started)

    def _report(self, waited: float) -> None:
        for lock, age, idle, removed in check_locks(self.root, self.wall_clock(), stale_after_s=self.stale_after_s):
            if removed:
                log.warning("removed the stale op build lock %s (%.0f s old, nothing in its directory written for %.0f s: "
                            "a build that was killed left it); the op is built again", lock, age, idle)
            elif waited > 0:
                log.warning("DeepSpeed has been starting for %.0f s; an op build lock exists: %s (%.0f s old, its directory "
                            "last written %.0f s ago). Another process may be building the op; if none is, a killed build "
                            "left it, and it is removed once %.0f s pass with no writes (or delete it yourself)",
                            waited, lock, age, idle, self.stale_after_s)
