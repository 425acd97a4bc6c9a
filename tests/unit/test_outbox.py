"""The Work stream's messages (``scheduler/outbox.py``): each outbox item encoded by hand reads
back as the message protobuf would have built (a task spec from its message cached once,
``convert.task_wire``); for a worker that said ``combined_acks``, the acks and assignments waiting
together go as one message (never an ack ahead of an assignment of its batch's tasks), and a
cancel or an end is never merged or overtaken."""

from __future__ import annotations

import asyncio

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.scheduler import convert, outbox
from elasticrl.scheduler.state import Sampling, Split, TaskSpec, Worker
from elasticrl.scheduler.stream import Ack, Assign, Cancel, End, WorkerConn

pytestmark = pytest.mark.timeout(30)


def spec(task_id: str, n: int) -> TaskSpec:
    return TaskSpec(task_id=task_id, prompt_ids=list(range(n)), prompt_text="p", num_samples=4,
                    sampling=Sampling(temperature=0.75, top_p=0.5, max_new_tokens=33, seed=5, stop_token_ids=[2, 3]),
                    split=Split.EVAL, metadata_json='{"row": 1}')


def parsed(data: bytes) -> spb.WorkResponse:
    return spb.WorkResponse.FromString(data)


def tasks_of(msg: spb.WorkResponse) -> list[tuple]:
    return [(a.iteration, convert.task_from_pb("t", a.task), a.lease_ms, a.backup) for a in msg.assign.tasks]


def test_an_assignment_carries_every_field_of_each_spec_and_builds_a_spec_message_once():
    specs = [spec("a", 2048), spec("b", 3)]
    msg = parsed(outbox.message(Assign([(7, specs[0], 1.5, False), (7, specs[1], 2.0, True)])))
    assert msg.WhichOneof("kind") == "assign" and len(msg.acks) == 0
    assert tasks_of(msg) == [(7, specs[0], 1500, False), (7, specs[1], 2000, True)]
    wire = convert.task_wire(specs[0])
    assert convert.task_wire(specs[0]) is wire  # kept on the spec: a second copy handed out reuses it
    assert wire == convert.task_to_pb(specs[0]).SerializeToString()


@pytest.mark.parametrize("item, expected", [
    (Ack(3, [(2, "t1", "duplicate"), (0, "", "")]), spb.WorkResponse(ack=spb.ResultAck(
        accepted=3, refused=[spb.RefusedResult(iteration=2, task_id="t1", reason="duplicate"), spb.RefusedResult()]))),
    (Ack(0, []), spb.WorkResponse(ack=spb.ResultAck())),  # still an ack: the worker counts it
    (Cancel(5, ["t1", "", "tâche"]), spb.WorkResponse(cancel=spb.CancelTasks(iteration=5, task_ids=["t1", "", "tâche"]))),
    (Cancel(0, []), spb.WorkResponse(cancel=spb.CancelTasks())),
    (Assign([(0, TaskSpec(task_id="z", prompt_ids=[]), 0.0, False)]), spb.WorkResponse(assign=spb.Assignments(
        tasks=[spb.TaskAssignment(task=convert.task_to_pb(TaskSpec(task_id="z", prompt_ids=[])))]))),
])
def test_each_item_reads_back_as_the_message_protobuf_builds(item, expected):
    msg = parsed(outbox.message(item))
    assert msg == expected and msg.WhichOneof("kind") == expected.WhichOneof("kind")


def conn_with(items: list, *, combined: bool) -> WorkerConn:
    conn = WorkerConn("r", Worker("w", 1, slots=4, weight=1.0, connected_at=0.0))
    conn.combined_acks = combined
    for item in items:
        conn.send(item)
    return conn


def written(conn: WorkerConn, n: int) -> list:
    async def take():
        writer = outbox.Writer(conn)
        return [await asyncio.wait_for(writer.next(), 5) for _ in range(n)]

    return asyncio.run(take())


def test_a_combined_acks_worker_gets_waiting_acks_and_assignments_in_one_message_in_order():
    a, b, c = spec("a", 3), spec("b", 3), spec("c", 3)
    items = [Assign([(1, a, 1.0, False)]), Ack(1, []), Assign([(1, b, 1.0, True)]), Ack(2, [(1, "x", "sealed")]),
             Cancel(1, ["a"]), Assign([(1, c, 1.0, False)]), End()]
    first, cancel, last, end = written(conn_with(items, combined=True), 4)
    msg = parsed(first)
    assert [(k.accepted, [(r.iteration, r.task_id, r.reason) for r in k.refused]) for k in msg.acks] == [
        (1, []), (2, [(1, "x", "sealed")])]
    assert [t[1].task_id for t in tasks_of(msg)] == ["a", "b"] and tasks_of(msg)[1][3] is True
    assert parsed(cancel).WhichOneof("kind") == "cancel"  # not merged, and c waits behind it
    assert [t[1].task_id for t in tasks_of(parsed(last))] == ["c"]
    assert isinstance(end, End)


def test_an_ack_is_not_merged_ahead_of_an_assignment_of_a_task_of_its_batch():
    # A reconnect: the hello's dispatch handed task a out again before the re-sent batch with a's
    # result was read. The worker reads acks first; with that ack first it would run a again.
    a, b, c = spec("a", 3), spec("b", 3), spec("c", 3)
    items = [Assign([(1, a, 1.0, False), (1, c, 1.0, False)]), Ack(1, [], frozenset({(1, "a"), (1, "z")})),
             Assign([(1, b, 1.0, False)]), Ack(1, [], frozenset({(2, "b")}))]
    first, second = (parsed(m) for m in written(conn_with(items, combined=True), 2))
    assert [t[1].task_id for t in tasks_of(first)] == ["a", "c"] and len(first.acks) == 0
    assert [k.accepted for k in second.acks] == [1, 1] and [t[1].task_id for t in tasks_of(second)] == ["b"]


def test_a_worker_that_did_not_ask_gets_one_message_per_item():
    a = spec("a", 3)
    items = [Assign([(1, a, 1.0, False)]), Ack(1, []), Ack(0, [])]
    kinds = [parsed(m).WhichOneof("kind") for m in written(conn_with(items, combined=False), 3)]
    assert kinds == ["assign", "ack", "ack"]
