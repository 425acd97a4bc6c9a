"""``EnvThread``: the thread one env instance is built on and whose sync calls it runs, in order.

The episode runner gives every env instance a thread of its own instead of a shared pool. A
call that hangs past its deadline (a browser that never answers) then holds only its own env's
thread, and that env is discarded: a pool sized to the episodes in flight was used up by a few
hung calls, and every later env call of the runner timed out. The threads are daemons, so a hung
call does not hold up the exit of the process either (a pool's threads are joined at exit). And
an env whose library is bound to the thread that created it (Playwright's sync API) is built and
driven on one thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

_names = itertools.count()


class EnvThread:
    """A daemon thread that runs the calls ``submit`` gives it, one at a time, in order."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"env-{next(_names)}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` after the calls submitted before it; its result or exception in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        """End the thread once the calls submitted so far have run (at once if none is running)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle, through the future
                future.set_exception(exc)
