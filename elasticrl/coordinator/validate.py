"""Field checks for every request: each failure names the field, the bad value and what fits.

Plain Python values in, ``InvalidRequestError`` out; the servicer calls these while converting
messages, so nothing malformed reaches ``core``.
"""

from __future__ import annotations

import math
import re

from elasticrl.errors import InvalidRequestError

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@=+-]*")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@=+/-]*")

MAX_ID_LEN = 128
MAX_NAME_LEN = 256
MAX_HOST_LEN = 255
MAX_REASON_LEN = 1024
MAX_CAPABILITIES = 64
MAX_CAPABILITY_LEN = 256
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 1 << 20
MAX_BATCH = 4096
MAX_DURATION_MS = 7 * 24 * 3600 * 1000  # a week: anything longer is a unit mistake
MIN_LEASE_TTL_MS = 100
MAX_LEASE_TTL_MS = 3600 * 1000
MAX_NODES = 100_000
MAX_WEIGHT = 1e6


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Ids and names found valid before: the same few recur in every request (each member's id in
# each of its keep-alives and arrivals), and a set lookup is ~5x cheaper than the regex. Bounded:
# emptied when full.
_VALID_IDS: set[str] = set()
_VALID_NAMES: set[str] = set()
_VALID_MAX = 16384


def ident(field: str, value: str, *, remember: bool = True) -> str:
    """Run and member ids: 1-128 characters of letters, digits and ``._:@=+-``. ``remember``
    False: an id seen once (a task's), kept out of the remembered set, which holds the ids that
    recur."""
    if value in _VALID_IDS:
        return value
    if not value:
        raise InvalidRequestError(f"{field}: must not be empty")
    if len(value) > MAX_ID_LEN or not ID_RE.fullmatch(value):
        raise InvalidRequestError(
            f"{field}: {_shown(value)} is not a valid id; use 1-{MAX_ID_LEN} characters of "
            "letters, digits and ._:@=+- starting with a letter or digit"
        )
    if remember:
        _remember(_VALID_IDS, value)
    return value


def name(field: str, value: str) -> str:
    """Barrier names: like ids, but up to 256 characters and ``/`` allowed (``iter-3/rollout``)."""
    if value in _VALID_NAMES:
        return value
    if not value:
        raise InvalidRequestError(f"{field}: must not be empty")
    if len(value) > MAX_NAME_LEN or not NAME_RE.fullmatch(value):
        raise InvalidRequestError(
            f"{field}: {_shown(value)} is not a valid name; use 1-{MAX_NAME_LEN} characters of "
            "letters, digits and ._:@=+/- starting with a letter or digit"
        )
    _remember(_VALID_NAMES, value)
    return value


def _remember(valid: set[str], value: str) -> None:
    if len(valid) >= _VALID_MAX:
        valid.clear()
    valid.add(value)


def member_ref(field: str, ref) -> tuple[str, int]:
    """A ``MemberRef`` message's (member id, incarnation). (The field names are built only for an
    error: this runs once per member per barrier and keep-alive.)"""
    member_id, inc = ref.member_id, ref.incarnation
    if member_id not in _VALID_IDS:
        ident(f"{field}.member_id", member_id)
    if inc <= 0:
        incarnation(f"{field}.incarnation", inc)
    return member_id, inc


def text(field: str, value: str, max_len: int) -> str:
    if len(value) > max_len:
        raise InvalidRequestError(f"{field}: {len(value)} characters, at most {max_len} allowed")
    return value


def duration_ms(field: str, value: int, *, allow_zero: bool = True, low: int = 1, high: int = MAX_DURATION_MS) -> float:
    """Milliseconds in, seconds out. Zero is allowed where the caller gives it a meaning."""
    if value == 0 and allow_zero:
        return 0.0
    if value < low or value > high:
        zero = "0 or " if allow_zero else ""
        raise InvalidRequestError(f"{field}: {value} ms is out of range; expected {zero}{low}..{high} ms")
    return value / 1000.0


def weight(field: str, value: float) -> float:
    if value == 0:
        return 1.0
    if not math.isfinite(value) or value < 0 or value > MAX_WEIGHT:
        raise InvalidRequestError(f"{field}: {value!r} must be a finite number in (0, {MAX_WEIGHT:g}] (0 means 1.0)")
    return float(value)


def capabilities(field: str, value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_CAPABILITIES:
        raise InvalidRequestError(f"{field}: {len(value)} entries, at most {MAX_CAPABILITIES} allowed")
    for k, v in value.items():
        if not k or len(k) > MAX_CAPABILITY_LEN or len(v) > MAX_CAPABILITY_LEN:
            raise InvalidRequestError(
                f"{field}[{_shown(k)}]: keys must be 1-{MAX_CAPABILITY_LEN} and values at most "
                f"{MAX_CAPABILITY_LEN} characters"
            )
    return dict(value)


def key(field: str, value: bytes) -> bytes:
    """A KV key: any bytes up to ``MAX_KEY_BYTES``, the empty key too (torch's stores take it)."""
    if len(value) > MAX_KEY_BYTES:
        raise InvalidRequestError(f"{field}: {len(value)} bytes, at most {MAX_KEY_BYTES} allowed")
    return bytes(value)


def value(field: str, data: bytes, max_bytes: int = MAX_VALUE_BYTES) -> bytes:
    """A KV value of at most ``max_bytes`` (the coordinator's ``--max-kv-value-bytes``)."""
    if len(data) > max_bytes:
        raise InvalidRequestError(
            f"{field}: {len(data)} bytes, at most {max_bytes} allowed; the KV store is for "
            "control data, not payloads (start the coordinator with --max-kv-value-bytes N to raise the limit)"
        )
    return bytes(data)


def batch(field: str, items: list, *, allow_empty: bool = False) -> list:
    if not items and not allow_empty:
        raise InvalidRequestError(f"{field}: must not be empty")
    if len(items) > MAX_BATCH:
        raise InvalidRequestError(f"{field}: {len(items)} entries, at most {MAX_BATCH} per request")
    return list(items)


def incarnation(field: str, value: int) -> int:
    if value <= 0:
        raise InvalidRequestError(f"{field}: must be the positive incarnation Join returned, got {value}")
    return value


def round_config(field: str, min_nodes: int, max_nodes: int) -> tuple[int, int]:
    if min_nodes < 1 or min_nodes > MAX_NODES:
        raise InvalidRequestError(f"{field}.min_nodes: {min_nodes} must be in 1..{MAX_NODES}")
    if max_nodes < min_nodes or max_nodes > MAX_NODES:
        raise InvalidRequestError(
            f"{field}.max_nodes: {max_nodes} must be in min_nodes..{MAX_NODES} (min_nodes={min_nodes})"
        )
    return min_nodes, max_nodes
