"""Seeded random schedules for the node session relay (``coordinator/session_relay.py``).

Each seed replays one sequence of steps against a real coordinator: members of two runs, behind
one or two in-process relays or streaming directly, arrive at barriers while members are killed
(their stream ends without ``close``), leave, join (fresh names or a gone member's name again),
miss a short barrier timeout (EVICT_MISSING or REPORT) or the coordinator restarts on its state
dir. Both runs' barriers of a step share a name and run at once through the same relays, so an
answer split to the wrong member shows as the other run's member list.

Checked at every step: each arrival returns within a hard deadline, with the one decided result
every other arrival at that barrier got (or the elasticrl error its member earned: FencedError
once evicted or gone), equal to the model's (arrived, evicted, missing); a killed member is
evicted by its broken stream within the grace (its lease could not explain it); a member that
is gone never shows up in a later barrier's arrived list; and the relays hold no state for
members that are gone once everyone left.

Extra seeds: ``RELAY_RANDOM_SEEDS=100-129 pytest tests/integration/test_session_relay_random.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import threading
import time

import pytest

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.coordinator.member_stream import MemberStream
from elasticrl.coordinator.session_relay import RelayThread
from elasticrl.coordinator.state import BarrierResult
from elasticrl.errors import BarrierTimeoutError, ElasticRLError, FencedError
from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.waits]

LEASE_TTL_S = 10.0  # a keep-alive every 3.3 s: an eviction within EVICT_BOUND_S is the broken stream's
STREAM_GRACE_S = 1.5  # --stream-grace (default 0.5): room for a relay's members to stream directly on a loaded CI machine
EVICT_BOUND_S = STREAM_GRACE_S + 4.0
LONG_TIMEOUT_S = 30.0  # a barrier that must not time out
SHORT_TIMEOUT_S = 1.2  # a barrier whose absent members time out
STEP_DEADLINE_S = 30.0  # every arrival of a step returns within this (the client gives up after ~48 s)


def _seeds() -> list[int]:
    spec = os.environ.get("RELAY_RANDOM_SEEDS", "")
    if not spec:
        return list(range(8))
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


class _Killed(Exception):
    """Raised in a killed member's renewal thread instead of reopening its stream: the process is gone."""


class Killer:
    """Ends a ``Membership``'s stream as a killed process's would: the connection (to the relay, or a
    direct gRPC stream) goes without a ``close``, and the member never reopens or leaves."""

    def __init__(self, monkeypatch):
        self._lock = threading.Lock()
        self._calls: dict[MemberStream, object] = {}
        self._killed: set[MemberStream] = set()
        original = MemberStream._open

        def _open(stream, requests):
            with self._lock:
                if stream in self._killed:
                    raise _Killed(stream.member_id)
            call = original(stream, requests)
            with self._lock:
                if stream in self._killed:
                    call.cancel()
                    raise _Killed(stream.member_id)
                self._calls[stream] = call
            return call

        monkeypatch.setattr(MemberStream, "_open", _open)

    def kill(self, m: Membership) -> None:
        with self._lock:
            self._killed.add(m._stream)
            call = self._calls.get(m._stream)
        if call is not None:
            call.cancel()
        m._thread.join(10)
        assert not m._thread.is_alive(), f"{m.member_id}'s renewal thread outlived its kill"


def _norm(r) -> tuple:
    """What every arrival at one barrier must agree on."""
    if isinstance(r, BarrierResult):
        return ("completed", tuple(r.arrived), tuple(r.evicted), tuple(r.missing), r.epoch, r.reason)
    if isinstance(r, BarrierTimeoutError):
        return ("timed_out", tuple(r.arrived), (), tuple(r.missing), str(r))
    return ("error", type(r).__name__, str(r))


class Sim:
    def __init__(self, rng: random.Random, coord, client: CoordinatorClient, relays: list[RelayThread],
                 killer: Killer, pool: concurrent.futures.ThreadPoolExecutor):
        self.rng, self.coord, self.client, self.relays, self.killer, self.pool = rng, coord, client, relays, killer, pool
        self.live: dict[str, dict[str, Membership]] = {"ra": {}, "rb": {}}  # run -> name -> its live Membership
        self.via: dict[tuple[str, str], str] = {}
        self.gone: dict[str, set[str]] = {"ra": set(), "rb": set()}  # names gone and not joined again
        self.dead: list[Membership] = []  # killed, fenced or left: never used again
        self.fresh = 0
        self.restarted = False
        self.stopped: set[int] = set()  # relays taken down: their members stream directly
        self.trace: list[str] = []

    def fail(self, message: str) -> None:
        pytest.fail(message + "\nsteps so far:\n  " + "\n  ".join(self.trace), pytrace=False)

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.fail(message)

    # -- membership ----------------------------------------------------------------------------

    def join(self, run: str, name: str) -> Membership:
        via = self.rng.choice([f"relay{i}" for i in range(len(self.relays))] * 2 + ["direct"])
        path = "" if via == "direct" else self.relays[int(via[5:])].path
        if via != "direct" and int(via[5:]) in self.stopped:  # a relay that is gone: it streams directly
            via = "direct"
        m = Membership(self.client, run, name, relay=path)
        self.check(m.streaming.wait(10), f"{run}/{name} ({via}): no keep-alive answered within 10s")
        self.live[run][name] = m
        self.via[(run, name)] = via
        self.gone[run].discard(name)
        self.trace.append(f"join {run}/{name} inc {m.incarnation} via {via}")
        return m

    def depart(self, run: str, name: str) -> Membership:
        m = self.live[run].pop(name)
        self.gone[run].add(name)
        self.dead.append(m)
        return m

    def state(self, run: str, m: Membership) -> dict:
        (r,) = self.client.status(run, include_departed=True)["runs"]
        return next(x for x in r["snapshot"]["members"] + r["departed"]
                    if x["member_id"] == m.member_id and int(x["incarnation"]) == m.incarnation)

    def open_arrived(self, run: str, name: str) -> set[str] | None:
        (r,) = self.client.status(run)["runs"]
        return next((set(b.get("arrived", [])) for b in r.get("open_barriers", []) if b["name"] == name), None)

    def wait_open(self, run: str, name: str, who: set[str]) -> None:
        """Until barrier ``name`` is open with ``who`` among its arrivals."""
        if who:
            wait_until(lambda: (self.open_arrived(run, name) or set()) >= who, 15, message=f"{sorted(who)} recorded at {run}/{name}")

    # -- arrivals --------------------------------------------------------------------------------

    def submit(self, run: str, name: str, who: str, *, timeout_s: float, policy: str = "evict_missing",
               delay_s: float = 0.0) -> concurrent.futures.Future:
        m = self.live[run][who]

        def go():
            if delay_s:
                time.sleep(delay_s)
            try:
                return m.arrive(name, timeout_s=timeout_s, policy=policy)
            except ElasticRLError as exc:
                return exc

        return self.pool.submit(go)

    def everyone(self, run: str, name: str, *, timeout_s: float = LONG_TIMEOUT_S, skip: set[str] = frozenset()) -> dict:
        return {who: self.submit(run, name, who, timeout_s=timeout_s, delay_s=self.rng.uniform(0, 0.05))
                for who in sorted(self.live[run]) if who not in skip}

    def collect(self, run: str, name: str, futures: dict[str, concurrent.futures.Future], deadline: float) -> dict:
        out = {}
        for who, f in futures.items():
            try:
                out[who] = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self.fail(f"{run}/{name}: {who}'s arrival did not return within {STEP_DEADLINE_S}s (hung)")
        return out

    def expect(self, run: str, name: str, results: dict, *, arrived: list[str], evicted: list[str] = (),
               missing: list[str] = (), timed_out: bool = False) -> None:
        """Every arrival got the one decided result, and it is the model's."""
        if not results:
            return
        seen = {who: _norm(r) for who, r in results.items()}
        self.check(len(set(seen.values())) == 1, f"{run}/{name}: arrivals got different answers: {seen}")
        got = next(iter(seen.values()))
        kind = "timed_out" if timed_out else "completed"
        want = (kind, tuple(sorted(arrived)), tuple(sorted(evicted)) if not timed_out else (), tuple(sorted(missing)))
        self.check(got[:4] == want, f"{run}/{name}: decided {got}, the model says {want}")
        for who in results:  # an answer meant for another member (of this run or the other) shows here
            self.check(who in got[1], f"{run}/{name}: {who} got an answer that does not list it: {got}")
        stale = set(got[1]) & self.gone[run]
        self.check(not stale, f"{run}/{name}: gone member(s) {sorted(stale)} in the arrived list {got[1]}")
        self.trace.append(f"  {run}/{name} -> {got[:4]}")

    def expect_error(self, run: str, name: str, who: str, result, error: type) -> None:
        self.check(isinstance(result, error), f"{run}/{name}: {who} should have got {error.__name__}, got {result!r}")

    # -- steps ---------------------------------------------------------------------------------

    def step(self, i: int) -> None:
        rng = self.rng
        name = f"s{i}"
        run = rng.choice(["ra", "ra", "rb"])
        other = "rb" if run == "ra" else "ra"
        kinds = ["all", "late", "join"]
        if len(self.live[run]) >= 2:
            kinds += ["timeout", "kill", "kill", "leave"]
        if not self.restarted:
            kinds.append("restart")
        if not self.stopped:
            kinds.append("relay_down")
        kind = rng.choice(kinds)
        self.trace.append(f"step {i}: {kind} at {run}/{name} (live {sorted(self.live[run])}, other {sorted(self.live[other])})")
        deadline = time.monotonic() + STEP_DEADLINE_S
        # the other run's barrier of the same name, at the same time, through the same relays
        others = self.everyone(other, name)
        others_live = sorted(self.live[other])
        getattr(self, f"_{kind}")(run, name, deadline)
        self.expect(other, name, self.collect(other, name, others, deadline), arrived=others_live)
        self.trace.append(f"  ({STEP_DEADLINE_S - (deadline - time.monotonic()):.2f}s)")

    def _all(self, run: str, name: str, deadline: float) -> None:
        live = sorted(self.live[run])
        self.expect(run, name, self.collect(run, name, self.everyone(run, name), deadline), arrived=live)

    def _late(self, run: str, name: str, deadline: float) -> None:
        live = sorted(self.live[run])
        late = self.rng.choice(live)
        futures = self.everyone(run, name, skip={late})
        futures[late] = self.submit(run, name, late, timeout_s=LONG_TIMEOUT_S, delay_s=self.rng.uniform(0.2, 0.5))
        self.trace.append(f"  {late} arrives late")
        self.expect(run, name, self.collect(run, name, futures, deadline), arrived=live)

    def _timeout(self, run: str, name: str, deadline: float) -> None:
        rng = self.rng
        live = sorted(self.live[run])
        absent = sorted(rng.sample(live, rng.randint(1, len(live) - 1)))
        present = [n for n in live if n not in absent]
        policy = rng.choice(["evict_missing", "report"])
        self.trace.append(f"  absent {absent}, policy {policy}, timeout {SHORT_TIMEOUT_S}s")
        futures = {who: self.submit(run, name, who, timeout_s=SHORT_TIMEOUT_S, policy=policy, delay_s=rng.uniform(0, 0.05))
                   for who in present}
        results = self.collect(run, name, futures, deadline)
        straggler = rng.choice(absent)  # arrives once the barrier is decided
        late = self.collect(run, name, {straggler: self.submit(run, name, straggler, timeout_s=SHORT_TIMEOUT_S, policy=policy)}, deadline)
        if policy == "report":  # nobody is evicted; the straggler gets the same report
            self.expect(run, name, results, arrived=present, missing=absent, timed_out=True)
            self.check(_norm(late[straggler]) == _norm(next(iter(results.values()))),
                       f"{run}/{name}: straggler {straggler} got {late[straggler]!r}, the others {next(iter(results.values()))!r}")
            return
        self.expect(run, name, results, arrived=present, evicted=absent, missing=absent)
        self.expect_error(run, name, straggler, late[straggler], FencedError)
        for who in absent:
            m = self.depart(run, who)
            st = self.state(run, m)
            self.check(st["state"] == "MEMBER_STATE_EVICTED" and "missed barrier" in st["reason"], f"{run}/{who}: {st}")

    def _kill(self, run: str, name: str, deadline: float, *, leave: bool = False) -> None:
        rng = self.rng
        live = sorted(self.live[run])
        victim = rng.choice(live)
        rest = [n for n in live if n != victim]
        victim_arrives = rng.random() < 0.5
        if leave and self.via[(run, victim)] == "direct":
            # Not on a direct stream: the coordinator holds a half-closed stream open until its waiting
            # arrival is answered, so ``leave`` waits out its join timeout (call_timeout_s + 1).
            victim_arrives = False
        # If the victim arrives, someone must arrive after its eviction, or the barrier completes with it.
        early = sorted(rng.sample(rest, rng.randint(0 if victim_arrives else 1, len(rest) - (1 if victim_arrives else 0))))
        late = [n for n in rest if n not in early]
        self.trace.append(f"  {'leave' if leave else 'kill'} {victim} ({self.via[(run, victim)]}), it arrives first: {victim_arrives}, early {early}")
        futures = {who: self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S) for who in early}
        if victim_arrives:
            futures[victim] = self.submit(run, name, victim, timeout_s=LONG_TIMEOUT_S)
        self.wait_open(run, name, set(early) | ({victim} if victim_arrives else set()))
        m = self.depart(run, victim)
        if leave:
            m.leave("random schedule")
            st = self.state(run, m)
            self.check(st["state"] == "MEMBER_STATE_LEFT", f"{run}/{victim} left: {st}")
        else:
            killed = time.monotonic()
            self.killer.kill(m)
            st = wait_until(lambda: (s := self.state(run, m))["state"] == "MEMBER_STATE_EVICTED" and s,
                            EVICT_BOUND_S + 10, message=f"{victim}'s eviction")
            took = time.monotonic() - killed
            self.check(took <= EVICT_BOUND_S and "stream broke" in st["reason"],
                       f"{run}/{victim} killed: evicted after {took:.2f}s (bound {EVICT_BOUND_S}s): {st}")
        for who in late:
            futures[who] = self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S, delay_s=rng.uniform(0, 0.05))
        results = self.collect(run, name, futures, deadline)
        if victim_arrives:  # its waiting arrival is answered FencedError: it is no longer live
            self.expect_error(run, name, victim, results.pop(victim), FencedError)
        self.expect(run, name, results, arrived=rest, evicted=[victim])

    def _leave(self, run: str, name: str, deadline: float) -> None:
        self._kill(run, name, deadline, leave=True)

    def _join(self, run: str, name: str, deadline: float) -> None:
        rng = self.rng
        live = sorted(self.live[run])
        early = sorted(rng.sample(live, rng.randint(0, len(live) - 1)))
        if self.gone[run] and rng.random() < 0.5:
            new = rng.choice(sorted(self.gone[run]))  # a restarted worker: the same name, a new incarnation
        else:
            self.fresh += 1
            new = f"{run[1]}n{self.fresh}"
        futures = {who: self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S) for who in early}
        self.wait_open(run, name, set(early))
        self.join(run, new)
        futures[new] = self.submit(run, name, new, timeout_s=LONG_TIMEOUT_S)
        self.wait_open(run, name, set(early) | {new})
        for who in live:
            if who not in early:
                futures[who] = self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S, delay_s=rng.uniform(0, 0.05))
        self.expect(run, name, self.collect(run, name, futures, deadline), arrived=[*live, new])

    def _restart(self, run: str, name: str, deadline: float) -> None:
        rng = self.rng
        self.restarted = True
        live = sorted(self.live[run])
        early = sorted(rng.sample(live, rng.randint(0, len(live))))
        self.trace.append(f"  coordinator restart after {early} arrived")
        futures = {who: self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S) for who in early}
        if len(early) < len(live):
            self.wait_open(run, name, set(early))
        else:  # all arrived: the restart races the release's delivery
            time.sleep(rng.uniform(0, 0.05))
        opened = [r.streams_opened for r in self.relays]
        self.coord.kill()
        self.coord.start()
        for who in live:
            if who not in early:
                futures[who] = self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S, delay_s=rng.uniform(0, 0.05))
        self.expect(run, name, self.collect(run, name, futures, deadline), arrived=live)
        # Every member streams again (through its relay, which opened a new stream) before the next step.
        members = [m for ms in self.live.values() for m in ms.values()]
        wait_until(lambda: all(m._stream._put is not None for m in members), 15, message="the members' streams after the restart")
        used = {self.via[(run, name)] for run, ms in self.live.items() for name in ms}
        for i, (r, before) in enumerate(zip(self.relays, opened)):
            if f"relay{i}" in used and i not in self.stopped:
                wait_until(lambda r=r, before=before: r.streams_opened > before, 15, message="a relay's new stream")

    def _relay_down(self, run: str, name: str, deadline: float) -> None:
        """A relay goes away mid-barrier: its members stream to the coordinator directly, within the
        stream grace, so none is evicted and the barrier completes with everyone."""
        rng = self.rng
        i = rng.randrange(len(self.relays))
        live = sorted(self.live[run])
        early = sorted(rng.sample(live, rng.randint(1, len(live))))
        self.trace.append(f"  relay{i} stops after {early} arrived")
        futures = {who: self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S) for who in early}
        if len(early) < len(live):
            self.wait_open(run, name, set(early))
        self.relays[i].stop()
        self.stopped.add(i)
        for who in live:
            if who not in early:
                futures[who] = self.submit(run, name, who, timeout_s=LONG_TIMEOUT_S, delay_s=rng.uniform(0, 0.05))
        self.expect(run, name, self.collect(run, name, futures, deadline), arrived=live)
        members = [(r, n, m) for r, ms in self.live.items() for n, m in ms.items()]
        wait_until(lambda: all(m._stream._put is not None for _, _, m in members), 15, message="the members' streams after the relay stopped")
        for r, n, m in members:
            if self.via[(r, n)] == f"relay{i}":
                self.via[(r, n)] = "direct"
                st = self.state(r, m)
                self.check(st["state"] == "MEMBER_STATE_LIVE", f"{r}/{n} lost its relay: {st}")

    # -- the end -------------------------------------------------------------------------------

    def leave_all(self) -> None:
        for run, ms in self.live.items():
            for name in sorted(ms):
                m = self.depart(run, name)
                m.leave("done")
                st = self.state(run, m)
                self.check(st["state"] == "MEMBER_STATE_LEFT", f"{run}/{name} left at the end: {st}")
        for i, r in enumerate(self.relays):  # nothing is left behind in a relay for members gone
            if i in self.stopped:
                continue
            relay = r._relay
            wait_until(lambda relay=relay: not (relay._conns or relay._routes or relay._carriers or relay._held), 10,
                       message=f"relay{i} to forget its members (conns {len(relay._conns)}, routes {len(relay._routes)}, "
                               f"carriers {dict(relay._carriers)}, held {len(relay._held)})")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", _seeds())
def test_random_schedule_through_relays(seed, coordinator_factory, monkeypatch):
    rng = random.Random(seed)
    killer = Killer(monkeypatch)
    coord = coordinator_factory(lease_ttl_s=LEASE_TTL_S, extra_args=["--stream-grace", str(STREAM_GRACE_S)])
    relays = [RelayThread(coord.address) for _ in range(rng.choice([1, 2]))]
    client = CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=15)
    pool = concurrent.futures.ThreadPoolExecutor(24, thread_name_prefix="arrive")
    sim = Sim(rng, coord, client, relays, killer, pool)
    try:
        for run, count in (("ra", rng.randint(3, 5)), ("rb", rng.randint(1, 2))):
            for n in range(count):
                sim.join(run, f"{run[1]}{n}")
        for i in range(rng.randint(4, 6)):
            sim.step(i)
        sim.leave_all()
        print("\n".join(sim.trace))  # shown with -s, or -rP
    finally:
        for ms in sim.live.values():
            for m in ms.values():
                with contextlib.suppress(Exception):
                    m.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        for r in relays:
            r.stop()
        client.close()
