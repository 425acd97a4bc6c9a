"""Stamps every log record of a worker with its node, rank and iteration, and keeps a warning that
repeats from flooding the log.

``WorkerLogContext`` is a ``logging.Filter`` installed on the worker's handler by the entry point
(library modules only call ``logging.getLogger(__name__)``); the loop updates ``iteration`` as it
goes, so a line from any module says where and when it was written. ``Repeats`` decides which of
many warnings with the same cause are written (a broken env fails every task the same way).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

NODE_NAME_ENV = "ELASTICRL_NODE_NAME"
FORMAT = "%(asctime)s %(levelname)s node=%(node)s rank=%(rank)s iter=%(iteration)s %(name)s: %(message)s"


def node_name() -> str:
    """This machine's name in logs: $ELASTICRL_NODE_NAME (set it where hosts share a name), else the hostname.

    Not torchrun's GROUP_RANK: that is reassigned every rendezvous round, so it cannot tell which
    machine a line came from after the group re-forms.
    """
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


class WorkerLogContext(logging.Filter):
    def __init__(self, node: int | str = "-", rank: int | str = "-"):
        super().__init__()
        self.node = node
        self.rank = rank
        self.iteration: int | str = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.node, record.rank, record.iteration = self.node, self.rank, self.iteration
        return True


class Repeats:
    """Which warnings of one kind to write: the first of each cause, then at most one a
    ``window_s`` per cause, saying how many were left out since. Any thread."""

    def __init__(self, window_s: float = 30.0, *, clock: Callable[[], float] = time.monotonic, max_causes: int = 256):
        self.window_s = window_s
        self.clock = clock
        self.max_causes = max_causes
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # cause -> (when last written, left out since)

    def take(self, cause: str) -> int | None:
        """None: leave this one out (counted); else write it, with the count left out before it."""
        now = self.clock()
        with self._lock:
            last = self._seen.get(cause)
            if last is not None and now - last[0] < self.window_s:
                self._seen[cause] = (last[0], last[1] + 1)
                return None
            if last is None and len(self._seen) >= self.max_causes:
                self._seen.pop(next(iter(self._seen)))  # the oldest cause: bounded for a run of varied errors
            self._seen[cause] = (now, 0)
            return 0 if last is None else last[1]
