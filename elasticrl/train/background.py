"""One call on a daemon thread whose failure resurfaces where its result is awaited.

The node runs a few things off its critical path: rank 0 submits the next iteration's tasks while
the current one updates, uploads each new policy version while the next iteration rolls out, and
records the run's progress; a checkpoint's writer ranks write its files while training goes on.
None may be lost silently: ``BackgroundCall.wait`` joins the thread with a deadline and re-raises
whatever the call raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from elasticrl.errors import ElasticRLError


class BackgroundCall:
    """``fn()`` started at once on a daemon thread named ``name``."""

    def __init__(self, fn: Callable[[], object], name: str):
        self.name = name
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._failure = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What the call raised, once it ended (``settle`` does not re-raise it)."""
        return self._failure

    def settle(self, timeout_s: float) -> bool:
        """Give the call up to ``timeout_s`` to finish, without re-raising: whether it did."""
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def wait(self, timeout_s: float) -> float:
        """Join the call within ``timeout_s``; re-raise its failure; ``ElasticRLError`` if it is
        still running then. Returns the seconds spent waiting."""
        t0 = time.monotonic()
        self._thread.join(timeout=timeout_s)
        if self._failure is not None:
            raise self._failure
        if self._thread.is_alive():
            raise ElasticRLError(f"{self.name} did not finish within {timeout_s:.0f}s")
        return time.monotonic() - t0
