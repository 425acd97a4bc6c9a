"""The node relay (``coordinator/session_relay.py``): members' sessions ride one stream to a real
coordinator, a member killed behind a live relay is still evicted by its broken connection within
the stream grace, a coordinator restart is survived, and a member whose relay is gone streams
directly."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import wire
from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.coordinator.session_relay import ENV, FOR_ENV, RelayCall, RelayThread
from tests.conftest import REPO, wait_until
from tests.integration.prometheus import value
from tests.integration.test_coordinator import members  # noqa: F401 - a fixture
from tests.integration.test_metrics import scrape, with_metrics
from tests.integration.test_stream_liveness import member_state

pytestmark = [pytest.mark.integration, pytest.mark.waits]


def released(m, name: str, timeout_s: float) -> dict:
    """Member process ``m``'s release from barrier ``name``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for e in m.seen:
            if e["event"] == "released" and e["name"] == name:
                return e
        left = deadline - time.monotonic()
        assert left > 0, f"no release from {name!r} within {timeout_s}s; saw {m.seen}"
        try:
            m.seen.append(m.events.get(timeout=left))
        except queue.Empty:
            pass


@pytest.fixture
def relay_process(tmp_path):
    """``elasticrl session-relay`` subprocesses; every one is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(address: str) -> str:
        path = str(tmp_path / f"relay{len(started)}.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "elasticrl", "session-relay", "--coordinator", address, "--socket", path],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=open(tmp_path / f"relay{len(started)}.log", "ab"),
        )
        started.append(proc)
        wait_until(lambda: os.path.exists(path) or proc.poll() is not None, 20, message="the relay's socket")
        assert proc.poll() is None, (tmp_path / f"relay{len(started) - 1}.log").read_text()
        return path

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(90)
def test_members_behind_a_relay_share_one_stream_and_a_killed_one_is_evicted_by_its_connection(
        coordinator_factory, tmp_path, relay_process, members, monkeypatch):  # noqa: F811
    # A 30 s lease cannot explain an eviction within 10 s: the relay's detach did it.
    coord, port = with_metrics(coordinator_factory, tmp_path, lease_ttl_s=30.0)
    monkeypatch.setenv(ENV, relay_process(coord.address))
    survivors = [members(coord.address, "r", n, "--wait-members", "3", "--barrier", "one", "--barrier", "two") for n in "ab"]
    victim = members(coord.address, "r", "c", "--wait-members", "3", "--barrier", "one")
    for m in [*survivors, victim]:
        assert released(m, "one", 30)["arrived"] == ["a", "b", "c"]
    samples = scrape(port)
    assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Session") == 1
    assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Arrive") == 0

    victim.kill(signal.SIGKILL)  # the relay lives on: only this member's connection to it breaks
    killed = time.monotonic()
    for m in survivors:  # barrier "two" waited for c; it completes without it
        assert released(m, "two", 15)["evicted"] == ["c"]
    assert time.monotonic() - killed < 10
    with CoordinatorClient(coord.address, call_timeout_s=5) as client:
        assert "stream broke" in member_state(client, "r", "c")["reason"]
        assert member_state(client, "r", "a")["state"] == "MEMBER_STATE_LIVE"


@pytest.mark.timeout(90)
def test_a_relay_carries_its_members_across_a_coordinator_restart(coordinator_factory):
    coord = coordinator_factory(lease_ttl_s=3.0)
    relay = RelayThread(coord.address)
    try:
        with CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=30) as client:
            ms = [Membership(client, "k", name, relay=relay.path) for name in ("a", "b", "c")]
            wait_until(lambda: all(m.streaming.is_set() for m in ms), 10, message="the members' streams")
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                assert all(r.arrived == ["a", "b", "c"] for r in pool.map(lambda m: m.arrive("before", timeout_s=20), ms))
                coord.kill()
                coord.start()
                results = list(pool.map(lambda m: m.arrive("after", timeout_s=30), ms))
            assert all(r.arrived == ["a", "b", "c"] and not r.evicted for r in results), results
            # The members stream through the relay again, which opened a second stream.
            wait_until(lambda: relay.streams_opened >= 2, 10, message="the relay's second stream")
            for m in ms:
                m.leave()
            states = {n: member_state(client, "k", n)["state"] for n in ("a", "b", "c")}
            assert set(states.values()) == {"MEMBER_STATE_LEFT"}, states  # a clean leave, not a broken stream
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_a_member_whose_relay_is_gone_streams_to_the_coordinator(coordinator_factory, tmp_path):
    coord = coordinator_factory(lease_ttl_s=30.0)
    with CoordinatorClient(coord.address, call_timeout_s=5) as client:
        m = Membership(client, "g", "a", relay=str(tmp_path / "no-relay.sock"))
        assert m.streaming.wait(10), "no keep-alive went through a direct stream"
        assert m.arrive("solo", timeout_s=10).arrived == ["a"]
        m.leave()


@pytest.mark.timeout(60)
def test_detach_ends_one_members_session_on_a_shared_stream(coordinator_factory):
    coord = coordinator_factory(lease_ttl_s=30.0)
    with CoordinatorClient(coord.address, call_timeout_s=5) as client:
        joined = {name: client.join("d", name) for name in ("kept", "gone", "quit")}
        channel = wire.open_channel(coord.address, None, aio=False)
        outbox: list[pb.SessionRequest] = [
            pb.SessionRequest(id=i, keep_alive=pb.KeepAliveRequest(run_id="d", member=wire.member_ref(n, j.incarnation)))
            for i, (n, j) in enumerate(joined.items(), 1)
        ]
        outbox += [
            pb.SessionRequest(id=10, detach=pb.SessionDetach(run_id="d", member=wire.member_ref("gone", joined["gone"].incarnation), broken=True)),
            pb.SessionRequest(id=11, detach=pb.SessionDetach(run_id="d", member=wire.member_ref("quit", joined["quit"].incarnation))),
            pb.SessionRequest(id=12, detach=pb.SessionDetach(run_id="", member=wire.member_ref("kept", 1))),
        ]
        done = threading.Event()

        def requests():
            yield from outbox
            done.wait(30)  # the stream stays open: only the detaches end sessions

        call = pb_grpc.CoordinatorStub(channel).Session(requests())
        responses = {}
        for resp in call:
            responses[resp.id] = resp
            if len(responses) == 4:
                break
        assert set(responses) == {1, 2, 3, 12} and responses[12].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "detach.run_id" in responses[12].error.message
        wait_until(lambda: member_state(client, "d", "gone")["state"] == "MEMBER_STATE_EVICTED", 10, message="gone's eviction")
        time.sleep(1.0)  # twice the stream grace: "quit" detached cleanly, "kept" still streams
        assert member_state(client, "d", "kept")["state"] == "MEMBER_STATE_LIVE"
        assert member_state(client, "d", "quit")["state"] == "MEMBER_STATE_LIVE"
        done.set()
        call.cancel()
        channel.close()


@pytest.mark.timeout(60)
def test_a_member_on_two_relay_connections_is_detached_when_the_last_one_ends(coordinator_factory):
    coord = coordinator_factory(lease_ttl_s=30.0)
    relay = RelayThread(coord.address)
    try:
        with CoordinatorClient(coord.address, call_timeout_s=5) as client:
            joined = client.join("t", "m")
            keep_alive = pb.KeepAliveRequest(run_id="t", member=wire.member_ref("m", joined.incarnation))
            ends = [threading.Event(), threading.Event()]

            def requests(end: threading.Event):
                yield pb.SessionRequest(id=1, keep_alive=keep_alive)
                end.wait(30)  # then the iterator ends: a half-close without ``close``, as a crash reads

            calls = [RelayCall(relay.path, requests(end)) for end in ends]
            answers = [iter(call) for call in calls]  # (an iterator dropped closes its connection)
            for answer in answers:  # each connection's keep-alive answered through the relay, with its own id
                assert next(answer).id == 1
            calls[0].cancel()  # the old connection of a member that reconnected ends
            time.sleep(1.0)  # twice the stream grace
            assert member_state(client, "t", "m")["state"] == "MEMBER_STATE_LIVE"
            calls[1].cancel()  # the last one: now its session is over
            wait_until(lambda: member_state(client, "t", "m")["state"] == "MEMBER_STATE_EVICTED", 10, message="m's eviction")
            for end in ends:
                end.set()
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_a_torchrun_agent_runs_a_relay_for_its_workers_unless_told_not_to(coordinator_factory, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elasticrl.rendezvous.handler import ElasticRLRendezvousHandler

    coord = coordinator_factory(lease_ttl_s=30.0)
    monkeypatch.delenv(ENV, raising=False)
    handler = ElasticRLRendezvousHandler.from_params(RendezvousParameters("elasticrl", coord.address, "ag", 1, 1))
    try:
        assert os.environ[FOR_ENV] == coord.address
        with CoordinatorClient(coord.address, call_timeout_s=5) as client:
            worker = Membership(client, "ag", "rank0")  # as -m elasticrl.node's, from the inherited environment
            assert worker.streaming.wait(10)
            assert handler._relay.path == os.environ[ENV] and handler._relay.streams_opened == 1
            worker.leave()
            other = Membership(CoordinatorClient(f"localhost:{coord.port}", call_timeout_s=5), "ag", "x")
            assert other._stream.relay is None  # the relay serves 127.0.0.1:PORT, not this address
            other.leave()
            other.client.close()
    finally:
        handler.shutdown()
    assert not os.path.exists(handler._relay.path) and ENV not in os.environ  # gone with the agent
    off = ElasticRLRendezvousHandler.from_params(RendezvousParameters("elasticrl", coord.address, "ag", 1, 1, session_relay="false"))
    assert off._relay is None and ENV not in os.environ
    off.shutdown()


@pytest.mark.timeout(60)
def test_a_relay_under_a_long_tmpdir_puts_its_socket_where_a_socket_fits(coordinator_factory, tmp_path, monkeypatch):
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))  # as $TMPDIR would
    coord = coordinator_factory(lease_ttl_s=30.0)
    relay = RelayThread(coord.address)
    try:
        assert len(os.fsencode(relay.path)) < 108 and not relay.path.startswith(str(deep))
        with CoordinatorClient(coord.address, call_timeout_s=5) as client:
            m = Membership(client, "long", "a", relay=relay.path)
            assert m.streaming.wait(10) and relay.streams_opened == 1
            m.leave()
    finally:
        relay.stop()
