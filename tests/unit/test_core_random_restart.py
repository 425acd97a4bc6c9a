"""A coordinator restarted at any point between calls holds exactly what it held before: random
calls (joins and re-joins, leaves, keep-alives, leases running out, barriers arriving in groups
under both timeout policies, KV writes, counters, compare-and-set and deletes, request ids
retried) on a real ``CoordinatorCore`` over a SQLite state dir, with an injected clock, and a new
core opened on the same file at random steps. What a restart does not keep is left out on
purpose: lease deadlines and barrier deadlines start afresh (``persist.load``)."""

from __future__ import annotations

import random

import pytest

from elasticrl.coordinator.barriers import Arrival
from elasticrl.coordinator.core import CoordinatorCore, Limits
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.state import TimeoutPolicy

pytestmark = pytest.mark.timeout(60)

RUNS = ("r1", "r2")
MEMBERS = tuple(f"m{i}" for i in range(6))
BARRIERS = tuple(f"b{i}" for i in range(5))
KEYS = tuple(f"k{i}".encode() for i in range(4))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(core: CoordinatorCore) -> dict:
    """Everything a restart must keep, as plain values."""
    out = {}
    for run_id, run in core.runs.items():
        out[run_id] = {
            "epoch": run.epoch, "closed": (run.closed, run.close_reason),
            "members": {m: (x.incarnation, x.status, x.reason, x.host, x.weight, x.lease_ttl_s, x.joined_epoch)
                        for m, x in run.members.items()},
            "live_count": run.live_count,
            "kv": dict(run.kv), "kv_bytes": run.kv_bytes,
            # (a decided barrier's arrivals are its result's: the rows go with the decision)
            "barriers": {n: (b.timeout_s, b.policy, dict(b.expected), dict(b.arrived) if b.result is None else None, b.result)
                         for n, b in run.barriers.items()},
            "open": sorted(run.open_barriers), "decided": list(run.decided),
        }
    return out


def step(core: CoordinatorCore, clock: Clock, rng: random.Random, log: list) -> None:
    run_id = rng.choice(RUNS)
    run = core.runs.get(run_id)
    members = run.members if run is not None else {}
    live = sorted(m for m, x in members.items() if x.live)
    roll = rng.random()
    retried = rng.random() < 0.3
    request_id = lambda kind: f"{kind}-{rng.randrange(20)}" if retried else ""  # ids repeat: retries
    if roll < 0.15 or not live:
        m = rng.choice(MEMBERS)
        log.append(("join", run_id, m, retried))
        core.join(run_id, m, host=f"h-{m}", lease_ttl_s=rng.choice((5.0, 30.0)), request_id=request_id("join"))
    elif roll < 0.2:
        m = rng.choice(live)
        log.append(("leave", run_id, m))
        core.leave(run_id, m, members[m].incarnation, "done", request_id=request_id("leave"))
    elif roll < 0.3:
        seconds = rng.choice((1.0, 4.0, 8.0))
        keep = [m for m in live if rng.random() < 0.8]
        log.append(("advance", seconds, keep))
        clock.now += seconds
        for m in keep:
            core.keep_alive(run_id, m, members[m].incarnation)
        core.tick()
    elif roll < 0.65:
        batch = []
        for _ in range(rng.randrange(1, 6)):
            m = rng.choice(sorted(members))
            inc = members[m].incarnation - (1 if rng.random() < 0.1 else 0)
            batch.append(Arrival(run_id, m, inc, rng.choice(BARRIERS), timeout_s=rng.choice((3.0, 20.0)),
                                 policy=rng.choice((TimeoutPolicy.EVICT_MISSING, TimeoutPolicy.REPORT))))
        log.append(("arrive", [(a.member_id, a.incarnation, a.name) for a in batch]))
        core.arrive_many(batch)
    else:
        key = rng.choice(KEYS)
        kind = rng.choice(("set", "add", "cas", "delete"))
        log.append(("kv", run_id, kind, key, retried))
        if kind == "set":
            core.kv_set(run_id, [(key, bytes([rng.randrange(256)]) * rng.randrange(1, 4))], request_id=request_id("set"))
        elif kind == "add":
            try:
                core.kv_add(run_id, key, rng.randrange(-2, 5), request_id=request_id("add"))
            except Exception as exc:  # noqa: BLE001 - adding to a value that is not a number: refused
                log.append(("refused", type(exc).__name__))
        elif kind == "cas":
            core.kv_compare_set(run_id, key, b"", b"v", request_id=request_id("cas"))
        else:
            core.kv_delete(run_id, key, request_id=request_id("delete"))


@pytest.mark.parametrize("seed", range(8))
def test_a_restart_at_any_step_keeps_exactly_the_state_it_had(seed, tmp_path):
    rng = random.Random(seed)
    clock = Clock()
    path = tmp_path / "state.db"
    limits = Limits(keep_decided_barriers=3)
    core = CoordinatorCore(StateDB(path), lease_ttl_s=30.0, clock=clock, limits=limits)
    log: list = []
    restarts = 0
    for n in range(250):
        step(core, clock, rng, log)
        if rng.random() < 0.12:
            before = snapshot(core)
            core.db.close()
            core = CoordinatorCore(StateDB(path), lease_ttl_s=30.0, clock=clock, limits=limits)
            restarts += 1
            after = snapshot(core)
            assert after == before, f"seed {seed}, step {n}: restart changed the state; last calls: {log[-5:]}"
            # A join after the restart gets an incarnation above every one handed out before it.
            highest = max((x.incarnation for r in core.runs.values() for x in r.members.values()), default=0)
            member, _ = core.join("r1", "fresh")
            assert member.incarnation > highest, f"seed {seed}, step {n}"
            log.append(("join", "r1", "fresh", ""))
    assert restarts >= 10
