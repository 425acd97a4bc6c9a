"""How long a block of code keeps the GIL from the process's other threads: what a lease keep-alive
thread beside it would have waited (``Stall``, ``timed``)."""

from __future__ import annotations

import threading
import time


class Stall:
    """The longest gap between the wake-ups of a thread that sleeps 10 ms at a time, over a ``with``
    block: how long the block kept the GIL from the process's other threads (a keep-alive)."""

    def __enter__(self):
        self.longest, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.01):
            now = time.perf_counter()
            self.longest, last = max(self.longest, now - last - 0.01), now

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn) -> tuple[float, float]:
    """Seconds ``fn()`` took and its ``Stall``."""
    with Stall() as stall:
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
    return seconds, stall.longest
