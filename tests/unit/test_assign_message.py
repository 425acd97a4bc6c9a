"""An assignment message (``scheduler/service._out_message``) carries each task spec as the worker
reads it back, built from the spec's message cached once (``convert.task_wire``)."""

from __future__ import annotations

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.scheduler import convert
from elasticrl.scheduler.service import _out_message
from elasticrl.scheduler.state import Sampling, Split, TaskSpec
from elasticrl.scheduler.stream import Assign


def spec(task_id: str, n: int) -> TaskSpec:
    return TaskSpec(task_id=task_id, prompt_ids=list(range(n)), prompt_text="p", num_samples=4,
                    sampling=Sampling(temperature=0.75, top_p=0.5, max_new_tokens=33, seed=5, stop_token_ids=[2, 3]),
                    split=Split.EVAL, metadata_json='{"row": 1}')


def test_an_assignment_carries_every_field_of_each_spec_and_builds_a_spec_message_once():
    specs = [spec("a", 2048), spec("b", 3)]
    data = _out_message(Assign([(7, specs[0], 1.5, False), (7, specs[1], 2.0, True)])).SerializeToString()
    msg = spb.WorkResponse.FromString(data)
    got = [(a.iteration, convert.task_from_pb("t", a.task), a.lease_ms, a.backup) for a in msg.assign.tasks]
    assert got == [(7, specs[0], 1500, False), (7, specs[1], 2000, True)]
    wire = convert.task_wire(specs[0])
    assert convert.task_wire(specs[0]) is wire  # kept on the spec: a second copy handed out reuses it
    assert wire == convert.task_to_pb(specs[0]).SerializeToString()
