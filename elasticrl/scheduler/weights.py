"""Versioned policy weights: the newest safetensors blob of each run, kept by the coordinator.

Rollout-only workers join a run at any time and have no shared filesystem with the trainer, so
the trainer publishes every new policy version to the coordinator and workers fetch the newest
one from it. ``WeightStore`` keeps one blob per run as a file: under ``<state-dir>/weights`` when
the coordinator has a state dir (written before the publish is acknowledged, so a coordinator
restarted after ``kill -9`` serves the same version again), else in a private temp directory
removed when the process exits. Blobs are never held in memory: an upload is spooled chunk by
chunk to a temp file beside its final place, and a fetch reads the file. Layout::

    <weights dir>/<run id>/v<version, 20 digits>.safetensors   the blob, byte for byte
                          /current.json                       {version, sha256, format,
                                                               total_bytes, file}
                          /v<version>.<random>.upload.tmp     an upload in progress

An upload is checked before it takes anything (header fields, size limit, version, the cap on
concurrent uploads), then chunk by chunk (offsets, size), then as a whole (total size, sha256, a
safetensors header); only then is its temp file renamed into place, ``current.json`` replaced,
and older blobs deleted, so a crash at any moment leaves ``current.json`` naming a complete file,
and a torn or corrupted upload leaves the previous version served. The temp file of an upload
that fails or whose stream goes away is deleted at once (``WeightUpload.close``); leftovers of a
crash are deleted at start-up.

Versions are fencing tokens: a publish whose version is not above the stored one is refused
(``FencedError``, FAILED_PRECONDITION: a stale trainer must not roll the policy back), except the
same version with the same sha256, which is a retried publish and succeeds again.

``pack_state_dict`` / ``unpack_state_dict`` turn a state dict into such a blob and back (torch is
imported inside them; the coordinator itself never decodes tensors).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, BinaryIO

from elasticrl import tensorfile
from elasticrl.coordinator import validate as v
from elasticrl.coordinator.signals import Signals
from elasticrl.errors import FencedError, InvalidRequestError, ResourceLimitError
from elasticrl.owned_dirs import OwnedDir
from elasticrl.scheduler.store import atomic_write, fsync_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "safetensors"
DIR_NAME = "weights"
CURRENT = "current.json"
# A coordinator without a state dir keeps its weights in a private temp directory with this prefix,
# owned as ``owned_dirs`` says (removed by the next store on the host if the coordinator is killed).
TMP_PREFIX = "elasticrl-weights-"
UPLOAD_SUFFIX = ".upload.tmp"
CHUNK_BYTES = 4 << 20
"""Data per ``WeightChunk`` message, well below the default 64 MiB gRPC message limit."""
DEFAULT_MAX_BLOB_BYTES = 16 << 30
"""Largest blob a coordinator accepts by default (16 GiB: an 8B-parameter policy in bf16)."""
DEFAULT_MAX_UPLOADS = 4
"""Uploads a coordinator receives at once by default (``--max-weight-uploads``)."""
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class WeightBlob:
    """One stored policy version: a verified file that never changes while it is stored."""

    run_id: str
    version: int
    sha256: str
    format: str
    total_bytes: int
    path: pathlib.Path

    def open(self) -> BinaryIO:
        """The blob's file, open for reading. The store deletes a blob's file only after a newer
        blob replaced it, so open it in the same event-loop step that ``latest`` or
        ``wait_newer`` returned it: the open file stays readable whatever is published next."""
        return open(self.path, "rb")

    def read_bytes(self) -> bytes:
        """The whole blob in memory (tests, small blobs; fetches stream ``open()`` instead)."""
        return self.path.read_bytes()


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def check_publish(current: WeightBlob | None, run_id: str, version: int, sha256: str) -> bool:
    """Whether publishing ``(version, sha256)`` over ``current`` stores something new.

    True: a new version. False: the same version with the same sha256 (a retried publish, an
    idempotent success). Raises ``FencedError`` for a version not above the stored one.
    """
    if current is None or version > current.version:
        return True
    if version == current.version and sha256 == current.sha256:
        return False
    if version == current.version:
        raise FencedError(
            f"weights of run {run_id!r}: version {version} is already stored with sha256 "
            f"{current.sha256[:12]}..., this upload has {sha256[:12]}...; publish a new version "
            f"(> {current.version}) instead of changing a published one"
        )
    raise FencedError(
        f"weights of run {run_id!r}: version {version} is older than the stored version "
        f"{current.version}; versions must increase (is a stale trainer still publishing?)"
    )


def check_safetensors_file(f: BinaryIO, total_bytes: int) -> None:
    """Refuse a file that does not start like a safetensors file (8-byte length + JSON object).
    Reads only the header, from the start of ``f``."""
    if total_bytes < 8:
        raise InvalidRequestError(f"data: {total_bytes} bytes is too short for a safetensors file (at least 8)")
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    if n > min(MAX_SAFETENSORS_HEADER, total_bytes - 8):
        raise InvalidRequestError(
            f"data: the safetensors header claims {n} bytes but the blob has {total_bytes - 8} after its length; "
            "send the output of safetensors' save (pack_state_dict)"
        )
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise InvalidRequestError("data: the safetensors header is not a JSON object; send the output of pack_state_dict")


@dataclasses.dataclass(frozen=True)
class UploadHeader:
    """The fields of an upload's first chunk, checked: what blob the stream promises."""

    run_id: str
    version: int
    total_bytes: int
    sha256: str
    format: str

    @classmethod
    def checked(
        cls, *, run_id: str, version: int, total_bytes: int, sha256: str, format: str, max_blob_bytes: int,
    ) -> "UploadHeader":
        run_id = v.ident("run_id", run_id)
        if version < 0:
            raise InvalidRequestError(f"version: {version} must be >= 0 (versions increase with each publish)")
        if format != FORMAT:
            raise InvalidRequestError(f"format: {format!r} is not supported; send a safetensors blob with format={FORMAT!r}")
        if not _SHA256_RE.fullmatch(sha256):
            raise InvalidRequestError(f"sha256: {sha256[:80]!r} is not 64 lowercase hex digits (hashlib.sha256(blob).hexdigest())")
        if total_bytes < 1:
            raise InvalidRequestError(f"total_bytes: {total_bytes} must be >= 1 (the size of the whole blob)")
        if total_bytes > max_blob_bytes:
            raise ResourceLimitError(
                f"total_bytes: {total_bytes} bytes ({total_bytes / 2**30:.2f} GiB) exceeds this coordinator's "
                f"weights limit of {max_blob_bytes} bytes ({max_blob_bytes / 2**30:.2f} GiB; its --max-weights-gb), or use "
                "rollout.weights_transfer = relay, which does not pass through it"
            )
        return cls(run_id, version, total_bytes, sha256, format)


class WeightUpload:
    """One publish stream being received: each chunk is checked, appended to the upload's temp file
    and hashed; ``finish`` verifies the whole. Made by ``WeightStore.begin`` only.

    No protobuf: the servicer feeds it the chunks' fields. ``add`` and ``finish`` do file I/O (the
    servicer runs them in a thread for large chunks). Whatever happens, the owner calls ``close``,
    which deletes the temp file unless the blob was committed and frees the upload's slot.
    """

    def __init__(self, header: UploadHeader, path: pathlib.Path, file: BinaryIO, store: "WeightStore"):
        self.header = header
        self.path = path
        self.received = 0
        self._file: BinaryIO | None = file
        self._hash = hashlib.sha256()
        self._store = store
        self._closed = False

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes

    def check_header(self, i: int, *, run_id: str, version: int, total_bytes: int, sha256: str, format: str) -> None:
        """Chunk ``i`` may leave its header fields empty/0; when set they must equal the first's."""
        h = self.header
        for field, sent, first in (
            ("run_id", run_id, h.run_id), ("version", version, h.version),
            ("total_bytes", total_bytes, h.total_bytes), ("sha256", sha256, h.sha256), ("format", format, h.format),
        ):
            if sent and sent != first:
                raise InvalidRequestError(f"chunk {i}: {field} {sent!r} differs from the first chunk's {first!r}; one stream uploads one blob")

    def add(self, i: int, offset: int, data: bytes) -> None:
        if offset != self.received:
            raise InvalidRequestError(
                f"chunk {i}: offset {offset}, expected {self.received} (chunks must be sent in order, without gaps)"
            )
        end = offset + len(data)
        if end > self.total_bytes:
            raise InvalidRequestError(f"chunk {i}: data runs to byte {end}, past total_bytes {self.total_bytes}")
        f = self._file
        assert f is not None, "add after finish or close"
        f.write(data)
        f.flush()  # on disk, not in a buffer: the temp file's size is what was received
        self._hash.update(data)
        self.received = end

    def finish(self) -> WeightBlob:
        """The verified blob, still at its temp path (``WeightStore.commit`` moves it into place).
        ``InvalidRequestError`` names what did not match."""
        if self.received != self.total_bytes:
            raise InvalidRequestError(
                f"total_bytes: the stream ended after {self.received} of {self.total_bytes} bytes (a torn upload); "
                "nothing was stored, publish again"
            )
        digest = self._hash.hexdigest()
        if digest != self.header.sha256:
            raise InvalidRequestError(
                f"sha256: the {self.total_bytes} bytes received hash to {digest}, the upload declared {self.header.sha256} "
                "(corrupted in transit or a wrong digest); nothing was stored"
            )
        assert self._file is not None, "finish after close"
        f, self._file = self._file, None
        try:
            f.flush()
            if self._store.fsync:
                os.fsync(f.fileno())
        finally:
            f.close()
        with open(self.path, "rb") as f:
            check_safetensors_file(f, self.total_bytes)
        # Received and verified: the slot is free; the temp file now belongs to the blob, which
        # ``commit`` moves into place or deletes (``close`` still deletes it if commit never runs).
        self._store._uploads.discard(self)
        h = self.header
        return WeightBlob(h.run_id, h.version, h.sha256, h.format, h.total_bytes, self.path)

    def close(self) -> None:
        """Release everything the upload holds: its file handle, its temp file (gone already if
        the blob was committed: it was renamed), its slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)
        self._store._uploads.discard(self)


def _log_removal_failure(removal: asyncio.Future) -> None:
    if not removal.cancelled() and removal.exception() is not None:
        log.warning("could not remove an older weights file: %s", removal.exception())


class WeightStore:
    """The newest weights of each run, as files: durable under ``root`` when given, else in a
    private temp directory.

    Methods that change or wait run on the coordinator's event loop; file work that can be slow
    (renames and fsyncs of a commit) runs in a worker thread so a multi-GiB blob does not stall
    leases. A blob's file is deleted only after a newer blob replaced it in ``latest`` (see
    ``WeightBlob.open``).
    """

    def __init__(
        self,
        root: str | os.PathLike | None,
        *,
        fsync: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        max_uploads: int = DEFAULT_MAX_UPLOADS,
    ):
        if max_blob_bytes < 1:
            raise ValueError(f"max_blob_bytes: {max_blob_bytes} must be >= 1")
        if max_uploads < 1:
            raise ValueError(f"max_uploads: {max_uploads} must be >= 1 (uploads received at once)")
        self.root = None if root is None else pathlib.Path(root)
        self.fsync = fsync
        self.max_blob_bytes = max_blob_bytes
        self.max_uploads = max_uploads
        self._blobs: dict[str, WeightBlob] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._published = Signals()  # by run: fired on every new version
        self._uploads: set[WeightUpload] = set()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.directory = self.root
            self._load()
        else:
            # Not durable, but still not in memory: under $TMPDIR (so RAM after all if that is a
            # tmpfs), deleted with this object or at exit, or by the next store made on this host
            # if this process is killed (no exit handler runs then).
            self._tmp = OwnedDir(TMP_PREFIX, "coordinator weight directories")
            self.directory = pathlib.Path(self._tmp.path)

    def latest(self, run_id: str) -> WeightBlob | None:
        return self._blobs.get(run_id)

    def runs(self) -> list[str]:
        return sorted(self._blobs)

    @property
    def uploads_in_progress(self) -> int:
        return len(self._uploads)

    def begin(self, *, run_id: str, version: int, total_bytes: int, sha256: str, format: str) -> WeightUpload:
        """Start an upload; the caller must ``close`` it. Refuses at once, before taking any
        memory or disk, what could never be stored (a bad header, a blob over the limit, a stale
        version) and an upload over the cap on concurrent ones, so such a publish costs nothing."""
        header = UploadHeader.checked(
            run_id=run_id, version=version, total_bytes=total_bytes, sha256=sha256, format=format,
            max_blob_bytes=self.max_blob_bytes,
        )
        check_publish(self._blobs.get(header.run_id), header.run_id, version, sha256)
        if len(self._uploads) >= self.max_uploads:
            raise ResourceLimitError(
                f"weights of run {header.run_id!r}: {len(self._uploads)} weight uploads are already in progress, "
                f"this coordinator's limit (--max-weight-uploads {self.max_uploads}); publish again once one "
                "finishes, or start the coordinator with a higher --max-weight-uploads"
            )
        directory = self.run_dir(header.run_id)
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=f"v{version:020d}.", suffix=UPLOAD_SUFFIX)
        upload = WeightUpload(header, pathlib.Path(name), os.fdopen(fd, "wb"), self)
        self._uploads.add(upload)
        return upload

    async def commit(self, blob: WeightBlob) -> bool:
        """Store ``blob`` (a finished upload, at its temp path) as its run's newest version and
        wake the waiters. Returns False for an idempotent re-publish. ``FencedError`` if a newer
        version was stored meanwhile (the check is repeated under the run's lock). The temp file
        is moved into place or deleted, never left behind."""
        lock = self._locks.setdefault(blob.run_id, asyncio.Lock())
        async with lock:
            try:
                fresh = check_publish(self._blobs.get(blob.run_id), blob.run_id, blob.version, blob.sha256)
            except FencedError:
                blob.path.unlink(missing_ok=True)
                raise
            if not fresh:
                blob.path.unlink(missing_ok=True)
                return False
            # The move into place runs to its end even if the publish is cancelled meanwhile (its
            # client gone, the coordinator stopping): the thread would finish it anyway, and this
            # run's blob, current.json and lock must follow it, not a later commit racing it.
            install = asyncio.ensure_future(asyncio.to_thread(self._install, blob))
            cancelled: asyncio.CancelledError | None = None
            while True:
                try:
                    stored = await asyncio.shield(install)
                    break
                except asyncio.CancelledError as exc:
                    cancelled = exc
                except BaseException:
                    blob.path.unlink(missing_ok=True)
                    raise
            self._blobs[blob.run_id] = stored
            self._published.fire(blob.run_id)
            # Only now, with the new blob current: a fetch holding the old one has it open.
            removal = asyncio.get_running_loop().run_in_executor(None, self._remove_older, stored)  # under way now
            if cancelled is not None:  # the removal goes on without this task
                removal.add_done_callback(_log_removal_failure)
                raise cancelled
            await removal
        log.info("weights of run %s: version %d stored (%d bytes, sha256 %s)", stored.run_id, stored.version,
                 stored.total_bytes, stored.sha256[:12])
        return True

    async def wait_newer(self, run_id: str, have_version: int, wait_s: float) -> WeightBlob | None:
        """The run's newest blob if its version is above ``have_version``, waiting up to
        ``wait_s`` seconds for one to be published; None if none comes in time."""
        deadline = time.monotonic() + wait_s
        while True:
            blob = self._blobs.get(run_id)
            if blob is not None and blob.version > have_version:
                return blob
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self._published.wait(run_id, left)

    def drop_run(self, run_id: str) -> None:
        """Forget a run the coordinator dropped (``--max-runs``): its newest blob and its files."""
        self._blobs.pop(run_id, None)
        self._locks.pop(run_id, None)
        directory = self.run_dir(run_id)
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)

    # -- disk ----------------------------------------------------------------------------------

    def run_dir(self, run_id: str) -> pathlib.Path:
        return self.directory / v.ident("run_id", run_id)

    def _install(self, blob: WeightBlob) -> WeightBlob:
        """Rename a verified temp file into place, then point ``current.json`` at it."""
        directory = self.run_dir(blob.run_id)
        name = f"v{blob.version:020d}.{FORMAT}"
        os.replace(blob.path, directory / name)
        if self.fsync:  # the rename, and the run's directory itself (new at a run's first publish)
            fsync_dir(directory)
            fsync_dir(directory.parent)
        if self.root is not None:
            meta = {"version": blob.version, "sha256": blob.sha256, "format": blob.format,
                    "total_bytes": blob.total_bytes, "file": name}
            atomic_write(directory / CURRENT, json.dumps(meta, indent=2, sort_keys=True).encode(), fsync=self.fsync)
        return dataclasses.replace(blob, path=directory / name)

    def _remove_older(self, blob: WeightBlob) -> None:
        for old in self.run_dir(blob.run_id).glob(f"v*.{FORMAT}"):
            if old != blob.path:
                old.unlink(missing_ok=True)

    def _load(self) -> None:
        """Read back every run's current blob, verifying it; a damaged one is logged and skipped
        (serving nothing beats serving corrupt weights), and leftovers of a crash (temp files of
        uploads and writes, blobs never made current) are removed."""
        assert self.root is not None
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for tmp in directory.glob("*.tmp"):
                tmp.unlink(missing_ok=True)
            current = directory / CURRENT
            if not current.exists():
                continue
            try:
                meta = json.loads(current.read_text())
                path = directory / meta["file"]
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    digest = _sha256_of(f)
                if size != meta["total_bytes"] or digest != meta["sha256"]:
                    raise ValueError(f"{meta['file']} does not match its size or sha256 in {CURRENT}")
                blob = WeightBlob(v.ident("run_id", directory.name), int(meta["version"]), meta["sha256"],
                                  meta["format"], size, path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("weights under %s are damaged and will not be served: %s", directory, exc)
                continue
            self._blobs[blob.run_id] = blob
            for old in directory.glob(f"v*.{FORMAT}"):  # a blob written but never made current
                if old.name != meta["file"]:
                    old.unlink(missing_ok=True)
            log.info("weights of run %s: version %d loaded from disk (%d bytes)", blob.run_id, blob.version, blob.total_bytes)


def _sha256_of(f: BinaryIO) -> str:
    """sha256 of a file read in chunks (``hashlib.file_digest`` needs Python 3.11)."""
    h = hashlib.sha256()
    while chunk := f.read(CHUNK_BYTES):
        h.update(chunk)
    return h.hexdigest()


# -- helpers for the trainer and the workers --------------------------------------------------------


def pack_state_dict(state: Mapping[str, "torch.Tensor"], metadata: Mapping[str, str] | None = None) -> memoryview:
    """A safetensors blob of ``state`` (tensors on any device; tensors that share storage, like
    tied embeddings, are each stored whole), built by ``tensorfile.to_buffer``: without holding the
    GIL, which ``safetensors.torch.save`` does for seconds per GiB (the trainer's lease keep-alive
    runs beside the background publish). Bytes-like: ``len``, slices, ``bytes(blob)``, buffers."""
    import torch

    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}]: {type(tensor).__name__} is not a tensor; pass a state_dict of tensors")
    return tensorfile.to_buffer(state, metadata)


def unpack_state_dict(blob: bytes | bytearray | memoryview) -> dict[str, "torch.Tensor"]:
    """The tensors of a ``pack_state_dict`` blob, on CPU (safetensors only; nothing executes),
    copied out without holding the GIL (``tensorfile.from_buffer``).

    Raises:
        TensorFileError: not a safetensors blob (a ValueError)."""
    return tensorfile.from_buffer(blob)[0]
