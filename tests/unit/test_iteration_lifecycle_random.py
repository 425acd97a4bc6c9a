"""An iteration's life as the trainer sees it, at random: submitted, results coming in, sealed
(every task done, every task done or given up, or the deadline with ``min_fraction`` done),
fetched, dropped by retention (``--keep-iterations``), across coordinator restarts.

Random operations on a durable ``Harness`` (a real CoordinatorCore + SchedulerCore on an
injected clock, SQLite and shard files under ``tmp_path``, no event loop but for the trainer's
``wait_sealed``, no sleeps): iterations submitted (train and eval tasks, deadlines with
``min_fraction`` 0, 0.5 or 1, static or dynamic, backup copies, 1-3 failures allowed per task),
submitted again (a no-op; or, once retention dropped the number, anew, as by a trainer resumed
from an older checkpoint), workers connecting (and replacing their stream) and disconnecting,
result batches (the worker's own tasks, late results for tasks of open, sealed and dropped
iterations, second copies of done tasks), releases (plain and failed), the clock moving (ticks:
deadlines seal, retention drops), an iteration finished with the trainer waiting on
``wait_sealed``, the trainer fetching any iteration (sealed, open, dropped, never submitted) with a
random world size and split, and at random steps a RESTART: a new process on the same state dir,
its ``--keep-iterations`` sometimes changed, after a wall-clock gap that counts toward deadlines.

The model is what the trainer was told: the acks (which results were accepted), its own submits and
releases, the clock. Checked against it:
  * every ack is what the documented rules give (``expect_decision``): after the seal a result is
    refused ("sealed", "duplicate"), after the drop it is "unknown": never added;
  * an iteration seals exactly when the model says it is due (at a commit, a given-up release, or
    a tick for the deadline), with the matching reason; it keeps the results acked before its
    seal, the rest of its tasks DROPPED (or FAILED), and no task of it is handed out afterwards
    (nor held by any worker), also after a restart;
  * a sealed iteration's fetch (each split, every rank of a random world size) gives exactly its
    results acked before the seal, each once, with the bytes sent and the node that sent them, the
    same before and after every restart; an open one raises NotReadyError; a dropped or never
    submitted one NotFoundError, never a partial answer;
  * retention keeps the ``keep_iterations`` sealed iterations that sealed last (a restart orders what
    it loads by their seal times) from the tick after a seal, or from the start-up; a dropped iteration's shard files are gone once the reaper ran
    (``TrajectoryStore.settle``), its manifest.json stays; a kept one's shard files on disk are
    exactly the ones its results are stored in; ``wait_sealed`` and ``latest`` agree;
  * the manifest's counts (total, done, failed, refused by reason, env errors, groups lost) and each
    node's done/tokens/refused match the model, across restarts.

It found three bugs, fixed, each with a focused test at the end of this file: a worker handed back
the task it had just delivered (queued after its lease ran out, then being stored) and never told to
cancel it; an iteration submitted again after its drop dropped again at the tick after its seal
(retention went by number); after a restart, a dropped iteration reported as never submitted.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import random
import types

import pytest

from elasticrl.errors import NotFoundError, NotReadyError
from elasticrl.scheduler import framing
from elasticrl.scheduler.core import KEEP_UNFETCHED, Assign, Cancel, End, WorkerConn
from elasticrl.scheduler.state import IterationConfig, Policy, Split, TaskStatus
from elasticrl.scheduler.store import MANIFEST
from tests.unit.scheduler_harness import (
    RUN,
    Clock,
    Harness,
    Item,
    assigned,
    cancelled,
    drain,
    expect_decision,
    group,
    spec,
    specs,
)

pytestmark = pytest.mark.timeout(60)

STEPS = 300
MEMBERS = ("a", "b", "c")
LEASE_TTL_S = 30.0  # every member sends keep-alives as the clock moves: nobody is evicted
TASK_LEASE_S = 1e6  # no task lease runs out: a copy a worker holds is a running task
DONE, QUEUED, RUNNING, DROPPED, FAILED = (
    TaskStatus.DONE, TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.DROPPED, TaskStatus.FAILED)
SEAL_REASON = {"done": "all {total} tasks done", "finished": "all tasks finished", "deadline": "deadline passed"}


@dataclasses.dataclass
class Sub:
    """One submitted iteration, as the trainer knows it."""

    n: int
    splits: dict  # task id -> Split, in submission order
    config: IterationConfig
    submitted_wall: float
    acked: dict = dataclasses.field(default_factory=dict)  # task id -> (Item, member) accepted
    failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    env_errors: int = 0
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> n
    node_refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # member -> n
    sealed: str = ""  # "", or why: "done", "finished", "deadline"
    at_seal: dict | None = None  # acked when it sealed: what a fetch must give
    dropped: bool = False
    dropped_here: bool = False  # dropped by retention (a fetch says why), not yet submitted again
    seal_order: int = 0  # retention keeps the newest seals (``Iteration.seal_order``)
    train_fetched: dict = dataclasses.field(default_factory=dict)  # world size -> ranks (the core's, in memory)
    sealed_wall: float = 0.0  # and a restart orders what it loads by the seal's wall time

    @property
    def awaits_fetch(self) -> bool:
        """``Iteration.awaits_fetch``: sealed, with train tasks, not fetched by a whole world."""
        return (bool(self.sealed) and any(sp is Split.TRAIN for sp in self.splits.values())
                and not any(len(r) >= n for n, r in self.train_fetched.items()))

    @property
    def failed(self) -> set:
        return {t for t, f in self.failures.items() if f >= self.config.max_task_failures and t not in self.acked}

    def seal_due(self, wall: float) -> str:
        """``policy.decide_seal``'s rule on the model (the deadline on the wall clock: a restart's
        gap counts)."""
        total, done = len(self.splits), len(self.acked)
        if done >= total:
            return "done"
        if done + len(self.failed) >= total:
            return "finished"
        c = self.config
        if c.deadline_s and wall >= self.submitted_wall + c.deadline_s and done >= math.ceil(c.min_fraction * total - 1e-9):
            return "deadline"
        return ""


def wire(n: int, g) -> bytes:
    """The bytes a trainer is served for group ``g`` of iteration ``n`` (fields 1-6)."""
    parts, _ = framing.group_parts(n, g)
    return b"".join(bytes(p) for p in parts)


class Sim:
    def __init__(self, seed: int, path) -> None:
        self.seed = seed
        self.seals = 0
        self.path = path
        self.rng = random.Random(seed)
        self.keep = self.rng.choice((2, 3, 4))
        self.fetched_upto = None  # the newest iteration a whole world fetched (since the core's start)
        self.h = Harness(keep_iterations=self.keep, clock=Clock(now=1000.0), lease_ttl_s=LEASE_TTL_S, state_dir=path)
        self.subs: dict[int, Sub] = {}  # the newest submit of each number
        self.ever: set[int] = set()  # every number submitted
        self.conns: dict[str, WorkerConn | None] = {}
        self.next_seed = 0
        self.next_batch = 0
        self.step_no = 0
        self.trace: list[str] = []
        self.sealed_before: dict[int, Sub] = {}  # the iterations sealed when this step began
        self.stats = collections.Counter()

    # -- helpers ------------------------------------------------------------------------------

    def ctx(self, what: str) -> str:
        return f"seed {self.seed}, step {self.step_no}: {what}; last operations: {self.trace[-10:]}"

    def note(self, op: str) -> None:
        self.trace.append(f"{self.step_no}:{op}")

    def its(self) -> dict:
        return self.h.sched.iterations.get(RUN, {})

    def wall(self) -> float:
        return self.h.clock.wall()

    def kept(self) -> dict[int, Sub]:
        return {n: s for n, s in self.subs.items() if not s.dropped}

    def live(self, member_id: str) -> bool:
        run = self.h.coord.runs.get(RUN)
        inc = self.h.incarnations.get(member_id)
        return run is not None and inc is not None and run.is_live(member_id, inc)

    def connected(self) -> list[str]:
        return [m for m, c in self.conns.items() if c is not None]

    def item(self, n: int, task_id: str) -> Item:
        self.next_seed += 1
        return Item(n, task_id, self.next_seed, self.rng.randint(1, 4))

    def seal(self, sub: Sub, kind: str) -> None:
        sub.sealed, sub.at_seal = kind, dict(sub.acked)
        self.seals += 1
        sub.seal_order, sub.sealed_wall = self.seals, self.wall()
        self.stats[f"sealed {kind}"] += 1
        if kind == "deadline" and len(sub.acked) < len(sub.splits):
            self.stats["sealed partial"] += 1

    def maybe_seal(self, sub: Sub) -> None:
        if not sub.sealed and not sub.dropped:
            kind = sub.seal_due(self.wall())
            if kind:
                self.seal(sub, kind)

    def retain(self) -> None:
        """``SchedulerCore._trim``: the ``keep`` sealed iterations that sealed last stay, and once the
        trainers fetched one in full, the newest KEEP_UNFETCHED of those above it no world fetched;
        and the highest number held."""
        sealed = sorted((n for n, s in self.kept().items() if s.sealed), key=lambda n: self.subs[n].seal_order)
        upto = self.fetched_upto
        unfetched = set() if upto is None else set([n for n in sealed if n > upto and self.subs[n].awaits_fetch][-KEEP_UNFETCHED:])
        newest = max(self.kept(), default=None)  # the run's current iteration stays
        for n in sealed[:-self.keep]:
            if n in unfetched or n == newest:
                continue
            self.subs[n].dropped = self.subs[n].dropped_here = True
            self.stats["dropped"] += 1

    def pump(self) -> None:
        """Deliver the outboxes. No task of an iteration sealed before this step is handed out."""
        for m in self.connected():
            conn = self.conns[m]
            ended = False
            for msg in drain(conn):
                if isinstance(msg, Assign):
                    for n, s, _, _ in msg.items:
                        # (It may have sealed, even been dropped, later in this step: then the
                        # copy was cancelled, which ``check`` sees in the worker's holding.)
                        sub = self.subs.get(n)
                        assert sub is not None and self.sealed_before.get(n) is not sub, self.ctx(
                            f"{m} was handed task {s.task_id} of iteration {n}, sealed ({sub and sub.sealed}) before")
                elif isinstance(msg, End):
                    ended = True
                else:
                    assert isinstance(msg, Cancel), msg
            if ended:
                self.h.sched.disconnect(conn, "ended by the coordinator")
                self.conns[m] = None

    def tick(self) -> None:
        """One tick of both cores, then the model's: retention of what sealed before, then the deadlines."""
        self.h.coord.tick()
        self.h.sched.tick()
        self.retain()
        for sub in self.kept().values():
            self.maybe_seal(sub)
        self.h.store.settle()  # the dropped shards are retired in a thread: wait for it (deterministic)

    # -- operations ---------------------------------------------------------------------------

    def config(self) -> IterationConfig:
        deadline = self.rng.choice((0.0, 0.0, 6.0, 15.0, 40.0))
        return IterationConfig(
            policy=Policy.STATIC if self.rng.random() < 0.15 else Policy.DYNAMIC,
            deadline_s=deadline,
            min_fraction=self.rng.choice((0.0, 0.5, 1.0)) if deadline else 1.0,
            task_lease_s=TASK_LEASE_S,
            backup_tasks=self.rng.choice((0, 0, 1)),
            max_task_failures=self.rng.choice((1, 2, 3)),
        )

    def submit(self, n: int, count: int) -> None:
        splits = {f"t{i:02d}": Split.EVAL if self.rng.random() < 0.25 else Split.TRAIN for i in range(count)}
        config = self.config()
        self.note(f"submit {n} x{count} deadline={config.deadline_s} min={config.min_fraction} "
                  f"fail={config.max_task_failures} {config.policy.value} backups={config.backup_tasks}")
        specs = [spec(i, split=s) for i, s in enumerate(splits.values())]
        created = self.h.sched.submit(RUN, n, specs, config)
        assert created is True, self.ctx(f"iteration {n} was not created")
        self.subs[n] = Sub(n, splits, config, self.wall())
        self.ever.add(n)

    def op_submit(self) -> None:
        if sum(1 for s in self.kept().values() if not s.sealed) >= 3:
            return self.op_advance()
        n = max(self.ever, default=0) + self.rng.choice((1, 1, 2))
        self.submit(n, self.rng.randint(1, 6))

    def op_resubmit(self) -> None:
        """The same tasks again: a no-op while the number is kept; once dropped, a new iteration (a
        trainer resumed from an older checkpoint)."""
        if not self.subs:
            return
        n = self.rng.choice(sorted(self.subs))
        sub = self.subs[n]
        if sub.dropped:
            self.stats["resubmitted dropped"] += 1
            self.submit(n, len(sub.splits))
            return
        self.note(f"resubmit {n}")
        specs = [spec(i, split=s) for i, s in enumerate(sub.splits.values())]
        assert self.h.sched.submit(RUN, n, specs, self.config()) is False, self.ctx(f"resubmitting {n} created it again")

    def op_connect(self) -> None:
        m = self.rng.choice(MEMBERS)
        slots = self.rng.randint(1, 3)
        self.note(f"connect {m} slots={slots}")
        self.connect(m, slots)

    def connect(self, m: str, slots: int) -> None:
        if not self.live(m):
            self.h.join(m)
        old = self.conns.get(m)
        self.conns[m] = self.h.worker(m, slots=slots)
        if old is not None:  # replaced by the newer stream: the servicer closes the old one
            drain(old)
            self.h.sched.disconnect(old, "replaced by a newer stream")

    def op_disconnect(self) -> None:
        ms = self.connected()
        if not ms:
            return
        m = self.rng.choice(ms)
        self.note(f"disconnect {m}")
        self.h.sched.disconnect(self.conns[m], "test", abrupt=self.rng.random() < 0.5)
        self.conns[m] = None

    def send(self, m: str, items: list[Item]) -> None:
        conn = self.conns[m]
        batch_id = ""
        if self.rng.random() < 0.8:
            self.next_batch += 1
            batch_id = f"{m}-{self.next_batch}"
        self.note(f"results {m} {batch_id!r} {[(i.iteration, i.task_id) for i in items]}")
        kept = self.kept()
        # The harness's arrival rules, on the model: what exists, what is sealed, what was acked.
        view = {n: types.SimpleNamespace(tasks=s.splits, sealed=bool(s.sealed)) for n, s in kept.items()}
        accepted = {(n, t) for n, s in kept.items() for t in s.acked}
        w = conn.worker
        fenced = w.fenced or not self.h.coord.runs[RUN].is_live(w.member_id, w.incarnation)
        fresh, refused = expect_decision(view, items, fenced=fenced, accepted=accepted, storing=set())
        ack, end = self.h.sched.accept(conn, [(i.iteration, i.group()) for i in items], batch_id)
        got = (ack.accepted, [tuple(r) for r in ack.refused])
        assert got == (len(fresh), refused), self.ctx(f"ack {got}, expected {(len(fresh), refused)}")
        for item in fresh:
            kept[item.iteration].acked[item.task_id] = (item, m)
            # Not handed to it again between the decision (which freed its slot) and the commit,
            # which cancels every copy of the task but the one of the worker that delivered it.
            assert item.key not in conn.worker.holding, self.ctx(
                f"{m} still holds task {item.task_id} of iteration {item.iteration} after its own result for it was "
                f"accepted ({'sealed' if self.its()[item.iteration].sealed else 'open'}): it was handed out again "
                "while that result was being stored, and never cancelled")
        touched = {i.iteration for i in fresh}
        for n, _, reason in refused:
            self.stats[f"refused {reason}"] += 1
            if reason != "unknown":
                kept[n].refused[reason] += 1
                kept[n].node_refused[m] += 1
                touched.add(n)
        for n in sorted(touched):  # the commit's seal check, per touched iteration
            self.maybe_seal(kept[n])
        if end is not None:
            self.h.sched.disconnect(conn, str(end))
            self.conns[m] = None

    def op_results(self) -> None:
        ms = self.connected()
        if not ms or not self.subs:
            return
        m = self.rng.choice(ms)
        held = sorted(self.conns[m].worker.holding)
        items = [self.item(*k) for k in self.rng.sample(held, self.rng.randint(0, min(3, len(held))))]
        if self.rng.random() < 0.35:  # late: a task of any iteration (sealed, dropped, open)
            unfinished = sorted((n, t) for n, s in self.kept().items() if s.sealed for t in s.splits if t not in s.acked)
            if unfinished and self.rng.random() < 0.5:  # one a seal left unfinished
                items.append(self.item(*self.rng.choice(unfinished)))
            else:
                n = self.rng.choice(sorted(self.subs))
                items.append(self.item(n, self.rng.choice(list(self.subs[n].splits))))
        acked = sorted((n, t) for n, s in self.kept().items() for t in s.acked)
        if acked and self.rng.random() < 0.15:  # a second copy of a done task
            items.append(self.item(*self.rng.choice(acked)))
        if items:
            self.send(m, items)

    def op_release(self) -> None:
        ms = [m for m in self.connected() if self.releasable(m)]
        if not ms:
            return
        m = self.rng.choice(ms)
        conn = self.conns[m]
        held = self.releasable(m)
        n = self.rng.choice(held)[0]
        ids = [t for i, t in held if i == n]
        ids = self.rng.sample(ids, self.rng.randint(1, len(ids)))
        failed = self.rng.random() < 0.6
        errors = self.rng.randint(1, 2) if failed else 0
        self.note(f"release {m} {n} {ids} failed={failed}")
        sub = self.subs[n]
        assert not sub.dropped and not sub.sealed, self.ctx(f"{m} holds tasks {ids} of {'dropped' if sub.dropped else 'sealed'} iteration {n}")
        it = self.its()[n]
        assert all(it.tasks[t].status is RUNNING for t in ids), "the sim's premise: a held copy is a running task"
        self.h.sched.release(conn, n, ids, "engine error", failed=failed, env_errors=errors)
        if failed:
            sub.env_errors += errors
            given_up = False
            for t in ids:
                sub.failures[t] += 1
                given_up |= sub.failures[t] >= sub.config.max_task_failures
            if given_up:
                self.stats["given up"] += 1
                self.maybe_seal(sub)

    def releasable(self, m: str) -> list:
        """The copies ``m`` runs."""
        return sorted(self.conns[m].worker.holding)

    def op_advance(self) -> None:
        seconds = self.rng.choice((0.5, 2.0, 5.0, 12.0, 30.0))
        self.note(f"advance {seconds}")
        left = seconds
        while left > 0:
            d = min(5.0, left)
            left -= d
            self.h.clock.now += d
            for m in MEMBERS:
                if self.live(m):
                    self.h.coord.keep_alive(RUN, m, self.h.incarnations[m])
            self.tick()

    def op_tick(self) -> None:
        self.note("tick")
        self.tick()

    def op_finish_waiting(self) -> None:
        """The trainer waits on ``wait_sealed`` while the last results of an open iteration arrive
        (late results are accepted whoever held the task): the seal wakes it."""
        open_ns = [n for n, s in self.kept().items() if not s.sealed]
        ms = self.connected()
        if not open_ns or not ms:
            return
        n, m = self.rng.choice(open_ns), self.rng.choice(ms)
        sub = self.subs[n]
        items = [self.item(n, t) for t in sub.splits if t not in sub.acked]
        self.note(f"finish {n} by {m}, the trainer waiting")

        async def scenario():
            waiter = asyncio.ensure_future(self.h.sched.wait_sealed(RUN, n, 30.0))
            await asyncio.sleep(0)  # the waiter is registered
            assert not waiter.done(), self.ctx(f"wait_sealed({n}) returned before the seal")
            self.send(m, items)
            return await asyncio.wait_for(waiter, 5.0)

        it = asyncio.run(scenario())
        assert sub.sealed == "done", self.ctx(f"iteration {n} not due to seal after its last results ({sub.sealed!r})")
        assert it is not None and it.sealed, self.ctx(f"wait_sealed({n}) woke with {it}")
        self.stats["waited"] += 1

    def op_fetch(self) -> None:
        sealed = sorted(n for n, s in self.kept().items() if s.sealed)
        r = self.rng.random()
        if sealed and r < 0.6:
            n = self.rng.choice(sealed)
        else:
            n = self.rng.choice(sorted(self.ever) + [max(self.ever, default=0) + 7])
        ws = self.rng.randint(1, 3)
        split = self.rng.choice((Split.TRAIN, Split.EVAL))
        self.note(f"fetch {n} world={ws} {split.value}")
        self.check_fetch(n, ws, split)
        got = asyncio.run(self.h.sched.wait_sealed(RUN, n, 0.0))
        sub = self.subs.get(n)
        if sub is None or sub.dropped:
            assert got is None, self.ctx(f"wait_sealed({n}) found it, though {'dropped' if sub else 'never submitted'}")
        else:
            assert got is not None and got.sealed == bool(sub.sealed), self.ctx(f"wait_sealed({n}): {got}")

    def op_restart(self) -> None:
        before = {n: self.fetch_all(n) for n, s in self.kept().items() if s.sealed}
        old = self.h
        old.store.settle()
        old.coord.db.close()
        self.keep = self.rng.choice((self.keep, self.keep, 2, 3, 5))
        now = self.rng.choice((5.0, 1000.0, 1e6))
        gap = self.rng.choice((0.5, 3.0, 20.0))
        self.note(f"RESTART keep={self.keep} gap={gap}")
        self.h = Harness(keep_iterations=self.keep, clock=Clock(now=now, wall_offset=old.clock.wall() + gap - now),
                                lease_ttl_s=LEASE_TTL_S, state_dir=self.path)
        self.h.incarnations = dict(old.incarnations)
        self.stats["restarts"] += 1
        self.fetched_upto = None  # what the core knows of fetches is memory only
        for sub in self.subs.values():
            sub.train_fetched = {}
        # The seals it loads, in the order of their wall times (to the ms; a tie by number).
        for n in sorted((n for n, s in self.kept().items() if s.sealed), key=lambda n: (round(self.subs[n].sealed_wall, 3), n)):
            self.seals += 1
            self.subs[n].seal_order = self.seals
        self.retain()  # a smaller --keep-iterations applies at start-up; so does a trim the last tick did not do
        self.h.store.settle()
        self.check()
        self.check_disk()
        for n, answer in before.items():
            if not self.subs[n].dropped:
                assert self.fetch_all(n) == answer, self.ctx(f"iteration {n}: the fetch changed across the restart")
        for m in list(self.conns):
            had, self.conns[m] = self.conns[m] is not None, None
            if had and self.rng.random() < 0.8:
                self.connect(m, self.rng.randint(1, 3))

    # -- invariants ---------------------------------------------------------------------------

    def fetch_all(self, n: int) -> dict:
        """{split: [(task id, node, bytes)]} as a trainer of world size 1 gets it."""
        self.fetched(n, 1, range(1))
        return {split: [(g.task_id, g.node, wire(n, g)) for g, _ in self.h.sched.shard(RUN, n, 0, 1, split)] for split in Split}

    def fetched(self, n: int, ws: int, ranks) -> None:
        """The core notes a sealed iteration's train fetches (retention keeps what no world fetched)."""
        got = self.subs[n].train_fetched.setdefault(ws, set())
        got.update(ranks)
        if len(got) == ws:
            self.fetched_upto = max(n, -1 if self.fetched_upto is None else self.fetched_upto)

    def check_fetch(self, n: int, ws: int, split: Split) -> None:
        sub = self.subs.get(n)
        where = f"fetch of iteration {n} (world {ws}, {split.value})"
        if sub is None or sub.dropped:
            with pytest.raises(NotFoundError) as e:
                self.h.sched.shard(RUN, n, 0, ws, split)
            if sub is not None and sub.dropped_here:
                assert "--keep-iterations" in str(e.value), self.ctx(f"{where}: dropped, but the error says {e.value}")
            self.stats["fetch not found"] += 1
            return
        if not sub.sealed:
            with pytest.raises(NotReadyError):
                self.h.sched.shard(RUN, n, 0, ws, split)
            self.stats["fetch not ready"] += 1
            return
        want = {t: x for t, x in sub.at_seal.items() if sub.splits[t] is split}
        if split is Split.TRAIN:
            self.fetched(n, ws, range(ws))
        got: dict = {}
        for rank in range(ws):
            for g, task in self.h.sched.shard(RUN, n, rank, ws, split):
                assert g.task_id not in got, self.ctx(f"{where}: task {g.task_id} served twice")
                assert task.spec.task_id == g.task_id and task.spec.split is split, self.ctx(f"{where}: {g.task_id} with task {task.spec}")
                got[g.task_id] = g
        assert sorted(got) == sorted(want), self.ctx(f"{where}: served {sorted(got)}, acked before the seal {sorted(want)}")
        for t, (item, member) in want.items():
            assert got[t].node == member and wire(n, got[t]) == wire(n, item.group()), self.ctx(
                f"{where}: task {t} is not the result acked ({item} from {member}), got node {got[t].node!r}")
        self.stats["fetch sealed"] += 1

    def check(self) -> None:
        its = self.its()
        kept = self.kept()
        assert sorted(its) == sorted(kept), self.ctx(f"the scheduler holds {sorted(its)}, the model {sorted(kept)}")
        for m, conn in self.conns.items():
            for n, t in conn.worker.holding if conn is not None else ():
                assert n in kept and not kept[n].sealed, self.ctx(f"{m} holds {t} of iteration {n}, which is sealed or gone")
        for n, sub in kept.items():
            it, where = its[n], f"iteration {n}"
            total = len(sub.splits)
            assert list(it.tasks) == list(sub.splits), self.ctx(f"{where}: tasks {list(it.tasks)}")
            status = {t: x.status for t, x in it.tasks.items()}
            done = {t for t, s in status.items() if s is DONE}
            assert done == set(sub.acked), self.ctx(f"{where}: DONE {sorted(done)}, acked {sorted(sub.acked)}")
            failed = {t for t, s in status.items() if s is FAILED}
            assert failed == sub.failed, self.ctx(f"{where}: FAILED {sorted(failed)}, given up {sorted(sub.failed)}")
            assert it.sealed == bool(sub.sealed), self.ctx(
                f"{where}: sealed={it.sealed} ({it.seal_reason!r}); model {sub.sealed!r}, due {sub.seal_due(self.wall())!r}")
            rest = {t for t in status if t not in done | failed}
            if sub.sealed:
                assert sub.at_seal == sub.acked, self.ctx(f"{where}: results added after the seal")
                assert it.seal_reason.startswith(SEAL_REASON[sub.sealed].format(total=total)), self.ctx(
                    f"{where}: sealed for {it.seal_reason!r}, model {sub.sealed!r}")
                assert all(status[t] is DROPPED for t in rest) and not it.queue and not it.shares, self.ctx(
                    f"{where}: sealed with work left: {status}, queue {list(it.queue)}, shares {it.shares}")
            else:
                assert all(status[t] in (QUEUED, RUNNING) for t in rest), self.ctx(f"{where}: open with {status}")
            mf = self.h.sched.manifest(it)
            want = {"tasks_total": total, "tasks_done": len(done), "tasks_failed": len(sub.failed),
                    "refused_duplicate": sub.refused["duplicate"], "refused_sealed": sub.refused["sealed"],
                    "refused_fenced": sub.refused["fenced"], "env_errors": sub.env_errors, "groups_lost": 0,
                    "sealed": bool(sub.sealed),
                    "eval_total": sum(sp is Split.EVAL for sp in sub.splits.values()),
                    "eval_done": sum(sub.splits[t] is Split.EVAL for t in done),
                    "eval_failed": sum(sub.splits[t] is Split.EVAL for t in sub.failed)}
            assert {k: mf[k] for k in want} == want, self.ctx(f"{where}: manifest {({k: mf[k] for k in want})}, model {want}")
            done_by = collections.Counter(member for _, member in sub.acked.values())
            tokens = collections.Counter()
            for item, member in sub.acked.values():
                tokens[member] += 2 * item.tokens
            nodes = {x["node"]: (x["done"], x["tokens"], x["refused"]) for x in mf["nodes"]}
            for member in set(nodes) | set(done_by) | set(sub.node_refused):
                assert nodes.get(member, (0, 0, 0)) == (done_by[member], tokens[member], sub.node_refused[member]), self.ctx(
                    f"{where}: node {member} done/tokens/refused {nodes.get(member)}, model "
                    f"{(done_by[member], tokens[member], sub.node_refused[member])}")
        latest = self.h.sched.latest(RUN)
        assert (latest.iteration if latest else None) == max(kept, default=None), self.ctx(f"latest is {latest and latest.iteration}")

    def check_disk(self) -> None:
        """Once the reaper ran: a kept iteration's shard files are the ones its results are in; a
        dropped one's are gone and its manifest stays; a sealed one's manifest.json says so."""
        its = self.its()
        for n in sorted(self.ever):
            sub = self.subs[n]
            d = self.h.store.iteration_dir(RUN, n)
            files = {p.name for p in d.glob("shard-*")} | {p.name for p in d.glob("*.tmp")} if d.exists() else set()
            if sub.dropped:
                assert not files, self.ctx(f"dropped iteration {n} still has {sorted(files)}")
                manifest = json.loads((d / MANIFEST).read_text())
                assert manifest["sealed"] and manifest["tasks_done"] == len(sub.at_seal), self.ctx(
                    f"dropped iteration {n}: manifest {manifest}")
                continue
            it = its[n]
            assert set(it.shard_of) == set(sub.acked) and files == set(it.shard_of.values()), self.ctx(
                f"iteration {n}: shard files {sorted(files)}, results in {it.shard_of}")
            if sub.sealed:
                manifest = json.loads((d / MANIFEST).read_text())
                assert (manifest["sealed"], manifest["seal_reason"], manifest["tasks_done"]) == (
                    True, it.seal_reason, len(sub.at_seal)), self.ctx(f"iteration {n}: manifest.json {manifest}")
        recycled = self.h.store.root / ".recycle"
        assert not recycled.exists() or all(not p.name.startswith("shard-") for p in recycled.iterdir())

    # -- the run ------------------------------------------------------------------------------

    def step(self) -> None:
        r = self.rng.random()
        if not self.connected() or r < 0.05:
            self.op_connect()
        elif not any(not s.sealed for s in self.kept().values()) or r < 0.14:
            self.op_submit()
        elif r < 0.42:
            self.op_results()
        elif r < 0.50:
            self.op_release()
        elif r < 0.64:
            self.op_advance()
        elif r < 0.68:
            self.op_tick()
        elif r < 0.71:
            self.op_disconnect()
        elif r < 0.74:
            self.op_resubmit()
        elif r < 0.77:
            self.op_finish_waiting()
        elif r < 0.95:
            self.op_fetch()
        else:
            self.op_restart()

    def run(self, steps: int) -> None:
        for self.step_no in range(steps):
            self.sealed_before = {n: s for n, s in self.subs.items() if s.sealed}
            self.step()
            self.pump()
            self.check()
            if self.trace and ("tick" in self.trace[-1] or "advance" in self.trace[-1]):
                self.check_disk()
        self.step_no += 1
        self.op_restart()
        for n in sorted(self.ever) + [max(self.ever) + 1]:
            for split in Split:
                self.check_fetch(n, self.rng.randint(1, 3), split)


SEEDS = list(range(8))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_trainer_fetches_what_was_acked_before_the_seal_across_retention_and_restarts(seed, tmp_path):
    sim = Sim(seed, tmp_path)
    sim.run(STEPS)
    s = sim.stats
    # The mix did what it is for: seals of each kind, drops, fetches of each outcome, restarts.
    assert s["restarts"] >= 4 and s["dropped"] >= 1 and s["fetch sealed"] >= 5, s
    assert s["sealed done"] + s["sealed finished"] >= 2 and s["refused sealed"] + s["refused unknown"] >= 1, s


# -- the bugs these runs found, each fixed ---------------------------------------------------------


def test_a_slow_workers_late_result_does_not_hand_it_the_same_task_again(tmp_path):
    """Minimized: a's task lease runs out (t00 queued again, a keeps its slot: nobody else is free);
    a's result then arrives, frees the slot, and the dispatch in ``decide`` hands t00 (queued,
    being stored) straight back to a. The commit seals the iteration but sends a no cancel: a runs
    t00 again for a sealed iteration."""
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=1)
    h.sched.submit(RUN, 1, specs(1), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ["t00"]
    h.advance(15.0, alive=("a",))
    assert h.it(1).tasks["t00"].status is QUEUED and a.worker.holding == {(1, "t00")}  # the lease ran out
    ack, _ = h.sched.accept(a, [(1, group("t00"))], "a-1")
    assert ack.accepted == 1 and h.it(1).sealed
    messages = drain(a)
    # Either it is not handed the task again, or the copy handed is cancelled.
    assert assigned(messages) == cancelled(messages) and not a.worker.holding, (
        f"assigned {assigned(messages)}, cancelled {cancelled(messages)}, a holds {sorted(a.worker.holding)} "
        f"of sealed iteration 1 ({h.it(1).seal_reason})")


def test_a_seal_in_a_batch_does_not_hand_its_worker_a_task_whose_result_the_same_batch_holds(tmp_path):
    """a's leases on t00 of iterations 1 and 2 run out (both queued again, a keeps its slots); its
    one batch then holds both results. The commit sealed iteration 1 before it marked iteration
    2's task done, and the seal's dispatch handed that task (no longer being stored) straight back
    to a, whose copy the commit does not cancel."""
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=2)
    for n in (1, 2):
        h.sched.submit(RUN, n, specs(1), IterationConfig(task_lease_s=10.0))
    assert sorted(assigned(drain(a))) == ["t00", "t00"]
    h.advance(15.0, alive=("a",))
    assert all(h.it(n).tasks["t00"].status is QUEUED for n in (1, 2)) and a.worker.holding == {(1, "t00"), (2, "t00")}
    ack, _ = h.sched.accept(a, [(1, group("t00")), (2, group("t00"))], "a-1")
    assert ack.accepted == 2 and h.it(1).sealed and h.it(2).sealed
    messages = drain(a)
    assert assigned(messages) == cancelled(messages) and not a.worker.holding, (
        f"assigned {assigned(messages)}, cancelled {cancelled(messages)}, a holds {sorted(a.worker.holding)}")


def test_an_iteration_submitted_again_after_its_drop_can_be_fetched_once_sealed(tmp_path):
    h = Harness(keep_iterations=2, state_dir=tmp_path)
    w = h.worker("w", slots=2)

    def roll_out(n: int) -> None:
        assert h.sched.submit(RUN, n, specs(2), IterationConfig()) is True
        ack, _ = h.sched.accept(w, [(n, group(t)) for t in assigned(drain(w))])
        assert ack.accepted == 2 and h.it(n).sealed
        h.sched.tick()  # retention runs at the tick after a seal

    for n in (1, 2, 3):
        roll_out(n)
    with pytest.raises(NotFoundError, match="was dropped"):
        h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
    roll_out(1)  # the resumed trainer's iteration 1, sealed: it waited for it, now it fetches it
    assert sorted(g.task_id for g, _ in h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)) == ["t00", "t01"]


def test_a_dropped_iteration_is_still_reported_as_dropped_after_a_restart(tmp_path):
    h = Harness(keep_iterations=2, state_dir=tmp_path)
    w = h.worker("w", slots=2)
    for n in (1, 2, 3):
        h.sched.submit(RUN, n, specs(2), IterationConfig())
        h.sched.accept(w, [(n, group(t)) for t in assigned(drain(w))])
        h.sched.tick()
    with pytest.raises(NotFoundError, match="--keep-iterations"):
        h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
    h.store.settle()
    h.coord.db.close()  # as a stopped process does
    again = Harness(keep_iterations=2, state_dir=tmp_path, clock=h.clock)
    with pytest.raises(NotFoundError, match="--keep-iterations"):
        again.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
