"""Dead processes are noticed at once (issue 14, item 3): a member renews its lease over a Session
stream, so when its process is SIGKILLed the kernel closes the socket and the coordinator evicts
it after the stream grace, not a lease TTL later. A paused process (SIGSTOP: its sockets stay
open, like a silent host) is left to its lease, and a connection reset that reconnects within
the grace evicts nobody."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import wire
from elasticrl.coordinator.client import CoordinatorClient, Membership

from tests.conftest import wait_until
from tests.tcp_proxy import TcpProxy
from tests.integration.test_coordinator import members  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.waits]


def member_state(client: CoordinatorClient, run: str, member: str) -> dict:
    status = client.status(run, include_departed=True)
    (r,) = status["runs"]
    everyone = r["snapshot"]["members"] + r["departed"]
    return next(m for m in everyone if m["member_id"] == member)


@pytest.mark.timeout(60)
def test_a_sigkilled_member_is_evicted_by_its_broken_stream_long_before_its_lease(coordinator_factory, members):  # noqa: F811
    coordinator = coordinator_factory(lease_ttl_s=30.0)
    with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
        m = members(coordinator.address, "live", "victim")
        m.wait_event("streaming", 30)  # killed before its first keep-alive, only its lease would tell
        m.kill(signal.SIGKILL)
        killed = time.monotonic()
        # A 30 s lease cannot explain an eviction within 10 s: the broken stream did it.
        wait_until(lambda: member_state(client, "live", "victim")["state"] == "MEMBER_STATE_EVICTED", 10,
                   message="the SIGKILLed member's eviction")
        assert time.monotonic() - killed < 10
        assert "stream broke" in member_state(client, "live", "victim")["reason"]


@pytest.mark.timeout(60)
def test_a_paused_member_keeps_its_stream_and_is_left_to_its_lease(coordinator_factory, members):  # noqa: F811
    coordinator = coordinator_factory(lease_ttl_s=2.0)
    with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
        m = members(coordinator.address, "pause", "sleeper")
        m.wait_event("streaming", 30)
        m.kill(signal.SIGSTOP)
        try:
            time.sleep(1.0)  # past the 0.5 s grace, within the 2 s lease: its socket is still open
            assert member_state(client, "pause", "sleeper")["state"] == "MEMBER_STATE_LIVE"
            wait_until(lambda: member_state(client, "pause", "sleeper")["state"] == "MEMBER_STATE_EVICTED", 10)
            assert "lease expired" in member_state(client, "pause", "sleeper")["reason"]
        finally:
            m.kill(signal.SIGCONT)
            m.kill(signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_connection_reset_that_reconnects_within_the_grace_evicts_nobody(coordinator_factory):
    coordinator = coordinator_factory(lease_ttl_s=30.0)
    proxy = TcpProxy(("127.0.0.1", coordinator.port))
    try:
        with CoordinatorClient(f"127.0.0.1:{proxy.port}", call_timeout_s=5) as via_proxy, \
                CoordinatorClient(coordinator.address, call_timeout_s=5) as direct:
            m = Membership(via_proxy, "blip", "steady", lease_ttl_s=3.0)  # a keep-alive per second
            try:
                assert m.streaming.wait(30)
                for _ in range(3):
                    assert proxy.reset_all() > 0
                    time.sleep(1.5)  # past the grace: an unreopened stream would have been evicted
                    state = member_state(direct, "blip", "steady")
                    assert state["state"] == "MEMBER_STATE_LIVE", state
                assert int(state["incarnation"]) == m.incarnation and m.fenced is None
            finally:
                m.leave("done")
        log = coordinator.log()
        assert "stream broke" not in log
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_a_stream_ended_without_its_close_message_counts_as_broken_and_one_with_it_does_not(coordinator_factory):
    """A killed client's reset often reaches the server as a plain end of the requests (a
    half-close) before grpc cancels the handler, so only an explicit ``close`` tells a stream
    ended on purpose. Without it the member goes within the grace; with it, only at its lease."""
    coordinator = coordinator_factory(lease_ttl_s=30.0)
    with CoordinatorClient(coordinator.address, call_timeout_s=5) as client:
        for member, say_close in (("quiet", False), ("polite", True)):
            joined = client.join("ends", member)
            ka = pb.KeepAliveRequest(run_id="ends", member=wire.member_ref(member, joined.incarnation))
            requests = [pb.SessionRequest(id=1, keep_alive=ka)]
            if say_close:
                requests.append(pb.SessionRequest(id=2, close=pb.SessionClose()))
            answers = list(client._stub.Session(iter(requests), timeout=10))  # then a half-close
            assert [a.id for a in answers] == [1] and not answers[0].HasField("error")
        time.sleep(1.5)  # past the 0.5 s grace, well within the 30 s lease
        assert member_state(client, "ends", "quiet")["state"] == "MEMBER_STATE_EVICTED"
        assert "stream broke" in member_state(client, "ends", "quiet")["reason"]
        assert member_state(client, "ends", "polite")["state"] == "MEMBER_STATE_LIVE"


@pytest.mark.timeout(90)
def test_a_member_that_leaves_while_its_arrival_waits_is_not_held_by_its_stream(coordinator):
    """The coordinator ends a closed stream only once the arrivals waiting on it are answered, and
    a leaving member's may wait for a barrier the others have not reached: ``leave`` used to block
    for the client's call timeout (here 30 s), its renewal thread left running."""
    from elasticrl.errors import FencedError

    with CoordinatorClient(coordinator.address, call_timeout_s=30) as ca, \
            CoordinatorClient(coordinator.address, call_timeout_s=30) as cb:
        a = Membership(ca, "leaving", "a", lease_ttl_s=30.0)
        b = Membership(cb, "leaving", "b", lease_ttl_s=30.0)
        try:
            assert a.streaming.wait(30) and b.streaming.wait(30)
            outcome: list = []

            def arrive() -> None:
                try:
                    outcome.append(a.arrive("x", timeout_s=60))
                except Exception as exc:  # noqa: BLE001 - checked below
                    outcome.append(exc)

            waiter = threading.Thread(target=arrive, daemon=True)
            waiter.start()
            wait_until(lambda: any(bar["name"] == "x" and "a" in bar.get("arrived", [])
                                   for bar in ca.status("leaving")["runs"][0].get("open_barriers", [])), 15,
                       message="a's arrival at x")
            started = time.monotonic()
            a.leave("done")
            assert time.monotonic() - started < 10, "leave() waited for the stream"
            assert not a._thread.is_alive()
            assert member_state(cb, "leaving", "a")["state"] == "MEMBER_STATE_LEFT"  # left, not evicted as a crash
            assert b.arrive("x", timeout_s=60).arrived == ["b"]
            waiter.join(30)
            assert len(outcome) == 1 and isinstance(outcome[0], FencedError), outcome
        finally:
            b.leave("done")
