"""The coordinator's key-value store (enough to back a ``torch.distributed.Store``), a part of
``CoordinatorCore`` kept in its own module.

It follows the core's rule (decide, write to SQLite in one transaction, then change memory) and
uses the core's state: ``runs``, ``db``, ``replies`` (exactly-once for retried writes), ``limits``,
``_kv_signals`` and its run lookups and fencing (``_run``, ``_run_or_new``, ``_fence``).
"""

from __future__ import annotations

import asyncio
import re

from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.replies import Replies
from elasticrl.coordinator.signals import Signals
from elasticrl.coordinator.state import Run
from elasticrl.errors import CoordinatorTimeoutError, InvalidRequestError, ResourceLimitError

# What add() reads as an integer, as TCPStore's std::stoll does with a whole value (no "1_0",
# which Python's int() takes).
_DECIMAL = re.compile(rb"\s*[+-]?[0-9]+")


class KeyValueOps:
    """Mixed into ``CoordinatorCore``, which provides these (and ``limits``, ``_run``,
    ``_run_or_new``, ``_fence``)."""

    runs: dict[str, Run]
    db: StateDB
    replies: Replies
    _kv_signals: Signals

    def _kv_writer(self, run_id: str, writer: tuple[str, int] | None) -> Run:
        """The run a KV write goes to; ``writer`` (member id, incarnation), when given, must be
        live: a fenced zombie's writes are refused. Without it anyone may write (torch Stores)."""
        if writer is None:
            return self._run_or_new(run_id)
        run = self._run(run_id)
        self._fence(run, *writer)
        return run

    def kv_set(
        self, run_id: str, pairs: list[tuple[bytes, bytes]], *, request_id: str = "", writer: tuple[str, int] | None = None,
    ) -> None:
        if self.replies.get(request_id, "kv_set") is not None:
            return
        self._kv_write(self._kv_writer(run_id, writer), pairs, (request_id, "kv_set", {}))

    def _kv_write(self, run: Run, pairs: list[tuple[bytes, bytes]], reply: tuple[str, str, object]) -> None:
        pairs = list(dict(pairs).items())  # the last value of a repeated key wins, counted once
        grow = sum(len(k) + len(v) - (len(k) + len(run.kv[k]) if k in run.kv else 0) for k, v in pairs)
        self._check_kv_room(run, grow)
        with self.db.tx() as db:
            db.put_run(run)
            db.put_kv(run.run_id, pairs)
            self.replies.record(*reply)
        self.replies.remember(reply[0])
        for k, v in pairs:
            run.kv[k] = v
        run.kv_bytes += grow
        self._notify_kv(run.run_id)

    def _kv_reply(self, request_id: str, kind: str, result) -> None:
        """Store the answer of a KV call that changed nothing (a compare-set that did not swap),
        so its retry does not apply where the first attempt did not."""
        if request_id:
            with self.db.tx():
                self.replies.record(request_id, kind, result)
            self.replies.remember(request_id)

    def _check_kv_room(self, run: Run, grow: int) -> None:
        if run.kv_bytes + grow > self.limits.max_kv_bytes_per_run:
            raise ResourceLimitError(
                f"run {run.run_id!r} would hold {run.kv_bytes + grow} KV bytes "
                f"(limit {self.limits.max_kv_bytes_per_run}); delete keys or use a new run"
            )

    def kv_get(self, run_id: str, keys: list[bytes]) -> tuple[list[bytes | None], list[bytes]]:
        run = self.runs.get(run_id)
        kv = run.kv if run is not None else {}
        values = [kv.get(k) for k in keys]
        return values, [k for k, v in zip(keys, values) if v is None]

    async def kv_wait(self, run_id: str, keys: list[bytes], wait_s: float) -> list[bytes]:
        """Return the values of ``keys`` once all exist; CoordinatorTimeoutError after ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            values, missing = self.kv_get(run_id, keys)
            if not missing:
                return values  # type: ignore[return-value]
            left = deadline - loop.time()
            if left <= 0:
                shown = ", ".join(repr(k) for k in missing[:5])
                raise CoordinatorTimeoutError(f"keys not set within {wait_s:.3f}s: {shown}")
            await self._kv_signals.wait(run_id, left)

    def kv_compare_set(
        self, run_id: str, key: bytes, expected: bytes, desired: bytes, *,
        request_id: str = "", writer: tuple[str, int] | None = None,
    ) -> tuple[bytes, bool]:
        """torch.distributed.Store semantics (see the proto comment)."""
        done = self.replies.get(request_id, "kv_compare_set")
        if done is not None:
            return bytes.fromhex(done["value"]), done["swapped"]
        run = self._kv_writer(run_id, writer)
        current = run.kv.get(key)
        if (current is None and expected == b"") or (current is not None and current == expected):
            self._kv_write(run, [(key, desired)], (request_id, "kv_compare_set", {"value": desired.hex(), "swapped": True}))
            return desired, True
        value = expected if current is None else current
        self._kv_reply(request_id, "kv_compare_set", {"value": value.hex(), "swapped": False})
        return value, False

    def kv_add(self, run_id: str, key: bytes, delta: int, *, request_id: str = "", writer: tuple[str, int] | None = None) -> int:
        done = self.replies.get(request_id, "kv_add")
        if done is not None:
            return done["value"]
        run = self._kv_writer(run_id, writer)
        current = run.kv.get(key, b"0")
        try:
            if not _DECIMAL.fullmatch(current):
                raise ValueError(current)
            value = int(current) + delta
        except ValueError:
            raise InvalidRequestError(
                f"key: {key!r} holds {current[:32]!r}, not a decimal integer, so it cannot be added to"
            ) from None
        if not -(2**63) <= value < 2**63:
            raise InvalidRequestError(f"delta: {key!r} would overflow int64 ({value})")
        self._kv_write(run, [(key, str(value).encode())], (request_id, "kv_add", {"value": value}))
        return value

    def kv_delete(self, run_id: str, key: bytes, *, request_id: str = "", writer: tuple[str, int] | None = None) -> bool:
        done = self.replies.get(request_id, "kv_delete")
        if done is not None:
            return done["deleted"]
        if writer is not None:
            self._kv_writer(run_id, writer)
        run = self.runs.get(run_id)
        if run is None or key not in run.kv:
            self._kv_reply(request_id, "kv_delete", {"deleted": False})
            return False
        with self.db.tx() as db:
            db.delete_kv(run_id, key)
            self.replies.record(request_id, "kv_delete", {"deleted": True})
        self.replies.remember(request_id)
        run.kv_bytes -= len(key) + len(run.kv.pop(key))
        return True

    def kv_num_keys(self, run_id: str) -> int:
        run = self.runs.get(run_id)
        return 0 if run is None else len(run.kv)

    def _notify_kv(self, run_id: str) -> None:
        self._kv_signals.fire(run_id)

