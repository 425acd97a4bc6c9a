"""``CoordinatorStore`` through coordinator faults: SIGKILL and restart (durable state dir, and
memory-only), SIGSTOP/SIGCONT, a coordinator that stays down, and a reply lost in transit.

What is asserted (store.py and client.py are the documents):

* durable: every key, counter and deletion survives ``kill -9``; a write in flight when the
  coordinator dies is retried with its request id and counts exactly once, whether the first
  attempt never reached the coordinator (SIGSTOP, then SIGKILL) or was applied and only its reply
  was lost (``TcpProxy.drop_replies``, then SIGKILL): ``add`` returns the first attempt's value,
  ``compare_set`` its answer, ``delete_key`` True;
* a ``get``/``wait``/``multi_get`` blocked when the coordinator is killed reconnects and returns
  promptly once another client sets the key after the restart; one whose key never comes raises
  ``DistStoreError`` ("wait timeout", naming the key and the coordinator) within its timeout plus
  a few seconds;
* a coordinator that stays down: every operation, a long ``wait`` included, raises
  ``DistNetworkError`` naming the coordinator once the client's reconnect budget is spent;
* SIGSTOP: a wait and a write that are stuck behind a paused coordinator finish after SIGCONT;
  paused past the deadlines, every call raises (the client's gRPC deadline) instead of hanging;
* memory-only (no ``--state-dir``; server.py: "state in memory only (lost on restart)"): the KV is
  gone after a restart, and the store says so with ordinary answers (``check`` False, ``num_keys``
  0, ``get`` times out, ``add`` starts from zero), never a hang.

The last two tests pin bugs found here (fixed in ``CoordinatorClient._call`` / ``kv_wait``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from elasticrl.coordinator.client import CoordinatorClient  # noqa: E402
from elasticrl.coordinator.wire import DEADLINE_SLACK_S  # noqa: E402
from elasticrl.rendezvous.store import CoordinatorStore  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from tests.tcp_proxy import TcpProxy  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.waits]

# How long after the event that releases it (the key set, SIGCONT) a blocked call must return:
# the client's reconnect backoff is at most ~1 s (wire.retry_wait, grpc's max reconnect backoff).
PROMPT_S = 2.5
# Slack on a timeout that expires (thread start, one reconnect backoff, a loaded 2-core machine).
SLACK_S = 3.0


class Call(threading.Thread):
    """``fn()`` in a daemon thread, with its value or exception and when it ended."""

    def __init__(self, fn, name: str = "call"):
        super().__init__(name=f"store-fault-{name}", daemon=True)
        self.fn = fn
        self.value = None
        self.exc: BaseException | None = None
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to judge
            self.exc = exc
        finally:
            self.ended_at = time.monotonic()

    def result(self, timeout_s: float):
        """Wait for the call (failing the test if it is still blocked after ``timeout_s``)."""
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.name} still blocked after {timeout_s:.1f}s"
        return self

    @property
    def elapsed(self) -> float:
        assert self.ended_at is not None
        return self.ended_at - self.started_at

    def __repr__(self) -> str:
        return f"<{self.name}: value={self.value!r} exc={self.exc!r}>"


@pytest.fixture
def make_store():
    """``make_store(address, run, ...)``: a CoordinatorStore over its own client (closed at teardown)."""
    clients: list[CoordinatorClient] = []

    def make(address: str, run: str, *, timeout_s: float = 15.0, call_s: float = 3.0, reconnect_s: float = 10.0,
             prefix: str = "f/") -> CoordinatorStore:
        client = CoordinatorClient(address, call_timeout_s=call_s, reconnect_timeout_s=reconnect_s)
        clients.append(client)
        return CoordinatorStore(client, run, prefix, timeout_s=timeout_s)

    yield make
    for client in clients:
        client.close()


def fresh_run(tag: str) -> str:
    return f"faults-{tag}-{uuid.uuid4().hex[:8]}"


def restart(coord, down_s: float = 0.0) -> float:
    """SIGKILL the coordinator (stopped or not), keep it down ``down_s``, start it on the same
    port and state dir; returns when it serves again."""
    coord.kill()
    time.sleep(down_s)
    coord.start()
    return time.monotonic()


def raw_value(address: str, run: str, key: str) -> bytes | None:
    with CoordinatorClient(address, call_timeout_s=3, reconnect_timeout_s=3) as c:
        return c.kv_get(run, [f"f/{key}".encode()])[0]


def assert_wait_timeout(call: Call, timeout_s: float, key: str, address: str, slack_s: float = SLACK_S) -> None:
    assert isinstance(call.exc, dist.DistStoreError), call
    msg = str(call.exc)
    assert "wait timeout" in msg and key in msg and address in msg, msg
    assert timeout_s * 0.8 <= call.elapsed < timeout_s + slack_s, (call, call.elapsed)


# -- SIGKILL and restart, durable ----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_every_kind_of_key_survives_sigkill_restarts(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("durable")
    s = make_store(coord.address, run)
    s.set("a", "1")
    s.multi_set(["b", "c"], [b"2", b"\x00\xff"])
    assert s.add("n", 5) == 5
    assert s.compare_set("cas", "", "x") == b"x"
    s.set("gone", "1")
    assert s.delete_key("gone") is True
    assert s.num_keys() == 5

    restart(coord)
    fresh = make_store(coord.address, run)
    for st in (s, fresh):  # the old client reconnects; a new one sees the same state
        assert st.get("a") == b"1"
        assert st.multi_get(["b", "c", "n", "cas"]) == [b"2", b"\x00\xff", b"5", b"x"]
        assert st.check(["a", "b", "c", "n", "cas"]) is True
        assert st.check(["gone"]) is False
        assert st.num_keys() == 5
    assert s.add("n", 2) == 7
    assert s.compare_set("cas", "x", "y") == b"y"
    assert s.compare_set("cas", "x", "z") == b"y"  # no swap: the current value
    assert s.delete_key("a") is True and s.delete_key("a") is False

    restart(coord)  # what changed after the first restart is durable too
    assert fresh.multi_get(["n", "cas", "b"]) == [b"7", b"y", b"2"]
    assert fresh.check(["a"]) is False
    assert fresh.num_keys() == 4


@pytest.mark.timeout(30)
def test_blocked_waits_survive_sigkill_and_return_once_keys_are_set_after_restart(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("waits")
    waiter = make_store(coord.address, run, timeout_s=15)
    setter = make_store(coord.address, run)
    setter.set("m1", "one")  # one of the multi_get keys exists before the crash
    # Past the restart with room to spare: a coordinator still down at the wait's deadline is
    # "unreachable", not a timeout (under load a restart took longer than 1.6 s).
    never_timeout_s = 5.0
    calls = {
        "wait": Call(lambda: waiter.wait(["k1"]), "wait"),
        "wait(timeout)": Call(lambda: waiter.wait(["k1", "m1"], 15.0), "wait(timeout)"),
        "get": Call(lambda: waiter.get("k2"), "get"),
        "multi_get": Call(lambda: waiter.multi_get(["m1", "m2"]), "multi_get"),
        "PrefixStore.get": Call(lambda: dist.PrefixStore("pre", waiter).get("k3"), "PrefixStore.get"),
        "never": Call(lambda: waiter.wait(["never"], never_timeout_s), "never"),
    }
    time.sleep(0.4)  # every call is blocked in a server-side wait
    assert all(c.is_alive() for c in calls.values()), calls
    restart(coord, down_s=0.3)
    assert all(c.is_alive() for c in calls.values()), calls  # a restart alone releases nothing

    set_at = time.monotonic()
    setter.set("k1", "v1")
    setter.set("k2", "v2")
    setter.multi_set(["m2"], ["two"])
    dist.PrefixStore("pre", setter).set("k3", "v3")
    for name in ("wait", "wait(timeout)", "get", "multi_get", "PrefixStore.get"):
        c = calls[name].result(PROMPT_S + 5)
        assert c.exc is None, c
        assert c.ended_at - set_at < PROMPT_S, (c, c.ended_at - set_at)
    assert calls["get"].value == b"v2"
    assert calls["multi_get"].value == [b"one", b"two"]
    assert calls["PrefixStore.get"].value == b"v3"
    # The key that never comes: the wait timeout, within its timeout plus slack (asked again with
    # the time left after the restart: test_a_wait_keeps_its_timeout_across_a_restart).
    never = calls["never"].result(never_timeout_s + SLACK_S + 3)
    assert_wait_timeout(never, never_timeout_s, "never", coord.address, slack_s=SLACK_S + 1.0)


@pytest.mark.timeout(30)
def test_writes_in_flight_at_the_crash_count_exactly_once(coordinator_factory, make_store):
    """The first attempt never reached the coordinator's code: it sits in the socket of a
    SIGSTOPped coordinator, which is then SIGKILLed. The retry after the restart applies it once."""
    coord = coordinator_factory()
    run = fresh_run("inflight")
    s = make_store(coord.address, run, call_s=5)
    s.set("n", "10")
    s.set("cas", "old")
    s.set("del", "x")
    os.kill(coord.pid, signal.SIGSTOP)
    calls = {
        "add": Call(lambda: s.add("n", 3), "add"),
        "compare_set": Call(lambda: s.compare_set("cas", "old", "new"), "compare_set"),
        "delete_key": Call(lambda: s.delete_key("del"), "delete_key"),
        "multi_set": Call(lambda: s.multi_set(["m1", "m2"], ["1", "2"]), "multi_set"),
        "set": Call(lambda: s.set("s", "v"), "set"),
    }
    time.sleep(0.5)
    assert all(c.is_alive() for c in calls.values()), calls
    restart(coord, down_s=0.2)
    for c in calls.values():
        c.result(10)
        assert c.exc is None, c
    assert calls["add"].value == 13
    assert calls["compare_set"].value == b"new"
    assert calls["delete_key"].value is True
    assert s.multi_get(["n", "cas", "m1", "m2", "s"]) == [b"13", b"new", b"1", b"2", b"v"]
    assert s.check(["del"]) is False
    assert s.num_keys() == 5


@pytest.mark.timeout(30)
def test_applied_writes_whose_reply_was_lost_are_replayed_after_restart(coordinator_factory, make_store):
    """The first attempt was applied and its reply lost (the proxy drops replies), then the
    coordinator is SIGKILLed: the retry must get the stored answer, not apply again. Each answer
    would differ without the replay: add would count twice (16), delete_key would say False, and
    compare_set would return the value another client wrote since ("other")."""
    coord = coordinator_factory()
    run = fresh_run("lost-reply")
    proxy = TcpProxy(("127.0.0.1", coord.port))
    try:
        s = make_store(proxy.address, run, call_s=8)
        other = make_store(coord.address, run)
        s.set("n", "10")  # also opens the connection through the proxy before replies are dropped
        s.set("cas", "old")
        s.set("del", "x")
        proxy.drop_replies = True
        calls = {
            "add": Call(lambda: s.add("n", 3), "add"),
            "delete_key": Call(lambda: s.delete_key("del"), "delete_key"),
            "compare_set": Call(lambda: s.compare_set("cas", "old", "new"), "compare_set"),
        }
        wait_until(lambda: other.multi_get(["n", "cas"]) == [b"13", b"new"] and not other.check(["del"]), 5,
                   message="the three writes applied")
        other.set("cas", "other")
        assert all(c.is_alive() for c in calls.values()), calls  # no reply came back
        proxy.drop_replies = False
        restart(coord, down_s=0.2)
        for c in calls.values():
            c.result(10)
            assert c.exc is None, c
        assert calls["add"].value == 13
        assert calls["delete_key"].value is True
        assert calls["compare_set"].value == b"new"
        assert other.multi_get(["n", "cas"]) == [b"13", b"other"]
        assert other.check(["del"]) is False
    finally:
        proxy.close()


@pytest.mark.timeout(30)
def test_adds_and_appends_across_random_kills_count_once(coordinator_factory, make_store):
    """Two clients keep adding and appending while the coordinator is SIGKILLed twice at random
    moments: every add returns the next number and the append log holds each entry once, in order
    (append is a compare_set loop: a compare_set applied twice would duplicate an entry)."""
    coord = coordinator_factory()
    run = fresh_run("burst")
    adder = make_store(coord.address, run)
    appender = make_store(coord.address, run)
    stop = threading.Event()
    added: list[int] = []
    appended: list[int] = []

    def add_loop():
        while not stop.is_set():
            added.append(adder.add("n", 1))

    def append_loop():
        i = 0
        while not stop.is_set():
            appender.append("log", f"{i},")
            appended.append(i)
            i += 1

    rng = random.Random(20240611)
    calls = [Call(add_loop, "adder"), Call(append_loop, "appender")]
    for _ in range(2):
        time.sleep(rng.uniform(0.15, 0.4))
        restart(coord, down_s=rng.uniform(0.0, 0.4))
    time.sleep(0.2)
    stop.set()
    for c in calls:
        c.result(15)
        assert c.exc is None, c
    assert len(added) > 5 and len(appended) > 5, (len(added), len(appended))
    assert added == list(range(1, len(added) + 1)), added
    assert adder.get("n") == str(len(added)).encode()
    assert appender.get("log") == "".join(f"{i}," for i in appended).encode()


# -- SIGSTOP -------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_sigstop_shorter_than_deadlines_delays_but_loses_nothing(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("pause")
    waiter = make_store(coord.address, run, timeout_s=10)
    setter = make_store(coord.address, run, call_s=5)
    get = Call(lambda: waiter.get("k"), "get")
    multi = Call(lambda: waiter.multi_get(["k", "j"]), "multi_get")
    time.sleep(0.3)
    os.kill(coord.pid, signal.SIGSTOP)
    try:
        writes = [Call(lambda: setter.set("k", "v"), "set"), Call(lambda: setter.add("j", 2), "add")]
        time.sleep(0.8)
        assert all(c.is_alive() for c in [get, multi, *writes]), (get, multi, writes)
    finally:
        os.kill(coord.pid, signal.SIGCONT)
    cont_at = time.monotonic()
    for c in [get, multi, *writes]:
        c.result(PROMPT_S + 5)
        assert c.exc is None, c
        assert c.ended_at - cont_at < PROMPT_S, (c, c.ended_at - cont_at)
    assert get.value == b"v" and multi.value == [b"v", b"2"]
    assert writes[1].value == 2
    assert setter.num_keys() == 2


@pytest.mark.timeout(40)
def test_sigstop_past_every_deadline_raises_instead_of_hanging(coordinator_factory, make_store):
    """A coordinator paused for longer than the deadlines: every call raises, naming the
    coordinator. Waits raise the wait timeout (DistStoreError) once their gRPC deadline (the wait
    plus ``DEADLINE_SLACK_S``) passes; the other calls raise DistNetworkError after
    ``call_timeout_s`` (TCPStore itself blocks forever in ``add`` against a paused server). The
    store works again after SIGCONT, and a write that timed out was applied at most once."""
    coord = coordinator_factory()
    run = fresh_run("stall")
    call_s, wait_s = 1.0, 0.3
    s = make_store(coord.address, run, timeout_s=wait_s, call_s=call_s)
    s.multi_set(["a", "b", "n", "cas"], ["1", "2", "0", "old"])
    os.kill(coord.pid, signal.SIGSTOP)
    try:
        plain = {
            "set": Call(lambda: s.set("x", "1"), "set"),
            "add": Call(lambda: s.add("n", 1), "add"),
            "compare_set": Call(lambda: s.compare_set("cas", "old", "new"), "compare_set"),
            "check": Call(lambda: s.check(["a"]), "check"),
            "delete_key": Call(lambda: s.delete_key("b"), "delete_key"),
            "num_keys": Call(s.num_keys, "num_keys"),
            "multi_set": Call(lambda: s.multi_set(["y"], ["1"]), "multi_set"),
        }
        waits = {
            "get": Call(lambda: s.get("never"), "get"),
            "wait": Call(lambda: s.wait(["never"], wait_s), "wait"),
            "multi_get": Call(lambda: s.multi_get(["a", "never"]), "multi_get"),
        }
        for c in plain.values():
            c.result(call_s + SLACK_S + 2)
            assert isinstance(c.exc, dist.DistNetworkError), c
            assert coord.address in str(c.exc), c
            assert c.elapsed < call_s + SLACK_S, (c, c.elapsed)
        for c in waits.values():
            c.result(wait_s + DEADLINE_SLACK_S + SLACK_S + 2)
            assert_wait_timeout(c, wait_s, "never", coord.address, slack_s=DEADLINE_SLACK_S + SLACK_S)
    finally:
        os.kill(coord.pid, signal.SIGCONT)
    assert s.get("a") == b"1"
    s.set("after", "1")
    assert s.get("after") == b"1"
    # The timed-out add may have been applied once the coordinator read it after SIGCONT (its
    # answer was lost to the caller, as with any timeout), but never twice.
    assert s.get("n") in (b"0", b"1")


# -- a coordinator that stays down ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_coordinator_down_for_good_raises_dist_network_error_after_the_reconnect_budget(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("down")
    reconnect_s = 1.0
    s = make_store(coord.address, run, timeout_s=30, reconnect_s=reconnect_s)
    s.set("a", "1")
    coord.kill()
    ops = {
        "set": lambda: s.set("x", "1"),
        "add": lambda: s.add("n", 1),
        "compare_set": lambda: s.compare_set("a", "1", "2"),
        "check": lambda: s.check(["a"]),
        "delete_key": lambda: s.delete_key("a"),
        "num_keys": s.num_keys,
        "multi_set": lambda: s.multi_set(["y"], ["1"]),
        "multi_get": lambda: s.multi_get(["a"]),
        "get": lambda: s.get("a"),
        "wait(30s)": lambda: s.wait(["never"], 30.0),  # far longer than the reconnect budget
    }
    calls = [Call(fn, name) for name, fn in ops.items()]
    for c in calls:
        c.result(reconnect_s + SLACK_S + 2)
        assert isinstance(c.exc, dist.DistNetworkError), c
        assert coord.address in str(c.exc) and run in str(c.exc), c
        assert c.elapsed < reconnect_s + SLACK_S, (c, c.elapsed)
    coord.start()  # durable: once it is back the same store carries on
    assert s.get("a") == b"1" and s.check(["x"]) is False


# -- memory-only coordinator ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_memory_only_restart_loses_the_kv_and_says_so_without_hanging(coordinator_factory, make_store):
    """Documented (server.py, ``state_dir``: "None keeps state in memory only (lost on restart)"):
    after a restart the run's keys are gone. Calls answer as on a fresh run; a wait in progress
    keeps waiting and returns once the key is set after the restart; a write in flight at the
    crash is applied once to the empty state (its earlier effects are gone with the rest)."""
    coord = coordinator_factory(durable=False)
    run = fresh_run("memory")
    s = make_store(coord.address, run, timeout_s=0.5, call_s=5)
    waiter = make_store(coord.address, run, timeout_s=15)
    s.set("a", "1")
    s.multi_set(["b", "c"], ["2", "3"])
    assert s.add("n", 5) == 5
    s.set("m", "10")
    waiting = Call(lambda: waiter.get("w"), "get(w)")
    os.kill(coord.pid, signal.SIGSTOP)
    in_flight = Call(lambda: s.add("m", 3), "add in flight")
    time.sleep(0.4)
    restart(coord, down_s=0.2)
    assert in_flight.result(10).exc is None and in_flight.value == 3, in_flight  # 10 + 3 was never stored
    assert s.check(["a"]) is False and s.check(["m"]) is True
    assert s.num_keys() == 1
    assert s.add("n", 1) == 1
    assert s.compare_set("b", "2", "x") == b"2"  # missing key, expected not "": no swap, torch's answer
    assert s.delete_key("c") is False
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout") as err:
        s.get("a")
    assert coord.address in str(err.value)
    assert time.monotonic() - t0 < 0.5 + SLACK_S
    assert waiting.is_alive(), waiting
    set_at = time.monotonic()
    s.set("w", "now")
    waiting.result(PROMPT_S + 5)
    assert waiting.exc is None and waiting.value == b"now", waiting
    assert waiting.ended_at - set_at < PROMPT_S


# -- bugs found (fixed) ----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_wait_blocked_longer_than_the_reconnect_budget_still_reconnects(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("bug-budget")
    waiter = make_store(coord.address, run, timeout_s=10, reconnect_s=1.2)
    setter = make_store(coord.address, run)
    call = Call(lambda: waiter.get("k"), "get")
    time.sleep(1.6)  # the get's first KVGet (wait_ms 10000) has been waiting longer than 1.2 s
    restart(coord)  # back within ~0.4 s: well inside a 1.2 s reconnect budget
    setter.set("k", "v")
    call.result(PROMPT_S + 5)
    assert call.exc is None and call.value == b"v", call


@pytest.mark.timeout(30)
def test_a_wait_keeps_its_timeout_across_a_restart(coordinator_factory, make_store):
    coord = coordinator_factory()
    run = fresh_run("bug-overrun")
    timeout_s = 3.0  # the coordinator is back (~0.4-1 s after the kill) well before it
    waiter = make_store(coord.address, run, timeout_s=timeout_s, reconnect_s=10)
    call = Call(lambda: waiter.get("never"), "get")
    time.sleep(1.5)
    restart(coord)  # 1.5 s before the wait's deadline; the coordinator is back in ~0.4 s
    call.result(timeout_s + 10)
    # The wait timeout at ~3 s (the coordinator was back before it). It was ~5 s: the KVGet
    # re-sent unchanged waited its whole 3 s again on the restarted coordinator.
    assert_wait_timeout(call, timeout_s, "never", coord.address, slack_s=1.2)
