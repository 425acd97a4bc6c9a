"""Seeded random tests of the pure reporting functions: ``scheduler.accounting`` (the counters a
result batch stages, the manifest that ``WaitSealed``, ``IterationStatus``, ``elasticrl status``
and ``manifest.json`` show) and ``train.metric_sinks`` (``scalars``, ``metrics.jsonl``).

Checked against a plain recount of the same inputs: a batch's refusals count once per reason for
its own iteration only (never "unknown"), into copies (the live counters change only after the
commit); a manifest's task counts add up to its tasks, its per-node running counts are the running
copies, its tokens the nodes' tokens, nothing is negative or NaN, it survives the protobuf round
trip the status RPCs take, and building it changes nothing; ``metrics.jsonl`` keeps one JSON
object a line and ``last_iteration`` names the newest complete one, a torn last line skipped.

``ELASTICRL_RANDOM_SEEDS`` (default 3) sets how many seeds run (x ``CASES`` cases each).

Bugs it found (each has a focused test below, which failed before its fix):
  * ``test_tasks_per_s_does_not_depend_on_the_clock_reading``: a node with no first assignment
    on record (after a restart) gets ``done / last_result_at``.
  * ``test_a_record_appended_after_a_torn_line_is_on_record``: a record written after a torn last
    line is glued to it.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import random

import pytest

from elasticrl.scheduler import accounting
from elasticrl.scheduler.convert import manifest_from_pb, manifest_to_pb
from elasticrl.scheduler.state import (
    MAX_ERRORS,
    Counters,
    GroupRecord,
    Holder,
    Iteration,
    IterationConfig,
    NodeStats,
    Policy,
    SampleRecord,
    Task,
    TaskSpec,
    TaskStatus,
)
from elasticrl.status_table import render_iteration
from elasticrl.train.metric_sinks import JsonLines, scalars

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "3")))
CASES = 200
REASONS = ("duplicate", "fenced", "sealed", "unknown")
NODES = ("n0", "node:1@h", "w-2.gpu=0+1", "x")


def random_iteration(rng: random.Random, *, number: int = 7) -> Iteration:
    """An iteration in any state the core can leave it in: tasks in every status, running copies
    held by nodes on record, counters and per-node stats (each node with a result has its first
    assignment on record, as a live coordinator keeps it)."""
    sealed = rng.random() < 0.4
    statuses = [TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.DONE, TaskStatus.FAILED]
    if sealed:
        statuses = [TaskStatus.DONE, TaskStatus.FAILED, TaskStatus.DROPPED]
    now = 1000.0
    nodes = {}
    for mid in rng.sample(NODES, rng.randint(0, len(NODES))):
        done = rng.randint(0, 9)
        first = now - rng.uniform(0, 100) if rng.random() < 0.9 or done == 0 else now - 50
        last = first + rng.uniform(0, 50) if done else (first + rng.uniform(0, 50) if rng.random() < 0.3 else None)
        nodes[mid] = NodeStats(
            assigned=rng.randint(done, done + 5), done=done, refused=rng.randint(0, 3), tokens=rng.randint(0, 500),
            first_assigned_at=first, last_result_at=last, evicted=rng.random() < 0.2)
    tasks = {}
    for i in range(rng.randint(0, 12)):
        task = Task(spec=TaskSpec(task_id=f"t{i}", prompt_ids=[1, i]), seq=i)
        task.status = rng.choice(statuses)
        if task.status is TaskStatus.RUNNING and nodes:
            for mid in rng.sample(sorted(nodes), rng.randint(1, min(2, len(nodes)))):
                task.holders[mid] = Holder(mid, 1, now - 1, now + 60)
        tasks[task.spec.task_id] = task
    it = Iteration(
        run_id=rng.choice(["r", "run:1@a=b+c"]), iteration=number, tasks=tasks, submitted_at=now - rng.uniform(1, 200),
        config=IterationConfig(policy=rng.choice(list(Policy))), nodes=nodes,
        counters=Counters(
            requeued=rng.randint(0, 20), refused_duplicate=rng.randint(0, 5), refused_fenced=rng.randint(0, 5),
            refused_sealed=rng.randint(0, 5), backups_issued=rng.randint(0, 3), env_errors=rng.randint(0, 9),
            errors=[f"e{k}" for k in range(rng.randint(0, MAX_ERRORS))], groups_lost=rng.randint(0, 2)),
        evicted=sorted(m for m, s in nodes.items() if s.evicted),
    )
    if sealed:
        it.sealed_at, it.seal_reason = it.submitted_at + rng.uniform(0, 100), "all tasks done"
    return it


def group(rng: random.Random, task_id: str) -> GroupRecord:
    samples = [SampleRecord.pack(list(range(t)), [-0.5] * t, 1.0, "stop", text=rng.choice(["", "x", "caf\u00e9"]))
               for t in (rng.randint(1, 8) for _ in range(rng.randint(1, 3)))]
    return GroupRecord(task_id, "", 0, 0.0, 0.0, samples)


@pytest.mark.parametrize("seed", SEEDS)
def test_staged_counters_count_each_refusal_of_this_iteration_once_into_copies(seed):
    rng = random.Random(seed)
    for case in range(CASES):
        it = random_iteration(rng)
        before = copy.deepcopy((it.counters, it.nodes))
        member = rng.choice(NODES)
        refused = [(rng.choice([it.iteration, it.iteration, it.iteration + 1]), f"t{rng.randint(0, 12)}", rng.choice(REASONS))
                   for _ in range(rng.randint(0, 6))]
        fresh = [group(rng, f"t{k}") for k in range(rng.randint(0, 4))]
        now = 2000.0 + case
        counters, node = accounting.staged_counters(it, member, refused, fresh, now)
        mine = collections.Counter(reason for n, _, reason in refused if n == it.iteration and reason != "unknown")
        old_c, old_nodes = before
        for reason in ("duplicate", "fenced", "sealed"):
            assert getattr(counters, f"refused_{reason}") == getattr(old_c, f"refused_{reason}") + mine[reason], (case, refused)
        for name in ("requeued", "backups_issued", "env_errors", "groups_lost", "errors"):
            assert getattr(counters, name) == getattr(old_c, name)
        old = old_nodes.get(member) or NodeStats()
        assert node.refused == old.refused + sum(mine.values())
        assert node.done == old.done + len(fresh)
        assert node.tokens == old.tokens + sum(g.num_tokens for g in fresh)
        assert node.last_result_at == (now if fresh else old.last_result_at)
        assert (node.assigned, node.first_assigned_at, node.evicted) == (old.assigned, old.first_assigned_at, old.evicted)
        # copies: the live books change only once the commit succeeded
        assert (it.counters, it.nodes) == before
        assert counters.errors is not it.counters.errors
        assert node is not it.nodes.get(member)


def books(it: Iteration) -> tuple:
    """Everything of ``it`` a manifest reads, as plain values."""
    return (
        vars(copy.deepcopy(it.counters)), {m: vars(s).copy() for m, s in it.nodes.items()}, list(it.evicted),
        {t: (x.status, sorted(x.holders)) for t, x in it.tasks.items()}, it.sealed_at, it.submitted_at,
    )


def numbers(d: dict, where: str = "manifest"):
    for k, v in d.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{where}.{k}", v


@pytest.mark.parametrize("seed", SEEDS)
def test_the_manifest_adds_up_and_is_reported_as_built(seed):
    rng = random.Random(seed)
    for case in range(CASES):
        it = random_iteration(rng)
        slots = {m: rng.randint(1, 8) for m in rng.sample(NODES, rng.randint(0, len(NODES)))}
        now = 3000.0
        elapsed = rng.uniform(0, 300)
        before = books(it)
        m = accounting.manifest(it, slots, now, elapsed)
        assert books(it) == before, "building the manifest changed the iteration"
        json.dumps(m, allow_nan=False)  # plain JSON (manifest.json), no NaN or infinity
        for name, v in [*numbers(m), *(x for n in m["nodes"] for x in numbers(n, f"node {n['node']}"))]:
            assert math.isfinite(v) and v >= 0, (case, name, v)
        by_status = collections.Counter(t.status for t in it.tasks.values())
        assert m["tasks_total"] == len(it.tasks)
        assert (m["tasks_done"], m["tasks_queued"], m["tasks_running"], m["tasks_failed"]) == (
            by_status[TaskStatus.DONE], by_status[TaskStatus.QUEUED], by_status[TaskStatus.RUNNING], by_status[TaskStatus.FAILED])
        assert m["tasks_total"] - m["tasks_done"] - m["tasks_queued"] - m["tasks_running"] - m["tasks_failed"] == by_status[TaskStatus.DROPPED]
        c = it.counters
        assert (m["requeued"], m["refused_duplicate"], m["refused_fenced"], m["refused_sealed"], m["backups_issued"],
                m["env_errors"], m["errors"], m["groups_lost"]) == (
            c.requeued, c.refused_duplicate, c.refused_fenced, c.refused_sealed, c.backups_issued, c.env_errors, c.errors,
            c.groups_lost)
        assert m["errors"] is not c.errors and m["evicted"] == it.evicted and m["evicted"] is not it.evicted
        running = collections.Counter(mid for t in it.tasks.values() if t.status is TaskStatus.RUNNING for mid in t.holders)
        assert [n["node"] for n in m["nodes"]] == sorted(set(it.nodes) | set(running))
        for n in m["nodes"]:
            s = it.nodes[n["node"]]
            assert (n["assigned"], n["done"], n["refused"], n["tokens"], n["evicted"], n["running"], n["slots"]) == (
                s.assigned, s.done, s.refused, s.tokens, s.evicted, running[n["node"]], slots.get(n["node"], 0))
            span = (s.last_result_at or 0) - (s.first_assigned_at or 0)
            assert n["tasks_per_s"] == (s.done / span if s.done and span > 0 else 0.0)
        assert m["tokens"] == sum(s.tokens for s in it.nodes.values())
        assert m["sealed"] == it.sealed and m["elapsed_s"] == elapsed
        assert m["sealed_ago_s"] == (now - it.sealed_at if it.sealed else 0.0)
        # A rate does not depend on where the clock started: the same books an hour later read the same.
        shifted = copy.deepcopy(it)
        for s in shifted.nodes.values():
            s.first_assigned_at = None if s.first_assigned_at is None else s.first_assigned_at + 3600
            s.last_result_at = None if s.last_result_at is None else s.last_result_at + 3600
        if shifted.sealed:
            shifted.sealed_at += 3600
        later = [n["tasks_per_s"] for n in accounting.manifest(shifted, slots, now + 3600, elapsed)["nodes"]]
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(later, [n["tasks_per_s"] for n in m["nodes"]])), later
        # What WaitSealed / IterationStatus carry, read back by the clients and `elasticrl status`.
        assert manifest_from_pb(manifest_to_pb(m)) == m
        table = render_iteration(m)
        assert f"tasks {m['tasks_done']}/{m['tasks_total']} done" in table and f"requeued {m['requeued']}" in table


@pytest.mark.parametrize("seed", SEEDS)
def test_scalars_keep_the_real_numbers_and_metrics_jsonl_names_its_newest_complete_record(seed, tmp_path):
    rng = random.Random(seed)
    pool = [1, 2.5, -3, 0, True, False, "x", None, {"1": 2}, [1], float("inf"), 10**20]
    for _ in range(CASES):
        metrics = {f"k{i}": rng.choice(pool) for i in range(rng.randint(0, 8))}
        out = scalars(metrics)
        assert out == {k: float(v) for k, v in metrics.items() if type(v) in (int, float)}
        assert all(type(v) is float for v in out.values())
    for case in range(30):
        sink = JsonLines(str(tmp_path / f"case{case}"))
        os.makedirs(os.path.dirname(sink.path), exist_ok=True)
        assert sink.last_iteration() == 0
        newest = 0
        for _ in range(rng.randint(0, 8)):
            # iterations go on, or are redone after a restart from an older snapshot
            iteration = max(1, newest + rng.choice([1, 1, 1, 0, -1]))
            sink.log({"iteration": iteration, "reward_mean": rng.random(), "example": "12=21 \u2603"}, iteration)
            newest = iteration
            assert sink.last_iteration() == newest
        if not os.path.exists(sink.path):
            continue
        with open(sink.path) as f:
            lines = f.read().splitlines()
        assert all("time_unix_s" in json.loads(line) for line in lines)
        if lines and rng.random() < 0.5:  # killed mid-write: the newest complete record still counts
            torn = json.dumps({"iteration": newest + 1, "reward_mean": 0.5})
            with open(sink.path, "a") as f:
                f.write(torn[: rng.randint(1, len(torn) - 1)])
            assert sink.last_iteration() == newest
            # (a record written after a torn line is glued to it: see
            # test_a_record_appended_after_a_torn_line_is_on_record)


# -- bugs found (fixed) ------------------------------------------------------------------------------------


def test_tasks_per_s_does_not_depend_on_the_clock_reading():
    """proto NodeCounts.tasks_per_s: "done / time from its first assignment to its last result".
    ``first_assigned_at`` and ``last_result_at`` are not persisted (persist._node_json), so a
    restarted coordinator holds a node's ``done`` without its first assignment; its next result
    sets ``last_result_at`` and ``accounting.manifest`` takes the missing first assignment as 0:
    ``done / last_result_at``, where ``last_result_at`` is a ``time.monotonic()`` reading (the host's
    uptime). The same books read 0.0008 tasks/s on a host up 1 h 23 min and 0.00004 on one up a
    day; neither is a rate of this node."""
    def rate(clock_reading: float) -> float:
        it = Iteration(run_id="r", iteration=1, tasks={}, submitted_at=clock_reading - 10, config=IterationConfig(),
                       nodes={"n0": NodeStats(assigned=4, done=4, tokens=40, first_assigned_at=None,
                                              last_result_at=clock_reading)})
        return accounting.manifest(it, {}, clock_reading, 10.0)["nodes"][0]["tasks_per_s"]

    assert math.isclose(rate(5000.0), rate(86400.0)), (rate(5000.0), rate(86400.0))


def test_a_record_appended_after_a_torn_line_is_on_record(tmp_path):
    """``JsonLines`` promises "every metric of every iteration, one JSON object a line" and its
    ``last_iteration`` skips "a torn last line (killed mid-write)" so that a resumed run adds the
    record its snapshot finished but nobody recorded (``train/loop.py`` ``_open_records``). That
    record is appended with no newline before it: it lands on the torn line, which is then not
    JSON, so iteration 2's metrics are lost (``last_iteration`` still says 1, ``run_summary.last_records``
    skips the line, ``elasticrl.plot`` fails on it)."""
    sink = JsonLines(str(tmp_path))
    sink.log({"iteration": 1, "reward_mean": 0.1}, 1)
    record = {"iteration": 2, "reward_mean": 0.2}
    with open(sink.path, "a") as f:
        f.write(json.dumps(record)[:15])  # killed mid-write
    assert sink.last_iteration() == 1
    sink.log(record, 2)  # the resumed run records the iteration its snapshot finished
    assert sink.last_iteration() == 2
