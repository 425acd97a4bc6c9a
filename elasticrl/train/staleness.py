"""Asynchronous RL with bounded staleness (``rollout.max_staleness = k``): which iterations the
driver submits ahead, which policy version their tasks ask for, which fetched groups may be trained
on, and how much of its time an engine spent idle.

Iteration ``i`` trains from policy version ``i - 1`` and produces version ``i``. With ``k = 0``
(on-policy, the default) the driver submits iteration ``i`` when it starts it (or, with
``rollout.presubmit``, during the update of ``i - 1``), and its tasks ask for version ``i - 1``:
engines draw nothing while the trainer updates. With ``k >= 1`` the driver keeps ``k`` iterations
submitted ahead of the one it waits for, and iteration ``j``'s tasks ask for *at least* version
``j - 1 - k``: engines keep drawing with the newest version they hold while the trainer computes
the next one, and no sample is more than ``k`` versions older than the policy it trains. Task
versions are minimums (the gates of ``rollout_link.VersionGate`` and of rollout-only workers wait
until an engine holds at least that version), and every group records the version it was actually
drawn with; the trainer drops, at fetch, any group that is older than ``k`` anyway (a group drawn
before a trainer restart, say) and reports the lag of the rest.

Pure Python (no torch): ``bench/async.py`` drives the same window with simulated engines.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol


def min_policy_version(iteration: int, max_staleness: int) -> int:
    """The oldest policy version iteration ``iteration``'s groups may be drawn with: the version
    it trains from (``iteration - 1``) less ``max_staleness``, and never below 0."""
    return max(0, iteration - 1 - max_staleness)


class SubmissionWindow:
    """The driver's submission schedule: while it waits for iteration ``i`` to seal, iterations
    ``i .. i + k`` are submitted (up to ``last``); during ``i``'s update, ``i + 1 + k`` may be
    submitted in the background (its tasks ask for version ``i``, so they wait in the engines until
    the update's push, exactly as the on-policy presubmit does with ``k = 0``).

    The caller submits and then ``mark``s; a submit that may not have landed is simply not marked
    (``due`` lists it again; submitting the same tasks twice is a no-op on the scheduler).
    """

    def __init__(self, max_staleness: int, last: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness: {max_staleness} must be >= 0")
        self.k = max_staleness
        self.last = last
        self._submitted: set[int] = set()

    def due(self, iteration: int) -> list[int]:
        """Iterations to submit before waiting for ``iteration``'s seal, oldest first."""
        return [j for j in range(iteration, min(iteration + self.k, self.last) + 1) if j not in self._submitted]

    def ahead(self, iteration: int) -> int | None:
        """The iteration to submit during ``iteration``'s update, or None (past the last one, or
        already submitted)."""
        j = iteration + 1 + self.k
        return j if j <= self.last and j not in self._submitted else None

    def mark(self, iteration: int) -> None:
        self._submitted.add(iteration)

    def task_version(self, iteration: int) -> int:
        return min_policy_version(iteration, self.k)


class Versioned(Protocol):
    """What ``keep_fresh`` reads of a fetched group (``scheduler.state.FetchedGroup``)."""

    policy_version: int
    samples: Sequence


def keep_fresh(groups: Iterable[Versioned], trainer_version: int, max_staleness: int) -> tuple[list, int, dict[int, int]]:
    """Split fetched groups into those the trainer at ``trainer_version`` may train on and the
    stale ones (drawn with a version older than ``trainer_version - max_staleness``).

    Returns (kept groups, number of dropped samples, {lag: samples} over the kept samples, lag =
    ``trainer_version - policy_version``; negative for a group a previous incarnation of the
    trainer drew with a version this one has not reached again).
    """
    kept, dropped, lags = [], 0, collections.Counter()
    for g in groups:
        lag = trainer_version - g.policy_version
        if lag > max_staleness:
            dropped += len(g.samples)
        else:
            kept.append(g)
            lags[lag] += len(g.samples)
    return kept, dropped, dict(lags)


def merge_lags(histograms: Iterable[dict]) -> dict[int, int]:
    """Sum {lag: samples} histograms (one per rank; keys may have become strings in JSON)."""
    total = collections.Counter()
    for h in histograms:
        for lag, n in (h or {}).items():
            total[int(lag)] += int(n)
    return dict(sorted(total.items()))


def lag_summary(histogram: dict[int, int]) -> dict:
    """The metrics of one iteration's lag histogram: the histogram itself (string keys, as JSON
    keeps them), its mean and its maximum (0 without samples)."""
    n = sum(histogram.values())
    return {
        "policy_lag": {str(lag): count for lag, count in sorted(histogram.items())},
        "policy_lag_mean": sum(lag * c for lag, c in histogram.items()) / n if n else 0.0,
        "policy_lag_max": max(histogram, default=0),
    }


class IdleMeter:
    """Busy time of an engine that runs batches on several threads at once: busy while at least
    one batch is in hand past its version gate. ``take()`` returns the idle share of the wall time
    since the previous ``take()`` (the first one: since construction)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._busy = 0.0
        self._since = self._mark = clock()  # _since: start of the current busy stretch

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1

    def stop(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += self._clock() - self._since

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def take(self) -> float:
        """Idle fraction in [0, 1] since the previous call."""
        with self._lock:
            now = self._clock()
            busy = self._busy + (now - self._since if self._active else 0.0)
            wall = now - self._mark
            self._busy, self._mark, self._since = 0.0, now, now
        return min(1.0, max(0.0, 1.0 - busy / wall)) if wall > 0 else 0.0
