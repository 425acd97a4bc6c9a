"""Per-iteration snapshots of the training state in host memory, so a node failure loses no
finished iteration.

After every iteration each node's local rank 0 writes the full training state (model, optimizer,
reference, data position, iteration; the same files as a checkpoint) to a directory in host memory
(``/dev/shm``), which outlives the worker processes that torchrun restarts. The write runs on a
background thread, off the critical path; the previous snapshot stays until the new one is
complete (written under a temporary name, renamed, then the old one deleted). A re-formed world
resumes from the newest snapshot or checkpoint that any survivor holds, broadcast from that rank
(``NodeTrainer._resume``), so nodes that join get the state over torch.distributed, not from disk.

Every node holds the whole state (not a shard of it), so one survivor is enough and the state
loads into a world of any size. Periodic checkpoints to disk stay, for the loss of every node.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from typing import Any

import torch

from elasticrl.errors import ElasticRLError
from elasticrl.train import checkpoint as ckpt
from elasticrl.train.background import BackgroundCall

log = logging.getLogger(__name__)

SHM = "/dev/shm"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def run_root(run_dir: str, run_id: str) -> str:
    """Where a run's snapshots live on this host: host memory (``/dev/shm``) where there is one,
    else ``<run_dir>/snapshots``. Freed when the run finishes."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        # The run dir in the name too: two runs that share an id (two tests in one second) must
        # never resume from each other's snapshots; a resumed run has the same run dir.
        tag = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:10]
        return os.path.join(SHM, "elasticrl", f"{_safe(run_id)}-{tag}")
    return os.path.join(run_dir, "snapshots")


def default_dir(run_dir: str, run_id: str, node: str) -> str:
    """One directory per node under ``run_root``, so nodes sharing a host keep their own."""
    return os.path.join(run_root(run_dir, run_id), _safe(node))


class Snapshots:
    """The snapshots of one node in ``directory``: at most one write in flight.

    ``save`` takes the state right after the update; ``record`` adds the iteration's metrics
    record (a world resumed from the snapshot writes it if nobody did); ``write_pending`` starts
    writing it on a background thread. The node calls the latter when its main thread is about to
    wait anyway (for the next iteration's seal): a write started at once would take the GIL from
    the main thread for its first milliseconds. A snapshot without its record is never written.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._writing: BackgroundCall | None = None
        self._pending: tuple | None = None
        # The main thread takes and writes; a SIGTERM watchdog (train.stop) may flush while the
        # main thread is stuck in a collective, or wait here while it flushes itself.
        self._lock = threading.RLock()

    def latest(self) -> int:
        """The newest complete snapshot's iteration; 0 when there is none."""
        return ckpt.latest_iteration(self.directory)

    def save(
        self, iteration: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
        meta: dict[str, Any], reference: dict[str, torch.Tensor] | None, *, timeout_s: float = 600.0,
    ) -> None:
        """Take snapshot ``iteration`` (copies the training will not change) to write next, once
        the write before it finished (its failure is re-raised here)."""
        with self._lock:
            self.wait(timeout_s)
            self._pending = (iteration, model_state, optimizer_state, {**meta, "snapshot": True}, reference)

    def taken(self, iteration: int) -> tuple | None:
        """(model state, optimizer state, meta, reference) of snapshot ``iteration`` if it is the
        one taken last and not written yet: a checkpoint of the same iteration reuses it."""
        if self._pending is None or self._pending[0] != iteration:
            return None
        _, model_state, optimizer_state, meta, reference = self._pending
        return model_state, optimizer_state, {k: v for k, v in meta.items() if k not in ("snapshot", "metrics")}, reference

    def record(self, metrics: dict[str, Any]) -> None:
        """The taken snapshot's metrics record: from now on it may be written."""
        with self._lock:
            if self._pending is not None and self._pending[0] == metrics.get("iteration"):
                self._pending[3]["metrics"] = metrics

    def write_pending(self) -> None:
        """Start writing the snapshot taken last, if it has its record and is not written yet."""
        with self._lock:
            if self._pending is None or self._writing is not None or "metrics" not in self._pending[3]:
                return
            iteration, model_state, optimizer_state, meta, reference = self._pending
            self._pending = None
            self._writing = BackgroundCall(
                lambda: ckpt.save_checkpoint(
                    self.directory, iteration, model_state, optimizer_state, meta, keep_last=1, reference=reference,
                ),
                f"snapshot of iteration {iteration}",
            )

    def wait(self, timeout_s: float = 600.0) -> None:
        """Wait for the write in flight, if any; re-raise its failure."""
        with self._lock:
            writing, self._writing = self._writing, None
            if writing is not None:
                writing.wait(timeout_s)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Write what was taken and wait for it: before the process exits, even on a failure (the
        survivors of a dead node resume from these). Callable from another thread."""
        if not self._lock.acquire(timeout=timeout_s):
            raise ElasticRLError(f"snapshots in {self.directory}: still busy after {timeout_s:.0f}s")
        try:
            self.wait(timeout_s)
            self.write_pending()
            self.wait(timeout_s)
        finally:
            self._lock.release()
