"""Rendezvous rounds in CoordinatorCore: every change is persisted before memory changes, and the
persisted state (timed-out members included) survives a restart. Injected clock, no sleeps."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from elasticrl.coordinator.core import CoordinatorCore
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.state import RoundConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


def _disk_full(*args, **kwargs):
    raise sqlite3.OperationalError("database or disk is full")


def _wait_once(core, member, cfg, *, after_round=0):
    """One RoundJoin that returns at once (wait_s=0): the member is then waiting, or has a result."""
    return run(core.round_join("r", member.member_id, member.incarnation, cfg, after_round=after_round, wait_s=0))


def _snapshot(rdzv):
    return (
        rdzv.config, rdzv.round, list(rdzv.participants), dict(rdzv.waiting), dict(rdzv.timed_out),
        rdzv.waiting_since, rdzv.min_reached_at,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _time_out_a(core, clock, cfg):
    """a waits alone for a round that needs two nodes, until the join timeout passes."""
    a, _ = core.join("r", "a", lease_ttl_s=1000.0)
    assert _wait_once(core, a, cfg).status == "waiting"
    clock.now += cfg.join_timeout_s
    return a


def test_failed_write_on_round_join_leaves_rendezvous_untouched(clock, monkeypatch):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=1.0, clock=clock)
    a, _ = core.join("r", "a")
    cfg = RoundConfig(2, 2, 1.0, 60.0)
    before = _snapshot(core.runs["r"].rendezvous)
    monkeypatch.setattr(core.db, "put_rendezvous", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        _wait_once(core, a, cfg)
    assert _snapshot(core.runs["r"].rendezvous) == before  # not waiting, no config, no timers
    monkeypatch.undo()
    assert _wait_once(core, a, cfg).status == "waiting"
    assert core.runs["r"].rendezvous.waiting == {"a": a.incarnation}


def test_failed_write_on_round_completion_leaves_rendezvous_untouched(clock, monkeypatch):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=1000.0, clock=clock)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    cfg = RoundConfig(2, 2, 1.0, 60.0)
    assert _wait_once(core, a, cfg).status == "waiting"
    before = _snapshot(core.runs["r"].rendezvous)
    monkeypatch.setattr(core.db, "put_rendezvous", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        _wait_once(core, b, cfg)  # b's arrival would complete the round
    assert _snapshot(core.runs["r"].rendezvous) == before
    monkeypatch.undo()
    assert _wait_once(core, b, cfg).round == 1
    assert _wait_once(core, a, cfg).round == 1


def test_failed_write_on_round_timeout_leaves_waiting_and_timed_out_untouched(clock, monkeypatch):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=1.0, clock=clock)
    cfg = RoundConfig(2, 2, 1.0, 10.0)
    a = _time_out_a(core, clock, cfg)
    rdzv = core.runs["r"].rendezvous
    before = _snapshot(rdzv)
    monkeypatch.setattr(core.db, "put_rendezvous", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        core.tick()
    assert _snapshot(core.runs["r"].rendezvous) == before
    assert core.runs["r"].rendezvous.waiting == {"a": a.incarnation} and not core.runs["r"].rendezvous.timed_out
    monkeypatch.undo()
    core.tick()
    assert core.runs["r"].rendezvous.timed_out.keys() == {"a"} and not core.runs["r"].rendezvous.waiting


def test_failed_write_when_reporting_a_timeout_keeps_the_report(clock, monkeypatch):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=1.0, clock=clock)
    cfg = RoundConfig(2, 2, 1.0, 10.0)
    a = _time_out_a(core, clock, cfg)
    core.tick()
    monkeypatch.setattr(core.db, "put_rendezvous", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        _wait_once(core, a, cfg)
    assert core.runs["r"].rendezvous.timed_out.keys() == {"a"}  # still owed to a
    monkeypatch.undo()
    result = _wait_once(core, a, cfg)
    assert result.status == "timed_out" and "min_nodes=2" in result.reason


def test_timed_out_survives_a_restart_and_is_reported_once(tmp_path, clock):
    path = tmp_path / "s.sqlite"
    core = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)
    cfg = RoundConfig(2, 2, 1.0, 10.0)
    a = _time_out_a(core, clock, cfg)
    core.tick()
    assert core.runs["r"].rendezvous.timed_out.keys() == {"a"}
    core.db.close()

    clock.now += 1000.0  # a new process
    again = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)
    assert again.runs["r"].rendezvous.timed_out.keys() == {"a"}
    result = _wait_once(again, a, cfg)
    assert result.status == "timed_out" and "join timeout" in result.reason
    again.db.close()

    third = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)  # the report was consumed
    assert not third.runs["r"].rendezvous.timed_out
    assert _wait_once(third, a, cfg).status == "waiting"


def test_rows_written_before_timed_out_was_persisted_still_load(tmp_path, clock):
    path = tmp_path / "s.sqlite"
    db = StateDB(path)
    db.connection.execute("INSERT INTO runs VALUES ('r', 1, 0, '')")
    db.connection.execute(
        "INSERT INTO rendezvous VALUES ('r', ?)",
        ('{"config": [2, 3, 1.0, 60.0], "round": 1, "participants": [["a", 1]], "waiting": [["a", 1]]}',),
    )
    db.close()
    rdzv = CoordinatorCore(StateDB(path), clock=clock).runs["r"].rendezvous
    assert rdzv.round == 1 and rdzv.waiting == {"a": 1} and rdzv.timed_out == {}


def test_last_call_closes_after_a_restart_with_min_nodes_waiting(tmp_path, clock):
    """A restart forgets when min_nodes was reached; the last call restarts from the load."""
    path = tmp_path / "s.sqlite"
    core = CoordinatorCore(StateDB(path), lease_ttl_s=1000.0, clock=clock)
    cfg = RoundConfig(2, 3, 1.0, 60.0)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    assert _wait_once(core, a, cfg).status == "waiting"
    assert _wait_once(core, b, cfg).status == "waiting"  # min reached, last call open
    core.db.close()

    clock.now += 1000.0
    again = CoordinatorCore(StateDB(path), lease_ttl_s=1000.0, clock=clock)
    clock.now += cfg.last_call_s
    again.tick()
    assert again.runs["r"].rendezvous.round == 1
    assert _wait_once(again, a, cfg).world_size == 2


def test_a_new_nnodes_is_taken_once_no_node_of_the_run_is_live(tmp_path, clock):
    # Found by an operator: a new Kubernetes Job with another MAX could never go on with the run.
    from elasticrl.errors import InvalidRequestError

    path = tmp_path / "s.sqlite"
    core = CoordinatorCore(StateDB(path), lease_ttl_s=1000.0, clock=clock)
    old = RoundConfig(1, 1, 1.0, 60.0)
    a, _ = core.join("r", "a")
    assert _wait_once(core, a, old).world_size == 1
    bigger = RoundConfig(1, 2, 1.0, 60.0)
    b, _ = core.join("r", "b")
    with pytest.raises(InvalidRequestError, match=r"--nnodes=1:2 differs from the run's 1:1.*no node of the run's rounds is live"):
        _wait_once(core, b, bigger)  # a still runs: every node of one job passes the same --nnodes
    core.leave("r", "a", a.incarnation)
    d, _ = core.join("r", "d")  # another node of the new job, joined but not yet asking for a round
    assert _wait_once(core, b, bigger).status == "waiting"  # the old job is gone: its size goes with it
    assert _wait_once(core, d, bigger).world_size == 2  # max_nodes reached: the new job's round of 2
    assert core.runs["r"].rendezvous.config == bigger
    core.db.close()
    again = CoordinatorCore(StateDB(path), lease_ttl_s=1000.0, clock=clock)  # persisted with the waiting set
    assert again.runs["r"].rendezvous.config == bigger
    c, _ = again.join("r", "c")
    with pytest.raises(InvalidRequestError, match="differs from the run's 1:2"):
        _wait_once(again, c, old)  # b and d run with the new size
