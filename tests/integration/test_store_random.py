"""Seeded random differential test of ``CoordinatorStore`` against torch's own stores.

Each seed draws a sequence of ``torch.distributed.Store`` operations (set, get, add, compare_set,
check, wait with and without a timeout, delete_key, num_keys, multi_get, multi_set, append,
set_timeout) over keys and values that are empty, binary, unicode, large and (for add) not
integers, and applies every step to

* a ``CoordinatorStore`` over a real coordinator subprocess (port 0, durable, one per module; a
  fresh run per test),
* ``torch.distributed.HashStore`` and
* ``torch.distributed.TCPStore`` (an in-process server on port 0),

comparing results and raised exception types step by step, then the whole key space at the end.
Odd seeds go through torch's C++ ``PrefixStore`` (so through the Python-store trampoline). Other
tests drive two store clients on one prefix (one waits while the other writes) and check that
every blocking call honours its timeout.

Where the stores differ on purpose the step asserts elasticrl's own, documented, behaviour (see
"DIFFERENCE" comments). Divergences judged to be bugs have a ``test_BUG_*`` test (each failed before its fix); the random
generator no longer steers around the ones it can reach (see "steer:" comments for the rest).

Reproduce one seed: ``pytest "tests/integration/test_store_random.py::test_random_ops_match_torch[3]"``; a
failure message carries the seed, the step number and the step log.
"""

from __future__ import annotations

import datetime
import os
import random
import re
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
from tests.conftest import CoordinatorProcess  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.waits]

N_SEEDS = int(os.environ.get("STORE_RANDOM_SEEDS", "6"))  # 16 passed; more: STORE_RANDOM_SEEDS=N
STEPS = 55
MAX_BLOCKING_TIMEOUTS = 2  # per seed: each costs its timeout on each of the three stores
SLACK_S = 2.0  # how late a timed-out wait may return (a loaded 2-core machine)
LIMIT = validate.MAX_VALUE_BYTES  # the coordinator's default --max-kv-value-bytes (documented)
INT64 = (-(2**63), 2**63 - 1)

# std::stoll's view of a value (C locale isspace, optional sign, digits): add() on TCPStore and
# HashStore reads the longest such prefix; the coordinator (kv._DECIMAL) only a whole one.
_WHOLE = re.compile(rb"[ \t\n\r\f\v]*[+-]?[0-9]+")
_STOLL_PREFIX = re.compile(rb"[ \t\n\r\f\v]*[+-]?[0-9]")

KEY_POOL = [
    "a", "b", "counter", "", "ключ✓", "x/y/z", " spaced key ", "nul\x00in", "🙂",
    "k" * 300, b"raw-bytes", b"\xff\xfe\x00bin",
]
NON_INTEGERS = ["abc", "5abc", " 5 ", "1.5", "0x10", "1e3", "--1", "+", "-", " ", "7\n", "\x1c5", "٣"]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    proc = CoordinatorProcess(tmp_path_factory.mktemp("store-random"))
    try:
        proc.start()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(coordinator):
    with CoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
        yield c


@pytest.fixture
def second_client(coordinator):
    """Another client (its own gRPC channel), as a second process would have."""
    with CoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
        yield c


def fresh_run(tag: str) -> str:
    return f"rand-{tag}-{uuid.uuid4().hex[:10]}"


def tcp_server(timeout_s: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# -- outcomes ------------------------------------------------------------------------------------


def category(exc: BaseException) -> str:
    """The exception's type as torch callers catch it."""
    if isinstance(exc, dist.DistStoreError):
        return "DistStoreError"
    if isinstance(exc, dist.DistNetworkError):
        return "DistNetworkError"
    if isinstance(exc, TypeError):
        return "TypeError"
    if isinstance(exc, ValueError):  # InvalidRequestError is one
        return "ValueError"
    return type(exc).__name__


class Outcome:
    def __init__(self, fn):
        t0 = time.monotonic()
        self.exc: BaseException | None = None
        self.value = None
        try:
            self.value = fn()
        except Exception as exc:  # noqa: BLE001 - compared below
            self.exc = exc
        self.elapsed = time.monotonic() - t0

    @property
    def key(self):
        return ("err", category(self.exc)) if self.exc is not None else ("ok", self.value)

    def __repr__(self) -> str:
        if self.exc is not None:
            return f"<{type(self.exc).__name__}: {str(self.exc)[:160]!r} after {self.elapsed:.2f}s>"
        shown = repr(self.value)
        return f"<ok {shown[:120] + '...' if len(shown) > 120 else shown}>"


def as_bytes(k) -> bytes:
    return k if isinstance(k, bytes) else k.encode()


# -- the random sequence -------------------------------------------------------------------------


class Differential:
    """The three stores of one seed and the log of what was done to them."""

    def __init__(self, seed: int, client: CoordinatorClient):
        self.seed = seed
        self.rng = random.Random(seed)
        self.via_prefix = seed % 2 == 1
        self.timeout_s = 0.15
        self.e_base = CoordinatorStore(client, fresh_run(f"s{seed}"), "rand/", timeout_s=self.timeout_s)
        self.h_base = dist.HashStore()
        self.h_base.set_timeout(td(self.timeout_s))
        self.t_base = tcp_server()
        self.t_base.set_timeout(td(self.timeout_s))
        if self.via_prefix:
            self.e, self.h, self.t = (dist.PrefixStore("pfx", s) for s in (self.e_base, self.h_base, self.t_base))
        else:
            self.e, self.h, self.t = self.e_base, self.h_base, self.t_base
        keys = KEY_POOL
        if self.via_prefix:
            # torch's trampoline hands a Python store its keys as str: a key that is not UTF-8
            # cannot reach any Python Store subclass through C++ (a torch limit, not elasticrl's).
            keys = [k for k in keys if not isinstance(k, bytes) or _is_utf8(k)]
        self.keys = self.rng.sample(keys, 7)
        self.blocking_left = MAX_BLOCKING_TIMEOUTS
        self.log: list[str] = []
        self.big_left = 1  # values of ~1 MiB per seed (slow-ish over gRPC and SQLite)

    # helpers

    def fail(self, msg: str):
        tail = "\n".join(self.log[-12:])
        pytest.fail(f"seed={self.seed} step={len(self.log)} via_prefix={self.via_prefix}: {msg}\nlast steps:\n{tail}")

    def current(self, key) -> bytes | None:
        """The reference's value of ``key`` (HashStore: never blocks for a present key)."""
        return self.h.get(key) if self.h.check([key]) else None

    def value(self, *, allow_big: bool = True):
        r = self.rng.random()
        if r < 0.10:
            v = self.rng.choice(["", b""])
        elif r < 0.25:
            v = "".join(self.rng.choice("abcxyz019 _-") for _ in range(self.rng.randint(1, 12)))
        elif r < 0.38:
            v = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 24)))
        elif r < 0.46:
            v = self.rng.choice(["значение✓", "🙂 ünï", "中文/字符", "\u0000nul\u0000"])
        elif r < 0.70:
            n = self.rng.randint(-1000, 1000)
            v = self.rng.choice([str(n), f"+{abs(n)}", f" {n}", f"\t{n}", f"00{abs(n)}", f"\x0b{n}"])
        elif r < 0.80:
            v = self.rng.choice(NON_INTEGERS)
        elif r < 0.86:
            v = str(self.rng.choice([INT64[1] - self.rng.randint(0, 3), INT64[0] + self.rng.randint(0, 3), 2**64]))
        elif r < 0.95:
            v = self.rng.randbytes(self.rng.randint(16 << 10, 64 << 10))
        elif allow_big and self.big_left > 0:
            self.big_left -= 1
            # Exactly the limit (stored), or one byte over (refused: a documented difference).
            v = b"M" * (LIMIT + self.rng.choice([0, 1]))
        else:
            v = "fallback"
        if isinstance(v, bytes) and self.rng.random() < 0.2:
            v = bytearray(v)  # torch takes any buffer of bytes
        # steer: never an int, float or None value (test_BUG_int_value_is_stored_as_nul_bytes).
        return v

    def pick_keys(self, lo: int, hi: int, *, present: bool | None = None) -> list:
        pool = self.keys
        if present is not None:
            pool = [k for k in self.keys if (self.current(k) is not None) == present]
        if not pool:
            return []
        return [self.rng.choice(pool) for _ in range(self.rng.randint(lo, hi))]

    def over_limit(self, v) -> bool:
        return len(as_bytes(v) if not isinstance(v, bytearray) else bytes(v)) > LIMIT

    def run(self, what: str, fn, stores=None) -> dict[str, Outcome]:
        """Apply ``fn(store)`` to each store; log the outcomes."""
        stores = stores or {"elastic": self.e, "hash": self.h, "tcp": self.t}
        out = {name: Outcome(lambda s=s: fn(s)) for name, s in stores.items()}
        self.log.append(f"{len(self.log)}: {what} -> " + ", ".join(f"{n}={o!r}" for n, o in out.items()))
        return out

    def same(self, out: dict[str, Outcome]) -> Outcome:
        """All stores agree (result, or exception type); returns elasticrl's outcome."""
        keys = {n: o.key for n, o in out.items()}
        if len(set(map(_hashable, keys.values()))) != 1:
            self.fail(f"stores disagree: {out}")
        return out["elastic"]

    def compare_keys(self, keys) -> None:
        for k in dict.fromkeys(keys):  # in order, once each
            present = self.run(f"check([{k!r}])", lambda s, k=k: s.check([k]))
            if self.same(present).value:
                self.same(self.run(f"get({k!r})", lambda s, k=k: s.get(k)))

    def expect_timeout(self, out: Outcome, timeout_s: float, what: str) -> None:
        if not isinstance(out.exc, dist.DistStoreError):
            self.fail(f"{what}: expected DistStoreError, got {out!r}")
        msg = str(out.exc)
        if "wait timeout" not in msg or "rand/" not in msg:
            self.fail(f"{what}: timeout message names neither the timeout nor the keys: {msg!r}")
        if not timeout_s * 0.8 <= out.elapsed <= timeout_s + SLACK_S:
            self.fail(f"{what}: a {timeout_s:.3f}s timeout took {out.elapsed:.3f}s")

    def expect_refused_as_too_big(self, out: Outcome, what: str) -> None:
        # DIFFERENCE (README "KV values up to 1 MiB"): TCPStore/HashStore take any size.
        if not isinstance(out.exc, InvalidRequestError) or "--max-kv-value-bytes" not in str(out.exc):
            self.fail(f"{what}: a value over {LIMIT} bytes should be refused naming --max-kv-value-bytes, got {out!r}")

    # operations

    def op_set(self):
        k, v = self.rng.choice(self.keys), self.value()
        what = f"set({k!r}, <{type(v).__name__} {len(v)}>)"
        if self.over_limit(v):
            out = self.run(what, lambda s: s.set(k, v), {"elastic": self.e})["elastic"]
            self.expect_refused_as_too_big(out, what)
        else:
            self.same(self.run(what, lambda s: s.set(k, v)))
        self.compare_keys([k])

    def op_get(self):
        k = self.rng.choice(self.keys)
        if self.current(k) is None:
            if self.blocking_left <= 0:
                return
            self.blocking_left -= 1
            out = self.same(self.run(f"get({k!r}) [missing]", lambda s: s.get(k)))
            self.expect_timeout(out, self.timeout_s, f"get({k!r})")
            return
        self.same(self.run(f"get({k!r})", lambda s: s.get(k)))

    def op_wait(self):
        keys = self.pick_keys(0, 3)
        missing = any(self.current(k) is None for k in keys)
        if missing and self.blocking_left <= 0:
            keys = self.pick_keys(0, 3, present=True)
            missing = False
        timeout = self.rng.choice([None, "td", "float"])
        t_s = round(self.rng.uniform(0.05, 0.25), 3)
        # steer: never a zero timeout in the differential run (it means "no timeout" here and in
        # HashStore but "at once" in TCPStore); test_zero_timeout_means_no_timeout covers it.
        arg = None if timeout is None else (td(t_s) if timeout == "td" else t_s)
        if self.via_prefix and timeout == "float":
            arg = td(t_s)  # PrefixStore.wait takes a timedelta only
        what = f"wait({keys!r}, {arg!r})" + (" [missing]" if missing else "")
        if missing:
            self.blocking_left -= 1
        fn = (lambda s: s.wait(keys)) if arg is None else (lambda s: s.wait(keys, arg))
        out = self.same(self.run(what, fn))
        if missing:
            self.expect_timeout(out, self.timeout_s if arg is None else t_s, what)

    def op_multi_get(self):
        keys = self.pick_keys(0, 4, present=True)
        missing = False
        if self.blocking_left > 0 and self.rng.random() < 0.3:
            absent = [k for k in self.keys if self.current(k) is None]
            if absent:
                keys = keys + [self.rng.choice(absent)]
                self.rng.shuffle(keys)
                missing = True
                self.blocking_left -= 1
        out = self.same(self.run(f"multi_get({keys!r})" + (" [missing]" if missing else ""), lambda s: s.multi_get(keys)))
        if missing:
            self.expect_timeout(out, self.timeout_s, "multi_get")

    def op_add(self):
        k = self.rng.choice(self.keys)
        amount = self.rng.choice([0, 1, -1, 2, 5, -7, 100, 2**62, -(2**62)])
        if self.rng.random() < 0.05:  # (added int(amount): test_BUG_add_takes_a_float_or_str_amount, fixed)
            bad = self.rng.choice([1.5, "5", None, b"1"])
            self.same(self.run(f"add({k!r}, {bad!r})", lambda s: s.add(k, bad)))
            return
        cur = self.current(k)
        what = f"add({k!r}, {amount}) on {cur[:24] if cur is not None else None!r}"
        whole = cur is None or _WHOLE.fullmatch(cur)
        base = 0 if cur is None else (int(cur) if whole else None)
        if whole and INT64[0] <= base <= INT64[1] and INT64[0] <= base + amount <= INT64[1]:
            out = self.same(self.run(what, lambda s: s.add(k, amount)))
            if out.value != base + amount:
                self.fail(f"{what}: returned {out.value}, expected {base + amount}")
            self.compare_keys([k])
            return
        # Every other case: only elasticrl is called (TCPStore's server drops the connection when
        # stoll throws, so it would be unusable for the rest of the sequence).
        out = self.run(what, lambda s: s.add(k, amount), {"elastic": self.e})["elastic"]
        if not isinstance(out.exc, InvalidRequestError):
            self.fail(f"{what}: expected InvalidRequestError, got {out!r}")
        msg = str(out.exc)
        if whole:
            # DIFFERENCE (kv.kv_add, deliberate): past int64 the coordinator refuses ("would
            # overflow int64") where TCPStore/HashStore wrap around (signed overflow in C++) or,
            # for a stored value already out of range, throw std::out_of_range (HashStore:
            # IndexError; TCPStore: the server drops the connection).
            if "overflow int64" not in msg:
                self.fail(f"{what}: the overflow error should say so: {msg!r}")
        else:
            if "not a decimal integer" not in msg or repr(as_bytes(k))[2:-1][:10] not in msg:
                self.fail(f"{what}: the error should name the key and why: {msg!r}")
            if cur != b"" and not _STOLL_PREFIX.match(cur):
                # No leading number: HashStore throws too, as a ValueError (message "stoll").
                ref = self.run(what, lambda s: s.add(k, amount), {"hash": self.h})["hash"]
                if ref.exc is None or category(ref.exc) != "ValueError":
                    self.fail(f"{what}: HashStore gave {ref!r}")
            # else DIFFERENCE (kv._DECIMAL: "as TCPStore's std::stoll does with a whole value"):
            # torch adds to the leading number of "5abc" / " 5 " / "1.5" (and HashStore reads ""
            # as 0, while TCPStore's server drops the connection); the coordinator refuses them.
        self.compare_keys([k])  # nothing changed anywhere

    def op_compare_set(self):
        k = self.rng.choice(self.keys)
        cur = self.current(k)
        r = self.rng.random()
        expected = (cur if cur is not None else "") if r < 0.45 else ("" if r < 0.7 else self.value(allow_big=False))
        desired = self.value(allow_big=False)
        what = f"compare_set({k!r}, <{len(expected)}>, <{len(desired)}>) on <{None if cur is None else len(cur)}>"
        self.same(self.run(what, lambda s: s.compare_set(k, expected, desired)))
        self.compare_keys([k])

    def op_check(self):
        keys = self.pick_keys(0, 4)
        self.same(self.run(f"check({keys!r})", lambda s: s.check(keys)))

    def op_delete(self):
        k = self.rng.choice(self.keys)
        self.same(self.run(f"delete_key({k!r})", lambda s: s.delete_key(k)))
        self.compare_keys([k])

    def op_num_keys(self):
        self.same(self.run("num_keys()", lambda s: s.num_keys()))

    def op_multi_set(self):
        n = self.rng.randint(0, 4)  # (empty raised: test_BUG_multi_set_of_no_keys_raises, fixed)
        keys = [self.rng.choice(self.keys) for _ in range(n)]  # duplicates: the last value wins
        values = [self.value() for _ in range(n)]
        what = f"multi_set({keys!r}, <{[len(v) for v in values]}>)"
        if any(self.over_limit(v) for v in values):
            before = {as_bytes(k): self.current(k) for k in keys}
            out = self.run(what, lambda s: s.multi_set(keys, values), {"elastic": self.e})["elastic"]
            self.expect_refused_as_too_big(out, what)
            # ... and none of the batch was written.
            for k in keys:
                got = self.e.get(k) if self.e.check([k]) else None
                if got != before[as_bytes(k)]:
                    self.fail(f"{what}: refused batch changed {k!r}")
        else:
            self.same(self.run(what, lambda s: s.multi_set(keys, values)))
        self.compare_keys(keys)

    def op_append(self):
        k, v = self.rng.choice(self.keys), self.value()
        cur = self.current(k)
        what = f"append({k!r}, <{len(v)}>) on <{None if cur is None else len(cur)}>"
        if len(cur or b"") + len(v) > LIMIT:
            out = self.run(what, lambda s: s.append(k, v), {"elastic": self.e})["elastic"]
            self.expect_refused_as_too_big(out, what)
        else:
            self.same(self.run(what, lambda s: s.append(k, v)))
        self.compare_keys([k])

    def op_set_timeout(self):
        # steer: at least 50 ms (zero means "no timeout" and would block a missing-key get).
        self.timeout_s = self.rng.choice([0.05, 0.1, 0.15, 0.2])
        for s in (self.e_base, self.h_base, self.t_base):
            s.set_timeout(td(self.timeout_s))
        self.same(self.run(f"set_timeout({self.timeout_s}) -> timeout", lambda s: s.timeout,
                           {"elastic": self.e_base, "hash": self.h_base, "tcp": self.t_base}))

    OPS = {
        "set": 14, "get": 8, "add": 12, "compare_set": 10, "check": 6, "wait": 7, "delete": 6,
        "num_keys": 4, "multi_get": 6, "multi_set": 7, "append": 8, "set_timeout": 2,
    }

    def step(self) -> None:
        name = self.rng.choices(list(self.OPS), weights=list(self.OPS.values()))[0]
        getattr(self, "op_" + name)()

    def final_check(self) -> None:
        self.compare_keys(self.keys)
        self.op_num_keys()


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def _hashable(x):
    if isinstance(x, tuple):
        return tuple(_hashable(i) for i in x)
    if isinstance(x, (list, bytearray)):
        return ("list", tuple(_hashable(i) for i in x)) if isinstance(x, list) else bytes(x)
    return x


@pytest.mark.timeout(40)
@pytest.mark.parametrize("seed", range(N_SEEDS))
def test_random_ops_match_torch(seed, client):
    d = Differential(seed, client)
    try:
        for _ in range(STEPS):
            d.step()
        d.final_check()
    finally:
        del d.t, d.t_base  # the TCPStore server stops with its last reference


# -- two clients on one prefix -------------------------------------------------------------------


def _pairs(kind: str, client, second_client):
    """(waiter store, writer store, cleanup) for one kind: two clients of one store."""
    if kind == "elastic":
        run = fresh_run("two")
        a = CoordinatorStore(client, run, "two/", timeout_s=5)
        b = CoordinatorStore(second_client, run, "two/", timeout_s=5)
        return a, b
    if kind == "tcp":
        server = tcp_server(5)
        other = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=td(5))
        return server, other
    raise ValueError(kind)


WRITERS = ["set", "multi_set", "add", "compare_set", "append"]
WAITERS = ["wait", "wait_store_timeout", "get", "multi_get"]


def _write(store, how: str, keys: list[str]) -> None:
    if how == "set":
        for k in keys:
            store.set(k, f"v-{k}")
    elif how == "multi_set":
        store.multi_set(keys, [f"v-{k}" for k in keys])
    elif how == "add":
        for k in keys:
            store.add(k, 7)
    elif how == "compare_set":
        for k in keys:
            store.compare_set(k, "", f"v-{k}")
    else:
        for k in keys:
            store.append(k, f"v-{k}")


def _wait(store, how: str, keys: list[str]):
    if how == "wait":
        return store.wait(keys, td(5))
    if how == "wait_store_timeout":
        return store.wait(keys)
    if how == "get":
        return [store.get(k) for k in keys]
    return store.multi_get(keys)


@pytest.mark.timeout(40)
@pytest.mark.parametrize("seed", range(5))
def test_two_clients_one_waits_while_the_other_writes(seed, client, second_client):
    # The seeds cover every writer and every waiter; keys and delay are random.
    rng = random.Random(1000 + seed)
    keys = rng.sample(["w1", "w2", "wü", "w/3", ""], rng.randint(1, 3))
    writer, waiter = WRITERS[seed % len(WRITERS)], WAITERS[(seed * 3) % len(WAITERS)]
    delay = rng.uniform(0.05, 0.3)
    results = {}
    # The reference is TCPStore (a server and a client). HashStore is in-process only, and its
    # add() does not wake waiters (they return at their timeout), so it is no reference here.
    for kind in ("elastic", "tcp"):
        a, b = _pairs(kind, client, second_client)
        b.set("unrelated", "x")  # a write that wakes nobody's keys
        box: dict = {}

        def wait_side(a=a, box=box):
            box["out"] = Outcome(lambda: _wait(a, waiter, keys))

        th = threading.Thread(target=wait_side, daemon=True)
        th.start()
        time.sleep(delay)
        _write(b, writer, keys)
        th.join(timeout=10)
        assert not th.is_alive(), f"{kind}: {waiter} still blocked 10 s after {writer} of {keys}"
        out = box["out"]
        assert out.exc is None, f"{kind}: {waiter} after {writer}: {out!r}"
        assert out.elapsed < delay + SLACK_S, f"{kind}: woke {out.elapsed - delay:.2f}s after the write"
        results[kind] = (out.key, a.multi_get(keys), b.num_keys())
        del a, b
    assert results["elastic"] == results["tcp"], (writer, waiter, keys, results)


@pytest.mark.timeout(30)
def test_two_clients_a_wait_for_other_keys_times_out(client, second_client):
    for kind in ("elastic", "tcp"):
        a, b = _pairs(kind, client, second_client)
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("out", Outcome(lambda: a.wait(["late"], td(0.4)))), daemon=True)
        th.start()
        time.sleep(0.05)
        # Writes of other keys (one a prefix of the awaited key, one with it as a prefix) wake
        # the waiter on the coordinator (a run-wide signal) but must not release it.
        b.set("early", "1")
        b.add("late-but-not-this", 1)
        b.set("lat", "1")
        b.multi_set(["x", "y"], ["1", "2"])
        th.join(timeout=10)
        out = box["out"]
        assert category(out.exc) == "DistStoreError" and "wait timeout" in str(out.exc), (kind, out)
        assert 0.32 <= out.elapsed <= 0.4 + SLACK_S, (kind, out.elapsed)
        # A key set and deleted by the other client is not there for a new waiter.
        b.set("late", "1")
        assert b.delete_key("late") is True
        out = Outcome(lambda: a.wait(["late"], td(0.3)))
        assert category(out.exc) == "DistStoreError" and 0.24 <= out.elapsed <= 0.3 + SLACK_S, (kind, out)
        del a, b


@pytest.mark.timeout(40)
@pytest.mark.parametrize("seed", range(2))
def test_two_clients_race_add_append_compare_set(seed, client, second_client):
    rng = random.Random(2000 + seed)
    n = rng.randint(10, 20)
    summary = {}
    for kind in ("elastic", "tcp"):
        a, b = _pairs(kind, client, second_client)
        got: dict[str, list] = {"A": [], "B": []}
        won: dict[str, bytes] = {}

        def work(store, me):
            for i in range(n):
                got[me].append(store.add("cnt", 1))
                store.append("log", f"{me}{i:02d}|")
            won[me] = store.compare_set("flag", "", me)

        threads = [threading.Thread(target=work, args=(s, me), daemon=True) for s, me in ((a, "A"), (b, "B"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=25)
        assert not any(th.is_alive() for th in threads), kind
        # Every add returned a distinct value and none was lost.
        assert sorted(got["A"] + got["B"]) == list(range(1, 2 * n + 1)), (kind, got)
        log = a.get("log").decode()
        tokens = [t for t in log.split("|") if t]
        assert sorted(tokens) == sorted(f"{me}{i:02d}" for me in "AB" for i in range(n)), (kind, log)
        assert [t for t in tokens if t[0] == "A"] == [f"A{i:02d}" for i in range(n)], (kind, log)  # per-client order
        # One compare_set created the flag; the other saw the winner's value.
        flag = a.get("flag")
        assert flag in (b"A", b"B") and won["A"] == won["B"] == flag, (kind, won, flag)
        summary[kind] = (a.get("cnt"), len(tokens), a.num_keys())
        del a, b
    assert summary["elastic"] == summary["tcp"], summary


# -- timeouts ------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
@pytest.mark.parametrize("timeout_s", [0.1, 0.6])
def test_every_blocking_call_honours_its_timeout(timeout_s, client):
    e = CoordinatorStore(client, fresh_run("to"), "to/", timeout_s=timeout_s)
    e.set("here", "1")
    h = dist.HashStore()
    h.set_timeout(td(0.05))
    h.set("here", "1")
    t = tcp_server()
    t.set_timeout(td(0.05))
    t.set("here", "1")
    calls = {
        "wait(timeout)": lambda s, t_s: s.wait(["here", "nope"], td(t_s)),
        "wait(float)": lambda s, t_s: s.wait(["nope"], t_s),
        "wait(store timeout)": lambda s, t_s: s.wait(["nope"]),
        "get": lambda s, t_s: s.get("nope"),
        "multi_get": lambda s, t_s: s.multi_get(["here", "nope"]),
        "PrefixStore.get": lambda s, t_s: dist.PrefixStore("p", s).get("nope"),
        "PrefixStore.wait(timeout)": lambda s, t_s: dist.PrefixStore("p", s).wait(["nope"], td(t_s)),
    }
    for name, call in calls.items():
        ref = {n: Outcome(lambda s=s: call(s, 0.05)) for n, s in (("hash", h), ("tcp", t))}
        out = Outcome(lambda: call(e, timeout_s))
        assert category(out.exc) == category(ref["hash"].exc) == category(ref["tcp"].exc) == "DistStoreError", (name, out, ref)
        assert "wait timeout" in str(out.exc) and "nope" in str(out.exc), (name, out)
        assert timeout_s * 0.8 <= out.elapsed <= timeout_s + SLACK_S, (name, timeout_s, out.elapsed)


@pytest.mark.timeout(30)
def test_zero_timeout_means_no_timeout(client, second_client):
    """DIFFERENCE (documented in the store's docstring, "a zero timeout means no timeout"): a zero
    ``wait`` timeout, or ``set_timeout(0)``, waits until the keys exist, as HashStore does (and as
    torch's ``kNoTimeout`` constant says). Note: the docstring says this "follows TCPStore", but
    torch 2.13's TCPStore raises DistStoreError at once for a zero timeout."""
    run = fresh_run("zero")
    a = CoordinatorStore(client, run, "z/", timeout_s=5)
    b = CoordinatorStore(second_client, run, "z/", timeout_s=5)
    h = dist.HashStore()
    for waiter, writer in ((a, b), (h, h)):
        waiter.set_timeout(td(0))
        for call in (lambda: waiter.wait(["k1"], td(0)), lambda: waiter.get("k2")):
            timer = threading.Timer(0.5, lambda: (writer.set("k1", "1"), writer.set("k2", "2")))
            timer.start()
            try:
                out = Outcome(call)
            finally:
                timer.join(timeout=10)
            assert out.exc is None and 0.4 <= out.elapsed < 0.5 + SLACK_S, (waiter, out)
            writer.delete_key("k1")
            writer.delete_key("k2")


@pytest.mark.timeout(20)
def test_ops_elasticrl_does_not_implement_fail_clearly(client):
    """torch's queue ops and list_keys are not implemented (torchrun uses neither; only torch's
    debug handlers call list_keys): they raise NotImplementedError, as torch's base Store does,
    where HashStore/TCPStore implement them."""
    e = CoordinatorStore(client, fresh_run("noq"), "q/", timeout_s=1)
    for call in (lambda s: s.queue_push("q", "a"), lambda s: s.queue_pop("q", False), lambda s: s.queue_len("q"),
                 lambda s: s.list_keys()):
        for s in (e, dist.PrefixStore("p", e)):
            with pytest.raises(NotImplementedError, match="not implemented"):
                call(s)


# -- bugs ----------------------------------------------------------------------------------------


@pytest.fixture
def store(client):
    return CoordinatorStore(client, fresh_run("bug"), "bug/", timeout_s=1)


@pytest.mark.timeout(20)
def test_BUG_int_value_is_stored_as_nul_bytes(store):
    calls = {
        "set": lambda s: s.set("k", 5),
        "compare_set": lambda s: s.compare_set("k", "", 3),
        "append": lambda s: s.append("k", 2),
        "multi_set": lambda s: s.multi_set(["k"], [4]),
    }
    ref = dist.HashStore()
    for name, call in calls.items():
        assert category(Outcome(lambda: call(ref)).exc) == "TypeError", name
    assert not ref.check(["k"])
    wrong = {}
    for name, call in calls.items():
        out = Outcome(lambda: call(store))
        if category(out.exc) != "TypeError":
            wrong[name] = (out, store.get("k") if store.check(["k"]) else None)
            store.delete_key("k")
    assert not wrong, f"torch raises TypeError for an int value; elasticrl: {wrong}"


@pytest.mark.timeout(20)
def test_BUG_multi_set_of_no_keys_raises(store):
    for ref in (dist.HashStore(), tcp_server()):
        ref.multi_set([], [])
    store.multi_set([], [])
    assert store.num_keys() == 0


@pytest.mark.timeout(20)
def test_BUG_add_takes_a_float_or_str_amount(store):
    ref = dist.HashStore()
    for amount in (1.5, "5"):
        assert category(Outcome(lambda: ref.add("n", amount)).exc) == "TypeError"
    got = {amount: Outcome(lambda: store.add("n", amount)) for amount in (1.5, "5")}
    assert all(category(o.exc) == "TypeError" for o in got.values()), f"torch raises TypeError; elasticrl: {got}"


@pytest.mark.timeout(20)
def test_BUG_empty_key_refused_with_default_prefix(client):
    ref = dist.HashStore()
    ref.set("", "v")
    assert ref.get("") == b"v"
    store = CoordinatorStore(client, fresh_run("bug-empty"), timeout_s=1)  # prefix "" (the default)
    store.set("", "v")
    assert store.get("") == b"v"
