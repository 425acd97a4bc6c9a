"""The ``torch.distributed.Store`` contract, run on ``CoordinatorStore`` and on ``TCPStore`` alike.

Every parametrized test runs the same cases on a ``CoordinatorStore`` over a real coordinator
(one per module, port 0, a fresh run per test) and on a fresh in-process ``TCPStore`` server, so a
case that passes on torch's own store and fails on ours is a bug in ours. Where the two differ on
purpose, each store's own behaviour is asserted and the reason is given in a comment.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from elasticrl.coordinator import validate  # noqa: E402
from elasticrl.coordinator.client import CoordinatorClient  # noqa: E402
from elasticrl.errors import InvalidRequestError  # noqa: E402
from elasticrl.rendezvous.store import CoordinatorStore  # noqa: E402
from tests.conftest import REPO, CoordinatorProcess  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
KINDS = ["coordinator", "tcp"]
WORKER = REPO / "tests" / "integration" / "store_pg_worker.py"
TIMEOUT_S = 10.0
# Keys a fresh store already counts. TCPStore's server keeps an internal counter of the workers
# that connected when built with a world size (as init_process_group builds it); the coordinator
# store counts the keys of its run, every prefix included, and a fresh run has none.
FRESH_KEYS = {"coordinator": 0, "tcp": 1}


@pytest.fixture(scope="module")
def shared_coordinator(tmp_path_factory):
    proc = CoordinatorProcess(tmp_path_factory.mktemp("store-contract")).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def shared_client(shared_coordinator):
    with CoordinatorClient(shared_coordinator.address, call_timeout_s=5, reconnect_timeout_s=10) as c:
        yield c


def fresh_run() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def store(kind, request):
    if kind == "coordinator":
        client = request.getfixturevalue("shared_client")
        yield CoordinatorStore(client, fresh_run(), "contract/", timeout_s=TIMEOUT_S)
    else:
        yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def timed_out(fn, low_s: float) -> float:
    """Run ``fn``, which must raise torch's wait timeout; return the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        fn()
    elapsed = time.monotonic() - t0
    assert low_s * 0.8 <= elapsed < low_s + 3.0, elapsed
    return elapsed


def test_torch_cpp_store_test(store):
    """torch's own C++ test: adds, sets and gets through the C++ interface, then a clone made by
    C++ (whose Python object nothing in Python references) must see a later set."""
    dist._test_python_store(store)
    gc.collect()
    assert store.get("key3") == b"15"


def test_clone_made_by_cpp_outlives_every_python_reference(store):
    pre = dist.PrefixStore("pg", store)
    twin = pre.clone()  # PrefixStore::clone -> the store's clone(), held by C++ only
    gc.collect()
    twin.set("k", "from-clone")
    assert pre.get("k") == b"from-clone"
    assert twin.add("n", 2) == 2 and pre.add("n", 1) == 3
    # A clone copies the timeout but owns it (TCPStore::clone does the same).
    twin.set_timeout(datetime.timedelta(seconds=1))
    assert store.timeout == datetime.timedelta(seconds=TIMEOUT_S)


def test_set_get_add(store):
    store.set("a", "text")
    store.set("b", b"\x00\xffraw")
    assert store.get("a") == b"text" and store.get("b") == b"\x00\xffraw"
    store.set("a", b"again")
    assert store.get("a") == b"again"
    store.set("empty", b"")
    assert store.get("empty") == b""
    assert store.add("n", 1) == 1  # a missing key counts from 0
    assert store.add("n", 5) == 6
    assert store.add("n", -10) == -4
    assert store.get("n") == b"-4"  # counters are decimal strings
    assert store.add("n", 0) == -4


def test_compare_set_follows_torch_semantics(store):
    # A missing key with a non-empty expected value: nothing is written, the expected value returns.
    assert store.compare_set("missing", "x", "y") == b"x"
    assert not store.check(["missing"])
    # A missing key with an empty expected value is created.
    assert store.compare_set("c", "", "first") == b"first"
    # A mismatch returns the current value; a match swaps.
    assert store.compare_set("c", "wrong", "second") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.get("c") == b"second"
    # An existing empty value matches an empty expected value.
    store.set("e", b"")
    assert store.compare_set("e", "", "z") == b"z"
    assert store.get("e") == b"z"


def test_waits_time_out_and_wake_on_set(store):
    timed_out(lambda: store.wait(["never"], datetime.timedelta(milliseconds=300)), 0.3)
    store.set_timeout(datetime.timedelta(milliseconds=300))
    assert store.timeout == datetime.timedelta(milliseconds=300)
    timed_out(lambda: store.get("never"), 0.3)
    store.set("here", "1")
    timed_out(lambda: store.multi_get(["here", "never"]), 0.3)
    timed_out(lambda: store.wait(["here", "never"]), 0.3)  # the store's own timeout

    # A waiter wakes when another client (a clone: the thread-safe copy torch offers) sets the keys.
    other = store.clone()
    setter = threading.Timer(0.2, lambda: other.multi_set(["w1", "w2"], ["1", "2"]))
    setter.start()
    t0 = time.monotonic()
    store.wait(["w1", "w2"], datetime.timedelta(seconds=TIMEOUT_S))
    assert time.monotonic() - t0 < 3.0
    setter.join(timeout=5)
    assert store.get("w2") == b"2"


def test_num_keys_and_delete_key(store, kind):
    base = FRESH_KEYS[kind]
    assert store.num_keys() == base
    store.set("a", "1")
    store.set("b", "2")
    store.add("c", 1)
    store.set("a", "overwrite")  # not a new key
    assert store.num_keys() == base + 3
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"])
    assert store.num_keys() == base + 2
    timed_out(lambda: store.wait(["a"], datetime.timedelta(milliseconds=300)), 0.3)


def test_multi_get_multi_set_append_check(store):
    store.multi_set(["x", "y", "z"], [b"1", "2", b"3"])
    assert store.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]
    assert store.multi_get([]) == []
    assert store.check(["x", "y"]) and not store.check(["x", "nope"])
    assert store.check([])
    store.append("log", "a")  # creates the key
    store.append("log", b"bc")
    assert store.get("log") == b"abc"
    assert store.has_extended_api()


def test_prefix_store_over_it(store, kind):
    """C++ ``PrefixStore`` calls into the store (the Python one through torch's trampoline)."""
    pre = dist.PrefixStore("pre", store)
    pre.set("k", "v")
    assert pre.get("k") == b"v"
    assert store.get("pre/k") == b"v"  # PrefixStore joins with "/"
    assert pre.add("cnt", 3) == 3
    assert pre.compare_set("k", "v", "w") == b"w"
    assert pre.compare_set("gone", "x", "y") == b"x" and not pre.check(["gone"])
    pre.wait(["k", "cnt"], datetime.timedelta(seconds=1))
    timed_out(lambda: pre.wait(["nope"], datetime.timedelta(milliseconds=300)), 0.3)
    pre.multi_set(["m1", "m2"], ["1", "2"])
    assert pre.multi_get(["m2", "m1", "cnt"]) == [b"2", b"1", b"3"]
    pre.append("log", "a")
    pre.append("log", "b")
    assert pre.get("log") == b"ab"
    # num_keys is the underlying store's: keys outside the prefix count too, on both stores.
    store.set("outside", "1")
    assert pre.num_keys() == store.num_keys() == FRESH_KEYS[kind] + 6  # k cnt m1 m2 log outside
    assert pre.delete_key("k") is True and not store.check(["pre/k"])


def test_values_over_one_mib(store, kind):
    big = b"x" * (validate.MAX_VALUE_BYTES + 1)
    if kind == "tcp":
        # TCPStore has no per-value limit.
        store.set("big", big)
        assert store.get("big") == big
        return
    # The coordinator refuses values over --max-kv-value-bytes (default 1 MiB): its KV store is for
    # control data, kept in memory and in SQLite. The error names the flag that raises the limit.
    store.set("edge", big[:-1])
    assert store.get("edge") == big[:-1]
    with pytest.raises(InvalidRequestError, match=r"at most 1048576 allowed.*--max-kv-value-bytes"):
        store.set("big", big)
    with pytest.raises(InvalidRequestError, match="--max-kv-value-bytes"):
        store.compare_set("big", "", big)
    with pytest.raises(InvalidRequestError, match="--max-kv-value-bytes"):
        dist.PrefixStore("pre", store).set("big", big)  # the same error through C++
    assert not store.check(["big"])


@pytest.mark.timeout(150)
def test_gloo_process_group_of_three_processes(kind, request):
    """Three real processes, each with its own store client, bootstrap gloo and all-reduce."""
    world = 3
    server = None
    if kind == "coordinator":
        address, run_id = request.getfixturevalue("shared_coordinator").address, fresh_run()
    else:
        # Only the server lives in the test process; the ranks connect as TCPStore clients.
        server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        address, run_id = f"127.0.0.1:{server.port}", "unused"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--store", kind, "--address", address, "--run-id", run_id,
             "--rank", str(rank), "--world", str(world), "--timeout", "60"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert all(r["world"] == world and r["sum"] == 6.0 for r in results), results
    del server


def test_max_kv_value_bytes_defaults_agree():
    from elasticrl.cli import build_parser
    from elasticrl.coordinator.server import CoordinatorConfig

    flag_default = build_parser().parse_args(["coordinator"]).max_kv_value_bytes
    assert flag_default == CoordinatorConfig().max_kv_value_bytes == validate.MAX_VALUE_BYTES == 1 << 20


@pytest.mark.timeout(60)
def test_max_kv_value_bytes_flag_sets_the_limit(coordinator_factory):
    coord = coordinator_factory(durable=False, extra_args=["--max-kv-value-bytes", "2048"])
    with CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=10) as client:
        store = CoordinatorStore(client, fresh_run(), "p/", timeout_s=5)
        store.set("fits", b"x" * 2048)
        assert store.get("fits") == b"x" * 2048
        with pytest.raises(InvalidRequestError, match=r"2049 bytes, at most 2048 allowed.*--max-kv-value-bytes"):
            store.set("over", b"x" * 2049)
        assert not store.check(["over"])
