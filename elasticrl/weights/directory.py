"""The coordinator's directory of policy-weight holders: metadata only, never the bytes.

Per run it keeps the newest announced version (``total_bytes``, ``sha256``, ``format``) and its
holders: ``host:port`` of each process that serves it, whether that holder has all of it, which
holder it reads from (its *source*) and how many readers it has. ``locate`` picks a source for a
new reader and registers the reader at once as a holder still receiving, so the next reader can
read behind it: the holder with the fewest readers wins, ties going to the newest holder. With
every reader arriving at about the same time this builds a chain (trainer -> w1 -> w2 -> ...):
each link carries the blob once, so the time to reach K workers barely grows with K where every
worker has its own network link. A worker that joins later reads from a complete peer with no
reader yet, not from the trainer.

A reader never gets one of its own descendants as source (they read behind it: the pair would
wait on each other). Holders a reader reports unreachable are dropped. State is in memory only:
after a coordinator restart the trainer's next announce and every worker's next locate rebuild it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re

from elasticrl.coordinator import validate as v
from elasticrl.errors import FencedError, InvalidRequestError, ResourceLimitError
from elasticrl.scheduler.weights import FORMAT

MAX_HOLDERS = 65536
"""Holders per run (a 512-node x 8-GPU cluster has 4096 engines)."""
MAX_RUNS = 4096
MAX_WAIT_S = 60.0
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})")


def address(field: str, value: str, *, allow_empty: bool = False) -> str:
    """``host:port`` (IPv6 hosts in brackets)."""
    if not value and allow_empty:
        return ""
    m = _ADDRESS_RE.fullmatch(value or "")
    if not m or not 0 < int(m.group(2)) < 65536 or len(value) > v.MAX_HOST_LEN:
        raise InvalidRequestError(f"{field}: {value[:80]!r} is not host:port (e.g. 10.0.0.5:41000)")
    return value


@dataclasses.dataclass(frozen=True)
class Version:
    version: int
    total_bytes: int
    sha256: str
    format: str = FORMAT

    @classmethod
    def checked(cls, version: int, total_bytes: int, sha256: str, format: str) -> "Version":
        if version < 0:
            raise InvalidRequestError(f"version: {version} must be >= 0")
        if total_bytes < 1:
            raise InvalidRequestError(f"total_bytes: {total_bytes} must be >= 1")
        if not _SHA256_RE.fullmatch(sha256 or ""):
            raise InvalidRequestError(f"sha256: {sha256[:80]!r} must be 64 lowercase hex digits")
        if format != FORMAT:
            raise InvalidRequestError(f"format: {format!r} must be {FORMAT!r}")
        return cls(version, total_bytes, sha256, format)


@dataclasses.dataclass
class Holder:
    member_id: str
    address: str
    complete: bool
    source: str = ""  # the member it reads from; "" for a root (the trainer) or once complete
    readers: int = 0
    seq: int = 0


@dataclasses.dataclass(frozen=True)
class Source:
    """The answer to a locate: the version, and where to read it."""

    version: Version
    member_id: str
    address: str
    complete: bool


class _Run:
    def __init__(self) -> None:
        self.newest: Version | None = None
        self.holders: dict[str, Holder] = {}
        self.changed = asyncio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class WeightDirectory:
    """Who holds which run's newest weights. Call from the coordinator's event loop only."""

    def __init__(self, *, max_holders: int = MAX_HOLDERS, max_runs: int = MAX_RUNS):
        self.max_holders = max_holders
        self.max_runs = max_runs
        self._runs: dict[str, _Run] = {}
        self._seq = itertools.count(1)

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            if len(self._runs) >= self.max_runs:
                raise ResourceLimitError(f"run_id: the weights directory already tracks {self.max_runs} runs")
            run = self._runs[run_id] = _Run()
        return run

    def newest(self, run_id: str) -> Version | None:
        run = self._runs.get(run_id)
        return None if run is None else run.newest

    def holders(self, run_id: str) -> list[Holder]:
        run = self._runs.get(run_id)
        return [] if run is None else list(run.holders.values())

    def announce(self, run_id: str, version: Version, member_id: str, addr: str, complete: bool) -> int:
        """Register ``member_id`` at ``addr`` as a holder of ``version``; returns the run's newest
        version afterwards. A newer version replaces the run's holders; an older one is ignored."""
        run = self._run(run_id)
        newest = run.newest
        if newest is not None and version.version < newest.version:
            return newest.version
        if newest is not None and version.version == newest.version and version != newest:
            raise FencedError(
                f"weights of run {run_id!r}: version {version.version} is announced with sha256 {version.sha256[:12]}... "
                f"and {version.total_bytes} bytes, but it is held as {newest.sha256[:12]}... and {newest.total_bytes} "
                "bytes; announce a new version instead of changing a published one"
            )
        if newest is None or version.version > newest.version:
            run.newest = version
            run.holders = {}
        self._put(run, member_id, addr, complete, source=None)
        run.notify()
        return version.version

    def _put(self, run: _Run, member_id: str, addr: str, complete: bool, source: str | None) -> Holder:
        h = run.holders.get(member_id)
        if h is None:
            if len(run.holders) >= self.max_holders:
                raise ResourceLimitError(f"weights directory: a run has {self.max_holders} holders already")
            h = run.holders[member_id] = Holder(member_id, addr, complete, seq=next(self._seq))
        h.address, h.complete = addr, h.complete or complete
        if source is not None:
            h.source = source
        if h.complete:
            h.source = ""
        return h

    def drop_unreachable(self, run_id: str, addresses: list[str]) -> None:
        run = self._runs.get(run_id)
        if run is None or not addresses:
            return
        gone = set(addresses)
        for member in [m for m, h in run.holders.items() if h.address in gone]:
            del run.holders[member]

    def _descendants(self, run: _Run, member_id: str) -> set[str]:
        """Members reading (directly or through others) from ``member_id``, and itself."""
        out = {member_id}
        grew = True
        while grew:
            grew = False
            for h in run.holders.values():
                if h.source in out and h.member_id not in out:
                    out.add(h.member_id)
                    grew = True
        return out

    def pick(self, run_id: str, member_id: str, addr: str, have_version: int) -> Source | None:
        """A source of the run's newest version for ``member_id``, if it is newer than
        ``have_version`` and some holder other than the caller's descendants serves it; the
        caller (with an ``addr``) becomes a holder still receiving it, reading from that source."""
        run = self._runs.get(run_id)
        if run is None or run.newest is None or run.newest.version <= have_version:
            return None
        banned = self._descendants(run, member_id)
        candidates = [h for h in run.holders.values() if h.member_id not in banned]
        if not candidates:
            return None
        best = min(candidates, key=lambda h: (h.readers, -h.seq))
        best.readers += 1
        if addr:
            self._put(run, member_id, addr, False, source=best.member_id)
        return Source(run.newest, best.member_id, best.address, best.complete)

    async def locate(self, run_id: str, member_id: str, addr: str, have_version: int, wait_s: float,
                     unreachable: list[str] | None = None) -> Source | None:
        """``pick``, waiting up to ``wait_s`` for a newer version or a reachable holder."""
        self.drop_unreachable(run_id, list(unreachable or ()))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while True:
            found = self.pick(run_id, member_id, addr, have_version)
            left = give_up - loop.time()
            if found is not None or left <= 0:
                return found
            event = self._run(run_id).changed
            try:
                async with asyncio.timeout(left):
                    await event.wait()
            except TimeoutError:
                return self.pick(run_id, member_id, addr, have_version)
