"""Exactly-once through coordinator crashes (issue 15): clients add, compare-and-set, arrive at
barriers and stream result batches while a real coordinator is SIGKILLed at random moments and
restarted on the same state dir. Every acknowledged operation must be counted exactly once and
nothing acknowledged may be lost."""

from __future__ import annotations

import collections
import random
import sys
import threading
import time
import traceback

import pytest

from elasticrl.coordinator.client import CoordinatorClient
from elasticrl.scheduler.client import SchedulerClient

from tests.integration.test_scheduler import fetch_all, tasks, wait_members, workers  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

KILLS = 10
BARRIERS = 150
RUN = "crash"
BARRIER_RUN = "crash-barriers"  # its own run: a barrier waits for every member of its run


class Ops:
    """What the client threads were told succeeded, and what failed outright."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    def ack(self, what: str) -> None:
        with self.lock:
            self.acked[what] += 1

    def fail(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")


def _stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for t in threads if t.ident in frames)


def _client(address: str) -> CoordinatorClient:
    return CoordinatorClient(address, call_timeout_s=5, reconnect_timeout_s=60)


def adder(address: str, ops: Ops, stop: threading.Event) -> None:
    with _client(address) as c:
        while not stop.is_set():
            try:
                c.kv_add(RUN, b"count", 1)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                ops.fail("add", exc)
                return
            ops.ack("add")


def appender(address: str, ops: Ops, stop: threading.Event, i: int) -> None:
    """Appends ``i,`` with a compare-and-set loop, the way CoordinatorStore.append does: a retried
    swap that reported "not swapped" would append the token twice."""
    with _client(address) as c:
        while not stop.is_set():
            try:
                current = c.kv_get(RUN, [b"log"])[0] or b""
                _, swapped = c.kv_compare_set(RUN, b"log", current, current + b"%d," % i)
            except Exception as exc:  # noqa: BLE001
                ops.fail(f"cas{i}", exc)
                return
            if swapped:
                ops.ack(f"cas{i}")


def barrier_member(address: str, ops: Ops, name: str, ready: threading.Barrier) -> None:
    """Arrives at BARRIERS barriers in turn (a fixed count: both members must reach the same last
    one), pausing between them so that the kills fall among them."""
    with _client(address) as c:
        me = c.join(BARRIER_RUN, name, lease_ttl_s=120)
        ready.wait(timeout=30)
        for n in range(BARRIERS):
            try:
                result = c.arrive(BARRIER_RUN, name, me.incarnation, f"b{n}", timeout_s=120)
            except Exception as exc:  # noqa: BLE001
                ops.fail(name, exc)
                return
            if result.outcome.value != "completed" or result.evicted or len(result.arrived) != 2:
                ops.fail(name, AssertionError(f"barrier b{n}: {result}"))
                return
            ops.ack(name)
            time.sleep(0.05)


@pytest.mark.timeout(240)
def test_acknowledged_operations_count_once_through_repeated_coordinator_kills(coordinator_factory, workers):
    coordinator = coordinator_factory(lease_ttl_s=60.0)
    address = coordinator.address
    rng = random.Random(15)
    ops, stop = Ops(), threading.Event()
    ready = threading.Barrier(2)
    threads = [threading.Thread(target=adder, args=(address, ops, stop), daemon=True) for _ in range(3)]
    threads += [threading.Thread(target=appender, args=(address, ops, stop, i), daemon=True) for i in range(2)]
    threads += [
        threading.Thread(target=barrier_member, args=(address, ops, f"m{i}", ready), daemon=True) for i in range(2)
    ]
    worker = workers(address, RUN, "w0", 0.02, "--slots", "4", "--linger", "0.005")
    n_tasks = 400
    with SchedulerClient(address, call_timeout_s=5, reconnect_timeout_s=60) as sched:
        wait_members(sched, RUN, 1)
        sched.submit_iteration(RUN, 1, tasks(n_tasks))
        for t in threads:
            t.start()
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.8))
            coordinator.kill()
            time.sleep(rng.uniform(0.0, 0.3))
            coordinator.start()
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=90)
        stuck = [t for t in threads if t.is_alive()]
        assert not stuck, f"client threads stuck: {_stacks(stuck)}; acked {dict(ops.acked)}; errors {ops.errors}"
        assert ops.errors == []
        with _client(address) as c:
            count, log = c.kv_get(RUN, [b"count", b"log"])
        assert int(count) == ops.acked["add"] > 0
        tokens = collections.Counter(log.decode().split(",")[:-1])
        assert {f"cas{k}": v for k, v in tokens.items()} == {k: v for k, v in ops.acked.items() if k.startswith("cas")}
        assert ops.acked["m0"] == ops.acked["m1"] == BARRIERS
        manifest = sched.wait_sealed(RUN, 1, timeout_s=90)
        assert manifest["tasks_done"] == n_tasks, worker.log()[-3000:]
        groups = fetch_all(sched, RUN, 1)
        assert sorted(g.task_id for g in groups) == [t.task_id for t in tasks(n_tasks)]
    assert coordinator.log().count("loaded") >= KILLS  # it really restarted each time
