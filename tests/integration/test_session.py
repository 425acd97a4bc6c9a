"""Session streams (``AsyncCoordinatorClient.session``) against a real coordinator subprocess:
barrier, per-operation errors on a live stream, token, and reconnection across a SIGKILL."""

from __future__ import annotations

import asyncio
import time

import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.coordinator.state import Outcome
from elasticrl.errors import AuthError, CoordinatorUnavailableError, FencedError, InvalidRequestError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.waits]


def _run(coro, timeout_s: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_three_members_pass_a_barrier_over_sessions(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            joined = [await client.join("run-s", f"m{i}") for i in range(3)]
            sessions = [client.session("run-s", j.member_id, j.incarnation) for j in joined]
            try:
                epochs = await asyncio.gather(*(s.keep_alive() for s in sessions))
                assert epochs == [3, 3, 3]
                for step in range(2):  # a second barrier on the same streams
                    results = await asyncio.gather(*(s.arrive(f"step-{step}", timeout_s=10) for s in sessions))
                    for result in results:
                        assert result.outcome is Outcome.COMPLETED
                        assert sorted(result.arrived) == ["m0", "m1", "m2"]
                # arrivals are idempotent: a decided barrier answers again at once
                again = await sessions[0].arrive("step-0", timeout_s=10)
                assert sorted(again.arrived) == ["m0", "m1", "m2"]
            finally:
                for s in sessions:
                    await s.close()

    _run(scenario())


def test_fenced_and_invalid_operations_fail_alone_and_the_stream_goes_on(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            old = await client.join("run-f", "node-0")
            new = await client.join("run-f", "node-0")  # a restarted process replaces the old one
            async with client.session("run-f", "node-0", old.incarnation) as stale, \
                    client.session("run-f", "node-0", new.incarnation) as live:
                with pytest.raises(FencedError, match="stale"):
                    await stale.arrive("b", timeout_s=1)
                with pytest.raises(FencedError):
                    await stale.keep_alive()
                # the fenced session's stream is still usable: it carries the next errors too
                with pytest.raises(InvalidRequestError, match="name"):
                    await stale.arrive("", timeout_s=1)
                with pytest.raises(InvalidRequestError, match="name"):
                    await live.arrive("", timeout_s=1)
                # fields the client never sends wrong, on the raw stream: same messages as unary
                ref = pb.MemberRef(member_id="node-0", incarnation=new.incarnation)
                for bad, field in [
                    (pb.ArriveRequest(run_id="run-f", member=ref, name="x", timeout_ms=-5), "timeout_ms"),
                    (pb.ArriveRequest(run_id="run-f", member=ref, name="x", wait_ms=10**12), "wait_ms"),
                    (pb.ArriveRequest(run_id="run-f", member=ref, name="x", policy=7), "policy"),
                    (pb.ArriveRequest(run_id="run-f", member=pb.MemberRef(member_id="node-0"), name="x"), "member.incarnation"),
                ]:
                    with pytest.raises(InvalidRequestError, match=field):
                        await live._op(pb.SessionRequest(arrive=bad), 5)
                with pytest.raises(InvalidRequestError, match="member.member_id"):
                    await live._op(pb.SessionRequest(keep_alive=pb.KeepAliveRequest(run_id="run-f", member=pb.MemberRef(incarnation=1))), 5)
                with pytest.raises(InvalidRequestError, match="op: must be set"):
                    await live._op(pb.SessionRequest(), 5)
                # ... and the live member's operations on its stream still succeed
                assert await live.keep_alive() == new.epoch
                result = await live.arrive("solo", timeout_s=5)
                assert result.arrived == ["node-0"]

    _run(scenario())


def test_session_requires_the_token(coordinator_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    coord = coordinator_factory(extra_args=["--token-file", str(token_file)])

    async def scenario():
        async with AsyncCoordinatorClient(coord.address, token="s3cret-token", call_timeout_s=5) as good:
            member = await good.join("run-t", "a")
            async with good.session("run-t", "a", member.incarnation) as session:
                assert await session.keep_alive() == member.epoch
        for token in (None, "wrong"):
            async with AsyncCoordinatorClient(coord.address, token=token, call_timeout_s=5, reconnect_timeout_s=2) as bad:
                async with bad.session("run-t", "a", member.incarnation) as session:
                    with pytest.raises(AuthError, match="token"):
                        await session.keep_alive()
                    with pytest.raises(AuthError):
                        await session.arrive("b", timeout_s=1)

    _run(scenario())


def test_sessions_reconnect_after_coordinator_restart_and_the_barrier_completes(coordinator_factory):
    coord = coordinator_factory(lease_ttl_s=3.0)

    async def scenario():
        async with AsyncCoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=15) as client:
            joined = [await client.join("run-r", f"m{i}") for i in range(3)]
            sessions = [client.session("run-r", j.member_id, j.incarnation) for j in joined]
            try:
                await asyncio.gather(*(s.keep_alive() for s in sessions))
                first = [asyncio.create_task(s.arrive("b", timeout_s=30)) for s in sessions[:2]]
                await asyncio.sleep(0.3)  # both parked on the coordinator
                assert not any(t.done() for t in first)
                coord.kill()
                await asyncio.sleep(0.5)
                await asyncio.to_thread(coord.start)  # same port, same state dir
                started = time.monotonic()
                last = await sessions[2].arrive("b", timeout_s=30)
                results = [last, *await asyncio.gather(*first)]
                for result in results:
                    assert result.outcome is Outcome.COMPLETED
                    assert sorted(result.arrived) == ["m0", "m1", "m2"]
                assert time.monotonic() - started < 10
                # the reopened streams carry later operations too
                assert len(set(await asyncio.gather(*(s.keep_alive() for s in sessions)))) == 1
            finally:
                for s in sessions:
                    await s.close()

    _run(scenario(), timeout_s=45)


def test_session_gives_up_after_the_reconnect_budget(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=1.0) as client:
            member = await client.join("run-gone", "a")
            await client.join("run-gone", "b")  # never arrives: the barrier stays open
            async with client.session("run-gone", "a", member.incarnation) as session:
                await session.keep_alive()
                pending = asyncio.create_task(session.arrive("never", timeout_s=30))
                await asyncio.sleep(0.2)
                coordinator.kill()  # and it stays down
                started = time.monotonic()
                with pytest.raises(CoordinatorUnavailableError, match=coordinator.address):
                    await pending
                assert 0.9 < time.monotonic() - started < 3.0  # the budget, not the barrier timeout
                # a later operation makes a fresh attempt, bounded by the same budget
                started = time.monotonic()
                with pytest.raises(CoordinatorUnavailableError, match=coordinator.address):
                    await session.keep_alive()
                assert time.monotonic() - started < 3.0

    _run(scenario())
