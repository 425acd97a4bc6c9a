"""Workers' Work streams opening and closing on the coordinator: ``connect`` (a reconnecting
worker's hello names the tasks it still runs, held for it again: ``_claim``), ``disconnect``, and
a member that stops being live (``_member_gone``); what a closed stream held is queued again.

``WorkerLinks`` is that part of ``SchedulerCore`` (the core inherits it, as it does
``results.ResultBook`` and ``returns.TaskReturns``); it uses the core's ``coord``, ``conns``,
``iterations``, ``db`` and ``clock``, and its ``_slots_freed``, ``_dispatch``, ``_assign``,
``_unqueue``, ``_assigned`` and ``_requeue``.
"""

from __future__ import annotations

import collections
import logging

from elasticrl.coordinator.state import Member, MemberStatus
from elasticrl.errors import FencedError
from elasticrl.scheduler.state import Iteration, TaskStatus, Worker
from elasticrl.scheduler.stream import Cancel, End, WorkerConn

log = logging.getLogger("elasticrl.scheduler.core")  # its records, as before the split


class WorkerLinks:
    def connect(
        self, run_id: str, member_id: str, incarnation: int, *, slots: int, weight: float,
        running: list[tuple[int, str]] | None = None,
    ) -> WorkerConn:
        """Open a worker's stream. The member must be live with exactly this incarnation.
        ``running``: (iteration, task id) of every copy it still runs from an earlier stream
        (``_claim``); None from a worker that does not say."""
        self.coord.check_member(run_id, member_id, incarnation)
        conn = WorkerConn(run_id, Worker(member_id, incarnation, slots, weight, self.clock()))
        self.coord.stream_attached(run_id, member_id, incarnation)  # a broken stream evicts it soon
        old = self.conns[run_id].get(member_id)
        if old is not None:
            # The same process reconnected (its old stream is not closed yet on our side): it still
            # runs what it held, so the copies move to the new stream instead of being requeued.
            if old.worker.incarnation == incarnation:
                conn.worker.holding = old.worker.holding
                old.worker.holding = set()
            old.send(End(FencedError(f"worker {member_id!r} opened a newer stream")))
            old.closed = True
        self.conns[run_id][member_id] = conn
        log.info("run %s: worker %s (incarnation %d) connected with %d slot(s), weight %g",
                 run_id, member_id, incarnation, slots, weight)
        if running is not None:
            conn.reports_running = True
            self._claim(conn, running)
        self._slots_freed(conn)  # only its slots are new: a full pass per connect was O(workers^2) to start a fleet
        self._dispatch(run_id, freed_only=True)
        return conn

    def _claim(self, conn: WorkerConn, running: list[tuple[int, str]]) -> None:
        """The copies a reconnecting worker still runs are its own again: held against its slots,
        not handed out anew. A copy handed out anew could cross the worker's release of its old
        one on the wire; the release would then free the new copy's slot while the worker ran it,
        and the worker would run more tasks than its slots. A task handed to another worker
        meanwhile, or whose result is being stored, keeps this copy too (the first result wins, the
        other copies are cancelled then). Only a copy of a task that will not run again (done,
        given up, its iteration sealed or unknown) is cancelled: a cancel is a request, the engine
        may finish the copy anyway, and a task that came back to this worker meanwhile would run
        on it twice.

        Copies moved here from its old stream (still open on this side) that ``running`` does not
        name are queued again: their assignment or their release was lost with the old stream (a
        result of one still on its way is taken all the same). Claims stop at the worker's slots:
        past them a copy is left where it is (a worker that says it runs more than its slots is
        wrong, and must not take tasks from the others' queues)."""
        worker, now = conn.worker, self.clock()
        its = self.iterations.get(conn.run_id, {})
        named = set(running)
        if lost := worker.holding - named:
            worker.holding -= lost
            n = self._requeue_keys(conn.run_id, worker.member_id, lost, "not running after a reconnect")
            log.info("run %s: worker %s no longer runs %d task(s) of its old stream; %d requeued",
                     conn.run_id, worker.member_id, len(lost), n)
        cancels: dict[int, list[str]] = collections.defaultdict(list)
        touched: dict[int, tuple[Iteration, set[str]]] = {}
        held = over = 0
        for iteration, task_id in sorted(named):
            if (iteration, task_id) in worker.holding:  # moved with its stream, which was still open here
                continue
            it = its.get(iteration)
            task = it.tasks.get(task_id) if it is not None and not it.sealed else None
            if task is None or task.status not in (TaskStatus.QUEUED, TaskStatus.RUNNING):
                cancels[iteration].append(task_id)
                continue
            if len(worker.holding) >= worker.slots:
                over += 1
                continue
            if task.status is TaskStatus.QUEUED:
                self._unqueue(it, task_id, worker.member_id, anywhere=True)
            self._assign(it, task, worker, now, backup=False, queued=False)
            held += 1
            touched.setdefault(iteration, (it, set()))[1].add(worker.member_id)
        self._assigned(conn.run_id, touched)
        for iteration, task_ids in cancels.items():
            conn.send(Cancel(iteration, task_ids))
        if held or cancels:
            log.info("run %s: worker %s still runs %d task(s): %d held for it again, %d cancelled",
                     conn.run_id, worker.member_id, len(named), held, sum(map(len, cancels.values())))
        if over:
            log.warning("run %s: worker %s says it runs %d task(s) on %d slot(s); %d of them left to the queue",
                        conn.run_id, worker.member_id, len(named), worker.slots, over)

    def disconnect(self, conn: WorkerConn, reason: str, *, abrupt: bool = True) -> None:
        """The stream ended: ``abrupt`` when it broke rather than being closed by the worker."""
        conn.closed = True
        self.coord.stream_detached(conn.run_id, conn.worker.member_id, conn.worker.incarnation, abrupt=abrupt)
        if self.conns.get(conn.run_id, {}).get(conn.worker.member_id) is not conn:
            return  # replaced by a newer stream of the same worker
        del self.conns[conn.run_id][conn.worker.member_id]
        n = self._requeue_holdings(conn, f"stream closed: {reason}")
        log.info("run %s: worker %s disconnected (%s); %d task(s) requeued", conn.run_id, conn.worker.member_id, reason, n)
        self._dispatch(conn.run_id)

    def _member_gone(self, run_id: str, member: Member) -> None:
        conn = self.conns.get(run_id, {}).get(member.member_id)
        evicted = member.status is MemberStatus.EVICTED
        for it in self.iterations.get(run_id, {}).values():
            if not it.sealed and member.member_id in it.nodes and evicted and member.member_id not in it.evicted:
                it.evicted.append(member.member_id)
                it.node(member.member_id).evicted = True
            # Static policy: a gone member's unstarted share goes to the shared queue, in order
            # (only that member would ever take it). A mere disconnect keeps it: it may reconnect.
            share = it.shares.pop(member.member_id, None)
            if share and not it.sealed:
                it.queue.extend(share)
            if not it.sealed and member.member_id in it.nodes:
                with self.db.tx():
                    self.db.put_counters(it)
        if conn is None or conn.worker.incarnation != member.incarnation:
            self._dispatch(run_id)
            return
        conn.worker.fenced = True
        n = self._requeue_holdings(conn, f"{member.status.value}: {member.reason}")
        log.info("run %s: worker %s %s; %d running task(s) requeued", run_id, member.member_id, member.status.value, n)
        # The stream stays open until FENCED_STREAM_GRACE_S (see ``tick``), so late results are
        # refused and counted rather than lost in flight.
        conn.fenced_at = self.clock()
        self._dispatch(run_id)

    def _requeue_holdings(self, conn: WorkerConn, why: str) -> int:
        keys, conn.worker.holding = conn.worker.holding, set()
        return self._requeue_keys(conn.run_id, conn.worker.member_id, keys, why)

    def _requeue_keys(self, run_id: str, member_id: str, keys, why: str) -> int:
        """Drop ``member_id``'s copies of ``keys`` (iteration, task id); those left with none go to
        the front of their queue, in their order. Returns how many."""
        n = 0
        by_iteration: dict[int, list[str]] = collections.defaultdict(list)
        for iteration, task_id in sorted(keys):
            by_iteration[iteration].append(task_id)
        for iteration, task_ids in by_iteration.items():
            it = self.iterations.get(run_id, {}).get(iteration)
            if it is None or it.sealed:
                continue
            task_ids.sort(key=lambda tid: it.tasks[tid].seq)
            with self.db.tx():
                for task_id in reversed(task_ids):  # appendleft: keep their order at the front
                    n += self._requeue(it, it.tasks[task_id], member_id, why)
                self.db.put_counters(it)
            # No cancel to a fenced worker: what it finishes is still sent, then refused and
            # counted (and it learns it is fenced from its keep-alive or the stream's end).
        return n
