"""One call on a daemon thread whose failure resurfaces where its result is awaited.

The node runs a few things off its critical path: rank 0 submits the next iteration's tasks while
the current one updates, uploads each new policy version while the next iteration rolls out, and
records the run's progress; a checkpoint's writer ranks write its files while training goes on.
None may be lost silently: ``BackgroundCall.wait`` joins the thread with a deadline and re-raises
whatever the call raised.

Where every rank must wait for such a call (a checkpoint's write before the next one gathers, the
resume's read of a checkpoint, the start-up check of a dataset's prompts), ``wait_together`` and
``run_together`` let the ranks poll each other once a second instead of waiting inside one
collective, whose time limit a slow disk or a big share would pass.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elasticrl.errors import ElasticRLError

T = TypeVar("T")


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


# How often ranks waiting together for their background calls check on each other.
POLL_S = 1.0
_DONE, _BUSY, _FAILED = 0, 1, 2


def wait_together(job: BackgroundCall | None, deadline: float, *, reduce: bool,
                  on_wait: Callable[[], None] | None = None) -> bool:
    """*Collective* (with ``reduce``). Until ``job`` (this rank's, or None: nothing to wait for
    here) has ended on every rank, every rank polls together: one small all-reduce each ``POLL_S``,
    so that none sits in one collective past the process group's time limit while another rank's
    disk, or its share of a long local job, is slow. Returns True once every job ended well; False,
    on every rank alike, once one failed or passed its ``deadline`` (``time.monotonic()``).
    ``on_wait`` is called once, at the first poll that finds a job still running."""
    import torch.distributed as dist

    from elasticrl.train.dist import all_reduce_int

    while True:
        if job is None:
            state = _DONE
        elif job.running:
            state = _FAILED if time.monotonic() >= deadline else _BUSY
        else:
            state = _FAILED if job.failure is not None else _DONE
        if reduce:
            state = all_reduce_int(state, dist.ReduceOp.MAX)
        if state != _BUSY:
            return state == _DONE
        if on_wait is not None:
            on_wait()
            on_wait = None
        if job is not None and job.running:
            job.settle(POLL_S)
        else:
            time.sleep(POLL_S)


def run_together(fn: Callable[[], T], name: str, *, reduce: bool) -> T:
    """*Collective* (with ``reduce``). ``fn()`` on this rank, on a thread, while every rank polls
    together (``wait_together``): each rank's share of a long local job (minutes, say) keeps none
    of them in one collective past its time limit. Raises ``fn``'s failure here, and on the other
    ranks an ``ElasticRLError`` naming ``name``."""
    box: dict[str, T] = {}
    job = BackgroundCall(lambda: box.setdefault("out", fn()), name)
    if wait_together(job, math.inf, reduce=reduce):
        return box["out"]
    if job.failure is not None:
        raise job.failure
    raise ElasticRLError(f"{name}: failed on another rank (its log says why)")
