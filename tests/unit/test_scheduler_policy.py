"""Pure scheduler policy: static shares, what a worker takes next, task leases, sealing and shard
balance, decided from hand-built state and a made-up clock. No I/O, no sleeps."""

from __future__ import annotations

import collections
import math
import random

import pytest

from elasticrl.scheduler import policy
from elasticrl.scheduler.state import (
    Holder,
    Iteration,
    IterationConfig,
    Policy,
    Task,
    TaskSpec,
    TaskStatus,
    Worker,
)


def make_iteration(n: int, *, submitted_at: float = 0.0, queued: bool = True, **config) -> Iteration:
    """``n`` tasks t0..t{n-1}, all queued (dynamic) unless ``queued`` is False."""
    ids = [f"t{i}" for i in range(n)]
    it = Iteration(
        run_id="r",
        iteration=1,
        config=IterationConfig(**config),
        tasks={tid: Task(spec=TaskSpec(task_id=tid, prompt_ids=[1, 2]), seq=i) for i, tid in enumerate(ids)},
        submitted_at=submitted_at,
    )
    if queued:
        it.queue.extend(ids)
    return it


def run_on(it: Iteration, task_id: str, member_id: str, *, at: float = 0.0, lease: float = 10.0) -> None:
    """Mark ``task_id`` running on ``member_id`` (as core's assign would), leaving the queue alone."""
    task = it.tasks[task_id]
    task.status = TaskStatus.RUNNING
    task.holders[member_id] = Holder(member_id, 1, at, at + lease)
    if task_id in it.queue:
        it.queue.remove(task_id)


def finish(it: Iteration, *task_ids: str) -> None:
    for tid in task_ids:
        it.tasks[tid].status = TaskStatus.DONE
        it.tasks[tid].holders.clear()
        if tid in it.queue:
            it.queue.remove(tid)


def worker(member_id: str, slots: int = 4) -> Worker:
    return Worker(member_id, 1, slots, 1.0, 0.0)


# -- static shares --------------------------------------------------------------------------


def test_static_shares_largest_remainder_is_contiguous_and_proportional():
    ids = [f"t{i}" for i in range(10)]
    # exact 5, 2.5, 2.5 -> floors 5/2/2; the one left over goes to b (tie in remainder: earlier member)
    shares = policy.static_shares(ids, {"a": 2, "b": 1, "c": 1})
    assert shares == {"a": ids[0:5], "b": ids[5:8], "c": ids[8:10]}


def test_static_shares_remainder_goes_to_the_largest_fraction():
    ids = [f"t{i}" for i in range(7)]
    # exact 1.75, 5.25 -> floors 1/5; the spare goes to a (0.75 > 0.25)
    assert policy.static_shares(ids, {"b": 3, "a": 1}) == {"a": ids[0:2], "b": ids[2:7]}


def test_static_shares_equal_weights_ties_go_to_earlier_members():
    ids = [f"t{i}" for i in range(10)]
    shares = policy.static_shares(ids, {"c": 1.0, "b": 1.0, "a": 1.0})
    assert [len(shares[m]) for m in "abc"] == [4, 3, 3]
    assert shares["a"] == ids[:4] and shares["b"] == ids[4:7] and shares["c"] == ids[7:]


def test_static_shares_are_deterministic_whatever_the_dict_order():
    ids = [f"t{i}" for i in range(23)]
    one = policy.static_shares(ids, {"a": 0.5, "b": 1.5, "c": 3.0, "d": 1.0})
    two = policy.static_shares(ids, {"d": 1.0, "c": 3.0, "b": 1.5, "a": 0.5})
    assert one == two
    assert list(one) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 31, 100])
def test_static_shares_cover_every_task_once_in_order(n):
    ids = [f"t{i}" for i in range(n)]
    weights = {"a": 3.0, "b": 1.0, "c": 0.25, "d": 2.0}
    shares = policy.static_shares(ids, weights)
    assert [tid for m in sorted(weights) for tid in shares[m]] == ids
    total = sum(weights.values())
    for m, w in weights.items():  # largest remainder: never more than one away from the exact share
        assert abs(len(shares[m]) - n * w / total) < 1.0


def test_static_shares_with_no_workers_is_empty():
    assert policy.static_shares(["t0", "t1"], {}) == {}
    assert policy.static_shares([], {"a": 1.0}) == {"a": []}


# -- pick_tasks ------------------------------------------------------------------------------


def test_pick_dynamic_takes_the_queue_in_order_without_mutating():
    it = make_iteration(5)
    run_on(it, "t1", "b")
    it.queue.appendleft("t1")  # a stale entry (running elsewhere) is skipped, not handed out twice
    before = list(it.queue)
    assert policy.pick_tasks(it, worker("a"), 3) == [("t0", False), ("t2", False), ("t3", False)]
    assert list(it.queue) == before
    assert it.tasks["t0"].status is TaskStatus.QUEUED


def test_pick_nothing_when_no_free_slot_or_sealed():
    it = make_iteration(3)
    assert policy.pick_tasks(it, worker("a"), 0) == []
    it.sealed_at = 5.0
    assert policy.pick_tasks(it, worker("a"), 3) == []


def test_pick_static_own_share_first_then_shared_queue_never_anothers_share():
    it = make_iteration(6, queued=False, policy=Policy.STATIC)
    it.shares = {"a": collections.deque(["t0", "t1"]), "b": collections.deque(["t2", "t3"])}
    it.queue.extend(["t4", "t5"])  # requeued tasks anyone may take
    assert policy.pick_tasks(it, worker("a"), 10) == [("t0", False), ("t1", False), ("t4", False), ("t5", False)]
    assert policy.pick_tasks(it, worker("a"), 1) == [("t0", False)]
    # c has no share: only the shared queue
    assert policy.pick_tasks(it, worker("c"), 10) == [("t4", False), ("t5", False)]


def test_pick_static_never_issues_backups():
    it = make_iteration(2, queued=False, policy=Policy.STATIC, backup_tasks=5)
    it.shares = {"a": collections.deque(["t0"]), "b": collections.deque(["t1"])}
    run_on(it, "t0", "a")
    run_on(it, "t1", "b")
    assert policy.pick_tasks(it, worker("c"), 4) == []


def test_pick_backups_only_once_queue_is_empty():
    it = make_iteration(3, backup_tasks=2)
    run_on(it, "t0", "b")
    # two queued tasks and one slot: the queue wins, no backup
    assert policy.pick_tasks(it, worker("a"), 1) == [("t1", False)]
    # enough slots to empty the queue: the rest of the slots go to backups
    assert policy.pick_tasks(it, worker("a"), 4) == [("t1", False), ("t2", False), ("t0", True)]


def test_pick_backups_longest_running_first_within_budget_never_to_a_holder():
    it = make_iteration(5, queued=False, backup_tasks=2)
    run_on(it, "t0", "b", at=5.0)
    run_on(it, "t1", "c", at=1.0)  # longest running
    run_on(it, "t2", "a", at=0.0)  # a's own: never a backup for a
    run_on(it, "t3", "b", at=1.0)  # same start as t1: seq breaks the tie
    run_on(it, "t4", "b", at=0.5)
    run_on(it, "t4", "c", at=0.5)  # already has a second copy
    assert policy.pick_tasks(it, worker("a"), 4) == [("t1", True), ("t3", True)]
    assert policy.pick_tasks(it, worker("a"), 1) == [("t1", True)]
    it.counters.backups_issued = 1
    assert policy.pick_tasks(it, worker("a"), 4) == [("t1", True)]
    it.counters.backups_issued = 2
    assert policy.pick_tasks(it, worker("a"), 4) == []


def test_pick_no_backups_without_budget():
    it = make_iteration(1, queued=False, backup_tasks=0)
    run_on(it, "t0", "b")
    assert policy.pick_tasks(it, worker("a"), 2) == []


# -- task leases -------------------------------------------------------------------------------


def test_expired_holders_at_exactly_the_deadline():
    it = make_iteration(4, queued=False)
    run_on(it, "t0", "a", at=0.0, lease=10.0)
    run_on(it, "t0", "b", at=10.0, lease=10.0)
    run_on(it, "t1", "c", at=0.0, lease=10.0)
    run_on(it, "t2", "d", at=0.0, lease=10.0)
    finish(it, "t2")
    assert policy.expired_holders(it, 9.999) == []
    assert sorted(policy.expired_holders(it, 10.0)) == [("t0", "a"), ("t1", "c")]
    assert sorted(policy.expired_holders(it, 20.0)) == [("t0", "a"), ("t0", "b"), ("t1", "c")]
    expired, earliest = policy.lease_scan(it, 10.0)
    assert sorted(expired) == [("t0", "a"), ("t1", "c")] and earliest == 20.0  # b's copy, not yet expired
    assert policy.lease_scan(it, 9.0)[1] == 10.0
    assert policy.lease_scan(make_iteration(2), 5.0) == ([], math.inf)  # nothing running


# -- sealing -----------------------------------------------------------------------------------


def test_seal_when_every_task_is_done_even_without_deadline():
    it = make_iteration(4)
    finish(it, "t0", "t1", "t2")
    assert policy.decide_seal(it, 1e9) == (False, "3/4 done, no deadline")
    finish(it, "t3")
    seal, reason = policy.decide_seal(it, 0.0)
    assert seal and reason == "all 4 tasks done"
    it.sealed_at = 1.0
    assert policy.decide_seal(it, 2.0) == (False, "already sealed")


def test_seal_waits_for_the_deadline_before_taking_a_fraction():
    it = make_iteration(4, submitted_at=100.0, deadline_s=10.0, min_fraction=0.5)
    finish(it, "t0", "t1", "t2")
    seal, reason = policy.decide_seal(it, 109.999)
    assert not seal and "to the deadline" in reason


def test_seal_at_deadline_with_min_fraction_done():
    it = make_iteration(4, submitted_at=100.0, deadline_s=10.0, min_fraction=0.5)
    finish(it, "t0", "t1")
    seal, reason = policy.decide_seal(it, 110.0)
    assert seal and "deadline passed with 2/4" in reason


def test_seal_after_deadline_waits_until_min_fraction_is_reached():
    it = make_iteration(4, submitted_at=100.0, deadline_s=10.0, min_fraction=0.75)
    finish(it, "t0", "t1")
    it.tasks["t2"].status = TaskStatus.DROPPED  # not done: does not count
    seal, reason = policy.decide_seal(it, 110.0)
    assert not seal and "waiting for 3" in reason
    assert not policy.decide_seal(it, 1e6)[0]
    finish(it, "t3")
    assert policy.decide_seal(it, 1e6)[0]


def test_seal_fraction_is_not_fooled_by_float_rounding():
    # 0.28 * 25 == 7.000000000000001 in floating point; 7 of 25 groups is enough
    it = make_iteration(25, submitted_at=0.0, deadline_s=1.0, min_fraction=0.28)
    finish(it, *[f"t{i}" for i in range(6)])
    assert not policy.decide_seal(it, 1.0)[0]
    finish(it, "t6")
    assert policy.decide_seal(it, 1.0)[0]


# -- shard balance -----------------------------------------------------------------------------


def test_balance_shards_hand_computed():
    groups = [("a", 0, 10), ("b", 1, 7), ("c", 2, 5), ("d", 3, 5), ("e", 4, 3)]
    # LPT: a->r0(10) b->r1(7) c->r1(12) d->r0(15) e->r1(15)
    assert policy.balance_shards(groups, 2) == [["a", "d"], ["b", "c", "e"]]


def test_balance_shards_equal_loads_tie_on_fewer_groups_then_lower_rank():
    groups = [("x", 0, 4), ("y", 1, 2), ("z", 2, 2), ("w", 3, 0)]
    # x->r0(4,1) y->r1(2,1) z->r1(4,2) w: loads equal at 4, r0 has fewer groups
    assert policy.balance_shards(groups, 2) == [["x", "w"], ["y", "z"]]


def test_balance_shards_every_group_once_seq_ordered_balanced_and_deterministic():
    rng = random.Random(7)
    groups = [(f"t{i}", i, rng.randint(1, 500)) for i in range(97)]
    for world_size in (1, 2, 3, 8):
        plan = policy.balance_shards(groups, world_size)
        assert len(plan) == world_size
        flat = [tid for shard in plan for tid in shard]
        assert sorted(flat) == sorted(g[0] for g in groups) and len(flat) == len(set(flat))
        seq = {tid: s for tid, s, _ in groups}
        tokens = {tid: n for tid, _, n in groups}
        for shard in plan:
            assert [seq[t] for t in shard] == sorted(seq[t] for t in shard)
        loads = [sum(tokens[t] for t in shard) for shard in plan]
        assert max(loads) - min(loads) <= max(tokens.values())  # the LPT guarantee
        shuffled = groups[:]
        rng.shuffle(shuffled)
        assert policy.balance_shards(shuffled, world_size) == plan


def test_balance_shards_more_ranks_than_groups():
    plan = policy.balance_shards([("a", 0, 20), ("b", 1, 10)], 4)
    assert plan == [["a"], ["b"], [], []]
    assert policy.balance_shards([], 3) == [[], [], []]


def test_balance_shards_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        policy.balance_shards([("a", 0, 1)], 0)


# -- order of iterations -------------------------------------------------------------------------


def test_oldest_open_skips_sealed_and_orders_by_number_whatever_the_submit_time():
    """Iteration 1 submitted last (again, by a trainer resumed from an older checkpoint) still
    comes first: the trainer waits for it, not for the ones submitted ahead."""
    its = []
    for number, at in ((3, 5.0), (1, 9.0), (2, 5.0), (4, 1.0)):
        it = make_iteration(1, submitted_at=at)
        it.iteration = number
        its.append(it)
    its[3].sealed_at = 2.0
    assert [it.iteration for it in policy.oldest_open(its)] == [1, 2, 3]


def test_status_counts_follow_every_change_and_every_table_entry():
    it = make_iteration(6)
    assert it.count(TaskStatus.QUEUED) == 6 and it.count(TaskStatus.DONE) == 0
    it.tasks["t0"].status = TaskStatus.RUNNING
    it.tasks["t0"].status = TaskStatus.DONE
    it.tasks["t1"].status = TaskStatus.FAILED
    it.tasks["t2"].status = TaskStatus.DONE
    replaced = it.tasks["t2"]
    it.tasks["t2"] = Task(spec=replaced.spec, seq=replaced.seq)  # a table entry replaced: the old one no longer counts
    replaced.status = TaskStatus.FAILED
    it.tasks["t9"] = Task(spec=TaskSpec(task_id="t9", prompt_ids=[1]), seq=9)  # added later, as a restart loads them
    it.tasks["t9"].status = TaskStatus.DROPPED
    recount = collections.Counter(t.status for t in it.tasks.values())
    assert {s: it.count(s) for s in TaskStatus} == {s: recount[s] for s in TaskStatus}
    assert (it.count(TaskStatus.DONE), it.count(TaskStatus.FAILED), it.count(TaskStatus.QUEUED)) == (1, 1, 4)
