"""Random runs of the pipelined result path (``results.ResultPipeline``) keep its promises.

Several workers (Work streams, as plain ``WorkerConn`` objects) on one durable ``Harness`` send
result batches through ``ResultPipeline.submit``: their own tasks, second copies of tasks another
batch is storing or stored, tasks of sealed (and dropped) iterations, unknown tasks, the same task
twice, batches re-sent under their batch id on a new stream while or after their first copy is
stored. Shard writes go to the writer thread (``threaded_write_bytes=0``, one or two threads), or
are written on the loop (the default threshold), or both (a small threshold); the test holds each
threaded write and lets it go (or fails it with OSError) in a random order; inline writes fail at
random; streams end while their batches are in flight (disconnected, replaced by a newer stream,
ended by the coordinator, cut between a batch's decision and its commit); a stream's reader blocks
once ``max_pending`` batches wait; iterations seal (deadlines) and are dropped (retention) under
pending batches. A dedicated variant with a small ``store_timeout_s`` lets held writes pass their
deadline, with batches behind them on the stream, re-sent copies waiting for them and readers
blocked for room.

Nothing waits for a time (but the deadline variant's deadlines): a threaded write waits for the test
to let it start, tells the loop when it is done, and returns only when the test says so, one at a
time, and the loop is then run until nothing more can move (``Sim.drive``). So a seed replays the
same run (the deadline variant's timed-out batches aside: those runs are checked, not replayed).

The scheduler's steps (``decide``, ``write``, ``commit``, ``abandon``, ``store_failed``) and each
stream's ``send`` are wrapped: each checks, when it happens, what the module docstring promises:
  * a fresh batch is decided by the documented rules (unknown / fenced / duplicate, counting the
    tasks being stored / sealed / stored), a re-sent one as a replay (stored before) or as following
    its first copy (being stored); a re-sent copy frees only the slots of copies that are over;
  * a stream's reader never decides a batch while ``max_pending`` of its batches wait;
  * a batch commits after every batch before it on its stream finished (unless one of them failed:
    the stream is ending), a re-sent copy after its first copy; the commit refuses what sealed or was
    dropped meanwhile and stores the rest; a task is stored at most once over the whole run; a
    re-sent copy gets its first ack and changes nothing (counted once), or, its first copy abandoned
    and no copy stored, ends its stream with CoordinatorUnavailableError;
  * an ack leaves only after its batch committed; the acks a stream delivers before its end answer
    its batches in the order they arrived (a worker drops its oldest unacknowledged batch per ack);
    a failed or timed-out write ends its stream with CoordinatorUnavailableError and no ack;
  * an abandoned batch strands nothing: its tasks are not ``storing``, go back to the worker while
    its stream is open (requeued when it ends) and are requeued otherwise; its shard is not
    referenced and not on disk (unless its write was still running: an orphan, never referenced).
After every step: ``storing`` flags, ``_deciding``, each stream's pending batches, DONE tasks (by
whom, which shard, the group in memory), the refused counters and per-node stats match the model of
the acks; a running task not being stored is in a stream's slots or in a batch not finished yet
(else nothing would ever requeue it: ``Stranded``); a worker holds no more than its slots (but tasks
given back by an abandoned batch). At the end, with every write let go: nothing pending or storing,
every stream ended and no task left RUNNING, the shard files on disk exactly the referenced ones (and
the orphans), each DONE task's group read back from its shard with the bytes that were sent, and
every batch answered once.

It found a bug: a task stranded after a failed write (see ``CASES`` and the last test).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import functools
import math
import random
import threading

import pytest

from elasticrl.errors import CoordinatorUnavailableError, FencedError
from elasticrl.scheduler import results
from elasticrl.scheduler.results import ResultPipeline
from elasticrl.scheduler.state import IterationConfig, TaskStatus
from elasticrl.scheduler.stream import Ack, Decided, End, WorkerConn
from tests.unit.scheduler_harness import RUN, Harness, Item, check_counts, drain, expect_commit, expect_decision, group, spec

pytestmark = pytest.mark.timeout(120)

DONE, QUEUED, RUNNING = TaskStatus.DONE, TaskStatus.QUEUED, TaskStatus.RUNNING
MEMBERS = ("a", "b", "c")
SCENARIO_TIMEOUT_S = 60.0  # the whole run (asyncio.wait_for): a hang fails, it does not stall the suite
SETTLE_TIMEOUT_S = 20.0  # one wait for the loop and the writer threads to move on (events, not a sleep)
GATE_WAIT_S = 30.0  # a write the test never lets go (a failed run) gives up after this long
BIG_TOKENS = 24  # 2 samples x 24 tokens x 8 bytes: over the mixed variant's threshold


@dataclasses.dataclass(frozen=True)
class Variant:
    threaded_write_bytes: int = 0  # 0: every shard write in the writer thread
    write_threads: int = 1
    max_pending: int = 2
    store_timeout_s: float = 60.0  # never reached but in the deadline variant
    backups: bool = True  # iterations with backup copies (two workers run one task)
    keep_iterations: int = 8
    big: float = 0.0  # share of batches with big groups (the mixed variant: those go to the thread)
    expire: bool = False  # held writes pass their deadline (op_expire)
    late: bool = True  # results of tasks the worker does not hold (but for re-sent batches)
    steps: int = 140


VARIANTS = {
    "threaded-1": Variant(),
    "threaded-2": Variant(write_threads=2, max_pending=3, keep_iterations=2),
    "mixed": Variant(threaded_write_bytes=256, write_threads=2, big=0.35),
    "inline": Variant(threaded_write_bytes=results.THREADED_WRITE_BYTES),
    # No backups: held writes are let go at once, but the one meant to pass its deadline.
    "deadline": Variant(write_threads=2, store_timeout_s=0.25, backups=False, expire=True, late=False, steps=90),
}


class Stranded(AssertionError):
    """A task left RUNNING with nobody to finish or requeue it (the bug the last test shows)."""


class Gate:
    """A threaded shard write: it starts when the test lets it go (``go``), tells the loop when it is
    done (``written``), and returns (its batch goes on) when the test says so (``back``); an
    ``expire`` one is let go only after its batch passed its deadline, and returns at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, expire: bool = False):
        self.loop = loop
        self.go = threading.Event()
        self.back = threading.Event()
        self.fail = ""  # "before": nothing is written; "after": the shard is, then the write fails
        self.expire = expire
        self.released = False
        self.returned = False
        self.wrote = False  # the shard file was written (set in the thread before ``written``)
        self.written = loop.create_future()
        self.thread = ""

    def release(self, fail: str) -> None:
        self.fail = fail
        self.released = True
        self.go.set()

    def open_all(self) -> None:  # a run that failed: let every thread go
        self.released = True
        self.go.set()
        self.back.set()


@dataclasses.dataclass(eq=False)
class Proc:
    """A worker process: its stream (None while it has none) and its reader, when one is blocked."""

    member_id: str
    slots: int
    conn: WorkerConn | None = None
    reader: asyncio.Task | None = None  # a submit waiting for room on its stream
    reader_conn: WorkerConn | None = None  # that stream
    batches: list = dataclasses.field(default_factory=list)  # batch ids this incarnation sent
    given_back: set = dataclasses.field(default_factory=set)  # keys an abandoned batch gave back


@dataclasses.dataclass(eq=False)
class Batch:
    """One copy of a batch as it arrived on a stream, and what became of it."""

    n: int
    proc: Proc
    conn: WorkerConn
    batch_id: str
    items: list
    invalid: list
    plan_fail: str  # its write fails (OSError): "before" writing, or "after" (say, the directory's fsync)
    plan_now: bool  # its threaded write is let go on arrival (else held until op_release)
    plan_expire: bool = False
    d: Decided | None = None
    kind: str = ""  # fresh / replay / follows
    fresh: list = dataclasses.field(default_factory=list)  # Items its decision stores
    refused: list = dataclasses.field(default_factory=list)  # refused on arrival
    threaded: bool = False
    gate: Gate | None = None
    ahead: Batch | None = None  # the batch before it in its stream's pending ones
    first: Batch | None = None  # follows: the copy it waits for
    outcome: str = ""  # committed / abandoned
    why: str = ""
    ack: Ack | None = None
    error: Exception | None = None  # what ended its stream (store failed, fenced, first copy lost)
    acks_sent: int = 0
    ends_sent: int = 0
    cut: bool = False  # its stream ended between its decision and its commit on arrival
    orphan_ok: bool = False  # abandoned while its write ran: its file may appear later

    def __repr__(self) -> str:
        return f"<{self.kind or '?'} {self.batch_id!r} #{self.n} of {self.proc.member_id} {[i.key for i in self.items]}>"

    def finished(self) -> bool:
        if self.d is not None and self.d.done is not None:
            return self.d.done.done()
        return bool(self.outcome)


@dataclasses.dataclass
class StreamLog:
    arrivals: list = dataclasses.field(default_factory=list)  # Batches decided on it, in order
    delivered: int = 0  # acks that reached the worker (before the stream's end)
    ended: bool = False  # an End went into its outbox


class Sim:
    def __init__(self, seed: int, variant: str, path) -> None:
        self.seed = seed
        self.vname = variant
        self.v = VARIANTS[variant]
        self.rng = random.Random(seed)
        self.h = Harness(state_dir=path)
        self.h.sched.keep_iterations = self.v.keep_iterations
        self.pipe = ResultPipeline(
            self.h.sched, max_pending=self.v.max_pending, store_timeout_s=self.v.store_timeout_s,
            write_threads=self.v.write_threads, threaded_write_bytes=self.v.threaded_write_bytes,
        )
        self.procs: dict[str, Proc] = {}
        self.tasks_of: dict[int, list[str]] = {}
        self.batches: list[Batch] = []
        self.batch_of: dict[Decided, Batch] = {}
        self.arriving: dict[WorkerConn, Batch] = {}
        self.streams: dict[WorkerConn, StreamLog] = {}
        self.fifo: list[Batch] = []  # threaded writes not returned yet, in the order they reach the executor
        self.storing: set = set()
        self.deciding: dict[str, Batch] = {}
        self.first_ack: dict[str, tuple[int, list]] = {}
        self.accepted: dict[tuple[int, str], Item] = {}
        self.accepted_by: dict[tuple[int, str], str] = {}
        self.refused = collections.Counter()  # (iteration, reason), "unknown" left out
        self.node_refused = collections.Counter()  # (iteration, member)
        self.sent_on: dict[str, set] = collections.defaultdict(set)  # batch id -> streams it went to
        self.items_of: dict[str, list] = {}
        self.failures: list[str] = []
        self.stats = collections.Counter()
        self.trace: list[str] = []
        self.step_no = 0
        self.next_seed = 0
        self.next_batch = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None

    # -- helpers ------------------------------------------------------------------------------

    def ctx(self, what: str) -> str:
        return f"{self.vname} seed {self.seed}, step {self.step_no}: {what}; last operations: {self.trace[-10:]}"

    def note(self, op: str) -> None:
        self.trace.append(f"{self.step_no}:{op}")

    def fail(self, what: str) -> None:
        """Record a broken promise (raising inside the pipeline's tasks would be turned into an
        InternalError); ``check`` raises the first."""
        self.failures.append(self.ctx(what))

    def its(self) -> dict:
        return self.h.sched.iterations.get(RUN, {})

    def live(self, member_id: str) -> bool:
        run = self.h.coord.runs.get(RUN)
        inc = self.h.incarnations.get(member_id)
        return run is not None and inc is not None and run.is_live(member_id, inc)

    def connected(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.conn is not None]

    def unfinished(self) -> list[Batch]:
        return [b for b in self.batches if b.d is not None and not b.finished()]

    def failure(self, p: float) -> str:
        return self.rng.choice(("before", "after")) if self.rng.random() < p else ""

    def item(self, iteration: int, task_id: str, *, big: bool = False) -> Item:
        self.next_seed += 1
        return Item(iteration, task_id, self.next_seed, BIG_TOKENS if big else self.rng.randint(1, 4))

    # -- the wrapped scheduler steps ------------------------------------------------------------

    def install(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.current_thread()
        s = self.h.sched
        self._decide, self._write, self._commit = s.decide, s.write, s.commit
        self._abandon, self._store_failed = s.abandon, s.store_failed
        s.decide, s.write, s.commit, s.abandon, s.store_failed = (
            self.decide, self.write, self.commit, self.abandon, self.store_failed)

    def expect(self, conn: WorkerConn, items: list[Item]) -> tuple[list[Item], list]:
        """What the documented rules decide for ``items`` arriving now: (stored, refused)."""
        w = conn.worker
        run = self.h.coord.runs.get(RUN)
        fenced = w.fenced or run is None or not run.is_live(w.member_id, w.incarnation)
        return expect_decision(self.its(), items, fenced=fenced, accepted=self.accepted, storing=self.storing)

    def decide(self, conn, groups, batch_id=""):
        b = self.arriving.pop(conn, None)
        if b is None:
            self.fail(f"a batch {batch_id!r} the test did not send was decided")
            return self._decide(conn, groups, batch_id)
        if len(conn.pending) >= self.pipe.max_pending:
            self.fail(f"{b} decided while {len(conn.pending)} batches of its stream wait (max_pending {self.pipe.max_pending})")
        kind = "replay" if batch_id and batch_id in self.first_ack else "follows" if batch_id in self.deciding else "fresh"
        fresh, refused = self.expect(conn, b.items) if kind == "fresh" else ([], [])
        holding = set(conn.worker.holding)
        # A re-sent batch frees a slot only where the worker's copy is over: not a running copy,
        # not being stored, of which it is a holder (one handed to it again since).
        its = self.h.sched.iterations.get(RUN, {})
        over = {}
        for item in b.items:
            task = its[item.iteration].tasks.get(item.task_id) if item.iteration in its else None
            over[item.key] = not (task is not None and task.status is RUNNING and not task.storing
                                  and conn.worker.member_id in task.holders)
        ahead = conn.pending[-1] if conn.pending else None
        d = self._decide(conn, groups, batch_id)
        b.d, b.kind = d, kind
        self.batch_of[d] = b
        self.streams[conn].arrivals.append(b)
        self.sent_on[batch_id].add(conn)
        self.stats[kind] += 1
        if (d.replay is not None, d.follows is not None) != (kind == "replay", kind == "follows"):
            self.fail(f"{b} decided as replay={d.replay is not None} follows={d.follows is not None}, expected {kind}")
        if kind == "fresh":
            stored = sorted((n, g.task_id) for n, batch in d.fresh.items() for g in batch)
            if stored != sorted(i.key for i in fresh) or d.refused != refused:
                self.fail(f"{b}: decision stores {stored} refuses {d.refused}; expected {sorted(i.key for i in fresh)}, {refused}")
        freed = []
        for item in b.items:
            if item.key in holding and (kind == "fresh" or over[item.key]):
                holding.discard(item.key)
                freed.append(item.key)
        if d.released != freed:
            self.fail(f"{b}: freed the slots of {d.released}, expected {freed}")
        b.ahead = self.batch_of.get(ahead) if ahead is not None else None
        if kind == "follows":
            b.first = self.deciding[batch_id]
            if d.follows is not b.first.d:
                self.fail(f"{b} follows another copy than {b.first}")
        if kind == "fresh":
            b.fresh, b.refused = fresh, refused
            self.storing.update(i.key for i in fresh)
            if batch_id:
                self.deciding[batch_id] = b
            for _, _, reason in refused:
                self.stats[f"refused-{reason}"] += 1
            size = sum(g.num_bytes for _, _, shard_groups in d.writes for g, _ in shard_groups)
            b.threaded = bool(d.writes) and size >= self.v.threaded_write_bytes
            if b.threaded:
                b.gate = Gate(self.loop, expire=b.plan_expire)
                if b.plan_now and not b.plan_expire:
                    b.gate.release(b.plan_fail)
                self.fifo.append(b)
        return d

    def write(self, d) -> None:
        b = self.batch_of.get(d)
        if b is None or not d.writes:
            return self._write(d)
        if threading.current_thread() is self.loop_thread:
            if b.threaded:
                self.fail(f"{b}: written on the event loop, expected in the writer thread")
            if b.plan_fail == "before":
                raise OSError(errno.EIO, "injected: the shard could not be written")
            self._write(d)
            if b.plan_fail == "after":
                raise OSError(errno.EIO, "injected: fsync of the shard's directory failed")
            return
        g = b.gate
        if g is None:
            self.fail(f"{b}: written in thread {threading.current_thread().name}, expected on the loop")
            return self._write(d)
        g.thread = threading.current_thread().name
        if not g.thread.startswith("shard-write"):
            self.fail(f"{b}: written in thread {g.thread}, not the pipeline's writer")
        if not g.go.wait(GATE_WAIT_S):
            raise OSError(errno.ETIMEDOUT, f"{b}: the test never let this write go")
        try:
            if g.fail == "before":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            self._write(d)
            g.wrote = True
            if g.fail == "after":
                raise OSError(errno.EIO, "injected: fsync of the shard's directory failed")
        finally:
            try:
                self.loop.call_soon_threadsafe(_resolve, g.written)
            except RuntimeError:  # the loop is gone (a failed run)
                pass
            if not g.expire:
                g.back.wait(GATE_WAIT_S)

    def durable_books(self) -> dict:
        """What a batch that changes nothing must leave as it was."""
        out = {}
        for n, it in self.its().items():
            c = it.counters
            out[n] = ({t: (x.status is DONE, x.done_by) for t, x in it.tasks.items()}, dict(it.shard_of),
                      (c.refused_duplicate, c.refused_fenced, c.refused_sealed, c.requeued),
                      {m: (s.done, s.refused, s.tokens) for m, s in it.nodes.items()})
        return out

    def commit(self, d):
        b = self.batch_of.get(d)
        if b is None:
            self.fail("a batch the test did not send was committed")
            return self._commit(d)
        log = self.streams[b.conn]
        before = log.arrivals[:log.arrivals.index(b)]
        if not any(x.outcome == "abandoned" for x in before) and any(not x.outcome for x in before):
            # (once a batch of the stream failed, the stream is ending: its End is queued before
            # any later ack, so a later batch may commit before an earlier one still written)
            self.fail(f"{b} commits before {[x for x in before if not x.outcome]}, which arrived before it on its stream")
        if b.kind == "follows" and not b.first.outcome:
            self.fail(f"{b} commits before its first copy {b.first} finished")
        its = self.its()
        stored, late, books, want = [], [], None, None
        if b.kind == "fresh":
            stored, late = expect_commit(its, b.fresh, accepted=self.accepted)
        else:
            books = self.durable_books()
            want = self.first_ack.get(b.batch_id)
        try:
            ack, end = self._commit(d)
        except CoordinatorUnavailableError as exc:
            if not (b.kind == "follows" and want is None):
                self.fail(f"{b}: commit raised {exc!r}")
            b.error = exc
            raise
        except BaseException as exc:
            self.fail(f"{b}: commit raised {exc!r}")
            raise
        b.outcome, b.ack = "committed", ack
        got = (ack.accepted, [tuple(r) for r in ack.refused])
        if b.kind == "fresh":
            expected = (len(stored), b.refused + late)
            if got != expected:
                self.fail(f"{b}: ack {got}, expected {expected}")
            for item in stored:
                if item.key in self.accepted:
                    self.fail(f"task {item.key} stored twice: by {self.accepted_by[item.key]} and by {b}")
                self.accepted[item.key] = item
                self.accepted_by[item.key] = b.proc.member_id
            for n, _, reason in b.refused + late:
                if reason != "unknown":
                    self.refused[(n, reason)] += 1
                    self.node_refused[(n, b.proc.member_id)] += 1
            for _, _, reason in late:
                self.stats[f"late-{reason}"] += 1
            if b.batch_id:
                self.first_ack[b.batch_id] = got
            self.storing.difference_update(i.key for i in b.fresh)
            if self.deciding.get(b.batch_id) is b:
                del self.deciding[b.batch_id]
            for item in stored:
                g = its[item.iteration].groups.get(item.task_id)
                if g is None or list(g.samples) != item.group().samples or g.node != b.proc.member_id:
                    self.fail(f"{b}: the group of {item.key} in memory is not the one sent")
            self.stats["stored"] += len(stored)
        else:
            if got != want:
                self.fail(f"re-sent {b} got {got}, its first ack was {want}")
            if self.durable_books() != books:
                self.fail(f"re-sent {b} changed the books")
        fenced = b.kind == "fresh" and d.fenced and bool(d.groups)
        if fenced != isinstance(end, FencedError) or (end is not None and not fenced):
            self.fail(f"{b}: commit ended its stream with {end!r} (fenced {d.fenced})")
        b.error = end
        return ack, end

    def abandon(self, d, why: str) -> None:
        b = self.batch_of.get(d)
        first_time = not (d.committed or d.abandoned)
        self._abandon(d, why)
        if b is None or not first_time:
            return
        if b.outcome:
            self.fail(f"{b} abandoned after it was {b.outcome}")
        b.outcome, b.why = "abandoned", why
        self.stats["abandoned"] += 1
        if b.kind == "fresh":
            self.storing.difference_update(i.key for i in b.fresh)
            if self.deciding.get(b.batch_id) is b:
                del self.deciding[b.batch_id]
        its = self.its()
        for item in b.fresh:
            it = its.get(item.iteration)
            if it is not None and it.tasks[item.task_id].storing:
                self.fail(f"{b} abandoned ({why}): {item.key} still storing")
        conn = d.conn
        if not conn.closed and self.h.sched.conns.get(RUN, {}).get(conn.worker.member_id) is conn:
            missing = [k for k in d.released if k not in conn.worker.holding]
            if missing:
                self.fail(f"{b} abandoned ({why}): {missing} not given back to its open stream")
            if b.proc.conn is conn:
                b.proc.given_back.update(d.released)
            self.stats["given-back"] += bool(d.released)
        g = b.gate
        running = g is not None and g.released and not g.written.done()
        for n, shard, _ in d.writes:
            it = its.get(n)
            if it is not None and shard in set(it.shard_of.values()):
                self.fail(f"{b} abandoned ({why}), and its shard {shard} is referenced")
            if running or (g is not None and g.expire and not g.released):
                b.orphan_ok = True  # its write finishes later: an orphan file, never referenced
            elif (self.h.store.iteration_dir(RUN, n) / shard).exists():
                self.fail(f"{b} abandoned ({why}), and its shard {shard} is left on disk")

    def store_failed(self, d, exc):
        err = self._store_failed(d, exc)
        b = self.batch_of.get(d)
        if b is not None:
            b.error = err
        return err

    def send(self, conn: WorkerConn, real_send, message) -> None:
        log = self.streams[conn]
        delivered = not conn.closed and not log.ended
        if isinstance(message, Ack):
            b = next((x for x in log.arrivals if x.ack is message), None)
            if b is None:
                self.fail(f"an ack no commit of this stream returned: {message}")
            else:
                b.acks_sent += 1
                if b.outcome != "committed" or b.acks_sent > 1:
                    self.fail(f"ack of {b} sent (outcome {b.outcome!r}, {b.acks_sent} acks)")
                if b.invalid and message.refused[-len(b.invalid):] != b.invalid:
                    self.fail(f"ack of {b} lacks its invalid groups: {message.refused}")
                if delivered:
                    k = log.delivered
                    if k >= len(log.arrivals) or log.arrivals[k] is not b:
                        self.fail(f"ack of {b} reaches the worker as the answer to "
                                  f"{log.arrivals[k] if k < len(log.arrivals) else 'nothing'} (acks out of order)")
                    log.delivered += 1
                    self.stats["acks-delivered"] += 1
        elif isinstance(message, End):
            b = next((x for x in log.arrivals if message.error is not None and x.error is message.error), None)
            if b is not None:
                b.ends_sent += 1
                if b.outcome == "abandoned":
                    if not isinstance(message.error, CoordinatorUnavailableError):
                        self.fail(f"{b} abandoned ({b.why}) ends its stream with {message.error!r}")
                elif not (b.outcome == "committed" and isinstance(message.error, FencedError) and b.acks_sent == 1):
                    self.fail(f"{b} ({b.outcome}) ends its stream with {message.error!r}")
            elif not isinstance(message.error, FencedError):  # a newer stream, or a fenced worker's grace
                self.fail(f"an End no batch explains: {message.error!r}")
            log.ended = True
        real_send(message)

    # -- driving the loop and the writer threads -------------------------------------------------

    def in_thread(self) -> list[Batch]:
        """The threaded writes a writer thread runs now (or will, once the loop hands them over):
        the executor takes them first in, first out."""
        return [b for b in self.fifo if not b.gate.returned][: self.v.write_threads]

    def can_finish(self, b: Batch, *, expire: bool) -> bool:
        """Whether ``b`` finishes with no more writes let go (``expire``: counting the deadlines)."""
        if b.finished():
            return True
        if b.d is None or b.d.done is None:
            return False
        g = b.gate
        if g is not None:
            if g.expire:
                return expire  # fails at its deadline, not waiting for the batches before it
            if not g.returned:
                return False
            if g.fail:
                return True  # fails at its write, before it waits for the batches before it
        elif b.plan_fail and b.d.writes:
            return True
        return all(x is None or self.can_finish(x, expire=expire) for x in (b.ahead, b.first))

    def reader_can_go(self, p: Proc, *, expire: bool) -> bool:
        conn = p.reader_conn
        return not conn.pending or self.can_finish(self.batch_of[conn.pending[0]], expire=expire)

    async def settle(self, *, expire: bool) -> None:
        """Run the loop until nothing moves unless the test lets a write return."""
        for _ in range(1000):
            waits = [b.gate.written for b in self.in_thread() if b.gate.released and not b.gate.written.done()]
            waits += [b.d.done for b in self.unfinished() if self.can_finish(b, expire=expire)]
            waits += [p.reader for p in self.procs.values()
                      if p.reader is not None and not p.reader.done() and self.reader_can_go(p, expire=expire)]
            if not waits:
                return
            _, late = await asyncio.wait(waits, timeout=SETTLE_TIMEOUT_S)
            if late:
                raise AssertionError(self.ctx(f"{len(late)} of {len(waits)} waits never ended: unfinished "
                                              f"{self.unfinished()}, in threads {self.in_thread()}"))
            for p in self.procs.values():
                if p.reader is not None and p.reader.done():
                    self.reader_done(p)
            for b in [b for b in self.fifo if b.gate.expire and b.gate.written.done()]:
                b.gate.returned = True
                self.fifo.remove(b)
        raise AssertionError(self.ctx("the loop kept moving"))

    async def drive(self) -> None:
        """Let the released writes return one at a time (in a random order), the loop settling after
        each; held writes that pass their deadline are waited for last."""
        while True:
            await self.settle(expire=False)
            ready = [b for b in self.in_thread() if not b.gate.expire and b.gate.written.done()]
            if ready:
                b = self.rng.choice(ready)
                b.gate.returned = True
                self.fifo.remove(b)
                b.gate.back.set()
                continue
            if any(self.can_finish(b, expire=True) for b in self.unfinished()):
                await self.settle(expire=True)
                continue
            return

    def reader_done(self, p: Proc) -> None:
        task, conn = p.reader, p.reader_conn
        p.reader = p.reader_conn = None
        if task.cancelled():
            self.arriving.pop(conn, None)
            return
        exc = task.exception()
        if exc is None:
            return
        self.arriving.pop(conn, None)
        if isinstance(exc, CoordinatorUnavailableError) and self.v.expire:
            # The oldest batch was not stored within the deadline while this one waited for room:
            # the stream ends (the worker sends them again).
            self.stats["room-deadline"] += 1
            if p.conn is conn:
                p.conn = None
                p.given_back.clear()
                self.h.sched.disconnect(conn, str(exc))
            return
        self.fail(f"the reader of {p.member_id} failed: {exc!r}")

    # -- streams ----------------------------------------------------------------------------------

    def open_stream(self, p: Proc) -> WorkerConn:
        conn = self.h.worker(p.member_id, slots=p.slots)
        conn.combined_acks = self.rng.random() < 0.3
        self.streams[conn] = StreamLog()
        conn.send = functools.partial(self.send, conn, conn.send)
        return conn

    async def end_stream(self, p: Proc, reason: str, *, abrupt: bool = True) -> None:
        """``p``'s stream ends as the servicer ends one: its reader is cancelled, then it disconnects."""
        conn, reader = p.conn, p.reader
        p.conn = None
        p.given_back.clear()
        if reader is not None and not reader.done():
            reader.cancel()
        self.h.sched.disconnect(conn, reason, abrupt=abrupt)
        if reader is not None:
            await asyncio.wait([reader])
            self.reader_done(p)

    async def op_connect(self, p: Proc | None = None) -> None:
        if p is None:
            member_id = self.rng.choice(MEMBERS)
            p = self.procs.get(member_id)
            if p is None:
                p = self.procs[member_id] = Proc(member_id, slots=self.rng.randint(1, 3))
        self.note(f"connect {p.member_id} (had a stream: {p.conn is not None}, live: {self.live(p.member_id)})")
        if not self.live(p.member_id):  # evicted (its stream broke long ago): the process joins again
            self.h.join(p.member_id)
            p.batches.clear()
            p.given_back.clear()
        old, reader = p.conn, p.reader
        p.conn = self.open_stream(p)
        if old is None:
            return
        # The old stream was told to end (a newer one opened); its reader may still read a batch the
        # worker sent on it before the servicer cancels it and disconnects the stream.
        if reader is None and self.rng.random() < 0.3 and len(old.pending) < self.pipe.max_pending:
            await self.send_batch(p, old, self.make_batch(p, old), self.new_batch_id(p), late_read=True)
        if reader is not None and not reader.done():
            reader.cancel()
        self.h.sched.disconnect(old, "replaced by a newer stream")
        if reader is not None:
            await asyncio.wait([reader])
            self.reader_done(p)

    async def op_disconnect(self) -> None:
        procs = self.connected()
        if procs:
            p = self.rng.choice(procs)
            abrupt = self.rng.random() < 0.7
            self.note(f"disconnect {p.member_id} abrupt={abrupt} (pending {len(p.conn.pending)})")
            await self.end_stream(p, "stream broke", abrupt=abrupt)

    async def op_pump(self) -> None:
        """The streams' writers: a stream whose outbox has an End ends."""
        for p in self.connected():
            if any(isinstance(m, End) for m in drain(p.conn)):
                self.note(f"pump: {p.member_id}'s stream ends")
                await self.end_stream(p, "ended by the coordinator")

    # -- batches ------------------------------------------------------------------------------

    def new_batch_id(self, p: Proc) -> str:
        if self.rng.random() < 0.05:
            return ""  # no batch id: never replayed
        self.next_batch += 1
        batch_id = f"{p.member_id}-{self.next_batch}"
        p.batches.append(batch_id)
        return batch_id

    def make_batch(self, p: Proc, conn: WorkerConn) -> list[Item]:
        rng = self.rng
        big = rng.random() < self.v.big
        held = sorted(conn.worker.holding)  # its own tasks
        items = [self.item(*key, big=big) for key in rng.sample(held, min(len(held), rng.randint(1, 3)))]
        if self.storing and rng.random() < 0.3:  # a copy of a task another batch is storing
            items.append(self.item(*rng.choice(sorted(self.storing))))
        if self.accepted and rng.random() < 0.15:  # a copy of a stored task
            items.append(self.item(*rng.choice(sorted(self.accepted))))
        sealed = [(n, t) for n, it in self.its().items() if it.sealed for t, x in it.tasks.items() if x.status is not DONE]
        if sealed and rng.random() < 0.15:  # a task of an iteration that sealed without it
            items.append(self.item(*rng.choice(sealed)))
        if self.tasks_of and rng.random() < (0.15 if self.v.late else 0.03):  # a late result: any task, or none that exists
            n = rng.choice(sorted(self.tasks_of) + [99])
            if self.v.late or n == 99:
                items.append(self.item(n, rng.choice(self.tasks_of.get(n, []) + ["t99"]), big=big))
        if items and rng.random() < 0.06:  # the same task twice
            items.append(self.item(*rng.choice(items).key))
        if not items and self.tasks_of:
            n = rng.choice(sorted(self.tasks_of))
            key = (n, rng.choice(self.tasks_of[n]))
            it = self.its().get(n)
            if self.v.late or key in self.storing or key in self.accepted or it is None or it.sealed:
                items.append(self.item(*key, big=big))
            else:
                items.append(self.item(99, "t99"))
        return items

    async def send_batch(self, p: Proc, conn: WorkerConn, items: list[Item], batch_id: str, *,
                         late_read: bool = False, expire: bool = False) -> Batch | None:
        """``conn``'s reader takes a batch (``ResultPipeline.submit``); returns it, None if its
        reader is now blocked for room."""
        rng = self.rng
        invalid = [(items[0].iteration, "bad", "invalid: test")] if items and rng.random() < 0.05 else []
        plan_now = expire or self.v.expire or rng.random() < 0.4
        b = Batch(len(self.batches), p, conn, batch_id, items, invalid,
                  plan_fail=self.failure(0.2 if plan_now else 0.0), plan_now=plan_now, plan_expire=expire)
        if batch_id and batch_id not in self.items_of:
            self.items_of[batch_id] = items
        self.batches.append(b)
        self.arriving[conn] = b
        self.note(f"send {b} on {'an old' if late_read else 'its'} stream (pending {len(conn.pending)}) "
                  f"plan fail={b.plan_fail} now={b.plan_now} expire={expire}")
        groups = [(i.iteration, i.group()) for i in items]
        task = asyncio.ensure_future(self.pipe.submit(conn, groups, batch_id, invalid))
        if len(conn.pending) >= self.pipe.max_pending:  # its reader blocks: the stream is not read
            self.stats["blocked"] += 1
            p.reader, p.reader_conn = task, conn
            return None
        if not late_read and rng.random() < 0.25:
            await asyncio.sleep(0)  # one turn: decided, and (outbox not empty) waiting to commit
            if not task.done() and rng.random() < 0.5:
                # The stream ends right there: the servicer cancels its reader and disconnects it.
                assert b.d is not None and b.d.done is not None and not b.d.done.done(), self.ctx(f"{b} not waiting")
                b.cut = True
                self.stats["cut"] += 1
                self.note(f"cut {p.member_id}'s stream before {b} committed")
                task.cancel()
                p.conn = None
                p.given_back.clear()
                self.h.sched.disconnect(conn, "stream broke")
                await asyncio.wait([task])
                if not task.cancelled() or b.outcome != "abandoned":
                    self.fail(f"{b}: cut, but {task!r}, {b.outcome!r}")
                return b
        await task
        if b.d is None:
            self.fail(f"{b}: submit returned without deciding it")
        return b

    async def op_send(self) -> None:
        procs = [p for p in self.connected() if p.reader is None]
        if procs and self.tasks_of:
            p = self.rng.choice(procs)
            await self.send_batch(p, p.conn, self.make_batch(p, p.conn), self.new_batch_id(p))

    async def op_resend(self) -> None:
        """A batch sent again under its id on a newer stream (its ack was lost, or it failed)."""
        procs = [p for p in self.connected() if p.reader is None
                 and any(p.conn not in self.sent_on[x] for x in p.batches)]
        if procs:
            p = self.rng.choice(procs)
            ids = [x for x in p.batches if p.conn not in self.sent_on[x]]
            in_flight = [x for x in ids if x in self.deciding]  # unacknowledged: what a worker re-sends first
            batch_id = self.rng.choice(in_flight if in_flight and self.rng.random() < 0.6 else ids)
            self.stats["resent"] += 1
            await self.send_batch(p, p.conn, self.items_of[batch_id], batch_id)

    async def op_release(self) -> None:
        held = [b for b in self.batches if b.gate is not None and not b.gate.released and not b.gate.expire]
        if not held:
            return
        for b in self.rng.sample(held, min(len(held), self.rng.choice((1, 1, 1, 2, 3)))):
            fail = self.failure(0.2)
            self.note(f"let {b}'s write go{f' (it fails {fail} writing)' if fail else ''}")
            b.gate.release(fail)

    async def op_expire(self) -> None:
        """A write held past its deadline, with batches behind it on its stream, maybe a copy re-sent
        on a new stream waiting for it and a reader blocked for room; then its thread finishes."""
        procs = [p for p in self.connected() if p.reader is None and not p.conn.pending and p.conn.worker.holding]
        if not procs or self.stats["expire"] >= 3:
            return
        p = self.rng.choice(procs)
        conn = p.conn
        items = [self.item(*key) for key in sorted(p.conn.worker.holding)[:2]]
        x = await self.send_batch(p, conn, items, self.new_batch_id(p), expire=True)
        if x is None or x.gate is None:
            return
        self.stats["expire"] += 1
        for _ in range(self.rng.choice((0, 1, 2))):  # batches behind it (the last may block for room)
            if p.conn is conn and p.reader is None and self.tasks_of:
                await self.send_batch(p, conn, self.make_batch(p, conn), self.new_batch_id(p))
        if x.batch_id and self.rng.random() < 0.5:  # the worker's stream breaks; it re-sends the batch
            if p.conn is conn:
                await self.end_stream(p, "stream broke")
            await self.op_connect(p)
            if p.conn is not None and p.reader is None:
                await self.send_batch(p, p.conn, x.items, x.batch_id)
        await self.drive()
        if x.outcome != "abandoned" or "not stored within" not in str(x.error):
            self.fail(f"{x} held past its deadline: {x.outcome!r}, {x.error!r}")
        x.gate.release("")  # its thread writes the shard late: an orphan, never referenced
        await self.drive()

    async def op_iteration(self) -> None:
        n = len(self.tasks_of) + 1
        deadline = self.rng.choice((0.0, 0.0, 0.0, 2.0))
        config = IterationConfig(
            deadline_s=deadline,
            min_fraction=self.rng.choice((0.0, 0.5)) if deadline else 1.0,
            backup_tasks=self.rng.choice((0, 1, 2)) if self.v.backups else 0,
        )
        count = self.rng.randint(2, 5)
        self.note(f"submit iteration {n} x{count} {config}")
        assert self.h.sched.submit(RUN, n, [spec(i) for i in range(count)], config), self.ctx("not created")
        self.tasks_of[n] = [f"t{i:02d}" for i in range(count)]

    async def op_advance(self) -> None:
        seconds = self.rng.choice((0.5, 1.0, 2.5))
        self.note(f"advance {seconds}s")
        h = self.h
        h.clock.now += seconds
        for m in self.procs:
            if self.live(m):
                h.coord.keep_alive(RUN, m, h.incarnations[m])
        h.coord.tick()
        h.sched.tick()

    async def op_tick(self) -> None:
        self.note("tick")
        self.h.sched.tick()

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        if self.failures:
            raise AssertionError(self.failures[0] + (f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""))
        its = self.its()
        deciding = self.h.sched._deciding
        assert set(deciding) == set(self.deciding) and all(deciding[k] is b.d for k, b in self.deciding.items()), self.ctx(
            f"deciding {sorted(deciding)}, expected {sorted(self.deciding)}")
        for conn, log in self.streams.items():
            # Between steps every unfinished batch with a future is in its stream's pending ones.
            want = [b.d for b in log.arrivals if b.d.done is not None and not b.finished()]
            assert list(conn.pending) == want and len(conn.pending) <= self.pipe.max_pending, self.ctx(
                f"{conn.worker.member_id}'s stream has {len(conn.pending)} batches pending: {[self.batch_of[d] for d in conn.pending]}")
        conns = self.h.sched.conns.get(RUN, {})
        for p in self.connected():
            c = p.conn
            extra = len(c.worker.holding - p.given_back)
            assert extra <= c.worker.slots or c.worker.fenced, self.ctx(
                f"{p.member_id} holds {sorted(c.worker.holding)} on {c.worker.slots} slot(s)")
        in_flight = collections.defaultdict(set)  # member -> keys an unfinished batch freed on arrival
        for b in self.unfinished():
            in_flight[b.proc.member_id].update(b.d.released)
        for n, it in its.items():
            where = f"iteration {n}"
            tally = collections.Counter(x.status for x in it.tasks.values())
            assert all(it.count(s) == tally[s] for s in TaskStatus), self.ctx(f"{where}: counts")
            done = {t for t, x in it.tasks.items() if x.status is DONE}
            model = {t for (i, t) in self.accepted if i == n}
            assert done == model, self.ctx(f"{where}: DONE {sorted(done)}, acknowledged {sorted(model)}")
            assert set(it.shard_of) == done, self.ctx(f"{where}: shard_of {sorted(it.shard_of)}")
            nodes_done, nodes_tokens = collections.Counter(), collections.Counter()
            for t in sorted(done):
                by, item = self.accepted_by[(n, t)], self.accepted[(n, t)]
                nodes_done[by] += 1
                nodes_tokens[by] += 2 * item.tokens
                assert it.tasks[t].done_by == by, self.ctx(f"{where}: {t} done by {it.tasks[t].done_by}, acknowledged to {by}")
            check_counts(it, n, nodes_done, nodes_tokens, self.node_refused, self.refused, self.ctx, where)
            for t, x in it.tasks.items():
                assert x.storing == ((n, t) in self.storing), self.ctx(f"{where}: {t} storing={x.storing}")
            if it.sealed:
                assert not tally[QUEUED] and not tally[RUNNING], self.ctx(f"{where}: sealed with work left")
                continue
            queued = [t for t in it.queue if it.tasks[t].status is QUEUED]
            assert sorted(queued) == sorted(t for t, x in it.tasks.items() if x.status is QUEUED), self.ctx(
                f"{where}: queue {list(it.queue)}, statuses {({t: x.status.name for t, x in it.tasks.items()})}")
            for t, x in it.tasks.items():
                if x.status is not RUNNING or x.storing:
                    continue
                for m in x.holders:
                    c2 = conns.get(m)
                    assert (c2 is not None and (n, t) in c2.worker.holding) or (n, t) in in_flight[m], self.ctx(
                        f"{where}: task {t} held by {m}, whose stream does not hold it")
                # A copy given back by an abandoned batch is in its stream's slots, maybe with no
                # holder any more (a refusal of another copy took it): that stream's end requeues it.
                if not (x.holders or any((n, t) in c2.worker.holding for c2 in conns.values())
                        or any((n, t) in keys for keys in in_flight.values())):
                    raise Stranded(self.ctx(f"{where}: task {t} RUNNING, not storing, not queued, and no stream or "
                                            "batch holds it: stranded (nothing requeues it)"))

    def check_end(self) -> None:
        """Everything let go and settled: nothing pending or storing; then every stream ends."""
        assert not self.unfinished() and not self.h.sched._deciding and not self.storing, self.ctx(
            f"left unfinished: {self.unfinished()}, deciding {sorted(self.h.sched._deciding)}")
        assert all(not c.pending for c in self.streams), self.ctx("batches left pending")
        assert not any(x.storing for it in self.its().values() for x in it.tasks.values()), self.ctx("tasks left storing")
        for b in self.batches:
            if b.d is None:
                continue
            assert b.outcome, self.ctx(f"{b} never finished")
            if b.outcome == "committed":
                assert b.acks_sent == 1, self.ctx(f"{b}: {b.acks_sent} acks sent")
            elif not b.cut:
                assert b.ends_sent == 1 and b.acks_sent == 0, self.ctx(f"{b} ({b.why}): {b.ends_sent} ends, {b.acks_sent} acks")

    async def end_all(self) -> None:
        for p in self.procs.values():
            if p.conn is not None:
                await self.end_stream(p, "the run is over", abrupt=False)
        self.check()
        for n, it in self.its().items():
            if not it.sealed:
                running = [t for t, x in it.tasks.items() if x.status is RUNNING]
                if running:
                    raise Stranded(self.ctx(f"iteration {n}: {running} still RUNNING with every stream ended: stranded"))

    def check_disk(self) -> None:
        self.h.store.settle()
        its = self.its()
        orphans = collections.defaultdict(set)
        for b in self.batches:
            if b.orphan_ok and b.gate is not None and b.gate.wrote:  # written after its batch was abandoned
                for n, shard, _ in b.d.writes:
                    orphans[n].add(shard)
        if not self.v.expire:
            assert not orphans, self.ctx(f"orphans {dict(orphans)} without a deadline")
        for n in self.tasks_of:
            directory = self.h.store.iteration_dir(RUN, n)
            on_disk = {p.name for p in directory.glob("shard-*")} if directory.exists() else set()
            referenced = set(its[n].shard_of.values()) if n in its else set()
            assert referenced <= on_disk and on_disk - referenced <= orphans[n], self.ctx(
                f"iteration {n}: shard files {sorted(on_disk)}, referenced {sorted(referenced)}, orphans {sorted(orphans[n])}")
            if n not in its:
                continue
            it = its[n]
            for shard in sorted(referenced):
                stored = {}
                for g, prompt in self.h.store.read_shard(RUN, n, shard):
                    assert g.task_id not in stored, self.ctx(f"iteration {n}: {g.task_id} twice in {shard}")
                    stored[g.task_id] = (g, list(prompt))
                assert sorted(stored) == sorted(t for t, s in it.shard_of.items() if s == shard), self.ctx(
                    f"iteration {n}: {shard} holds {sorted(stored)}")
                for t, (g, prompt) in stored.items():
                    item, by = self.accepted[(n, t)], self.accepted_by[(n, t)]
                    assert list(g.samples) == item.group().samples and g.node == by, self.ctx(
                        f"iteration {n}: {t} read back from {shard} is not the group {by} sent ({item})")
                    assert prompt == list(it.tasks[t].spec.prompt_ids), self.ctx(f"iteration {n}: {t}'s prompt in {shard}")

    # -- the run ------------------------------------------------------------------------------

    async def step(self) -> None:
        r = self.rng.random()
        open_its = [it for it in self.its().values() if not it.sealed]
        if not self.connected() or r < 0.07:
            await self.op_connect()
        elif (not open_its or r < 0.12) and len(open_its) < 3 and len(self.tasks_of) < 12:
            await self.op_iteration()
        elif r < 0.45:
            await self.op_send()
        elif r < 0.53:
            await self.op_resend()
        elif r < 0.66:
            await (self.op_expire() if self.v.expire and r < 0.575 else self.op_release())
        elif r < 0.78:
            await self.op_pump()
        elif r < 0.83:
            await self.op_disconnect()
        elif r < 0.88:
            await self.op_advance()
        else:
            await self.op_tick()
        await self.drive()

    async def run(self) -> None:
        self.install()
        try:
            for step_no in range(self.v.steps):
                self.step_no = step_no
                await self.step()
                self.check()
            self.step_no += 1
            self.note("the end: every held write goes")
            while held := [b for b in self.batches if b.gate is not None and not b.gate.released]:
                for b in held:  # (a reader blocked for room decides one more when they go)
                    b.gate.release(self.failure(0.15))
                await self.drive()
            self.check()
            self.check_end()
            await self.op_pump()
            await self.end_all()
            self.check_disk()
        finally:
            for b in self.batches:
                if b.gate is not None:
                    b.gate.open_all()
            if self.pipe._writer is not None:
                self.pipe._writer.shutdown(wait=not self.failures)
        self.check()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def run_sim(seed: int, variant: str, path) -> Sim:
    sim = Sim(seed, variant, path)
    asyncio.run(asyncio.wait_for(sim.run(), SCENARIO_TIMEOUT_S))
    return sim


# ("threaded-1", 0) found a bug (2 of 40 threaded-1 seeds and 3 of 40 threaded-2 did): a batch
# abandoned after its write failed left a task of it RUNNING with no holder when another copy of
# that task had been refused as a duplicate while it was stored (``abandon`` requeued only the slots
# the batch freed itself; ``commit`` drops the refused copy's holder). Its shortest form is the
# last test. ("threaded-1", 30) and ("threaded-2", 17) found its second form, with backup copies: the
# task went back to a stream that ended, the requeue saw the holder of a copy refused meanwhile, and
# that copy's commit then dropped the last holder (``commit`` now queues such a task again).
CASES = [(v, s) for v, n in (("threaded-1", 6), ("threaded-2", 6), ("mixed", 4), ("inline", 3), ("deadline", 2)) for s in range(n)]
FOUND = [("threaded-1", 30), ("threaded-2", 17)]


@pytest.fixture(autouse=True)
def _no_slow_disk_heuristic(monkeypatch):
    # A slow inline write (a loaded CI disk) would send writes to the thread for a while: a timing
    # the test does not control. The heuristic has its own tests (test_result_pipeline.py).
    monkeypatch.setattr(results, "SLOW_WRITE_S", math.inf)


@pytest.mark.parametrize(("variant", "seed"), CASES)
def test_random_result_batches_keep_the_pipelines_promises(variant, seed, tmp_path):
    sim = run_sim(seed, variant, tmp_path)
    s = sim.stats
    # The mix did what it is for: batches stored, refused, re-sent, abandoned.
    assert s["stored"] >= 15 and s["refused-duplicate"] >= 5 and s["replay"] + s["follows"] >= 1 and s["abandoned"] >= 1, s
    if variant in ("threaded-1", "mixed"):  # (inline: nothing waits; threaded-2's max_pending 3 seldom fills)
        assert s["blocked"] >= 1, s
    if variant == "deadline":
        assert s["expire"] >= 1, s


@pytest.mark.parametrize(("variant", "seed"), FOUND)
def test_the_seeds_that_found_the_second_form_keep_the_promises(variant, seed, tmp_path):
    run_sim(seed, variant, tmp_path)


def test_a_task_whose_other_copy_was_refused_while_it_was_stored_is_requeued_when_its_write_fails(tmp_path):
    """The bug the random runs found, in its shortest form: worker a's stream breaks with t00's result
    in flight, so t00 is requeued and handed to x; a re-sends the batch on a new stream (its result
    of t00 is stored: nobody's is yet) and, while that shard is written, x's result of t00 is
    refused as a duplicate (x's copy is dropped: its slot freed, its holder removed at the commit).
    Then a's write fails. Nothing held t00 any more, and nothing requeued it: not the failed batch
    (it gave back only the slots it freed, and a did not hold t00), not a's stream's end (no slot
    holds it), not a task lease (no holder); an iteration without a deadline never sealed. Now the
    abandoned batch queues it again."""
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, [spec(0), spec(1)], IterationConfig())
    a = h.worker("a", slots=1)
    assert [s.task_id for m in drain(a) for _, s, _, _ in m.items] == ["t00"]
    h.sched.disconnect(a, "connection reset")  # its result of t00 was on the way
    x = h.worker("x", slots=1)
    assert [s.task_id for m in drain(x) for _, s, _, _ in m.items] == ["t00"]
    a = h.worker("a", slots=1)
    assert [s.task_id for m in drain(a) for _, s, _, _ in m.items] == ["t01"]
    go = threading.Event()
    real = h.sched.write

    def write(d):
        if d.batch_id == "a-1":
            go.wait(10)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(d)

    h.sched.write = write
    pipe = ResultPipeline(h.sched, threaded_write_bytes=0)

    async def scenario():
        await pipe.submit(a, [(1, group("t00"))], "a-1")  # sent again on the new stream: stored (held)
        await pipe.submit(x, [(1, group("t00", seed=1))], "x-1")
        assert [(m.accepted, m.refused) for m in drain(x) if isinstance(m, Ack)] == [(0, [(1, "t00", "duplicate")])]
        go.set()
        await asyncio.wait_for(asyncio.gather(*[d.done for d in a.pending]), 10)
        assert [type(m.error) for m in drain(a) if isinstance(m, End)] == [CoordinatorUnavailableError]
        h.sched.disconnect(a, "could not store results")  # the stream ends
        h.sched.disconnect(x, "worker stopped")

    asyncio.run(asyncio.wait_for(scenario(), 20))
    it = h.it()
    assert it.tasks["t01"].status is QUEUED  # a's own task: requeued at its stream's end
    t00 = it.tasks["t00"]
    # Fails today: t00 is RUNNING, with no holder, not storing, not in the queue.
    assert t00.status is QUEUED and list(it.queue).count("t00") == 1, (t00.status, t00.holders, t00.storing, list(it.queue))
