"""The node's training state outside its worker process: a snapshot after every iteration, disk
checkpoints every few, and resuming a (re-formed) world from the newest of them.

``Recovery`` is what ``NodeTrainer`` calls for all of it, in this order: ``setup`` (collective:
every rank names its node; the buddy exchange gets a gloo group of its own), ``resume``, then per
iteration ``snapshot`` (after the update, with the iteration's metrics record; the new policy is
released to the engines and the iteration reported only after it), ``write_pending`` (at the next
rollout, where the main thread waits for the seal anyway) and, every
``checkpoint.every_iterations``, ``save_checkpoint``; ``finish`` or ``close`` at the end.

Resuming (every rank the same decision, from all-gathered facts; no rank decides for the others):

1. Every rank reports the snapshot shards its node's directory holds, own and buddy copies
   (``snapshot_plan.Held``, JSON over torch.distributed); the newest snapshot every shard of which
   someone holds wins (``snapshot_plan.choose``), unless a disk checkpoint is newer.
2. Each node lacking shards of it gets them from a holder (``snapshot_plan.fetch_plan``), point to
   point, as files into its own directory.
3. ``TrainStrategy.load_sharded_state`` loads them into this world's cut with
   ``torch.distributed.checkpoint`` (``shards.read_shards``): another world size reshards.
   Every rank reads first and the ranks agree that all reads worked before the state is applied
   (ZeRO reads its optimizer slices, and ZeRO-3 its partitions, straight into the live state: the
   checkpoint a failed read falls back to overwrites all of it), so a bad file makes every rank
   fall back to the checkpoint together.

Without a complete snapshot (snapshots off, every node that held a shard lost) the newest disk
checkpoint any rank holds is broadcast from the lowest rank that holds it, as before snapshots.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from elasticrl.config import ConfigError, NodeConfig, to_dict
from elasticrl.config.node import model_identity
from elasticrl.errors import ElasticRLError
from elasticrl.train import checkpoint as ckpt, stop
from elasticrl.train.background import BackgroundCall, wait_together
from elasticrl.train.dist import WorldInfo, all_gather_json, all_reduce_int, broadcast_json, broadcast_tensors
from elasticrl.train.shard_wire import WireError, move
from elasticrl.train.shards import Chunk, ShardError, read_shards, saved_tensors
from elasticrl.train.snapshot import Snapshots
from elasticrl.train.snapshot_plan import Held, SnapshotId, choose, default_dir, fetch_plan, run_root, shard_file

log = logging.getLogger(__name__)

# A checkpoint written in the background must be done within this long, or at this many bytes per
# second (a disk slower than that stops the run instead of hanging it at the end).
CHECKPOINT_WRITE_MIN_S = 600.0
CHECKPOINT_WRITE_MIN_BYTES_S = 20e6


def io_limit_s(nbytes: float) -> float:
    """How long a checkpoint's write or read of ``nbytes`` may take: ``CHECKPOINT_WRITE_MIN_S`` at
    least, else at ``CHECKPOINT_WRITE_MIN_BYTES_S``."""
    return max(CHECKPOINT_WRITE_MIN_S, nbytes / CHECKPOINT_WRITE_MIN_BYTES_S)


@dataclasses.dataclass
class Resumed:
    """What a resume loaded besides the strategy's state, for the trainer to apply."""

    iteration: int
    meta: dict[str, Any]
    """The saved meta: data_position, config, ... (checkpoint.py's meta.json, or a shard's JSON)."""
    metrics: dict[str, Any] | None
    """A snapshot's metrics record (rank 0's), written if metrics.jsonl lacks it."""
    reference: dict[str, torch.Tensor] | None


class Recovery:
    def __init__(self, config: NodeConfig, world: WorldInfo, node: str):
        self.cfg = config
        self.world = world
        self.node = node
        self.ckpt_dir = config.checkpoint.dir or os.path.join(config.run.run_dir, "checkpoints")
        self.snapshots: Snapshots | None = None
        self.group = None
        self.last_checkpoint = ""
        self._checkpointing: BackgroundCall | None = None
        self._checkpoint_deadline = 0.0
        self._forget_flush = lambda: None
        self._finished = False

    # -- set-up and resume -------------------------------------------------------------------------

    def setup(self, generation: int) -> None:
        """*Collective.* Every rank names its node (whose directory holds its snapshots); a world of
        several ranks gets a gloo group for moving shards (buddy copies, the resume's fetches)."""
        c = self.cfg.checkpoint
        if not c.snapshots:
            return
        nodes = [str(n) for n in all_gather_json(self.node)]
        if self.world.world_size > 1:
            # Its own group: the buddy exchange runs on a thread while the main thread's collectives
            # go on, and gloo moves CPU tensors under any training backend.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=c.snapshot_timeout_s))
        directory = c.snapshot_dir or default_dir(self.cfg.run.run_dir, self.cfg.run.run_id, self.node)
        buddy_group = self.group if c.snapshot_buddies and len(set(nodes)) > 1 else None
        self.snapshots = Snapshots(directory, rank=self.world.rank, world_size=self.world.world_size, generation=generation,
                                   nodes=nodes, group=buddy_group, timeout_s=c.snapshot_timeout_s)
        # Written on a forced exit too (SIGTERM while stuck in a collective): see train.stop.
        self._forget_flush = stop.on_forced_exit(self.snapshots.flush)
        if self.world.rank == 0:
            log.info("snapshots: every rank's shard in %s%s", os.path.dirname(directory),
                     "" if buddy_group is None else ", and a copy on the next node's same rank (buddy)")

    def resume(self, strategy) -> Resumed | None:
        """*Collective.* Load the newest complete snapshot, or else the newest checkpoint any rank
        holds, into ``strategy``; None when there is neither."""
        newest_ckpt = all_reduce_int(ckpt.latest_iteration(self.ckpt_dir), dist.ReduceOp.MAX)
        if self.snapshots is not None:
            held = [Held.from_json(h) for h in all_gather_json(self.snapshots.held().to_json())]
            sid, reason = choose(held, self.snapshots.generation)
            if sid is not None and sid.iteration >= newest_ckpt:  # on a tie the snapshot (host memory) wins
                try:
                    return self._from_snapshot(strategy, sid, held, reason)
                except ShardError as exc:  # every rank alike (see _read)
                    if newest_ckpt == 0:
                        raise
                    log.error("snapshot %s unusable (%s); resuming from checkpoint %d instead", sid.name, exc, newest_ckpt)
            elif self.world.rank == 0 and (sid is not None or any(h.snapshots for h in held)):
                # An older snapshot than the checkpoint, or none complete (a lost host's shards
                # without buddy copies, say): the latter loses iterations, so it is a warning.
                log.log(logging.INFO if sid is not None else logging.WARNING, "snapshots: %s; %s", reason,
                        f"resuming from checkpoint {newest_ckpt}" if newest_ckpt else "no checkpoint either: starting over")
        return self._from_checkpoint(strategy, newest_ckpt) if newest_ckpt else None

    def _from_snapshot(self, strategy, sid: SnapshotId, held: list[Held], reason: str) -> Resumed:
        t0 = time.monotonic()
        plan = fetch_plan(sid, held)
        fetch_failure = None
        try:
            self._fetch(sid, plan)
        except (WireError, OSError) as exc:
            fetch_failure = exc
        # Every rank waits here for the fetches into its node's directory (a node's lowest rank
        # receives for all of its ranks), and one failed fetch fails every rank alike.
        if all_reduce_int(0 if fetch_failure else 1, dist.ReduceOp.MIN) == 0:
            raise ShardError(f"snapshot {sid.name}: fetching its shards failed on some rank"
                             + (f" (here: {fetch_failure})" if fetch_failure else "")) from fetch_failure
        directory = self.snapshots.path(sid)
        failure, docs, saved = None, {}, {}
        try:  # local: every rank reads its node's copies; the ranks agree before anything collective
            for shard in range(sid.world_size):
                with open(os.path.join(directory, shard_file(shard, ".json"))) as f:
                    docs[shard] = json.load(f)
            saved = saved_tensors(directory)
        except (OSError, ValueError, KeyError, ShardError) as exc:
            failure = exc
        if all_reduce_int(0 if failure else 1, dist.ReduceOp.MIN) == 0:
            raise ShardError(f"snapshot {sid.name}: its files in {directory} are unreadable on some rank"
                             + (f" (here: {failure})" if failure else "")) from failure
        meta = docs[0]["meta"]
        self._check_model(meta, f"snapshot {sid.name} in {directory}", "delete that directory")
        strategy.load_sharded_state(lambda chunks: self._read(directory, chunks), saved, meta["strategy_state"])
        reference = None
        if self.cfg.algorithm.kl_coef > 0 and meta.get("reference"):
            dest = {n: Chunk.whole(torch.empty(shape, dtype=dtype)) for n, (shape, dtype) in saved.items() if n.startswith("reference.")}
            self._read(directory, dest)
            reference = {n.removeprefix("reference."): c.tensor for n, c in dest.items()}
        # Shards none of whose holders is the node that wrote them: there from a buddy copy only.
        holders = {s: {h.node for h in held if s in h.snapshots.get(sid.name, {})} for s in range(sid.world_size)}
        buddy_only = [s for s in range(sid.world_size) if docs[s]["node"] not in holders[s]]
        log.info("resumed from iteration %d (snapshot of rank %d, node %s); from buddy copies only: shard(s) %s of %d",
                 sid.iteration, self.world.rank, self.node, buddy_only or "none", sid.world_size)
        log.info("snapshot %s; %d shard(s) fetched from other nodes; loaded in %.2fs", reason, len(plan), time.monotonic() - t0)
        return Resumed(sid.iteration, meta, docs[0].get("metrics"), reference)

    def _fetch(self, sid: SnapshotId, plan) -> None:
        """Move the shard files of ``plan`` (both files of a shard, point to point) into the
        receiving nodes' directories."""
        rank, directory = self.world.rank, self.snapshots.path(sid)
        outgoing, incoming = [], []
        for i, t in enumerate(plan):
            if t.src == rank:
                for k, suffix in enumerate((".safetensors", ".json")):
                    outgoing.append((t.dst, 2 * i + k, _read_file(os.path.join(directory, shard_file(t.shard, suffix)))))
            if t.dst == rank:
                incoming += [(t.src, 2 * i + k, torch.empty(t.sizes[k], dtype=torch.uint8), t.shard, suffix)
                             for k, suffix in enumerate((".safetensors", ".json"))]
        if not plan:
            return
        move(outgoing, [(src, tag, buf) for src, tag, buf, _, _ in incoming], self.group,
             self.cfg.checkpoint.snapshot_timeout_s,
             f"snapshot {sid.name}: fetching shards (checkpoint.snapshot_timeout_s = {self.cfg.checkpoint.snapshot_timeout_s:g})")
        os.makedirs(directory, exist_ok=True)
        for _, _, buf, shard, suffix in sorted(incoming, key=lambda x: x[4] == ".json"):  # every .json last
            path = os.path.join(directory, shard_file(shard, suffix))
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(memoryview(buf.numpy()))  # from the tensor's memory: no copy holding the GIL
            os.rename(tmp, path)

    def _read(self, directory: str, chunks: dict[str, Chunk]) -> None:
        """``read_shards``, then every rank says whether it worked: one failure fails all of them
        alike, before any of them applies what it read."""
        failure = None
        try:
            read_shards(directory, chunks)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            failure = exc
        if all_reduce_int(0 if failure else 1, dist.ReduceOp.MIN) == 0:
            raise ShardError(f"reading the shards in {directory} failed on some rank"
                             + (f" (here: {failure})" if failure else "")) from failure

    def _read_checkpoint(self, path: str, src: int) -> ckpt.Checkpoint | None:
        """*Collective.* Rank ``src`` reads the checkpoint in ``path`` (None elsewhere) in a thread,
        while every rank polls together, one small all-reduce a second
        (``background.wait_together``): a big checkpoint on a slow disk keeps no rank in a
        collective past its time limit (the process group's, ``coordinator.barrier_timeout_s`` +
        60 s). A read that fails, or is not done by the deadline a write has, stops every rank."""
        box: dict[str, ckpt.Checkpoint] = {}
        job, deadline, limit = None, 0.0, 0.0
        if self.world.rank == src:
            try:
                size = sum(f.stat().st_size for f in os.scandir(path) if f.is_file())
            except OSError:  # the read below fails too, naming the file, and every rank learns so
                size = 0
            limit = io_limit_s(size)
            deadline = time.monotonic() + limit
            job = BackgroundCall(lambda: box.setdefault("loaded", ckpt.load_checkpoint(path, read_now=True)),
                                 f"reading checkpoint {path}")
        if wait_together(job, deadline, reduce=True):
            return box.get("loaded")
        if job is not None and job.failure is not None:
            raise job.failure  # load_checkpoint's ValueError names the file
        if job is not None:
            raise ElasticRLError(f"{job.name}: not done within {limit:.4g}s (a disk slower than "
                                 f"{CHECKPOINT_WRITE_MIN_BYTES_S / 1e6:g} MB/s)")
        raise ElasticRLError(f"checkpoint {path}: rank {src} could not read it (its log says why)")

    def _from_checkpoint(self, strategy, newest: int) -> Resumed:
        """The newest checkpoint, broadcast from the lowest rank that holds it (a rank that holds
        none gets it over torch.distributed)."""
        mine = ckpt.latest_iteration(self.ckpt_dir)
        src = all_reduce_int(self.world.rank if mine == newest else self.world.world_size, dist.ReduceOp.MIN)
        loaded = self._read_checkpoint(ckpt.checkpoint_dir(self.ckpt_dir, newest), src)
        # The metadata first, so every rank refuses an incompatible checkpoint together.
        meta = broadcast_json(loaded.meta if loaded else None, src)
        self._check_model(meta, f"checkpoint {newest} in {self.ckpt_dir}", "a new checkpoint.dir")
        weights = broadcast_tensors(loaded.model if loaded else None, src)
        opt_tensors = broadcast_tensors(loaded.optimizer_tensors if loaded else None, src)
        strategy.load_full_model_state_dict(weights)
        strategy.load_full_optimizer_state_dict(ckpt.unflatten_optimizer(opt_tensors, meta["optimizer"]))
        reference = None
        if self.cfg.algorithm.kl_coef > 0 and broadcast_json(loaded.reference is not None if loaded else None, src):
            reference = broadcast_tensors(loaded.reference if loaded else None, src)
        log.info("resumed from iteration %d (checkpoint of rank %d, node %s)", newest, src, meta.get("node", "?"))
        return Resumed(newest, meta, meta.get("metrics"), reference)

    def _check_model(self, meta: dict, what: str, fix: str) -> None:
        saved, wanted = meta.get("config", {}).get("model"), to_dict(self.cfg)["model"]
        if saved is not None and model_identity(saved) != model_identity(wanted):
            raise ConfigError(f"{what} has model {model_identity(saved)}, the config asks for {model_identity(wanted)}; "
                              f"use the same [model] or {fix}")

    # -- every iteration -----------------------------------------------------------------------------

    def snapshot(self, strategy, iteration: int, meta: dict[str, Any], reference: torch.nn.Module | None,
                 metrics: dict[str, Any]) -> float:
        """After the update, before any engine may draw from the new policy: this rank's shard,
        staged with the iteration's record and exchanged with the buddies (``Snapshots.take``);
        returns the seconds the exchange took."""
        if self.snapshots is None:
            return 0.0
        chunks, rest = strategy.sharded_state()
        if reference is not None:
            chunks.update({f"reference.{k}": Chunk.whole(v.detach(), replicated=True) for k, v in reference.state_dict().items()})
        meta = {**meta, "strategy_state": rest, "reference": reference is not None}
        # A strategy that does not say (a test's stand-in) exchanges: always right, only slower.
        replicated = bool(getattr(strategy, "state_replicated", False))
        return self.snapshots.take(iteration, chunks, meta, metrics, replicated=replicated)

    def write_pending(self) -> None:
        """Where the main thread is about to wait anyway: write the last snapshot to host memory."""
        if self.snapshots is not None:
            self.snapshots.write_pending()

    def save_checkpoint(self, strategy, iteration: int, meta: dict[str, Any], reference: torch.nn.Module | None,
                        metrics: dict[str, Any]) -> None:
        """*Collective* (in a world of several ranks: the ranks first wait together for the write
        before, then the full state is gathered): rank 0, or with ``checkpoint.every_node`` every
        node's local rank 0, writes checkpoint ``iteration``."""
        c, world = self.cfg.checkpoint, self.world
        self._await_previous_write(iteration)  # one full copy of the state per host at a time
        model_state = strategy.full_model_state_dict(all_ranks=c.every_node)
        optimizer_state = strategy.full_optimizer_state_dict(all_ranks=c.every_node)
        if not (world.rank == 0 or (c.every_node and world.local_rank == 0)):
            return
        self.wait_checkpoint()  # written by now: its failure, if any, is raised here
        ref = None if reference is None else {k: v.detach().to("cpu", copy=True) for k, v in reference.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in (*model_state.values(), *(ref or {}).values()))
        # The gathered copies are this call's own (the next step changes none of them), so the
        # write goes on in the background while training does: on one node the others would wait
        # for a big model's files at the next barrier (and time out there).
        def write() -> None:
            # With its record: a world resumed from it adds the record if the iteration was not reported.
            self.last_checkpoint = ckpt.save_checkpoint(self.ckpt_dir, iteration, model_state, optimizer_state,
                                                        {**meta, "metrics": metrics}, keep_last=c.keep_last, reference=ref)
            log.info("saved checkpoint %s", self.last_checkpoint)

        self._checkpoint_deadline = time.monotonic() + io_limit_s(nbytes * 3)  # + Adam's 2x
        self._checkpointing = BackgroundCall(write, f"writing checkpoint {ckpt.checkpoint_dir(self.ckpt_dir, iteration)}")

    def _await_previous_write(self, iteration: int) -> None:
        """*Collective.* Before the next checkpoint's state is gathered, every rank waits until no
        writer rank is still writing the one before, so a host never holds two full copies of the
        state (a writer would gather the new one while its last write lags). The ranks poll
        together, one small all-reduce a second (``background.wait_together``), so none sits in a
        collective past its time limit meanwhile. A writer whose write failed or passed its deadline says so
        in the same all-reduce: it raises that failure, and every other rank stops too instead of
        waiting in the gather for it."""
        waited, pending, noted = time.monotonic(), self._checkpointing, []

        def note() -> None:  # a write still running somewhere: say so now, and when it is done
            noted.append(True)
            log.info("checkpoint %d: waiting for the one before to be written (%s)", iteration,
                     "here" if pending is not None and pending.running else "on a writer rank")

        ok = wait_together(pending, self._checkpoint_deadline, reduce=self.world.world_size > 1, on_wait=note)
        if not ok:
            self.wait_checkpoint()  # a writer raises its own failure, or its deadline's
            raise ElasticRLError(f"checkpoint {iteration}: the checkpoint before it failed on a writer rank "
                                 "(its log says why); stopping with it")
        if noted:
            log.info("checkpoint %d: the one before is written (waited %.1fs)", iteration, time.monotonic() - waited)

    def wait_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background, if any; re-raise its failure.
        ``ElasticRLError`` if it is not written by its deadline: ``CHECKPOINT_WRITE_MIN_S`` after it
        started, or its bytes (3x the weights: Adam's two moments) at ``CHECKPOINT_WRITE_MIN_BYTES_S``."""
        pending, self._checkpointing = self._checkpointing, None
        if pending is None:
            return
        try:
            pending.wait(max(0.0, self._checkpoint_deadline - time.monotonic()))
        except ElasticRLError as exc:
            if not pending.running:
                raise
            raise ElasticRLError(f"{pending.name}: not written by its deadline (a disk slower than "
                                 f"{CHECKPOINT_WRITE_MIN_BYTES_S / 1e6:g} MB/s; {CHECKPOINT_WRITE_MIN_S:g} s at least)") from exc

    # -- the end -------------------------------------------------------------------------------------

    def before_finish(self) -> None:
        """Every rank, before the final barrier: no snapshot or checkpoint write in flight."""
        self.wait_checkpoint()
        self._forget_flush()
        if self.snapshots is not None:
            self.snapshots.wait()

    def finish(self) -> None:
        """After the final barrier: free this host's snapshots (the disk checkpoints stay)."""
        self._finished = True
        if self.snapshots is not None and self.world.local_rank == 0 and not self.cfg.checkpoint.snapshot_dir:
            shutil.rmtree(run_root(self.cfg.run.run_dir, self.cfg.run.run_id), ignore_errors=True)

    def close(self) -> None:
        pending, self._checkpointing = self._checkpointing, None
        if pending is not None:  # a finished checkpoint is worth the wait
            left = max(0.0, self._checkpoint_deadline - time.monotonic())
            if pending.running:
                log.info("%s: waiting up to %.0fs for it to finish", pending.name, left)
            if not pending.settle(left):
                log.warning("%s: not finished; left unfinished", pending.name)
            elif pending.failure is not None:
                log.error("%s failed: %s: %s", pending.name, type(pending.failure).__name__, pending.failure)
        if self.snapshots is not None and not self._finished:
            try:  # the last recorded iteration's snapshot, even when this iteration failed
                self.snapshots.flush()
            except Exception as exc:  # noqa: BLE001 - the previous snapshot and the disk checkpoints are still there
                log.warning("could not write the last snapshot: %s", exc)
        self._forget_flush()


def _read_file(path: str) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, read straight into its memory (``bytearray(f.read())``
    copies the whole shard again, holding the GIL, while the keep-alive thread waits)."""
    with open(path, "rb", buffering=0) as f:
        buf = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: ended after {got} of its {len(view)} bytes while it was read")  # as _fetch expects
            got += n
    return buf
