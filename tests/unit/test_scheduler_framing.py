"""The trajectory path's hand-written wire format (``scheduler.framing``) against the generated
protobuf classes: what a worker builds is byte for byte what upb serializes, what the coordinator
reads from a message is what ``convert.group_from_pb`` reads, a group carrying fields a worker
does not fill is stored without them, and what is unacceptable is refused with the same messages."""

from __future__ import annotations

import array
import dataclasses
import math
import struct

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.errors import InvalidRequestError
from elasticrl.scheduler import framing
from elasticrl.scheduler.convert import group_from_pb, result_to_pb, served_fields_pb
from elasticrl.scheduler.state import GroupRecord, SampleRecord, Split, TaskSpec

pytestmark = pytest.mark.timeout(30)


def sample(n: int, *, seed: int = 0, **kw) -> SampleRecord:
    return SampleRecord(
        array.array("i", [seed * 1000 + k for k in range(n)]).tobytes(),
        array.array("f", [-0.25 * k for k in range(n)]).tobytes(),
        **{"reward": 1.0, **kw},
    )


GROUPS = [
    GroupRecord("t00", "", 3, 1.5, 0.25, [sample(4), sample(2, seed=1, reward=0.0)]),
    # everything a sample can carry, negative and odd values included
    GroupRecord("t:01-x", "", -7, 0.0, 2.0, [
        sample(6, reward=-0.0, finish_reason="stop", text="héllo ✓", loss_mask=bytes([0, 0, 1, 1, 0, 1]),
               turns=3, env_s=0.125, truncated=True),
        sample(1, reward=-3.75, turns=0),
        sample(0, reward=2.5, finish_reason="length"),
    ]),
    GroupRecord("t02", "", 1 << 40, 1e9, 0.0, [sample(3000, seed=2, turns=(1 << 32) - 1)]),
]


def wire_group(g: GroupRecord, iteration: int = 5) -> bytes:
    return result_to_pb(iteration, g).SerializeToString()


def test_a_result_batch_is_what_upb_serializes_byte_for_byte():
    batch = [(5, g) for g in GROUPS] + [((1 << 64) - 1, GROUPS[0])]
    mine = framing.result_batch_request(batch, "b-1")
    theirs = spb.WorkRequest(results=spb.ResultBatch(
        groups=[result_to_pb(i, g) for i, g in batch], batch_id="b-1")).SerializeToString()
    assert mine == theirs
    assert framing.result_batch_request([(1, GROUPS[0])], "") == spb.WorkRequest(
        results=spb.ResultBatch(groups=[result_to_pb(1, GROUPS[0])])).SerializeToString()


def test_a_float_beyond_float32_is_sent_as_infinity_as_upb_does():
    g = GroupRecord("t00", "", 0, 0.0, 0.0, [sample(1, reward=1e39, env_s=-1e40)])
    parsed = spb.WorkRequest.FromString(framing.result_batch_request([(1, g)], "b"))
    s = parsed.results.groups[0].samples[0]
    assert s.reward == math.inf and s.env_s == -math.inf


def test_reading_a_batch_gives_what_the_generated_parser_gives():
    data = spb.WorkRequest(results=spb.ResultBatch(groups=[result_to_pb(5, g) for g in GROUPS], batch_id="b-7")).SerializeToString()
    batch_id, spans = framing.result_batch_spans(data)
    assert batch_id == "b-7" and len(spans) == len(GROUPS)
    msg = spb.WorkRequest.FromString(data)
    for i, ((start, end), pb) in enumerate(zip(spans, msg.results.groups)):
        iteration, wg = framing.read_group(f"results.groups[{i}]", data, start, end, node="w0")
        it2, rec = group_from_pb(f"results.groups[{i}]", pb)
        assert iteration == it2 == 5
        assert (wg.task_id, wg.policy_version, wg.gen_seconds, wg.reward_seconds) == (
            rec.task_id, rec.policy_version, rec.gen_seconds, rec.reward_seconds)
        assert wg.samples == rec.samples and wg.num_tokens == rec.num_tokens and wg.node == "w0"
        assert bytes(wg.wire) == pb.SerializeToString()  # stored and served as it came: no copy, no change


def test_requests_other_than_a_result_batch_are_left_to_the_generated_parser():
    hello = spb.WorkRequest(hello=spb.WorkerHello(run_id="r", slots=1)).SerializeToString()
    release = spb.WorkRequest(release=spb.ReleaseTasks(iteration=1, task_ids=["t"])).SerializeToString()
    both = spb.WorkRequest(results=spb.ResultBatch(batch_id="b")).SerializeToString() + hello  # oneof: last one wins
    assert framing.result_batch_spans(hello) is None
    assert framing.result_batch_spans(release) is None
    assert framing.result_batch_spans(both) is None
    assert framing.result_batch_spans(b"") is None


@pytest.mark.parametrize("extra", [
    spb.TrajectoryGroup(node="forged", prompt_ids=[9, 9], split=spb.SPLIT_EVAL, metadata_json="{}"),
    spb.TrajectoryGroup(task_id="t00"),
])
def test_a_group_with_fields_a_worker_does_not_fill_is_stored_without_them(extra):
    g = GROUPS[1]
    data = wire_group(g) + extra.SerializeToString() + struct.pack("<B", 0xA0) + b"\x01\x05"  # + unknown field 20
    iteration, wg = framing.read_group("g", data, 0, len(data))
    stored = spb.TrajectoryGroup.FromString(bytes(wg.wire))
    expected = dataclasses.replace(g, task_id=extra.task_id or g.task_id)  # a field twice: the last one counts
    assert bytes(wg.wire) == wire_group(expected)  # exactly fields 1-6, each once, as a worker sends them
    assert (stored.node, list(stored.prompt_ids), stored.split, stored.metadata_json) == ("", [], 0, "")
    assert iteration == 5 and wg.samples == group_from_pb("g", result_to_pb(5, g))[1].samples


def test_a_sample_with_an_unknown_field_is_rebuilt_without_it():
    s = spb.Sample(completion_ids=array.array("i", [1, 2]).tobytes(), logprobs=array.array("f", [0, 0]).tobytes())
    raw = s.SerializeToString() + b"\xa0\x01\x07"  # field 20, a varint
    data = spb.TrajectoryGroup(iteration=1, task_id="t").SerializeToString() + b"\x1a" + bytes([len(raw)]) + raw
    _, wg = framing.read_group("g", data, 0, len(data))
    assert spb.TrajectoryGroup.FromString(bytes(wg.wire)).samples[0] == s and len(wg.wire) < len(data)


def _with(g: GroupRecord, **sample_fields) -> bytes:
    pb = result_to_pb(1, g)
    for k, value in sample_fields.items():
        setattr(pb.samples[0], k, value)
    return pb.SerializeToString()


@pytest.mark.parametrize("data, message", [
    (_with(GROUPS[0], completion_ids=b"\x01\x02\x03"), r"g.samples\[0\]: completion_ids \(3 bytes\) must be int32"),
    (_with(GROUPS[0], logprobs=b"\x00" * 4), r"logprobs \(4 bytes\) one float32 per token"),
    (_with(GROUPS[0], reward=float("nan")), r"g.samples\[0\].reward: nan is not finite"),
    (_with(GROUPS[0], loss_mask=b"\x01"), r"g.samples\[0\].loss_mask: 1 bytes for 4 tokens"),
    (_with(GROUPS[0], loss_mask=b"\x01\x01\x02\x01"), "one 0/1 byte per token"),
    (_with(GROUPS[0], env_s=-1.0), r"g.samples\[0\].env_s: -1.0 must be a finite number >= 0"),
    (spb.TrajectoryGroup(iteration=1, task_id="t00").SerializeToString(), r"g.samples: must not be empty"),
    (result_to_pb(1, GroupRecord("no spaces", "", 0, 0, 0, [sample(1)])).SerializeToString(), r"g.task_id: 'no spaces' is not a valid id"),
])
def test_unacceptable_values_are_refused_as_group_from_pb_refuses_them(data, message):
    with pytest.raises(InvalidRequestError, match=message):
        framing.read_group("g", data, 0, len(data))
    with pytest.raises(InvalidRequestError, match=message):
        group_from_pb("g", spb.TrajectoryGroup.FromString(data))


def test_text_that_is_not_utf8_is_refused_and_the_refusal_still_names_the_task():
    raw = spb.Sample(completion_ids=b"\x00" * 4, logprobs=b"\x00" * 4).SerializeToString() + b"\x2a\x02\xff\xfe"
    data = spb.TrajectoryGroup(iteration=3, task_id="t09").SerializeToString() + b"\x1a" + bytes([len(raw)]) + raw
    with pytest.raises(InvalidRequestError, match=r"g.samples\[0\].text: not valid UTF-8"):
        framing.read_group("g", data, 0, len(data))
    assert framing.group_key(data, 0, len(data)) == (3, "t09")


@pytest.mark.parametrize("cut", [1, 2, 3, 10, 40])
def test_truncated_bytes_are_a_framing_error_not_a_crash(cut):
    data = framing.result_batch_request([(1, GROUPS[0])], "b")
    short = data[:-cut]
    with pytest.raises(framing.FramingError):
        found = framing.result_batch_spans(short)
        if found is not None:  # the outer length no longer fits: refused above, or a group is short
            for start, end in found[1]:
                framing.read_group("g", short, start, end)
    group = wire_group(GROUPS[0])
    with pytest.raises(framing.FramingError):
        framing.read_group("g", group[:-cut], 0, len(group) - cut)


def test_a_wire_type_protobuf_does_not_have_is_a_framing_error():
    data = wire_group(GROUPS[0]) + b"\x0f"  # field 1, wire type 7
    with pytest.raises(framing.FramingError, match="wire type 7"):
        framing.read_group("g", data, 0, len(data))


def test_a_fetch_response_is_the_stored_group_plus_the_fields_the_coordinator_fills():
    spec = TaskSpec(task_id="t00", prompt_ids=[7, -1, 1 << 30], split=Split.EVAL, metadata_json='{"answer": 4}')
    data = wire_group(GROUPS[0])
    _, wg = framing.read_group("g", data, 0, len(data), node="w1")
    groups = []
    for g in (wg, GROUPS[1]):  # a received group, and a decoded one (read from an old shard)
        parts, n = framing.group_parts(5, g)
        served = served_fields_pb("w1", spec)
        groups.append(([*parts, served], n + len(served)))
    msg = spb.FetchShardResponse.FromString(framing.fetch_response(groups, 2, 12))
    assert (msg.total_groups, msg.total_tokens, len(msg.groups)) == (2, 12, 2)
    for pb, g in zip(msg.groups, (GROUPS[0], GROUPS[1])):
        assert (pb.node, list(pb.prompt_ids), pb.split, pb.metadata_json) == ("w1", [7, -1, 1 << 30], spb.SPLIT_EVAL, '{"answer": 4}')
        assert pb.iteration == 5 and pb.task_id == g.task_id and pb.policy_version == g.policy_version
        assert group_from_pb("g", pb)[1].samples == group_from_pb("g", result_to_pb(5, g))[1].samples
    assert spb.FetchShardResponse.FromString(framing.fetch_response([], 0, 0)) == spb.FetchShardResponse()


def test_varints_match_the_protobuf_encoding():
    for n in (0, 1, 127, 128, 300, 1 << 32, (1 << 64) - 1, -1, -(1 << 63)):
        expected = spb.TrajectoryGroup(policy_version=n).SerializeToString()[1:] if -(1 << 63) <= n < (1 << 63) else None
        if expected is not None and n != 0:
            assert framing.varint(n) == expected, n
    assert framing.varint(0) == b"\x00"
