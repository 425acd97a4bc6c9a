"""Exactly-once for retried calls: the result of each recent mutating request, by its request id.

Clients retry a call that failed in transit (the coordinator restarting after ``kill -9``, say),
and a call may have been applied before the failure. Every mutating request therefore carries an
idempotency key the client made for that logical call; the core writes the call's result under
that key in the same SQLite transaction as the change itself, and a retry finds the result and
gets it back instead of applying the change again (the pattern of Stripe's idempotency keys and
of Raft client sessions). The same call with another key is a new call.

The table holds the newest ``keep`` ids (a retry comes within a client's reconnect budget, seconds
to minutes, so old ids are never asked for again); older ones are dropped in batches.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import sqlite3

from elasticrl.errors import InvalidRequestError

MAX_REQUEST_ID_LEN = 64
_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")
DEFAULT_KEEP = 100_000

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS replies (request_id TEXT PRIMARY KEY, kind TEXT NOT NULL, result TEXT NOT NULL);
"""


def request_id(field: str, value: str) -> str:
    """Validate an idempotency key: empty (no replay) or 1-64 characters of ``[A-Za-z0-9._:-]``."""
    if value and (len(value) > MAX_REQUEST_ID_LEN or not _ID_RE.fullmatch(value)):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise InvalidRequestError(
            f"{field}: {shown!r} is not a valid request id; use 1-{MAX_REQUEST_ID_LEN} characters of "
            "letters, digits and ._:- (a UUID), or leave it empty"
        )
    return value


class Replies:
    """Stored results by request id: the ids in memory (a lookup per call costs a dict probe), the
    results in SQLite only (read back on the rare retry), so each kept id costs about 150 bytes.

    ``conn`` is the coordinator's SQLite connection: ``record`` must run inside the transaction
    of the change it answers, ``remember`` after that transaction committed.
    """

    def __init__(self, conn, *, keep: int = DEFAULT_KEEP):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._conn = conn
        self.keep = keep
        conn.executescript(_SCHEMA)
        # Insertion-ordered: the oldest ids are dropped first.
        self._ids: dict[str, None] = dict.fromkeys(
            rid for (rid,) in conn.execute("SELECT request_id FROM replies ORDER BY rowid")
        )
        self.replayed = 0
        """Retries answered from a stored result (a metric for tests and benches)."""

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, rid: str, kind: str):
        """The stored result of ``rid``, or None when it is new (or empty). The same id used for
        another kind of call is a client bug: refused rather than answered with the wrong shape."""
        if not rid or rid not in self._ids:
            return None
        row = self._conn.execute("SELECT kind, result FROM replies WHERE request_id=?", (rid,)).fetchone()
        if row is None:  # dropped from SQLite by a trim that memory has not seen: a new call
            return None
        if row[0] != kind:
            raise InvalidRequestError(
                f"request_id: {rid!r} was already used for a {row[0]} call, not {kind}; make a new id per call"
            )
        self.replayed += 1
        return json.loads(row[1])

    def record(self, rid: str, kind: str, result) -> None:
        """Write ``result`` for ``rid``; call inside the change's transaction."""
        if rid:
            self._conn.execute(
                "INSERT OR REPLACE INTO replies(request_id, kind, result) VALUES (?, ?, ?)",
                (rid, kind, json.dumps(result, separators=(",", ":"))),
            )

    def remember(self, rid: str) -> None:
        """Note ``rid`` once its transaction committed; drop the oldest ids past ``keep`` (in
        batches of a tenth, so the delete is rare)."""
        if not rid:
            return
        self._ids[rid] = None
        excess = len(self._ids) - self.keep
        if excess > max(1, self.keep // 10):
            for old in list(itertools.islice(self._ids, excess)):
                del self._ids[old]
            oldest = next(iter(self._ids))
            try:
                self._conn.execute(
                    "DELETE FROM replies WHERE rowid < (SELECT rowid FROM replies WHERE request_id=?)", (oldest,)
                )
            except sqlite3.Error:  # the change this answers is committed: only the trim waits
                log.warning("could not trim the stored request ids; retrying with the next call", exc_info=True)
