"""WeightStore and WeightUpload without a server: versions as fencing tokens, idempotent
re-publish, torn and corrupted uploads, restart from disk, waiters; pack/unpack of state dicts."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from elasticrl.errors import FencedError, InvalidRequestError, ResourceLimitError
from elasticrl.scheduler.weights import (
    CURRENT,
    UPLOAD_SUFFIX,
    WeightStore,
    pack_state_dict,
    sha256_hex,
    unpack_state_dict,
)

RUN = "run-a"


def blob_of(seed: int, n: int = 64) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(pack_state_dict({"w": torch.randn(n, generator=g), "b": torch.full((3,), float(seed))}))


def upload(store: WeightStore, version: int, data: bytes, *, run: str = RUN, chunk: int = 50, sha: str | None = None):
    """Feed ``data`` through an upload in ``chunk``-byte pieces; returns the verified blob."""
    up = store.begin(run_id=run, version=version, total_bytes=len(data), sha256=sha or sha256_hex(data), format="safetensors")
    for i, offset in enumerate(range(0, len(data), chunk)):
        up.add(i, offset, data[offset:offset + chunk])
    return up.finish()


def publish(store: WeightStore, version: int, data: bytes, **kwargs) -> bool:
    return asyncio.run(store.commit(upload(store, version, data, **kwargs)))


def test_versions_must_increase_and_the_error_names_both():
    store = WeightStore(None)
    assert store.latest(RUN) is None
    assert publish(store, 1, blob_of(1)) is True
    assert publish(store, 5, blob_of(5)) is True
    assert store.latest(RUN).version == 5
    with pytest.raises(FencedError, match=r"version 3 is older than the stored version 5"):
        upload(store, 3, blob_of(3))
    with pytest.raises(FencedError, match=r"version 5 is already stored"):
        upload(store, 5, blob_of(6))  # same version, other bytes
    assert store.latest(RUN).version == 5 and store.latest(RUN).read_bytes() == blob_of(5)
    assert publish(store, 1, blob_of(1), run="run-b") is True  # versions are per run


def test_republishing_the_same_version_and_bytes_is_an_idempotent_ok():
    store = WeightStore(None)
    assert publish(store, 2, blob_of(2)) is True
    first = store.latest(RUN)
    assert publish(store, 2, blob_of(2)) is False
    assert store.latest(RUN) is first


def test_commit_rechecks_the_version_against_a_publish_that_finished_meanwhile():
    store = WeightStore(None)
    older = upload(store, 2, blob_of(2))  # both begin while nothing is stored
    newer = upload(store, 3, blob_of(3))
    assert asyncio.run(store.commit(newer)) is True
    with pytest.raises(FencedError, match="version 2 is older than the stored version 3"):
        asyncio.run(store.commit(older))
    assert store.latest(RUN).version == 3


@pytest.mark.parametrize(
    "corrupt,match",
    [
        ("flip", r"sha256: the \d+ bytes received hash to"),
        ("torn", r"total_bytes: the stream ended after \d+ of \d+ bytes"),
        ("gap", r"chunk 1: offset 100, expected 50"),
        ("overrun", r"past total_bytes"),
    ],
)
def test_a_corrupted_or_torn_upload_is_refused_and_the_previous_version_stays(corrupt, match):
    store = WeightStore(None)
    publish(store, 1, blob_of(1))
    data = blob_of(2)
    up = store.begin(run_id=RUN, version=2, total_bytes=len(data), sha256=sha256_hex(data), format="safetensors")
    with pytest.raises(InvalidRequestError, match=match):
        if corrupt == "flip":
            bad = bytearray(data)
            bad[-1] ^= 0xFF
            up.add(0, 0, bytes(bad))
        elif corrupt == "torn":
            up.add(0, 0, data[:-10])
        elif corrupt == "gap":
            up.add(0, 0, data[:50])
            up.add(1, 100, data[100:])
        else:
            up.add(0, 0, data + b"extra")
        up.finish()
    assert store.latest(RUN).version == 1 and store.latest(RUN).read_bytes() == blob_of(1)


def test_a_later_chunk_may_not_switch_blobs():
    store = WeightStore(None)
    data = blob_of(1)
    up = store.begin(run_id=RUN, version=1, total_bytes=len(data), sha256=sha256_hex(data), format="safetensors")
    up.check_header(1, run_id="", version=0, total_bytes=0, sha256="", format="")  # empty: fine
    with pytest.raises(InvalidRequestError, match=r"chunk 1: version 2 differs from the first chunk's 1"):
        up.check_header(1, run_id=RUN, version=2, total_bytes=0, sha256="", format="")


@pytest.mark.parametrize(
    "fields,error,match",
    [
        ({"format": "pickle"}, InvalidRequestError, r"format: 'pickle' is not supported"),
        ({"sha256": "abc"}, InvalidRequestError, r"sha256: 'abc' is not 64 lowercase hex digits"),
        ({"version": -2}, InvalidRequestError, r"version: -2 must be >= 0"),
        ({"total_bytes": 0}, InvalidRequestError, r"total_bytes: 0 must be >= 1"),
        ({"total_bytes": 1001}, ResourceLimitError, r"total_bytes: 1001 bytes .* exceeds this coordinator's weights limit of 1000 bytes .*--max-weights-gb.*weights_transfer = relay"),
        ({"run_id": "../etc"}, InvalidRequestError, r"run_id: '../etc' is not a valid id"),
    ],
)
def test_bad_upload_headers_are_refused_before_any_transfer(fields, error, match):
    store = WeightStore(None, max_blob_bytes=1000)
    args = {"run_id": RUN, "version": 1, "total_bytes": 10, "sha256": "0" * 64, "format": "safetensors", **fields}
    with pytest.raises(error, match=match):
        store.begin(**args)


def test_bytes_that_are_not_safetensors_are_refused():
    store = WeightStore(None)
    junk = b"\x80\x04\x95 not a safetensors file, maybe a pickle"
    with pytest.raises(InvalidRequestError, match="safetensors header"):
        upload(store, 1, junk)
    assert store.latest(RUN) is None


def test_a_restarted_store_serves_the_newest_version_from_disk(tmp_path):
    root = tmp_path / "weights"
    store = WeightStore(root)
    publish(store, 1, blob_of(1))
    publish(store, 2, blob_of(2))
    files = sorted(p.name for p in (root / RUN).iterdir())
    assert files == [CURRENT, f"v{2:020d}.safetensors"], files  # the older blob is gone
    (root / RUN / "v00000000000000000003.safetensors.tmp").write_bytes(b"half a blob")  # a crash mid-write
    (root / RUN / f"v{3:020d}.abc123{UPLOAD_SUFFIX}").write_bytes(b"a torn upload")  # a crash mid-upload

    again = WeightStore(root)
    blob = again.latest(RUN)
    assert blob is not None and blob.version == 2 and blob.read_bytes() == blob_of(2)
    assert blob.sha256 == sha256_hex(blob_of(2))
    assert not list((root / RUN).glob("*.tmp"))
    with pytest.raises(FencedError, match="older than the stored version 2"):  # versions survive too
        upload(again, 1, blob_of(1))


def test_a_blob_written_but_never_made_current_is_ignored_on_restart(tmp_path):
    root = tmp_path / "weights"
    publish(WeightStore(root), 1, blob_of(1))
    orphan = root / RUN / f"v{2:020d}.safetensors"  # crash after the blob's rename, before current.json
    orphan.write_bytes(blob_of(2))
    again = WeightStore(root)
    assert again.latest(RUN).version == 1
    assert not orphan.exists()


def test_a_damaged_blob_on_disk_is_not_served(tmp_path, caplog):
    root = tmp_path / "weights"
    publish(WeightStore(root), 1, blob_of(1))
    meta = json.loads((root / RUN / CURRENT).read_text())
    path = root / RUN / meta["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    publish(WeightStore(root), 1, blob_of(1), run="run-b")  # another run loads fine beside it
    again = WeightStore(root)
    assert again.latest(RUN) is None
    assert again.latest("run-b").version == 1
    assert "damaged" in caplog.text


def spooled(store: WeightStore, run: str = RUN) -> list[str]:
    """Names of the upload temp files under the store's directory."""
    return sorted(p.name for p in store.directory.rglob(f"*{UPLOAD_SUFFIX}"))


def begin(store: WeightStore, version: int, total_bytes: int = 3 << 30):
    return store.begin(run_id=RUN, version=version, total_bytes=total_bytes, sha256="0" * 64, format="safetensors")


@pytest.mark.parametrize("durable", [True, False])
def test_an_upload_spools_to_a_temp_file_and_close_deletes_it(tmp_path, durable):
    store = WeightStore(tmp_path / "weights" if durable else None)
    up = begin(store, 1)  # 3 GiB declared: nothing is allocated for it
    up.add(0, 0, b"0123456789")
    up.add(1, 10, b"abc")
    [name] = spooled(store)
    assert name.startswith(f"v{1:020d}.") and (store.run_dir(RUN) / name).stat().st_size == 13
    up.close()
    up.close()  # idempotent
    assert spooled(store) == [] and store.uploads_in_progress == 0


def test_concurrent_uploads_over_the_cap_are_refused_naming_the_option():
    store = WeightStore(None, max_uploads=2)
    first, second = begin(store, 1), begin(store, 2)
    with pytest.raises(ResourceLimitError, match=r"2 weight uploads are already in progress.*--max-weight-uploads"):
        begin(store, 3)
    assert len(spooled(store)) == 2  # the refused one took nothing
    first.close()
    third = begin(store, 3)
    second.close()
    third.close()
    assert store.uploads_in_progress == 0 and spooled(store) == []


def test_a_stale_version_is_refused_before_any_file_is_made():
    store = WeightStore(None)
    publish(store, 5, blob_of(5))
    with pytest.raises(FencedError):
        begin(store, 4)
    assert spooled(store) == [] and store.uploads_in_progress == 0


def test_finished_uploads_free_their_slot_and_commit_leaves_no_temp_file(tmp_path):
    store = WeightStore(tmp_path / "weights", max_uploads=1)
    for version in (1, 2, 2):  # the last is an idempotent retry: its temp file is deleted too
        publish(store, version, blob_of(version))
    older = upload(store, 2, blob_of(2))  # verified, then fenced at commit by version 3
    asyncio.run(store.commit(upload(store, 3, blob_of(3))))
    with pytest.raises(FencedError):
        asyncio.run(store.commit(older))
    assert spooled(store) == []
    assert sorted(p.name for p in store.run_dir(RUN).iterdir()) == [CURRENT, f"v{3:020d}.safetensors"]
    assert store.latest(RUN).path == store.run_dir(RUN) / f"v{3:020d}.safetensors"


def test_a_fetch_that_opened_a_blob_reads_it_whole_after_a_newer_publish(tmp_path):
    store = WeightStore(tmp_path / "weights")
    publish(store, 1, blob_of(1, n=4096))
    with store.latest(RUN).open() as f:
        head = f.read(100)
        publish(store, 2, blob_of(2))  # deletes version 1's file
        assert not (store.run_dir(RUN) / f"v{1:020d}.safetensors").exists()
        assert head + f.read() == blob_of(1, n=4096)
    assert store.latest(RUN).read_bytes() == blob_of(2)


def test_with_fsync_the_blob_and_its_directory_are_synced(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    store = WeightStore(tmp_path / "weights", fsync=True)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    publish(store, 1, blob_of(1))
    run_dir = str(store.run_dir(RUN))
    assert any(p.endswith(UPLOAD_SUFFIX) for p in synced), synced  # the data, before the rename
    assert run_dir in synced, synced  # the rename
    assert synced.index(run_dir) > next(i for i, p in enumerate(synced) if p.endswith(UPLOAD_SUFFIX))


def test_a_waiter_is_woken_by_a_publish():
    store = WeightStore(None)
    publish(store, 1, blob_of(1))

    async def scenario():
        waiter = asyncio.create_task(store.wait_newer(RUN, 1, 30.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        await store.commit(upload(store, 1, blob_of(1)))  # an idempotent re-publish wakes nobody
        await asyncio.sleep(0)
        assert not waiter.done()
        await store.commit(upload(store, 2, blob_of(2)))
        return await asyncio.wait_for(waiter, 2.0)

    blob = asyncio.run(scenario())
    assert blob.version == 2 and blob.read_bytes() == blob_of(2)


def test_wait_returns_at_once_when_newer_and_none_after_the_wait():
    store = WeightStore(None)

    async def scenario():
        nothing_yet = await store.wait_newer(RUN, -1, 0.0)
        await store.commit(upload(store, 4, blob_of(4)))
        newer = await store.wait_newer(RUN, -1, 0.0)
        held = await asyncio.wait_for(store.wait_newer(RUN, 4, 0.01), 2.0)
        return nothing_yet, newer, held

    nothing_yet, newer, held = asyncio.run(scenario())
    assert nothing_yet is None
    assert newer.version == 4
    assert held is None


def test_pack_unpack_round_trip_keeps_dtypes_shapes_values_and_tied_weights():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 4, generator=g)
    state = {
        "embed.weight": emb,
        "lm_head.weight": emb,  # tied: the same tensor twice
        "proj.weight": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([3], dtype=torch.int64),
        "slice": torch.arange(20, dtype=torch.float32)[5:8],  # a view of a larger storage
    }
    out = unpack_state_dict(pack_state_dict(state, metadata={"version": "7"}))
    assert sorted(out) == sorted(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name
    with pytest.raises(TypeError, match=r"state\['x'\]: list is not a tensor"):
        pack_state_dict({"x": [1, 2]})


def test_a_stalled_upload_is_dropped_after_the_idle_timeout_freeing_its_slot_and_file():
    """The servicer with a fake context: a client that sends one chunk and then nothing must not
    hold an upload slot and a temp file until its own deadline."""
    import grpc

    from elasticrl._proto import scheduler_pb2 as spb
    from elasticrl.scheduler.service import SchedulerServicer

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details, trailing_metadata=()):
            self.code, self.details = code, details
            raise Aborted()

    store = WeightStore(None, max_uploads=1)
    servicer = SchedulerServicer(None, weights=store)
    servicer.upload_idle_s = 0.05

    async def stalled():
        yield spb.WeightChunk(run_id=RUN, version=1, total_bytes=3 << 30, offset=0, data=b"0123456789",
                              sha256="0" * 64, format="safetensors")
        await asyncio.sleep(30)

    context = Context()
    with pytest.raises(Aborted):
        asyncio.run(asyncio.wait_for(servicer.PublishWeights(stalled(), context), 10))
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "chunks: none received for 0.05s" in context.details
    assert store.uploads_in_progress == 0 and spooled(store) == []


def test_a_dropped_run_leaves_nothing_behind_and_waiters_leave_no_entry(tmp_path):
    store = WeightStore(tmp_path)
    assert publish(store, 1, blob_of(1)) is True
    assert asyncio.run(asyncio.wait_for(store.wait_newer("run-b", -1, 0.05), 5)) is None
    assert len(store._published) == 0  # a waiter that timed out leaves no event behind
    store.drop_run(RUN)
    assert store.latest(RUN) is None and not store.run_dir(RUN).exists()
    assert WeightStore(tmp_path).latest(RUN) is None  # nor after a restart


def test_a_killed_coordinators_private_weights_are_removed_by_the_next_store(tmp_path, monkeypatch):
    """Without a state dir the weights live in a temp directory removed at exit; a SIGKILLed
    coordinator runs no exit handler, so the next store on the host removes what no process holds
    (its flock died with it), and never a live store's."""
    import subprocess
    import sys

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read $TMPDIR
    script = ("import asyncio, os, signal, sys; from elasticrl.scheduler.weights import WeightStore; "
              "s = WeightStore(None); print(s.directory, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=os.environ)
    orphan = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(orphan), killed
    live = WeightStore(None)  # removes the orphan
    assert not os.path.exists(orphan)
    assert publish(live, 1, blob_of(1))
    other = WeightStore(None)  # a second live store leaves the first one's weights alone
    assert live.directory.is_dir() and live.latest(RUN).read_bytes() == blob_of(1)
    assert other.directory != live.directory
    stray = tmp_path / "elasticrl-weights-not-one"  # no owner lock: not ours to delete
    stray.mkdir()
    WeightStore(None)
    assert stray.is_dir()


def test_a_publish_cancelled_while_its_blob_moves_into_place_still_makes_it_current(tmp_path, monkeypatch):
    """The client's deadline (or the coordinator stopping) cancels the commit while the thread
    renames the blob and writes current.json: that thread finishes anyway, so the store must
    follow it (and hold the run's lock until then), not keep serving the old version."""
    import threading

    store = WeightStore(tmp_path)
    assert publish(store, 1, blob_of(1))
    installing, release = threading.Event(), threading.Event()
    real = store._install

    def slow_install(blob):
        installing.set()
        release.wait(10)
        return real(blob)

    monkeypatch.setattr(store, "_install", slow_install)

    async def scenario():
        commit = asyncio.create_task(store.commit(upload(store, 2, blob_of(2))))
        await asyncio.to_thread(installing.wait, 10)
        commit.cancel()
        await asyncio.sleep(0.05)
        assert not commit.done()  # it waits for the move it started
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await commit

    asyncio.run(scenario())
    assert store.latest(RUN).version == 2 and store.latest(RUN).read_bytes() == blob_of(2)
    assert json.loads((tmp_path / RUN / CURRENT).read_text())["version"] == 2
    assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == [CURRENT, f"v{2:020d}.safetensors"]
    assert WeightStore(tmp_path).latest(RUN).version == 2  # and after a restart
