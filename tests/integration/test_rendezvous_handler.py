"""``ElasticRLRendezvousHandler`` in-process against a real coordinator (no torchrun): registration,
rounds, ``num_nodes_waiting`` after evictions and arrivals, fencing and rejoin, Leave vs close, and
the mapping of every failure onto torch's rendezvous exceptions."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
from torch.distributed.elastic.rendezvous import registry  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

import elasticrl.rendezvous as rdzv  # noqa: E402
from elasticrl.coordinator import policy  # noqa: E402
from elasticrl.coordinator.client import CoordinatorClient  # noqa: E402
from elasticrl.rendezvous.handler import ElasticRLRendezvousHandler  # noqa: E402
from tests.conftest import REPO, free_port, wait_until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.waits]
TTL_S = 1.0


def make_params(address: str, node: str, *, run: str = "rdzv", nnodes=(2, 3), **conf) -> RendezvousParameters:
    conf = {"last_call_timeout": 0.5, "lease_ttl": TTL_S, "join_timeout": 20, "connect_timeout": 5, "node_id": node, **conf}
    return RendezvousParameters("elasticrl", address, run, nnodes[0], nnodes[1], local_addr="127.0.0.1", **conf)


@pytest.fixture
def handlers(coordinator):
    made: list[ElasticRLRendezvousHandler] = []

    def make(node: str, **kwargs) -> ElasticRLRendezvousHandler:
        h = registry.get_rendezvous_handler(make_params(coordinator.address, node, **kwargs))
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


def rendezvous_all(*hs, timeout_s: float = 30):
    with concurrent.futures.ThreadPoolExecutor(len(hs)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in hs]
        return [f.result(timeout=timeout_s) for f in futures]


def test_entry_point_registers_the_backend(coordinator):
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "elasticrl"]
    assert ep.load()() is rdzv.create_handler
    h = registry.get_rendezvous_handler(make_params(coordinator.address, "n0"))
    assert isinstance(h, ElasticRLRendezvousHandler)
    assert h.get_backend() == "elasticrl" and h.get_run_id() == "rdzv"
    assert h.use_agent_store is False
    assert h.num_nodes_waiting() == 0  # nothing formed yet; no remote call
    h.shutdown()


def test_too_old_torch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(rdzv, "_torch_version", lambda: (2, 5))
    with pytest.raises(RuntimeError, match=r"torch >= 2\.6"):
        rdzv.handler_factory()


def test_bad_rdzv_conf_names_the_key(coordinator):
    with pytest.raises(ValueError, match="lease_ttl"):
        rdzv.create_handler(make_params(coordinator.address, "n0", lease_ttl="soon"))
    with pytest.raises(ValueError, match="rejoin_timeout"):
        rdzv.create_handler(make_params(coordinator.address, "n0", rejoin_timeout="-1"))
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        rdzv.create_handler(RendezvousParameters("elasticrl", "", "rdzv", 1, 2))


def test_round_ranks_bootstrap_and_store_prefix(handlers):
    a, b = handlers("a"), handlers("b")
    infos = rendezvous_all(a, b)
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    boots = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(boots) == 1 and next(iter(boots))[0] == "127.0.0.1"
    assert {i.store.prefix for i in infos} == {"torchrun/round-1/"}
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0


def test_eviction_is_reported_within_a_second_and_survivors_reform(handlers):
    a, b, c = handlers("a"), handlers("b"), handlers("c")
    first = dict(zip("abc", rendezvous_all(a, b, c)))
    # c goes silent (as if SIGKILLed): its lease lapses after TTL and the others must notice.
    c.member.stop()
    silent_at = time.monotonic()
    wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, TTL_S + 3, message="eviction seen")
    assert time.monotonic() - silent_at < TTL_S + 1.0
    second = dict(zip("ab", rendezvous_all(a, b)))
    assert {i.world_size for i in second.values()} == {2}
    for n in "ab":  # ranks that still fit are kept
        if first[n].rank < 2:
            assert second[n].rank == first[n].rank
    assert a.round == b.round == 2

    # The fenced node comes back as a new incarnation and is admitted at the next round.
    old_incarnation = c.member.incarnation
    wait_until(lambda: c.num_nodes_waiting() > 0, 5, message="c to see it was left out")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        c_future = pool.submit(c.next_rendezvous)
        wait_until(lambda: a.num_nodes_waiting() > 0, 10, message="newcomer seen")
        third = rendezvous_all(a, b) + [c_future.result(timeout=30)]
    assert c.member.incarnation != old_incarnation
    assert sorted(i.rank for i in third) == [0, 1, 2]


@pytest.mark.parametrize("armed", [False, True], ids=["workers-not-watching", "workers-watching"])
def test_in_place_leaves_a_lost_node_to_workers_that_watch_their_world(handlers, client, armed):
    """in_place=true: once the round's workers said they watch their world (the key rank 0 sets,
    ``rendezvous.worker.armed_key``), a lost node restarts nobody, a joining node still does, and
    exactly one survivor checks in at torchrun's exit barrier for the lost node. Before that (a node
    lost while the workers start), the agents restart their workers as without in_place."""
    from elasticrl.rendezvous.handler import EXIT_BARRIER
    from elasticrl.rendezvous.store import CoordinatorStore
    from elasticrl.rendezvous.worker import armed_key

    a, b, c = (handlers(n, in_place="true") for n in "abc")
    rendezvous_all(a, b, c)
    if armed:
        client.kv_set("rdzv", {armed_key(a.round): b"1"})
    c.member.stop()  # c goes silent
    if not armed:
        wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, TTL_S + 3, message="eviction seen")
        return
    store = CoordinatorStore(client, "rdzv", f"torchrun/round-{a.round}/", timeout_s=5)
    wait_until(lambda: store.check([EXIT_BARRIER + "/num_members"]), TTL_S + 3, message="a stand-in for c")
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    assert store.add(EXIT_BARRIER + "/num_members", 0) == 1  # once, by a or b
    assert store.get("elasticrl/exit-stand-in/c") in (b"a", b"b")
    # a and b finish: with c's stand-in their exit barrier completes
    assert store.add(EXIT_BARRIER + "/num_members", 1) == 2
    assert store.add(EXIT_BARRIER + "/num_members", 1) == 3
    d = handlers("d", in_place="true")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joining = pool.submit(d.next_rendezvous)
        wait_until(lambda: a.num_nodes_waiting() > 0, 10, message="the newcomer seen")  # c's place is room
        rendezvous_all(a, b)
        joining.result(timeout=30)


def _ask_to_stop(handler, monkeypatch, kind: str, *, at_once: bool) -> None:
    """What a failing worker of ``handler``'s node does (``elasticrl.node.stop_node``)."""
    from elasticrl.rendezvous.worker import STOP_FILE_ENV, request_stop

    monkeypatch.setenv(STOP_FILE_ENV, handler.stop_file)
    assert request_stop(kind, f"{handler.config.node_id}: {kind}: boom", at_once=at_once) == handler.stop_file


@pytest.mark.parametrize("armed", [False, True], ids=["restarting-workers", "in-place"])
def test_a_node_whose_worker_asks_to_stop_leaves_and_checks_in_at_the_exit_barrier(handlers, client, monkeypatch, armed):
    """A worker that failed in a way restarts do not fix asks its agent to stop: the agent's next
    rendezvous raises RendezvousClosedError with the worker's reason (torchrun then shuts the
    handler down: it leaves; the run stays open). In place, with the round armed, the others
    finish that round without it, so it checks in at the round's exit barrier for itself (a
    survivor's stand-in skips a node that left), once: else they would wait out torchrun's exit
    barrier timeout (300 s) for it."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from elasticrl.rendezvous.handler import EXIT_BARRIER
    from elasticrl.rendezvous.store import CoordinatorStore
    from elasticrl.rendezvous.worker import armed_key

    a, b, c = (handlers(n, in_place="true") for n in "abc")
    rendezvous_all(a, b, c)
    if armed:
        client.kv_set("rdzv", {armed_key(a.round): b"1"})
    _ask_to_stop(c, monkeypatch, "ConfigError", at_once=True)
    with pytest.raises(RendezvousClosedError, match=r"node c stops.*c: ConfigError: boom"):
        c.next_rendezvous()
    c.shutdown()
    store = CoordinatorStore(client, "rdzv", f"torchrun/round-{a.round}/", timeout_s=5)
    assert store.add(EXIT_BARRIER + "/num_members", 0) == (1 if armed else 0)
    time.sleep(TTL_S + 0.5)  # a and b see c leave: neither stands in for it again
    assert store.add(EXIT_BARRIER + "/num_members", 0) == (1 if armed else 0)
    assert store.check(["elasticrl/exit-stand-in/c"]) == armed
    run = client.status("rdzv", include_departed=True)["runs"][0]
    assert not run["snapshot"]["closed"]
    assert [m["state"] for m in run["departed"] if m["member_id"] == "c"] == ["MEMBER_STATE_LEFT"]


def test_a_failure_that_may_pass_is_restarted_once_and_stops_the_node_when_it_comes_back(handlers, monkeypatch):
    """A reward function or env that raised may have met a service that was down: the first
    request (not at_once) restarts the workers once more; the same kind of failure again stops
    the node; another kind is given its own retry."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    a, b = handlers("a"), handlers("b")
    rendezvous_all(a, b)
    _ask_to_stop(b, monkeypatch, "RewardError", at_once=False)
    rendezvous_all(a, b)  # restarted once
    _ask_to_stop(b, monkeypatch, "EnvError", at_once=False)
    rendezvous_all(a, b)  # another kind: its own retry
    _ask_to_stop(b, monkeypatch, "EnvError", at_once=False)
    with pytest.raises(RendezvousClosedError, match=r"node b stops.*b: EnvError: boom"):
        b.next_rendezvous()


def test_leave_is_reported_at_once_and_does_not_close_the_run(handlers, client):
    a, b = handlers("a"), handlers("b")
    rendezvous_all(a, b)
    t0 = time.monotonic()
    b.shutdown()
    wait_until(lambda: a.num_nodes_waiting() > 0, 5, message="a to see b leave")
    assert time.monotonic() - t0 < 1.0
    run = client.status("rdzv", include_departed=True)["runs"][0]
    assert not run["snapshot"]["closed"]
    assert [m["state"] for m in run["departed"] if m["member_id"] == "b"] == ["MEMBER_STATE_LEFT"]
    assert not a.is_closed()


def test_full_round_ignores_standby_nodes_but_not_a_rejoining_participant(handlers):
    # A long last call, so that b waiting again next to the standby d does not complete a round
    # of two before a and c have seen it; a join timeout shorter than the standby's wait.
    a, b, c, d = (handlers(n, nnodes=(2, 3), last_call_timeout=5, join_timeout=4) for n in "abcd")
    rendezvous_all(a, b, c)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {"d": pool.submit(d.next_rendezvous)}
        wait_until(lambda: a._views.view is not None and "d" in a._views.view.round.waiting, 5, message="d waiting")
        time.sleep(0.2)
        assert a.num_nodes_waiting() == 0, "a standby node must not restart a full round"
        futures["b"] = pool.submit(b.next_rendezvous)  # b's workers failed: it waits again
        wait_until(lambda: a.num_nodes_waiting() > 0 and c.num_nodes_waiting() > 0, 3, message="b seen waiting again")
        futures |= {n: pool.submit(h.next_rendezvous) for n, h in (("a", a), ("c", c))}
        concurrent.futures.wait(futures.values(), timeout=30, return_when=concurrent.futures.FIRST_COMPLETED)
        deadline = time.monotonic() + 30
        while sum(f.done() for f in futures.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        done = {n: f.result() for n, f in futures.items() if f.done()}
        # The round is full again (max 3) with the previous round's three (they keep their slots):
        # d stays a standby, past its join_timeout (4 s), as c10d keeps its redundant nodes ...
        time.sleep(5.0)
        assert sorted(done) == ["a", "b", "c"] and not futures["d"].done(), (done, futures["d"])
        # ... until the run is closed: then it leaves the wait.
        a.set_closed()
        with pytest.raises(RendezvousClosedError):
            futures["d"].result(timeout=30)
    assert sorted(i.rank for i in done.values()) == [0, 1, 2]
    assert len({i.store.prefix for i in done.values()}) == 1


def test_nodes_waiting_policy_counts_rejoining_participants():
    assert policy.nodes_waiting(1, 1, ["a", "b"], ["c"], [], 2) == 0
    assert policy.nodes_waiting(1, 1, ["a", "b"], ["b"], [], 2) == 1
    assert policy.nodes_waiting(1, 1, ["a", "b"], ["b", "c"], [], 3) == 2


def test_set_closed_and_close_run_cli_raise_rendezvous_closed(handlers, coordinator):
    a, b = handlers("a"), handlers("b")
    rendezvous_all(a, b)
    a.set_closed()
    assert a.is_closed()
    with pytest.raises(RendezvousClosedError, match="closed"):
        b.next_rendezvous()
    wait_until(b.is_closed, 5, message="b to see the close")

    x = handlers("x", run="other", nnodes=(1, 1))
    assert x.next_rendezvous().world_size == 1
    subprocess.run(
        [sys.executable, "-m", "elasticrl", "close-run", "other", "--coordinator", coordinator.address],
        check=True, cwd=REPO, timeout=30, capture_output=True,
    )
    with pytest.raises(RendezvousClosedError, match="other"):
        x.next_rendezvous()
    with pytest.raises(RendezvousClosedError, match="other"):
        handlers("y", run="other").next_rendezvous()  # a newcomer cannot even join


def test_join_timeout_raises_rendezvous_timeout(handlers):
    lone = handlers("lone", join_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="min_nodes=2"):
        lone.next_rendezvous()
    assert 0.9 <= time.monotonic() - t0 < 4.0


def test_nnodes_mismatch_is_a_rendezvous_error(handlers):
    a, b = handlers("a", nnodes=(2, 3), join_timeout=2), handlers("b", nnodes=(2, 4))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        a_future = pool.submit(a.next_rendezvous)
        time.sleep(0.3)
        with pytest.raises(RendezvousError, match="--nnodes"):
            b.next_rendezvous()
        with pytest.raises(RendezvousTimeoutError):
            a_future.result(timeout=30)


def test_unreachable_coordinator_is_a_connection_error_naming_it():
    h = rdzv.create_handler(make_params("127.0.0.1:1", "n0", connect_timeout=1, call_timeout=0.5))
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1:1"):
        h.next_rendezvous()
    assert time.monotonic() - t0 < 5.0
    h.shutdown()


def test_wrong_token_is_a_connection_error(coordinator_factory, tmp_path):
    (tmp_path / "token").write_text("right-token\n")
    (tmp_path / "wrong").write_text("wrong-token\n")
    coord = coordinator_factory(extra_args=["--token-file", str(tmp_path / "token")])
    h = rdzv.create_handler(make_params(coord.address, "n0", token_file=tmp_path / "wrong"))
    with pytest.raises(RendezvousConnectionError, match="token"):
        h.next_rendezvous()
    h.shutdown()
    ok = rdzv.create_handler(make_params(coord.address, "n0", token_file=tmp_path / "token", nnodes=(1, 1)))
    assert ok.next_rendezvous().world_size == 1
    ok.shutdown()
    with CoordinatorClient(coord.address, token="right-token") as client:
        assert client.status("rdzv")["runs"][0]["snapshot"]["members"] == []


def test_rank0_gone_before_publishing_its_store_address_forms_a_new_round(handlers, client):
    """A rank 0 that dies between the round's completion and publishing MASTER_ADDR/PORT must not
    leave the others waiting for read_timeout: they see it lost and form the next round."""
    from elasticrl.coordinator.client import Membership

    z = Membership(client, "rdzv", "z", lease_ttl_s=TTL_S)  # a bare member: joins rounds, never publishes
    b, c = handlers("b", nnodes=(2, 2)), handlers("c", nnodes=(2, 2))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        z_round = pool.submit(
            client.round_join, "rdzv", "z", z.incarnation, min_nodes=2, max_nodes=2,
            last_call_s=0.5, join_timeout_s=20, after_round=0, wait_s=10,
        )
        wait_until(lambda: "z" in client.status("rdzv")["runs"][0]["snapshot"]["round"].get("waiting", []), 5, message="z waiting")
        b_info = pool.submit(b.next_rendezvous)
        first = z_round.result(timeout=15)
        assert (first.status, first.rank) == ("complete", 0)
        z.leave("died before publishing")
        t0 = time.monotonic()
        infos = rendezvous_all(c) + [b_info.result(timeout=30)]
    assert time.monotonic() - t0 < 5.0
    assert b.round == c.round == 2
    assert sorted(i.rank for i in infos) == [0, 1]


def test_an_agent_waiting_for_an_unreachable_coordinator_says_whom_it_waits_for(caplog, monkeypatch):
    # Found by an operator: a wrong --rdzv-endpoint was silent for connect_timeout (30 s).
    import elasticrl.rendezvous.handler as handler_module
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    monkeypatch.setattr(handler_module, "CONNECT_NOTE_S", 0.5)
    address = f"127.0.0.1:{free_port()}"
    h = rdzv.create_handler(make_params(address, "n0", connect_timeout=2, session_relay="false"))
    try:
        with caplog.at_level("WARNING"), pytest.raises(RendezvousConnectionError):
            h.next_rendezvous()
    finally:
        h.shutdown()
    notes = [r.getMessage() for r in caplog.records if "waiting for the coordinator" in r.getMessage()]
    assert notes == [f"run rdzv: waiting for the coordinator at {address} (this node gives up after connect_timeout=2s; "
                     "check --rdzv-endpoint and that the coordinator is up)"], caplog.text
