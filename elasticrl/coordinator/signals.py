"""Wake-ups by key for waiters on the event loop, kept only while someone waits.

A key is whatever a client named (a barrier, a run's KV store, an iteration), so a map of events
that outlived their waiters would grow with every name ever waited on. Here an event exists from
its first waiter until it fires or its last waiter leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class _Signal(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waiters = 0


class Signals:
    def __init__(self) -> None:
        self._events: dict[Hashable, _Signal] = {}

    def __len__(self) -> int:
        return len(self._events)

    async def wait(self, key: Hashable, timeout_s: float | None) -> bool:
        """Wait until ``fire(key)`` or ``timeout_s`` (None: no limit); True when fired."""
        signal = self._events.get(key)
        if signal is None:
            signal = self._events[key] = _Signal()
        signal.waiters += 1
        try:
            await asyncio.wait_for(signal.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            signal.waiters -= 1
            if signal.waiters == 0 and self._events.get(key) is signal:
                del self._events[key]

    def fire(self, key: Hashable) -> None:
        """Wake every current waiter of ``key``; later waiters wait for the next fire."""
        signal = self._events.pop(key, None)
        if signal is not None:
            signal.set()
