"""Seeded random test of what the coordinator REPORTS: a real ``elasticrl coordinator`` subprocess
(``--metrics-port``) is driven by random operations (members join, leave, are replaced, stall
until their lease expires, lose their Work stream; barriers complete, time out under either
policy, or wait; iterations are submitted, their tasks assigned over real Work streams, completed,
released, failed, given up, left to lapse their task lease, refused as duplicate / fenced / sealed /
unknown; KV keys set and deleted; runs are closed, and dropped to make room under ``--max-runs``;
the coordinator is killed and restarted on its state dir). After every step a model of what
happened is compared with everything the coordinator reports:

* ``GET /metrics`` (parsed with ``prometheus_client.parser``, and the strict reader of
  ``tests/integration/prometheus.py``): the counters (joins, leaves, evictions by reason, barriers
  by outcome, requeues, accepted / refused results, env errors, trajectory bytes, seals) and the
  state gauges (members by state, epochs, open barriers, workers, the newest iteration and its
  tasks by state) equal the model's; counters never go down (but start at zero after a restart);
  nothing is negative or NaN; a dropped run's labelled series are all gone (``Metrics.forget_run``);
  the odd run ids round-trip through the exposition's label escaping;
* ``GET /healthz`` answers;
* ``Status`` (and, now and then, ``elasticrl status --json --all`` as a subprocess) and every
  iteration's manifest (``IterationStatus``: tasks by state, requeued, refused_*, env_errors,
  groups_lost, per-node counts) equal the model's; a worker's acks and cancels are the ones the
  model expects.

Every wait has a hard deadline. ``ELASTICRL_RANDOM_SEEDS`` (default 3) sets how many seeds run;
even seeds use a durable coordinator (and restart it once), odd ones an in-memory one.

Bugs it found (each has a focused test at the end of this file, which failed before its fix;
the walk still avoids them as it did):
  * ``test_close_run_does_not_count_its_engines_as_stream_lost_evictions``: a closed run's live
    engines are evicted as "stream_lost" -- so ``op_close`` makes every live engine leave first.
  * ``test_scheduler_iteration_gauge_keeps_the_newest_submitted_iteration``: retention can drop the
    newest-numbered iteration (it sealed first), and the gauge then goes back to an older one -- so
    the model follows the code's ``latest`` there (see ``Model.latest``).
  * ``test_a_clean_shutdown_does_not_evict_members_it_stopped_listening_to``: a SIGTERM'd
    coordinator evicts members whose keep-alives it refuses -- so ``op_restart`` uses kill -9.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
import json
import math
import os
import pathlib
import queue
import random
import subprocess
import sys
import threading
import time
import typing
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.coordinator import wire
from elasticrl.errors import (
    ElasticRLError,
    FencedError,
    NotFoundError,
    ResourceLimitError,
    RunClosedError,
)
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.state import TaskSpec
from tests.conftest import REPO, wait_until
from tests.integration.prometheus import parse_exposition

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.waits]

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "3")))
STEPS = 60
MAX_RUNS = 3
KEEP_ITERATIONS = 2  # the smallest --keep-iterations: retention drops sealed iterations often
STREAM_GRACE_S = 0.3
TASK_LEASE_S = 0.2  # the task lease of the iterations whose leases lapse
KEPT_TTL_S = 1.5  # members kept alive by the keeper thread (stalled by taking them out of it)
LONG_TTL_S = 600.0  # members nobody keeps alive, whose lease never runs out in a test
KEEPALIVE_EVERY_S = 0.2
SETTLE_S = 12.0  # the longest a step may take to be reported as it happened
HTTP_TIMEOUT_S = 5.0
CLI_TIMEOUT_S = 60.0
TEXTS = ("", "ok", "caf\u00e9 \u732b \u2603", "x" * 7)

COUNTERS = ("_total",)
HIST = ("_bucket", "_count", "_sum")


def run_ids(rng: random.Random):
    """Odd but valid run ids (letters, digits and ._:@=+-, up to 128 characters), never reused."""
    shapes = ["r{k}", "run:{k}@a=b+c", "R-{k}.x_y", "{k}==+", "r{k}" + "z" * 120, "a.b:c@{k}-", "{k}@@::"]
    for k in itertools.count():
        yield rng.choice(shapes).format(k=k)[:128]


# -- a Work stream driven by hand --------------------------------------------------------------------


class FakeWorker:
    """One engine's Work stream on a sync gRPC channel: what it sends is decided by the test, what
    it receives is queued for the main thread (``inbox``)."""

    def __init__(self, channel: grpc.Channel, run_id: str, member_id: str, incarnation: int, slots: int):
        self.run_id, self.mid, self.inc, self.slots = run_id, member_id, incarnation, slots
        self.held: set[tuple[int, str]] = set()
        self.fenced = False  # its member is no longer live (the coordinator fenced the stream)
        self.ended = False  # the stream ended (its end was read)
        self.end_error: grpc.RpcError | None = None
        self.expect_end: str | None = None  # why the test expects the coordinator to end it
        self.closed_by_us = False
        self.expected_acks: collections.deque = collections.deque()
        self.expected_cancels: set[tuple[int, str]] = set()
        self.inbox: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        hello = spb.WorkerHello(run_id=run_id, member=wire.member_ref(member_id, incarnation), slots=slots)
        self._out.put(spb.WorkRequest(hello=hello))
        self.call = spb_grpc.SchedulerStub(channel).Work(self._requests())
        self._reader = threading.Thread(target=self._read, name=f"fake-worker-{member_id}", daemon=True)
        self._reader.start()

    @property
    def active(self) -> bool:
        return not self.fenced and not self.ended and not self.closed_by_us and self.expect_end is None

    @property
    def free(self) -> int:
        return self.slots - len(self.held) if self.active else 0

    def _requests(self):
        while True:
            item = self._out.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put(msg)
            self.inbox.put(("end", None))
        except grpc.RpcError as err:
            self.inbox.put(("end", err))

    def send(self, request: spb.WorkRequest) -> None:
        self._out.put(request)

    def close(self) -> None:
        """Cancel the stream from our side (a killed process, as the coordinator sees it)."""
        self.closed_by_us = True
        self.call.cancel()
        self._out.put(None)


class Keeper:
    """Renews the leases of the "kept" members from one thread (a stall: take one out)."""

    def __init__(self, address: str):
        self.client = SchedulerClient(address, call_timeout_s=2, reconnect_timeout_s=2)
        self.kept: set[tuple[str, str, int]] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="keeper", daemon=True)
        self.thread.start()

    def add(self, run_id: str, mid: str, inc: int) -> None:
        with self.lock:
            self.kept.add((run_id, mid, inc))

    def discard(self, run_id: str, mid: str, inc: int) -> None:
        with self.lock:
            self.kept.discard((run_id, mid, inc))

    def _loop(self) -> None:
        while not self.stop.wait(KEEPALIVE_EVERY_S):
            with self.lock:
                kept = list(self.kept)
            for key in kept:
                with self.lock:
                    if key not in self.kept:
                        continue
                try:
                    self.client.keep_alive(*key, retry_s=1.0)
                except (FencedError, NotFoundError):
                    self.discard(*key)
                except ElasticRLError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.close()


# -- the model ------------------------------------------------------------------------------------


@dataclasses.dataclass
class MTask:
    tid: str
    seq: int
    status: str = "queued"  # queued, running, done, failed, dropped
    holders: set = dataclasses.field(default_factory=set)
    failures: int = 0


@dataclasses.dataclass
class MIter:
    n: int
    tasks: dict[str, MTask]
    max_failures: int
    need: int | None  # deadline iterations: groups needed to seal (the deadline passes at once)
    short_lease: bool = False  # task leases lapse (TASK_LEASE_S) before any result comes
    sealed: bool = False
    seal_order: int = 0
    dropped: bool = False  # by retention (--keep-iterations)
    c: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    nodes: dict[str, collections.Counter] = dataclasses.field(default_factory=dict)
    evicted: list[str] = dataclasses.field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.tasks.values())

    def node(self, mid: str) -> collections.Counter:
        return self.nodes.setdefault(mid, collections.Counter())


@dataclasses.dataclass
class MMember:
    mid: str
    inc: int
    state: str = "live"  # live, left, evicted
    kept: bool = False


@dataclasses.dataclass
class MBarrier:
    name: str
    expected: dict[str, int]
    arrived: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class MRun:
    rid: str
    closed: bool = False
    epoch: int = 0
    members: dict[str, MMember] = dataclasses.field(default_factory=dict)
    barriers: dict[str, MBarrier] = dataclasses.field(default_factory=dict)  # open ones
    decided: set[str] = dataclasses.field(default_factory=set)
    iters: dict[int, MIter] = dataclasses.field(default_factory=dict)
    next_iter: int = 1
    workers: list[FakeWorker] = dataclasses.field(default_factory=list)
    sched_seen: bool = False  # the scheduler has a row for it (a Work stream opened, or a submit)
    kv: set[bytes] = dataclasses.field(default_factory=set)
    seals: int = 0

    def live(self) -> list[MMember]:
        return [m for m in self.members.values() if m.state == "live"]

    def is_live(self, mid: str, inc: int) -> bool:
        m = self.members.get(mid)
        return m is not None and m.state == "live" and m.inc == inc

    def worker_of(self, mid: str) -> FakeWorker | None:
        """The member's worker whose stream the coordinator holds as current (not ended)."""
        for w in reversed(self.workers):
            if w.mid == mid and not w.ended and not w.closed_by_us and w.expect_end is None:
                return w
        return None

    def kept_iters(self) -> dict[int, MIter]:
        return {n: it for n, it in self.iters.items() if not it.dropped}


class Model:
    def __init__(self):
        self.runs: dict[str, MRun] = {}  # in creation order, as the coordinator holds them
        self.dropped_runs: set[str] = set()
        self.counters: collections.Counter = collections.Counter()
        self.incarnation = 0  # the newest one handed out (strictly increasing, across restarts too)

    def inc(self, name: str, amount: int = 1, **labels) -> None:
        self.counters[(name, frozenset(labels.items()))] += amount

    # -- runs

    def would_create(self, rid: str) -> str | None:
        """None if ``rid`` exists or has room; else the run dropped to make room, or "refused"."""
        if rid in self.runs or len(self.runs) < MAX_RUNS:
            return None
        victim = next((r for r in self.runs.values() if r.closed and not r.live()), None)
        return "refused" if victim is None else victim.rid

    def create(self, rid: str) -> MRun:
        if rid not in self.runs:
            victim = self.would_create(rid)
            assert victim != "refused"
            if victim is not None:
                self.drop_run(victim)
            self.runs[rid] = MRun(rid)
        return self.runs[rid]

    def drop_run(self, rid: str) -> None:
        run = self.runs.pop(rid)
        self.dropped_runs.add(rid)
        for key in [k for k in self.counters if ("run", rid) in k[1]]:
            del self.counters[key]
        for w in run.workers:
            if not w.ended and not w.closed_by_us:
                w.expect_end = w.expect_end or "run dropped"

    def restarted(self) -> None:
        """A kill -9 and a start on the same state dir: counters start at zero again, Work streams
        are gone (their tasks queued again, not counted as requeued), the rest is as it was."""
        self.counters.clear()
        for run in self.runs.values():
            for it in run.kept_iters().values():
                if not it.sealed:
                    for task in it.tasks.values():
                        if task.status == "running":
                            task.status = "queued"
                        task.holders.clear()
            for w in run.workers:
                if not w.ended and not w.closed_by_us and w.expect_end is None:
                    w.expect_end = "restart"
                w.held.clear()
            run.sched_seen = bool(run.kept_iters())

    # -- membership

    def join(self, run: MRun, mid: str, inc: int, kept: bool) -> MMember | None:
        old = run.members.get(mid)
        replaced = old is not None and old.state == "live"
        run.epoch += 1 + int(replaced)
        if replaced:
            old.state = "evicted"
            self.member_gone(run, old, evicted=True)
            self.inc("elasticrl_member_evictions_total", run=run.rid, reason="replaced")
        run.members[mid] = MMember(mid, inc, kept=kept)
        self.inc("elasticrl_member_joins_total", run=run.rid)
        self.redecide(run)
        return old if replaced else None

    def leave(self, run: MRun, m: MMember) -> None:
        m.state = "left"
        run.epoch += 1
        self.member_gone(run, m, evicted=False)
        self.inc("elasticrl_member_leaves_total", run=run.rid)
        self.redecide(run)

    def evict(self, run: MRun, m: MMember, reason: str, *, redecide: bool = True) -> None:
        m.state = "evicted"
        run.epoch += 1
        self.member_gone(run, m, evicted=True)
        self.inc("elasticrl_member_evictions_total", run=run.rid, reason=reason)
        if redecide:
            self.redecide(run)

    def member_gone(self, run: MRun, m: MMember, *, evicted: bool) -> None:
        """SchedulerCore._member_gone: the member's nodes marked evicted, its stream fenced and
        whatever it held queued again."""
        for it in run.iters.values():
            if not it.sealed and not it.dropped and m.mid in it.nodes and evicted and m.mid not in it.evicted:
                it.evicted.append(m.mid)
                it.node(m.mid)["evicted"] = 1
        w = run.worker_of(m.mid)
        if w is not None and w.inc == m.inc and not w.fenced:
            w.fenced = True
            self.requeue_holdings(run, w)

    def requeue_holdings(self, run: MRun, w: FakeWorker) -> None:
        held, w.held = w.held, set()
        for n, tid in sorted(held):
            it = run.iters.get(n)
            if it is None or it.dropped or it.sealed:
                continue
            self.requeue(run, it, it.tasks[tid], w.mid)

    def requeue(self, run: MRun, it: MIter, task: MTask, mid: str) -> None:
        task.holders.discard(mid)
        if task.status != "running" or task.holders:
            return
        task.status = "queued"
        it.c["requeued"] += 1
        self.inc("elasticrl_scheduler_tasks_requeued_total", run=run.rid)

    # -- barriers

    def arrive(self, run: MRun, m: MMember, name: str) -> None:
        if name in run.decided:
            return  # a replay
        b = run.barriers.get(name)
        if b is None:
            b = run.barriers[name] = MBarrier(name, {x.mid: x.inc for x in run.live()})
        b.arrived[m.mid] = m.inc
        if not self.waiting_for(run, b):
            self.decide(run, name, "completed")

    def waiting_for(self, run: MRun, b: MBarrier) -> list[str]:
        return sorted(mid for mid, inc in b.expected.items() if run.is_live(mid, inc) and b.arrived.get(mid) != inc)

    def decide(self, run: MRun, name: str, outcome: str, evict: list[str] = ()) -> None:
        b = run.barriers.pop(name)
        run.decided.add(name)
        for mid in evict:
            self.evict(run, run.members[mid], "missed_barrier", redecide=False)
        self.inc("elasticrl_barriers_decided_total", run=run.rid, outcome=outcome)
        self.inc("elasticrl_barrier_wait_seconds_count", run=run.rid)
        del b
        if evict:
            self.redecide(run)

    def timed_out(self, run: MRun, name: str, policy: str) -> None:
        b = run.barriers[name]
        late = self.waiting_for(run, b)
        if not late:
            self.decide(run, name, "completed")
        elif policy == "report":
            self.decide(run, name, "timed_out")
        else:
            self.decide(run, name, "completed", evict=late)

    def redecide(self, run: MRun) -> None:
        for name, b in list(run.barriers.items()):
            if name in run.barriers and not self.waiting_for(run, b):
                self.decide(run, name, "completed")

    # -- scheduler

    def latest(self, run: MRun) -> MIter | None:
        # The coordinator's ``latest``: the highest-numbered iteration it holds (retention keeps it:
        # test_scheduler_iteration_gauge_keeps_the_newest_submitted_iteration).
        kept = run.kept_iters()
        return kept[max(kept)] if kept else None

    def assigned(self, run: MRun, w: FakeWorker, n: int, tid: str) -> None:
        assert not w.fenced and not w.ended, f"task {n}/{tid} assigned to {w.mid}, which is fenced or gone"
        it = run.iters[n]
        task = it.tasks[tid]
        if it.sealed and task.status == "dropped":
            # Handed out on the arrival of the result batch whose commit then sealed the iteration
            # (a result batch frees its slots before it is stored): the seal cancelled it at once.
            it.node(w.mid)["assigned"] += 1
            w.expected_cancels.add((n, tid))
            return
        assert task.status == "queued", f"task {n}/{tid} assigned to {w.mid} while {task.status}"
        task.status = "running"
        task.holders.add(w.mid)
        w.held.add((n, tid))
        it.node(w.mid)["assigned"] += 1
        assert len(w.held) <= w.slots, f"{w.mid} holds {sorted(w.held)} with {w.slots} slot(s)"
        if it.short_lease:
            # Its task lease lapses (a tick after TASK_LEASE_S): the task is queued again while the
            # worker keeps its slot (it presumably still runs the copy). Applied at once: every
            # step waits until the coordinator reports it.
            self.requeue(run, it, task, w.mid)

    def cancel_copies(self, run: MRun, it: MIter, task: MTask, keep: str = "") -> None:
        """Every other worker still running a copy (a holder, or one whose task lease lapsed) is
        told to drop it; its slot is free."""
        key = (it.n, task.tid)
        for w in run.workers:
            if w.mid != keep and key in w.held:
                w.held.discard(key)
                w.expected_cancels.add(key)

    def maybe_seal(self, run: MRun, it: MIter) -> None:
        if it.sealed:
            return
        total, done, failed = len(it.tasks), it.count("done"), it.count("failed")
        if done >= total or done + failed >= total or (it.need is not None and done >= it.need):
            it.sealed = True
            run.seals += 1
            it.seal_order = run.seals
            self.inc("elasticrl_scheduler_iterations_sealed_total", run=run.rid)
            self.inc("elasticrl_scheduler_seal_seconds_count", run=run.rid)
            for task in it.tasks.values():
                if task.status in ("queued", "running"):
                    task.status = "dropped"
                    self.cancel_copies(run, it, task)
                    task.holders.clear()
            sealed = sorted((x for x in run.iters.values() if x.sealed), key=lambda x: x.seal_order)
            newest = max((n for n, x in run.iters.items() if not x.dropped), default=None)
            for old in sealed[:-KEEP_ITERATIONS]:
                if old.n != newest:  # the newest number stays (it was dropped when it sealed first:
                    old.dropped = True  # test_scheduler_iteration_gauge_keeps_the_newest_submitted_iteration)

    def results(self, run: MRun, w: FakeWorker, groups: list[tuple[int, str, int, int]]) -> tuple[int, list]:
        """A result batch from ``w``: groups (iteration, task id, tokens, bytes). Returns the ack
        it must get: (accepted, [(task id, reason)])."""
        fenced = w.fenced or not run.is_live(w.mid, w.inc)
        its = run.kept_iters()
        fresh: dict[int, list] = collections.defaultdict(list)
        refused: list[tuple[int, str, str]] = []
        seen = set()
        for n, tid, tokens, nbytes in groups:
            it = its.get(n)
            task = it.tasks.get(tid) if it is not None else None
            if task is None:
                reason = "unknown"
            elif fenced:
                reason = "fenced"
            elif task.status == "done" or (n, tid) in seen:
                reason = "duplicate"
            elif it.sealed:
                reason = "sealed"
            else:
                seen.add((n, tid))
                fresh[n].append((tid, tokens, nbytes))
                continue
            refused.append((n, tid, reason))
        for n, tid, _, _ in groups:  # each group's slot is free on arrival
            w.held.discard((n, tid))
        for n, tid, reason in refused:
            self.inc("elasticrl_scheduler_results_refused_total", run=run.rid, reason=reason)
            if reason != "unknown" and n in its:
                its[n].c[f"refused_{reason}"] += 1
                its[n].node(w.mid)["refused"] += 1
        for n in sorted(fresh):
            it = its[n]
            node = it.node(w.mid)
            for tid, tokens, nbytes in fresh[n]:
                task = it.tasks[tid]
                self.cancel_copies(run, it, task, keep=w.mid)
                task.holders.clear()
                task.status = "done"
                node["done"] += 1
                node["tokens"] += tokens
                self.inc("elasticrl_scheduler_results_accepted_total", run=run.rid)
                self.inc("elasticrl_scheduler_trajectory_bytes_total", nbytes, run=run.rid)
        touched = sorted({*fresh, *(n for n, _, reason in refused if reason != "unknown" and n in its)})
        for n in touched:
            self.maybe_seal(run, its[n])
        if fenced and groups:
            w.expect_end = "fenced results"
        return sum(len(b) for b in fresh.values()), sorted((tid, reason) for _, tid, reason in refused)

    def release(self, run: MRun, w: FakeWorker, n: int, tids: list[str], failed: bool, env_errors: int) -> None:
        it = run.kept_iters().get(n)
        if it is None:
            for tid in tids:
                w.held.discard((n, tid))
            return
        if failed and not it.sealed:
            it.c["env_errors"] += env_errors
            self.inc("elasticrl_scheduler_env_errors_total", env_errors, run=run.rid)
        given_up = []
        for tid in tids:
            if (n, tid) not in w.held:
                continue
            w.held.discard((n, tid))
            task = it.tasks.get(tid)
            if it.sealed or task is None:
                continue
            if failed and task.status == "running":
                task.failures += 1
                if task.failures >= it.max_failures:
                    given_up.append(task)
                    continue
            self.requeue(run, it, task, w.mid)
        for task in given_up:
            task.status = "failed"
            task.holders.discard(w.mid)
            self.cancel_copies(run, it, task)
            task.holders.clear()
        if given_up:
            self.maybe_seal(run, it)


# -- reading what the coordinator reports ---------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=HTTP_TIMEOUT_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def parse_metrics(text: str) -> tuple[dict, dict]:
    """(samples keyed by (name, frozenset(labels)), family type of each sample name)."""
    samples, kinds = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"sample {key} appears twice"
            samples[key] = s.value
            kinds[s.name] = family.type
    return samples, kinds


def is_monotonic(name: str, kind: str) -> bool:
    if name.endswith("_created"):
        return False
    return (kind == "counter" and name.endswith(COUNTERS)) or (kind == "histogram" and name.endswith(HIST))


def run_of(key) -> str | None:
    return dict(key[1]).get("run")


class Reporter:
    """What the coordinator reports, read back and compared with the model."""

    def __init__(self, address: str, metrics_port: int, model: Model):
        self.address, self.port, self.model = address, metrics_port, model
        self.client = SchedulerClient(address, call_timeout_s=5, reconnect_timeout_s=5)
        self.last: dict = {}
        self.scrapes = 0

    def scrape(self) -> dict:
        status, body = http_get(self.port, "/healthz")
        assert (status, body) == (200, "ok\n"), (status, body)
        status, text = http_get(self.port, "/metrics")
        assert status == 200, (status, text[-500:])
        samples, kinds = parse_metrics(text)
        # The strict reader of the other metrics tests agrees, label escaping included.
        strict = parse_exposition(text)
        assert {k: v for k, v in strict.items() if not k[0].endswith("_created")} == {
            k: v for k, v in samples.items() if not k[0].endswith("_created")}, "the two exposition readers disagree"
        for key, value in samples.items():
            assert math.isfinite(value) and value >= 0, f"{key} = {value}"
        # Counters never go down; a series of a run that was not dropped never vanishes.
        for key, old in self.last.items():
            if run_of(key) in self.model.dropped_runs:
                continue
            if is_monotonic(key[0], self.kinds.get(key[0], "")):
                assert key in samples, f"counter series {key} vanished (its run was not dropped)"
                assert samples[key] >= old, f"counter {key} went down: {old} -> {samples[key]}"
        self.last, self.kinds = samples, kinds
        self.scrapes += 1
        return samples

    def metric_problems(self, samples: dict) -> list[str]:
        m, out = self.model, []
        for key, value in samples.items():
            rid = run_of(key)
            if rid is not None and rid not in m.runs:
                out.append(f"series of a run the coordinator does not hold: {key} = {value}")
        # every labelled counter the coordinators counts
        for key, value in samples.items():
            if run_of(key) in m.runs and is_monotonic(key[0], self.kinds.get(key[0], "")):
                name = key[0]
                if name.endswith(("_bucket", "_sum")) or name == "elasticrl_rpcs_received_total":
                    continue
                if m.counters.get(key, 0) != value:
                    out.append(f"{name}{dict(key[1])} = {value}, model {m.counters.get(key, 0)}")
        for key, value in m.counters.items():
            if value and samples.get(key, 0) != value:
                out.append(f"{key[0]}{dict(key[1])} = {samples.get(key, 0)}, model {value}")
        for name in ("elasticrl_barrier_wait_seconds", "elasticrl_scheduler_seal_seconds"):
            for rid in m.runs:
                count = samples.get((f"{name}_count", frozenset({("run", rid)})), 0)
                inf = samples.get((f"{name}_bucket", frozenset({("run", rid), ("le", "+Inf")})), 0)
                if count != inf:
                    out.append(f"{name}{{run={rid}}}: count {count} != +Inf bucket {inf}")

        def gauge(name, **labels):
            return samples.get((name, frozenset(labels.items())))

        for rid, run in m.runs.items():
            by_state = collections.Counter(x.state for x in run.members.values())
            for state in ("live", "left", "evicted"):
                if gauge("elasticrl_members", run=rid, state=state) != by_state[state]:
                    out.append(f"members{{{rid},{state}}} = {gauge('elasticrl_members', run=rid, state=state)}, model {by_state[state]}")
            if gauge("elasticrl_run_epoch", run=rid) != run.epoch:
                out.append(f"epoch{{{rid}}} = {gauge('elasticrl_run_epoch', run=rid)}, model {run.epoch}")
            if gauge("elasticrl_barriers_open", run=rid) != len(run.barriers):
                out.append(f"barriers_open{{{rid}}} = {gauge('elasticrl_barriers_open', run=rid)}, model {sorted(run.barriers)}")
            workers = sum(w.active for w in run.workers)
            got = gauge("elasticrl_scheduler_workers", run=rid)
            if got != (workers if run.sched_seen else None):
                out.append(f"scheduler_workers{{{rid}}} = {got}, model {workers if run.sched_seen else None}")
            it = m.latest(run)
            got = gauge("elasticrl_scheduler_iteration", run=rid)
            if got != (None if it is None else it.n):
                out.append(f"scheduler_iteration{{{rid}}} = {got}, model {None if it is None else it.n}")
            if it is not None:
                for state in ("queued", "running", "done", "dropped", "failed"):
                    got = gauge("elasticrl_scheduler_tasks", run=rid, state=state)
                    if got != it.count(state):
                        out.append(f"scheduler_tasks{{{rid},{state}}} (iteration {it.n}) = {got}, model {it.count(state)}")
        return out

    def status_problems(self, data: dict, *, cli: bool = False) -> list[str]:
        m, out = self.model, []
        runs = {r["snapshot"]["run_id"]: r for r in data.get("runs") or []}
        if set(runs) != set(m.runs):
            out.append(f"status lists runs {sorted(runs)}, model {sorted(m.runs)}")
        assert float(data["uptime_s"]) >= 0
        for rid, run in m.runs.items():
            r = runs.get(rid)
            if r is None:
                continue
            snap = r["snapshot"]
            if int(snap["epoch"]) != run.epoch or bool(snap["closed"]) != run.closed:
                out.append(f"status {rid}: epoch {snap['epoch']} closed {snap['closed']}, model {run.epoch} {run.closed}")
            live = {x["member_id"]: int(x["incarnation"]) for x in snap.get("members") or []}
            want = {x.mid: x.inc for x in run.live()}
            if live != want:
                out.append(f"status {rid}: live members {live}, model {want}")
            departed = {x["member_id"]: x["state"].removeprefix("MEMBER_STATE_").lower() for x in r.get("departed") or []}
            want = {x.mid: x.state for x in run.members.values() if x.state != "live"}
            if departed != want:
                out.append(f"status {rid}: departed {departed}, model {want}")
            for x in (snap.get("members") or []) + (r.get("departed") or []):
                if int(x["lease_left_ms"]) < 0 or (x["state"] != "MEMBER_STATE_LIVE" and int(x["lease_left_ms"]) != 0):
                    out.append(f"status {rid}: lease_left_ms {x['lease_left_ms']} of {x['member_id']} ({x['state']})")
            if int(r.get("kv_keys", 0)) != len(run.kv):
                out.append(f"status {rid}: kv_keys {r.get('kv_keys')}, model {len(run.kv)}")
            names = sorted(b["name"] for b in r.get("open_barriers") or [])
            if names != sorted(run.barriers):
                out.append(f"status {rid}: open barriers {names}, model {sorted(run.barriers)}")
            for b in r.get("open_barriers") or []:
                if int(b["age_ms"]) < 0 or int(b["timeout_ms"]) <= 0:
                    out.append(f"status {rid}: barrier {b}")
                mb = run.barriers.get(b["name"])
                if mb is not None and sorted(b.get("waiting_for") or []) != m.waiting_for(run, mb):
                    out.append(f"status {rid}: barrier {b['name']} waits for {b.get('waiting_for')}, model {m.waiting_for(run, mb)}")
            if cli:
                it = m.latest(run)
                got = r.get("iteration")
                if (got is None) != (it is None):
                    out.append(f"status --json {rid}: iteration {got and got['iteration']}, model {it and it.n}")
                elif it is not None:
                    out += [f"status --json {rid}: {p}" for p in self.manifest_problems(run, it, got)]
        return out

    def manifest_problems(self, run: MRun, it: MIter, got: dict) -> list[str]:
        out = []
        for k, v in got.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (not math.isfinite(v) or v < 0):
                out.append(f"{k} = {v}")
        for n in got["nodes"]:
            for k, v in n.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and (not math.isfinite(v) or v < 0):
                    out.append(f"node {n['node']}: {k} = {v}")
        want = {
            "iteration": it.n, "sealed": it.sealed, "tasks_total": len(it.tasks), "tasks_done": it.count("done"),
            "tasks_queued": it.count("queued"), "tasks_running": it.count("running"), "tasks_failed": it.count("failed"),
            "requeued": it.c["requeued"], "refused_duplicate": it.c["refused_duplicate"],
            "refused_fenced": it.c["refused_fenced"], "refused_sealed": it.c["refused_sealed"],
            "env_errors": it.c["env_errors"], "groups_lost": 0, "backups_issued": 0,
            "tokens": sum(x["tokens"] for x in it.nodes.values()), "evicted": it.evicted,
        }
        for k, v in want.items():
            if got[k] != v:
                out.append(f"iteration {it.n}: {k} = {got[k]!r}, model {v!r}")
        running = collections.Counter(mid for t in it.tasks.values() if t.status == "running" for mid in t.holders)
        nodes = {n["node"]: (n["assigned"], n["done"], n["refused"], n["tokens"], n["running"], n["evicted"]) for n in got["nodes"]}
        want_nodes = {mid: (c["assigned"], c["done"], c["refused"], c["tokens"], running[mid], bool(c["evicted"]))
                      for mid, c in it.nodes.items()}
        if nodes != want_nodes:
            out.append(f"iteration {it.n}: nodes {nodes}, model {want_nodes}")
        if not it.sealed and got["sealed_ago_s"] != 0:
            out.append(f"iteration {it.n}: open with sealed_ago_s {got['sealed_ago_s']}")
        return out

    def problems(self) -> list[str]:
        m = self.model
        out = self.metric_problems(self.scrape())
        out += self.status_problems(self.client.status(include_departed=True))
        for rid, run in m.runs.items():
            latest = self.client.iteration_status(rid)
            it = m.latest(run)
            if (latest is None) != (it is None) or (latest is not None and latest["iteration"] != it.n):
                out.append(f"iteration_status({rid}) latest {latest and latest['iteration']}, model {it and it.n}")
            for n, it in run.iters.items():
                got = self.client.iteration_status(rid, n)
                if it.dropped:
                    if got is not None:
                        out.append(f"iteration {n} of {rid} was dropped by retention but still reported")
                elif got is None:
                    out.append(f"iteration {n} of {rid} not reported")
                else:
                    out += [f"{rid}: {p}" for p in self.manifest_problems(run, it, got)]
        for rid in m.dropped_runs:
            if self.client.iteration_status(rid) is not None:
                out.append(f"dropped run {rid} still has an iteration")
        return out

    def cli_status(self) -> dict:
        proc = subprocess.run(
            [sys.executable, "-m", "elasticrl", "status", "--coordinator", self.address, "--json", "--all"],
            cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)


# -- the random walk -------------------------------------------------------------------------------


class Walk:
    def __init__(self, seed: int, coord, metrics_port: int, metrics_port_file: pathlib.Path):
        self.seed, self.rng, self.coord = seed, random.Random(seed), coord
        self.model = Model()
        self.client = SchedulerClient(coord.address, call_timeout_s=5, reconnect_timeout_s=5)
        self.channel = self.client._channel
        self.keeper = Keeper(coord.address)
        self.reporter = Reporter(coord.address, metrics_port, self.model)
        self.rids = run_ids(self.rng)
        self.mids = itertools.count()
        self.names = itertools.count()
        self.batches = itertools.count()
        self.step = 0
        self.log: list[str] = []
        self.cli_checks = 0
        self.restarts = 0
        self.metrics_port_file = metrics_port_file

    def close(self) -> None:
        for run in self.model.runs.values():
            for w in run.workers:
                if not w.ended:
                    w.call.cancel()
        self.keeper.close()
        self.client.close()
        self.reporter.client.close()

    def note(self, text: str) -> None:
        self.log.append(f"step {self.step}: {text}")

    def fail(self, what: str) -> None:
        raise AssertionError(
            f"seed {self.seed}, step {self.step}: {what}\nwhat happened:\n  " + "\n  ".join(self.log[-25:])
            + f"\ncoordinator log tail:\n{self.coord.log()[-3000:]}"
        )

    # -- keeping the model up with what the workers receive

    def pump(self) -> None:
        for run in list(self.model.runs.values()):
            for w in run.workers:
                while True:
                    try:
                        msg = w.inbox.get_nowait()
                    except queue.Empty:
                        break
                    self.received(run, w, msg)

    def received(self, run: MRun, w: FakeWorker, msg) -> None:
        if isinstance(msg, tuple):
            _, err = msg
            w.ended, w.end_error = True, err
            if w.closed_by_us:
                return
            code = err.code() if err is not None else None
            if w.expect_end is None or (code != grpc.StatusCode.FAILED_PRECONDITION and w.expect_end != "restart"):
                self.fail(f"the stream of {w.mid} ({run.rid}) ended unexpectedly: {code} "
                          f"{err.details() if err is not None else ''} (expected: {w.expect_end})")
            return
        kind = msg.WhichOneof("kind")
        if kind == "assign":
            for a in msg.assign.tasks:
                try:
                    self.model.assigned(run, w, a.iteration, a.task.task_id)
                except AssertionError as exc:
                    self.fail(str(exc))
        elif kind == "cancel":
            for tid in msg.cancel.task_ids:
                key = (msg.cancel.iteration, tid)
                if key not in w.expected_cancels:
                    self.fail(f"{w.mid} got an unexpected cancel of {key}")
                w.expected_cancels.discard(key)
        elif kind == "ack":
            if not w.expected_acks:
                self.fail(f"{w.mid} got an ack nobody expected: {msg.ack}")
            accepted, refused = w.expected_acks.popleft()
            got = (msg.ack.accepted, sorted((r.task_id, r.reason.split(":")[0]) for r in msg.ack.refused))
            if got != (accepted, refused):
                self.fail(f"{w.mid}'s ack {got} differs from the model's {(accepted, refused)}")
        else:
            self.fail(f"{w.mid} got an unexpected message {msg}")

    def unsettled(self) -> list[str]:
        out = []
        for run in self.model.runs.values():
            queued = [(n, t.tid) for n, it in run.kept_iters().items() if not it.sealed
                      for t in it.tasks.values() if t.status == "queued"]
            for w in run.workers:
                takes = [key for key in queued if key not in w.held]  # (not a copy it still runs)
                if w.free and takes:
                    out.append(f"{run.rid}: {takes} queued while {w.mid} has {w.free} free slot(s)")
            for w in run.workers:
                if w.expected_acks or w.expected_cancels:
                    out.append(f"{w.mid}: waits for acks {list(w.expected_acks)} / cancels {sorted(w.expected_cancels)}")
                if w.expect_end and not w.ended:
                    out.append(f"{w.mid}: its stream has not ended yet ({w.expect_end})")
        return out

    def settle(self, what: str) -> None:
        """Wait until the workers got what the coordinator sent and everything it reports is the model's."""
        self.note(what)
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.pump()
            problems = self.unsettled() or self.reporter.problems()
            if not problems:
                return
            if time.monotonic() > deadline:
                self.fail(f"after {SETTLE_S:g}s: " + "\n    ".join(problems))
            time.sleep(0.03)

    def wait_for(self, predicate, what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.pump()
            if time.monotonic() > deadline:
                self.fail(f"timed out after {timeout_s:g}s waiting for {what}")
            time.sleep(0.02)

    def member_state(self, rid: str, mid: str) -> tuple[str, int] | None:
        for r in self.client.status(rid, include_departed=True)["runs"]:
            for x in (r["snapshot"].get("members") or []) + (r.get("departed") or []):
                if x["member_id"] == mid:
                    return x["state"].removeprefix("MEMBER_STATE_").lower(), int(x["incarnation"])
        return None

    # -- choices

    def open_runs(self) -> list[MRun]:
        return [r for r in self.model.runs.values() if not r.closed]

    def pick_run_for_new_work(self) -> tuple[str, bool]:
        """A run id for a join or submit: an open run, or a new one (maybe at the --max-runs limit)."""
        runs = self.open_runs()
        if runs and self.rng.random() < 0.85:
            return self.rng.choice(runs).rid, False
        return next(self.rids), True

    # -- operations: each returns False when it does not apply now

    def op_join(self) -> bool:
        rid, new = self.pick_run_for_new_work()
        if not new and self.rng.random() < 0.1:
            rid = self.rng.choice(list(self.model.runs))  # maybe a closed one: refused
        run = self.model.runs.get(rid)
        candidates = [] if run is None else list(run.members)
        if candidates and self.rng.random() < 0.3:
            mid = self.rng.choice(candidates)  # a rejoin, or the replacement of a live incarnation
        else:
            mid = self.rng.choice(["m{k}", "node:{k}@h", "w-{k}.gpu=0+1"]).format(k=next(self.mids))
        kept = self.rng.random() < 0.5
        victim = self.model.would_create(rid)
        try:
            joined = self.client.join(rid, mid, lease_ttl_s=KEPT_TTL_S if kept else LONG_TTL_S)
        except ResourceLimitError:
            assert victim == "refused", f"join of a new run {rid} was refused, model drops {victim}"
            self.settle(f"join {mid} to new run {rid}: refused (--max-runs)")
            return True
        except RunClosedError:
            assert run is not None and run.closed, f"join {mid} to {rid} refused as closed"
            self.settle(f"join {mid} to closed run {rid}: refused")
            return True
        assert victim != "refused", f"join to a new run {rid} was accepted at the --max-runs limit"
        assert run is None or not run.closed, f"join {mid} to closed run {rid} accepted"
        assert joined.incarnation > self.model.incarnation, f"incarnation {joined.incarnation} after {self.model.incarnation}"
        self.model.incarnation = joined.incarnation
        run = self.model.create(rid)
        old = self.model.join(run, mid, joined.incarnation, kept)
        if old is not None:
            self.keeper.discard(rid, mid, old.inc)
        if kept:
            self.keeper.add(rid, mid, joined.incarnation)
        self.settle(f"join {mid} -> {rid} incarnation {joined.incarnation}" + (f" (replaced {old.inc})" if old else "")
                    + (f" (dropped run {victim})" if victim else "") + (" kept" if kept else ""))
        return True

    def op_leave(self) -> bool:
        live = [(r, m) for r in self.model.runs.values() for m in r.live()]
        if not live:
            return False
        run, m = self.rng.choice(live)
        self.keeper.discard(run.rid, m.mid, m.inc)
        self.client.leave(run.rid, m.mid, m.inc, "random walk")
        self.model.leave(run, m)
        self.settle(f"leave {m.mid} ({run.rid})")
        return True

    def op_stall(self) -> bool:
        kept = [(r, m) for r in self.model.runs.values() for m in r.live() if m.kept]
        if not kept:
            return False
        run, m = self.rng.choice(kept)
        self.keeper.discard(run.rid, m.mid, m.inc)
        self.wait_for(lambda: self.member_state(run.rid, m.mid) == ("evicted", m.inc), f"{m.mid}'s lease to expire",
                      KEPT_TTL_S + 5)
        self.model.evict(run, m, "lease_expired")
        self.settle(f"stall {m.mid} ({run.rid}): lease expired")
        return True

    def op_connect(self) -> bool:
        free = [(r, m) for r in self.open_runs() for m in r.live()
                if (w := r.worker_of(m.mid)) is None or w.inc != m.inc]
        if not free:
            return False
        run, m = self.rng.choice(free)
        old = run.worker_of(m.mid)
        if old is not None:  # an older incarnation's fenced stream: the coordinator ends it
            old.expect_end = "a newer stream"
        w = FakeWorker(self.channel, run.rid, m.mid, m.inc, self.rng.randint(1, 3))
        run.workers.append(w)
        run.sched_seen = True
        self.settle(f"connect {m.mid} ({run.rid}) with {w.slots} slot(s)")
        return True

    def op_drop_stream(self) -> bool:
        active = [(r, w) for r in self.open_runs() for w in r.workers if w.active]
        if not active:
            return False
        run, w = self.rng.choice(active)
        m = run.members[w.mid]
        self.keeper.discard(run.rid, m.mid, m.inc)
        w.close()
        self.model.requeue_holdings(run, w)
        self.wait_for(lambda: self.member_state(run.rid, m.mid) == ("evicted", m.inc), f"{m.mid} evicted for its lost stream")
        self.model.evict(run, m, "stream_lost")
        self.settle(f"drop the stream of {w.mid} ({run.rid})")
        return True

    def op_close_fenced(self) -> bool:
        fenced = [(r, w) for r in self.model.runs.values() for w in r.workers
                  if w.fenced and not w.ended and not w.closed_by_us and w.expect_end is None]
        if not fenced:
            return False
        run, w = self.rng.choice(fenced)
        w.close()
        self.settle(f"close the fenced stream of {w.mid} ({run.rid})")
        return True

    def op_submit(self) -> bool:
        rid, _ = self.pick_run_for_new_work()
        run = self.model.runs.get(rid)
        if run is not None and run.iters and self.rng.random() < 0.1:  # the same tasks again: nothing new
            n = self.rng.choice(list(run.kept_iters()) or [0])
            if n and not run.closed:
                it = run.iters[n]
                created = self.client.submit_iteration(rid, n, [TaskSpec(task_id=t, prompt_ids=[1]) for t in it.tasks])
                assert created is False
                self.settle(f"submit {rid}/{n} again: not created")
                return True
        n = 1 if run is None else run.next_iter + self.rng.choice([0, 0, 1])
        k = self.rng.randint(1, 5)
        max_failures = self.rng.randint(1, 3)
        deadline = self.rng.random() < 0.3
        short_lease = not deadline and self.rng.random() < 0.15
        fraction = self.rng.choice([0.01, 0.5, 1.0])
        specs = [TaskSpec(task_id=f"t{i}", prompt_ids=[1, i], num_samples=self.rng.randint(1, 2)) for i in range(k)]
        victim = self.model.would_create(rid)
        try:
            self.client.submit_iteration(
                rid, n, specs, max_task_failures=max_failures,
                deadline_s=0.001 if deadline else 0.0, min_fraction=fraction if deadline else 1.0,
                task_lease_s=TASK_LEASE_S if short_lease else 0.0)
        except ResourceLimitError:
            assert victim == "refused", f"submit to new run {rid} refused, model drops {victim}"
            self.settle(f"submit to new run {rid}: refused (--max-runs)")
            return True
        assert victim != "refused", f"submit to a new run {rid} accepted at the --max-runs limit"
        run = self.model.create(rid)
        need = math.ceil(fraction * k - 1e-9) if deadline else None
        run.iters[n] = MIter(n, {s.task_id: MTask(s.task_id, i) for i, s in enumerate(specs)}, max_failures, need,
                             short_lease=short_lease)
        run.next_iter = n + 1
        run.sched_seen = True
        self.settle(f"submit {rid}/{n}: {k} task(s), max_failures {max_failures}"
                    + (f", deadline, need {need}" if deadline else "") + (", short task lease" if short_lease else "")
                    + (f" (dropped run {victim})" if victim else ""))
        return True

    def group(self, n: int, tid: str) -> tuple[spb.TrajectoryGroup, int, int]:
        samples, tokens, nbytes = [], 0, 0
        for _ in range(self.rng.randint(1, 2)):
            t = self.rng.randint(1, 6)
            text = self.rng.choice(TEXTS)
            mask = bytes(self.rng.randint(0, 1) for _ in range(t)) if self.rng.random() < 0.3 else b""
            samples.append(spb.Sample(
                completion_ids=array.array("i", range(t)).tobytes(), logprobs=array.array("f", [-0.5] * t).tobytes(),
                reward=self.rng.choice([0.0, 1.0]), finish_reason="stop", text=text, loss_mask=mask))
            tokens += t
            nbytes += 8 * t + len(mask) + len(text.encode())
        return spb.TrajectoryGroup(iteration=n, task_id=tid, samples=samples), tokens, nbytes

    def send_results(self, run: MRun, w: FakeWorker, keys: list[tuple[int, str]], what: str) -> None:
        groups, model_groups = [], []
        for n, tid in keys:
            g, tokens, nbytes = self.group(n, tid)
            groups.append(g)
            model_groups.append((n, tid, tokens, nbytes))
        w.send(spb.WorkRequest(results=spb.ResultBatch(groups=groups, batch_id=f"b{self.seed}-{next(self.batches)}")))
        w.expected_acks.append(self.model.results(run, w, model_groups))
        self.settle(f"{what}: {w.mid} ({run.rid}) sends {keys}")

    def extra_keys(self, run: MRun, w: FakeWorker) -> list[tuple[int, str]]:
        """Results the batch carries besides the worker's own: a duplicate, a sealed one, a task
        another worker runs or nobody runs yet, a task that does not exist."""
        its = run.kept_iters()
        pool = {
            "done": [(n, t.tid) for n, it in its.items() for t in it.tasks.values() if t.status == "done"],
            "sealed": [(n, t.tid) for n, it in its.items() if it.sealed for t in it.tasks.values() if t.status != "done"],
            "other": [(n, t.tid) for n, it in its.items() if not it.sealed for t in it.tasks.values()
                      if t.status in ("queued", "running", "failed") and (n, t.tid) not in w.held],
            "unknown": [(self.rng.choice(list(its) or [1]), "nope"), (999, "t0")],
        }
        out = []
        for keys in pool.values():
            if keys and self.rng.random() < 0.25:
                out.append(self.rng.choice(keys))
        return out

    def op_results(self) -> bool:
        busy = [(r, w) for r in self.model.runs.values() for w in r.workers if w.active and (w.held or self.rng.random() < 0.2)]
        if not busy:
            return False
        run, w = self.rng.choice(busy)
        held = sorted(w.held)
        keys = self.rng.sample(held, self.rng.randint(1, len(held))) if held else []
        keys += self.extra_keys(run, w)
        if keys and self.rng.random() < 0.15:
            keys.append(keys[0])  # the same task twice in one batch
        if not keys:
            return False
        self.send_results(run, w, keys, "results")
        return True

    def op_fenced_results(self) -> bool:
        fenced = [(r, w) for r in self.model.runs.values() for w in r.workers
                  if w.fenced and not w.ended and not w.closed_by_us and w.expect_end is None]
        if not fenced:
            return False
        run, w = self.rng.choice(fenced)
        its = run.kept_iters()
        keys = [(n, t) for n, it in its.items() for t in it.tasks]
        keys = self.rng.sample(keys, min(len(keys), self.rng.randint(1, 2))) + ([(7777, "t0")] if self.rng.random() < 0.3 else [])
        if not keys:
            return False
        self.send_results(run, w, keys, "late results of a fenced worker")
        return True

    def op_release(self) -> bool:
        workers = [(r, w) for r in self.model.runs.values() for w in r.workers
                   if (w.active and w.held) or (w.fenced and not w.ended and not w.closed_by_us and w.expect_end is None)]
        if not workers:
            return False
        run, w = self.rng.choice(workers)
        held = sorted(w.held)
        if held:
            n = self.rng.choice(held)[0]
            tids = [t for i, t in held if i == n]
            tids = self.rng.sample(tids, self.rng.randint(1, len(tids)))
        else:
            n, tids = self.rng.choice(list(run.iters) or [1]), ["t0"]
        if self.rng.random() < 0.2:
            tids.append("t4")  # maybe not one it holds: ignored
        if self.rng.random() < 0.1:
            n = 4242  # an iteration the coordinator does not hold: ignored
        failed = self.rng.random() < 0.6
        env_errors = self.rng.randint(0, 3) if failed else 0
        reason = f"env fake.step() raised: attempt {self.step}" if failed else "random walk gives it back"
        w.send(spb.WorkRequest(release=spb.ReleaseTasks(iteration=n, task_ids=tids, reason=reason, failed=failed,
                                                        env_errors=env_errors)))
        self.model.release(run, w, n, tids, failed, env_errors)
        self.settle(f"release {n}/{tids} by {w.mid} ({run.rid}) failed={failed} env_errors={env_errors}")
        return True

    def arrive(self, run: MRun, m: MMember, name: str, timeout_s: float, policy: str) -> None:
        request = wire.arrive_request(run.rid, m.mid, m.inc, name, timeout_s=timeout_s, policy=policy, epoch=0, wait_s=0.001)
        self.client._call("Arrive", request, timeout_s=5)
        self.model.arrive(run, m, name)

    def op_barrier(self) -> bool:
        runs = [r for r in self.model.runs.values() if r.live()]
        if not runs:
            return False
        run = self.rng.choice(runs)
        live = run.live()
        kind = self.rng.choice(["long", "long", "short", "replay"])
        if kind == "replay":
            if not run.decided:
                return False
            name = self.rng.choice(sorted(run.decided))
            self.arrive(run, self.rng.choice(live), name, 60, "evict_missing")
            self.settle(f"arrive again at decided barrier {name} ({run.rid})")
            return True
        if kind == "long":
            if run.barriers and self.rng.random() < 0.6:
                name = self.rng.choice(sorted(run.barriers))
            else:
                name = f"iter-{next(self.names)}/sync"
            who = self.rng.sample(live, self.rng.randint(1, len(live)))
            for m in who:
                if m.state == "live":
                    self.arrive(run, m, name, 120, "evict_missing")
            self.settle(f"arrive at {name} ({run.rid}): {[m.mid for m in who]}")
            return True
        name, policy = f"short-{next(self.names)}", self.rng.choice(["report", "evict_missing"])
        most = len(live) - 1 if len(live) > 1 and self.rng.random() < 0.8 else len(live)
        who = self.rng.sample(live, self.rng.randint(1, most))
        if policy == "evict_missing":
            # At most one missing engine: the tasks of the first one evicted could go to the next
            # one before its own eviction (all in one decision), which the model cannot order.
            engines = [m for m in live if m not in who and (w := run.worker_of(m.mid)) is not None and w.active]
            who += engines[1:]
        for m in who:
            self.arrive(run, m, name, 0.5, policy)
        if name in run.barriers:
            def decided():
                return not any(b["name"] == name for r in self.client.status(run.rid)["runs"] for b in r.get("open_barriers") or [])
            self.wait_for(decided, f"barrier {name} to time out")
            self.model.timed_out(run, name, policy)
        self.settle(f"short barrier {name} ({run.rid}, {policy}): {[m.mid for m in who]} arrived")
        return True

    def op_close(self) -> bool:
        runs = self.open_runs()
        if not runs:
            return False
        run = self.rng.choice(runs)
        # Live engines leave first, as a stopping RolloutWorker does: closing a run with a live
        # engine counts it as a stream_lost eviction (the xfail test
        # test_close_run_does_not_count_its_engines_as_stream_lost_evictions).
        for w in list(run.workers):
            if w.active:
                m = run.members[w.mid]
                self.keeper.discard(run.rid, m.mid, m.inc)
                self.client.leave(run.rid, m.mid, m.inc, "engine stops")
                self.model.leave(run, m)
                # (what it held may go to the next engine before that one leaves: read it first)
                self.settle(f"{m.mid} leaves before run {run.rid} closes")
        if self.rng.random() < 0.5:
            proc = subprocess.run(
                [sys.executable, "-m", "elasticrl", "close-run", run.rid, "--coordinator", self.coord.address, "--reason", "walk"],
                cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
            assert proc.returncode == 0 and proc.stdout.strip() == f"run {run.rid} closed", (proc.returncode, proc.stdout, proc.stderr)
        else:
            self.client.close_run(run.rid, "walk")
        run.closed = True
        for w in run.workers:  # every stream of the run still open is ended with RUN_CLOSED
            if not w.ended and not w.closed_by_us and w.expect_end is None:
                w.expect_end = "run closed"
        if self.rng.random() < 0.7:  # the rest leave: the run can be dropped to make room
            for m in run.live():
                self.keeper.discard(run.rid, m.mid, m.inc)
                self.client.leave(run.rid, m.mid, m.inc, "done")
                self.model.leave(run, m)
        self.settle(f"close run {run.rid}")
        return True

    def op_kv(self) -> bool:
        """KV writes without a writer make their run (counted against --max-runs, like a join)."""
        runs = list(self.model.runs.values())
        run = self.rng.choice(runs) if runs and self.rng.random() < 0.85 else None
        if run is not None and run.kv and self.rng.random() < 0.3:
            key = self.rng.choice(sorted(run.kv))
            assert self.client.kv_delete(run.rid, key) is True
            run.kv.discard(key)
            self.settle(f"kv delete {key!r} ({run.rid})")
            return True
        rid = run.rid if run is not None else next(self.rids)
        keys = [f"k{self.rng.randint(0, 5)}/x".encode() for _ in range(self.rng.randint(1, 3))]
        victim = self.model.would_create(rid)
        try:
            self.client.kv_set(rid, {k: b"v" * self.rng.randint(0, 3) for k in keys})
        except ResourceLimitError:
            assert victim == "refused", f"kv set on new run {rid} refused, model drops {victim}"
            self.settle(f"kv set on new run {rid}: refused (--max-runs)")
            return True
        assert victim != "refused", f"kv set on a new run {rid} accepted at the --max-runs limit"
        self.model.create(rid).kv.update(keys)
        self.settle(f"kv set {keys} ({rid})" + (f" (dropped run {victim})" if victim else ""))
        return True

    def op_restart(self) -> bool:
        if self.coord.state_dir is None or self.restarts >= 1:
            return False
        self.pump()
        # kill -9, not SIGTERM: a SIGTERM'd coordinator evicts members whose keep-alives it no
        # longer takes (test_a_clean_shutdown_does_not_evict_members_it_stopped_listening_to).
        # The assignment counts reach SQLite at the tick (a crash loses at most one tick's): wait one.
        time.sleep(0.2)
        self.metrics_port_file.unlink()
        self.coord.kill()
        self.coord.start()
        port = wait_until(lambda: self.metrics_port_file.exists() and int(self.metrics_port_file.read_text() or 0), 10,
                          message="the metrics port file after the restart")
        self.restarts += 1
        self.reporter.port = port
        self.reporter.last = {}  # a restarted coordinator counts from zero (as Prometheus expects)
        self.model.restarted()
        self.settle("restart the coordinator (kill -9, same state dir)")
        return True

    OPS: typing.ClassVar[dict[str, float]] = {
        "join": 4, "leave": 1.5, "stall": 0.7, "connect": 5, "drop_stream": 0.7, "close_fenced": 0.7, "submit": 4,
        "results": 12, "fenced_results": 1.5, "release": 5, "barrier": 3, "close": 0.4, "kv": 1, "restart": 0.3,
    }

    def walk(self, steps: int) -> None:
        self.settle("start")
        names, weights = zip(*self.OPS.items())
        for self.step in range(1, steps + 1):
            for name in self.rng.choices(names, weights, k=20):
                if getattr(self, f"op_{name}")():
                    break
            if self.step % 16 == 0:
                self.cli_check()
        self.cli_check()

    def cli_check(self) -> None:
        self.pump()
        problems = self.reporter.status_problems(self.reporter.cli_status(), cli=True)
        if problems:
            self.fail("elasticrl status --json: " + "\n    ".join(problems))
        self.cli_checks += 1


def metrics_coordinator(coordinator_factory, tmp_path: pathlib.Path, *extra: str, **kwargs):
    """A coordinator serving metrics on a free port: (process, metrics port, the port's file)."""
    port_file = tmp_path / f"metrics-port-{len(list(tmp_path.glob('metrics-port-*')))}"
    coord = coordinator_factory(extra_args=["--metrics-port", "0", "--metrics-port-file", str(port_file), *extra], **kwargs)
    port = wait_until(lambda: port_file.exists() and int(port_file.read_text() or 0), 10, message="the metrics port file")
    return coord, port, port_file


@pytest.mark.parametrize("seed", SEEDS)
def test_what_the_coordinator_reports_matches_what_happened(seed, coordinator_factory, tmp_path):
    coord, port, port_file = metrics_coordinator(
        coordinator_factory, tmp_path, "--max-runs", str(MAX_RUNS), "--keep-iterations", str(KEEP_ITERATIONS),
        "--stream-grace", str(STREAM_GRACE_S), durable=seed % 2 == 0,
    )
    walk = Walk(seed, coord, port, port_file)
    try:
        walk.walk(STEPS)
    finally:
        walk.close()
    assert walk.reporter.scrapes >= STEPS and walk.cli_checks >= 1


# -- bugs found (fixed), each reduced to one focused test ------------------------------------------------------


def _gauge(port: int, name: str, **labels) -> float | None:
    status, text = http_get(port, "/metrics")
    assert status == 200
    return parse_metrics(text)[0].get((name, frozenset(labels.items())))


def _one_result(iteration: int, task_id: str) -> spb.WorkRequest:
    sample = spb.Sample(completion_ids=array.array("i", [5]).tobytes(), logprobs=array.array("f", [-0.5]).tobytes())
    group = spb.TrajectoryGroup(iteration=iteration, task_id=task_id, samples=[sample])
    return spb.WorkRequest(results=spb.ResultBatch(groups=[group], batch_id=f"b-{iteration}-{task_id}"))


def _next_message(w: FakeWorker, kind: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        msg = w.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, tuple):
            return msg
        if msg.WhichOneof("kind") == kind:
            return msg


@pytest.mark.timeout(60)
def test_close_run_does_not_count_its_engines_as_stream_lost_evictions(coordinator_factory, tmp_path):
    """``elasticrl close-run`` ends every Work stream of the run with RUN_CLOSED (``end_streams``);
    the servicer then detaches the stream as ``abrupt`` (scheduler/service.py ``Work``: "Always
    abrupt"), so STREAM_GRACE_S later the engine, alive and with a 60 s lease, is evicted with
    reason "its stream broke and did not reopen within 0.300s (the process died?)" and counted in
    ``elasticrl_member_evictions_total{reason="stream_lost"}``, whose HELP says "stream_lost (its
    stream broke and did not reopen in time)". Nothing broke: the coordinator closed it. (A real
    RolloutWorker that gets RUN_CLOSED raises without leaving, so every close-run with engines
    connected shows up as lost engines.)"""
    coord, port, _ = metrics_coordinator(coordinator_factory, tmp_path, "--stream-grace", str(STREAM_GRACE_S), durable=False)
    run = "closing"
    with SchedulerClient(coord.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
        joined = client.join(run, "engine", lease_ttl_s=60)
        w = FakeWorker(client._channel, run, "engine", joined.incarnation, 1)
        wait_until(lambda: _gauge(port, "elasticrl_scheduler_workers", run=run) == 1, 10, message="the engine connected")
        client.close_run(run, "training finished")
        _, err = _next_message(w, "end")
        assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        time.sleep(STREAM_GRACE_S + 0.5)  # past the stream grace, many ticks
        state = client.status(run, include_departed=True)["runs"][0]
        members = {m["member_id"]: (m["state"], m.get("reason", "")) for m in state["snapshot"].get("members", []) + state.get("departed", [])}
        evicted = _gauge(port, "elasticrl_member_evictions_total", run=run, reason="stream_lost") or 0
    assert evicted == 0 and members["engine"][0] == "MEMBER_STATE_LIVE", (evicted, members)


@pytest.mark.timeout(60)
def test_scheduler_iteration_gauge_keeps_the_newest_submitted_iteration(coordinator_factory, tmp_path):
    """Iterations 1, 2, 3 submitted; 3 seals first (iterations submitted ahead, as with
    rollout.max_staleness, finish out of order), then 1 and 2. ``_trim`` keeps the
    ``--keep-iterations`` (2) iterations that sealed LAST, so iteration 3, the newest, was dropped;
    ``SchedulerCore.latest`` is the highest number still held, so the gauge
    ``elasticrl_scheduler_iteration`` (HELP "Newest submitted iteration of each run.", and
    ``SchedulerGauges.iteration``: "Newest submitted iteration") goes from 3 back to 2, and
    ``elasticrl status`` / ``iteration_status(run)`` ("default: the run's newest") show iteration 2
    as the run's current one."""
    coord, port, _ = metrics_coordinator(coordinator_factory, tmp_path, "--keep-iterations", "2", durable=False)
    run = "ahead"
    with SchedulerClient(coord.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
        joined = client.join(run, "engine", lease_ttl_s=60)
        for n in (1, 2, 3):
            client.submit_iteration(run, n, [TaskSpec(task_id="t0", prompt_ids=[1])])
        assert _gauge(port, "elasticrl_scheduler_iteration", run=run) == 3
        w = FakeWorker(client._channel, run, "engine", joined.incarnation, 3)
        assert len(_next_message(w, "assign").assign.tasks) == 3
        for n in (3, 1, 2):
            w.send(_one_result(n, "t0"))
            client.wait_sealed(run, n, timeout_s=10)
        time.sleep(1.0)  # ticks after the seals, where retention drops what it drops (3 was dropped)
        assert client.iteration_status(run, 3) is not None
        gauge = _gauge(port, "elasticrl_scheduler_iteration", run=run)
        latest = client.iteration_status(run)["iteration"]
        w.close()
    assert (gauge, latest) == (3, 3), (gauge, latest)


@pytest.mark.timeout(90)
def test_a_clean_shutdown_does_not_evict_members_it_stopped_listening_to(coordinator_factory, tmp_path):
    """``CoordinatorServer.stop`` calls ``server.stop(grace_s=2.0)`` (new calls refused, running
    ones given up to 2 s) while the tick task still runs; it is cancelled only afterwards. A member
    whose lease is shorter than that window (here 1 s, renewed every 0.2 s) has its keep-alives
    refused and is evicted by the stopping coordinator, "lease expired (1.000s without
    keep-alive)", persisted, so the restarted coordinator reports it evicted (and its tasks
    requeued, its barriers released without it). README: "A member silent for one TTL is evicted"
    (it was not silent) and "After kill -9 and a restart, members ... are back; every live member
    gets one lease period to reconnect" -- a clean SIGTERM restart does worse than a kill -9."""
    coord, _, port_file = metrics_coordinator(coordinator_factory, tmp_path)
    run = "restarting"
    stop = threading.Event()
    with SchedulerClient(coord.address, call_timeout_s=2, reconnect_timeout_s=10) as client:
        joined = client.join(run, "m", lease_ttl_s=1.0)
        client.submit_iteration(run, 1, [TaskSpec(task_id="t0", prompt_ids=[1])])

        def keep_alive():
            while not stop.wait(0.2):
                try:
                    client.keep_alive(run, "m", joined.incarnation, retry_s=0.5)
                except ElasticRLError:
                    pass

        def wait_sealed():  # a call in flight when SIGTERM comes: the stop waits its grace for it
            try:
                client.wait_sealed(run, 1, timeout_s=3)
            except ElasticRLError:
                pass

        threads = [threading.Thread(target=f, daemon=True) for f in (keep_alive, wait_sealed)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        port_file.unlink()
        assert coord.stop() == 0
        coord.start()
        time.sleep(0.5)
        state = client.status(run, include_departed=True)["runs"][0]
        stop.set()
        for t in threads:
            t.join(15)
        members = {m["member_id"]: (m["state"], m.get("reason", "")) for m in state["snapshot"].get("members", []) + state.get("departed", [])}
    # The stopping coordinator evicts nobody (its tick ends first). The restarted one gives every
    # member one lease period to come back, which a 1 s lease across the client's reconnect may
    # miss: that eviction, if any, is the new coordinator's and says so after its start.
    log = coord.log()
    stopped = log.index("stopped")
    assert "evicted" not in log[:stopped], log[:stopped][-2000:]
    assert members["m"][0] == "MEMBER_STATE_LIVE" or "evicted" in log[log.index("serving", stopped):], members
