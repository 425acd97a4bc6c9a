"""Leaving promptly on torchrun's SIGTERM, even from inside a collective.

torchrun stops a worker with SIGTERM, then SIGKILL 30 s later. Python runs a signal handler only
when the main thread is back in the interpreter, so a worker blocked in a collective with a silent
peer (a SIGSTOPped host keeps its sockets open, so nothing fails) would ignore the SIGTERM until
the SIGKILL, and the re-formed world would wait the 30 s for it.

``install`` turns SIGTERM into ``SystemExit`` in the main thread (the clean way out, when the main
thread can take it) and also wakes a watchdog thread through the signal wakeup fd, which Python's
C-level handler writes at once, whatever the main thread is doing. If the process is still alive
``grace_s`` later, the watchdog runs the registered flushes (``on_forced_exit``: the snapshot of
the last finished iteration) within ``flush_s`` and ends the process with ``os._exit``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM
_flushes: list[Callable[[float], None]] = []


def on_forced_exit(flush: Callable[[float], None]) -> Callable[[], None]:
    """Run ``flush(timeout_s)`` before a forced exit; returns the function that unregisters it."""
    _flushes.append(flush)
    return lambda: _flushes.remove(flush) if flush in _flushes else None


def install(grace_s: float = 1.0, flush_s: float = 60.0) -> bool:
    """Call from the main thread. False (the SIGTERM handler alone) where the wakeup fd is taken."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an event loop's): leave it to them
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    threading.Thread(target=_watch, args=(r, grace_s, flush_s), name="sigterm-watchdog", daemon=True).start()
    return True


def _watch(fd: int, grace_s: float, flush_s: float) -> None:
    while signal.SIGTERM not in os.read(fd, 64):  # one byte per signal that arrived
        pass
    time.sleep(grace_s)  # the main thread leaves cleanly if it can; then this thread dies with it
    log.warning("still running %.1fs after SIGTERM (blocked in a collective?): flushing, then exiting", grace_s)
    exit_now(EXIT_CODE, flush_s)


def exit_now(code: int, flush_s: float = 60.0) -> None:
    """Run the registered flushes within ``flush_s``, then end the process with ``code`` at once,
    from any thread, whatever the main thread is blocked in."""
    deadline = time.monotonic() + flush_s
    for flush in list(_flushes):
        try:
            flush(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - exiting regardless
            log.warning("flush before exit failed: %s", exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
