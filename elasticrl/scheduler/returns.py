"""Tasks a worker hands back, or holds longer: ``release`` (unfinished: requeued, or, failed too
often, given up) and ``renew`` (its engine advances on them: their leases start again).

``TaskReturns`` is that part of ``SchedulerCore`` (the core inherits it, as it does
``results.ResultBook``); it uses the core's ``iterations``, ``db``, ``clock`` and ``metrics``, and
its ``_free_slot``, ``_requeue``, ``_cancel_copies``, ``_maybe_seal`` and ``_dispatch``.
"""

from __future__ import annotations

import logging

from elasticrl.scheduler.state import MAX_ERRORS, RELEASE_STOPPING, TaskStatus
from elasticrl.scheduler.stream import WorkerConn

log = logging.getLogger("elasticrl.scheduler.core")  # its records, as before the split


class TaskReturns:
    def release(
        self, conn: WorkerConn, iteration: int, task_ids: list[str], reason: str, *, failed: bool = False, env_errors: int = 0,
    ) -> None:
        """The worker gives tasks back unfinished: they are queued again for anyone. With
        ``failed`` their attempt failed (an environment error): a task that failed
        ``max_task_failures`` times is given up (FAILED) instead, and the iteration may seal
        without it. A release naming an iteration this coordinator does not hold (never
        submitted, or dropped since) is ignored: those tasks are nobody's to requeue any more."""
        if reason == RELEASE_STOPPING:
            conn.draining = True
        it = self.iterations.get(conn.run_id, {}).get(iteration)
        if it is None:
            for task_id in task_ids:
                self._free_slot(conn, (iteration, task_id))  # filled at the next dispatch
            log.info(
                "run %s: worker %s released %d task(s) of iteration %d, which this coordinator does not hold; ignored",
                conn.run_id, conn.worker.member_id, len(task_ids), iteration,
            )
            return
        given_up, back = [], []
        with self.db.tx():
            if failed and not it.sealed:
                it.counters.env_errors += env_errors
                if reason not in it.counters.errors:
                    it.counters.errors = [*it.counters.errors, reason][-MAX_ERRORS:]
                self.metrics.env_errors.inc(env_errors, run=conn.run_id)
            for task_id in task_ids:
                if self._free_slot(conn, (iteration, task_id)):
                    task = it.tasks.get(task_id)
                    if it.sealed or task is None:
                        continue
                    if failed and task.status is TaskStatus.RUNNING:
                        task.failures += 1
                        if conn.worker.member_id not in task.failed_on:
                            task.failed_on += (conn.worker.member_id,)
                        self.db.put_failures(it, task)
                        if task.failures >= it.config.max_task_failures:
                            given_up.append(task)
                            continue
                    back.append(task)
            for task in sorted(back, key=lambda t: t.seq, reverse=True):  # each to the front: they keep their order
                self._requeue(it, task, conn.worker.member_id, f"released: {reason}")
            self.db.put_counters(it)
        for task in given_up:
            task.status = TaskStatus.FAILED
            task.holders.clear()
            self._cancel_copies(it, task.spec.task_id)
            log.warning("run %s iteration %d: task %s failed %d time(s), given up: %s",
                        it.run_id, it.iteration, task.spec.task_id, task.failures, reason)
        if given_up:
            self._maybe_seal(it)
        self._dispatch(conn.run_id, skip=conn)  # not straight back to the worker giving them up

    def renew(self, conn: WorkerConn, iteration: int, task_ids: list[str]) -> int:
        """The worker's engine made progress on these tasks: the lease of its copy of each starts
        again from now (``task_lease_s``). Only a live copy this worker holds is renewed; a task
        done, sealed, not its own or already past its deadline (requeued) is left as it is.
        Memory only, like the leases themselves. Returns how many were renewed."""
        it = self.iterations.get(conn.run_id, {}).get(iteration)
        if it is None or it.sealed or conn.worker.fenced:
            return 0
        now, renewed = self.clock(), 0
        for task_id in task_ids:
            task = it.tasks.get(task_id)
            holder = task.holders.get(conn.worker.member_id) if task is not None else None
            if (holder is None or task.status is not TaskStatus.RUNNING or holder.incarnation != conn.worker.incarnation
                    or now >= holder.deadline):
                continue
            holder.deadline = now + it.config.task_lease_s
            renewed += 1
        return renewed
