"""Wake-ups by key for waiters on the event loop, kept only while someone waits.

A key is whatever a client named (a barrier, a run's KV store, an iteration), so a map of events
that outlived their waiters would grow with every name ever waited on. Here an event exists from
its first waiter until it fires or its last waiter leaves.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)


class Signals:
    """Per key, the futures of its current waiters: ``fire`` resolves them all at once. One future
    (and a timer, with a timeout) per waiter, no task: a barrier's release wakes thousands. A
    waiter that stands for many (a Session stream with many members at one barrier) listens with
    one callback instead (``listen``)."""

    def __init__(self) -> None:
        self._events: dict[Hashable, set[asyncio.Future]] = {}
        self._callbacks: dict[Hashable, dict[int, Callable[[], None]]] = {}
        self._handles = itertools.count()

    def __len__(self) -> int:
        return len(self._events.keys() | self._callbacks.keys())

    def listen(self, key: Hashable, callback: Callable[[], None]) -> int:
        """Call ``callback()`` at the next ``fire(key)``, once; returns a handle for ``unlisten``."""
        handle = next(self._handles)
        self._callbacks.setdefault(key, {})[handle] = callback
        return handle

    def unlisten(self, key: Hashable, handle: int) -> None:
        callbacks = self._callbacks.get(key)
        if callbacks is not None:
            callbacks.pop(handle, None)
            if not callbacks:
                del self._callbacks[key]

    async def wait(self, key: Hashable, timeout_s: float | None) -> bool:
        """Wait until ``fire(key)`` or ``timeout_s`` (None: no limit); True when fired."""
        loop = asyncio.get_running_loop()
        waiters = self._events.get(key)
        if waiters is None:
            waiters = self._events[key] = set()
        waiter = loop.create_future()
        waiters.add(waiter)
        timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), _expire, waiter)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            waiters.discard(waiter)
            if not waiters and self._events.get(key) is waiters:
                del self._events[key]

    def fire(self, key: Hashable) -> None:
        """Wake every current waiter of ``key``; later waiters wait for the next fire."""
        waiters = self._events.pop(key, None)
        if waiters is not None:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(True)
        callbacks = self._callbacks.pop(key, None)
        if callbacks is not None:
            for callback in callbacks.values():
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one listener's bug must not stop the others
                    log.exception("listener %r of %r failed", callback, key)


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)
