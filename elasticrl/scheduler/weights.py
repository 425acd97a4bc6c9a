"""Versioned policy weights: the newest safetensors blob of each run, kept by the coordinator.

Rollout-only workers join a run at any time and have no shared filesystem with the trainer, so
the trainer publishes every new policy version to the coordinator and workers fetch the newest
one from it. ``WeightStore`` holds one blob per run in memory and, when the coordinator has a state
dir, on disk as well (written before the publish is acknowledged), so a coordinator restarted
after ``kill -9`` serves the same version again. Layout::

    <state-dir>/weights/<run id>/v<version, 20 digits>.safetensors   the blob, byte for byte
                                /current.json                       {version, sha256, format,
                                                                     total_bytes, file}

Both files are written as temp file + rename; the blob first, then ``current.json``, and older
blobs are deleted last, so a crash at any moment leaves ``current.json`` naming a complete file.

Versions are fencing tokens: a publish whose version is not above the stored one is refused
(``FencedError``, FAILED_PRECONDITION: a stale trainer must not roll the policy back), except the
same version with the same sha256, which is a retried publish and succeeds again. An upload is
checked chunk by chunk (``WeightUpload``: offsets, size limit) and as a whole (total size, sha256,
a safetensors header) before it replaces anything, so a torn or corrupted upload leaves the
previous version served.

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
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elasticrl.coordinator import validate as v
from elasticrl.errors import FencedError, InvalidRequestError, ResourceLimitError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "safetensors"
DIR_NAME = "weights"
CURRENT = "current.json"
CHUNK_BYTES = 4 << 20
"""Data per ``WeightChunk`` message, well below the default 64 MiB gRPC message limit."""
DEFAULT_MAX_BLOB_BYTES = 16 << 30
"""Largest blob a coordinator accepts by default (16 GiB: an 8B-parameter policy in bf16)."""
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class WeightBlob:
    """One stored policy version. ``data`` is read-only and never changes once stored."""

    run_id: str
    version: int
    sha256: str
    format: str
    data: memoryview

    @property
    def total_bytes(self) -> int:
        return self.data.nbytes


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


def check_safetensors_header(data: bytes | bytearray | memoryview) -> None:
    """Refuse a blob that does not start like a safetensors file (8-byte length + JSON object)."""
    view = memoryview(data)
    if view.nbytes < 8:
        raise InvalidRequestError(f"data: {view.nbytes} bytes is too short for a safetensors file (at least 8)")
    n = int.from_bytes(view[:8], "little")
    if n > min(MAX_SAFETENSORS_HEADER, view.nbytes - 8):
        raise InvalidRequestError(
            f"data: the safetensors header claims {n} bytes but the blob has {view.nbytes - 8} after its length; "
            "send the output of safetensors' save (pack_state_dict)"
        )
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise InvalidRequestError("data: the safetensors header is not a JSON object; send the output of pack_state_dict")


class WeightUpload:
    """Assembles one publish stream: validates its header, places each chunk, verifies the whole.

    No I/O and no protobuf: the servicer feeds it the chunks' fields. ``add`` copies and hashes a
    chunk (the servicer runs it in a thread: both release the GIL on large buffers).
    """

    def __init__(
        self,
        *,
        run_id: str,
        version: int,
        total_bytes: int,
        sha256: str,
        format: str,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    ):
        self.run_id = v.ident("run_id", run_id)
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
                f"weights limit of {max_blob_bytes} bytes ({max_blob_bytes / 2**30:.2f} GiB)"
            )
        self.version = version
        self.total_bytes = total_bytes
        self.sha256 = sha256
        self.format = format
        self.received = 0
        self._buf = bytearray(total_bytes)
        self._hash = hashlib.sha256()

    def check_header(self, i: int, *, run_id: str, version: int, total_bytes: int, sha256: str, format: str) -> None:
        """Chunk ``i`` may leave its header fields empty/0; when set they must equal the first's."""
        for field, sent, first in (
            ("run_id", run_id, self.run_id), ("version", version, self.version),
            ("total_bytes", total_bytes, self.total_bytes), ("sha256", sha256, self.sha256), ("format", format, self.format),
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
        self._buf[offset:end] = data
        self._hash.update(data)
        self.received = end

    def finish(self) -> WeightBlob:
        """The verified blob. ``InvalidRequestError`` names what did not match."""
        if self.received != self.total_bytes:
            raise InvalidRequestError(
                f"total_bytes: the stream ended after {self.received} of {self.total_bytes} bytes (a torn upload); "
                "nothing was stored, publish again"
            )
        digest = self._hash.hexdigest()
        if digest != self.sha256:
            raise InvalidRequestError(
                f"sha256: the {self.total_bytes} bytes received hash to {digest}, the upload declared {self.sha256} "
                "(corrupted in transit or a wrong digest); nothing was stored"
            )
        check_safetensors_header(self._buf)
        return WeightBlob(self.run_id, self.version, self.sha256, self.format, memoryview(self._buf).toreadonly())


class WeightStore:
    """The newest weights of each run; durable under ``root`` when given.

    Methods that change or wait run on the coordinator's event loop; ``commit`` writes the file in
    a worker thread so a multi-GiB blob does not stall leases.
    """

    def __init__(
        self,
        root: str | os.PathLike | None,
        *,
        fsync: bool = False,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    ):
        if max_blob_bytes < 1:
            raise ValueError(f"max_blob_bytes: {max_blob_bytes} must be >= 1")
        self.root = None if root is None else pathlib.Path(root)
        self.fsync = fsync
        self.max_blob_bytes = max_blob_bytes
        self._blobs: dict[str, WeightBlob] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._published: dict[str, asyncio.Event] = {}  # set (and replaced) on every new version
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._load()

    def latest(self, run_id: str) -> WeightBlob | None:
        return self._blobs.get(run_id)

    def runs(self) -> list[str]:
        return sorted(self._blobs)

    def begin(self, *, run_id: str, version: int, total_bytes: int, sha256: str, format: str) -> WeightUpload:
        """Start an upload. Refuses at once what could never be stored (a stale version, a blob
        over the limit) so such a publish costs no transfer."""
        upload = WeightUpload(
            run_id=run_id, version=version, total_bytes=total_bytes, sha256=sha256, format=format,
            max_blob_bytes=self.max_blob_bytes,
        )
        check_publish(self._blobs.get(run_id), run_id, version, sha256)
        return upload

    async def commit(self, blob: WeightBlob) -> bool:
        """Store ``blob`` as its run's newest version and wake the waiters; on disk first when
        durable. Returns False for an idempotent re-publish. ``FencedError`` if a newer version was
        stored meanwhile (the check is repeated under the run's lock)."""
        lock = self._locks.setdefault(blob.run_id, asyncio.Lock())
        async with lock:
            if not check_publish(self._blobs.get(blob.run_id), blob.run_id, blob.version, blob.sha256):
                return False
            if self.root is not None:
                await asyncio.to_thread(self._write, blob)
            self._blobs[blob.run_id] = blob
            event = self._published.pop(blob.run_id, None)
            if event is not None:
                event.set()
        log.info("weights of run %s: version %d stored (%d bytes, sha256 %s)", blob.run_id, blob.version,
                 blob.total_bytes, blob.sha256[:12])
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
            event = self._published.setdefault(run_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- disk ----------------------------------------------------------------------------------

    def run_dir(self, run_id: str) -> pathlib.Path:
        assert self.root is not None, "in-memory store has no directories"
        return self.root / v.ident("run_id", run_id)

    def _write(self, blob: WeightBlob) -> None:
        directory = self.run_dir(blob.run_id)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"v{blob.version:020d}.{FORMAT}"
        _atomic_write(directory / name, blob.data, fsync=self.fsync)
        meta = {"version": blob.version, "sha256": blob.sha256, "format": blob.format,
                "total_bytes": blob.total_bytes, "file": name}
        _atomic_write(directory / CURRENT, json.dumps(meta, indent=2, sort_keys=True).encode(), fsync=self.fsync)
        for old in directory.glob(f"v*.{FORMAT}"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def _load(self) -> None:
        """Read back every run's current blob, verifying it; a damaged one is logged and skipped
        (serving nothing beats serving corrupt weights), and leftovers of a crash are removed."""
        assert self.root is not None
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for tmp in directory.glob("*.tmp"):
                tmp.unlink(missing_ok=True)
            current = directory / CURRENT
            if not current.exists():
                continue
            try:
                meta = json.loads(current.read_text())
                data = (directory / meta["file"]).read_bytes()
                if len(data) != meta["total_bytes"] or sha256_hex(data) != meta["sha256"]:
                    raise ValueError(f"{meta['file']} does not match its size or sha256 in {CURRENT}")
                blob = WeightBlob(v.ident("run_id", directory.name), int(meta["version"]), meta["sha256"],
                                  meta["format"], memoryview(data))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("weights under %s are damaged and will not be served: %s", directory, exc)
                continue
            self._blobs[blob.run_id] = blob
            for old in directory.glob(f"v*.{FORMAT}"):  # a blob written but never made current
                if old.name != meta["file"]:
                    old.unlink(missing_ok=True)
            log.info("weights of run %s: version %d loaded from disk (%d bytes)", blob.run_id, blob.version, blob.total_bytes)


def _atomic_write(path: pathlib.Path, data: bytes | memoryview, *, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- helpers for the trainer and the workers --------------------------------------------------------


def pack_state_dict(state: Mapping[str, "torch.Tensor"], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors blob of ``state`` (tensors moved to CPU and made contiguous; tensors that
    share storage, like tied embeddings, are stored once each as copies)."""
    import torch
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}]: {type(tensor).__name__} is not a tensor; pass a state_dict of tensors")
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # safetensors refuses tensors that share memory
        seen.add(key)
        tensors[name] = t
    return save(tensors, metadata=dict(metadata) if metadata else None)


def unpack_state_dict(blob: bytes | bytearray | memoryview) -> dict[str, "torch.Tensor"]:
    """The tensors of a ``pack_state_dict`` blob, on CPU (safetensors only; nothing executes)."""
    from safetensors.torch import load

    return load(bytes(blob))
