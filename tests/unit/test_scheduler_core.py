"""SchedulerCore on a real CoordinatorCore with an injected clock: dispatch, exactly-once results,
fencing, requeues on eviction / disconnect / task lease / release, static shares, backup copies,
sealing, shards, and a simulated restart on the same files. Milliseconds, no sleeps."""

from __future__ import annotations

import array
import asyncio
import dataclasses
import json

import pytest

from elasticrl.errors import FencedError, InvalidRequestError, NotFoundError, NotReadyError, RunClosedError
from elasticrl.scheduler.core import FENCED_STREAM_GRACE_S, REDISPATCH_S, Cancel, End
from elasticrl.scheduler.state import RELEASE_STOPPING, IterationConfig, Policy, Split, TaskSpec, TaskStatus
from elasticrl.scheduler.store import MANIFEST

from tests.unit.scheduler_harness import RUN, Clock, Harness, assigned, cancelled, drain, group, spec, specs


def plain(s: TaskSpec) -> TaskSpec:
    """``s`` with its prompt as a list, to compare a spec the coordinator loaded (an array) with one made here."""
    return dataclasses.replace(s, prompt_ids=list(s.prompt_ids))


def ids(*numbers: int) -> list[str]:
    return [f"t{i:02d}" for i in numbers]


def accept(h: Harness, conn, *task_ids: str, iteration: int = 1, tokens: int = 3, seed: int = 0):
    return h.sched.accept(conn, [(iteration, group(tid, tokens, seed=seed)) for tid in task_ids])


# -- submit and dispatch ---------------------------------------------------------------------------


def test_dispatch_one_task_per_worker_per_pass_within_slots():
    h = Harness()
    a = h.worker("a", slots=2)
    b = h.worker("b", slots=1)
    assert h.sched.submit(RUN, 1, specs(5), IterationConfig(task_lease_s=30.0)) is True
    ma, mb = drain(a), drain(b)
    assert len(ma) == 1 and len(mb) == 1  # one Assign per worker per dispatch
    assert assigned(ma) == ids(0, 2) and assigned(mb) == ids(1)
    assert [(i, lease, backup) for i, _, lease, backup in ma[0].items] == [(1, 30.0, False), (1, 30.0, False)]
    it = h.it()
    assert list(it.queue) == ids(3, 4)
    assert a.worker.free == 0 and b.worker.free == 0
    assert it.tasks["t00"].holders["a"].deadline == h.clock.now + 30.0
    m = h.sched.manifest(it)
    assert (m["tasks_running"], m["tasks_queued"], m["tasks_done"]) == (3, 2, 0)
    assert {n["node"]: n["assigned"] for n in m["nodes"]} == {"a": 2, "b": 1}


def test_worker_connecting_later_takes_queued_tasks_in_order():
    h = Harness()
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    a = h.worker("a", slots=2)
    assert assigned(drain(a)) == ids(0, 1)
    assert list(h.it().queue) == ids(2)


def test_older_iteration_is_served_first():
    h = Harness()
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    h.clock.now += 1
    h.sched.submit(RUN, 2, specs(2), IterationConfig())
    a = h.worker("a", slots=3)
    [msg] = drain(a)
    assert [(i, s.task_id) for i, s, _, _ in msg.items] == [(1, "t00"), (1, "t01"), (2, "t00")]


def test_the_lower_iteration_is_served_first_even_when_submitted_later():
    """Iterations submitted ahead (rollout.max_staleness) or one submitted again after a trainer
    restart: the lowest number, which the trainer waits for, is handed out first."""
    h = Harness()
    h.sched.submit(RUN, 3, specs(2), IterationConfig())
    h.clock.now += 1
    h.sched.submit(RUN, 2, specs(2), IterationConfig())
    a = h.worker("a", slots=3)
    [msg] = drain(a)
    assert [(i, s.task_id) for i, s, _, _ in msg.items] == [(2, "t00"), (2, "t01"), (3, "t00")]


def test_connect_needs_a_live_member_with_that_incarnation():
    h = Harness()
    with pytest.raises(NotFoundError):
        h.sched.connect(RUN, "ghost", 1, slots=1, weight=1.0)
    old = h.join("a")
    h.join("a")  # restarted: the old incarnation is replaced
    with pytest.raises(FencedError):
        h.sched.connect(RUN, "a", old, slots=1, weight=1.0)


def test_resubmit_same_tasks_is_a_no_op_other_tasks_are_refused():
    h = Harness()
    a = h.worker("a")
    assert h.sched.submit(RUN, 1, specs(3), IterationConfig()) is True
    assert assigned(drain(a)) == ids(0)
    assert h.sched.submit(RUN, 1, specs(3), IterationConfig()) is False
    assert drain(a) == [] and list(h.it().queue) == ids(1, 2)
    with pytest.raises(InvalidRequestError, match="already submitted"):
        h.sched.submit(RUN, 1, specs(4), IterationConfig())
    with pytest.raises(InvalidRequestError):
        h.sched.submit(RUN, 1, [spec(2), spec(1), spec(0)], IterationConfig())
    h.coord.close_run(RUN, "finished")
    with pytest.raises(RunClosedError):
        h.sched.submit(RUN, 2, specs(1), IterationConfig())


# -- results: exactly once ---------------------------------------------------------------------------


def test_result_is_accepted_once_and_a_second_copy_is_refused_as_duplicate():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    drain(a)
    ack, err = accept(h, a, "t00", tokens=4)
    assert err is None and ack.accepted == 1 and ack.refused == []
    it = h.it()
    assert it.tasks["t00"].status is TaskStatus.DONE and it.tasks["t00"].done_by == "a"
    assert it.groups["t00"].node == "a" and it.groups["t00"].samples[0].token_ids() == [0, 1, 2, 3]
    assert assigned(drain(a)) == ids(1)  # the freed slot is refilled at once
    ack, err = accept(h, a, "t00", seed=50)
    assert err is None and ack.accepted == 0 and ack.refused == [(1, "t00", "duplicate")]
    assert it.groups["t00"].samples[0].token_ids() == [0, 1, 2, 3]  # the first result stays
    assert it.counters.refused_duplicate == 1
    assert (it.nodes["a"].done, it.nodes["a"].refused, it.nodes["a"].tokens) == (1, 1, 8)
    assert a.worker.free == 0  # the duplicate did not free t01's slot


def test_two_copies_in_one_batch_store_only_the_first():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    ack, _ = h.sched.accept(a, [(1, group("t00", 2)), (1, group("t00", 2, seed=7))])
    assert ack.accepted == 1 and ack.refused == [(1, "t00", "duplicate")]
    assert h.it().groups["t00"].samples[0].token_ids() == [0, 1]
    assert h.it().counters.refused_duplicate == 1


def test_unknown_task_or_iteration_is_refused():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    ack, err = h.sched.accept(a, [(1, group("t99")), (7, group("t00"))])
    assert err is None and ack.accepted == 0
    assert ack.refused == [(1, "t99", "unknown"), (7, "t00", "unknown")]
    it = h.it()
    assert it.tasks["t00"].status is TaskStatus.RUNNING and it.groups == {}


def test_results_of_a_replaced_incarnation_are_refused_as_fenced_and_counted():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(1)
    h.join("a")  # a restarted and joined again: its old stream is fenced
    # a fenced stream gets no new work (whether it is told to cancel is the core's choice)
    assert assigned(drain(a)) == [] and a.worker.fenced and a.worker.free == 0
    it = h.it()
    assert it.tasks["t00"].status is TaskStatus.QUEUED and list(it.queue) == ids(0)
    ack, err = accept(h, a, "t00")
    assert isinstance(err, FencedError)
    assert ack.accepted == 0 and ack.refused == [(1, "t00", "fenced")]
    assert it.counters.refused_fenced == 1 and it.nodes["a"].refused == 1
    assert it.tasks["t00"].status is TaskStatus.QUEUED and "t00" not in it.groups
    a2 = h.worker("a")  # the new incarnation's stream takes the task
    assert isinstance(drain(a)[-1], End)
    assert assigned(drain(a2)) == ids(0)
    assert accept(h, a2, "t00")[0].accepted == 1


def test_fenced_stream_ends_after_the_grace_period():
    h = Harness(lease_ttl_s=30.0)
    a = h.worker("a")
    h.worker("b")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    drain(a)
    h.advance(30.0, alive=("b",))  # a's lease lapses at +30
    assert a.worker.fenced and a.fenced_at == h.clock.now
    assert not any(isinstance(m, End) for m in drain(a))
    h.advance(FENCED_STREAM_GRACE_S - 5.0, alive=("b",))
    assert drain(a) == []
    h.advance(5.0, alive=("b",))
    [end] = drain(a)
    assert isinstance(end, End) and isinstance(end.error, FencedError)
    h.advance(10.0, alive=("b",))
    assert drain(a) == []  # ended once


# -- requeues ----------------------------------------------------------------------------------------


def test_eviction_requeues_running_tasks_at_the_front_for_the_survivor():
    h = Harness(lease_ttl_s=30.0)
    a = h.worker("a", slots=2)
    b = h.worker("b", slots=1)
    h.sched.submit(RUN, 1, specs(6), IterationConfig())
    assert assigned(drain(a)) == ids(0, 2) and assigned(drain(b)) == ids(1)
    h.advance(30.0, alive=("b",))
    assert h.coord.runs[RUN].members["a"].status.value == "evicted"
    assert assigned(drain(a)) == [] and a.worker.holding == set()
    it = h.it()
    assert list(it.queue) == ids(0, 2, 3, 4, 5)
    assert it.counters.requeued == 2 and it.tasks["t00"].requeues == 1
    assert it.evicted == ["a"] and it.nodes["a"].evicted
    assert h.sched.manifest(it)["evicted"] == ["a"]
    order, tid = [], "t01"
    for _ in range(6):  # b runs one task at a time: each result brings the next
        accept(h, b, tid)
        nxt = assigned(drain(b))
        if not nxt:
            break
        order += nxt
        tid = nxt[0]
    assert order == ids(0, 2, 3, 4, 5)
    assert it.sealed and all(t.done_by == "b" for t in it.tasks.values())
    assert accept(h, a, "t00")[0].refused == [(1, "t00", "fenced")]


def test_requeued_holdings_keep_submission_order():
    h = Harness()
    a = h.worker("a", slots=12)
    h.sched.submit(RUN, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1]) for i in range(12)], IterationConfig())
    h.sched.disconnect(a, "stream broke")
    assert list(h.it().queue) == [f"t{i}" for i in range(12)]  # got t0, t1, t10, t11, t2, ...


def test_stream_disconnect_requeues_at_the_front_and_member_can_reconnect():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    drain(a), drain(b)
    h.sched.disconnect(a, "stream broke")
    it = h.it()
    assert a.closed and drain(a) == []
    assert list(it.queue) == ids(0, 2) and it.counters.requeued == 1
    assert not it.nodes["a"].evicted and it.evicted == []  # a is still a live member
    accept(h, b, "t01")
    assert assigned(drain(b)) == ids(0)
    a2 = h.worker("a")
    assert assigned(drain(a2)) == ids(2)


def test_reconnect_of_the_same_incarnation_keeps_its_tasks():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    drain(a)
    a2 = h.worker("a")
    [end] = drain(a)
    assert isinstance(end, End) and isinstance(end.error, FencedError) and a.closed
    assert a2.worker.holding == {(1, "t00")} and drain(a2) == []
    h.sched.disconnect(a, "old stream finally closed")  # a replaced stream requeues nothing
    it = h.it()
    assert it.counters.requeued == 0 and it.tasks["t00"].status is TaskStatus.RUNNING
    assert accept(h, a2, "t00")[0].accepted == 1


def test_a_reconnecting_worker_holds_the_tasks_it_still_runs_instead_of_being_handed_them_anew():
    # Its old stream closed here first, so its copies were queued again. Handed out anew on the
    # new stream, each new copy could cross the worker's release of its old one (an engine that
    # crashed meanwhile), and the release would free the new copy's slot while the worker ran it:
    # 4 tasks on 3 slots (seed 6 of test_worker_random). Now the hello says what still runs.
    for claims in (False, True):
        h = Harness()
        a = h.worker("a", slots=3)
        h.sched.submit(RUN, 1, specs(5), IterationConfig())
        assert assigned(drain(a)) == ids(0, 1, 2)
        h.sched.disconnect(a, "stream broke")
        running = [(1, t) for t in ids(0, 1, 2)] if claims else ()
        a2 = h.worker("a", slots=3, running=running)
        it = h.it()
        if not claims:  # before: handed out anew
            assert assigned(drain(a2)) == ids(0, 1, 2)
            continue
        assert drain(a2) == [] and a2.worker.holding == {(1, t) for t in ids(0, 1, 2)}
        assert [it.tasks[t].status for t in ids(0, 1, 2)] == [TaskStatus.RUNNING] * 3 and list(it.queue) == ids(3, 4)
        assert set(it.tasks["t00"].holders) == {"a"} and it.nodes["a"].assigned == 6
        h.sched.release(a2, 1, ids(0, 1), "engine error")  # the old copies' release frees exactly those
        assert a2.worker.holding == {(1, "t02")} and list(it.queue) == ids(0, 1, 3, 4)
        assert accept(h, a2, "t02")[0].accepted == 1  # a held copy's result is its own
        assert len(a2.worker.holding) <= 3


def test_a_reconnecting_worker_keeps_a_copy_handed_out_meanwhile_and_drops_those_that_will_not_run_again():
    # A cancel only asks: the engine may finish the copy. So only a copy of a task that never
    # runs again is cancelled; one handed to another worker meanwhile stays a second copy here
    # (cancelled, it could come back to this worker while the engine still ran it: twice).
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(5), IterationConfig())
    drain(a)
    h.sched.disconnect(a, "stream broke")  # t00, t01 queued again
    b = h.worker("b")
    assert assigned(drain(b)) == ids(0)
    accept(h, b, "t00")  # done; b takes t01
    assert assigned(drain(b)) == ids(1)
    running = [(1, "t00"), (1, "t01"), (1, "t02"), (1, "t09"), (7, "t00")]  # done, b's, queued, unknown, no iteration
    a2 = h.worker("a", slots=2, running=running)
    messages = drain(a2)
    assert [(m.iteration, m.task_ids) for m in messages if isinstance(m, Cancel)] == [(1, ids(0, 9)), (7, ids(0))]
    assert assigned(messages) == []  # both slots held
    it = h.it()
    assert a2.worker.holding == {(1, "t01"), (1, "t02")} and set(it.tasks["t01"].holders) == {"a", "b"}
    assert it.tasks["t02"].status is TaskStatus.RUNNING and list(it.queue) == ids(3, 4)
    accept(h, b, "t01")  # the first result wins; a's copy is cancelled and its slot filled
    messages = drain(a2)
    assert cancelled(messages) == ids(1) and assigned(drain(b)) == ids(3) and assigned(messages) == ids(4)


def test_a_reconnect_whose_old_stream_is_still_open_moves_its_copies_once():
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    drain(a)
    a2 = h.worker("a", slots=2, running=[(1, "t00"), (1, "t01")])
    assert [m for m in drain(a2) if not isinstance(m, End)] == [] and a2.worker.holding == {(1, "t00"), (1, "t01")}
    assert h.it().nodes["a"].assigned == 2


def test_copies_moved_with_a_still_open_stream_that_the_hello_does_not_name_are_queued_again():
    # Their assignment (or their release) was lost with the old stream: held, they would take a
    # slot and stall the task until its lease ran out.
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(3), IterationConfig(task_lease_s=60))
    assert assigned(drain(a)) == ids(0, 1)  # the worker read only t00's
    a2 = h.worker("a", slots=2, running=[(1, "t00")])
    it = h.it()
    assert it.counters.requeued == 1 and it.tasks["t01"].requeues == 1
    assert assigned(drain(a2)) == ids(1)  # at the front of the queue, and a2 has a free slot: handed out anew
    assert a2.worker.holding == {(1, "t00"), (1, "t01")} and list(it.queue) == ids(2)


def test_a_hello_claims_no_more_than_its_slots():
    h = Harness()
    b, c = h.worker("b"), h.worker("c")
    h.sched.submit(RUN, 1, specs(6), IterationConfig(policy=Policy.STATIC))
    drain(b), drain(c)
    a = h.worker("a", slots=1, running=[(1, "t01"), (1, "t02"), (1, "t04")])
    assert len(a.worker.holding) == 1 and drain(a) == []  # the others left where they were


def test_a_restarted_coordinator_holds_a_reconnecting_workers_copies_again(tmp_path):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    assert assigned(drain(a)) == ids(0, 1)
    h.coord.db.close()
    h2 = Harness(state_dir=tmp_path, clock=h.clock)  # tasks not done are queued again
    h2.incarnations = dict(h.incarnations)
    it = h2.it()
    assert list(it.queue) == ids(0, 1, 2)
    a2 = h2.worker("a", slots=2, running=[(1, "t01"), (1, "t01")])  # named twice: held once
    assert a2.worker.holding == {(1, "t00"), (1, "t01")} and assigned(drain(a2)) == ids(0)
    assert list(it.queue) == ids(2) and it.count(TaskStatus.RUNNING) == 2


@pytest.mark.parametrize("winner", ["first_holder", "second_holder"])
def test_task_lease_expiry_requeues_and_the_first_finisher_wins(winner):
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(1), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0) and drain(b) == []
    h.advance(9.0, step=3.0)
    assert drain(b) == [] and h.it().counters.requeued == 0
    h.advance(1.0)
    it = h.it()
    assert assigned(drain(b)) == ids(0)
    assert it.counters.requeued == 1 and it.tasks["t00"].requeues == 1
    assert set(it.tasks["t00"].holders) == {"b"}
    assert a.worker.free == 0  # a presumably still works on it: it keeps its slot
    first, second = (a, b) if winner == "first_holder" else (b, a)
    assert accept(h, first, "t00")[0].accepted == 1
    assert cancelled(drain(second)) == ids(0) and second.worker.free == 1
    assert accept(h, second, "t00")[0].refused == [(1, "t00", "duplicate")]
    assert it.sealed and it.tasks["t00"].done_by == first.worker.member_id


def test_a_renewed_task_lease_starts_again_from_the_renewal():
    """A worker whose engine advances on a task (a multi-turn episode) renews its lease: the task
    is not handed to another engine while it advances, and is once it stops advancing."""
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(1), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0)
    h.advance(8.0, step=2.0)
    assert h.sched.renew(a, 1, ["t00"]) == 1  # deadline 18
    h.advance(8.0, step=2.0)  # 16
    assert drain(b) == [] and h.it().counters.requeued == 0
    assert h.sched.renew(a, 1, ["t00", "t99"]) == 1  # deadline 26; an unknown task is ignored
    h.advance(9.0, step=3.0)  # 25
    assert drain(b) == [] and h.it().counters.requeued == 0
    h.advance(1.0)  # 26: no progress since: the lease ran out
    assert assigned(drain(b)) == ids(0) and h.it().counters.requeued == 1
    assert h.sched.renew(a, 1, ["t00"]) == 0  # past its deadline: too late, b's copy runs
    assert accept(h, a, "t00")[0].accepted == 1  # whichever finishes first still wins


def test_a_renewal_past_the_deadline_or_from_another_incarnation_or_a_fenced_worker_renews_nothing():
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(2), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0, 1)
    h.clock.now += 10.0  # the deadline passed, no tick yet: the holder is still there
    assert set(h.it().tasks["t00"].holders) == {"a"}
    assert h.sched.renew(a, 1, ["t00"]) == 0
    h.clock.now -= 5.0
    stale = dataclasses.replace(a.worker, incarnation=a.worker.incarnation + 1)
    a.worker, real = stale, a.worker
    assert h.sched.renew(a, 1, ["t00"]) == 0  # a copy another incarnation holds
    a.worker = real
    a.worker.fenced = True
    assert h.sched.renew(a, 1, ["t01"]) == 0
    a.worker.fenced = False
    assert h.sched.renew(a, 1, ["t00", "t01"]) == 2


def test_only_the_holder_renews_and_not_after_the_task_is_done_or_sealed():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(2), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(1)
    assert h.sched.renew(b, 1, ["t00"]) == 0 and h.sched.renew(a, 2, ["t00"]) == 0  # not b's; no iteration 2
    accept(h, a, "t00")
    assert h.sched.renew(a, 1, ["t00"]) == 0  # done
    accept(h, b, "t01")
    assert h.it().sealed and h.sched.renew(b, 1, ["t01"]) == 0


def test_task_lease_expiry_does_not_hand_the_task_back_to_its_holder():
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(1), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0)
    h.advance(10.0)
    # a second copy on the same worker gains nothing, and `holding` (a set) counts both copies as
    # one slot, so the worker runs more copies than its slots
    assert drain(a) == []


def test_the_tick_looks_for_expired_task_leases_only_once_the_earliest_could_have_passed(monkeypatch):
    from elasticrl.scheduler import policy

    h = Harness()
    a = h.worker("a", slots=2)
    b = h.worker("b", slots=2)
    h.sched.submit(RUN, 1, specs(6), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0, 2) and assigned(drain(b)) == ids(1, 3)  # leases end at 10.0
    scans = []
    real = policy.lease_scan
    monkeypatch.setattr(policy, "lease_scan", lambda it, now: scans.append(now) or real(it, now))
    h.advance(4.0, step=1.0, alive=("a", "b"))  # 4 ticks: no pass over the tasks
    assert scans == []
    accept(h, a, "t00")  # t04 goes to a, its lease ending at 14.0; the earliest is still 10.0
    assert assigned(drain(a)) == ids(4)
    h.advance(6.0, step=1.0, alive=("a", "b"))  # the tick at 10.0 finds t01, t02, t03 expired
    assert scans == [pytest.approx(h.clock.now)] and h.it().counters.requeued == 3
    h.advance(3.0, step=1.0, alive=("a", "b"))  # once more after expiries, then not until 14.0
    assert len(scans) == 2
    h.advance(1.0, alive=("a", "b"))
    assert len(scans) == 3 and h.it().tasks["t04"].requeues == 1


def test_a_seal_inside_a_batch_keeps_the_counts_of_what_it_hands_out_of_another_iteration_of_the_batch():
    h = Harness()
    w = h.worker("w", slots=3)
    x = h.worker("x", slots=1)
    h.sched.submit(RUN, 1, [spec(10), spec(11)], IterationConfig(min_fraction=0.5, deadline_s=5))
    h.sched.submit(RUN, 2, [spec(20), spec(21)], IterationConfig(backup_tasks=1))
    assert sorted(assigned(drain(w))) == ["t10", "t20", "t21"] and assigned(drain(x)) == ["t11"]
    h.clock.now += 10
    # Iteration 1 seals inside this batch (past its deadline with half done): x's copy of t11 is
    # cancelled and x takes a backup of t21, counted in iteration 2 before the batch's own
    # counters for iteration 2 are applied.
    ack, _ = h.sched.accept(w, [(1, group("t10")), (2, group("t20"))], "b1")
    assert ack.accepted == 2 and h.it(1).sealed
    assert assigned(drain(x)) == ["t21"]
    assert h.it(2).counters.backups_issued == 1 and h.it(2).nodes["x"].assigned == 1


def test_a_result_batch_offers_tasks_to_the_workers_it_freed_not_to_every_worker(monkeypatch):
    from elasticrl.scheduler import policy

    h = Harness()
    conns = [h.worker(f"w{i:03d}") for i in range(200)]
    h.sched.submit(RUN, 1, specs(250), IterationConfig(backup_tasks=1))
    for c in conns:
        drain(c)
    asked = []
    real = policy.pick_tasks
    monkeypatch.setattr(policy, "pick_tasks", lambda it, worker, *a, **k: asked.append(worker.member_id) or real(it, worker, *a, **k))
    accept(h, conns[7], "t07")
    assert assigned(drain(conns[7])) == ["t200"] and set(asked) == {"w007"}  # not 200 workers looked at
    asked.clear()
    late = h.worker("late")  # and a worker that connects: only its own slots are new
    assert assigned(drain(late)) == ["t201"] and set(asked) == {"late"}


def test_a_cancelled_backup_copy_frees_a_slot_that_the_same_result_batch_fills():
    h = Harness()
    a, b, c = h.worker("a"), h.worker("b"), h.worker("c")
    h.sched.submit(RUN, 1, specs(3), IterationConfig(backup_tasks=1, task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(1) and assigned(drain(c)) == ids(2)
    accept(h, b, "t01")  # the queue is empty: b takes a backup copy of the oldest, t00
    assert assigned(drain(b)) == ids(0) and set(h.it().tasks["t00"].holders) == {"a", "b"}
    h.sched.submit(RUN, 2, specs(2), IterationConfig())
    accept(h, b, "t00")  # b's slot, freed on arrival, takes iteration 2's t00; the backup wins,
    messages = drain(a)  # so a's copy is cancelled at the commit, and a's slot takes t01 then
    assert cancelled(messages) == ids(0)
    assert [(i, spec.task_id) for m in messages if hasattr(m, "items") for i, spec, _, _ in m.items] == [(2, "t01")]
    assert [(i, spec.task_id) for m in drain(b) if hasattr(m, "items") for i, spec, _, _ in m.items] == [(2, "t00")]
    assert not h.it(1).sealed  # (c still runs t02: no seal, whose dispatch would look at every worker)


def test_release_requeues_at_the_front():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    drain(a), drain(b)
    h.sched.release(b, 1, ["t01", "t02"], "engine error")  # t02 is not b's: ignored
    it = h.it()
    assert it.counters.requeued == 1 and it.tasks["t01"].requeues == 1
    assert it.tasks["t02"].requeues == 0 and it.tasks["t02"].status is TaskStatus.QUEUED
    handed = assigned(drain(b))
    accept(h, a, "t00")
    handed += assigned(drain(a)) + assigned(drain(b))
    assert handed == ids(1, 2)  # the released task went to the front, ahead of t02
    assert list(it.queue) == []
    # an iteration the coordinator does not hold (never submitted, or dropped): ignored, no error
    h.sched.release(b, 9, ["t00"], "x")
    assert it.counters.requeued == 1 and list(it.queue) == []


def test_a_task_released_by_the_only_worker_is_offered_again_after_a_pause():
    h = Harness()
    a = h.worker("a", slots=1)
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    assert assigned(drain(a)) == ids(0)
    h.sched.release(a, 1, ["t00"], "engine error")
    assert drain(a) == []  # not straight back
    h.clock.now += REDISPATCH_S / 2
    h.sched.tick()
    assert drain(a) == []
    h.clock.now += REDISPATCH_S / 2
    h.sched.tick()
    assert assigned(drain(a)) == ids(0)  # nobody else took it: retried here


def test_a_stopping_worker_is_handed_nothing_more():
    h = Harness()
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    assert assigned(drain(a)) == ids(0, 1)
    h.sched.release(a, 1, ["t00", "t01"], RELEASE_STOPPING)
    for _ in range(4):  # no ping-pong of tasks it would only give back (and requeues counted each time)
        h.clock.now += REDISPATCH_S
        h.sched.tick()
        assert drain(a) == []
    it = h.it()
    assert it.counters.requeued == 2 and sorted(it.queue) == ids(0, 1)
    b = h.worker("b", slots=2)
    assert sorted(assigned(drain(b))) == ids(0, 1)


def test_released_task_goes_to_another_free_worker():
    h = Harness()
    a = h.worker("a", slots=1)
    b = h.worker("b", slots=2)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    drain(a), drain(b)
    h.sched.release(a, 1, ["t00"], "worker stopping")
    assert assigned(drain(b)) == ids(0) and drain(a) == []


# -- static shares -------------------------------------------------------------------------------------


def test_static_policy_splits_by_weight_and_shares_only_requeued_tasks():
    h = Harness()
    a = h.worker("a", weight=2.0)
    b = h.worker("b", weight=1.0)
    c = h.worker("c", weight=1.0)
    h.sched.submit(RUN, 1, specs(10), IterationConfig(policy=Policy.STATIC))
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(5) and assigned(drain(c)) == ids(8)
    it = h.it()
    assert {m: list(s) for m, s in it.shares.items()} == {"a": ids(1, 2, 3, 4), "b": ids(6, 7), "c": ids(9)}
    assert list(it.queue) == []
    accept(h, c, "t08")
    assert assigned(drain(c)) == ids(9)
    accept(h, c, "t09")
    assert drain(c) == [] and c.worker.free == 1  # static: c never takes a's or b's share
    h.sched.disconnect(a, "stream broke")  # a's running task goes to the shared queue
    assert assigned(drain(c)) == ids(0)
    assert list(it.shares["a"]) == ids(1, 2, 3, 4)


def test_static_policy_without_workers_falls_back_to_a_shared_queue():
    h = Harness()
    h.sched.submit(RUN, 1, specs(3), IterationConfig(policy=Policy.STATIC))
    assert h.it().shares == {} and list(h.it().queue) == ids(0, 1, 2)
    a = h.worker("a", slots=3)
    assert assigned(drain(a)) == ids(0, 1, 2)


def test_static_share_of_an_evicted_worker_is_not_lost():
    h = Harness(lease_ttl_s=30.0)
    a = h.worker("a")
    h.worker("b")
    h.sched.submit(RUN, 1, specs(4), IterationConfig(policy=Policy.STATIC))  # a: t00 t01, b: t02 t03
    h.advance(30.0, alive=("a",))  # b dies; its running t02 is requeued, t03 was never started
    got = assigned(drain(a))
    for _ in range(4):
        accept(h, a, got[-1])
        nxt = assigned(drain(a))
        if not nxt:
            break
        got += nxt
    assert got == ids(0, 1, 2, 3) and h.it().sealed  # t03 stays in b's share for ever


# -- backup copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("winner", ["backup", "original"])
def test_backup_copy_for_the_straggler_and_the_loser_is_cancelled(winner):
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(2), IterationConfig(backup_tasks=1))
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(1)
    h.clock.now += 5.0
    accept(h, b, "t01")  # queue empty: b's free slot gets a backup of a's straggler
    [msg] = drain(b)
    assert [(s.task_id, backup) for _, s, _, backup in msg.items] == [("t00", True)]
    it = h.it()
    assert it.counters.backups_issued == 1
    assert set(it.tasks["t00"].holders) == {"a", "b"} and it.tasks["t00"].holders["b"].backup
    c = h.worker("c")
    assert drain(c) == []  # budget spent
    first, second = (b, a) if winner == "backup" else (a, b)
    assert accept(h, first, "t00")[0].accepted == 1
    assert cancelled(drain(second)) == ids(0)
    assert it.sealed and it.seal_reason == "all 2 tasks done"
    assert accept(h, second, "t00")[0].refused == [(1, "t00", "duplicate")]
    assert h.sched.manifest(it)["backups_issued"] == 1


def test_no_backup_without_budget():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    drain(a), drain(b)
    accept(h, b, "t01")
    assert drain(b) == [] and h.it().counters.backups_issued == 0


# -- sealing -----------------------------------------------------------------------------------------


def test_deadline_seal_with_min_fraction_drops_the_rest_and_cancels_holders():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(4), IterationConfig(deadline_s=10.0, min_fraction=0.5))
    drain(a), drain(b)
    accept(h, a, "t00")
    assert assigned(drain(a)) == ids(2)
    accept(h, a, "t02")
    assert assigned(drain(a)) == ids(3)
    it = h.it()
    h.advance(9.5)
    assert not it.sealed and h.sched.manifest(it)["sealed_ago_s"] == 0.0
    h.advance(0.5)
    assert it.sealed and it.seal_reason.startswith("deadline passed with 2/4")
    assert cancelled(drain(a)) == ids(3) and cancelled(drain(b)) == ids(1)
    assert a.worker.free == 1 and b.worker.free == 1
    assert [it.tasks[t].status for t in ids(0, 1, 2, 3)] == [
        TaskStatus.DONE, TaskStatus.DROPPED, TaskStatus.DONE, TaskStatus.DROPPED,
    ]
    assert list(it.queue) == [] and it.shares == {}
    ack, err = accept(h, b, "t01")
    assert err is None and ack.refused == [(1, "t01", "sealed")]
    assert accept(h, a, "t00")[0].refused == [(1, "t00", "duplicate")]
    assert (it.counters.refused_sealed, it.counters.refused_duplicate) == (1, 1)
    assert "t01" not in it.groups
    m = h.sched.manifest(it)
    assert (m["sealed"], m["tasks_done"], m["tasks_total"], m["refused_sealed"]) == (True, 2, 4, 1)
    assert m["elapsed_s"] == pytest.approx(10.0)
    assert m["sealed_ago_s"] == pytest.approx(0.0)
    h.advance(0.25)
    assert h.sched.manifest(it)["sealed_ago_s"] == pytest.approx(0.25)  # the seal's age when a reply is built


def test_deadline_passed_below_min_fraction_seals_on_the_result_that_reaches_it():
    h = Harness()
    a = h.worker("a")
    b = h.worker("b")
    h.sched.submit(RUN, 1, specs(4), IterationConfig(deadline_s=10.0, min_fraction=0.75))
    drain(a), drain(b)
    accept(h, a, "t00")
    h.advance(10.0)
    it = h.it()
    assert not it.sealed
    accept(h, a, "t02")
    assert not it.sealed and assigned(drain(a)) == ids(2, 3)
    accept(h, b, "t01")  # 3 of 4: seals at once, no tick needed
    assert it.sealed and "3/4" in it.seal_reason
    assert cancelled(drain(a)) == ids(3) and it.tasks["t03"].status is TaskStatus.DROPPED


def test_wait_sealed_wakes_on_the_seal():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig())

    async def scenario():
        early = await h.sched.wait_sealed(RUN, 1, 0.01)
        assert early is h.it() and not early.sealed
        waiter = asyncio.create_task(h.sched.wait_sealed(RUN, 1, 30.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        accept(h, a, "t00")
        it = await asyncio.wait_for(waiter, 2.0)
        again = await asyncio.wait_for(h.sched.wait_sealed(RUN, 1, 30.0), 2.0)
        return it, again

    it, again = asyncio.run(scenario())
    assert it.sealed and again is it


def test_an_open_iteration_s_counts_come_without_a_scan_of_its_tasks():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(4), IterationConfig())
    accept(h, a, "t00")
    it = h.it()
    full, counts = h.sched.manifest(it), h.sched.manifest(it, per_node=False)
    assert full["nodes"] and counts["nodes"] == [] and counts["tokens"] == 0
    same = ("tasks_total", "tasks_done", "tasks_queued", "tasks_running", "tasks_failed", "sealed", "requeued")
    assert {k: counts[k] for k in same} == {k: full[k] for k in same}
    assert counts["tasks_done"] == 1 and counts["tasks_running"] + counts["tasks_queued"] == 3


def test_wait_sealed_before_the_iteration_is_submitted():
    h = Harness()
    a = h.worker("a")

    async def scenario():
        assert await h.sched.wait_sealed(RUN, 2, 0.01) is None  # a trainer asking before the driver submits
        waiter = asyncio.create_task(h.sched.wait_sealed(RUN, 2, 30.0))
        await asyncio.sleep(0)
        h.sched.submit(RUN, 2, specs(1), IterationConfig())
        await asyncio.sleep(0)
        assert not waiter.done()
        accept(h, a, "t00", iteration=2)
        return await asyncio.wait_for(waiter, 2.0)

    it = asyncio.run(scenario())
    assert it is not None and it.iteration == 2 and it.sealed


# -- shards --------------------------------------------------------------------------------------------


def test_shard_refuses_before_seal_then_balances_every_done_group_once():
    h = Harness()
    a = h.worker("a", slots=9)
    tasks = specs(7) + [spec(7, split=Split.EVAL), spec(8, split=Split.EVAL)]
    h.sched.submit(RUN, 1, tasks, IterationConfig(deadline_s=10.0, min_fraction=0.5))
    for tid, tokens in zip(ids(0, 1, 2, 3, 4), (10, 7, 5, 5, 3)):
        accept(h, a, tid, tokens=tokens)
    accept(h, a, "t07", "t08")
    with pytest.raises(NotReadyError, match="not sealed"):
        h.sched.shard(RUN, 1, 0, 2, Split.TRAIN)
    h.advance(10.0)
    assert h.it().sealed  # t05, t06 dropped
    plan = [h.sched.shard(RUN, 1, rank, 2, Split.TRAIN) for rank in range(2)]
    # groups hold 2 samples: 20, 14, 10, 10, 6 tokens -> LPT gives 30 / 30
    assert [[g.task_id for g, _ in part] for part in plan] == [ids(0, 3), ids(1, 2, 4)]
    for part in plan:
        for g, task in part:
            assert g.task_id == task.spec.task_id and g.node == "a"
            assert g.samples[1].token_ids() == group(g.task_id, g.samples[1].num_tokens).samples[1].token_ids()
    assert [g.task_id for g, _ in h.sched.shard(RUN, 1, 0, 1, Split.EVAL)] == ids(7, 8)
    assert [[g.task_id for g, _ in h.sched.shard(RUN, 1, r, 4, Split.EVAL)] for r in range(4)] == [ids(7), ids(8), [], []]
    for rank, world in ((2, 2), (-1, 2)):
        with pytest.raises(InvalidRequestError, match="rank"):
            h.sched.shard(RUN, 1, rank, world, Split.TRAIN)
    with pytest.raises(NotFoundError):
        h.sched.shard(RUN, 5, 0, 1, Split.TRAIN)


def test_a_sealed_iteration_is_balanced_once_per_world_size_not_once_per_rank(monkeypatch):
    from elasticrl.scheduler import core as core_mod

    h = Harness()
    a = h.worker("a", slots=8)
    h.sched.submit(RUN, 1, specs(6), IterationConfig())
    accept(h, a, *ids(0, 1, 2, 3, 4, 5))
    assert h.it().sealed
    calls = []
    balance = core_mod.policy.balance_shards
    monkeypatch.setattr(core_mod.policy, "balance_shards", lambda items, n: calls.append(n) or balance(items, n))
    first = [[g.task_id for g, _ in h.sched.shard(RUN, 1, r, 3, Split.TRAIN)] for r in range(3)]
    again = [[g.task_id for g, _ in h.sched.shard(RUN, 1, r, 3, Split.TRAIN)] for r in range(3)]  # a restarted rank asks again
    assert first == again and sorted(sum(first, [])) == ids(0, 1, 2, 3, 4, 5)
    h.sched.shard(RUN, 1, 0, 2, Split.TRAIN)  # a world of another size: its own balance
    assert calls == [3, 2]


# -- persistence ----------------------------------------------------------------------------------------


def stored_counters(h: Harness, iteration: int = 1) -> dict:
    """What SQLite holds of an iteration's counters, with its node stats (a row per node)."""
    db = h.coord.db.connection
    row = db.execute("SELECT counters FROM sched_iterations WHERE run_id=? AND iteration=?", (RUN, iteration)).fetchone()
    nodes = db.execute("SELECT member_id, stats FROM sched_nodes WHERE run_id=? AND iteration=?", (RUN, iteration))
    return {**json.loads(row[0]), "nodes": {m: json.loads(stats) for m, stats in nodes}}


def test_assignment_counts_reach_sqlite_at_the_next_tick_or_with_a_result_batch_which_commits_once(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=2)
    b = h.worker("b", slots=1)
    h.sched.submit(RUN, 1, specs(6), IterationConfig())
    assert assigned(drain(a)) == ids(0, 2) and assigned(drain(b)) == ids(1)
    assert stored_counters(h)["nodes"] == {}  # handed out, not written on the dispatch's path
    h.sched.tick()
    assert stored_counters(h)["nodes"]["a"]["assigned"] == 2 and stored_counters(h)["nodes"]["b"]["assigned"] == 1
    commits = []
    real_tx = h.coord.db.tx

    def counting_tx():
        commits.append(h.coord.db._depth == 0)  # an outermost transaction: a commit of its own
        return real_tx()

    monkeypatch.setattr(h.coord.db, "tx", counting_tx)
    ack, _ = accept(h, a, "t00", "t02")  # frees two slots: t03 and t04 go out in the same call
    assert ack.accepted == 2 and assigned(drain(a)) == ids(3, 4)
    assert commits.count(True) == 1  # the batch's own, which carries those assignments' counts
    assert stored_counters(h)["nodes"]["a"] == {**stored_counters(h)["nodes"]["a"], "done": 2, "assigned": 4}
    h.sched.tick()
    assert commits.count(True) == 1  # nothing left for the tick to write
    c = h.worker("c", slots=1)  # c is handed t05 as it connects (joining commits on its own)
    assert assigned(drain(c)) == ids(5)
    before = commits.count(True)
    ack, _ = accept(h, a, "t03")  # a's batch writes a's stats; c's count waits for the tick
    assert ack.accepted == 1 and commits.count(True) == before + 1
    assert "c" not in stored_counters(h)["nodes"]
    h.sched.tick()
    assert commits.count(True) == before + 2 and stored_counters(h)["nodes"]["c"]["assigned"] == 1
    h.sched.tick()
    assert commits.count(True) == before + 2  # nothing new to write: no transaction


def test_a_result_batch_writes_its_own_nodes_stats_not_every_nodes(tmp_path):
    h = Harness(state_dir=tmp_path)
    conns = [h.worker(f"w{i:02d}", slots=1) for i in range(20)]
    h.sched.submit(RUN, 1, specs(40), IterationConfig())
    h.sched.tick()  # the dispatch's counts: one row per node
    assert len(stored_counters(h)["nodes"]) == 20
    task = assigned(drain(conns[7]))[0]
    statements: list[str] = []
    h.coord.db.connection.set_trace_callback(statements.append)
    ack, _ = accept(h, conns[7], task, tokens=5)
    h.coord.db.connection.set_trace_callback(None)
    assert ack.accepted == 1
    assert [x for x in statements if "sched_nodes" in x] == [x for x in statements if "sched_nodes" in x and "'w07'" in x]
    assert len([x for x in statements if "sched_nodes" in x]) == 1
    assert stored_counters(h)["nodes"]["w07"]["done"] == 1 and stored_counters(h)["nodes"]["w07"]["tokens"] == 10


def test_node_stats_stored_in_the_counters_json_before_their_table_are_read_and_moved(tmp_path):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    accept(h, a, *assigned(drain(a)), tokens=4)
    h.sched.tick()
    before = {m: dataclasses.asdict(n) for m, n in h.it().nodes.items()}
    db = h.coord.db.connection
    old = {**stored_counters(h)}  # as an older coordinator wrote it: the nodes inside the JSON
    with h.coord.db.tx():
        db.execute("UPDATE sched_iterations SET counters=?", (json.dumps(old),))
        db.execute("DELETE FROM sched_nodes")
    h.coord.db.close()
    again = Harness(state_dir=tmp_path, clock=h.clock)
    got = {m: dataclasses.asdict(n) for m, n in again.it().nodes.items()}
    keys = ("assigned", "done", "refused", "tokens", "evicted")  # what is stored (not the timings)
    assert {m: {k: v[k] for k in keys} for m, v in got.items()} == {m: {k: v[k] for k in keys} for m, v in before.items()}
    assert "nodes" not in json.loads(again.coord.db.connection.execute("SELECT counters FROM sched_iterations").fetchone()[0])
    assert set(stored_counters(again)["nodes"]) == {"a"}


def test_task_specs_are_stored_as_their_message_and_specs_stored_as_json_before_are_still_read(tmp_path):
    from elasticrl._proto import scheduler_pb2 as spb
    from elasticrl.scheduler.convert import task_wire
    from elasticrl.scheduler.state import Sampling

    h = Harness(state_dir=tmp_path)
    rich = TaskSpec(task_id="t00", prompt_ids=[5, 6, 7], prompt_text="p", num_samples=4, split=Split.EVAL,
                    sampling=Sampling(temperature=0.5, top_p=0.9, max_new_tokens=64, seed=3, stop_token_ids=[2]),
                    metadata_json='{"answer": 13}')
    h.sched.submit(RUN, 1, [rich, spec(1)], IterationConfig())
    db = h.coord.db.connection
    stored = dict(db.execute("SELECT task_id, spec FROM sched_tasks").fetchall())
    assert stored["t00"] == task_wire(rich) and spb.TaskSpec.FromString(stored["t00"]).metadata_json == '{"answer": 13}'
    legacy = {**{k: v for k, v in vars(rich).items() if not k.startswith("_")}, "sampling": vars(rich.sampling), "split": "eval"}
    with h.coord.db.tx():  # as a coordinator before this change wrote it
        db.execute("UPDATE sched_tasks SET spec=? WHERE task_id='t00'", (json.dumps(legacy),))
    h.coord.db.close()
    again = Harness(state_dir=tmp_path, clock=h.clock)
    got = again.it().tasks
    assert plain(got["t00"].spec) == rich and plain(got["t01"].spec) == spec(1)
    assert isinstance(got["t01"].spec.prompt_ids, array.array)  # stored as a message: kept compact
    a = again.worker("a", slots=2)  # and both are handed out as before
    assert sorted(assigned(drain(a))) == ["t00", "t01"]


def test_assignment_counts_that_could_not_be_saved_are_saved_by_a_later_tick_which_goes_on_meanwhile(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a", slots=1)
    h.sched.submit(RUN, 1, specs(2), IterationConfig(task_lease_s=10.0))
    assert assigned(drain(a)) == ids(0)
    real = h.sched.db.put_counters

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h.sched.db, "put_counters", disk_full)
    h.advance(5.0, alive=("a",))  # a tick that cannot save: no exception, the rest of it runs
    assert stored_counters(h)["nodes"] == {}
    monkeypatch.setattr(h.sched.db, "put_counters", real)
    h.advance(6.0, alive=("a",))  # t00's lease expired: requeued, and the counts are saved
    assert h.it().tasks["t00"].requeues == 1
    assert stored_counters(h)["nodes"]["a"]["assigned"] == 1


def test_restart_keeps_done_groups_requeues_the_rest_and_still_seals(tmp_path):
    clock1 = Clock(now=1000.0)
    h1 = Harness(clock=clock1, state_dir=tmp_path)
    a = h1.worker("a", slots=2)
    inc_a = h1.incarnations["a"]
    h1.sched.submit(RUN, 1, specs(6), IterationConfig(deadline_s=100.0, min_fraction=1.0))
    assert assigned(drain(a)) == ids(0, 1)
    clock1.now += 5.0
    accept(h1, a, "t00", tokens=4)
    accept(h1, a, "t01", tokens=6)  # a second shard
    accept(h1, a, "t00", seed=9)  # duplicate: counted
    h1.sched.release(a, 1, ["t03"], "engine error")  # counted as a requeue
    before = {tid: [s.completion_ids for s in h1.it().groups[tid].samples] for tid in ids(0, 1)}
    # a shard written whose commit never happened (killed between the two): never referenced
    orphan = h1.store.write_shard(RUN, 1, [(group("t02", 1, seed=77), [1])])
    h1.coord.db.close()

    # a new process: its own monotonic clock, 20 s of wall time later
    clock2 = Clock(now=50.0, wall_offset=clock1.wall() + 20.0 - 50.0)
    h2 = Harness(clock=clock2, state_dir=tmp_path)
    assert not (h2.store.iteration_dir(RUN, 1) / orphan).exists()  # removed at start-up
    it = h2.it()
    assert [it.tasks[t].status for t in ids(0, 1)] == [TaskStatus.DONE, TaskStatus.DONE]
    assert it.tasks["t00"].done_by == "a"
    assert {tid: [s.completion_ids for s in it.groups[tid].samples] for tid in ids(0, 1)} == before
    assert it.groups["t00"].policy_version == 3 and it.groups["t01"].samples[1].reward == 1.0
    assert plain(it.tasks["t01"].spec) == spec(1)
    assert list(it.queue) == ids(2, 3, 4, 5)
    assert all(it.tasks[t].status is TaskStatus.QUEUED for t in ids(2, 3, 4, 5))
    assert it.tasks["t03"].requeues == 1
    c = it.counters
    assert (c.refused_duplicate, c.requeued) == (1, 1)
    assert (it.nodes["a"].done, it.nodes["a"].tokens, it.nodes["a"].refused) == (2, 20, 1)
    assert it.deadline - clock2.now == pytest.approx(100.0 - 5.0 - 20.0)
    assert not it.sealed

    # a is still a member with the same incarnation: it reconnects and finishes the iteration
    h2.incarnations["a"] = inc_a
    a2 = h2.worker("a", slots=2)
    assert assigned(drain(a2)) == ids(2, 3)
    accept(h2, a2, "t02", "t03")
    assert assigned(drain(a2)) == ids(4, 5)
    accept(h2, a2, "t04", "t05")
    assert it.sealed and it.seal_reason == "all 6 tasks done"
    assert it.groups["t02"].samples[0].token_ids() == group("t02").samples[0].token_ids()

    shard_dir = h2.store.iteration_dir(RUN, 1)
    shard_names = sorted(p.name for p in shard_dir.glob("shard-*.safetensors"))
    assert len(shard_names) == 4  # the two committed before the restart, two after it

    manifest = json.loads((shard_dir / MANIFEST).read_text())
    assert manifest["sealed"] and manifest["tasks_done"] == 6 and manifest["tasks_total"] == 6
    assert (manifest["refused_duplicate"], manifest["requeued"]) == (1, 1)
    assert [(n["node"], n["done"]) for n in manifest["nodes"]] == [("a", 6)]
    elapsed = manifest["elapsed_s"]
    assert elapsed == pytest.approx(5.0 + 20.0)
    h2.coord.db.close()

    # and once more, after the seal: groups are read back from the shards on demand
    clock3 = Clock(now=7.0, wall_offset=clock2.wall() + 60.0 - 7.0)
    h3 = Harness(clock=clock3, state_dir=tmp_path)
    it3 = h3.it()
    assert it3.sealed and it3.seal_reason == "all 6 tasks done"
    assert h3.sched.manifest(it3)["elapsed_s"] == pytest.approx(elapsed)
    parts = [h3.sched.shard(RUN, 1, r, 2, Split.TRAIN) for r in range(2)]
    got = {g.task_id: g for part in parts for g, _ in part}
    assert sorted(got) == ids(0, 1, 2, 3, 4, 5)
    assert [s.completion_ids for s in got["t00"].samples] == before["t00"]
    assert got["t05"].node == "a"


def test_in_memory_store_writes_no_manifest_and_durable_store_does(tmp_path):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    accept(h, a, "t00", tokens=2)
    data = json.loads((h.store.iteration_dir(RUN, 1) / MANIFEST).read_text())
    assert data["run_id"] == RUN and data["iteration"] == 1 and data["tokens"] == 4
    assert data["seal_reason"] == "all 1 tasks done" and data["policy"] == "dynamic"


@pytest.mark.parametrize("durable", [True, False])
def test_old_sealed_iterations_leave_memory(tmp_path, durable):
    """Only the newest sealed iterations keep their groups in memory. With a state dir an older
    one is read back from its shards; an in-memory coordinator has dropped it and says so."""
    from elasticrl.scheduler.core import KEEP_SEALED_GROUPS

    h = Harness(state_dir=tmp_path if durable else None)
    a = h.worker("a", slots=4)
    n = KEEP_SEALED_GROUPS + 2
    for iteration in range(1, n + 1):
        h.sched.submit(RUN, iteration, specs(2), IterationConfig())
        accept(h, a, *ids(0, 1), iteration=iteration, tokens=iteration)
        assert h.it(iteration).sealed
        h.sched.tick()  # the seal's waiters are answered first; the tick trims
    in_memory = [i for i in range(1, n + 1) if h.it(i).groups]
    assert in_memory == list(range(n - KEEP_SEALED_GROUPS + 1, n + 1))
    if durable:
        part = h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
        assert [g.task_id for g, _ in part] == ids(0, 1) and all(g.num_tokens == 2 for g, _ in part)
    else:
        with pytest.raises(NotFoundError, match="use --state-dir"):
            h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
    assert [g.task_id for g, _ in h.sched.shard(RUN, n, 0, 1, Split.TRAIN)] == ids(0, 1)
