"""glibc's allocator, tuned for processes that move megabyte messages: the coordinator, which
receives trajectory batches (``tune``), and a rollout engine's process, which sends them
(``tune_sender``).

Each 1 MiB trajectory batch gRPC hands the coordinator is a fresh ``bytes``. With glibc's
defaults its memory comes from a new mapping or from the top of the heap, which ``free`` gives
back to the kernel soon after, so every batch is faulted in page by page again: in
``bench/scheduler.py``'s stream, page faults and the kernel's page frees were the largest cost
after gRPC's own. Raising the mmap threshold (allocations below it come from the heap) and the
trim threshold (free memory the heap keeps before giving it back) lets the next batch reuse the
last one's pages: the in-memory coordinator's CPU per GB streamed fell from ~1.3 to ~1.0 s.
The cost is up to ``TRIM_BYTES`` of freed memory kept by the process.

The sending side has the same churn (each batch is serialized into a fresh ``bytes``), but it is
a trainer's or an engine's process, whose allocations are mostly torch's; so ``tune_sender``
stays inside what glibc does by itself: its dynamic mmap threshold rises up to 32 MiB as large
chunks are freed, with the trim threshold at twice it. It pins the threshold at twice the batch
size (4 MiB at least, 32 MiB at most) and trim at 64 MiB: in ``bench/scheduler.py``'s stream the
worker's CPU per GB fell from 0.95-1.05 to 0.67-0.81 s.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment (glibc's own
tunables) win, and ``ELASTICRL_MALLOC_TUNE=0`` keeps glibc's defaults: then nothing is changed.
Elsewhere than glibc this does nothing.

Python's cyclic garbage collector is tuned for the coordinator too (``tune_gc``). With its
defaults (700, 10, 10) the youngest generation is collected every 700 container allocations and
the whole heap (every task, member and barrier held) every ~70,000, on the event loop, where each
pause holds every stream and barrier. A coordinator allocates a few objects per message (the
protobuf, a future, a queue item), so at 512 members a barrier round triggered tens of young
collections and, now and then, a full one. ``GC_THRESHOLDS`` (10,000, 20, 20) collects the young
generation 14x less often and the whole heap ~30x less often; the garbage a coordinator makes is
rare (its objects die by reference count), so memory does not grow with it.
``ELASTICRL_GC_THRESHOLD=700,10,10`` gives Python's defaults back.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

log = logging.getLogger(__name__)

GC_THRESHOLDS = (10_000, 20, 20)
GC_ENV = "ELASTICRL_GC_THRESHOLD"
MMAP_BYTES = 64 << 20
TRIM_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
GLIBC_MMAP_MAX = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX (64-bit): the dynamic threshold's ceiling
SENDER_MMAP_MIN_BYTES = 4 << 20
SENDER_TRIM_BYTES = 2 * GLIBC_MMAP_MAX


def tune(*, mmap_bytes: int = MMAP_BYTES, trim_bytes: int = TRIM_BYTES) -> bool:
    """Set the thresholds (see the module docstring). Returns whether they were set."""
    if os.environ.get("ELASTICRL_MALLOC_TUNE", "1") == "0" or any(
        os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS no such symbol)
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; keeping the allocator's defaults")
    return ok


def sender_thresholds(batch_bytes: int) -> tuple[int, int]:
    """(mmap, trim) thresholds for a process sending result batches of ``batch_bytes``."""
    return min(max(SENDER_MMAP_MIN_BYTES, 2 * batch_bytes), GLIBC_MMAP_MAX), SENDER_TRIM_BYTES


def tune_sender(batch_bytes: int) -> bool:
    """For a process that streams result batches (see the module docstring). Returns whether set."""
    mmap_bytes, trim_bytes = sender_thresholds(batch_bytes)
    return tune(mmap_bytes=mmap_bytes, trim_bytes=trim_bytes)


def gc_thresholds(env: str | None) -> tuple[int, int, int]:
    """``GC_THRESHOLDS``, or the three counts ``env`` names ("700,10,10"). Raises ``ValueError``."""
    if not env:
        return GC_THRESHOLDS
    try:
        counts = tuple(int(x) for x in env.split(","))
    except ValueError:
        counts = ()
    if len(counts) != 3 or min(counts) < 0:
        raise ValueError(f"{GC_ENV}={env!r}: expected three counts >= 0 as in gc.set_threshold, e.g. 700,10,10")
    return counts  # type: ignore[return-value]


def tune_gc() -> tuple[int, int, int]:
    """Set the cyclic collector's thresholds for a coordinator (see the module docstring);
    returns them. Raises ``ValueError`` for a malformed ``ELASTICRL_GC_THRESHOLD``."""
    thresholds = gc_thresholds(os.environ.get(GC_ENV))
    gc.set_threshold(*thresholds)
    return thresholds
