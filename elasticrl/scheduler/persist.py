"""The scheduler's durable state: tables in the coordinator's SQLite database.

They share ``StateDB``'s connection and transactions, so a change that touches membership and
tasks together commits together. What is stored: each iteration's config, submit wall time,
counters and seal; each node's stats per iteration; each task's spec and requeue count, and (once
accepted, a row of ``sched_done``) who completed it and the shard that holds its group; failed
attempts per task. Which
worker runs which task is not stored: after a restart every unfinished task is queued again and
workers reconnect (their late results are still accepted once). JSON columns, no pickle; a task's
spec is its ``TaskSpec`` message (a state dir written before that has it as JSON, still read).
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import json

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.coordinator.persist import StateDB
from elasticrl.scheduler.convert import shared_sampling, task_from_pb, task_wire
from elasticrl.scheduler.state import (
    Counters,
    Iteration,
    IterationConfig,
    NodeStats,
    Policy,
    Sampling,
    Split,
    Task,
    TaskSpec,
    TaskStatus,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sched_iterations (
    run_id TEXT NOT NULL, iteration INTEGER NOT NULL, config TEXT NOT NULL,
    submitted_unix REAL NOT NULL, counters TEXT NOT NULL, sealed INTEGER NOT NULL,
    seal_reason TEXT NOT NULL, elapsed_s REAL NOT NULL, PRIMARY KEY (run_id, iteration));
CREATE TABLE IF NOT EXISTS sched_tasks (
    run_id TEXT NOT NULL, iteration INTEGER NOT NULL, task_id TEXT NOT NULL, seq INTEGER NOT NULL,
    spec TEXT NOT NULL, requeues INTEGER NOT NULL, done_by TEXT NOT NULL, shard TEXT NOT NULL,
    PRIMARY KEY (run_id, iteration, task_id));
CREATE TABLE IF NOT EXISTS sched_nodes (
    run_id TEXT NOT NULL, iteration INTEGER NOT NULL, member_id TEXT NOT NULL, stats TEXT NOT NULL,
    PRIMARY KEY (run_id, iteration, member_id));
CREATE TABLE IF NOT EXISTS sched_done (
    run_id TEXT NOT NULL, iteration INTEGER NOT NULL, task_id TEXT NOT NULL, done_by TEXT NOT NULL, shard TEXT NOT NULL,
    PRIMARY KEY (run_id, iteration, task_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sched_task_failures (
    run_id TEXT NOT NULL, iteration INTEGER NOT NULL, task_id TEXT NOT NULL, failures INTEGER NOT NULL,
    PRIMARY KEY (run_id, iteration, task_id));
CREATE TABLE IF NOT EXISTS sched_dropped (run_id TEXT PRIMARY KEY, upto INTEGER NOT NULL);
"""


def open_db(db: StateDB) -> "SchedulerDB":
    """The scheduler's tables in ``db``; for the in-memory database, a ``SchedulerDB`` that writes
    none: only a restart reads them, and a restart of a memory-only coordinator starts empty. (Its
    JSON encoding and SQLite statements were ~10% of the coordinator's CPU per result batch in
    ``bench/scheduler.py``'s in-memory stream.) The transactions stay: the replies they hold are
    read back on a retry."""
    return SchedulerDB(db) if db.durable else _Unwritten(db)


class SchedulerDB:
    def __init__(self, db: StateDB):
        self.db = db
        self._conn = db.connection
        self._conn.executescript(_SCHEMA)

    @contextlib.contextmanager
    def tx(self):
        """One transaction of the shared database (re-entrant, like ``StateDB.tx``)."""
        with self.db.tx():
            yield self

    def put_iteration(self, it: Iteration, submitted_unix: float) -> None:
        self._conn.execute(
            "INSERT INTO sched_iterations VALUES (?, ?, ?, ?, ?, 0, '', 0)",
            (it.run_id, it.iteration, json.dumps(_config_json(it.config)), submitted_unix, _counters_json(it)),
        )
        self._conn.executemany(
            "INSERT INTO sched_tasks VALUES (?, ?, ?, ?, ?, 0, '', '')",
            [
                (it.run_id, it.iteration, t.spec.task_id, t.seq, task_wire(t.spec))
                for t in it.tasks.values()
            ],
        )

    def put_counters(self, it: Iteration, counters: Counters | None = None, nodes: dict[str, NodeStats] | None = None) -> None:
        """``it``'s counters, and the stats of ``nodes`` (member id -> stats), or of all its nodes
        when None. ``counters``/``nodes`` may stand in for memory, for a change that reaches
        memory only once this transaction committed. A node's stats are a row of their own, so a
        result batch rewrites its own node's, not every node's (at 512 workers that was a ~45 KB
        JSON encoded and written per batch)."""
        self._conn.execute(
            "UPDATE sched_iterations SET counters=? WHERE run_id=? AND iteration=?",
            (_counters_json(it, counters), it.run_id, it.iteration),
        )
        self._put_nodes(it, it.nodes if nodes is None else nodes)

    def _put_nodes(self, it: Iteration, nodes: dict[str, NodeStats]) -> None:
        self._conn.executemany(
            "INSERT OR REPLACE INTO sched_nodes VALUES (?, ?, ?, ?)",
            [(it.run_id, it.iteration, m, _node_json(n)) for m, n in nodes.items()],
        )

    def put_done(self, it: Iteration, task_ids: list[str], done_by: str, shard: str) -> None:
        """Rows of their own, not an update of the task's row: that row holds the spec (~1 KB for a
        200-token prompt, several pages past ~1000 tokens), and SQLite writes every page of a row
        it changes, once to the WAL and once at the checkpoint. A result batch of 4 groups wrote
        6.3 pages to the WAL at 200-token prompts and 11 at 2048; now 5.9 at either (the rest:
        the iteration's counters, the worker's stats, the batch's reply)."""
        self._conn.executemany(
            "INSERT OR REPLACE INTO sched_done VALUES (?, ?, ?, ?, ?)",
            [(it.run_id, it.iteration, tid, done_by, shard) for tid in task_ids],
        )

    def put_lost(self, it: Iteration, tasks: list[Task]) -> None:
        """These tasks' groups are gone (their shard is missing or damaged): not done any more."""
        keys = [(it.run_id, it.iteration, t.spec.task_id) for t in tasks]
        self._conn.executemany("DELETE FROM sched_done WHERE run_id=? AND iteration=? AND task_id=?", keys)
        # (done_by/shard in the task's row: where a coordinator before sched_done marked it done)
        self._conn.executemany(
            "UPDATE sched_tasks SET done_by='', shard='', requeues=? WHERE run_id=? AND iteration=? AND task_id=?",
            [(t.requeues, *key) for t, key in zip(tasks, keys)],
        )

    def delete_iterations(self, run_id: str, iterations: list[int] | None = None) -> None:
        """Forget these iterations of ``run_id`` (retention), or all of its iterations (None)."""
        where, args = ("run_id=?", [(run_id,)]) if iterations is None else (
            "run_id=? AND iteration=?", [(run_id, i) for i in iterations])
        for table in ("sched_iterations", "sched_tasks", "sched_done", "sched_nodes", "sched_task_failures"):
            self._conn.executemany(f"DELETE FROM {table} WHERE {where}", args)
        if iterations is None:
            self._conn.execute("DELETE FROM sched_dropped WHERE run_id=?", (run_id,))

    def put_dropped(self, run_id: str, upto: int) -> None:
        """The highest iteration number retention dropped (so a fetch of one says it was dropped)."""
        self._conn.execute("INSERT OR REPLACE INTO sched_dropped VALUES (?, ?)", (run_id, upto))

    def dropped(self) -> dict[str, int]:
        return dict(self._conn.execute("SELECT run_id, upto FROM sched_dropped"))

    def put_requeue(self, it: Iteration, task: Task) -> None:
        self._conn.execute(
            "UPDATE sched_tasks SET requeues=? WHERE run_id=? AND iteration=? AND task_id=?",
            (task.requeues, it.run_id, it.iteration, task.spec.task_id),
        )

    def put_failures(self, it: Iteration, task: Task) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO sched_task_failures VALUES (?, ?, ?, ?)",
            (it.run_id, it.iteration, task.spec.task_id, task.failures),
        )

    def put_seal(self, it: Iteration, reason: str, elapsed_s: float) -> None:
        self._conn.execute(
            "UPDATE sched_iterations SET sealed=1, seal_reason=?, elapsed_s=?, counters=? WHERE run_id=? AND iteration=?",
            (reason, elapsed_s, _counters_json(it), it.run_id, it.iteration),
        )
        self._put_nodes(it, it.nodes)

    def load(self, now: float, wall_now: float) -> list[tuple[Iteration, float]]:
        """Every stored iteration, with its submit time mapped onto this process's clock, and
        (for sealed ones) the elapsed time recorded at the seal."""
        tasks: dict[tuple[str, int], list[tuple]] = collections.defaultdict(list)
        for row in self._conn.execute(
            "SELECT run_id, iteration, task_id, seq, spec, requeues, done_by, shard FROM sched_tasks ORDER BY seq"
        ):
            tasks[(row[0], row[1])].append(row[2:])
        done = {
            (run_id, iteration, task_id): (done_by, shard)
            for run_id, iteration, task_id, done_by, shard in self._conn.execute("SELECT * FROM sched_done")
        }
        failures = {
            (run_id, iteration, task_id): n
            for run_id, iteration, task_id, n in self._conn.execute("SELECT * FROM sched_task_failures")
        }
        nodes: dict[tuple[str, int], dict[str, NodeStats]] = collections.defaultdict(dict)
        for run_id, iteration, member_id, stats in self._conn.execute("SELECT * FROM sched_nodes"):
            nodes[(run_id, iteration)][member_id] = NodeStats(**json.loads(stats))
        out, legacy = [], []
        for run_id, iteration, config, submitted_unix, counters, sealed, seal_reason, elapsed_s in self._conn.execute(
            "SELECT * FROM sched_iterations ORDER BY run_id, iteration"
        ):
            age = max(0.0, wall_now - submitted_unix)
            it = Iteration(
                run_id=run_id,
                iteration=iteration,
                config=_config_from(json.loads(config)),
                tasks={},
                submitted_at=now - age,
            )
            stored = json.loads(counters)
            _counters_from(it, stored)
            it.nodes.update(nodes[(run_id, iteration)])
            if "nodes" in stored:  # written before node stats had their own table
                legacy.append(it)
            for task_id, seq, spec, requeues, done_by, shard in tasks[(run_id, iteration)]:
                # done: a row in sched_done, or (a state dir from before it) the task's own columns
                done_by, shard = done.get((run_id, iteration, task_id), (done_by, shard))
                task = Task(spec=_stored_spec(spec), seq=seq, requeues=requeues, done_by=done_by,
                            failures=failures.get((run_id, iteration, task_id), 0))
                if done_by:
                    task.status = TaskStatus.DONE
                    it.shard_of[task_id] = shard
                elif task.failures >= it.config.max_task_failures:
                    task.status = TaskStatus.FAILED
                elif sealed:
                    task.status = TaskStatus.DROPPED
                else:
                    it.queue.append(task_id)
                it.tasks[task_id] = task
            if sealed:  # on this process's clock as well, so that retention keeps the seal order
                it.sealed_at = min(now, it.submitted_at + elapsed_s)
                it.seal_reason = seal_reason
            out.append((it, elapsed_s))
        if legacy:  # their node stats move to their table, and leave the counters' JSON
            with self.tx():
                for it in legacy:
                    self.put_counters(it)
        return out


class _Unwritten(SchedulerDB):
    """``SchedulerDB`` of a memory-only coordinator: every write is dropped (see ``open_db``)."""

    def put_iteration(self, it, submitted_unix):
        pass

    def put_counters(self, it, counters=None, nodes=None):
        pass

    def put_done(self, it, task_ids, done_by, shard):
        pass

    def put_lost(self, it, tasks):
        pass

    def delete_iterations(self, run_id, iterations=None):
        pass

    def put_dropped(self, run_id, upto):
        pass

    def dropped(self):
        return {}

    def put_requeue(self, it, task):
        pass

    def put_failures(self, it, task):
        pass

    def put_seal(self, it, reason, elapsed_s):
        pass


def _config_json(c: IterationConfig) -> dict:
    d = dataclasses.asdict(c)
    d["policy"] = c.policy.value
    return d


def _config_from(d: dict) -> IterationConfig:
    return IterationConfig(**{**d, "policy": Policy(d["policy"])})


def _stored_spec(value: bytes | str) -> TaskSpec:
    """A task's stored spec: its message, as workers are sent it (the JSON it was stored as
    before cost ~25 us per task of a submit with a 200-token prompt, on the event loop), or JSON
    from a state dir written before."""
    if isinstance(value, bytes):
        return task_from_pb("sched_tasks.spec", spb.TaskSpec.FromString(value), keep_wire=True)
    d = json.loads(value)
    return TaskSpec(**{**d, "prompt_ids": array.array("i", d["prompt_ids"]), "split": Split(d["split"]),
                       "sampling": shared_sampling(Sampling(**d["sampling"]))})


def _counters_json(it: Iteration, counters: Counters | None = None) -> str:
    c = it.counters if counters is None else counters
    # The fields as they are (ints and a list of strings): asdict's deep copy cost more than the
    # encoding, once per result batch.
    return json.dumps({"counters": vars(c), "evicted": it.evicted})


def _node_json(n: NodeStats) -> str:
    return json.dumps({"assigned": n.assigned, "done": n.done, "refused": n.refused, "tokens": n.tokens, "evicted": n.evicted})


def _counters_from(it: Iteration, d: dict) -> None:
    it.counters = Counters(**d["counters"])
    it.nodes = {m: NodeStats(**n) for m, n in d.get("nodes", {}).items()}  # "nodes": the format before sched_nodes
    it.evicted = list(d["evicted"])
