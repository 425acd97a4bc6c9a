"""The client's request coalescing (``aio_session.batched_requests``) and the server's response
batch encoding (``session.response_batch``), without a coordinator."""

from __future__ import annotations

import asyncio

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import session
from elasticrl.coordinator.session import Release
from elasticrl.coordinator.aio_session import batched_requests


def _ka(i: int) -> pb.SessionRequest:
    return pb.SessionRequest(id=i, keep_alive=pb.KeepAliveRequest(run_id="r"))


def _drain(items) -> list[pb.SessionRequest]:
    async def go():
        outbox: asyncio.Queue = asyncio.Queue()
        for item in items:
            outbox.put_nowait(item)
        return [r async for r in batched_requests(outbox)]

    return asyncio.run(asyncio.wait_for(go(), 5))


def test_a_lone_request_goes_as_itself_and_queued_ones_as_one_batch_never_with_close():
    close = pb.SessionRequest(id=9, close=pb.SessionClose())
    sent = _drain([_ka(1), None])
    assert sent == [_ka(1)]
    sent = _drain([_ka(1), _ka(2), _ka(3), close, None])
    assert [r.WhichOneof("op") for r in sent] == ["batch", "close"]
    assert [op.id for op in sent[0].batch.ops] == [1, 2, 3]


def test_a_response_batch_sends_a_shared_decided_response_once_for_all_its_ids():
    decided = pb.SessionResponse(arrive=pb.ArriveResponse(arrived=["a", "b"], epoch=4)).SerializeToString()
    out: asyncio.Queue = asyncio.Queue()
    for item in [Release([2], decided), pb.SessionResponse(id=3, keep_alive=pb.KeepAliveResponse(epoch=4)), Release([5, 6], decided), None]:
        out.put_nowait(item)
    data, held = session.response_batch(Release([1], decided), out)
    assert held is None  # the end of the stream: handled after the batch
    message = pb.SessionResponse.FromString(data)
    assert message.WhichOneof("result") == "batch"
    assert [r.id for r in message.batch.results] == [3]
    (group,) = message.batch.shared
    assert list(group.ids) == [1, 2, 5, 6] and list(group.response.arrive.arrived) == ["a", "b"]
    # a lone response is not wrapped in a batch
    empty: asyncio.Queue = asyncio.Queue()
    lone = Release([7], decided)
    assert session.response_batch(lone, empty) == (lone, session._NOTHING)
    # one release of many ids is, even alone: one message for every member it answers
    data, held = session.response_batch(Release([8, 9, 300], decided), empty)
    (group,) = pb.SessionResponse.FromString(data).batch.shared
    assert list(group.ids) == [8, 9, 300] and held is session._NOTHING
