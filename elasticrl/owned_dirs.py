"""Private temp directories that a killed process does not leave behind for good.

A process that makes one (``OwnedDir``) holds an flock on the directory's OWNER_LOCK file for as
long as it lives; the kernel drops the lock when its holder dies, however it dies. The next
process on the host that makes a directory with the same prefix first removes those whose lock
nobody holds (``remove_orphaned``): the weights of a SIGKILLed coordinator without a state dir,
the session relay and stop-request directories of a SIGKILLed torchrun agent. Where the file
system has no flock, the directory is only removed by its own process's ``remove``. Names carry
the host's name, so that hosts sharing a ``$TMPDIR`` whose locks are local to each host (NFS with
``local_lock``) only ever sweep their own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
import weakref

log = logging.getLogger(__name__)

OWNER_LOCK = ".owner.lock"
_MINE: set[str] = set()  # this process's directories: never swept (NFS's emulated flock is per process)


def host_prefix(prefix: str) -> str:
    """``prefix`` with this host's name (letters, digits, dots and dashes; at most 32)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:32] or "host"
    return f"{prefix}{host}-"


def hold_owner_lock(directory: pathlib.Path, what: str):
    """Lock ``directory``'s OWNER_LOCK for as long as the returned file stays open. Locked before
    it gets its name, so no sweep ever finds it unlocked while its owner lives. None where the
    file system has no flock (or there is no fcntl), with a warning naming ``what``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".owner.", suffix=".tmp")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else has opened yet
        os.replace(tmp, directory / OWNER_LOCK)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        log.warning("%s in %s: no owner lock (%s); if this process is killed, nothing removes them", what, directory, exc)
        return None
    return os.fdopen(fd, "w")


def remove_orphaned(parent: str | os.PathLike, prefix: str) -> list[str]:
    """Delete the directories ``parent/prefix*`` whose OWNER_LOCK no process holds; returns them.
    A directory without the file (being made right now, or not one of these) is left alone."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return []
    removed = []
    for path in pathlib.Path(parent).glob(prefix + "*"):
        if str(path) in _MINE:
            continue
        try:
            fd = os.open(path / OWNER_LOCK, os.O_RDWR)  # NFS locks only what is open for writing
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # not "its owner lives": say why
                log.debug("cannot tell whether %s is orphaned: %s", path, exc)
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    return removed


class OwnedDir:
    """A fresh directory ``parent/prefix<host>-*`` (mode 0700) owned by this process; ``what``
    names its contents in the log. Those of the same kind whose owner was killed are removed
    first. Removed by ``remove``, when the object is collected, or at exit (as a
    ``TemporaryDirectory`` is); by the next maker of the kind if the process is killed.
    ``OSError`` when the directory cannot be made (a full or read-only ``$TMPDIR``)."""

    def __init__(self, prefix: str, what: str, parent: str | None = None):
        parent = parent or tempfile.gettempdir()
        prefix = host_prefix(prefix)
        removed = remove_orphaned(parent, prefix)
        if removed:
            log.info("removed %d %s left by killed processes: %s", len(removed), what, ", ".join(removed))
        self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        _MINE.add(self.path)
        owner = hold_owner_lock(pathlib.Path(self.path), what)
        self._finalizer = weakref.finalize(self, _remove, self.path, owner)

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent)."""
        self._finalizer()


def _remove(path: str, owner) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if owner is not None:
        owner.close()
    _MINE.discard(path)
