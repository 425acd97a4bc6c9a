"""The result path of the scheduler: a batch of groups from a worker is decided when it arrives,
its shards are written, then it is committed and acknowledged.

``ResultBook`` is that half of ``SchedulerCore`` (the core inherits it; it uses the core's
iterations, store, database and dispatch): ``decide`` (on arrival, nothing durable), ``write``
(the shard files, no shared state), ``commit`` (one SQLite transaction for the batch, then memory)
and ``abandon`` (the shards could not be written). ``ResultPipeline`` runs them for the Work
streams: the worker gets new tasks on arrival, before the write; with a durable store a big
batch's write (or any write, with fsync or a slow disk) goes to a worker thread, so the event loop
reads the next batch (and serves every other stream) while the kernel copies this one, and a small
one is written on the loop (cheaper than the hand-off); each stream's batches commit and are
acknowledged in the order they arrived (a worker drops its oldest unacknowledged batch per ack).

Invariants (those of ``core``, kept across the split):
  * an ack goes out only after its batch's commit, and a re-sent batch (same batch id) is answered
    with its first ack, counted once, even while its first copy is still being stored; a copy of
    one of its tasks handed to its worker again meanwhile is given back (the worker, holding the
    result, skips it) and goes to another worker first, since that ack is not out yet;
  * a task is stored at most once: between a batch's decision and its commit its fresh tasks are
    ``storing``, and any other copy of them is refused as a duplicate;
  * at most ``MAX_PENDING_BATCHES`` batches per stream wait between decision and commit (the stream
    is not read meanwhile, so gRPC's flow control holds the worker back): memory stays bounded;
  * every wait has a deadline (``STORE_TIMEOUT_S``): a shard write that hangs fails the batch like
    a full disk, and the worker sends it again on a new stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import logging
import math
import time

from elasticrl.errors import CoordinatorUnavailableError, FencedError, InternalError
from elasticrl.scheduler import accounting, policy
from elasticrl.scheduler.state import GroupRecord, Iteration, Task, TaskStatus
from elasticrl.scheduler.store import Group
from elasticrl.scheduler.stream import Ack, Decided, End, WorkerConn

log = logging.getLogger(__name__)

# Batches per stream between decision and commit; the stream waits (is not read) beyond it.
MAX_PENDING_BATCHES = 4
# A shard write (or the commit of the batch before it on its stream) not done within this long
# fails the batch: the worker is told to send it again on a new stream.
STORE_TIMEOUT_S = 60.0
# Threads writing shard files. One keeps the writes in order and off the event loop; more only
# made the kernel's page-cache allocations contend on the 2-core development VM.
WRITE_THREADS = 1
# Batches with at least this many bytes of samples have their shard written in that thread. A
# smaller one is written on the event loop: overwriting a recycled shard file (recycle.py) costs
# ~0.15 ms per MiB, less than the hand-off to the thread and back (in bench/scheduler.py's durable
# stream the coordinator's CPU per GB fell from 2.2-2.8 s to 2.0-2.2 s with 1 MiB batches inline).
THREADED_WRITE_BYTES = 4 << 20
# ...unless the store fsyncs, or SLOW_WRITES inline writes within SLOW_WRITE_WINDOW_S took longer
# than SLOW_WRITE_S each, or one took SLOW_WRITE_WINDOW_S (a slow or throttled disk): then every
# write goes to the thread for SLOW_WRITE_HOLD_S, so that the event loop (every stream, barrier and
# lease) does not wait for the disk. (A 1 MiB write to the page cache takes ~0.2 ms; 5 ms was passed now and then by a
# scheduling hiccup of this VM, and 20 ms about once in 5000 writes of bench/scheduler.py's durable
# stream: with one strike that hiccup sent the rest of the run to the thread, ~10% slower here.)
SLOW_WRITE_S = 0.02
SLOW_WRITES = 2
SLOW_WRITE_WINDOW_S = 1.0
SLOW_WRITE_HOLD_S = 10.0


class ResultBook:
    """The result half of ``SchedulerCore`` (see the module docstring). It uses the core's
    ``coord``, ``iterations``, ``conns``, ``store``, ``db``, ``clock``, ``metrics`` and
    ``_deciding`` (batch id -> its ``Decided`` until the commit), and its ``_dispatch``,
    ``_maybe_seal``, ``_requeue``, ``_cancel_copies``, ``_free_slot``, ``_counts_saved`` and
    ``release`` (``returns.TaskReturns``)."""

    def accept(
        self, conn: WorkerConn, groups: list[tuple[int, Group]], batch_id: str = "",
    ) -> tuple[Ack | None, Exception | None]:
        """Store the first result of each task; refuse (and count) every other one: ``decide``,
        ``write`` and ``commit`` at once (tests; ``ResultPipeline`` runs them apart).

        Returns (ack, error). With an error the stream ends after the ack: FencedError when the
        worker is fenced; CoordinatorUnavailableError, with no ack, when the groups could not be
        stored (disk full, say): nothing was committed, the tasks are the worker's again, and it
        sends the batch again on a new stream. A batch re-sent after it was stored (same
        ``batch_id``) gets its first ack back, counted once.
        """
        decided = self.decide(conn, groups, batch_id)
        try:
            self.write(decided)
        except OSError as exc:
            self.abandon(decided, f"store failed: {exc}")
            return None, self.store_failed(decided, exc)
        return self.commit(decided)

    def decide(self, conn: WorkerConn, groups: list[tuple[int, Group]], batch_id: str = "") -> Decided:
        """Decide a result batch on arrival (``policy.sort_results``) and pick its shards' names.

        Nothing durable changes until ``commit``. What changes in memory at once: the worker's slots
        for the batch's tasks are free (its engine is done with them), so it gets new tasks while
        the shards are written, and each fresh task is marked ``storing``, so that a second copy
        arriving before the commit is refused as a duplicate and none is handed out as a backup.
        ``abandon`` undoes both if the batch cannot be stored.
        """
        worker = conn.worker
        d = Decided(conn, groups, batch_id)
        replay = self.coord.replies.get(batch_id, "results")
        if replay is not None:  # stored before: the re-sent batch gets its first ack, counted once
            d.replay = Ack(replay["accepted"], [tuple(r) for r in replay["refused"]])
        elif batch_id in self._deciding:  # its first copy is between decision and commit
            d.follows = self._deciding[batch_id]
        else:
            run = self.coord.runs.get(conn.run_id)
            d.fenced = worker.fenced or run is None or not run.is_live(worker.member_id, worker.incarnation)
            its = self.iterations.get(conn.run_id, {})
            d.fresh, d.refused = policy.sort_results(its, groups, d.fenced)
            for iteration, batch in d.fresh.items():
                it = its[iteration]
                for g in batch:
                    it.tasks[g.task_id].storing = True
                    g.node = worker.member_id  # the incoming record, not shared state: stored with it
                shard = self.store.reserve(conn.run_id, iteration)
                d.writes.append((iteration, shard, [(g, it.tasks[g.task_id].spec.prompt_ids) for g in batch]))
            if batch_id:
                self._deciding[batch_id] = d
        its = self.iterations.get(conn.run_id, {})
        resent = d.replay is not None or d.follows is not None
        gives_back = resent and self._gives_back(conn)
        for iteration, group in groups:
            key = (iteration, group.task_id)
            if resent:
                # A re-sent batch frees a slot of its tasks where the worker's copy is over (the task
                # done or being stored, or the worker no longer one of its holders: a slot carried
                # over from its stream before, which the first copy could not free). A copy handed
                # to it again since (a restart lost the stored result, or another worker's) never
                # ran: the worker holds this batch's results until its ack and skips such a copy.
                # The commit gives it back (``_give_back_handed_again``); one whose task another
                # result is being stored for is dropped from its holders now (that result decides
                # it, or its abandon queues it again), also if this stream ends before the commit.
                it = its.get(iteration)
                task = it.tasks.get(group.task_id) if it is not None else None
                if (task is not None and task.status is TaskStatus.RUNNING and not task.storing
                        and worker.member_id in task.holders):
                    continue
                if gives_back and task is not None and task.storing:
                    task.holders.pop(worker.member_id, None)
            if self._free_slot(conn, key):
                d.released.append(key)
        self._dispatch(conn.run_id, freed_only=True)
        return d

    def write(self, d: Decided) -> None:
        """Write ``d``'s shard files. Touches no shared state but the files (and the in-memory
        store's dict, which is why that store is written on the event loop), so a durable store
        may run it in a worker thread.

        Raises:
            OSError: a shard could not be written (``abandon`` the batch).
        """
        for iteration, shard, groups in d.writes:
            self.store.write(d.conn.run_id, iteration, shard, groups)

    def store_failed(self, d: Decided, exc: BaseException) -> CoordinatorUnavailableError:
        log.error("run %s: could not store the %d result(s) of worker %s: %s; it sends them again",
                  d.conn.run_id, sum(len(b) for b in d.fresh.values()), d.conn.worker.member_id, exc)
        return CoordinatorUnavailableError(f"could not store results ({exc}); send them again on a new stream")

    def commit(self, d: Decided) -> tuple[Ack | None, Exception | None]:
        """Make a decided batch durable, its shards written: one SQLite transaction for the whole
        batch (the done tasks, the counters, the ack for a re-sent copy); memory follows once it
        committed. Returns (ack, error); with an error the stream ends after the ack (FencedError:
        the worker is fenced).

        Raises:
            CoordinatorUnavailableError: a re-sent batch whose first copy was abandoned (the
                worker sends it again, on a new stream).
        """
        conn, worker = d.conn, d.conn.worker
        if d.replay is not None:
            self._give_back_handed_again(d)
            return d.replay, None
        if d.follows is not None:
            replay = self.coord.replies.get(d.batch_id, "results")
            if replay is None:
                raise CoordinatorUnavailableError("results: the first copy of this batch could not be stored; send it again")
            self._give_back_handed_again(d)
            return Ack(replay["accepted"], [tuple(r) for r in replay["refused"]]), None
        if self._deciding.get(d.batch_id) is d:
            del self._deciding[d.batch_id]
        its = self.iterations.get(conn.run_id, {})
        refused, fresh, shards = list(d.refused), {}, {}
        for iteration, shard, groups in d.writes:  # what changed since the decision: a seal, a drop
            it = its.get(iteration)
            for g, _ in groups:
                task = it.tasks.get(g.task_id) if it is not None else None
                if task is not None:
                    task.storing = False
                reason = "unknown" if task is None else "duplicate" if task.status is TaskStatus.DONE else "sealed" if it.sealed else ""
                if reason:
                    refused.append((iteration, g.task_id, reason))
                else:
                    fresh.setdefault(iteration, []).append(g)
                    shards[iteration] = shard
            if iteration not in fresh:
                self.store.discard(conn.run_id, iteration, shard)  # no commit will refer to it
        touched = {i: its[i] for i in {*fresh, *(i for i, _, reason in refused if reason != "unknown")} if i in its}
        ack = Ack(sum(len(b) for b in fresh.values()), refused)
        reply = {"accepted": ack.accepted, "refused": [list(r) for r in refused]}
        now = self.clock()
        staged = {i: accounting.staged_counters(it, worker.member_id, refused, fresh.get(i, []), now) for i, it in touched.items()}
        try:
            with self.db.tx() as db:
                for iteration, it in touched.items():
                    if fresh.get(iteration):
                        db.put_done(it, [g.task_id for g in fresh[iteration]], worker.member_id, shards[iteration])
                    counters, node = staged[iteration]
                    db.put_counters(it, counters, {worker.member_id: node})
                self.coord.replies.record(d.batch_id, "results", reply)
        except BaseException as exc:  # nothing was committed: nothing of the batch stays in memory either
            self.abandon(d, f"commit failed: {type(exc).__name__}: {exc}")
            raise
        d.committed = True
        self.coord.replies.remember(d.batch_id)
        for it in touched.values():
            self._counts_saved(conn.run_id, it, worker.member_id)
        # Committed: now memory follows.
        for iteration, group in d.groups:
            it = touched.get(iteration)
            if it is not None and group.task_id in it.tasks:
                it.tasks[group.task_id].holders.pop(worker.member_id, None)
        for _, task_id, reason in refused:
            self.metrics.refused.inc(run=conn.run_id, reason=reason)
        # Every touched iteration's counters first: a seal below dispatches, and the counts of the
        # tasks it hands out of another of these iterations must not be overwritten afterwards.
        for iteration, it in touched.items():
            it.counters, it.nodes[worker.member_id] = staged[iteration]
        # Every result of the batch done before any seal: a seal dispatches, and it would hand out
        # a task of a later iteration whose result is in this batch (queued again after its lease
        # ran out) to the very worker that delivered it, whose copy ``_complete`` does not cancel.
        for iteration, it in sorted(touched.items()):
            batch = fresh.get(iteration, [])
            for g in batch:
                self._complete(it, it.tasks[g.task_id], g, shards[iteration])
            if batch:
                self.metrics.accepted.inc(len(batch), run=conn.run_id)
                self.metrics.trajectory_bytes.inc(sum(g.num_bytes for g in batch), run=conn.run_id)
        for _, it in sorted(touched.items()):
            self._maybe_seal(it)
        # A copy refused as a duplicate of a result that was then abandoned: it was the last one.
        orphans = [(i, task_id) for i, task_id, reason in refused if reason == "duplicate"
                   and (it := touched.get(i)) is not None and not it.sealed and (task := it.tasks.get(task_id)) is not None
                   and task.status is TaskStatus.RUNNING and not task.holders and not task.storing]
        if orphans:
            self._requeue_orphans(conn.run_id, orphans, "the result it was refused for was not stored")
        if d.fenced and d.groups:
            log.info("run %s: refused %d result(s) from fenced worker %s (incarnation %d)",
                     conn.run_id, len(d.groups), worker.member_id, worker.incarnation)
            end = FencedError(f"worker {worker.member_id!r} incarnation {worker.incarnation} is no longer live; join again")
            return ack, end
        self._dispatch(conn.run_id, freed_only=True)  # the slots of copies cancelled above
        return ack, None

    def _give_back_handed_again(self, d: Decided) -> None:
        """Give back what a re-sent batch's tasks still hold of its worker on its stream now. The
        worker holds the batch's results until this ack and skips a task it holds the result of
        (``RolloutWorker._has``), and its hello never names one, so it runs none of them:

        * a slot still counted for one is a copy handed to it again after it first sent the batch
          (a restart lost the stored result, or another worker's), which it skipped. It would hold
          the slot and the task until the task lease ran out (600 s by default), and the slot
          until the stream ended (the lease takes the worker off the task's holders, not its
          slot). It is released as the worker would release it: queued again if no other copy
          runs, and handed to another worker first (``release``), since this ack is not sent yet
          and a copy handed to this worker before it would be skipped again;
        * the worker still among a task's holders without the slot is dropped from them, and the
          task queued again if it runs with no other copy (``decide`` already dropped it where
          another result was being stored then, which decides the task, or, abandoned, queues it).

        A task whose other result is being stored only loses this copy (that result decides it).
        Only on the worker's current stream (an older one's copies are the new hello's to claim),
        and only for a worker whose hello names what it runs: every such worker skips those copies
        (an older one may run them)."""
        conn = d.conn
        member_id = conn.worker.member_id
        if not self._gives_back(conn):
            return
        its, unheld = self.iterations.get(conn.run_id, {}), []
        keys = {(iteration, group.task_id) for iteration, group in d.groups}
        for iteration, of_iteration in itertools.groupby(sorted(keys), key=lambda key: key[0]):
            it, held, unheld_before = its.get(iteration), [], len(unheld)
            for key in of_iteration:
                task = it.tasks.get(key[1]) if it is not None else None
                if key in conn.worker.holding and not (task is not None and task.storing):
                    held.append(key[1])
                elif key in conn.worker.holding or (task is not None and member_id in task.holders):
                    self._free_slot(conn, key)  # (a task being stored: its other result decides it)
                    unheld.append(key)
            if n := len(held) + len(unheld) - unheld_before:
                log.info("run %s iteration %d: worker %s re-sent a batch with the results of %d task(s) handed to it "
                         "again meanwhile, which it skipped; given back", conn.run_id, iteration, member_id, n)
            if held:
                self.release(conn, iteration, held, "handed out again while its worker held the result")
        if unheld:  # its holders without its slot, or a task being stored: no copy of this worker's left
            self._requeue_orphans(conn.run_id, unheld, "its copy was skipped", member_id=member_id, skip=conn)

    def _gives_back(self, conn: WorkerConn) -> bool:
        """Whether a batch re-sent on ``conn`` gives back its tasks' copies (see
        ``_give_back_handed_again``): the worker's current stream, and its hello named what runs."""
        return (conn.reports_running and not conn.closed
                and self.conns.get(conn.run_id, {}).get(conn.worker.member_id) is conn)

    def abandon(self, d: Decided, why: str) -> None:
        """A decided batch that will not be committed (its shards could not be written): its tasks
        are not ``storing`` any more and go back to the worker's slots, so the end of its stream
        requeues them; if that stream is gone already, they are requeued now. Once per batch."""
        if d.committed or d.abandoned:
            return
        d.abandoned = True
        if self._deciding.get(d.batch_id) is d:
            del self._deciding[d.batch_id]
        its = self.iterations.get(d.conn.run_id, {})
        orphans: list[tuple[int, str]] = []
        for iteration, shard, groups in d.writes:
            it = its.get(iteration)
            for g, _ in groups:
                if it is not None and g.task_id in it.tasks:
                    it.tasks[g.task_id].storing = False
                    if (iteration, g.task_id) not in d.released:
                        orphans.append((iteration, g.task_id))  # its copies may have gone meanwhile
            self.store.discard(d.conn.run_id, iteration, shard)
        conn = d.conn
        if not conn.closed and self.conns.get(conn.run_id, {}).get(conn.worker.member_id) is conn:
            conn.worker.holding.update(d.released)
            self._requeue_orphans(conn.run_id, orphans, why)
            return
        self._requeue_orphans(conn.run_id, d.released, why, member_id=conn.worker.member_id)
        self._requeue_orphans(conn.run_id, orphans, why)

    def _requeue_orphans(self, run_id: str, keys, why: str, *, member_id: str = "", skip: WorkerConn | None = None) -> None:
        """Queue again each task of ``keys`` (iteration, task id) that is running with no copy
        left (after dropping ``member_id``'s), and not being stored: nothing else would. The
        dispatch that follows passes over ``skip``.

        A copy refused as a duplicate of a result being stored frees its worker on arrival, and
        its commit drops it from the task's holders; if the stored result is then abandoned, the
        task may be left running with no holder. ``abandon`` and ``commit`` queue it here."""
        its = self.iterations.get(run_id, {})
        requeued = False
        for iteration, group in itertools.groupby(sorted(keys), key=lambda key: key[0]):
            it = its.get(iteration)
            if it is None or it.sealed:
                continue
            with self.db.tx():
                for _, task_id in group:
                    task = it.tasks[task_id]
                    if task.storing:  # another copy's result decides: done, or this check again
                        task.holders.pop(member_id, None)
                    else:  # (queued only if running with no copy left)
                        requeued |= bool(self._requeue(it, task, member_id, why))
                self.db.put_counters(it)
        if requeued or member_id:
            self._dispatch(run_id, skip=skip)

    def _complete(self, it: Iteration, task: Task, group: GroupRecord, shard: str) -> None:
        """Apply a committed result in memory (the node's stats come from ``_staged_counters``)."""
        task.status = TaskStatus.DONE
        task.done_by = group.node
        it.groups[task.spec.task_id] = group
        it.shard_of[task.spec.task_id] = shard
        self._cancel_copies(it, task.spec.task_id, keep=group.node)
        task.holders.clear()



class ResultPipeline:
    """Runs ``ResultBook``'s steps for every Work stream: one task per batch that waits for its
    shard write (a worker thread) and for the batch before it on its stream, then commits and
    sends the ack. With the in-memory store, or nothing to write and nothing ahead of it, a batch
    is committed by the caller, after one turn of the event loop if it freed slots that were
    filled (the stream's writer sends those tasks first)."""

    def __init__(self, book: ResultBook, *, max_pending: int = MAX_PENDING_BATCHES, store_timeout_s: float = STORE_TIMEOUT_S,
                 write_threads: int = WRITE_THREADS, threaded_write_bytes: int = THREADED_WRITE_BYTES):
        self.book = book
        self.threaded_write_bytes = threaded_write_bytes
        self.max_pending = max_pending
        self.store_timeout_s = store_timeout_s
        self.write_threads = write_threads
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task] = set()
        self._threaded_until = -math.inf  # perf_counter: slow inline writes send writes to the thread
        self._slow_writes: list[float] = []  # when the latest slow inline writes ended (perf_counter)

    async def submit(self, conn: WorkerConn, groups: list[tuple[int, Group]], batch_id: str,
                     invalid: list[tuple[int, str, str]] = ()) -> None:
        """Take a batch off ``conn``'s stream. Returns once it is decided (and, without a write
        to wait for, committed and acknowledged), so the stream's next message can be read.

        Raises:
            CoordinatorUnavailableError: the stream's oldest batch did not finish within the
                deadline while this one waited for room (the stream ends; the worker re-sends).
        """
        while len(conn.pending) >= self.max_pending:  # bounded: the stream is not read meanwhile
            oldest, waiting = conn.pending[0].done, len(conn.pending)
            try:
                async with asyncio.timeout(self.store_timeout_s):
                    await asyncio.shield(oldest)
            except TimeoutError:
                raise CoordinatorUnavailableError(
                    f"results: {waiting} batches not stored within {self.store_timeout_s:g}s; send them again"
                ) from None
        book = self.book
        d = book.decide(conn, groups, batch_id)
        d.invalid = list(invalid)
        threaded = self._threaded(d)
        if not conn.pending and not threaded and d.follows is None:
            if conn.outbox.empty() or conn.combined_acks:
                # A combined_acks worker gets the tasks handed out on arrival with this batch's
                # ack, as one message (outbox.Writer), which saves a message's send and receive on
                # each side: in bench/scheduler.py's stream ~0.1 CPU s per GB on the coordinator
                # and on the worker, against the ~0.3 ms earlier those tasks would leave otherwise.
                self._commit_now(d)
                return
            # The tasks handed out on arrival go first: the stream's writer sends them while this
            # batch commits, instead of after it (the worker's engine waits for them; in
            # bench/scheduler.py's in-memory stream that was 0.3 ms of a ~2.5 ms round trip).
            d.done = asyncio.get_running_loop().create_future()  # a re-sent copy waits for it
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:  # the stream ended meanwhile: nothing is committed
                book.abandon(d, "stream closed")
                raise
            else:
                self._commit_now(d)
            finally:
                d.done.set_result(None)
            return
        d.done = asyncio.get_running_loop().create_future()
        ahead = conn.pending[-1].done if conn.pending else None
        conn.pending.append(d)
        task = asyncio.create_task(self._finish(d, ahead, threaded), name=f"results-{conn.worker.member_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _threaded(self, d: Decided) -> bool:
        """Whether ``d``'s shard goes to the writer thread: a big batch, an fsync, or a disk that was
        slow of late. Otherwise it is written on the loop: a few syscalls, fewer than the hand-off
        (round trips of empty tasks took twice as long through the thread)."""
        store = self.book.store
        if store.root is None or not d.writes:
            return False
        if store.fsync or time.perf_counter() < self._threaded_until:
            return True
        return sum(g.num_bytes for _, _, shard_groups in d.writes for g, _ in shard_groups) >= self.threaded_write_bytes

    def _write_inline(self, d: Decided) -> None:
        """``book.write(d)`` on the event loop, timed (see ``SLOW_WRITE_S``)."""
        started = time.perf_counter()
        try:
            self.book.write(d)
        finally:
            now = time.perf_counter()
            if d.writes and now - started > SLOW_WRITE_S:
                # The window counts back from this write's start, so writes slower than the window
                # still count together; one as long as the window is no scheduling hiccup.
                self._slow_writes = [t for t in self._slow_writes if started - t < SLOW_WRITE_WINDOW_S] + [now]
                if len(self._slow_writes) >= SLOW_WRITES or now - started >= SLOW_WRITE_WINDOW_S:
                    if now >= self._threaded_until:
                        log.info("%d shard writes took over %.0f ms on the event loop (the last %.1f ms); writing shards "
                                 "in a thread for %gs", len(self._slow_writes), SLOW_WRITE_S * 1000, (now - started) * 1000,
                                 SLOW_WRITE_HOLD_S)
                    self._threaded_until = now + SLOW_WRITE_HOLD_S

    def _commit_now(self, d: Decided) -> None:
        """Write (the in-memory store's dict, or a small shard), commit and answer ``d`` on this step."""
        book = self.book
        try:
            self._write_inline(d)
        except OSError as exc:
            book.abandon(d, f"store failed: {exc}")
            _answer(d, None, book.store_failed(d, exc))
            return
        _answer(d, *book.commit(d))

    async def _finish(self, d: Decided, ahead: asyncio.Future | None, threaded: bool) -> None:
        book, answer = self.book, None
        try:
            if threaded:
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(self.write_threads, thread_name_prefix="shard-write")
                await self._deadline(asyncio.get_running_loop().run_in_executor(self._writer, book.write, d))
            else:
                self._write_inline(d)
            for before in (ahead, d.follows.done if d.follows is not None else None):
                if before is not None:  # each finishes within its own deadlines
                    await self._deadline(asyncio.shield(before))
            answer = book.commit(d)
        except OSError as exc:
            book.abandon(d, f"store failed: {exc}")
            answer = (None, book.store_failed(d, exc))
        except CoordinatorUnavailableError as exc:  # a re-sent copy whose first copy was abandoned
            book.abandon(d, str(exc))
            answer = (None, exc)
        except asyncio.CancelledError:  # the coordinator is stopping: nothing is committed
            book.abandon(d, "coordinator stopping")
            raise
        except Exception as exc:  # noqa: BLE001 - ends the stream with its status, as the reader does
            log.exception("results of %s could not be committed", d.conn.worker.member_id)
            book.abandon(d, f"{type(exc).__name__}: {exc}")
            answer = (None, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            d.conn.pending.remove(d)
            d.done.set_result(None)
        _answer(d, *answer)


    async def _deadline(self, awaitable) -> None:
        """Await ``awaitable`` for at most ``store_timeout_s``; past it, the batch fails as a write
        that could not be done (the thread, if any, finishes on its own; its file is never used)."""
        try:
            async with asyncio.timeout(self.store_timeout_s):
                await awaitable
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"not stored within {self.store_timeout_s:g}s") from None


def _answer(d: Decided, ack: Ack | None, end: Exception | None) -> None:
    """The ack of a committed batch (with the groups refused before the core saw them), then the
    stream's end if there is one. Sent to a closed stream they go nowhere: the worker re-sends the
    batch on its new stream and gets this ack back from the replies."""
    if ack is not None:
        ack.refused.extend(d.invalid)
        if d.conn.combined_acks:  # what its writer's merge needs (``outbox.Writer``)
            ack.tasks = frozenset((iteration, group.task_id) for iteration, group in d.groups)
        d.conn.send(ack)
    if end is not None:
        d.conn.send(End(end))
