"""glibc's allocator, tuned for a process that receives megabyte messages: the coordinator.

Each 1 MiB trajectory batch gRPC hands the coordinator is a fresh ``bytes``. With glibc's
defaults its memory comes from a new mapping or from the top of the heap, which ``free`` gives
back to the kernel soon after, so every batch is faulted in page by page again: in
``bench/scheduler.py``'s stream, page faults and the kernel's page frees were the largest cost
after gRPC's own. Raising the mmap threshold (allocations below it come from the heap) and the
trim threshold (free memory the heap keeps before giving it back) lets the next batch reuse the
last one's pages: the in-memory coordinator's CPU per GB streamed fell from ~1.3 to ~1.0 s.
The cost is up to ``TRIM_BYTES`` of freed memory kept by the process.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment (glibc's own
tunables) win, and ``ELASTICRL_MALLOC_TUNE=0`` keeps glibc's defaults: then nothing is changed.
Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

MMAP_BYTES = 64 << 20
TRIM_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


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
