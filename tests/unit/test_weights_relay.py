"""The weights relay without a coordinator process: the directory's choice of sources (a chain, a
late joiner served by a peer, never a reader's own descendant, dead holders dropped), and peers
moving real bytes over loopback TCP (reading behind a holder still receiving, resuming at the
same offset after a source dies or stalls, a corrupt source, a wrong token)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time

import pytest

from elasticrl.errors import FencedError, InvalidRequestError
from elasticrl.weights import directory as d
from elasticrl.weights import peer as P

pytestmark = pytest.mark.timeout(60)


def ver(version: int, data: bytes = b"x") -> d.Version:
    return d.Version(version, len(data), hashlib.sha256(data).hexdigest())


def test_readers_arriving_together_form_a_chain_and_a_late_joiner_reads_from_a_peer():
    wd = d.WeightDirectory()
    wd.announce("r", ver(1), "trainer", "10.0.0.1:1", complete=True)
    sources = [wd.pick("r", f"w{i}", f"10.0.1.{i}:1", -1).member_id for i in range(4)]
    assert sources == ["trainer", "w0", "w1", "w2"]
    for i in range(4):
        wd.announce("r", ver(1), f"w{i}", f"10.0.1.{i}:1", complete=True)
    late = wd.pick("r", "late", "10.0.2.1:1", -1)
    assert late.member_id == "w3" and late.complete  # the only holder nobody reads from yet: a peer, not the trainer
    assert wd.pick("r", "w0", "10.0.1.0:1", 1) is None  # holds the newest already


def test_a_reader_never_reads_from_its_own_descendants():
    wd = d.WeightDirectory()
    wd.announce("r", ver(1), "trainer", "10.0.0.1:1", complete=True)
    assert wd.pick("r", "a", "10.0.1.1:1", -1).member_id == "trainer"
    assert wd.pick("r", "b", "10.0.1.2:1", -1).member_id == "a"
    assert wd.pick("r", "c", "10.0.1.3:1", -1).member_id == "b"
    # a's source died: b and c read behind a, so they must not be a's new source (each would wait on the other).
    wd.drop_unreachable("r", ["10.0.0.1:1"])
    assert wd.pick("r", "a", "10.0.1.1:1", -1) is None
    wd.announce("r", ver(1), "d", "10.0.1.4:1", complete=True)
    assert wd.pick("r", "a", "10.0.1.1:1", -1).member_id == "d"


def test_versions_move_forward_and_a_changed_blob_is_refused():
    wd = d.WeightDirectory()
    wd.announce("r", ver(2, b"two"), "trainer", "h:1", complete=True)
    wd.announce("r", ver(2, b"two"), "w", "h:2", complete=True)
    assert wd.announce("r", ver(1, b"one"), "old", "h:3", complete=True) == 2  # stale: ignored
    assert {h.member_id for h in wd.holders("r")} == {"trainer", "w"}
    with pytest.raises(FencedError, match="version 2"):
        wd.announce("r", ver(2, b"other"), "x", "h:4", complete=True)
    wd.announce("r", ver(3, b"three"), "trainer", "h:1", complete=True)
    assert [h.member_id for h in wd.holders("r")] == ["trainer"]  # holders of 2 are no source of 3


def test_locate_waits_for_a_version_and_gives_up_at_its_deadline():
    async def main():
        wd = d.WeightDirectory()
        t0 = time.monotonic()
        assert await wd.locate("r", "w", "h:2", -1, 0.2) is None
        assert time.monotonic() - t0 >= 0.2
        waiter = asyncio.create_task(wd.locate("r", "w", "h:2", -1, 10))
        await asyncio.sleep(0.05)
        wd.announce("r", ver(1), "trainer", "h:1", complete=True)
        src = await asyncio.wait_for(waiter, 5)
        assert src.member_id == "trainer" and src.version.version == 1

    asyncio.run(main())


@pytest.mark.parametrize("value", ["nohost", "h:0", "h:70000", ":5", "a b:1"])
def test_bad_addresses_and_versions_are_refused_by_field(value):
    with pytest.raises(InvalidRequestError, match="address"):
        d.address("address", value)
    with pytest.raises(InvalidRequestError, match="sha256"):
        d.Version.checked(1, 10, "abc", "safetensors")
    with pytest.raises(InvalidRequestError, match="total_bytes"):
        d.Version.checked(1, 0, "0" * 64, "safetensors")
    assert d.address("address", "[::1]:80") == "[::1]:80"


class DirectoryClient:
    """The two relay calls of ``SchedulerClient``, answered by a ``WeightDirectory`` in process."""

    def __init__(self):
        self.wd = d.WeightDirectory()
        self.lock = threading.Lock()
        self.unreachable: list[str] = []

    def announce_weights(self, run_id, version, *, total_bytes, sha256, member_id, address, complete):
        with self.lock:
            return self.wd.announce(run_id, d.Version(version, total_bytes, sha256), member_id, address, complete)

    def locate_weights(self, run_id, *, member_id, address, have_version, wait_s=0.0, unreachable=()):
        give_up = time.monotonic() + wait_s
        while True:
            with self.lock:
                self.unreachable += unreachable
                self.wd.drop_unreachable(run_id, list(unreachable))
                unreachable = ()
                src = self.wd.pick(run_id, member_id, address, have_version)
            if src is not None or time.monotonic() >= give_up:
                break
            time.sleep(0.01)
        if src is None:
            return None
        return type("Reply", (), dict(version=src.version.version, total_bytes=src.version.total_bytes,
                                      sha256=src.version.sha256, address=src.address, source_member=src.member_id,
                                      source_complete=src.complete))


def digest_of(blob: bytes) -> str:
    return P.blob_digest(P.piece_digests(blob))


def test_pieces_hash_a_blob_in_parts_and_any_changed_byte_changes_the_digest():
    blob = bytearray(os.urandom(2 * P.PIECE_BYTES + 5))
    pieces = P.piece_digests(blob)
    assert len(pieces) == 3 and pieces[2] == hashlib.sha256(blob[-5:]).hexdigest()
    digest = P.blob_digest(pieces)
    blob[P.PIECE_BYTES + 1] ^= 1
    assert P.blob_digest(P.piece_digests(blob)) != digest


def fetch_in_thread(client, member, peer, results, **kw):
    def run():
        try:
            results[member] = P.fetch(client, "r", member, peer, have_version=-1, wait_s=20, token="t", **kw)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[member] = exc
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_a_reader_behind_a_dying_holder_resumes_at_its_offset_from_another_source():
    blob = os.urandom(8 << 20)
    client = DirectoryClient()
    with P.WeightPeer(token="t", rate_limit_bytes_s=8 << 20) as trainer, P.WeightPeer(token="t") as a, \
            P.WeightPeer(token="t") as b:
        P.publish(client, "r", "trainer", trainer, 1, blob)
        results: dict = {}
        ta = fetch_in_thread(client, "a", a, results)
        time.sleep(0.2)  # a reads from the trainer (at 8 MB/s: about a second)
        progress = []
        tb = fetch_in_thread(client, "b", b, results, on_bytes=progress.append)
        deadline = time.monotonic() + 10
        while not progress and time.monotonic() < deadline:
            time.sleep(0.01)
        assert progress, "b received nothing from a"
        a.close()  # a dies mid-transfer: b's connection breaks
        tb.join(20)
        ta.join(20)
        got = results["b"]
        assert isinstance(got, P.Held), got
        assert bytes(got.buf) == blob and got.complete
        (first, a0, a1), (second, b0, b1) = got.sources[0], got.sources[-1]
        assert first == "a" and second == "trainer" and a0 == 0 and 0 < a1 == b0 and b1 == len(blob), got.sources
        assert "127.0.0.1:%d" % a.port in client.unreachable


def test_a_stalled_source_counts_as_unreachable_after_the_stall_timeout():
    blob = os.urandom(1 << 20)
    client = DirectoryClient()
    with P.WeightPeer(token="t") as trainer, P.WeightPeer(token="t") as silent, P.WeightPeer(token="t") as b:
        P.publish(client, "r", "trainer", trainer, 1, blob)
        # "silent" claims the version but never sends a byte of it: a stopped host.
        stuck = P.Held(1, digest_of(blob), len(blob))
        silent.hold(stuck)
        client.announce_weights("r", 1, total_bytes=len(blob), sha256=stuck.digest, member_id="silent",
                                address=silent.address, complete=False)
        t0 = time.monotonic()
        held = P.fetch(client, "r", "b", b, have_version=-1, wait_s=10, token="t", stall_timeout_s=0.5)
        assert bytes(held.buf) == blob and time.monotonic() - t0 < 5
        assert [s[0] for s in held.sources] == ["silent", "trainer"]


def test_a_corrupt_source_is_dropped_and_the_blob_fetched_again():
    blob = os.urandom(1 << 20)
    client = DirectoryClient()
    with P.WeightPeer(token="t") as trainer, P.WeightPeer(token="t") as liar, P.WeightPeer(token="t") as b:
        P.publish(client, "r", "trainer", trainer, 1, blob)
        bad = bytearray(blob)
        bad[len(blob) - 12345] ^= 1
        held = P.Held(1, digest_of(blob), len(blob), bad, P.piece_digests(blob))  # claims the right digests
        liar.hold(held)
        client.announce_weights("r", 1, total_bytes=len(blob), sha256=held.digest, member_id="liar",
                                address=liar.address, complete=True)
        got = P.fetch(client, "r", "b", b, have_version=-1, wait_s=10, token="t")
        assert bytes(got.buf) == blob and got.sources[-1][0] == "trainer"
        assert liar.address in client.unreachable


def test_a_wrong_token_is_refused():
    blob = os.urandom(1024)
    with P.WeightPeer(token="secret") as trainer:
        held = P.Held(1, digest_of(blob), len(blob))
        trainer.hold(P.Held(1, held.digest, len(blob), blob, P.piece_digests(blob)))
        with pytest.raises(P.PeerError, match="token"):
            P.read_from(trainer.address, held, P._Verifier(held), run_id="r", token="guess")
        assert held.filled == 0
