"""The worker side of the Work stream under seeded random schedules: in-process ``RolloutWorker``s
with a fake engine (varying latency and output size, tasks that raise, fail as environment
errors or produce results bigger than a batch), each connected through its own TCP proxy to a
real durable coordinator subprocess, while the coordinator is SIGKILLed and restarted on its
state dir and port, a worker's connections are reset, workers stop and new ones join, and the
coordinator cancels copies (backups that lost, tasks of an iteration sealed at its deadline).

Invariants checked per seed:
  * every task of a sealed iteration is done exactly once (its fetched group byte-identical to
    one result the engine produced for it, on the node that produced it) or is accounted failed
    or dropped as the seal reason says;
  * every group a worker saw acked as accepted is in the sealed iteration, with the same bytes,
    also when read again after later restarts, and no task is acked as accepted twice;
  * every ack matches the batch it pops (accepted + refused = the batch's groups);
  * every worker's outbox drains once the coordinator is healthy, and every worker stops cleanly
    within a hard timeout;
  * an engine never runs more tasks at once than its worker's slots (one task per call: all told;
    else the uncancelled tasks the worker still tracks, from whichever stream). Seed 6 failed this
    about once in 25 runs, and it could only be checked per stream, until a reopened stream's
    hello named the tasks still running: a stream closed on the coordinator first got all its
    slots anew while old copies ran, and an old copy's release could free the slot of a new copy
    handed out on the hello;
  * no task is run twice by one worker (one handed out again on a new stream while the worker ran
    it or held its result: the bug ``test_a_task_handed_out_again_...`` pins, fixed), and none is
    handed to a worker after its own result for it was acked as accepted.

More seeds: ``WORKER_RANDOM_SEEDS=7,8,9 pytest tests/integration/test_worker_random.py``.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import random
import signal
import threading
import time
import zlib

import pytest

from elasticrl.errors import FencedError
from elasticrl.scheduler import framing
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.state import GroupRecord, SampleRecord, TaskFailure, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker
from tests.conftest import wait_until
from tests.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.waits]

RUN = "wrand"
SEEDS = [int(s) for s in os.environ.get("WORKER_RANDOM_SEEDS", "1,2,3,4,5,6").split(",")]  # more: set it
HARD_TIMEOUT_S = 25.0  # any one wait: a seal, a worker's stop, an outbox drain
ALLOWED_REFUSALS = {"duplicate", "sealed"}  # nobody is fenced, nothing is malformed or unknown


# -- the fake engine ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the engine does with one task (a pure function of the seed and the task)."""

    latency_s: float
    tokens: int
    samples: int
    mode: str  # ok | raise_once | fail_once | always_fail
    ignore_cancel: bool


@dataclasses.dataclass(frozen=True)
class Production:
    member: str
    tag: str
    samples: tuple[tuple[bytes, bytes, float, str], ...]  # (ids, logprobs, reward, text) per sample


def _tokens(task_id: str, sample: int, n: int) -> bytes:
    base = zlib.crc32(task_id.encode()) % 50_000
    return array.array("i", [base + sample * 13 + k % 1000 for k in range(n)]).tobytes()


class Book:
    """What every engine produced and every worker saw acknowledged, across the whole seed."""

    def __init__(self, plans: dict[tuple[int, str], Plan]):
        self.plans = plans
        self.lock = threading.Lock()
        self.productions: dict[tuple[int, str], list[Production]] = collections.defaultdict(list)
        self.tags: dict[str, tuple[tuple[int, str], Production]] = {}
        self.attempts: collections.Counter[tuple[int, str]] = collections.Counter()
        self.first_failures: set[tuple[int, str]] = set()
        self.acked: dict[tuple[int, str], tuple[str, str]] = {}  # key -> (member, tag) acked as accepted
        self.refusals: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.fenced_by_own_leave = 0  # clean stops that raised FencedError (a known bug)
        self.seq = 0

    def error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)


class Engine:
    """``generate`` / ``generate_batch`` for one worker: sleeps its plan's latency (times this
    engine's speed), checking the cancel flag unless the plan ignores it, and returns groups
    whose sample text names the copy (member and attempt), so a stored group tells which copy it
    is."""

    def __init__(self, book: Book, member: str, slots: int, speed: float):
        self.book, self.member, self.slots, self.speed = book, member, slots, speed
        self.worker: TrackedWorker | None = None
        self.lock = threading.Lock()
        self.active: list[Assignment] = []
        self.max_running = 0  # tasks in the engine at once, all told
        self.max_tracked = 0  # ... of those the worker tracks (not cancelled), whichever stream handed them out
        self.twice = 0  # runs of a task this engine was already running (must stay 0)

    def _enter(self, batch: list[Assignment]) -> None:
        with self.lock:
            running = {(a.iteration, a.task.task_id) for a in self.active}
            self.twice += sum((a.iteration, a.task.task_id) in running for a in batch)
            self.active += batch
            self.max_running = max(self.max_running, len(self.active))
            # The coordinator's credits: what the worker still runs (a single get per key: the
            # event loop thread mutates the dict) never exceeds the slots, copies from an older
            # stream included (a reopened stream's hello names them). Left out: cancelled copies
            # (and a task handed out again, which the run checks never runs).
            tracked = sum(
                not a.cancelled.is_set() and not a.why and self.worker._running.get((a.iteration, a.task.task_id)) is a
                for a in self.active
            )
            self.max_tracked = max(self.max_tracked, tracked)

    def _leave(self, batch: list[Assignment]) -> None:
        with self.lock:
            for a in batch:
                self.active.remove(a)

    def _sleep(self, assignments: list[Assignment], latency_s: float) -> None:
        end = time.monotonic() + latency_s
        while (left := end - time.monotonic()) > 0:
            if all(a.cancelled.is_set() and not self.book.plans[(a.iteration, a.task.task_id)].ignore_cancel
                   for a in assignments):
                return
            time.sleep(min(0.005, left))

    def _outcome(self, a: Assignment) -> GroupRecord | TaskFailure | Exception:
        key = (a.iteration, a.task.task_id)
        plan = self.book.plans[key]
        with self.book.lock:
            self.book.attempts[key] += 1
            first = key not in self.book.first_failures
            if plan.mode in ("raise_once", "fail_once") and first:
                self.book.first_failures.add(key)
            self.book.seq += 1
            tag = f"{self.member}#{self.book.seq}"
        if plan.mode == "raise_once" and first:
            return RuntimeError(f"fake engine crashed on {a.task.task_id}")
        if plan.mode == "always_fail" or (plan.mode == "fail_once" and first):
            return TaskFailure(a.task.task_id, f"env fake.step() raised on {a.task.task_id}", env_errors=1)
        samples = []
        for j in range(plan.samples):
            ids = _tokens(a.task.task_id, j, plan.tokens)
            lps = array.array("f", [-0.25 * (j + 1)] * plan.tokens).tobytes()
            samples.append(SampleRecord(ids, lps, float(j % 3), "length", text=tag))
        production = Production(self.member, tag, tuple((s.completion_ids, s.logprobs, s.reward, s.text) for s in samples))
        with self.book.lock:
            self.book.productions[key].append(production)
            self.book.tags[tag] = (key, production)
        return GroupRecord(a.task.task_id, self.member, 0, 0.0, 0.0, samples)

    def generate(self, a: Assignment) -> GroupRecord | TaskFailure:
        self._enter([a])
        try:
            self._sleep([a], self.book.plans[(a.iteration, a.task.task_id)].latency_s * self.speed)
            out = self._outcome(a)
            if isinstance(out, Exception):
                raise out
            return out
        finally:
            self._leave([a])

    def generate_batch(self, batch: list[Assignment]) -> list[GroupRecord | TaskFailure]:
        self._enter(batch)
        try:
            self._sleep(batch, max(self.book.plans[(a.iteration, a.task.task_id)].latency_s for a in batch) * self.speed)
            outs = [self._outcome(a) for a in batch]
            crashed = next((o for o in outs if isinstance(o, Exception)), None)
            if crashed is not None:
                raise crashed  # the whole batch is given back
            return outs
        finally:
            self._leave(batch)


class TrackedWorker(RolloutWorker):
    """A ``RolloutWorker`` that books each ack against the batch it pops."""

    book: Book
    resent = 0  # unacknowledged batches sent again on a new stream
    rehanded = 0  # tasks handed to it that it still ran, or whose result was not acked yet
    after_accepted = 0  # tasks handed to it after its result for them was acked as accepted (must stay 0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepted_keys: set[tuple[int, str]] = set()

    async def _one_stream(self, executor):
        self.resent += len(self.unacked)
        return await super()._one_stream(executor)

    def _start(self, executor, messages) -> None:
        before = dict(self._running)
        sent = set()
        for request in self.unacked:
            _, spans = framing.result_batch_spans(request)
            sent |= {framing.group_key(request, a, b) for a, b in spans}
        sent |= {(i, g.task_id) for i, g in self._pending}
        # A done task is never handed out again. Handed to this worker after the ack of its own
        # result, it would run it again (the ack merged ahead of the assignment: outbox.Writer).
        self.after_accepted += sum((m.iteration, m.task.task_id) in self.accepted_keys for m in messages)
        super()._start(executor, messages)
        for key, a in self._running.items():
            if not hasattr(a, "why"):
                a.why = ("running" if key in before else "") + ("sent" if key in sent else "")
                self.rehanded += bool(a.why)

    def _ack(self, ack) -> None:
        if self.unacked:
            request = self.unacked[0]
            try:
                _, spans = framing.result_batch_spans(request)
                groups = [framing.read_group("g", request, a, b) for a, b in spans]
            except Exception as exc:  # noqa: BLE001 - booked as a failure of the test
                self.book.error(f"{self.member_id}: unreadable unacked batch: {exc!r}")
                groups = []
            refused = collections.Counter((r.iteration, r.task_id) for r in ack.refused)
            if ack.accepted + len(ack.refused) != len(groups):
                self.book.error(f"{self.member_id}: ack of {ack.accepted} accepted + {len(ack.refused)} refused "
                                f"popped a batch of {len(groups)} group(s)")
            with self.book.lock:
                for r in ack.refused:
                    self.book.refusals[r.reason.split(":")[0]] += 1
                for iteration, g in groups:
                    key = (iteration, g.task_id)
                    if refused[key]:
                        refused[key] -= 1
                        continue
                    tag = g.samples[0].text
                    if key in self.book.acked:
                        self.book.errors.append(f"{key} acked as accepted twice: {self.book.acked[key]} and {(self.member_id, tag)}")
                    self.book.acked[key] = (self.member_id, tag)
                    self.accepted_keys.add(key)
        else:
            self.book.error(f"{self.member_id}: an ack with nothing unacknowledged")
        super()._ack(ack)


# -- the cluster: in-process workers on one event loop thread -------------------------------------


@dataclasses.dataclass
class Handle:
    member: str
    worker: TrackedWorker
    engine: Engine
    proxy: TcpProxy
    future: object = None
    stop: asyncio.Event | None = None


class Cluster:
    def __init__(self, coordinator, book: Book, rng: random.Random):
        self.coordinator, self.book, self.rng = coordinator, book, rng
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="workers-loop")
        self.thread.start()
        self.live: dict[str, Handle] = {}
        self.gone: list[Handle] = []
        self.names = (f"w{i}" for i in range(100))
        self.lock = threading.Lock()

    def on_loop(self, coro, timeout_s: float = HARD_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def add(self, member: str | None = None) -> Handle:
        """A new worker; ``member``: a stopped one's id, to join again as a new incarnation."""
        member = member or next(self.names)
        slots = self.rng.choice([1, 1, 2, 3])
        engine = Engine(self.book, member, slots, self.rng.choice([0.5, 1.0, 1.0, 2.0]))
        proxy = TcpProxy(("127.0.0.1", self.coordinator.port))  # its reset_all() cuts the worker's stream
        batched = self.rng.random() < 0.3
        worker = TrackedWorker(
            f"127.0.0.1:{proxy.port}", RUN, member,
            None if batched else engine.generate, generate_batch=engine.generate_batch if batched else None,
            slots=slots, call_timeout_s=5.0, reconnect_timeout_s=HARD_TIMEOUT_S,
            batch_bytes=self.rng.choice([8 << 10, 64 << 10, 1 << 20]), linger_s=self.rng.choice([0.002, 0.01, 0.05]),
        )
        worker.book, engine.worker = self.book, worker
        h = Handle(member, worker, engine, proxy)

        async def run() -> None:
            h.stop = asyncio.Event()
            await h.worker.run(h.stop)

        h.future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        with self.lock:
            self.live[member] = h
        return h

    def stop(self, h: Handle) -> None:
        """A clean stop: the worker gives back what runs, flushes, waits for its acks and leaves."""
        with self.lock:
            self.live.pop(h.member, None)
        wait_until(lambda: h.stop is not None, 5, message=f"{h.member} started")
        self.loop.call_soon_threadsafe(h.stop.set)
        try:
            h.future.result(HARD_TIMEOUT_S)
        except FencedError as exc:
            if "(left: worker stopped)" in str(exc):  # its own leave (fixed: checked after the run)
                self.book.fenced_by_own_leave += 1
            else:
                self.book.error(f"{h.member} did not stop cleanly: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a timeout is a hang; anything else a failure
            self.book.error(f"{h.member} did not stop cleanly: {type(exc).__name__}: {exc}")
        if h.worker.unacked:
            self.book.error(f"{h.member} stopped with {len(h.worker.unacked)} unacknowledged batch(es)")
        h.proxy.close()
        self.gone.append(h)

    def outboxes(self) -> dict[str, tuple[int, int]]:
        async def read():
            return {m: (len(h.worker.unacked), len(h.worker._pending)) for m, h in list(self.live.items())}
        return self.on_loop(read())

    def close(self) -> None:
        """Tear down what a failed seed left running, without the clean stop's long waits."""
        for h in list(self.live.values()):
            if h.stop is not None:
                self.loop.call_soon_threadsafe(h.stop.set)
            with contextlib.suppress(Exception):
                h.future.result(3)
            h.future.cancel()
            h.proxy.close()
            self.gone.append(h)
        self.live.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- the schedule -----------------------------------------------------------------------------------


def make_iteration(rng: random.Random, iteration: int) -> tuple[list[TaskSpec], dict, dict]:
    n = rng.randint(5, 10)
    specs, plans = [], {}
    for k in range(n):
        task_id = f"i{iteration}-t{k:02d}"
        roll = rng.random()
        mode = ("raise_once" if roll < 0.08 else "fail_once" if roll < 0.16 else "always_fail" if roll < 0.2 else "ok")
        big = rng.random() < 0.12
        plans[(iteration, task_id)] = Plan(
            latency_s=rng.uniform(0.3, 0.7) if rng.random() < 0.15 else rng.uniform(0.005, 0.12),
            tokens=rng.randint(6_000, 20_000) if big else rng.randint(4, 64),
            samples=rng.randint(1, 3),
            mode=mode,
            ignore_cancel=rng.random() < 0.3,
        )
        specs.append(TaskSpec(task_id=task_id, prompt_ids=[iteration, k, rng.randint(0, 999)], num_samples=plans[(iteration, task_id)].samples))
    config: dict = {"policy": "static" if rng.random() < 0.2 else "dynamic"}
    if config["policy"] == "dynamic" and rng.random() < 0.5:
        config["backup_tasks"] = rng.randint(1, 3)
    if rng.random() < 0.25:
        config["deadline_s"] = rng.uniform(0.6, 1.5)
        config["min_fraction"] = rng.choice([0.3, 0.5])
    if rng.random() < 0.25:
        config["task_lease_s"] = rng.uniform(0.4, 1.0)  # copies whose lease lapses get a second copy
    return specs, plans, config


def chaos(cluster: Cluster, rng: random.Random, stop: threading.Event, events: list[str]) -> None:
    """Random events, one at a time, until ``stop`` (at most a handful: each costs reconnects)."""
    coordinator = cluster.coordinator
    budget = rng.randint(3, 6)
    while len(events) < budget and not stop.wait(rng.uniform(0.15, 0.6)):
        roll = rng.random()
        live = list(cluster.live.values())
        try:
            if roll < 0.3:
                coordinator.kill()
                time.sleep(rng.uniform(0.0, 0.4))
                coordinator.start()
                events.append("restart")
            elif roll < 0.6 and live:
                h = rng.choice(live)
                events.append(f"cut {h.member} ({h.proxy.reset_all()} conns)")
            elif roll < 0.8 and len(live) > 1:
                h = rng.choice(live)
                cluster.stop(h)
                events.append(f"stop {h.member}")
            elif len(live) < 3:
                again = [h.member for h in cluster.gone if h.member not in cluster.live]
                member = rng.choice(again) if again and rng.random() < 0.4 else None
                events.append(f"join {cluster.add(member).member}{' again' if member else ''}")
        except Exception as exc:  # noqa: BLE001
            cluster.book.error(f"chaos event failed: {type(exc).__name__}: {exc}")
            return


def fetch(client: SchedulerClient, iteration: int, world_size: int) -> dict:
    groups = []
    for rank in range(world_size):
        groups += client.fetch_shard(RUN, iteration, rank=rank, world_size=world_size)
    ids = [g.task_id for g in groups]
    assert len(ids) == len(set(ids)), f"iteration {iteration}: a task stored twice: {sorted(ids)}"
    return {g.task_id: g for g in groups}


def check_iteration(book: Book, iteration: int, specs: list[TaskSpec], manifest: dict, fetched: dict) -> None:
    where = f"iteration {iteration} ({manifest['seal_reason']})"
    total, done, failed = len(specs), manifest["tasks_done"], manifest["tasks_failed"]
    assert manifest["sealed"] and manifest["tasks_total"] == total, (where, manifest)
    assert (manifest["tasks_queued"], manifest["tasks_running"]) == (0, 0), (where, manifest)
    assert len(fetched) == done, (where, sorted(fetched), manifest)
    by_id = {s.task_id: s for s in specs}
    always_fail = {t for (i, t), p in book.plans.items() if i == iteration and p.mode == "always_fail"}
    for task_id, g in fetched.items():
        assert task_id in by_id and task_id not in always_fail, (where, task_id)
        assert list(g.prompt_ids) == list(by_id[task_id].prompt_ids), (where, task_id, g.prompt_ids)
        tag = g.samples[0].text
        assert tag in book.tags, (where, task_id, "a stored group no engine produced", tag)
        key, production = book.tags[tag]
        assert key == (iteration, task_id) and production.member == g.node, (where, task_id, tag, g.node)
        got = tuple((s.completion_ids, s.logprobs, s.reward, s.text) for s in g.samples)
        assert got == production.samples, (where, task_id, "stored bytes differ from what the engine produced")
        assert book.acked.get((iteration, task_id)) == (g.node, tag), (
            where, task_id, "stored but not acked to its producer", book.acked.get((iteration, task_id)), (g.node, tag))
    acked = {t for (i, t) in book.acked if i == iteration}
    assert acked == set(fetched), (where, "acked but not stored", sorted(acked - set(fetched)))
    reason = manifest["seal_reason"]
    assert failed <= len(always_fail), (where, failed, sorted(always_fail))
    if reason == f"all {total} tasks done":
        assert done == total and not always_fail, where
    elif reason.startswith("all tasks finished:"):
        assert done + failed == total and failed == len(always_fail), (where, manifest)
        assert set(fetched) == set(by_id) - always_fail, where
    elif reason.startswith("deadline passed with"):
        # The min_fraction is the submit's (the manifest does not carry it): the reason states it.
        fraction = float(reason.rsplit("min_fraction ", 1)[1].rstrip(")"))
        assert done >= math.ceil(fraction * total - 1e-9), (where, manifest)
    else:
        raise AssertionError(f"{where}: unexpected seal reason")


def scenario(coordinator_factory, seed: int) -> dict:
    rng = random.Random(seed)
    coordinator = coordinator_factory(lease_ttl_s=5.0, extra_args=["--stream-grace", "5"])
    n_iterations = rng.randint(2, 3)
    iterations = {}
    plans: dict = {}
    for i in range(1, n_iterations + 1):
        specs, p, config = make_iteration(rng, i)
        iterations[i] = (specs, config)
        plans.update(p)
    book = Book(plans)
    cluster = Cluster(coordinator, book, random.Random(seed * 7919 + 1))
    events: list[str] = []
    timeline: list[str] = []
    stop = threading.Event()
    chaos_rng = random.Random(seed * 104729 + 2)
    results: dict[int, tuple[dict, dict]] = {}
    try:
        for _ in range(rng.randint(1, 3)):
            cluster.add()
        chaos_thread = threading.Thread(target=chaos, args=(cluster, chaos_rng, stop, events), daemon=True)
        with SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=HARD_TIMEOUT_S) as client:
            chaos_thread.start()
            t0 = time.monotonic()
            i = 1
            while i <= n_iterations:
                ahead = [i] + ([i + 1] if i < n_iterations and rng.random() < 0.3 else [])
                for j in ahead:
                    specs, config = iterations[j]
                    client.submit_iteration(RUN, j, specs, **config)
                for j in ahead:
                    try:
                        manifest = client.wait_sealed(RUN, j, timeout_s=HARD_TIMEOUT_S)
                    except Exception as exc:
                        raise AssertionError(f"iteration {j}: {exc}; events {events}; errors {book.errors}") from exc
                    results[j] = (manifest, fetch(client, j, rng.choice([1, 2])))
                    timeline.append(f"sealed {j} at {time.monotonic() - t0:.1f}s")
                i += len(ahead)
            stop.set()
            chaos_thread.join(HARD_TIMEOUT_S)
            assert not chaos_thread.is_alive(), "the chaos thread hung"
            if coordinator.proc.poll() is not None:
                coordinator.start()
            # Every outbox drains once the coordinator is healthy: nothing stays unacknowledged.
            try:
                wait_until(lambda: all(v == (0, 0) for v in cluster.outboxes().values()), HARD_TIMEOUT_S, 0.05)
            except AssertionError:
                raise AssertionError(f"outboxes did not drain: {cluster.outboxes()}; events {events}") from None
            timeline.append(f"drained at {time.monotonic() - t0:.1f}s")
            # One more restart: what was sealed and acknowledged is still there, byte for byte.
            coordinator.kill()
            coordinator.start()
            again = {j: fetch(client, j, 1) for j in results}
            timeline.append(f"refetched at {time.monotonic() - t0:.1f}s")
        for h in list(cluster.live.values()):
            cluster.stop(h)
            timeline.append(f"stopped {h.member} at {time.monotonic() - t0:.1f}s")
    finally:
        stop.set()
        cluster.close()
    assert book.errors == [], (book.errors, events)
    assert book.fenced_by_own_leave == 0, events  # a keep-alive answered after the worker's own leave
    for h in cluster.gone:
        # A task handed out again on a new stream that the worker still ran, or held the result of,
        # ran a second time, past the slots.
        assert h.engine.twice == 0 and h.worker.rehanded == 0, (h.member, h.engine.twice, h.worker.rehanded, events)
        assert h.worker.after_accepted == 0, (h.member, h.worker.after_accepted, events)
        assert h.engine.max_tracked <= h.worker.slots, (h.member, h.engine.max_tracked, h.worker.slots, events)
        if h.worker.generate is not None:  # one task per engine thread, slots threads
            assert h.engine.max_running <= h.worker.slots, (h.member, h.engine.max_running, h.worker.slots, events)
    assert set(book.refusals) <= ALLOWED_REFUSALS, (dict(book.refusals), events)
    for j, (manifest, fetched) in results.items():
        check_iteration(book, j, iterations[j][0], manifest, fetched)
        assert {t: g.samples for t, g in again[j].items()} == {t: g.samples for t, g in fetched.items()}, j
    return {
        "events": events,
        "timeline": timeline,
        "reconnects": sum(h.worker.stats.reconnects for h in cluster.gone),
        "resent": sum(h.worker.resent for h in cluster.gone),
        "over_slots": [(h.member, h.engine.max_running, h.worker.slots) for h in cluster.gone if h.engine.max_running > h.worker.slots],
        "ran_twice": sum(h.engine.twice for h in cluster.gone),
        "rehanded": sum(h.worker.rehanded for h in cluster.gone),
        "refusals": dict(book.refusals),
        "fenced_by_own_leave": book.fenced_by_own_leave,
        "workers": len(cluster.gone),
        "backups": sum(m["backups_issued"] for m, _ in results.values()),
        "reasons": [m["seal_reason"] for m, _ in results.values()],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
def test_worker_outbox_and_exactly_once_under_random_faults(coordinator_factory, seed):
    summary = scenario(coordinator_factory, seed)
    print(f"seed {seed}: {summary}")


@pytest.mark.timeout(60)
def test_a_task_handed_out_again_whose_result_is_unacked_is_not_run_twice_or_past_the_slots(coordinator_factory):
    """Minimized from the random schedule: a batch is sent while the coordinator is paused, the
    coordinator is killed before reading it and restarted, and every task is queued again."""
    coordinator = coordinator_factory(lease_ttl_s=5.0, extra_args=["--stream-grace", "5"])
    specs = [TaskSpec(task_id=f"t{k}", prompt_ids=[1, k], num_samples=1) for k in range(4)]
    go = threading.Event()
    lock = threading.Lock()
    calls: list[list[str]] = []
    running, most = [0], [0]

    def generate_batch(batch: list[Assignment]) -> list[GroupRecord]:
        with lock:
            calls.append([a.task.task_id for a in batch])
            first = len(calls) == 1
            running[0] += len(batch)
            most[0] = max(most[0], running[0])
        try:
            if first:
                go.wait(HARD_TIMEOUT_S)
            else:
                time.sleep(0.5)
            return [_one_group(a) for a in batch]
        finally:
            with lock:
                running[0] -= len(batch)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker = RolloutWorker(coordinator.address, RUN, "w0", None, generate_batch=generate_batch, slots=2,
                           call_timeout_s=5.0, reconnect_timeout_s=HARD_TIMEOUT_S, linger_s=0.0)
    stop: list[asyncio.Event] = []

    async def run() -> None:
        stop.append(asyncio.Event())
        await worker.run(stop[0])

    future = asyncio.run_coroutine_threadsafe(run(), loop)
    try:
        with SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=HARD_TIMEOUT_S) as client:
            client.submit_iteration(RUN, 1, specs)
            wait_until(lambda: calls, 10, message="the first batch in the engine")
            assert calls[0] == ["t0", "t1"]
            os.kill(coordinator.pid, signal.SIGSTOP)  # it reads nothing more: the results are sent, never stored
            go.set()
            wait_until(lambda: asyncio.run_coroutine_threadsafe(_unacked(worker), loop).result(5), 10,
                       message="the results of t0 and t1 sent")
            coordinator.kill()
            coordinator.start()
            manifest = client.wait_sealed(RUN, 1, timeout_s=HARD_TIMEOUT_S)
            assert manifest["tasks_done"] == 4, manifest
            wait_until(lambda: len(calls) >= 2 and running[0] == 0, 10)
        ran = collections.Counter(t for c in calls for t in c)
        assert most[0] <= worker.slots and max(ran.values()) == 1, (calls, most[0])
    finally:
        go.set()
        if stop:
            loop.call_soon_threadsafe(stop[0].set)
        with contextlib.suppress(Exception):
            future.result(HARD_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def _unacked(worker: RolloutWorker) -> int:
    return len(worker.unacked)


def _one_group(a: Assignment) -> GroupRecord:
    """The minimized tests' engine: one short sample for ``a``, from worker w0."""
    return GroupRecord(a.task.task_id, "w0", 0, 0.0, 0.0, [SampleRecord(_tokens(a.task.task_id, 0, 4), b"\0" * 16, 1.0)])


def _slow_leave(monkeypatch, left: asyncio.Event | None = None) -> None:
    """Every worker's Leave answered 0.5 s after the coordinator took it (a busy or just restarted
    coordinator; the reply on its way back), ``left`` set meanwhile."""
    from elasticrl.coordinator.aio_client import AsyncCoordinatorClient

    real_leave = AsyncCoordinatorClient.leave

    async def slow_leave(self, *args, **kwargs):
        epoch = await real_leave(self, *args, **kwargs)
        if left is not None:
            left.set()
        await asyncio.sleep(0.5)
        return epoch

    monkeypatch.setattr(AsyncCoordinatorClient, "leave", slow_leave)


@pytest.mark.timeout(60)
def test_a_clean_stop_does_not_raise_fenced_from_a_keep_alive_that_crosses_the_leave(coordinator_factory, monkeypatch):
    """Minimized: the leave's reply takes a while (a busy or just restarted coordinator; here a
    delay after the real Leave) while keep-alives go every 0.2 s."""
    coordinator = coordinator_factory(lease_ttl_s=5.0)
    _slow_leave(monkeypatch)
    worker = RolloutWorker(coordinator.address, RUN, "w0", _one_group, lease_ttl_s=0.6, call_timeout_s=5.0,
                           reconnect_timeout_s=HARD_TIMEOUT_S)

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(1.0)  # joined, streaming, a few keep-alives
        assert not running.done()
        stop.set()
        await asyncio.wait_for(running, HARD_TIMEOUT_S)  # a clean stop returns None

    asyncio.run(scenario())
    assert worker.fenced is None


@pytest.mark.timeout(60)
def test_a_clean_stop_does_not_raise_fenced_from_a_stream_reopened_across_the_leave(coordinator_factory, monkeypatch):
    """Minimized from the random schedule (seed 2): the coordinator restarts just before a clean
    stop; the worker's Work stream is reopened only after its leave is in (held here until then,
    a backoff pause in the run), and the coordinator refuses the hello of a member that left."""
    coordinator = coordinator_factory(lease_ttl_s=5.0)
    real_stream = RolloutWorker._one_stream
    left = asyncio.Event()
    streams: list[str] = []
    _slow_leave(monkeypatch, left)

    async def held_stream(self, executor):
        if streams:  # a reopen: after the leave
            await left.wait()
        streams.append("opened")
        return await real_stream(self, executor)

    monkeypatch.setattr(RolloutWorker, "_one_stream", held_stream)

    worker = RolloutWorker(coordinator.address, RUN, "w0", _one_group, call_timeout_s=5.0, reconnect_timeout_s=HARD_TIMEOUT_S)

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        while not streams:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # streaming
        coordinator.kill()
        while worker.stats.reconnects == 0:  # its first stream ended with the coordinator
            await asyncio.sleep(0.05)
        coordinator.start()
        stop.set()
        await asyncio.wait_for(running, HARD_TIMEOUT_S)  # a clean stop returns None
        assert len(streams) == 2  # the reopen happened, after the leave

    asyncio.run(scenario())
    assert worker.fenced is None
