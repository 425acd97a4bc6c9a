"""Per-iteration snapshots of the training state that outlive the worker process and its host, so
a node failure loses no finished iteration.

After every update each rank takes its own part of the state (``TrainStrategy.sharded_state``:
a DTensor shard, its slices of the ZeRO partitions, or, of state every rank holds alike, the
tensors it owns; ``shards.own_part``) into one CPU buffer, the only copy of it, with a JSON part
(data position, hyper-parameters, the iteration's metrics record). From there it goes two ways:

* **To a buddy on another node** at once, over a gloo group of its own (``shard_wire``): the rank
  at the same position on the next node in ring order (``snapshot_plan.buddies``), so the shard of
  a host lost with its memory still exists; an all-reduce on that group then confirms that every
  rank's buddy holds its copy. ``take`` returns only then, and the trainer opens the gate to the
  new policy and reports the iteration only after it: no engine draws from a policy, and no
  iteration is on record, before every shard of it is in the memory of two nodes. This is on the
  critical path (a few milliseconds for the demo's model; the shard's size over the network for a
  large one). With one node there are no buddies.
* **To host memory** (``/dev/shm``, which outlives the workers torchrun restarts), own shard and
  buddy copies alike, as DCP safetensors files (``shards.write_shard``) in the background, once the
  main thread is about to wait for the next seal (a write started at once would take the GIL from
  the main thread for its first milliseconds), or when the process ends for whatever reason
  (``flush``, also from the SIGTERM watchdog). Files are renamed into place complete, a shard's
  JSON last, and older snapshots are deleted only once the new one is written and confirmed: the
  previous snapshot stays until the new one is complete.

A re-formed world agrees on the newest snapshot every shard of which some survivor holds, fetches
the missing files and loads them into its own cut (``recovery.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import torch

from elasticrl.errors import ElasticRLError
from elasticrl.train.background import BackgroundCall
from elasticrl.train.shard_wire import all_ok, from_json_blob, json_blob, pack, swap, unpack
from elasticrl.train.shards import Chunk, own_part, write_shard
from elasticrl.train.snapshot_plan import Held, SnapshotId, buddies, inventory, shard_file, shards_in, stale

log = logging.getLogger(__name__)

FORMAT_VERSION = 2


@dataclasses.dataclass
class Taken:
    """One iteration's snapshot on this rank, from the update until it is written."""

    sid: SnapshotId
    own: dict[str, Chunk]
    """This rank's shard: views into one staged CPU buffer."""
    doc: dict[str, Any]
    """Its JSON part, the metrics record included."""
    received: dict[int, tuple[dict[str, Chunk], dict]] = dataclasses.field(default_factory=dict)
    """Buddy copies: sender rank -> (its chunks, its JSON part)."""
    confirmed: bool = False
    """Every rank's buddy holds its copy (or there are no buddies): older snapshots may be deleted
    once this one is written."""
    writing: bool = False


def write_json(path: str, obj: Any) -> None:
    """``obj`` as ``path``, complete once it has that name (written aside, fsynced, renamed)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


class Snapshots:
    """This rank's snapshots: its node's directory, its buddy, at most one snapshot in flight.

    ``take`` after the update (with the iteration's metrics record); ``write_pending`` when the main
    thread is about to wait anyway; ``flush`` before the process exits. ``group`` is a gloo group of
    the whole world for the buddy exchange (None: no buddies).
    """

    def __init__(self, directory: str, *, rank: int, world_size: int, generation: int, nodes: list[str],
                 group=None, timeout_s: float = 120.0):
        self.directory = directory
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.node, self.nodes = nodes[rank], list(nodes)
        ring = buddies(nodes) if group is not None else {r: None for r in range(world_size)}
        self.buddy = ring[rank]
        self.senders = sorted(r for r, b in ring.items() if b == rank)
        # Every shard a snapshot leaves in this node's directory: its ranks' own and the copies
        # they keep for their senders (the ranks of a node share the directory).
        mine = {r for r, n in enumerate(self.nodes) if n == self.node}
        self.node_shards = mine | {r for r, b in ring.items() if b in mine}
        self.group = group
        self.timeout_s = timeout_s
        self._taken: Taken | None = None
        self._writing: BackgroundCall | None = None
        self._buffer: torch.Tensor | None = None  # the staged copy's memory, reused once its write is done
        # The main thread takes and writes; the SIGTERM watchdog (train.stop) may flush while the
        # main thread is stuck in a collective, or wait here while it flushes itself.
        self._lock = threading.RLock()

    def held(self) -> Held:
        """What this node's directory holds, for the resume's agreement."""
        return Held(self.node, inventory(self.directory))

    def path(self, sid: SnapshotId) -> str:
        return os.path.join(self.directory, sid.name)

    # -- one iteration ---------------------------------------------------------------------------

    def take(self, iteration: int, state: dict[str, Chunk], meta: dict[str, Any], metrics: dict[str, Any], *,
             replicated: bool = False) -> float:
        """Stage this rank's part of ``state`` (a copy the training will not change) with ``meta``
        and the iteration's ``metrics`` (a world resumed from the snapshot reports them if nobody
        did), and exchange copies with the buddies; returns the seconds the exchange took. The
        snapshot before must be written by then (its write's failure is re-raised here).

        ``replicated``: every rank's ``state`` is the same replicated state (the strategy says so,
        alike on every rank: ddp), so the copies are cut from this rank's own and nothing
        crosses the network. Not decided from ``state``: a ZeRO-1/2 rank whose partition holds no
        slice of a trained parameter has only replicated chunks, and took that path while its peers
        waited for it in the exchange.

        Raises:
            WireError: the exchange failed (a peer died): the world must re-form. No buddy copy
                is kept (``swap`` gives all or none); ``flush`` writes this rank's own shard, and
                the snapshot is not confirmed.
        """
        with self._lock:
            self.write_pending()  # a taken snapshot is never dropped unwritten
            self.wait(self.timeout_s)
            sid = SnapshotId(iteration, self.generation, self.world_size)
            # The one copy, into the buffer of the last snapshot (written by now: the wait above)
            # when it is large enough: its pages are mapped (and pinned, from a GPU) already.
            free = self._buffer if self._writing is None else None
            header, payload = pack(own_part(state, self.rank, self.world_size), into=free)
            if self._buffer is None or payload.numel() > self._buffer.numel():  # a new one
                self._buffer = payload
            doc = {"format_version": FORMAT_VERSION, "snapshot": sid.name, "iteration": iteration,
                   "generation": self.generation, "world_size": self.world_size, "shard": self.rank,
                   "node": self.node, "bytes": payload.numel(), "meta": meta, "metrics": dict(metrics)}
            taken = self._taken = Taken(sid, unpack(header, payload), doc)
        if self.buddy is None:
            taken.confirmed = True
            return 0.0
        t0 = time.monotonic()
        if replicated:
            if not all(c.replicated for c in state.values()):
                raise ValueError(f"snapshot {sid.name}: replicated=True, but chunk(s) "
                                 f"{sorted(n for n, c in state.items() if not c.replicated)[:3]} are sharded")
            # Every rank holds all of it (DDP): the shard a sender would send is cut from this
            # rank's own copy, and no byte crosses the network (the exchange was 4-6 ms of a demo
            # iteration). The JSON part is this rank's with the sender's shard and node; its
            # metrics record differs from the sender's only in rank-local fields (timers, example).
            for src in self.senders:
                h, p = pack(own_part(state, src, self.world_size))
                taken.received[src] = (unpack(h, p), {**doc, "shard": src, "node": self.nodes[src], "bytes": p.numel()})
            taken.confirmed = True
            return time.monotonic() - t0
        what = (f"snapshot {sid.name}: buddy copies (to rank {self.buddy}, from {self.senders}; "
                f"checkpoint.snapshot_timeout_s = {self.timeout_s:g})")
        got = swap([json_blob(header), json_blob(doc), payload], self.buddy, self.senders, self.group, self.timeout_s, what)
        taken.received = {src: (unpack(from_json_blob(h), p), from_json_blob(d)) for src, (h, d, p) in got.items()}
        all_ok(True, self.group, self.timeout_s, f"{what}: confirmation")
        taken.confirmed = True
        return time.monotonic() - t0

    def write_pending(self) -> None:
        """Start writing the last snapshot (own shard and buddy copies), if that has not started."""
        with self._lock:
            taken = self._taken
            if taken is None or taken.writing or self._writing is not None:
                return
            taken.writing = True
            self._writing = BackgroundCall(lambda: self._write(taken), f"snapshot {taken.sid.name}: write")

    def _write(self, taken: Taken) -> None:
        t0 = time.monotonic()
        directory = self.path(taken.sid)
        os.makedirs(directory, exist_ok=True)
        for shard, (chunks, doc) in [(self.rank, (taken.own, taken.doc)), *sorted(taken.received.items())]:
            self._write_shard(directory, shard, chunks, doc)
        # Once every shard of this snapshot is in two nodes' memory (confirmed) and this node's part
        # of it on disk (the last of its ranks to write sees it: they share the directory), the
        # older ones are no longer needed; an unconfirmed one (written on the way out after a failed
        # exchange) may lack a lost node's shard, and a rank of this node that died before it wrote
        # leaves its shard nowhere else without buddies: then the previous one stays.
        if taken.confirmed and self.node_shards <= set(shards_in(directory)):
            for name in stale(os.listdir(self.directory), taken.sid):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        log.debug("wrote snapshot %s (shard %d + %d buddy copies) in %.3fs", taken.sid.name, self.rank,
                  len(taken.received), time.monotonic() - t0)

    @staticmethod
    def _write_shard(directory: str, shard: int, chunks: dict[str, Chunk], doc: dict) -> None:
        write_shard(chunks, os.path.join(directory, shard_file(shard, ".safetensors")))
        write_json(os.path.join(directory, shard_file(shard, ".json")), doc)  # last: the shard is complete

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the write in flight, if any; re-raise its failure. A write still running when
        the wait gives up stays in flight (the next wait waits for it again): its buffer is not
        free to stage into."""
        with self._lock:
            writing = self._writing
            if writing is None:
                return
            try:
                writing.wait(self.timeout_s if timeout_s is None else timeout_s)
            finally:
                if not writing.running:
                    self._writing = None

    def flush(self, timeout_s: float = 60.0) -> None:
        """Write the last snapshot (with the buddy copies that arrived) and wait for it: before the
        process exits, even on a failure (the survivors of a dead node resume from these).
        Callable from another thread."""
        if not self._lock.acquire(timeout=timeout_s):
            raise ElasticRLError(f"snapshots in {self.directory}: still busy after {timeout_s:.0f}s")
        try:
            self.wait(timeout_s)
            self.write_pending()
            self.wait(timeout_s)
        finally:
            self._lock.release()
