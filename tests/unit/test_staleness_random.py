"""Seeded random tests of asynchronous RL with bounded staleness (``rollout.max_staleness = k``).

Pure logic on an injected clock, no threads of our own except the driver's real background submit:

* the pure pieces of ``train/staleness.py`` against their docstrings (``SubmissionWindow``,
  ``min_policy_version``, ``keep_fresh``, ``merge_lags`` / ``lag_summary``, ``IdleMeter``);
* a whole run, simulated: the driver is the real ``train/submit.Submitter`` (its window, task
  versions, background presubmits that land late or are still running), the scheduler is a real
  ``SchedulerCore`` (tests/unit/scheduler_harness.py, durable), trainer-node engines wait at a real
  ``VersionGate``, rollout-only workers at a real ``CoordinatorWeights`` fed by a simulated weight
  store whose publishes arrive late (an older one after a newer one is refused, as the store does),
  engines join and leave at random, and the worker group restarts from its newest checkpoint (a
  new generation, a new driver) mid-run. The trainer trains each sealed iteration through
  ``keep_fresh`` at its own version. Checked: no group trained with lag > k, nothing trained twice,
  every group of every iteration trained or counted as dropped, task versions as documented, k = 0
  exactly on-policy, submit-ahead never past k, idle fractions in [0, 1] and equal to the busy time
  the simulation saw.

The bugs this file found are pinned by the focused tests at the end (each failed on the code before its fix).
Seeds: ``ELASTICRL_RANDOM_SEEDS`` (default 10).
"""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
import types

import pytest

from elasticrl.config import (
    CoordinatorSection,
    NodeConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from elasticrl.errors import NotFoundError
from elasticrl.scheduler.core import Assign, Cancel, End
from elasticrl.scheduler.state import GroupRecord, IterationConfig, SampleRecord, Split
from elasticrl.train import rollout_only
from elasticrl.train.names import weights_version
from elasticrl.train.rollout_link import PolicyVersionTimeout, VersionGate
from elasticrl.train.rollout_only import POLICY_MASK, CoordinatorWeights
from elasticrl.train.staleness import (
    IdleMeter,
    SubmissionWindow,
    keep_fresh,
    lag_summary,
    merge_lags,
    min_policy_version,
)
from elasticrl.train.submit import Submitter
from tests.unit.scheduler_harness import RUN, Clock, Harness, drain

pytestmark = pytest.mark.timeout(120)

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10")))


# -- the pure pieces ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_the_window_submits_k_ahead_asking_the_documented_versions(seed):
    """``SubmissionWindow``'s docstrings, over random schedules: presubmits on or off, submits that
    may not have landed (not marked), and driver restarts resumed from any earlier iteration."""
    rng = random.Random(seed)
    for _ in range(100):
        k, last = rng.randint(0, 3), rng.randint(1, 12)
        presubmit = rng.random() < 0.7
        window, marked = SubmissionWindow(k, last), set()
        ctx = f"seed {seed}: k={k} last={last} presubmit={presubmit}"
        i, version, first = 1, 0, 1
        while i <= last:
            due = window.due(i)
            assert due == [j for j in range(i, min(i + k, last) + 1) if j not in marked], ctx  # oldest first
            for j in due:
                assert window.task_version(j) == min_policy_version(j, k) == max(0, j - 1 - k), ctx
                # the version it asks for is one the trainer (at i - 1 while it waits for i) has reached
                assert window.task_version(j) <= version, ctx
                if rng.random() < 0.15:  # not landed, not marked: due lists it again
                    assert j in window.due(i), ctx
                window.mark(j)
                marked.add(j)
            # while it waits for i: i .. i + k submitted, and nothing further ahead
            assert set(range(i, min(i + k, last) + 1)) <= marked and max(marked) <= min(i + k, last), ctx
            assert window.due(i) == [], ctx
            ahead = window.ahead(i)
            assert ahead == (i + 1 + k if i + 1 + k <= last and (i + 1 + k) not in marked else None), ctx
            if ahead is not None and presubmit:
                assert window.task_version(ahead) == i, ctx  # the version this update produces
                if rng.random() < 0.85:
                    window.mark(ahead)
                    marked.add(ahead)
                    assert window.ahead(i) is None, ctx
            assert max(marked) <= min(i + 1 + k, last), ctx
            version = i
            i += 1
            if rng.random() < 0.08 and i <= last:  # the driver restarts: resumed from an older checkpoint
                version = rng.randint(0, i - 1)
                i = first = version + 1
                window, marked = SubmissionWindow(k, last), set()
        assert set(range(first, last + 1)) <= marked, ctx  # every iteration of this incarnation submitted
        assert window.due(last + 1) == [] and window.ahead(last) is None, ctx
    with pytest.raises(ValueError, match="max_staleness"):
        SubmissionWindow(-rng.randint(1, 5), 3)


def groups_of(rng: random.Random, n: int, lo: int, hi: int) -> list:
    return [types.SimpleNamespace(policy_version=rng.randint(lo, hi), samples=[object()] * rng.randint(1, 4)) for _ in range(n)]


@pytest.mark.parametrize("seed", SEEDS)
def test_keep_fresh_keeps_exactly_the_groups_within_k_and_counts_the_rest(seed):
    rng = random.Random(seed)
    for _ in range(300):
        k, version = rng.randint(0, 3), rng.randint(0, 12)
        groups = groups_of(rng, rng.randint(0, 12), 0, version + 3)  # some drawn before a restart to an older version
        kept, dropped, lags = keep_fresh(groups, version, k)
        assert kept == [g for g in groups if version - g.policy_version <= k]  # in order, the same objects
        assert dropped == sum(len(g.samples) for g in groups if version - g.policy_version > k)
        assert sum(lags.values()) + dropped == sum(len(g.samples) for g in groups)  # nothing lost
        assert all(lag <= k for lag in lags) and all(n > 0 for n in lags.values())
        assert lags == dict(collections.Counter(
            {lag: sum(len(g.samples) for g in kept if version - g.policy_version == lag) for lag in {version - g.policy_version for g in kept}}))
        if k == 0:
            assert all(g.policy_version >= version for g in kept)
        # every rank's histogram, through JSON (string keys) and back, sums to the whole
        cut = rng.randint(0, len(groups))
        parts = [keep_fresh(groups[:cut], version, k)[2], keep_fresh(groups[cut:], version, k)[2]]
        merged = merge_lags([json.loads(json.dumps(p)) for p in parts] + [None, {}])
        assert merged == dict(sorted(lags.items())) and list(merged) == sorted(merged)
        summary = lag_summary(merged)
        n = sum(merged.values())
        assert summary["policy_lag"] == {str(lag): c for lag, c in sorted(merged.items())}
        assert summary["policy_lag_max"] == (max(merged) if merged else 0) and summary["policy_lag_max"] <= k
        assert summary["policy_lag_mean"] == pytest.approx(sum(lag * c for lag, c in merged.items()) / n if n else 0.0)
        if merged:
            assert min(merged) <= summary["policy_lag_mean"] <= max(merged)


class StepClock:
    def __init__(self, now: float = 50.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", SEEDS)
def test_the_idle_meter_is_the_share_of_time_with_no_batch_in_hand(seed):
    """Several threads' batches overlap; ``take()`` is the idle share since the previous one, in
    [0, 1], and the busy time of all windows adds up to the time with at least one batch in hand."""
    rng = random.Random(seed)
    for _ in range(30):
        clock = StepClock(rng.uniform(0, 100))
        meter = IdleMeter(clock)
        active, busy, wall = 0, 0.0, 0.0
        total_busy = total_wall = 0.0
        for _ in range(rng.randint(1, 200)):
            op = rng.random()
            if op < 0.35:
                meter.start()
                active += 1
            elif op < 0.7 and active:
                meter.stop()
                active -= 1
            elif op < 0.8:
                idle = meter.take()
                assert 0.0 <= idle <= 1.0
                if wall > 0:
                    assert idle == pytest.approx(1.0 - busy / wall, abs=1e-6)
                else:
                    assert idle == 0.0  # no time passed
                total_busy, total_wall = total_busy + busy, total_wall + wall
                busy = wall = 0.0
            else:
                dt = rng.choice([0.0, rng.uniform(0, 3), rng.uniform(0, 1e-3)])
                clock.now += dt
                wall += dt
                busy += dt if active else 0.0
        with meter.busy():  # the context manager is one start/stop pair
            active += 1
            clock.now += 0.5
            wall += 0.5
            busy += 0.5
        active -= 1
        idle = meter.take()
        assert 0.0 <= idle <= 1.0 and idle == pytest.approx(1.0 - busy / wall, abs=1e-6)
        assert total_busy + busy <= total_wall + wall + 1e-9


# -- a simulated run: real driver, scheduler and gates on an injected clock ----------------------------

DT = 0.05
SAMPLES = 2


class FakeWeights:
    """The coordinator's (or relay's) newest published weights: publishes arrive late, possibly out
    of order, and one not above the stored version is refused (``weights.check_publish``)."""

    def __init__(self):
        self.newest: int | None = None
        self.in_flight: list[tuple[float, int, int]] = []  # (arrives at, order, weights version)
        self._order = 0

    def publish(self, wversion: int, arrives_at: float) -> None:
        self._order += 1
        self.in_flight.append((arrives_at, self._order, wversion))

    def step(self, now: float) -> None:
        for item in sorted(x for x in self.in_flight if x[0] <= now):
            self.in_flight.remove(item)
            if self.newest is None or item[2] > self.newest:
                self.newest = item[2]

    # the fetcher interface CoordinatorWeights uses
    mode = "fake"

    def fetch(self, have: int, wait_s: float):
        return (self.newest, b"") if self.newest is not None and self.newest > have else None


class RecordingEngine:
    def __init__(self):
        self.version = -1

    def update_weights(self, items, version):
        self.version = version


class FakeSchedulerClient:
    """What ``Submitter`` calls, applied to the simulated scheduler. Calls from the main thread
    land at once; a background (presubmit) call waits until the simulation lets it land."""

    def __init__(self, sim: Sim, generation: int):
        self.sim = sim
        self.generation = generation
        self.queue: list[tuple[int, list, threading.Event]] = []
        self.lock = threading.Lock()

    def submit_iteration(self, run_id, iteration, tasks, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self.sim.apply_submit(self, iteration, tasks, background=False)
            return
        landed = threading.Event()
        with self.lock:
            self.queue.append((iteration, tasks, landed))
        if not landed.wait(30):
            raise TimeoutError("the simulation never let this submit land")


class SimEngine:
    def __init__(self, sim: Sim, member_id: str, kind: str, speed: float, slots: int, generation: int):
        self.sim, self.member_id, self.kind, self.speed = sim, member_id, kind, speed
        sim.h.join(member_id)  # a new process: a new incarnation
        self.conn = sim.h.worker(member_id, slots=slots)
        self.held: dict[tuple[int, str], dict] = {}
        self.meter = IdleMeter(sim.clock)
        self.ref_busy = 0.0
        self.ref_since = sim.clock.now
        self.alive = True
        if kind == "node":
            self.gate = VersionGate()  # a fresh worker process (torchrun restarted the group)
            self.gate.advance(sim.driver_version)
            self.generation = generation
        else:
            self.engine = RecordingEngine()
            self.gate = CoordinatorWeights(sim.weights, RUN, self.engine, threading.RLock())

    # what the engine holds now: (policy version, generation of the trainer that produced it)
    def holding(self) -> tuple[int, int]:
        if self.kind == "node":
            return self.gate.version, self.generation
        wv = self.gate.weights_version
        return wv & POLICY_MASK, wv >> 32

    def passes(self, policy_version: int, wversion: int) -> bool:
        if self.kind == "node":
            try:
                self.gate.wait(policy_version, wversion, 0.0)
            except PolicyVersionTimeout:
                return False
            return True
        if not self.gate.holds(wversion, policy_version):
            self.gate.catch_up()  # what refresh() does, one fetch at a time
            if not self.gate.holds(wversion, policy_version):
                return False
        # The catch-up after a passed gate (what wait() does; it loaded a newer generation whose
        # policy is older than the task names: test_a_rollout_only_worker_never_draws_a_task_
        # with_a_policy_older_than_it_names_after_a_trainer_restart).
        self.gate.catch_up(policy_version)  # at most every CATCH_UP_EVERY_S: the newest, if newer
        return True

    @property
    def running(self) -> int:
        return sum(1 for t in self.held.values() if t["start"] is not None)

    def step(self) -> None:
        sim, now = self.sim, self.sim.clock.now
        for msg in drain(self.conn):
            if isinstance(msg, Assign):
                for iteration, spec, _lease, _backup in msg.items:
                    meta = json.loads(spec.metadata_json)
                    self.held[(iteration, spec.task_id)] = {"pv": meta["policy_version"], "wv": meta["weights_version"], "start": None}
            elif isinstance(msg, Cancel):
                for task_id in msg.task_ids:
                    t = self.held.pop((msg.iteration, task_id), None)
                    if t is not None and t["start"] is not None:
                        self.meter.stop()
            elif isinstance(msg, End):
                pytest.fail(f"{self.member_id}'s stream ended: {msg.error}")
        for key, t in sorted(self.held.items()):
            if t["start"] is not None and now - t["start"] >= self.speed - 1e-9:
                del self.held[key]
                self.meter.stop()
                version, generation = t["drawn"]
                samples = [SampleRecord.pack([1, 2, 3], [-0.5] * 3, 1.0) for _ in range(SAMPLES)]
                ack, err = sim.h.sched.accept(self.conn, [(key[0], GroupRecord(key[1], "", version, self.speed, 0.0, samples))])
                assert err is None, err
                if ack.accepted:
                    assert key not in sim.drawn, f"{key} accepted twice"
                    sim.drawn[key] = {"version": version, "generation": generation, "at": now, "by": self.member_id,
                                      "pv": t["pv"]}
        for key, t in sorted(self.held.items()):
            if t["start"] is None and self.passes(t["pv"], t["wv"]):
                version, generation = self.holding()
                # the gate's promise: the engine holds at least the version the task names
                assert version >= t["pv"], (self.member_id, key, version, t)
                if self.kind == "worker":
                    assert self.gate.weights_version >= t["wv"]
                t["start"], t["drawn"] = now, (version, generation)
                self.meter.start()

    def account(self, dt: float) -> None:
        """The reference busy time: the state is constant over a step."""
        if self.running:
            self.ref_busy += dt

    def take(self) -> tuple[float, float]:
        now = self.sim.clock.now
        idle = self.meter.take()
        wall = now - self.ref_since
        ref = (1.0 - self.ref_busy / wall) if wall > 0 else 0.0
        self.ref_busy, self.ref_since = 0.0, now
        return idle, ref

    def leave(self, *, abrupt: bool) -> None:
        self.alive = False
        self.sim.h.sched.disconnect(self.conn, "left", abrupt=abrupt)
        if not abrupt:
            self.sim.h.coord.leave(RUN, self.member_id, self.sim.h.incarnations[self.member_id])


class Rows:
    def train_rows(self, iteration, n):
        return [{"prompt": f"{iteration}:{r}=", "target": str(r)} for r in range(n)]

    def eval_rows(self, n):
        return []


class Sim:
    def __init__(self, rng: random.Random, tmp_path, ctx: str):
        self.rng = rng
        self.ctx = ctx
        self.clock = Clock(now=1000.0)
        tmp_path.mkdir(parents=True, exist_ok=True)
        # Durable, and keeps every sealed iteration (retention of what was submitted ahead is
        # test_a_sealed_iteration_submitted_ahead_is_kept_until_the_trainer_fetched_it).
        self.h = Harness(clock=self.clock, state_dir=tmp_path, keep_iterations=10_000)
        self.k = rng.randint(0, 3)
        self.last = rng.randint(3, 9)
        self.tasks = rng.randint(2, 6)
        self.update_s = rng.choice([0.1, 0.3, 0.6, 1.2])
        self.presubmit = rng.random() < 0.7
        self.deadline = rng.random() < 0.15  # no presubmit with rollout.deadline_s (the scheduler is given none here)
        self.slow_submits = rng.random() < 0.3
        self.lease_s = rng.choice([10_000.0, 10_000.0, 1.0, 2.5])
        self.checkpoint_every = rng.randint(1, 3)
        self.publish_delay = rng.choice([0.0, 0.2, 1.0, 3.0])
        restarts = rng.choice([0, 1, 2, 3])
        self.restart_at = {(rng.randint(1, self.last), rng.choice(["wait", "updated"])) for _ in range(restarts)}
        self.ctx = f"{ctx} k={self.k} last={self.last} tasks={self.tasks} update={self.update_s} presubmit={self.presubmit} " \
                   f"deadline={self.deadline} slow={self.slow_submits} lease={self.lease_s} ckpt={self.checkpoint_every} " \
                   f"publish_delay={self.publish_delay} restarts={sorted(self.restart_at)}"
        self.weights = FakeWeights()
        self.drawn: dict[tuple[int, str], dict] = {}
        self.submits: list[dict] = []
        self.trained: dict[int, dict] = {}  # the current lineage: iteration -> what it trained
        self.every_training: list[dict] = []
        self.idle: list[tuple[str, float, float]] = []
        self.restarts_done = 0
        self.old_clients: list[FakeSchedulerClient] = []  # drivers of earlier generations (their submits may still land)
        self.generation = 0
        self.driver_version = 0
        self.checkpoint = 0
        self.engines: list[SimEngine] = []
        self.n_nodes = rng.randint(1, 2)
        self.node_speeds = [rng.uniform(0.1, 0.8) for _ in range(self.n_nodes)]
        self.node_slots = [rng.randint(1, 3) for _ in range(self.n_nodes)]
        self.workers_seen = 0
        self.start_generation()

    # -- the worker group ----------------------------------------------------------------------

    def start_generation(self) -> None:
        """A (re)started worker group: resumed from the newest checkpoint, a new generation and
        driver, every node's engine a new process holding the resumed version (torchrun's restart;
        an in-place re-form is not simulated here: test_an_in_place_reform_to_an_older_checkpoint_
        closes_the_gate_to_versions_the_engine_no_longer_holds)."""
        self.generation += 1
        self.driver_version = self.checkpoint
        for e in self.engines:
            if e.kind == "node" and e.alive:
                e.leave(abrupt=True)
        self.engines = [e for e in self.engines if e.alive]
        for n in range(self.n_nodes):
            self.engines.append(SimEngine(self, f"engine-{n}", "node", self.node_speeds[n], self.node_slots[n], self.generation))
        self.trained = {i: t for i, t in self.trained.items() if i <= self.checkpoint}
        cfg = NodeConfig(
            run=RunConfig(run_id="sim", iterations=self.last, rl_phase="both"),
            task=TaskConfig(prompts_per_iteration=self.tasks, group_size=SAMPLES),
            rollout=RolloutConfig(max_staleness=self.k, presubmit=self.presubmit, deadline_s=5.0 if self.deadline else 0.0),
            coordinator=CoordinatorSection(call_timeout_s=0.02, reconnect_timeout_s=0.0),
        )
        self.client = FakeSchedulerClient(self, self.generation)
        self.submitter = Submitter(cfg, Rows(), self.client, generation=self.generation, max_new_tokens=3)
        self.weights.publish(weights_version(self.generation, self.driver_version), self.clock.now + self.rng.uniform(0, self.publish_delay))
        self.iteration = self.driver_version + 1
        self.phase = "start"

    def apply_submit(self, client: FakeSchedulerClient, iteration: int, tasks: list, *, background: bool) -> None:
        created = self.h.sched.submit(RUN, iteration, tasks, IterationConfig(task_lease_s=self.lease_s))
        self.submits.append({"iteration": iteration, "generation": client.generation, "background": background,
                             "driver_at": self.iteration, "phase": self.phase, "created": created,
                             "versions": {json.loads(t.metadata_json)["policy_version"] for t in tasks},
                             "wversions": {json.loads(t.metadata_json)["weights_version"] for t in tasks},
                             "current": client.generation == self.generation})

    def land_background(self, force: bool = False) -> None:
        """Background submits of every driver (a dead one's too) land when their time comes."""
        for client in {id(c): c for c in [self.client, *self.old_clients]}.values():
            with client.lock:
                queue = list(client.queue)
            for item in queue:
                iteration, tasks, landed = item
                if force or self.rng.random() < 0.3:
                    with client.lock:
                        client.queue.remove(item)
                    self.apply_submit(client, iteration, tasks, background=True)
                    landed.set()

    # -- the trainer ---------------------------------------------------------------------------

    def driver_step(self) -> None:
        now = self.clock.now
        if self.phase == "start":
            self.iteration_started = now
            self.waited = 0.0
            self.submitter.submit_due(self.iteration, self.driver_version)
            self.phase = "wait"
        if self.phase == "wait":
            if (self.iteration, "wait") in self.restart_at and self.rng.random() < 0.05:
                self.restart_at.discard((self.iteration, "wait"))
                return self.restart()
            it = self.h.sched.iterations.get(RUN, {}).get(self.iteration)
            if it is None or not it.sealed:
                self.waited += DT
                return
            self.train(it)
            self.submitter.presubmit(self.iteration)
            self.settle_presubmit()
            self.phase, self.update_ends = "update", now + self.update_s
        if self.phase == "update" and now >= self.update_ends - 1e-9:
            i = self.iteration
            self.driver_version = i
            for e in self.engines:
                if e.kind == "node" and e.alive:
                    e.gate.advance(i)  # the push
            self.weights.publish(weights_version(self.generation, i), now + self.rng.uniform(0, self.publish_delay))
            if i % self.checkpoint_every == 0 or i == self.last:
                self.checkpoint = i
            for e in self.engines:
                if e.alive:
                    idle, ref = e.take()
                    self.idle.append((e.member_id, idle, ref))
            trainer_idle = min(1.0, self.waited / max(now - self.iteration_started, 1e-9))
            assert 0.0 <= trainer_idle <= 1.0, self.ctx
            self.iteration += 1
            self.phase = "start" if self.iteration <= self.last else "done"
            if (i, "updated") in self.restart_at and self.phase != "done":
                self.restart_at.discard((i, "updated"))
                self.restart()

    def settle_presubmit(self) -> None:
        """The background submit: lands now, or (slow coordinator) later, maybe after the next
        ``submit_due`` already submitted it again."""
        pending = self.submitter._pending
        if pending is None:
            return

        def mine():  # this call's entry (an earlier slow one of the same driver may still be queued)
            with self.client.lock:
                return next((x for x in self.client.queue if x[0] == pending[0]), None)

        give_up = time.monotonic() + 10
        while mine() is None and pending[1].running:
            assert time.monotonic() < give_up, "the background submit never called the client"
            time.sleep(0.0002)
        if not (self.slow_submits and self.rng.random() < 0.5):
            item = mine()
            assert item is not None, "the background submit failed before it called the client"
            with self.client.lock:
                self.client.queue.remove(item)
            iteration, tasks, landed = item
            self.apply_submit(self.client, iteration, tasks, background=True)
            landed.set()
            while pending[1].running:
                time.sleep(0.0002)

    def train(self, it) -> None:
        i, version = self.iteration, self.driver_version
        groups = [types.SimpleNamespace(task_id=g.task_id, policy_version=g.policy_version, samples=list(g.samples))
                  for g, _ in self.h.sched.shard(RUN, i, 0, 1, Split.TRAIN)]
        kept, dropped, lags = keep_fresh(groups, version, self.k)
        record = {"iteration": i, "version": version, "generation": self.generation, "kept": kept, "dropped": dropped,
                  "lags": lags, "total": len(groups), "samples": sum(len(g.samples) for g in groups), "restarts": self.restarts_done}
        assert i not in self.trained, f"{self.ctx}: iteration {i} trained twice in one lineage"
        self.trained[i] = record
        self.every_training.append(record)

    def restart(self) -> None:
        self.restarts_done += 1
        self.old_clients = [*self.old_clients, self.client]
        self.start_generation()

    # -- rollout-only workers join and leave -------------------------------------------------------

    def churn(self) -> None:
        workers = [e for e in self.engines if e.kind == "worker" and e.alive]
        if len(workers) < 3 and self.rng.random() < 0.02:
            self.workers_seen += 1
            self.engines.append(SimEngine(self, f"rollout-{self.workers_seen}", "worker", self.rng.uniform(0.05, 0.6), 1, 0))
        elif workers and self.rng.random() < 0.01:
            self.rng.choice(workers).leave(abrupt=self.rng.random() < 0.5)

    def run(self) -> None:
        for _ in range(40_000):
            if self.phase == "done":
                break
            self.weights.step(self.clock.now)
            self.land_background()
            self.churn()
            for e in list(self.engines):
                if e.alive:
                    e.step()
            self.driver_step()
            self.clock.now += DT
            for e in self.engines:
                if e.alive:
                    e.account(DT)
                    self.h.coord.keep_alive(RUN, e.member_id, self.h.incarnations[e.member_id])
            self.h.coord.tick()
            self.h.sched.tick()
        else:
            raise AssertionError(f"{self.ctx}: no progress (iteration {self.iteration}, phase {self.phase})")
        self.land_background(force=True)

    # -- the promises ------------------------------------------------------------------------------

    def check(self) -> None:
        k, ctx = self.k, self.ctx
        # every iteration trained exactly once in the lineage that finished the run
        assert sorted(self.trained) == list(range(1, self.last + 1)), ctx
        for r in self.every_training:
            where = f"{ctx}: iteration {r['iteration']} at version {r['version']}"
            assert r["version"] == r["iteration"] - 1, where  # iteration i trains from version i - 1
            ids = [g.task_id for g in r["kept"]]
            assert len(ids) == len(set(ids)), where  # nothing trained twice
            assert r["total"] == self.tasks, where  # no task of a sealed iteration lost (no deadline here)
            assert sum(r["lags"].values()) + r["dropped"] == r["samples"] == self.tasks * SAMPLES, where
            assert all(lag <= k for lag in r["lags"]), where  # the bound
            for g in r["kept"]:
                d = self.drawn[(r["iteration"], g.task_id)]
                assert d["version"] == g.policy_version, where  # the version it was drawn with
                assert g.policy_version >= max(0, r["iteration"] - 1 - k) or d["generation"] < r["generation"], where
                if r["version"] - g.policy_version < 0:
                    # negative only for groups drawn with a previous incarnation's weights
                    assert d["generation"] < r["generation"], (where, d)
            if k == 0 and r["restarts"] == 0:
                # exactly on-policy: iteration i from version i - 1, nothing dropped
                assert {g.policy_version for g in r["kept"]} == {r["iteration"] - 1} and r["dropped"] == 0, where
            # With one k for the whole run no group can be too old, restarts or not: a task of
            # iteration j asks for j - 1 - k and the trainer of j is at j - 1 in every lineage.
            assert r["dropped"] == 0 and lag_summary(r["lags"])["policy_lag_max"] <= k, where
        for s in self.submits:
            where = f"{ctx}: submit {s}"
            j = s["iteration"]
            # the version a task asks for: at least j - 1 - k, with the submitter's generation
            assert s["versions"] == {max(0, j - 1 - k)}, where
            assert s["wversions"] == {weights_version(s["generation"], max(0, j - 1 - k))}, where
            assert 1 <= j <= self.last, where
            if s["current"] and not s["background"]:
                assert s["driver_at"] <= j <= s["driver_at"] + k, where  # while waiting for i: i .. i + k
            if s["current"] and s["background"]:
                # during i's update: i + 1 + k (submitted there; it may land as late as the next iterations)
                assert j <= s["driver_at"] + 1 + k, where
        for member, idle, ref in self.idle:
            assert 0.0 <= idle <= 1.0, (ctx, member)
            assert idle == pytest.approx(min(1.0, max(0.0, ref)), abs=1e-6), (ctx, member, idle, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_simulated_async_run_never_trains_a_group_older_than_k_nor_loses_one(seed, tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_only, "unpack_state_dict", lambda blob: {})
    rng = random.Random(seed)
    for run in range(4):
        sim = Sim(rng, tmp_path / f"run{run}", f"seed {seed} run {run}")
        monkeypatch.setattr(rollout_only, "time", types.SimpleNamespace(monotonic=sim.clock))  # catch-up throttle on the sim's clock
        try:
            sim.run()
            sim.check()
        finally:
            sim.land_background(force=True)


# -- bugs found by this file, each reduced to a minimal case (fixed) ---------------------------------------


@pytest.mark.parametrize("durable,k", [(False, 2), (True, 8)], ids=["in-memory-k2", "durable-k8"])
def test_a_sealed_iteration_submitted_ahead_is_kept_until_the_trainer_fetched_it(durable, k, tmp_path):
    """README: with k >= 1 "the driver keeps k iterations submitted ahead of the one it waits for"
    (rollout.max_staleness accepts 0..64). The trainer waits for iteration 2, one of whose groups
    straggles (a slow engine, a lapsed task lease), while the engines finish 3 .. 2 + k (their tasks
    ask for versions <= 1, which the trainer already pushed). When 2 seals, the scheduler keeps the
    groups of only the KEEP_SEALED_GROUPS = 2 newest *by seal order* in memory (in-memory store:
    nothing to read them back from), and at most --keep-iterations = 8 sealed iterations at all:
    iteration 3, sealed and never fetched, was gone, and the trainer's fetch of it failed. Now what
    the trainers have not fetched is kept (core.KEEP_UNFETCHED)."""
    from tests.unit.scheduler_harness import group, specs

    h = Harness(state_dir=tmp_path if durable else None)
    a = h.worker("a", slots=1000)
    window = SubmissionWindow(k, 40)

    def submit(j: int) -> None:
        h.sched.submit(RUN, j, specs(2), IterationConfig())
        window.mark(j)

    def finish(j: int, task_ids=("t00", "t01")) -> None:
        ack, err = h.sched.accept(a, [(j, group(t)) for t in task_ids])
        assert err is None and ack.accepted == len(task_ids)
        h.sched.tick()

    def fetch(j: int) -> list:
        return h.sched.shard(RUN, j, 0, 1, Split.TRAIN)

    for j in window.due(1):
        submit(j)
    finish(1)
    assert len(fetch(1)) == 2  # iteration 1 trained
    submit(window.ahead(1))  # 2 + k, during the update of 1 (asks for version 1)
    assert window.due(2) == []  # the trainer (at version 1) waits for 2
    finish(2, ["t00"])  # t01 straggles
    for j in range(3, 3 + k):
        finish(j)
    finish(2, ["t01"])
    assert h.it(2).sealed
    assert len(fetch(2)) == 2  # iteration 2 trained
    for j in range(3, 3 + k):  # the next ones, sealed all along, never fetched yet
        try:
            assert len(fetch(j)) == 2
        except NotFoundError as exc:
            pytest.fail(f"k={k}: iteration {j} sealed but its groups are gone before the trainer fetched it: {exc}")


def test_a_rollout_only_worker_never_draws_a_task_with_a_policy_older_than_it_names_after_a_trainer_restart(monkeypatch):
    """rollout_only.CoordinatorWeights: "A task needs both at least its weights version and at least
    its policy version: a worker group that re-formed publishes again from the checkpoint it
    resumed, under a newer generation but an older policy, which must not pass for the policy an
    earlier generation's task asked for." A worker holds generation 1's policy 5; the trainer
    restarts from checkpoint 3 and publishes (generation 2, policy 3). A task generation 1 submitted
    (the resumed driver's submit of the same iteration is a no-op, so the old task stays) asks for
    policy >= 5: ``wait`` passes (the worker holds (1, 5)), then its catch-up loads (2, 3), and the
    group is drawn (and stamped) with policy 3. Found by the simulated run (see SimEngine.passes)."""
    monkeypatch.setattr(rollout_only, "unpack_state_dict", lambda blob: {})
    monkeypatch.setattr(rollout_only, "CATCH_UP_EVERY_S", 0.0)
    store, engine = FakeWeights(), RecordingEngine()
    gate = CoordinatorWeights(store, RUN, engine, threading.RLock())
    store.newest = weights_version(1, 5)
    gate.wait(5, weights_version(1, 5), 0.05)
    assert engine.version == 5
    store.newest = weights_version(2, 3)  # the restarted worker group's first publish
    try:
        gate.wait(5, weights_version(1, 5), 0.05)
    except PolicyVersionTimeout:
        return  # waiting until the new generation reaches policy 5 keeps the promise too
    # the engine then draws the task: it must hold at least the policy the task names
    assert engine.version >= 5, f"the task asked for policy >= 5; the engine draws it with {engine.version}"


def test_an_in_place_reform_to_an_older_checkpoint_closes_the_gate_to_versions_the_engine_no_longer_holds(monkeypatch):
    """loop.NodeTrainer._iteration: "an engine draws a task only once its node holds at least the
    policy version the task names (VersionGate; ...)"; VersionGate: "the engine may draw a task's
    group once the node pushed at least the policy version the task names". In place, the engine
    worker and its gate survive the re-form (train/inplace.py), and ``_push(start)`` only
    ``advance``s the gate (a max): resumed at version 3 (no complete snapshot newer than the
    checkpoint of 3, e.g. checkpoint.snapshots = false) after releasing version 5, the gate still
    lets tasks that name versions 4 and 5 through while the engine holds 3. Their groups are drawn
    with 3 and, beyond k, dropped at fetch (an engine that does not share the trainer's module, HF
    say, keeps drawing during the update: with k = 0 that can be the whole presubmitted next
    iteration, "no groups to train on")."""
    from elasticrl.train import inplace, loop

    class Engine:
        policy_version = 5

        def set_version(self, v):
            self.policy_version = v

    t = loop.NodeTrainer.__new__(loop.NodeTrainer)
    t.cfg = types.SimpleNamespace()
    t.gate = VersionGate()
    t.gate.advance(5)  # the lost world released version 5
    t.version, t.generation, t._token = 5, 1, None
    t.engine, t.shares_module, t.engine_lock, t.publisher = Engine(), True, threading.RLock(), None
    t.world = types.SimpleNamespace(rank=1, world_size=1)
    t.logctx = types.SimpleNamespace(node="n", rank=1)
    t.recovery = types.SimpleNamespace(close=lambda: None)
    t.membership = types.SimpleNamespace(lease_ttl_s=1.0)
    t.watch = types.SimpleNamespace(await_loss=lambda timeout_s: ("rank-0",))
    t.reformer = types.SimpleNamespace(reform=lambda *a: (["rank-1"], t.world))
    t.strategy = types.SimpleNamespace(regroup=lambda: None, module=None)
    t._next_generation = lambda: 2
    t._lead = lambda token: None
    t._resume = lambda: 3  # the newest complete state: the checkpoint of iteration 3
    monkeypatch.setattr(inplace, "is_peer_failure", lambda exc: True)
    monkeypatch.setattr(inplace, "Recovery", lambda *a: types.SimpleNamespace(setup=lambda generation: None))
    monkeypatch.setattr(inplace.reform, "abortable_ddp", lambda *a: None)
    assert t._reform(RuntimeError("gloo: connection reset by peer")) == 4
    assert t.version == 3 and t.engine.policy_version == 3
    with pytest.raises(PolicyVersionTimeout):  # a task naming version 4 must wait: the engine holds 3
        t.gate.wait(4, 0, 0.0)
