"""Durable coordinator state in SQLite (WAL mode) under ``--state-dir``.

Every change is written here, in one transaction, before the in-memory state changes and before
the request is acknowledged, so ``kill -9`` at any moment loses nothing that a client was told
happened. Monotonic times are not stored (a restarted process has a new clock): on load, leases
and deadlines are granted afresh, which gives every member one lease period to reconnect.

Values are protobuf-free: JSON for small structured columns, raw bytes for KV. No pickle.

``synchronous=NORMAL`` survives a process crash (the WAL is in the OS page cache); pass
``fsync=True`` (``--fsync``) for ``synchronous=FULL`` when the machine itself may lose power.

The database is opened in ``locking_mode=EXCLUSIVE``: the coordinator holds its lock from start to
exit (the kernel drops it when the process dies, ``kill -9`` included). A second coordinator
started on the same state dir stops at once with ``StateDirInUseError`` instead of both writing it.
It is also cheaper: no file lock is taken and released around each transaction, and the WAL index
lives in the process's memory instead of a shared ``-shm`` mapping. In ``bench/scheduler.py``'s
durable stream that was ~12 ``fcntl`` calls per result batch. Read a live coordinator's state
through its API (``elasticrl status``), not through the file.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sqlite3

from elasticrl.coordinator.state import (
    Barrier,
    BarrierResult,
    Member,
    MemberStatus,
    Outcome,
    Rendezvous,
    RoundConfig,
    Run,
    TimeoutPolicy,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
# Versions this code opens; an older one is marked SCHEMA_VERSION once open, so a coordinator
# from before stops with a clear error instead of misreading it. 2: a done task is a row of
# sched_done (version 1 had it in its sched_tasks row, still read), a task's spec its message.
READS_SCHEMA = (1, 2)
# How long a coordinator waits for another process's lock on the state database before it stops.
LOCK_WAIT_S = 1.0


class StateDBError(RuntimeError):
    """The state database cannot be used: not a database, unreadable, or written by another
    version; the message names the file and what to do."""


class StateDirInUseError(StateDBError):
    """Another process holds the state database (a coordinator still running on the same dir)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, closed INTEGER NOT NULL, close_reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    run_id TEXT NOT NULL, member_id TEXT NOT NULL, incarnation INTEGER NOT NULL, host TEXT NOT NULL,
    weight REAL NOT NULL, capabilities TEXT NOT NULL, joined_epoch INTEGER NOT NULL,
    lease_ttl_s REAL NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (run_id, member_id));
CREATE TABLE IF NOT EXISTS kv (
    run_id TEXT NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL, PRIMARY KEY (run_id, key));
CREATE TABLE IF NOT EXISTS barriers (
    run_id TEXT NOT NULL, name TEXT NOT NULL, timeout_s REAL NOT NULL, policy TEXT NOT NULL,
    expected TEXT NOT NULL, result TEXT, PRIMARY KEY (run_id, name));
CREATE TABLE IF NOT EXISTS arrivals (
    run_id TEXT NOT NULL, name TEXT NOT NULL, member_id TEXT NOT NULL, incarnation INTEGER NOT NULL,
    PRIMARY KEY (run_id, name, member_id));
CREATE TABLE IF NOT EXISTS rendezvous (run_id TEXT PRIMARY KEY, state TEXT NOT NULL);
"""


class StateDB:
    """A thin, synchronous writer/reader of the coordinator's tables.

    Callers group the writes of one change with ``with db.tx():`` so they commit together.
    """

    def __init__(self, path: str | os.PathLike | None, *, fsync: bool = False):
        # path None: an in-memory database (tests and benchmarks that do not need durability).
        self.path = None if path is None else pathlib.Path(path)
        target = ":memory:" if path is None else str(path)
        try:
            self._conn = sqlite3.connect(target, isolation_level=None, check_same_thread=False, timeout=LOCK_WAIT_S)
        except sqlite3.Error as exc:  # a directory in its place, no permission
            raise StateDBError(f"{path}: cannot open the state database ({exc}); check --state-dir") from None
        try:
            if path is not None:  # before WAL mode is entered: then no -shm mapping is used
                self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._conn.executescript(_SCHEMA)  # takes the lock, held until close()
            version = self._meta("schema_version")
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise StateDirInUseError(
                    f"{path}: the state database is locked by another process or connection (a coordinator still running "
                    "on this --state-dir?); stop it first, or give this one another --state-dir"
                ) from None
            raise StateDBError(
                f"{path}: not a usable coordinator state database ({exc}); move it away, or start with another --state-dir"
            ) from None
        if version is not None and (not str(version).isdigit() or int(version) not in READS_SCHEMA):
            self._conn.close()
            raise StateDBError(
                f"{path}: state schema version {version}, this coordinator reads "
                f"{', '.join(map(str, READS_SCHEMA))}; start with a fresh --state-dir (or the coordinator that wrote it)"
            )
        if version is None or int(version) != SCHEMA_VERSION:
            self._set_meta("schema_version", str(SCHEMA_VERSION))
        self._depth = 0

    # -- transactions ------------------------------------------------------------------------

    @property
    def durable(self) -> bool:
        """Whether anything written here outlives the process (False: the in-memory database,
        whose rows only a restart would read back, and a restart starts it empty)."""
        return self.path is not None

    def tx(self) -> "_Tx":
        return _Tx(self)

    def close(self) -> None:
        self._conn.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """For other tables that share this database and its transactions (``scheduler.persist``)."""
        return self._conn

    def _meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def _set_meta(self, key: str, value: str) -> None:
        self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    # -- writes (call inside tx) -------------------------------------------------------------

    def next_incarnation(self) -> int:
        value = int(self._meta("incarnation") or 0) + 1
        self._set_meta("incarnation", str(value))
        return value

    def put_run(self, run: Run, *, epoch: int | None = None, closed: bool | None = None, reason: str | None = None) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO runs(run_id, epoch, closed, close_reason) VALUES (?, ?, ?, ?)",
            (
                run.run_id,
                run.epoch if epoch is None else epoch,
                int(run.closed if closed is None else closed),
                run.close_reason if reason is None else reason,
            ),
        )

    def put_member(self, run_id: str, m: Member, *, status: MemberStatus | None = None, reason: str | None = None) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                m.member_id,
                m.incarnation,
                m.host,
                m.weight,
                json.dumps(m.capabilities, sort_keys=True),
                m.joined_epoch,
                m.lease_ttl_s,
                (status or m.status).value,
                m.reason if reason is None else reason,
            ),
        )

    def put_kv(self, run_id: str, pairs: list[tuple[bytes, bytes]]) -> None:
        self._conn.executemany(
            "INSERT OR REPLACE INTO kv(run_id, key, value) VALUES (?, ?, ?)",
            [(run_id, k, v) for k, v in pairs],
        )

    def delete_kv(self, run_id: str, key: bytes) -> None:
        self._conn.execute("DELETE FROM kv WHERE run_id=? AND key=?", (run_id, key))

    def put_barrier(self, run_id: str, b: Barrier, result: BarrierResult | None = None) -> None:
        res = result or b.result
        self._conn.execute(
            "INSERT OR REPLACE INTO barriers VALUES (?, ?, ?, ?, ?, ?)",
            (
                run_id,
                b.name,
                b.timeout_s,
                b.policy.value,
                json.dumps(b.expected, sort_keys=True),
                None if res is None else json.dumps(_result_to_json(res)),
            ),
        )

    def delete_run(self, run_id: str) -> None:
        for table in ("runs", "members", "kv", "barriers", "arrivals", "rendezvous"):
            self._conn.execute(f"DELETE FROM {table} WHERE run_id=?", (run_id,))

    def delete_barrier(self, run_id: str, name: str) -> None:
        self._conn.execute("DELETE FROM barriers WHERE run_id=? AND name=?", (run_id, name))

    def put_arrivals(self, rows: list[tuple[str, str, str, int]]) -> None:
        """Arrivals as (run id, barrier name, member id, incarnation), in one statement."""
        self._conn.executemany("INSERT OR REPLACE INTO arrivals VALUES (?, ?, ?, ?)", rows)

    def delete_arrivals(self, run_id: str, name: str) -> None:
        """A decided barrier's result lists who arrived; the per-arrival rows are no longer needed."""
        self._conn.execute("DELETE FROM arrivals WHERE run_id=? AND name=?", (run_id, name))

    def put_rendezvous(self, run_id: str, rdzv: Rendezvous) -> None:
        cfg = rdzv.config
        state = {
            "config": None if cfg is None else [cfg.min_nodes, cfg.max_nodes, cfg.last_call_s, cfg.join_timeout_s, cfg.rejoin_timeout_s],
            "round": rdzv.round,
            "participants": rdzv.participants,
            "waiting": list(rdzv.waiting.items()),
            "timed_out": rdzv.timed_out,
        }
        self._conn.execute(
            "INSERT OR REPLACE INTO rendezvous(run_id, state) VALUES (?, ?)", (run_id, json.dumps(state))
        )

    # -- load --------------------------------------------------------------------------------

    def load(self, now: float) -> dict[str, Run]:
        """Rebuild every run; live leases and open deadlines restart from ``now`` (the grace period)."""
        runs: dict[str, Run] = {}
        for run_id, epoch, closed, reason in self._conn.execute("SELECT * FROM runs"):
            runs[run_id] = Run(run_id=run_id, epoch=epoch, closed=bool(closed), close_reason=reason)
        for row in self._conn.execute("SELECT * FROM members"):
            run_id, mid, inc, host, weight, caps, joined, ttl, status, reason = row
            runs[run_id].members[mid] = Member(
                member_id=mid,
                incarnation=inc,
                host=host,
                weight=weight,
                capabilities=json.loads(caps),
                joined_epoch=joined,
                lease_ttl_s=ttl,
                lease_deadline=now + ttl,
                status=MemberStatus(status),
                reason=reason,
            )
        for run in runs.values():
            run.live_count = len(run.live_members())
        for run_id, key, value in self._conn.execute("SELECT * FROM kv"):
            run = runs[run_id]
            run.kv[bytes(key)] = bytes(value)
            run.kv_bytes += len(key) + len(value)
        # rowid order is decision order for decided barriers: deciding one replaces its row.
        for run_id, name, timeout_s, policy, expected, result in self._conn.execute("SELECT * FROM barriers ORDER BY rowid"):
            runs[run_id].barriers[name] = Barrier(
                name=name,
                timeout_s=timeout_s,
                policy=TimeoutPolicy(policy),
                expected={k: int(v) for k, v in json.loads(expected).items()},
                arrived={},
                opened_at=now,
                result=None if result is None else _result_from_json(json.loads(result)),
            )
        for run_id, name, mid, inc in self._conn.execute("SELECT * FROM arrivals"):
            barrier = runs[run_id].barriers.get(name)
            if barrier is not None:
                barrier.arrived[mid] = inc
        for run in runs.values():
            run.open_barriers = {n: b for n, b in run.barriers.items() if b.result is None}
            run.decided.extend(n for n, b in run.barriers.items() if b.result is not None)
        for run_id, state in self._conn.execute("SELECT * FROM rendezvous"):
            s = json.loads(state)
            rdzv = runs[run_id].rendezvous
            rdzv.config = None if s["config"] is None else RoundConfig(*s["config"])
            rdzv.round = s["round"]
            rdzv.participants = [(m, int(i)) for m, i in s["participants"]]
            rdzv.waiting = {m: int(i) for m, i in s["waiting"]}
            rdzv.timed_out = {m: str(r) for m, r in s.get("timed_out", {}).items()}  # absent in older rows
            # The waiting set's times restart now, the last call included: the old clock is gone.
            rdzv.waiting_since = now if rdzv.waiting else None
            if rdzv.config is not None and rdzv.waiting and len(rdzv.waiting) >= rdzv.config.min_nodes:
                rdzv.min_reached_at = now
        return runs


class _Tx:
    """Re-entrant transaction: the outermost ``with`` commits, an exception rolls back."""

    def __init__(self, db: StateDB):
        self._db = db

    def __enter__(self) -> StateDB:
        if self._db._depth == 0:
            self._db._conn.execute("BEGIN")
        self._db._depth += 1
        return self._db

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db._depth -= 1
        if self._db._depth == 0:
            self._db._conn.execute("ROLLBACK" if exc_type else "COMMIT")


def _result_to_json(r: BarrierResult) -> dict:
    return {
        "outcome": r.outcome.value,
        "arrived": r.arrived,
        "evicted": r.evicted,
        "missing": r.missing,
        "epoch": r.epoch,
        "reason": r.reason,
    }


def _result_from_json(d: dict) -> BarrierResult:
    return BarrierResult(
        outcome=Outcome(d["outcome"]),
        arrived=list(d["arrived"]),
        evicted=list(d["evicted"]),
        missing=list(d["missing"]),
        epoch=int(d["epoch"]),
        reason=str(d["reason"]),
    )
