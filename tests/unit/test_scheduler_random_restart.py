"""The rollout scheduler restarted at random points keeps every result exactly once.

Random operations on a durable ``Harness`` (a real CoordinatorCore + SchedulerCore on an injected
clock, SQLite + shard files under ``tmp_path``): iterations submitted (some with a deadline and a
``min_fraction``, some static, some with backup copies), workers connecting and disconnecting
(cleanly, abruptly, replaced by a newer stream, leaving, restarting as a new incarnation, going
quiet until their lease runs out), result batches (the worker's own tasks, late results for tasks
it no longer holds, second copies of done tasks, tasks nobody holds, the same task twice in one
batch, batches re-sent under their batch id), batches held between their decision and their commit
(as ``ResultPipeline`` holds them while the shard is written, so a restart can fall between the
shard write and the commit), releases (plain, failed, stopping), the clock moving (task leases and
member leases running out, deadlines sealing), and at random steps a RESTART: a new Harness on the
same state dir, the workers reconnecting with the incarnation they had.

A model of what the workers were told (acks) is the oracle. After every step:
  * a task is DONE exactly when one result for it was acknowledged as accepted, by its
    ``done_by``, and its group (in memory and in its shard file) has the bytes of that result;
  * no task is accepted twice, over the whole run (re-sent batches and restarts included); every
    fresh batch's ack is what the documented rules give (unknown / fenced / duplicate / sealed /
    stored), and a re-sent batch gets its first ack back and changes nothing but the copies of its
    tasks handed to its worker again since, which it gives back (a real worker, holding the
    batch's results until that ack, skips them);
  * the per-node ``done``/``tokens``/``refused`` and the refused counters match the acks;
  * DONE tasks never go back (no shard is lost here), nor change ``done_by`` or shard; a sealed
    iteration stays sealed with the same reason and the same task statuses;
  * a running copy is held by a connected worker, within its slots; a queued task is queued once.
Right after each restart, against the state just before it: the same iterations, seals, DONE tasks
(done_by, shard), requeues and failures; every unfinished task queued; the manifest equal but for
times, connected slots and running copies; the shard files on disk exactly the committed ones. What
a restart does not keep is left out on purpose: assignment counts not yet saved by a tick
(``SchedulerCore.save_counters``: "a crash loses at most one tick's counts, never a result") may
fall back, unless the crash came right after a save; leases start afresh.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random

import pytest

from elasticrl.scheduler.core import Assign, Cancel, Decided, End, WorkerConn
from elasticrl.scheduler.state import (
    RELEASE_STOPPING,
    IterationConfig,
    Policy,
    Split,
    TaskStatus,
)
from tests.unit.scheduler_harness import RUN, Clock, Harness, Item, check_counts, drain, expect_commit, expect_decision, spec

pytestmark = pytest.mark.timeout(60)

STEPS = 260
LEASE_TTL_S = 20.0
MAX_ITERATIONS = 16  # past the default --keep-iterations (8): the oldest sealed ones are dropped
MEMBERS = ("a", "b", "c", "d")

DONE, QUEUED, RUNNING = TaskStatus.DONE, TaskStatus.QUEUED, TaskStatus.RUNNING
TIME_FIELDS = ("elapsed_s", "sealed_ago_s")
# Per node: times, the connected stream's slots and the copies running now (a restart requeues them).
NODE_VOLATILE = ("node", "tasks_per_s", "slots", "running")
NODE_DEFAULT = {"assigned": 0, "done": 0, "refused": 0, "tokens": 0, "evicted": False}


@dataclasses.dataclass
class Proc:
    """A worker process: its member id, stream (None while it has none) and the tasks it runs."""

    member_id: str
    slots: int
    conn: WorkerConn | None = None
    awake: bool = True  # sends keep-alives
    known: set = dataclasses.field(default_factory=set)  # (iteration, task id) it was handed, not finished
    cancelled: set = dataclasses.field(default_factory=set)  # cancelled: a result may have crossed the cancel
    batches: list = dataclasses.field(default_factory=list)  # batch ids this incarnation sent (to send again)

    def new_incarnation(self) -> None:
        """A process that joins again starts afresh: nothing running, no batch to send again."""
        self.known.clear()
        self.cancelled.clear()
        self.batches.clear()


@dataclasses.dataclass
class Pending:
    """A batch between its decision and its commit (``ResultPipeline`` while its shard is written)."""

    d: Decided
    batch_id: str
    kind: str  # "fresh", "replay" (committed before), "follows" (its first copy is pending too)
    decided_fresh: list  # the Items its decision stores
    decided_refused: list  # (iteration, task id, reason) refused on arrival
    written: bool


@dataclasses.dataclass
class View:
    sealed: bool
    reason: str
    status: dict
    done: dict  # task id -> (done_by, shard)
    requeues: dict
    failures: dict
    manifest: dict


class Sim:
    def __init__(self, seed: int, path) -> None:
        self.seed = seed
        self.path = path
        self.rng = random.Random(seed)
        self.h = Harness(clock=Clock(now=1000.0), lease_ttl_s=LEASE_TTL_S, state_dir=path)
        self.procs: dict[str, Proc] = {}
        self.tasks_of: dict[int, list[str]] = {}  # iteration -> its task ids, as submitted
        self.dropped: set[int] = set()  # iterations the scheduler let go (retention)
        # When each iteration sealed (wall clock), as first seen: retention keeps the last to seal.
        self.sealed_wall: dict[int, float] = {}
        self.sent: dict[str, tuple[str, list[Item]]] = {}  # batch id -> (member, items)
        self.first_ack: dict[str, tuple[int, list]] = {}  # batch id -> (accepted, refused) of its commit
        self.accepted: dict[tuple[int, str], Item] = {}  # the one result accepted per task
        self.accepted_by: dict[tuple[int, str], str] = {}
        self.refused = collections.Counter()  # (iteration, reason) over first acks, "unknown" left out
        self.node_refused = collections.Counter()  # (iteration, member)
        self.pending: list[Pending] = []
        self.next_seed = 1
        self.next_batch = 0
        self.step_no = 0
        self.op = "start"
        self.trace: list[str] = []
        self.restarts = 0
        self.prev: dict[int, View] = {}
        self.shard_cache: dict = {}  # (iteration, shard) -> (stat signature, {task id: group})

    # -- helpers ------------------------------------------------------------------------------

    def ctx(self, what: str) -> str:
        return f"seed {self.seed}, step {self.step_no} ({self.op}): {what}; last operations: {self.trace[-8:]}"

    def note(self, op: str) -> None:
        self.op = op
        self.trace.append(f"{self.step_no}:{op}")

    def its(self) -> dict:
        return self.h.sched.iterations.get(RUN, {})

    def live(self, member_id: str) -> bool:
        run = self.h.coord.runs.get(RUN)
        inc = self.h.incarnations.get(member_id)
        return run is not None and inc is not None and run.is_live(member_id, inc)

    def connected(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.conn is not None]

    def storing(self) -> set:
        return {i.key for p in self.pending if p.kind == "fresh" for i in p.decided_fresh}

    def item(self, iteration: int, task_id: str) -> Item:
        self.next_seed += 1
        return Item(iteration, task_id, self.next_seed, self.rng.randint(1, 4))

    def pump(self) -> None:
        """Deliver every outbox message to its worker process; a stream sent End is ended (as the
        servicer's writer does: the stream closes, then ``disconnect``)."""
        for _ in range(20):
            any_ended = False
            for p in list(self.procs.values()):
                conn = p.conn
                if conn is None:
                    continue
                ended = False
                for m in drain(conn):
                    if isinstance(m, Assign):
                        p.known.update((i, s.task_id) for i, s, _, _ in m.items)
                    elif isinstance(m, Cancel):
                        keys = {(m.iteration, t) for t in m.task_ids}
                        p.cancelled.update(keys & p.known)
                        p.known -= keys
                    elif isinstance(m, End):
                        ended = True
                if ended:
                    self.end_stream(p, "stream ended")
                    any_ended = True
            if not any_ended:
                return
        raise AssertionError(self.ctx("streams kept ending"))

    def end_stream(self, p: Proc, reason: str, *, abrupt: bool = True) -> None:
        """``p``'s stream ends (the servicer then calls ``disconnect`` once)."""
        self.h.sched.disconnect(p.conn, reason, abrupt=abrupt)
        p.conn = None

    def ended(self, conn: WorkerConn, end) -> None:
        """A batch's answer ended its stream (fenced): if it is still the worker's stream, it closes."""
        if end is None:
            return
        p = self.procs[conn.worker.member_id]
        if p.conn is conn:
            self.end_stream(p, str(end))

    # -- operations ---------------------------------------------------------------------------

    def op_submit(self) -> None:
        n = max(self.tasks_of, default=0) + self.rng.choice((1, 1, 1, 2))
        count = self.rng.randint(1, 5)
        deadline = self.rng.choice((0.0, 0.0, 8.0, 15.0, 40.0))
        config = IterationConfig(
            policy=Policy.STATIC if self.rng.random() < 0.2 else Policy.DYNAMIC,
            deadline_s=deadline,
            min_fraction=self.rng.choice((0.5, 0.75, 1.0)) if deadline else 1.0,
            task_lease_s=self.rng.choice((12.0, 25.0, 600.0)),
            backup_tasks=self.rng.choice((0, 0, 1, 2)),
            max_task_failures=self.rng.choice((1, 2, 3)),
        )
        self.note(f"submit {n} x{count} {config}")
        created = self.h.sched.submit(RUN, n, [spec(i) for i in range(count)], config)
        assert created is True, self.ctx("a new iteration was not created")
        self.tasks_of[n] = [f"t{i:02d}" for i in range(count)]

    def op_resubmit(self) -> None:
        kept = sorted(n for n in self.tasks_of if n not in self.dropped)
        if not kept:
            return
        n = self.rng.choice(kept)
        self.note(f"resubmit {n}")
        before = self.view()
        created = self.h.sched.submit(RUN, n, [spec(i) for i in range(len(self.tasks_of[n]))], IterationConfig())
        assert created is False, self.ctx("submitting the same tasks again was not a no-op")
        assert self.view()[n].done == before[n].done, self.ctx("a resubmit changed the done tasks")

    def connect(self, p: Proc) -> None:
        if not self.live(p.member_id):  # evicted or left: the process joins again (a new incarnation)
            self.h.join(p.member_id)
            p.new_incarnation()
        old = p.conn
        # Most hellos name what the process runs (the tasks it was handed and has not finished),
        # as a RolloutWorker's does; some say nothing, as an older worker's.
        running = sorted(p.known) if self.rng.random() < 0.7 else None
        p.conn = self.h.worker(p.member_id, slots=p.slots, running=running)
        if old is not None:  # the old stream ends (told so by the core): the servicer disconnects it
            drain(old)
            self.h.sched.disconnect(old, "replaced by a newer stream")

    def op_connect(self) -> None:
        member_id = self.rng.choice(MEMBERS)
        p = self.procs.get(member_id)
        if p is None:
            p = self.procs[member_id] = Proc(member_id, slots=self.rng.randint(1, 3))
        self.note(f"connect {member_id} (slots {p.slots}, had a stream: {p.conn is not None}, live: {self.live(member_id)})")
        p.awake = True
        self.connect(p)

    def op_disconnect(self) -> None:
        procs = self.connected()
        if not procs:
            return
        p = self.rng.choice(procs)
        abrupt = self.rng.random() < 0.5
        self.note(f"disconnect {p.member_id} abrupt={abrupt}")
        self.h.sched.disconnect(p.conn, "test", abrupt=abrupt)
        p.conn = None

    def op_rejoin(self) -> None:
        """The worker process restarted: a new incarnation (the old stream is fenced, then breaks)."""
        procs = [p for p in self.procs.values() if self.live(p.member_id)]
        if not procs:
            return
        p = self.rng.choice(procs)
        self.note(f"rejoin {p.member_id}")
        self.h.join(p.member_id)
        if p.conn is not None:
            drain(p.conn)
            self.h.sched.disconnect(p.conn, "process restarted")
            p.conn = None
        p.new_incarnation()
        p.slots = self.rng.randint(1, 3)
        p.awake = True
        if self.rng.random() < 0.7:
            self.connect(p)

    def op_leave(self) -> None:
        procs = [p for p in self.procs.values() if self.live(p.member_id)]
        if not procs:
            return
        p = self.rng.choice(procs)
        self.note(f"leave {p.member_id}")
        self.h.coord.leave(RUN, p.member_id, self.h.incarnations[p.member_id], "done")
        if p.conn is not None:
            drain(p.conn)
            self.h.sched.disconnect(p.conn, "left", abrupt=False)
            p.conn = None

    def op_sleep(self) -> None:
        if not self.procs:
            return
        p = self.procs[self.rng.choice(sorted(self.procs))]
        p.awake = not p.awake
        self.note(f"{p.member_id} awake={p.awake}")

    def op_advance(self) -> None:
        seconds = self.rng.choice((0.2, 1.0, 5.0, 12.0, 25.0))
        awake = tuple(m for m, p in self.procs.items() if p.awake)
        self.note(f"advance {seconds} awake={awake}")
        # ``Harness.advance``, but a member evicted on the way (its stream broke) sends no more
        # keep-alives: they would be refused.
        h, left = self.h, seconds
        while left > 1e-9:
            d = min(5.0, left)
            h.clock.now += d
            left -= d
            for m in awake:
                if self.live(m):
                    h.coord.keep_alive(RUN, m, h.incarnations[m])
            h.coord.tick()
            h.sched.tick()

    def op_release(self) -> None:
        procs = [p for p in self.connected() if p.conn.worker.holding] or self.connected()
        if not procs:
            return
        p = self.rng.choice(procs)
        held = sorted(p.conn.worker.holding)
        if held:
            n = self.rng.choice(held)[0]
            ids = [t for i, t in held if i == n]
            ids = self.rng.sample(ids, self.rng.randint(1, len(ids)))
        else:
            n = self.rng.choice(sorted(self.tasks_of) or [1])
            ids = [self.rng.choice(self.tasks_of.get(n, ["t00"]))]
        failed = self.rng.random() < 0.4
        reason = RELEASE_STOPPING if self.rng.random() < 0.05 else "engine error"
        self.note(f"release {p.member_id} {n} {ids} failed={failed} reason={reason!r}")
        self.h.sched.release(p.conn, n, ids, reason, failed=failed, env_errors=1 if failed else 0)
        p.known.difference_update((n, t) for t in ids)

    def make_batch(self, p: Proc) -> list[Item]:
        items: list[Item] = []
        held = sorted(p.conn.worker.holding)
        if held:
            for key in self.rng.sample(held, self.rng.randint(0, min(3, len(held)))):
                items.append(self.item(*key))
        late = sorted(p.known - p.conn.worker.holding)
        if late and self.rng.random() < 0.4:  # a task it ran on an older stream, or whose lease expired
            items.append(self.item(*self.rng.choice(late)))
        if p.cancelled and self.rng.random() < 0.3:  # finished as its cancel was on the way
            key = self.rng.choice(sorted(p.cancelled))
            p.cancelled.discard(key)
            items.append(self.item(*key))
        if self.accepted and self.rng.random() < 0.2:  # a second copy of a done task
            items.append(self.item(*self.rng.choice(sorted(self.accepted))))
        if self.tasks_of and self.rng.random() < 0.15:  # any task at all, or none that exists
            n = self.rng.choice(sorted(self.tasks_of) + [99])
            items.append(self.item(n, self.rng.choice(self.tasks_of.get(n, []) + ["t99"])))
        if items and self.rng.random() < 0.1:  # the same task twice in one batch
            items.append(self.item(*self.rng.choice(items).key))
        if not items and self.tasks_of:
            n = self.rng.choice(sorted(self.tasks_of))
            items.append(self.item(n, self.rng.choice(self.tasks_of[n])))
        return items

    def expect(self, conn: WorkerConn, items: list[Item]) -> tuple[list[Item], list[tuple[int, str, str]]]:
        """What the documented rules decide for ``items`` arriving now: (stored, refused)."""
        w = conn.worker
        fenced = w.fenced or not self.h.coord.runs[RUN].is_live(w.member_id, w.incarnation)
        return expect_decision(self.its(), items, fenced=fenced, accepted=self.accepted, storing=self.storing())

    def record(self, batch_id: str, member_id: str, fresh: list[Item], refused: list, ack) -> None:
        """The first ack of a batch: what it stored and refused becomes the model's."""
        got = (ack.accepted, [tuple(r) for r in ack.refused])
        assert got == (len(fresh), refused), self.ctx(
            f"batch {batch_id!r} of {member_id}: ack {got}, expected {(len(fresh), refused)} "
            f"(stored {[i.key for i in fresh]})")
        for item in fresh:
            assert item.key not in self.accepted, self.ctx(
                f"task {item.key} accepted twice: first {self.accepted[item.key]} by {self.accepted_by[item.key]}, "
                f"again {item} by {member_id} (batch {batch_id!r})")
            self.accepted[item.key] = item
            self.accepted_by[item.key] = member_id
        for n, _, reason in refused:
            if reason != "unknown":
                self.refused[(n, reason)] += 1
                self.node_refused[(n, member_id)] += 1
        if batch_id:
            self.first_ack[batch_id] = got

    def durable_books(self) -> dict:
        """What a batch that changes nothing must leave as it was."""
        out = {}
        for n, it in self.its().items():
            c = it.counters
            out[n] = ({t: (x.status is DONE, x.done_by) for t, x in it.tasks.items()}, dict(it.shard_of),
                      (c.refused_duplicate, c.refused_fenced, c.refused_sealed, c.requeued),
                      {m: (s.done, s.refused, s.tokens) for m, s in it.nodes.items() if (s.done, s.refused, s.tokens) != (0, 0, 0)})
        return out

    def handed_again(self, conn: WorkerConn, items: list[Item]) -> tuple[set, dict]:
        """What answering a re-sent batch on ``conn`` now gives back: each of its tasks still
        counted on the worker's current stream, or still held by the worker (handed to it again
        since the batch was first sent: a real worker, holding the batch's results, skipped it),
        and per iteration how many of them are queued again (running, not being stored, no other
        copy left)."""
        member_id = conn.worker.member_id
        if not conn.reports_running or conn.closed or self.h.sched.conns.get(RUN, {}).get(member_id) is not conn:
            return set(), {}  # (a worker whose hello does not say what runs may run them: kept)
        keys = set()
        for item in items:
            it = self.its().get(item.iteration)
            task = it.tasks.get(item.task_id) if it is not None else None
            if item.key in conn.worker.holding or (task is not None and member_id in task.holders):
                keys.add(item.key)
        requeued, storing = collections.Counter(), self.storing()
        for n, t in keys:
            it = self.its().get(n)
            task = it.tasks.get(t) if it is not None else None
            if (task is not None and not it.sealed and task.status is RUNNING and (n, t) not in storing
                    and (n, t) not in self.accepted and set(task.holders) <= {member_id}):
                requeued[n] += 1
        return keys, requeued

    def replayed(self, p: Proc | None, conn: WorkerConn, batch_id: str, ack, books: dict, handed: tuple[set, dict]) -> None:
        """A re-sent batch got its first ack back and changed nothing but the copies it gave back."""
        got = (ack.accepted, [tuple(r) for r in ack.refused])
        assert got == self.first_ack[batch_id], self.ctx(
            f"re-sent batch {batch_id!r} got {got}, its first ack was {self.first_ack[batch_id]}")
        keys, requeued = handed
        for n, count in requeued.items():
            statuses, shards, (dup, fenced, sealed, requeues), nodes = books[n]
            books[n] = (statuses, shards, (dup, fenced, sealed, requeues + count), nodes)
        assert self.durable_books() == books, self.ctx(f"re-sent batch {batch_id!r} changed the books (gave back {sorted(keys)})")
        for n, t in sorted(keys):
            task = self.its()[n].tasks[t]
            assert (n, t) not in conn.worker.holding and conn.worker.member_id not in task.holders, self.ctx(
                f"re-sent batch {batch_id!r}: the copy of {(n, t)} handed to its worker again was not given back")
        if p is not None:
            p.known -= keys  # it skipped them: it held their results

    def send(self, p: Proc, items: list[Item], batch_id: str, *, hold: bool) -> None:
        conn = p.conn
        if batch_id and batch_id not in self.sent:
            self.sent[batch_id] = (p.member_id, items)
            p.batches.append(batch_id)
        p.known.difference_update(i.key for i in items)
        groups = [(i.iteration, i.group()) for i in items]
        in_flight = any(x.batch_id == batch_id and x.kind == "fresh" for x in self.pending) if batch_id else False
        kind = "replay" if batch_id in self.first_ack else "follows" if in_flight else "fresh"
        if kind == "fresh":
            fresh, refused = self.expect(conn, items)
        else:
            fresh, refused = [], []
        if kind == "follows":
            hold = True  # it waits for its first copy's commit (``ResultPipeline._finish``)
        self.note(f"{'decide' if hold else 'accept'} {p.member_id} batch {batch_id!r} ({kind}) "
                  f"{[(i.iteration, i.task_id, i.seed) for i in items]}")
        if not hold:
            books = self.durable_books() if kind == "replay" else None
            handed = self.handed_again(conn, items) if kind == "replay" else None
            ack, end = self.h.sched.accept(conn, groups, batch_id)
            assert ack is not None, self.ctx(f"no ack ({end!r})")
            if kind == "replay":
                self.replayed(p, conn, batch_id, ack, books, handed)
            else:
                self.record(batch_id, p.member_id, fresh, refused, ack)
            self.check_groups_in_memory(fresh)
            self.ended(conn, end)  # fenced: the stream ends after the ack
            return
        d = self.h.sched.decide(conn, groups, batch_id)
        assert (d.replay is not None, d.follows is not None) == (kind == "replay", kind == "follows"), self.ctx(
            f"batch {batch_id!r} decided as replay={d.replay is not None} follows={d.follows is not None}, expected {kind}")
        if kind == "fresh":
            stored = [(n, g.task_id) for n, batch in d.fresh.items() for g in batch]
            assert sorted(stored) == sorted(i.key for i in fresh) and d.refused == refused, self.ctx(
                f"decision stores {stored} refuses {d.refused}; expected {[i.key for i in fresh]}, {refused}")
        written = self.rng.random() < 0.5
        if written:
            self.h.sched.write(d)
        self.pending.append(Pending(d, batch_id, kind, fresh, refused, written))

    def op_accept(self, *, hold: bool = False) -> None:
        procs = self.connected()
        if not procs or not self.tasks_of:
            return
        p = self.rng.choice(procs)
        items = self.make_batch(p)
        batch_id = ""
        if self.rng.random() < 0.85:
            self.next_batch += 1
            batch_id = f"{p.member_id}-{self.next_batch}"
        self.send(p, items, batch_id, hold=hold)

    def op_resend(self) -> None:
        """A batch sent again under its id: after its ack was lost, a broken stream or a restart."""
        procs = [p for p in self.connected() if p.batches]
        if not procs:
            return
        p = self.rng.choice(procs)
        # Often one with a task handed to the worker again since (a copy the worker skipped).
        again = [b for b in p.batches if any(i.key in p.conn.worker.holding for i in self.sent[b][1])]
        batch_id = self.rng.choice(again if again and self.rng.random() < 0.5 else p.batches)
        member_id, items = self.sent[batch_id]
        assert member_id == p.member_id
        self.send(p, items, batch_id, hold=self.rng.random() < 0.3)

    def op_commit(self) -> None:
        """The oldest held batch is committed (in arrival order, as the pipeline does per stream; a
        re-sent copy after its first)."""
        if not self.pending:
            return
        x = self.pending.pop(0)
        self.note(f"commit batch {x.batch_id!r} ({x.kind}) of {x.d.conn.worker.member_id}, written before: {x.written}")
        if not x.written:
            self.h.sched.write(x.d)
        books = self.durable_books() if x.kind != "fresh" else None
        handed = self.handed_again(x.d.conn, self.sent[x.batch_id][1]) if x.kind != "fresh" else None
        # Between the decision and the commit the iteration may have sealed or been dropped (as it
        # stands before the commit: the commit itself may seal it).
        stored, late = expect_commit(self.its(), x.decided_fresh, accepted=self.accepted)
        ack, end = self.h.sched.commit(x.d)
        assert ack is not None, self.ctx(f"no ack ({end!r})")
        if x.kind != "fresh":
            owner = next((p for p in self.procs.values() if p.conn is x.d.conn), None)
            self.replayed(owner, x.d.conn, x.batch_id, ack, books, handed)
        else:
            self.record(x.batch_id, x.d.conn.worker.member_id, stored, x.decided_refused + late, ack)
            self.check_groups_in_memory(stored)
        self.ended(x.d.conn, end)

    def op_restart(self) -> None:
        clean = self.rng.random() < 0.5
        lost = [(x.batch_id, x.kind, x.written) for x in self.pending]
        self.note(f"RESTART clean={clean} losing {lost}")
        if clean:  # right after a tick saved the assignment counts
            self.h.sched.save_counters()
        self.note_seals()
        before = self.view()
        old = self.h
        old.store.settle()  # a dropped iteration's files retired (a thread): deterministic
        old.coord.db.close()
        now = self.rng.choice((5.0, 1000.0, 1e6))
        gap = self.rng.choice((0.5, 3.0, 20.0))
        self.h = Harness(clock=Clock(now=now, wall_offset=old.clock.wall() + gap - now),
                         lease_ttl_s=LEASE_TTL_S, state_dir=self.path)
        self.h.incarnations = dict(old.incarnations)
        self.pending.clear()  # died with the process: the workers send them again
        self.restarts += 1
        self.compare_restart(before, self.view(), clean)
        self.check_disk()
        for p in self.procs.values():
            had = p.conn is not None
            p.conn = None
            if had and self.rng.random() < 0.8:
                self.connect(p)

    # -- invariants ---------------------------------------------------------------------------

    def view(self) -> dict[int, View]:
        out = {}
        for n, it in self.its().items():
            out[n] = View(
                sealed=it.sealed, reason=it.seal_reason,
                status={t: x.status for t, x in it.tasks.items()},
                done={t: (x.done_by, it.shard_of.get(t)) for t, x in it.tasks.items() if x.status is DONE},
                requeues={t: x.requeues for t, x in it.tasks.items()},
                failures={t: x.failures for t, x in it.tasks.items()},
                manifest=self.h.sched.manifest(it),
            )
        return out

    def note_seals(self) -> None:
        offset = self.h.clock.wall() - self.h.clock()
        for n, it in self.its().items():
            if it.sealed and n not in self.sealed_wall:
                self.sealed_wall[n] = it.sealed_at + offset

    def sealed_no_later(self, gone: list[int], kept: list[int]) -> bool:
        """Every iteration of ``gone`` sealed no later than every one of ``kept`` (a tie either way)."""
        return not gone or not kept or max(self.sealed_wall[n] for n in gone) <= min(self.sealed_wall[n] for n in kept) + 1e-6

    def compare_restart(self, before: dict[int, View], after: dict[int, View], clean: bool) -> None:
        gone = sorted(set(before) - set(after))
        assert set(after) <= set(before), self.ctx(f"iterations {sorted(set(after) - set(before))} appeared")
        # Only retention may drop one at start-up (a trim the last tick had not done yet).
        kept_sealed = sorted(n for n in after if after[n].sealed)
        for n in gone:
            assert before[n].sealed and kept_sealed and self.sealed_no_later([n], kept_sealed), self.ctx(
                f"iteration {n} lost in the restart")
        for n, a in after.items():
            b = before[n]
            where = f"iteration {n} across the restart"
            assert (a.sealed, a.reason) == (b.sealed, b.reason), self.ctx(f"{where}: seal {(b.sealed, b.reason)} -> {(a.sealed, a.reason)}")
            assert a.done == b.done, self.ctx(f"{where}: done {b.done} -> {a.done}")
            want = {t: QUEUED if s in (QUEUED, RUNNING) else s for t, s in b.status.items()}
            assert a.status == want, self.ctx(f"{where}: statuses {b.status} -> {a.status}")
            assert a.requeues == b.requeues, self.ctx(f"{where}: requeues {b.requeues} -> {a.requeues}")
            assert a.failures == b.failures, self.ctx(f"{where}: failures {b.failures} -> {a.failures}")
            mb, ma = self.durable_manifest(b.manifest), self.durable_manifest(a.manifest)
            if clean:
                assert ma == mb, self.ctx(f"{where}: manifest {mb} -> {ma}")
                continue
            # Unsaved assignment counts may fall back, nothing else.
            nb, na = mb.pop("nodes"), ma.pop("nodes")
            bb, ba = mb.pop("backups_issued"), ma.pop("backups_issued")
            assert ma == mb and ba <= bb, self.ctx(f"{where}: manifest {mb} -> {ma}, backups {bb} -> {ba}")
            for m in sorted(set(nb) | set(na)):
                x, y = dict(nb.get(m, NODE_DEFAULT)), dict(na.get(m, NODE_DEFAULT))
                assigned_b, assigned_a = x.pop("assigned"), y.pop("assigned")
                assert y == x and assigned_a <= assigned_b, self.ctx(f"{where}: node {m} {nb.get(m)} -> {na.get(m)}")

    @staticmethod
    def durable_manifest(m: dict) -> dict:
        m = {k: v for k, v in m.items() if k not in TIME_FIELDS}
        m["tasks_unfinished"] = m.pop("tasks_queued") + m.pop("tasks_running")  # a restart queues the running ones
        m["nodes"] = {n["node"]: {k: v for k, v in n.items() if k not in NODE_VOLATILE} for n in m["nodes"]}
        return m

    def check_groups_in_memory(self, items: list[Item]) -> None:
        for item in items:
            it = self.its().get(item.iteration)
            if it is None or item.task_id not in it.groups:
                continue
            g = it.groups[item.task_id]
            assert list(g.samples) == item.group().samples, self.ctx(f"task {item.key}: the group in memory is not the one accepted")

    def stored_groups(self, n: int, shard: str) -> dict:
        path = self.h.store.iteration_dir(RUN, n) / shard
        st = os.stat(path)
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self.shard_cache.get((n, shard))
        if cached is None or cached[0] != sig:
            groups: dict = {}
            for g, _ in self.h.store.read_shard(RUN, n, shard):
                groups.setdefault(g.task_id, []).append(g)
            cached = self.shard_cache[(n, shard)] = (sig, groups)
        return cached[1]

    def check(self) -> None:
        self.note_seals()
        its = self.its()
        for n in self.tasks_of:
            if n not in its and n not in self.dropped:
                assert n in self.prev and self.prev[n].sealed, self.ctx(f"iteration {n} is gone, and it was not sealed")
                self.dropped.add(n)
        assert not self.dropped & set(its), self.ctx(f"dropped iterations {sorted(self.dropped & set(its))} are back")
        kept_sealed = sorted(n for n, it in its.items() if it.sealed)
        assert self.sealed_no_later(sorted(self.dropped), kept_sealed), self.ctx(
            f"dropped {sorted(self.dropped)} while ones that sealed before them are kept {kept_sealed}")
        storing = self.storing()
        conns = self.h.sched.conns.get(RUN, {})
        for c in conns.values():
            assert len(c.worker.holding) <= c.worker.slots or c.worker.fenced, self.ctx(
                f"{c.worker.member_id} holds {sorted(c.worker.holding)} on {c.worker.slots} slot(s)")
        now = self.view()
        for n, it in its.items():
            v, prev = now[n], self.prev.get(n)
            where = f"iteration {n}"
            assert [t for t in it.tasks] == self.tasks_of[n], self.ctx(f"{where}: tasks {list(it.tasks)}")
            tally = collections.Counter(x.status for x in it.tasks.values())
            assert all(it.count(s) == tally[s] for s in TaskStatus), self.ctx(f"{where}: counts {it.tasks.tally} != {tally}")
            done_model = {t for (i, t) in self.accepted if i == n}
            assert set(v.done) == done_model, self.ctx(f"{where}: DONE {sorted(v.done)}, acknowledged {sorted(done_model)}")
            nodes_done, nodes_tokens = collections.Counter(), collections.Counter()
            for t in sorted(done_model):
                item, by = self.accepted[(n, t)], self.accepted_by[(n, t)]
                nodes_done[by] += 1
                nodes_tokens[by] += 2 * item.tokens
                done_by, shard = v.done[t]
                assert done_by == by and shard, self.ctx(f"{where}: task {t} done by {done_by!r} in {shard!r}, accepted from {by}")
                want = item.group().samples
                if t in it.groups:
                    assert list(it.groups[t].samples) == want and it.groups[t].node == by, self.ctx(
                        f"{where}: task {t}: the group in memory is not the one accepted ({item})")
                stored = self.stored_groups(n, shard).get(t, [])
                assert len(stored) == 1 and list(stored[0].samples) == want and stored[0].node == by, self.ctx(
                    f"{where}: task {t}: shard {shard} holds {stored}, not the group accepted ({item})")
            assert set(it.shard_of) == set(v.done), self.ctx(f"{where}: shard_of {sorted(it.shard_of)} vs done {sorted(v.done)}")
            check_counts(it, n, nodes_done, nodes_tokens, self.node_refused, self.refused, self.ctx, where)
            for t, x in it.tasks.items():
                assert x.storing == ((n, t) in storing), self.ctx(f"{where}: task {t} storing={x.storing}")
            if it.sealed:
                assert not it.queue and not it.shares and not tally[QUEUED] and not tally[RUNNING], self.ctx(
                    f"{where}: sealed ({it.seal_reason}) with work left: {v.status}")
            else:
                # Every queued task once in the queue (or a static share); other entries are tasks
                # done meanwhile (a late result), which a dispatch skips.
                queued = [t for t in [*it.queue, *(t for share in it.shares.values() for t in share)] if v.status[t] is QUEUED]
                assert sorted(queued) == sorted(t for t, s in v.status.items() if s is QUEUED), self.ctx(
                    f"{where}: queued {list(it.queue)} {it.shares}, statuses {v.status}")
                for t, x in it.tasks.items():
                    if x.status is RUNNING and not x.storing:
                        assert x.holders, self.ctx(f"{where}: task {t} running with no holder")
                        for m in x.holders:
                            c2 = conns.get(m)
                            assert c2 is not None and (n, t) in c2.worker.holding, self.ctx(
                                f"{where}: task {t} held by {m}, whose stream does not hold it")
            if prev is not None:
                for t, (done_by, shard) in prev.done.items():
                    assert v.done.get(t) == (done_by, shard), self.ctx(
                        f"{where}: task {t} was done by {done_by} in {shard}, now {v.done.get(t)} ({v.status[t]})")
                if prev.sealed:
                    assert (v.sealed, v.reason) == (True, prev.reason), self.ctx(
                        f"{where}: sealed ({prev.reason}), now {(v.sealed, v.reason)}")
                    assert v.status == prev.status, self.ctx(f"{where}: a sealed iteration's tasks changed {prev.status} -> {v.status}")
        self.prev = now

    def check_disk(self) -> None:
        """After a start-up: each iteration's shard files are exactly its committed ones."""
        self.h.store.settle()  # a retention drop at start-up retires its files in a thread
        its = self.its()
        for n in self.tasks_of:
            directory = self.h.store.iteration_dir(RUN, n)
            on_disk = {p.name for p in directory.glob("shard-*")} if directory.exists() else set()
            want = set(its[n].shard_of.values()) if n in its else set()
            assert on_disk == want, self.ctx(f"iteration {n}: shard files {sorted(on_disk)}, committed {sorted(want)}")

    def check_fetch(self) -> None:
        """A trainer's fetch of every sealed iteration returns exactly its accepted groups."""
        for n, it in self.its().items():
            if not it.sealed:
                continue
            got = {g.task_id: g for g, _ in self.h.sched.shard(RUN, n, 0, 1, Split.TRAIN)}
            want = {t: item for (i, t), item in self.accepted.items() if i == n}
            assert sorted(got) == sorted(want), self.ctx(f"iteration {n}: fetched {sorted(got)}, accepted {sorted(want)}")
            for t, item in want.items():
                assert list(got[t].samples) == item.group().samples and got[t].node == self.accepted_by[(n, t)], self.ctx(
                    f"iteration {n}: fetched group of {t} is not the one accepted")

    # -- the run ------------------------------------------------------------------------------

    def step(self) -> None:
        r = self.rng.random()
        open_its = [it for it in self.its().values() if not it.sealed]
        if not self.procs or r < 0.06:
            self.op_connect()
        elif (not open_its or r < 0.12) and len(self.tasks_of) < MAX_ITERATIONS and len(open_its) < 3:
            self.op_submit()
        elif r < 0.42:
            self.op_accept()
        elif r < 0.48:
            self.op_accept(hold=True)
        elif r < 0.56:
            self.op_commit()
        elif r < 0.63:
            self.op_resend()
        elif r < 0.69:
            self.op_release()
        elif r < 0.82:
            self.op_advance()
        elif r < 0.85:
            self.op_disconnect()
        elif r < 0.88:
            self.op_sleep()
        elif r < 0.89:
            self.op_rejoin()
        elif r < 0.897:
            self.op_leave()
        elif r < 0.905:
            self.op_resubmit()
        elif r < 0.96:
            self.op_restart()
        else:
            self.note("tick")
            self.h.sched.tick()

    def run(self, steps: int) -> None:
        for self.step_no in range(steps):
            self.step()
            self.pump()
            self.check()
        while self.pending:  # the last held batches commit
            self.op_commit()
            self.pump()
            self.check()
        self.step_no += 1
        self.op_restart()
        self.check()
        self.check_fetch()


# 813 found a bug (9 of seeds 0-999 did, the same one; this one at step 17): c's batch with
# iteration 4's t00 is decided (t00 storing); a's batch "a-5" with t00 is refused as a duplicate and
# committed; a restart loses c's batch, so t00 is queued again and handed to a when it reconnects;
# a sends "a-5" again (its ack was lost), and the replay freed a's slot of t00 (``decide`` freed the
# slots of a re-sent batch's tasks too): t00 stayed RUNNING held by a while a's stream did not hold
# it, a was handed a task beyond its slots, and a's stream closing did not requeue t00.
# 72, 133 and 187 (three of the four of seeds 0-399 that do): a re-sent batch gives back a copy of
# its task that was handed to its worker again since (``ResultBook._give_back_handed_again``).
SEEDS = [*range(8), 72, 133, 187, 813]


@pytest.mark.parametrize("seed", SEEDS)
def test_results_stay_exactly_once_and_durable_across_random_restarts(seed, tmp_path):
    sim = Sim(seed, tmp_path)
    sim.run(STEPS)
    # The mix did what it is for: restarts, results stored and refused, batches sent again.
    assert sim.restarts >= 5, sim.restarts
    assert len(sim.accepted) >= 10 and sum(sim.refused.values()) >= 3, (len(sim.accepted), sim.refused)
