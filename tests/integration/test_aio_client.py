"""AsyncCoordinatorClient against a real coordinator subprocess: barrier, KV, fencing, restart."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.coordinator.state import Outcome
from elasticrl.errors import FencedError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.waits]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_two_members_pass_a_barrier_and_share_kv(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            a = await client.join("run-aio", "a")
            b = await client.join("run-aio", "b")
            assert b.incarnation > a.incarnation
            results = await asyncio.gather(
                client.arrive("run-aio", "a", a.incarnation, "step-1", timeout_s=10),
                client.arrive("run-aio", "b", b.incarnation, "step-1", timeout_s=10),
            )
            for result in results:
                assert result.outcome is Outcome.COMPLETED
                assert sorted(result.arrived) == ["a", "b"]
            assert await client.keep_alive("run-aio", "a", a.incarnation) >= b.epoch

            await client.kv_set("run-aio", {b"k": b"v"})
            assert await client.kv_get("run-aio", [b"k", b"missing"]) == [b"v", None]
            assert await client.kv_add("run-aio", b"n", 2) == 2
            assert await client.kv_add("run-aio", b"n", 3) == 5
            assert await client.kv_wait("run-aio", [b"k"], timeout_s=1) == [b"v"]

            await client.leave("run-aio", "b", b.incarnation)
            await client.leave("run-aio", "a", a.incarnation)

    _run(scenario())


def test_stale_incarnation_is_fenced(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
            old = await client.join("run-fence", "node-0")
            new = await client.join("run-fence", "node-0")  # a restarted process replaces the old one
            assert new.incarnation > old.incarnation
            with pytest.raises(FencedError, match="stale"):
                await client.keep_alive("run-fence", "node-0", old.incarnation)
            with pytest.raises(FencedError):
                await client.arrive("run-fence", "node-0", old.incarnation, "b", timeout_s=1)
            await client.keep_alive("run-fence", "node-0", new.incarnation)

    _run(scenario())


def test_call_retries_while_the_coordinator_restarts(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=15) as client:
            member = await client.join("run-restart", "node-0", lease_ttl_s=5)
            coordinator.kill()
            restart = threading.Timer(0.5, coordinator.start)  # same port, same state dir
            restart.start()
            try:
                started = time.monotonic()
                await client.keep_alive("run-restart", "node-0", member.incarnation)  # UNAVAILABLE, then retried
                assert 0.4 < time.monotonic() - started < 15  # it did wait for the restart, within budget
            finally:
                restart.join()

    _run(scenario())
