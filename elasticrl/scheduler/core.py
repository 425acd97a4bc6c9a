"""The scheduler's engine: task queues, leases, exactly-once results, sealing and shards.

One ``SchedulerCore`` lives on the coordinator's event loop beside ``CoordinatorCore`` (whose
membership it trusts: a worker is a member of the iteration's run, and when that member stops
being live the core's listener requeues everything it held). Like the coordinator core, every
change is written first (a shard file for accepted groups, then SQLite), then applied in memory,
then pushed to whoever waits: a worker's outbox (assignments, cancels, acks) or a seal waiter.
Workers' streams opening and closing (a reconnect's hello, a member gone) are
``links.WorkerLinks``, the result path (decide on arrival, write the shards, commit, ack) is
``results.ResultBook``, and tasks handed back or held longer (release, lease renewal) are
``returns.TaskReturns``, all of which this class inherits; the stream records (``WorkerConn``,
outbox messages) are in ``stream``.

Invariants:
  * a task is DONE at most once; its group is the first result accepted for it, and every other
    result for it is refused and counted (duplicate, fenced, sealed), never stored;
  * a worker never holds more copies than its slots, and a copy it holds is freed only by its
    result's arrival, its release, a cancel sent to it, or its stream closing;
  * an evicted (or disconnected) worker's running tasks go back to the front of the queue at once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
from collections.abc import Callable

from elasticrl.coordinator.core import CoordinatorCore
from elasticrl.coordinator.signals import Signals
from elasticrl.errors import (
    FencedError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    RunClosedError,
)
from elasticrl.scheduler import accounting, persist, policy, recovery
from elasticrl.scheduler.links import WorkerLinks
from elasticrl.scheduler.results import ResultBook
from elasticrl.scheduler.returns import TaskReturns
from elasticrl.scheduler.state import (
    GroupRecord,
    Holder,
    Iteration,
    IterationConfig,
    Policy,
    Split,
    Task,
    TaskSpec,
    TaskStatus,
    Worker,
)
from elasticrl.scheduler.store import TrajectoryStore
from elasticrl.scheduler.stream import Ack, Assign, Cancel, Decided, End, WorkerConn

__all__ = ["Ack", "Assign", "Cancel", "Decided", "End", "SchedulerCore", "WorkerConn"]  # the stream records, for callers of the core

log = logging.getLogger(__name__)

# A fenced worker's stream stays open this long so the results it sends after waking up (a
# SIGSTOPped process, say) reach us and are refused and counted, rather than lost in transit.
FENCED_STREAM_GRACE_S = 60.0
# Sealed iterations whose groups stay in memory per run (trainers fetch the newest one or two).
KEEP_SEALED_GROUPS = 2
# Beyond those, once a run's trainers fetched an iteration in full: sealed iterations numbered
# above it that no world has fetched yet are kept (groups and all), the newest this many. With
# rollout.max_staleness = k the iterations submitted ahead can seal before the one the trainer
# waits for: k + 1 of them (k at most 64).
KEEP_UNFETCHED = 66
# Sealed iterations kept per run (``--keep-iterations``): older ones are dropped from memory and
# SQLite and their shards deleted (manifests stay). A trainer fetches the newest one or two.
DEFAULT_KEEP_ITERATIONS = 8
# Queued tasks that no dispatch handed out (a worker released them and no other one had a free
# slot) are offered again after this long, to anyone including the worker that released them.
REDISPATCH_S = 0.5


class SchedulerCore(WorkerLinks, ResultBook, TaskReturns):
    def __init__(
        self,
        coord: CoordinatorCore,
        store: TrajectoryStore,
        *,
        wall_clock: Callable[[], float] = time.time,
        keep_iterations: int = DEFAULT_KEEP_ITERATIONS,
    ):
        if keep_iterations < KEEP_SEALED_GROUPS:
            raise ValueError(f"keep_iterations must be >= {KEEP_SEALED_GROUPS}, got {keep_iterations}")
        self.keep_iterations = keep_iterations
        # Per run, the newest iteration dropped by retention (for a clear error when one is asked for).
        self._dropped_upto: dict[str, int] = {}
        self.coord = coord
        self.clock = coord.clock
        self.metrics = coord.metrics  # one registry per coordinator process
        self.db = persist.open_db(coord.db)
        self.store = store
        self.iterations: dict[str, dict[int, Iteration]] = collections.defaultdict(dict)
        self.conns: dict[str, dict[str, WorkerConn]] = collections.defaultdict(dict)
        self._seal_signals = Signals()
        self._dispatched_at: dict[str, float] = {}
        # Iterations whose assignment counts changed since SQLite last got their counters, with
        # the nodes whose counts did (``_dispatch``); ``save_counters`` writes them at the next tick.
        self._unsaved: dict[tuple[str, int], tuple[Iteration, set[str]]] = {}
        # Per run, the workers whose slots were freed since its last dispatch (``_slots_freed``).
        self._freed: dict[str, dict[str, WorkerConn]] = collections.defaultdict(dict)
        # Batch id -> its batch between ``decide`` and ``commit`` (a re-sent copy waits for it).
        self._deciding: dict[str, Decided] = {}
        # Runs with an iteration sealed since the last tick, whose old iterations the tick drops
        # (``_trim``): not on the seal's own path, which the trainer waits for.
        self._trim_due: set[str] = set()
        # Per run, the newest iteration a whole world of trainers fetched the train shards of
        # (retention then keeps the sealed ones above it that they have not fetched yet).
        self._fetched_upto: dict[str, int] = {}
        now = self.clock()
        self._elapsed_at_seal: dict[tuple[str, int], float] = {}
        self._seal_order = itertools.count(1)
        for it, elapsed in self.db.load(now, wall_clock()):
            self.iterations[it.run_id][it.iteration] = it
            if it.sealed:
                self._elapsed_at_seal[(it.run_id, it.iteration)] = elapsed
            # Reads an open iteration's groups back; a missing or damaged shard's groups are lost
            # (requeued while open) rather than stopping the coordinator.
            if recovery.restore_groups(it, store, self.db) and it.sealed:
                store.write_manifest(it.run_id, it.iteration, self.manifest(it))
        self._wall = wall_clock
        self._dropped_upto.update(self.db.dropped())
        loaded = sorted((it for its in self.iterations.values() for it in its.values() if it.sealed),
                        key=lambda it: (round(it.sealed_at, 3), it.iteration))  # to the ms: a tie by number
        for it in loaded:
            it.seal_order = next(self._seal_order)
        dropped = store.remove_dropped({(r, i) for r, its in self.iterations.items() for i in its})
        if dropped:
            log.warning("scheduler: removed %d shard file(s) of iterations dropped before the last stop", len(dropped))
        for run_id in list(self.iterations):  # a smaller --keep-iterations applies at once
            self._trim(run_id)
        coord.gone_listeners.append(self._member_gone)
        coord.run_dropped_listeners.append(self.drop_run)
        coord.run_closed_listeners.append(self.end_streams)
        open_its = [it for its in self.iterations.values() for it in its.values() if not it.sealed]
        if open_its:
            log.info(
                "scheduler: resumed %d open iteration(s); %d task(s) done, %d requeued for the workers to take",
                len(open_its), sum(it.count(TaskStatus.DONE) for it in open_its),
                sum(len(it.queue) for it in open_its),
            )

    # -- lookups ---------------------------------------------------------------------------

    def iteration(self, run_id: str, iteration: int) -> Iteration:
        it = self.iterations.get(run_id, {}).get(iteration)
        if it is None:
            if iteration <= self._dropped_upto.get(run_id, -1):
                raise NotFoundError(
                    f"iteration: iteration {iteration} of run {run_id!r} was dropped: this coordinator keeps "
                    f"the newest {self.keep_iterations} sealed iterations (--keep-iterations)"
                )
            raise NotFoundError(f"iteration: run {run_id!r} has no iteration {iteration} (submit it first)")
        return it

    def latest(self, run_id: str) -> Iteration | None:
        its = self.iterations.get(run_id)
        return its[max(its)] if its else None

    def _load_groups(self, it: Iteration) -> None:
        """Read back every stored group of ``it`` that is not in memory (after a restart)."""
        missing = {shard for tid, shard in it.shard_of.items() if tid not in it.groups}
        for shard in sorted(missing):
            for group, _ in self.store.read_shard(it.run_id, it.iteration, shard):
                if it.shard_of.get(group.task_id) == shard:
                    it.groups[group.task_id] = group

    # -- submitting --------------------------------------------------------------------------

    def submit(
        self, run_id: str, iteration: int, specs: list[TaskSpec], config: IterationConfig, *, request_id: str = "",
    ) -> bool:
        """Queue an iteration's tasks. Returns False for a second submit of the same tasks (a retry
        with the same ``request_id`` gets what its first attempt got)."""
        done = self.coord.replies.get(request_id, "submit")
        if done is not None:
            return done["created"]
        run = self.coord.run_or_new(run_id)  # counted against --max-runs like any other run
        if run.closed:
            raise RunClosedError(f"run {run_id!r} is closed ({run.close_reason}); start a new run id")
        old = self.iterations.get(run_id, {}).get(iteration)
        if old is not None:
            if [t.spec.task_id for t in old.tasks.values()] == [s.task_id for s in specs]:
                return False
            raise InvalidRequestError(
                f"iteration: {iteration} of run {run_id!r} was already submitted with other tasks; "
                "use a new iteration number"
            )
        now = self.clock()
        it = Iteration(
            run_id=run_id,
            iteration=iteration,
            config=config,
            tasks={s.task_id: Task(spec=s, seq=i) for i, s in enumerate(specs)},
            submitted_at=now,
        )
        ids = [s.task_id for s in specs]
        workers = {m: c.worker.weight for m, c in self.conns.get(run_id, {}).items() if not c.worker.fenced}
        if config.policy is Policy.STATIC and workers:
            it.shares = {m: collections.deque(share) for m, share in policy.static_shares(ids, workers).items()}
        else:
            if config.policy is Policy.STATIC:
                log.warning("run %s iteration %d: static policy but no worker connected; tasks go to a shared queue", run_id, iteration)
            it.queue.extend(ids)
        with self.db.tx() as db:
            self.coord.db.put_run(run)
            db.put_iteration(it, self._wall())
            self.coord.replies.record(request_id, "submit", {"created": True})
        self.coord.replies.remember(request_id)
        self.iterations[run_id][iteration] = it
        log.info(
            "run %s iteration %d: %d task(s) submitted (%s, deadline %s, min_fraction %g, %d worker(s) connected)",
            run_id, iteration, len(specs), config.policy.value,
            f"{config.deadline_s:g}s" if config.deadline_s else "none", config.min_fraction, len(workers),
        )
        self._dispatch(run_id)
        return True

    def _requeue(self, it: Iteration, task: Task, member_id: str, why: str) -> int:
        """Drop ``member_id``'s copy of ``task``; queue the task again if no copy is left.
        Call inside a transaction (the caller persists the counters)."""
        task.holders.pop(member_id, None)
        if task.status is not TaskStatus.RUNNING or task.holders:
            return 0
        task.status = TaskStatus.QUEUED
        task.requeues += 1
        it.counters.requeued += 1
        it.queue.appendleft(task.spec.task_id)
        self.db.put_requeue(it, task)
        self.metrics.requeued.inc(run=it.run_id)
        log.debug("run %s iteration %d: task %s requeued (%s)", it.run_id, it.iteration, task.spec.task_id, why)
        return 1

    # -- dispatch ----------------------------------------------------------------------------

    def _slots_freed(self, conn: WorkerConn) -> None:
        """``conn``'s worker has free slots the last dispatch did not offer (see ``_dispatch``)."""
        self._freed[conn.run_id][conn.worker.member_id] = conn

    def _free_slot(self, conn: WorkerConn, key: tuple[int, str]) -> bool:
        """``conn``'s worker no longer runs task ``key`` (iteration, task id): its slot is free for
        the next dispatch. Every place a live worker's ``holding`` shrinks goes through here, so a
        dispatch that looks at freed workers only (``freed_only``) misses none. False if it did
        not hold the task."""
        if key not in conn.worker.holding:
            return False
        conn.worker.holding.discard(key)
        self._slots_freed(conn)
        return True

    def _dispatch(self, run_id: str, *, skip: WorkerConn | None = None, retry_anywhere: bool = False,
                  freed_only: bool = False) -> None:
        """Hand queued tasks to workers with free slots, one task per worker per pass, so equal
        workers start with equal work. ``retry_anywhere``: a task whose env failed on a worker may
        go back to that worker (no other took it).

        ``freed_only``: look only at the workers whose slots were freed since the last dispatch
        (``_slots_freed``): after a result batch, the rest had their chance when the tasks now
        queued appeared, each a full dispatch. A full scan at every batch cost O(workers): at 512
        single-slot workers it was most of the coordinator's time per batch. Except when this pass
        empties a dynamic iteration's queue with backups left to hand out: backups appear only
        now, for any idle worker, so a full pass follows."""
        self._dispatched_at[run_id] = self.clock()
        freed = self._freed.pop(run_id, {})
        if freed_only:  # in the order they opened, as a full pass goes
            pool = sorted(freed.values(), key=lambda c: c.order) if len(freed) > 1 else freed.values()
        else:
            pool = self.conns.get(run_id, {}).values()
        conns = [c for c in pool if c is not skip and not c.closed and not c.draining and c.worker.free > 0]
        if skip is not None and skip.worker.free > 0:
            self._slots_freed(skip)  # passed over this time only
        open_its = policy.oldest_open(list(self.iterations.get(run_id, {}).values()))
        if not conns or not open_its:
            return
        now = self.clock()
        batches: dict[int, list] = collections.defaultdict(list)
        touched: dict[int, tuple[Iteration, set[str]]] = {}
        backups_next = [it for it in open_its if it.queue and it.config.policy is Policy.DYNAMIC
                        and it.config.backup_tasks > it.counters.backups_issued] if freed_only else []
        progress = True
        while progress:
            progress = False
            for conn in conns:
                if conn.worker.free <= 0:
                    continue
                for it in open_its:
                    picks = policy.pick_tasks(it, conn.worker, 1, retry_anywhere=retry_anywhere)
                    if picks:
                        task_id, backup = picks[0]
                        batches[id(conn)].append(self._assign(it, it.tasks[task_id], conn.worker, now, backup))
                        touched.setdefault(it.iteration, (it, set()))[1].add(conn.worker.member_id)
                        progress = True
                        break
        self._assigned(run_id, touched)
        for conn in conns:
            items = batches.get(id(conn))
            if items:
                conn.send(Assign(items))
        if any(not it.queue for it in backups_next):
            self._dispatch(run_id)

    def _assigned(self, run_id: str, touched: dict[int, tuple[Iteration, set[str]]]) -> None:
        """The counts of tasks handed out (iteration -> (it, the members given some)) reach SQLite
        at the next tick (``save_counters``)."""
        for iteration, (it, members) in touched.items():
            unsaved = self._unsaved.get((run_id, iteration))
            if unsaved is not None and unsaved[0] is it:
                unsaved[1].update(members)
            else:
                self._unsaved[(run_id, iteration)] = (it, members)

    @staticmethod
    def _unqueue(it: Iteration, task_id: str, member_id: str, *, anywhere: bool = False) -> None:
        """Take queued ``task_id`` out of ``member_id``'s share or the shared queue (``anywhere``:
        or another worker's share)."""
        others = [s for m, s in it.shares.items() if m != member_id] if anywhere else []
        for source in (it.shares.get(member_id), it.queue, *others):
            if source and task_id in source:
                if source[0] == task_id:
                    source.popleft()
                else:
                    source.remove(task_id)
                return

    def _assign(self, it: Iteration, task: Task, worker: Worker, now: float, backup: bool, *, queued: bool = True):
        """Give ``worker`` a copy of ``task`` (taken out of the queue first unless ``queued`` is
        False, i.e. it was) and return what its ``Assign`` says."""
        task_id = task.spec.task_id
        if backup:
            it.counters.backups_issued += 1
        elif queued:
            self._unqueue(it, task_id, worker.member_id)
        task.status = TaskStatus.RUNNING
        lease = it.config.task_lease_s
        task.holders[worker.member_id] = Holder(worker.member_id, worker.incarnation, now, now + lease, backup)
        it.next_expiry = min(it.next_expiry, now + lease)
        if worker.member_id not in task.copies_on:
            task.copies_on += (worker.member_id,)
        worker.holding.add((it.iteration, task_id))
        stats = it.node(worker.member_id)
        stats.assigned += 1
        if stats.first_assigned_at is None:
            stats.first_assigned_at = now
        return (it.iteration, task.spec, lease, backup)

    def _cancel_copies(self, it: Iteration, task_id: str, keep: str = "") -> None:
        """Tell every other worker running ``task_id`` to drop it; their slots are free again.
        Only the workers handed a copy are looked at: a scan of every worker, per accepted
        result, cost O(workers) each (~1.6 ms per result batch at 512 single-slot workers)."""
        key = (it.iteration, task_id)
        conns = self.conns.get(it.run_id, {})
        for member_id in it.tasks[task_id].copies_on:
            conn = conns.get(member_id)
            if member_id != keep and conn is not None and self._free_slot(conn, key):
                conn.send(Cancel(it.iteration, [task_id]))

    # -- time: task leases and deadlines -------------------------------------------------------

    def save_counters(self) -> None:
        """Write the counters of the iterations that tasks were handed out of since the last call,
        in one transaction. Assignments are not otherwise stored (a restarted coordinator queues
        unfinished tasks again), so their counts (``assigned``, ``backups_issued``) need not
        commit on the path of every result batch, which costs a transaction of its own: they
        ride along with the batch's own commit when one follows, and reach SQLite at the next tick
        (``--tick``, 50 ms) otherwise. A crash loses at most one tick's counts, never a result."""
        if not self._unsaved:
            return
        try:
            with self.db.tx() as db:
                for (run_id, iteration), (it, members) in self._unsaved.items():
                    if self.iterations.get(run_id, {}).get(iteration) is it:  # not dropped meanwhile
                        db.put_counters(it, nodes={m: it.nodes[m] for m in members if m in it.nodes})
        except Exception as exc:  # noqa: BLE001 - a full disk, say: the counts stay in memory, tried again next tick
            log.warning("scheduler: could not save assignment counts (%s); trying again at the next tick", exc)
            return
        self._unsaved.clear()

    def _counts_saved(self, run_id: str, it: Iteration, member_id: str) -> None:
        """A result batch's commit wrote ``it``'s counters and ``member_id``'s stats, assignment
        counts included: the next tick need not write them again (in a trajectory stream it did,
        once per tick: a transaction of its own)."""
        key = (run_id, it.iteration)
        unsaved = self._unsaved.get(key)
        if unsaved is not None and unsaved[0] is it:
            unsaved[1].discard(member_id)
            if not unsaved[1]:
                del self._unsaved[key]

    def tick(self) -> None:
        self.save_counters()
        for run_id in list(self._trim_due):
            try:
                self._trim(run_id)
            except Exception as exc:  # noqa: BLE001 - a full disk, say: nothing was dropped; tried again next tick
                log.warning("scheduler: could not drop run %s's old iterations (%s); trying again at the next tick", run_id, exc)
                continue
            self._trim_due.discard(run_id)
        now = self.clock()
        for conns in self.conns.values():
            for conn in conns.values():
                if conn.fenced_at is not None and now - conn.fenced_at >= FENCED_STREAM_GRACE_S:
                    conn.send(End(FencedError(f"worker {conn.worker.member_id!r} is no longer live; join again")))
                    conn.fenced_at = None
        for run_id, its in list(self.iterations.items()):
            changed = False
            stranded = False
            for it in its.values():
                if it.sealed:
                    continue
                stranded |= bool(it.queue)
                expired = []
                if now >= it.next_expiry:
                    expired, it.next_expiry = policy.lease_scan(it, now)
                if expired:
                    it.next_expiry = now  # looked at again next tick, in case these are not requeued
                    with self.db.tx():
                        for task_id, member_id in expired:
                            # The holder keeps its slot (it is presumably still busy on the task);
                            # whichever copy finishes first is accepted.
                            changed |= bool(self._requeue(it, it.tasks[task_id], member_id, "task lease expired"))
                        self.db.put_counters(it)
                    log.info("run %s iteration %d: %d task lease(s) expired; requeued", run_id, it.iteration, len(expired))
                self._maybe_seal(it)
            if changed or (stranded and now - self._dispatched_at.get(run_id, -math.inf) >= REDISPATCH_S):
                self._dispatch(run_id, retry_anywhere=stranded)

    def _maybe_seal(self, it: Iteration) -> None:
        seal, reason = policy.decide_seal(it, self.clock())
        if seal:
            self._seal(it, reason)

    def _seal(self, it: Iteration, reason: str) -> None:
        now = self.clock()
        dropped = [t for t in it.tasks.values() if t.status in (TaskStatus.QUEUED, TaskStatus.RUNNING)]
        with self.db.tx() as db:
            db.put_seal(it, reason, now - it.submitted_at)
        it.sealed_at, it.seal_reason = now, reason  # only once the seal is durable
        it.seal_order = next(self._seal_order)
        self.metrics.sealed.inc(run=it.run_id)
        self.metrics.seal_time.observe(now - it.submitted_at, run=it.run_id)
        for task in dropped:
            task.status = TaskStatus.DROPPED
            task.holders.clear()
            self._cancel_copies(it, task.spec.task_id)
        it.queue.clear()
        it.shares.clear()
        manifest = self.manifest(it)
        self.store.write_manifest(it.run_id, it.iteration, manifest)
        log.info(
            "run %s iteration %d sealed: %s; %d/%d done, %d requeued, %d refused, evicted %s, %.2fs",
            it.run_id, it.iteration, reason, manifest["tasks_done"], manifest["tasks_total"], manifest["requeued"],
            manifest["refused_duplicate"] + manifest["refused_fenced"] + manifest["refused_sealed"],
            it.evicted or "none", manifest["elapsed_s"],
        )
        self._seal_signals.fire((it.run_id, it.iteration))
        # Older iterations are dropped at the next tick: freeing their memory and rows, and
        # handing their shard files to the recycler, took 3.6 ms of the seal of each ~100 MB
        # iteration of bench/scheduler.py's durable stream, before the waiters got their answer.
        self._trim_due.add(it.run_id)
        self._dispatch(it.run_id)

    def _trim(self, run_id: str) -> None:
        """Keep the groups of the newest KEEP_SEALED_GROUPS sealed iterations in memory (older ones
        are read back from their shards if a trainer still asks for them), and the newest
        ``keep_iterations`` sealed iterations at all: older ones leave memory, SQLite and disk.
        Once the run's trainers fetched an iteration in full, the sealed iterations above it that
        they have not fetched yet are kept whole as well (the newest KEEP_UNFETCHED): iterations
        submitted ahead (``rollout.max_staleness``) seal before the one the trainer waits for, and
        were dropped before it got to them. (Trainers fetch in number order; one resumed from an
        older checkpoint fetches lower numbers again, which the seal order keeps, as before.)"""
        its = self.iterations.get(run_id, {})
        # In the order they sealed, not by number: an iteration submitted again after it was dropped
        # (a trainer resumed from an older checkpoint) is the newest once it seals.
        sealed = sorted((i for i, it in its.items() if it.sealed), key=lambda i: its[i].seal_order)
        fetched = self._fetched_upto.get(run_id)
        unfetched = set() if fetched is None else set([i for i in sealed if i > fetched and its[i].awaits_fetch][-KEEP_UNFETCHED:])
        for iteration in sealed[-self.keep_iterations:-KEEP_SEALED_GROUPS]:
            if iteration in unfetched:
                continue
            it = its[iteration]
            it.groups.clear()
            if self.store.forget(run_id, iteration):  # in memory: nothing to read them back from
                it.shard_of.clear()
        # The newest number stays too: it is the run's current iteration (``latest``, the metrics).
        newest = max(its, default=None)
        old = [i for i in sealed[:-self.keep_iterations] if i not in unfetched and i != newest]
        if not old:
            return
        upto = max(self._dropped_upto.get(run_id, -1), *old)
        with self.db.tx() as db:
            db.delete_iterations(run_id, old)
            db.put_dropped(run_id, upto)
        for iteration in old:
            del its[iteration]
            self._elapsed_at_seal.pop((run_id, iteration), None)
            self.store.drop(run_id, iteration)
        self._dropped_upto[run_id] = upto
        log.debug("run %s: dropped sealed iteration(s) %s (keeping %d)", run_id, old, self.keep_iterations)

    def end_streams(self, run_id: str, reason: str) -> None:
        """The run was closed: end its engines' Work streams with RUN_CLOSED, so rollout-only
        workers stop at once instead of finding out by polling (its iterations stay readable)."""
        for conn in self.conns.get(run_id, {}).values():
            if not conn.closed:
                conn.run_closed = True
                conn.send(End(RunClosedError(f"run {run_id!r} was closed ({reason})")))

    def drop_run(self, run_id: str) -> None:
        """Forget a run the coordinator dropped (closed, no live member): its iterations, streams
        and shards. SQLite first; memory once that committed."""
        with self.db.tx() as db:
            db.delete_iterations(run_id)
        for it in self.iterations.pop(run_id, {}).values():
            self._elapsed_at_seal.pop((run_id, it.iteration), None)
            self.store.drop(run_id, it.iteration)
        for conn in self.conns.pop(run_id, {}).values():
            conn.send(End(RunClosedError(f"run {run_id!r} was closed and dropped")))
            conn.closed = True
        self._dispatched_at.pop(run_id, None)
        self._freed.pop(run_id, None)
        self._fetched_upto.pop(run_id, None)
        self._dropped_upto.pop(run_id, None)
        self._trim_due.discard(run_id)

    async def wait_sealed(self, run_id: str, iteration: int, wait_s: float) -> Iteration | None:
        """The iteration once sealed, or as it stands after ``wait_s``; None if it has not even
        been submitted yet (trainer ranks may ask before the driver submits)."""
        it = self.iterations.get(run_id, {}).get(iteration)
        if (it is None or not it.sealed) and wait_s > 0:
            await self._seal_signals.wait((run_id, iteration), wait_s)
        return self.iterations.get(run_id, {}).get(iteration)

    # -- reading results -----------------------------------------------------------------------

    def manifest(self, it: Iteration, *, per_node: bool = True) -> dict:
        if it.sealed:
            elapsed = self._elapsed_at_seal.get((it.run_id, it.iteration), it.sealed_at - it.submitted_at)
        else:
            elapsed = self.clock() - it.submitted_at
        slots = {m: c.worker.slots for m, c in self.conns.get(it.run_id, {}).items()}
        return accounting.manifest(it, slots, self.clock(), elapsed, per_node=per_node)

    def shard(self, run_id: str, iteration: int, rank: int, world_size: int, split: Split) -> list[tuple[GroupRecord, Task]]:
        """Rank ``rank``'s part of a sealed iteration's ``split`` groups, balanced by tokens."""
        it = self.iteration(run_id, iteration)
        if not it.sealed:
            raise NotReadyError(
                f"iteration: {iteration} of run {run_id!r} is not sealed yet "
                f"({it.count(TaskStatus.DONE)}/{len(it.tasks)} done); wait for the seal first"
            )
        if not 0 <= rank < world_size:
            raise InvalidRequestError(f"rank: {rank} must be in 0..world_size-1 (world_size={world_size})")
        self._load_groups(it)
        if split is Split.TRAIN:
            ranks = it.train_fetched.setdefault(world_size, set())
            ranks.add(rank)
            if len(ranks) == world_size:  # what the trainers fetched need not be kept for them
                self._fetched_upto[run_id] = max(iteration, self._fetched_upto.get(run_id, -1))
                self._trim_due.add(run_id)
        plan = it.shard_plans.get((split, world_size))
        if plan is None:
            done = [t for t in it.tasks.values() if t.status is TaskStatus.DONE and t.spec.split is split]
            if any(t.spec.task_id not in it.groups for t in done):
                raise self._groups_gone(it)
            # Balanced by every token of every episode, observations included: the update's forward
            # and backward passes cost all of them, trained (loss mask 1) or not.
            plan = it.shard_plans[(split, world_size)] = policy.balance_shards(
                [(t.spec.task_id, t.seq, it.groups[t.spec.task_id].num_tokens) for t in done], world_size)
        if any(task_id not in it.groups for task_id in plan[rank]):
            raise self._groups_gone(it)
        return [(it.groups[task_id], it.tasks[task_id]) for task_id in plan[rank]]

    @staticmethod
    def _groups_gone(it: Iteration) -> NotFoundError:
        return NotFoundError(
            f"iteration: the groups of iteration {it.iteration} of run {it.run_id!r} are gone: an in-memory "
            f"coordinator keeps only the newest {KEEP_SEALED_GROUPS} sealed iterations (use --state-dir)"
        )
