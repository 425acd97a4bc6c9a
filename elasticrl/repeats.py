"""Which of many warnings with one cause are worth writing.

A broken env fails every task the same way; a coordinator that is down fails every reopen and
keep-alive until it is back. Either would write a line per attempt. ``Repeats`` lets the first of
each cause through, then at most one a window per cause, and says how many were left out and for
how long the cause has lasted; ``ok(cause)`` ends a cause, so the next failure is new and written
at once. Any thread.

The other way round, a call that retries quietly (a client waiting for an unreachable
coordinator) says nothing for as long as it is allowed to wait: ``still_waiting`` writes one line
if it outlasts a few seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Repeat:
    """A warning to write: ``left_out`` of its cause were left out since the last one written,
    ``count`` were taken since the cause began (this one included), over ``lasting_s``."""

    left_out: int
    count: int
    lasting_s: float

    def outage(self) -> str:
        """The text to append to a failed attempt's warning: "" for the first."""
        return "" if self.count == 1 else f" (failing for {self.lasting_s:.0f}s, {self.count} attempts)"


class Repeats:
    def __init__(self, window_s: float = 30.0, *, clock: Callable[[], float] = time.monotonic, max_causes: int = 256):
        self.window_s = window_s
        self.clock = clock
        self.max_causes = max_causes
        self._lock = threading.Lock()
        # cause -> [when it began, when last written, taken in all, left out since last written]
        self._causes: dict[str, list] = {}

    def take(self, cause: str = "") -> Repeat | None:
        """None: leave this one out (it is counted); else write it, as the ``Repeat`` says."""
        now = self.clock()
        with self._lock:
            seen = self._causes.get(cause)
            if seen is None:
                if len(self._causes) >= self.max_causes:
                    self._causes.pop(next(iter(self._causes)))  # the oldest cause: bounded for a run of varied errors
                seen = self._causes[cause] = [now, float("-inf"), 0, 0]
            seen[2] += 1
            if now - seen[1] < self.window_s:
                seen[3] += 1
                return None
            left_out, seen[1], seen[3] = seen[3], now, 0
            return Repeat(left_out, seen[2], now - seen[0])

    def ok(self, cause: str = "") -> None:
        """The cause is over (the coordinator answered): its next failure is written at once."""
        with self._lock:
            self._causes.pop(cause, None)


@contextlib.contextmanager
def still_waiting(after_s: float, say: Callable[[], None]) -> Iterator[None]:
    """Call ``say`` (once, from a timer thread) if the block has not ended within ``after_s``."""
    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
