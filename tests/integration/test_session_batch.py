"""Batched Session streams (``AsyncSession.member``, ``SessionBatch``) against a real coordinator
subprocess: many members on one stream pass a barrier, keep their leases, get per-operation errors,
and are all evicted at once when the process holding the stream is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import wire
from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.coordinator.client import CoordinatorClient
from elasticrl.coordinator.state import Outcome
from elasticrl.errors import FencedError

from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.waits]


def _run(coro, timeout_s: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _states(client: CoordinatorClient, run: str) -> dict[str, dict]:
    (r,) = client.status(run, include_departed=True)["runs"]
    return {m["member_id"]: m for m in r["snapshot"]["members"] + r["departed"]}


def test_many_members_on_one_session_pass_barriers_together(coordinator):
    n = 40

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            joined = [await client.join("run-b", f"m{i:02d}") for i in range(n)]
            session = client.session("run-b", joined[0].member_id, joined[0].incarnation)
            members = [session.member(j.member_id, j.incarnation) for j in joined]
            try:
                epochs = await asyncio.gather(*(m.keep_alive() for m in members))
                assert set(epochs) == {n}
                for step in range(3):  # several barriers on the same stream
                    results = await asyncio.gather(*(m.arrive(f"step-{step}", timeout_s=10) for m in members))
                    for result in results:
                        assert result.outcome is Outcome.COMPLETED
                        assert result.arrived == [f"m{i:02d}" for i in range(n)]
                        assert result.evicted == [] and result.epoch == n
                    # each member has lists of its own, though their decoding is shared
                    assert results[0].arrived is not results[1].arrived
                # the session's own member is one of them: its own calls ride the same stream
                again = await session.arrive("step-0", timeout_s=10)
                assert len(again.arrived) == n
            finally:
                await session.close()

    _run(scenario())


def test_a_bad_operation_in_a_batch_fails_alone(coordinator):
    """Raw frames: a batch holding a keep-alive of a live member, one of an unknown member, a
    nested batch, a close and an empty op: each gets its own answer, and the stream goes on."""
    with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
        joined = client.join("run-e", "good")
        ka = pb.KeepAliveRequest(run_id="run-e", member=wire.member_ref("good", joined.incarnation))
        ghost = pb.KeepAliveRequest(run_id="run-e", member=wire.member_ref("ghost", 1))
        batch = pb.SessionBatch(ops=[
            pb.SessionRequest(id=1, keep_alive=ka),
            pb.SessionRequest(id=2, keep_alive=ghost),
            pb.SessionRequest(id=3, batch=pb.SessionBatch(ops=[pb.SessionRequest(id=9, keep_alive=ka)])),
            pb.SessionRequest(id=4, close=pb.SessionClose()),
            pb.SessionRequest(id=5),
            pb.SessionRequest(id=6, keep_alive=ka),
        ])
        requests = [pb.SessionRequest(batch=batch), pb.SessionRequest(id=7, keep_alive=ka),
                    pb.SessionRequest(id=8, close=pb.SessionClose())]
        answers: dict[int, pb.SessionResponse] = {}
        for message in client._stub.Session(iter(requests), timeout=10):
            if message.WhichOneof("result") == "batch":
                for one in message.batch.results:
                    assert one.WhichOneof("result") != "batch"
                    answers[one.id] = one
            else:
                answers[message.id] = message
        assert sorted(answers) == [1, 2, 3, 4, 5, 6, 7]  # the nested op 9 never ran
        for ok in (1, 6, 7):
            assert answers[ok].WhichOneof("result") == "keep_alive", answers[ok]
        assert answers[2].error.error_class == "NotFoundError"  # an unknown member
        for bad in (3, 4, 5):
            assert answers[bad].error.code == 3, answers[bad]  # INVALID_ARGUMENT
            assert "batch" in answers[bad].error.message
        # the inner close did not count as the stream's close: only the last one did
        assert _states(client, "run-e")["good"]["state"] == "MEMBER_STATE_LIVE"


def test_keep_alives_of_many_members_on_one_stream_keep_them_all_live(coordinator_factory):
    coordinator = coordinator_factory(lease_ttl_s=1.0)
    n = 30

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            joined = [await client.join("run-k", f"k{i:02d}", lease_ttl_s=1.0) for i in range(n)]
            session = client.session("run-k", joined[0].member_id, joined[0].incarnation)
            members = [session.member(j.member_id, j.incarnation) for j in joined]
            try:
                deadline = time.monotonic() + 3.0  # three lease TTLs
                while time.monotonic() < deadline:
                    await asyncio.gather(*(m.keep_alive() for m in members))
                    await asyncio.sleep(0.25)
                # a stale incarnation on the shared stream is fenced alone
                with pytest.raises(FencedError):
                    await session.member("k00", joined[0].incarnation + 7).keep_alive()
                await asyncio.gather(*(m.keep_alive() for m in members))
            finally:
                await session.close()

    _run(scenario())
    with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
        states = _states(client, "run-k")
        assert all(states[f"k{i:02d}"]["state"] == "MEMBER_STATE_LIVE" for i in range(n)), states


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from elasticrl.coordinator.aio_client import AsyncCoordinatorClient

    async def main(address, n):
        client = AsyncCoordinatorClient(address, call_timeout_s=5, reconnect_timeout_s=5)
        joined = [await client.join("run-x", f"x{i:02d}", lease_ttl_s=30.0) for i in range(n)]
        session = client.session("run-x", joined[0].member_id, joined[0].incarnation)
        members = [session.member(j.member_id, j.incarnation) for j in joined]
        await asyncio.gather(*(m.keep_alive() for m in members))
        print("streaming", flush=True)
        await asyncio.sleep(120)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def test_a_sigkilled_process_holding_a_shared_stream_gets_all_its_members_evicted(coordinator_factory):
    coordinator = coordinator_factory(lease_ttl_s=30.0)
    n = 16
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, coordinator.address, str(n)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "streaming"
        with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
            assert all(m["state"] == "MEMBER_STATE_LIVE" for m in _states(client, "run-x").values())
            holder.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            # 30 s leases cannot explain evictions within 10 s: the broken stream did it.
            wait_until(lambda: all(m["state"] == "MEMBER_STATE_EVICTED" for m in _states(client, "run-x").values()),
                       10, message="every member of the SIGKILLed process evicted")
            assert time.monotonic() - killed < 10
            states = _states(client, "run-x")
            assert len(states) == n and all("stream broke" in m["reason"] for m in states.values())
    finally:
        holder.kill()
        holder.wait(10)


def test_a_shared_session_resends_its_members_pending_arrivals_after_a_coordinator_restart(coordinator_factory):
    coord = coordinator_factory(lease_ttl_s=5.0)
    n = 12

    async def scenario():
        async with AsyncCoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=15) as client:
            joined = [await client.join("run-r", f"r{i:02d}") for i in range(n)]
            session = client.session("run-r", joined[0].member_id, joined[0].incarnation)
            members = [session.member(j.member_id, j.incarnation) for j in joined]
            try:
                await asyncio.gather(*(m.keep_alive() for m in members))
                parked = [asyncio.create_task(m.arrive("b", timeout_s=30)) for m in members[:-1]]
                await asyncio.sleep(0.3)  # parked on the coordinator, sent as one batch
                assert not any(t.done() for t in parked)
                coord.kill()
                await asyncio.sleep(0.5)
                await asyncio.to_thread(coord.start)  # same port, same state dir
                started = time.monotonic()
                results = await asyncio.gather(members[-1].arrive("b", timeout_s=30), *parked)
                for result in results:
                    assert result.outcome is Outcome.COMPLETED
                    assert result.arrived == [f"r{i:02d}" for i in range(n)]
                assert time.monotonic() - started < 10
                assert len(set(await asyncio.gather(*(m.keep_alive() for m in members)))) == 1
            finally:
                await session.close()

    _run(scenario(), timeout_s=45)
