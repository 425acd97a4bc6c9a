"""``CoordinatorStore``: a ``torch.distributed.Store`` whose keys live in the coordinator's KV.

The torchrun agent uses the store its rendezvous returns for ``_assign_worker_ranks`` (set,
multi_get, multi_set, get), ``RendezvousStoreInfo.build`` (set, get) and the exit barrier
(``store_util.barrier``: add, set, wait, set_timeout). Keys are bytes under a prefix (one per run
and round, ``torchrun/round-N/``), so nothing written in one round is read in another and no agent
process hosts the store: any node may die without taking the store with it.

Semantics follow ``TCPStore``: ``get``/``wait``/``multi_get`` block until the keys exist and raise
``torch.distributed.DistStoreError`` after the timeout (``set_timeout``, or the ``wait`` argument;
a zero timeout means no timeout, as in ``HashStore``: torch 2.13's ``TCPStore`` fails at once); an
unreachable coordinator, or one that does not answer a call within the client's call timeout,
raises ``DistNetworkError``. Keys and values are bytes or str (an int is a
``TypeError``, as in torch, not that many zero bytes); ``add`` takes an int. Where torch's stores
differ on purpose: a value over the coordinator's ``--max-kv-value-bytes`` (1 MiB) is refused, and
``add`` on a value that is not a whole decimal number raises ``ValueError`` (torch's ``stoll`` reads
its leading digits). Calls with more than ``validate.MAX_BATCH`` (4096) keys go in parts: each part
of a ``multi_set`` is atomic, not the whole.

Python subclasses of ``torch.distributed.Store`` work in torch 2.13 both when Python calls them
and when C++ does (through ``PrefixStore`` or a process group): the C++ trampoline looks up
``set``/``get``/``add``/``compare_set``/``wait``/``check``/``multi_get``/``multi_set``/``append``/
``has_extended_api`` by those names but ``getNumKeys`` and ``deleteKey`` in camel case, so both
spellings are defined here.

The trampoline holds only the C++ half of a Python store: once the Python object is collected,
every call from C++ fails ``INTERNAL ASSERT FAILED ... Not implemented``. So a ``CoordinatorStore``
must stay referenced from Python while C++ uses it (as any Python store must), and ``clone()``,
whose result C++ alone holds (``PrefixStore::clone``, ``_test_python_store``, a shrunk process
group), keeps every clone referenced from the store it was cloned from.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time

import torch.distributed as dist

from elasticrl.coordinator.client import CoordinatorClient
from elasticrl.coordinator.validate import MAX_BATCH
from elasticrl.errors import CoordinatorTimeoutError, CoordinatorUnavailableError

log = logging.getLogger(__name__)

# torch's Store::kNoTimeout is zero; "no timeout" is a long wait in bounded chunks here.
NO_TIMEOUT_S = 7 * 24 * 3600.0
# The longest append retry loop (compare-and-set contention) before giving up.
APPEND_RETRY_S = 30.0


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview, list, tuple)):  # list[int] from C++ callers
        return bytes(value)
    # bytes(5) is five zero bytes: torch refuses anything but str/bytes here.
    raise TypeError(f"a store key or value must be str or bytes, not {type(value).__name__}")


def _key_list(keys) -> list:
    if isinstance(keys, (str, bytes)):  # one key where a list is meant: "abc" is not ["a", "b", "c"]
        raise TypeError(f"keys must be a list of str or bytes, not {type(keys).__name__}")
    return list(keys)


def _parts(items: list) -> list[list]:
    """``items`` in runs of at most ``validate.MAX_BATCH`` (what one request takes)."""
    return [items[i:i + MAX_BATCH] for i in range(0, len(items), MAX_BATCH)]


def _seconds(timeout) -> float:
    if timeout is None:
        return 0.0
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class CoordinatorStore(dist.Store):
    """A store over the coordinator KV of ``run_id``, every key prefixed by ``prefix``."""

    def __init__(self, client: CoordinatorClient, run_id: str, prefix: str = "", *, timeout_s: float = 300.0):
        super().__init__()
        self._client = client
        self._run_id = run_id
        self._prefix = prefix.encode()
        # This store and its clones (transitively) share one list that references them all, so a
        # clone lives while any store of the family is referenced from Python; see the module doc.
        self._family: list[CoordinatorStore] = []
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    def _key(self, key) -> bytes:
        return self._prefix + _bytes(key)

    def _timeout_s(self, timeout=None) -> float:
        s = _seconds(self.timeout if timeout is None else timeout)
        return NO_TIMEOUT_S if s <= 0 else s

    @contextlib.contextmanager
    def _reaching(self):
        """A coordinator that cannot be reached, or does not answer within the client's call
        timeout (SIGSTOPped, say), is torch's ``DistNetworkError``, naming the store and the coordinator."""
        try:
            yield
        except (CoordinatorUnavailableError, CoordinatorTimeoutError) as exc:
            raise dist.DistNetworkError(f"store {self.prefix!r} of run {self._run_id!r}: {exc}") from None

    def _wait_values(self, keys: list, timeout=None) -> list[bytes]:
        if not keys:
            return []
        full = [self._key(k) for k in keys]
        timeout_s = self._timeout_s(timeout)
        deadline = time.monotonic() + timeout_s
        with self._reaching():  # what is left once a wait timeout is the store's own error
            try:
                values: list[bytes] = []
                for part in _parts(full):  # each part waits for what is left of the one timeout
                    values += self._client.kv_wait(self._run_id, part, max(deadline - time.monotonic(), 0.001))
                return values
            except CoordinatorTimeoutError:
                shown = ", ".join(repr(k.decode(errors="replace")) for k in full[:4])
                raise dist.DistStoreError(
                    f"wait timeout after {timeout_s * 1000:.0f}ms, keys: {shown} (run {self._run_id!r} "
                    f"on coordinator {self._client.address})"
                ) from None

    # -- the Store interface -------------------------------------------------------------------

    def set(self, key, value) -> None:
        with self._reaching():
            self._client.kv_set(self._run_id, [(self._key(key), _bytes(value))])

    def get(self, key) -> bytes:
        return self._wait_values([key])[0]

    def add(self, key, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):  # int(1.5) would add 1, int("5") 5
            raise TypeError(f"add: the amount must be an int, not {type(amount).__name__}")
        if not -(1 << 63) <= amount < 1 << 63:
            raise TypeError(f"add: the amount {amount} does not fit in an int64")
        with self._reaching():
            return self._client.kv_add(self._run_id, self._key(key), amount)

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        with self._reaching():
            value, _ = self._client.kv_compare_set(
                self._run_id, self._key(key), _bytes(expected_value), _bytes(desired_value)
            )
        return value

    def wait(self, keys, timeout=None) -> None:
        self._wait_values(_key_list(keys), timeout)

    def check(self, keys) -> bool:
        full = [self._key(k) for k in _key_list(keys)]
        if not full:
            return True
        with self._reaching():
            return all(v is not None for part in _parts(full) for v in self._client.kv_get(self._run_id, part))

    def delete_key(self, key) -> bool:
        with self._reaching():
            return self._client.kv_delete(self._run_id, self._key(key))

    deleteKey = delete_key  # the name torch's C++ trampoline looks up

    def num_keys(self) -> int:
        """Keys of the whole run, every prefix included (as ``PrefixStore`` over TCPStore counts)."""
        with self._reaching():
            return self._client.kv_num_keys(self._run_id)

    getNumKeys = num_keys  # the name torch's C++ trampoline looks up

    def multi_get(self, keys) -> list[bytes]:
        return self._wait_values(_key_list(keys))

    def multi_set(self, keys, values) -> None:
        keys, values = _key_list(keys), _key_list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs = [(self._key(k), _bytes(v)) for k, v in zip(keys, values)]
        if not pairs:
            return  # as torch's stores: nothing to set
        with self._reaching():
            for part in _parts(pairs):
                self._client.kv_set(self._run_id, part)

    def append(self, key, value) -> None:
        """Append to the value (creating it), atomically via compare-and-set retries."""
        full, tail = self._key(key), _bytes(value)
        give_up = time.monotonic() + APPEND_RETRY_S
        with self._reaching():
            while True:
                current = self._client.kv_get(self._run_id, [full])[0]
                expected = b"" if current is None else current
                _, swapped = self._client.kv_compare_set(self._run_id, full, expected, expected + tail)
                # An existing empty value and a missing key both match b"": either way it is set now.
                if swapped:
                    return
                if time.monotonic() > give_up:
                    raise dist.DistStoreError(f"append to {full!r}: value kept changing for {APPEND_RETRY_S:.0f}s")

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "CoordinatorStore":
        """A store over the same run, prefix and client, with its own timeout (a copy of this one's).

        The clone stays referenced (a few hundred bytes per call; torch clones rarely, e.g. in
        ``PrefixStore::clone`` or when it shrinks a group) until this store and all its clones are
        unreferenced: a C++ caller keeps only the C++ half, and without the Python half the
        trampoline finds no overrides.
        """
        twin = CoordinatorStore(self._client, self._run_id, self.prefix, timeout_s=_seconds(self.timeout))
        twin._family = self._family
        self._family.append(twin)
        return twin

    def __repr__(self) -> str:
        return f"CoordinatorStore(run={self._run_id!r}, prefix={self.prefix!r}, coordinator={self._client.address})"
