"""A real CoordinatorCore + SchedulerCore pair on an injected clock, with workers as plain
``WorkerConn`` objects whose outboxes the test reads. No event loop, no sleeps."""

from __future__ import annotations

import dataclasses
import pathlib

from elasticrl.coordinator.core import CoordinatorCore
from elasticrl.coordinator.persist import StateDB
from elasticrl.scheduler.core import Assign, Cancel, SchedulerCore, WorkerConn
from elasticrl.scheduler.state import GroupRecord, SampleRecord, Split, TaskSpec
from elasticrl.scheduler.store import TrajectoryStore

RUN = "r"


class Clock:
    """Monotonic seconds (``now``) plus a wall clock that moves with it."""

    def __init__(self, now: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = now
        self.wall_offset = wall_offset

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset


class Harness:
    def __init__(
        self,
        *,
        clock: Clock | None = None,
        lease_ttl_s: float = 30.0,
        state_dir: pathlib.Path | None = None,
        keep_iterations: int | None = None,
    ) -> None:
        """``keep_iterations`` (``--keep-iterations``) is given to the scheduler, so that it applies
        from the start-up on, as a restarted coordinator's does (setting it afterwards misses that)."""
        self.clock = clock or Clock()
        db = StateDB(None if state_dir is None else state_dir / "state.db")
        self.coord = CoordinatorCore(db, lease_ttl_s=lease_ttl_s, clock=self.clock)
        self.store = TrajectoryStore(None if state_dir is None else state_dir / "trajectories")
        keep = {} if keep_iterations is None else {"keep_iterations": keep_iterations}
        self.sched = SchedulerCore(self.coord, self.store, wall_clock=self.clock.wall, **keep)
        self.incarnations: dict[str, int] = {}

    def join(self, member_id: str) -> int:
        member, _ = self.coord.join(RUN, member_id)
        self.incarnations[member_id] = member.incarnation
        return member.incarnation

    def worker(self, member_id: str, *, slots: int = 1, weight: float = 1.0, running=None) -> WorkerConn:
        """Join (if not a member yet) and open a stream (``running``: the hello's, None from a
        worker that does not report it)."""
        if member_id not in self.incarnations:
            self.join(member_id)
        return self.sched.connect(RUN, member_id, self.incarnations[member_id], slots=slots, weight=weight, running=running)

    def advance(self, seconds: float, *, alive: tuple[str, ...] = (), step: float = 5.0) -> None:
        """Move the clock in ``step``s, renewing ``alive`` members' leases, ticking both cores."""
        left = seconds
        while left > 1e-9:
            d = min(step, left)
            self.clock.now += d
            left -= d
            for m in alive:
                self.coord.keep_alive(RUN, m, self.incarnations[m])
            self.coord.tick()
            self.sched.tick()

    def it(self, iteration: int = 1):
        return self.sched.iteration(RUN, iteration)


def spec(i: int, *, split: Split = Split.TRAIN) -> TaskSpec:
    return TaskSpec(task_id=f"t{i:02d}", prompt_ids=[100 + i, 7, 8], num_samples=2, split=split)


def specs(n: int) -> list[TaskSpec]:
    return [spec(i) for i in range(n)]


def group(task_id: str, tokens: int = 3, *, seed: int = 0) -> GroupRecord:
    """Two samples of ``tokens`` tokens each whose ids depend on the task (to check bytes later)."""
    base = int(task_id.lstrip("t") or 0) * 1000 + seed
    samples = [
        SampleRecord.pack([base + j * 100 + k for k in range(tokens)], [-0.25 * k for k in range(tokens)], reward=float(j))
        for j in range(2)
    ]
    return GroupRecord(task_id=task_id, node="", policy_version=3, gen_seconds=1.5, reward_seconds=0.25, samples=samples)


def drain(conn: WorkerConn) -> list:
    out = []
    while not conn.outbox.empty():
        out.append(conn.outbox.get_nowait())
    return out


def assigned(messages: list) -> list[str]:
    return [spec.task_id for m in messages if isinstance(m, Assign) for _, spec, _, _ in m.items]


def cancelled(messages: list) -> list[str]:
    return [tid for m in messages if isinstance(m, Cancel) for tid in m.task_ids]


@dataclasses.dataclass(frozen=True)
class Item:
    """One result as a worker sends it in the random tests: its group is ``group(task_id, tokens, seed=seed)``."""

    iteration: int
    task_id: str
    seed: int
    tokens: int

    @property
    def key(self) -> tuple[int, str]:
        return (self.iteration, self.task_id)

    def group(self) -> GroupRecord:
        return group(self.task_id, self.tokens, seed=self.seed)


def expect_decision(its: dict, items: list[Item], *, fenced: bool, accepted, storing) -> tuple[list[Item], list]:
    """The documented rules for result ``items`` arriving now (``its``: iteration -> Iteration;
    ``accepted``/``storing``: task keys stored, or being stored): (to store, refused)."""
    fresh, refused, seen = [], [], set()
    for item in items:
        it = its.get(item.iteration)
        if it is None or item.task_id not in it.tasks:
            refused.append((*item.key, "unknown"))
        elif fenced:
            refused.append((*item.key, "fenced"))
        elif item.key in accepted or item.key in storing or item.key in seen:
            refused.append((*item.key, "duplicate"))
        elif it.sealed:
            refused.append((*item.key, "sealed"))
        else:
            seen.add(item.key)
            fresh.append(item)
    return fresh, refused


def expect_commit(its: dict, items: list[Item], *, accepted) -> tuple[list[Item], list]:
    """What changed between a batch's decision and its commit: of the ``items`` it decided to store,
    (still stored, refused at the commit), grouped by iteration as the commit takes them."""
    by_iteration: dict[int, list[Item]] = {}
    for item in items:
        by_iteration.setdefault(item.iteration, []).append(item)
    stored, late = [], []
    for n, group_items in by_iteration.items():
        it = its.get(n)
        for item in group_items:
            if it is None:
                late.append((*item.key, "unknown"))
            elif item.key in accepted:
                late.append((*item.key, "duplicate"))
            elif it.sealed:
                late.append((*item.key, "sealed"))
            else:
                stored.append(item)
    return stored, late


def check_counts(it, n: int, nodes_done, nodes_tokens, node_refused, refused, ctx, where: str) -> None:
    """Iteration ``n``'s per-node done/tokens/refused and its refused counters against what the
    acks said (``node_refused[(n, member)]``, ``refused[(n, reason)]``); ``ctx(msg)`` words a failure."""
    for m in set(it.nodes) | set(nodes_done):
        s = it.nodes.get(m)
        got = (s.done, s.tokens, s.refused) if s else (0, 0, 0)
        assert got == (nodes_done[m], nodes_tokens[m], node_refused[(n, m)]), ctx(
            f"{where}: node {m} done/tokens/refused {got}, acknowledged "
            f"{(nodes_done[m], nodes_tokens[m], node_refused[(n, m)])}")
    c = it.counters
    got = (c.refused_duplicate, c.refused_fenced, c.refused_sealed)
    want = tuple(refused[(n, r)] for r in ("duplicate", "fenced", "sealed"))
    assert got == want, ctx(f"{where}: refused counters {got}, acknowledged {want}")
