"""``CoordinatorStore`` (a Python ``torch.distributed.Store``) against a real coordinator: every
operation torch's agent uses, the error torch expects on a timeout, per-round prefixes, and the
C++ side (``PrefixStore`` and a gloo process group calling back into the Python store)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo  # noqa: E402
from torch.distributed.elastic.utils import store as store_util  # noqa: E402

from elasticrl.coordinator.client import CoordinatorClient  # noqa: E402
from elasticrl.rendezvous.store import CoordinatorStore  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.waits]
RUN = "store-test"


@pytest.fixture
def store(client):
    return CoordinatorStore(client, RUN, "torchrun/round-1/", timeout_s=5)


def test_set_get_str_and_bytes(store):
    store.set("a", "text")
    store.set("b", b"\x00\xffraw")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffraw"
    store.set("a", b"again")
    assert store.get("a") == b"again"


def test_get_of_a_missing_key_times_out_with_dist_store_error(store):
    store.set_timeout(datetime.timedelta(seconds=0.5))
    assert store.timeout == datetime.timedelta(seconds=0.5)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.get("never")
    assert 0.4 <= time.monotonic() - t0 < 3.0


def test_wait_with_explicit_timeout_raises_and_wakes_on_set(store):
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["k1", "k2"], datetime.timedelta(milliseconds=300))
    assert 0.25 <= time.monotonic() - t0 < 3.0

    threading.Timer(0.2, lambda: store.multi_set(["k1", "k2"], ["1", "2"])).start()
    t0 = time.monotonic()
    store.wait(["k1", "k2"], datetime.timedelta(seconds=5))
    assert time.monotonic() - t0 < 2.0
    assert store.check(["k1", "k2"]) and not store.check(["k1", "k3"])


def test_add_compare_set_delete_num_keys(store, client):
    assert store.add("n", 1) == 1
    assert store.add("n", 5) == 6
    assert store.add("n", -2) == 4
    assert store.get("n") == b"4"
    # torch semantics: empty expected creates a missing key; a mismatch returns the current value.
    assert store.compare_set("c", "", "first") == b"first"
    assert store.compare_set("c", "wrong", "second") == b"first"
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("missing", "x", "y") == b"x"
    assert not store.check(["missing"])
    before = store.num_keys()
    assert store.delete_key("c") is True and store.delete_key("c") is False
    assert store.num_keys() == before - 1 == client.kv_num_keys(RUN)


def test_multi_get_multi_set_and_append(store):
    store.multi_set(["x", "y", "z"], [b"1", "2", b"3"])
    assert store.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.multi_get(["x", "nope"])
    store.append("log", "a")
    store.append("log", b"bc")
    assert store.get("log") == b"abc"
    assert store.has_extended_api()


def test_keys_are_prefixed_per_round(client):
    r1 = CoordinatorStore(client, RUN, "torchrun/round-1/", timeout_s=0.3)
    r2 = CoordinatorStore(client, RUN, "torchrun/round-2/", timeout_s=0.3)
    r1.set("MASTER_ADDR", "host-a")
    assert not r2.check(["MASTER_ADDR"])
    with pytest.raises(dist.DistStoreError):
        r2.get("MASTER_ADDR")
    assert client.kv_get(RUN, [b"torchrun/round-1/MASTER_ADDR"]) == [b"host-a"]
    assert r1.clone().get("MASTER_ADDR") == b"host-a"


def test_cpp_callers_reach_the_python_store(store, client):
    """PrefixStore (C++) dispatches to the Python methods, camel-case getNumKeys/deleteKey included."""
    pre = dist.PrefixStore("pre", store)
    pre.set("k", "v")
    assert pre.get("k") == b"v"
    assert client.kv_get(RUN, [b"torchrun/round-1/pre/k"]) == [b"v"]
    assert pre.add("cnt", 3) == 3
    assert pre.compare_set("k", "v", "w") == b"w"
    pre.wait(["k"], datetime.timedelta(seconds=1))
    assert pre.num_keys() >= 2
    assert pre.delete_key("k") is True
    assert pre.multi_get(["cnt"]) == [b"3"]


def test_gloo_process_group_bootstraps_over_the_store(client):
    results: dict[int, float] = {}

    def rank_main(rank: int) -> None:
        s = CoordinatorStore(client, RUN, "pg/", timeout_s=20)
        pg = dist.ProcessGroupGloo(s, rank, 2, datetime.timedelta(seconds=20))
        t = torch.tensor([rank + 1.0])
        pg.allreduce([t]).wait()
        results[rank] = t.item()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {0: 3.0, 1: 3.0}


def test_agent_usage_exit_barrier_and_bootstrap_info(client):
    """What the torchrun agent does with the store: RendezvousStoreInfo.build and store_util.barrier."""
    stores = [CoordinatorStore(client, RUN, "torchrun/round-7/", timeout_s=10) for _ in range(3)]
    info0 = RendezvousStoreInfo.build(0, stores[0], "10.0.0.1")
    info2 = RendezvousStoreInfo.build(2, stores[2], "10.0.0.3")
    assert (info2.master_addr, info2.master_port) == ("10.0.0.1", info0.master_port)

    errors: list[BaseException] = []

    def arrive(s):
        try:
            store_util.barrier(s, world_size=3, key_prefix="torchelastic/agent/terminal_state", barrier_timeout=10)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=arrive, args=(s,), daemon=True) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not errors and not any(t.is_alive() for t in threads)
    # A barrier that one agent never reaches times out with the error torch catches.
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store_util.barrier(stores[0], world_size=2, key_prefix="lonely", barrier_timeout=0.5)
    assert time.monotonic() - t0 < 3.0


def test_unreachable_coordinator_raises_dist_network_error():
    with CoordinatorClient("127.0.0.1:1", call_timeout_s=0.5, reconnect_timeout_s=0.5) as client:
        s = CoordinatorStore(client, RUN, "p/", timeout_s=1)
        t0 = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="127.0.0.1:1"):
            s.set("k", "v")
        assert time.monotonic() - t0 < 5.0
