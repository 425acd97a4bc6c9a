"""Where accepted trajectories live: safetensors shards under the coordinator's state dir.

Each accepted result batch becomes one shard file, written (temp file + rename, and with fsync on
the file and then its directory) before the acceptance is committed to SQLite and acknowledged, so
a coordinator killed at any moment loses no group a worker was told is stored; a shard whose commit
never happened is never referenced, and is removed at the next start (``remove_unreferenced``).
A sealed iteration also gets ``manifest.json``. Layout::

    <state-dir>/trajectories/<run id>/<iteration, 8 digits>/shard-<n>.safetensors
                                                           /manifest.json

A shard is self-describing (no pickle): a safetensors file, flat tensors plus a JSON header.
Format v3 (written since the trajectory path stopped decoding samples on arrival):

    groups         uint8 [B]  each group's ``TrajectoryGroup`` message (proto/elasticrl/v1/
                              scheduler.proto, fields 1-6: iteration, task_id, samples,
                              policy_version, gen_seconds, reward_seconds), back to back: the bytes
                              its worker sent, checked on arrival (``framing.read_group``)
    group_bytes    int64 [G]  the length of each
    prompt_ids     int32 [P]  every group's prompt, back to back
    prompt_lengths int32 [G]
    metadata "groups": JSON list of {task_id, node}

so writing one is a header and the received bytes in one ``writev``, and a group read back is
served to a trainer as it is. Formats v1 and v2 (per-sample tensors) are still read:

    completion_ids int32 [T]   every sample's (episode's) tokens, back to back
    logprobs       float32 [T] the sampling policy's logprob of each of them (0 off the loss mask)
    loss_mask      uint8 [T]   1 on the policy's own tokens (trained), 0 on observations/templates
    sample_tokens  int32 [S]   token count of each sample
    rewards        float32 [S] each episode's return
    turns          int32 [S]   policy turns of each episode
    env_s          float32 [S] seconds each episode spent in its environment
    truncated      uint8 [S]   1 when the episode was cut short
    group_samples  int32 [G]   samples per group
    prompt_ids     int32 [P]   every group's prompt, back to back
    prompt_lengths int32 [G]
    metadata "groups": JSON list of {task_id, node, policy_version, gen_seconds, reward_seconds,
                       finish_reasons, texts}

v1 shards (before multi-turn episodes) have no loss_mask/turns/env_s/truncated and read as
single-turn completions trained on every token.

Without a state dir (``root=None``) the records themselves are kept in memory (no encoding): same
interface, not durable, and ``forget`` drops an old iteration's.
"""

from __future__ import annotations

import array
import concurrent.futures
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
from safetensors.numpy import load as st_load

from elasticrl.scheduler import framing
from elasticrl.scheduler.recycle import DIRECTORY as RECYCLE_DIRECTORY
from elasticrl.scheduler.recycle import Recycler
from elasticrl.scheduler.state import GroupRecord, SampleRecord

FORMAT = "elasticrl.trajectories.v3"
LEGACY_FORMATS = ("elasticrl.trajectories.v1", "elasticrl.trajectories.v2")
# A group as the store keeps it: decoded, or as its worker sent it.
Group = GroupRecord | framing.WireGroup
MANIFEST = "manifest.json"
SHARD_GLOB = "shard-[0-9][0-9][0-9][0-9][0-9][0-9].safetensors"


class TrajectoryStore:
    def __init__(self, root: str | os.PathLike | None, *, fsync: bool = False):
        self.root = None if root is None else pathlib.Path(root)
        self.fsync = fsync
        self._memory: dict[tuple[str, int, str], list[tuple[Group, Sequence[int]]]] = {}
        self._next: dict[tuple[str, int], int] = {}
        self._made: set[pathlib.Path] = set()  # iteration directories known to exist
        self._reaper: concurrent.futures.ThreadPoolExecutor | None = None  # retires dropped shards
        self._reaping: list[concurrent.futures.Future] = []
        # Dropped shards, overwritten by new ones (creating and deleting files cost more).
        self.recycler = None if self.root is None else Recycler(self.root)

    def iteration_dir(self, run_id: str, iteration: int) -> pathlib.Path:
        assert self.root is not None, "in-memory store has no directories"
        return self.root / run_id / f"{iteration:08d}"

    def write_shard(self, run_id: str, iteration: int, groups: list[tuple[Group, Sequence[int]]]) -> str:
        """Store ``(group, prompt ids)`` pairs as one new shard; returns its name."""
        name = self.reserve(run_id, iteration)
        self.write(run_id, iteration, name, groups)
        return name

    def reserve(self, run_id: str, iteration: int) -> str:
        """The name of the iteration's next shard (on the event loop: names are handed out in order)."""
        key = (run_id, iteration)
        n = self._next.get(key)
        if n is None:
            n = self._first_free(run_id, iteration)
        self._next[key] = n + 1
        return f"shard-{n:06d}.safetensors"

    def write(self, run_id: str, iteration: int, name: str, groups: list[tuple[Group, Sequence[int]]]) -> None:
        """Store ``groups`` as shard ``name`` (from ``reserve``). Durable, it only writes files, so
        it may run in a worker thread while the event loop goes on (``core.ResultPipeline``).

        Raises:
            OSError: the file could not be written (nothing was renamed into place).
        """
        if self.root is None:
            # Nothing has to survive a restart: keep the records, skip the encoding.
            self._memory[(run_id, iteration, name)] = list(groups)
            return
        directory = self.iteration_dir(run_id, iteration)
        if directory not in self._made:  # a stat per batch otherwise; nothing removes these dirs
            _make_dirs(directory, fsync=self.fsync)
            self._made.add(directory)
        atomic_write(directory / name, shard_chunks(run_id, iteration, groups), fsync=self.fsync, reuse=self.recycler.take())

    def discard(self, run_id: str, iteration: int, name: str) -> None:
        """Remove shard ``name`` (written, or being written, for a batch that will not be committed)
        if it is there. A write still running when this is called leaves an orphan, which the
        next start-up removes (``remove_unreferenced``), as it does a crash's."""
        if self.root is None:
            self._memory.pop((run_id, iteration, name), None)
            return
        (self.iteration_dir(run_id, iteration) / name).unlink(missing_ok=True)

    def _first_free(self, run_id: str, iteration: int) -> int:
        """After a restart, continue numbering after every shard on disk (committed or not)."""
        if self.root is None:
            return sum(1 for k in self._memory if k[:2] == (run_id, iteration))
        directory = self.iteration_dir(run_id, iteration)
        names = [p.name for p in directory.glob("shard-*.safetensors")] if directory.exists() else []
        return 1 + max((int(n[6:12]) for n in names), default=-1)

    def drop(self, run_id: str, iteration: int) -> None:
        """Delete an iteration's shards (retention); its manifest stays, for the record.

        A background thread retires the files (``recycle.Recycler``: kept to be overwritten by new
        shards, or unlinked): unlinking an iteration's hundred 1 MiB shards took 20-35 ms here, a
        stall of the event loop (every stream, every barrier) at each seal. Nothing refers to them
        any more (SQLite and memory forgot the iteration first); a process that ends before they
        are gone leaves them to ``remove_dropped`` at its next start.
        """
        self._next.pop((run_id, iteration), None)
        if self.root is None:
            self.forget(run_id, iteration)
            return
        directory = self.iteration_dir(run_id, iteration)
        self._made.discard(directory)
        if directory.exists():
            paths = [*directory.glob(SHARD_GLOB), *directory.glob("*.tmp")]
            if paths:
                self._reap(paths)

    def _reap(self, paths: list[pathlib.Path]) -> None:
        if self._reaper is None:
            self._reaper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-delete")
        self._reaping = [f for f in self._reaping if not f.done()]
        self._reaping.append(self._reaper.submit(self.recycler.retire, paths))

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until the shards dropped so far are retired.

        Raises:
            TimeoutError: they were not, within ``timeout_s``.
        """
        _, late = concurrent.futures.wait(self._reaping, timeout=timeout_s)
        if late:
            raise TimeoutError(f"{len(late)} shard deletion(s) still running after {timeout_s:g}s")
        self._reaping = []

    def remove_dropped(self, kept: set[tuple[str, int]]) -> list[pathlib.Path]:
        """At start-up: delete the shard and temp files of every iteration directory that is not
        one of ``kept`` (the iterations SQLite holds), leaving manifests and other files. Those are
        shards of iterations dropped by a process that ended before its ``drop`` finished."""
        if self.root is None or not self.root.is_dir():
            return []
        gone = []
        for run_dir in self.root.iterdir():
            if not run_dir.is_dir() or run_dir.name == RECYCLE_DIRECTORY:
                continue
            for directory in run_dir.iterdir():
                name = directory.name
                if len(name) != 8 or not name.isdigit() or (run_dir.name, int(name)) in kept or not directory.is_dir():
                    continue
                paths = [*directory.glob(SHARD_GLOB), *directory.glob("*.tmp")]
                _unlink_all(paths)
                gone += paths
        return gone

    def forget(self, run_id: str, iteration: int) -> bool:
        """In-memory store: drop an iteration's shards (nothing else holds them). Durable: no-op."""
        if self.root is not None:
            return False
        for key in [k for k in self._memory if k[:2] == (run_id, iteration)]:
            del self._memory[key]
        return True

    def read_shard(self, run_id: str, iteration: int, name: str) -> list[tuple[Group, Sequence[int]]]:
        if self.root is None:
            return list(self._memory[(run_id, iteration, name)])
        else:
            data = (self.iteration_dir(run_id, iteration) / name).read_bytes()
        return decode_shard(data)

    def shard_names(self, run_id: str, iteration: int) -> set[str]:
        """Names of the shard files of an iteration on disk (durable store) or in memory."""
        if self.root is None:
            return {k[2] for k in self._memory if k[:2] == (run_id, iteration)}
        directory = self.iteration_dir(run_id, iteration)
        return {p.name for p in directory.glob(SHARD_GLOB)} if directory.exists() else set()

    def remove_unreferenced(self, run_id: str, iteration: int, keep: set[str]) -> list[str]:
        """Delete the iteration's shard files not in ``keep`` and its temp files (leftovers of a
        crash between writing a shard and committing it, or mid-write); returns their names.
        Call only at start-up, before any shard is written. Other files are left alone."""
        if self.root is None:
            return []
        directory = self.iteration_dir(run_id, iteration)
        if not directory.exists():
            return []
        gone = sorted(p.name for p in directory.glob(SHARD_GLOB) if p.name not in keep)
        gone += sorted(p.name for p in directory.glob("*.tmp"))
        for name in gone:
            (directory / name).unlink(missing_ok=True)
        return gone

    def write_manifest(self, run_id: str, iteration: int, manifest: dict) -> None:
        if self.root is None:
            return
        directory = self.iteration_dir(run_id, iteration)
        _make_dirs(directory, fsync=self.fsync)
        atomic_write(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode(), fsync=self.fsync)


def _unlink_all(paths: list[pathlib.Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def atomic_write(path: pathlib.Path, data: bytes | memoryview | list, *, fsync: bool, reuse: pathlib.Path | None = None) -> None:
    """Write ``data`` (bytes, or a list of buffers) to a file that is renamed to ``path`` once
    complete (the weight store uses it too): ``path`` never holds a partial file. ``reuse``: a
    file of no further use (``Recycler.take``), overwritten where it lies and renamed into place,
    one rename instead of two (the kernel's rename was ~1% of the durable coordinator's CPU each);
    if it cannot be opened, a new temporary file is created beside ``path``."""
    fd = None
    if reuse is not None:
        try:
            fd = os.open(reuse, os.O_WRONLY)
        except OSError:
            pass
    src = reuse if fd is not None else path.with_name(path.name + ".tmp")
    if fd is None:
        fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size = _write_all(fd, data if isinstance(data, list) else [data])
        if src is reuse:  # the old content may run past the new
            os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        if src is reuse:  # half overwritten: of no use to the recycler any more
            reuse.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(src, path)
    if fsync:  # make the rename itself durable: without it a crash can lose a committed shard
        fsync_dir(path.parent)


def _write_all(fd: int, buffers: list) -> int:
    """``buffers`` one after the other (returns how many bytes), in as few ``writev`` calls as the kernel allows: a shard is a
    header plus its groups' received bytes, and one call per buffer through a buffered file (the
    format before v3 had ~100 per MiB) cost several times the copy itself here."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    first = 0
    while first < len(views):
        n = os.writev(fd, views[first:first + _IOV_MAX])
        while n:  # a short write: drop what went out, go on from the middle of a buffer
            size = len(views[first])
            if n >= size:
                n -= size
                first += 1
            else:
                views[first] = views[first][n:]
                n = 0
    return total


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def _make_dirs(directory: pathlib.Path, *, fsync: bool) -> None:
    """``mkdir -p``; with ``fsync``, each directory created is made durable in its parent too."""
    if directory.is_dir():
        return
    created = []
    d = directory
    while not d.exists():
        created.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    if fsync:
        for d in reversed(created):
            fsync_dir(d.parent)


def fsync_dir(directory: pathlib.Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (the weight store uses it too)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DTYPES = {"<i4": "I32", "<f4": "F32", "|u1": "U8", "<i8": "I64"}
_ITEMSIZE = {"I32": 4, "F32": 4, "U8": 1, "I64": 8}


def shard_chunks(run_id: str, iteration: int, groups: list[tuple[Group, Sequence[int]]]) -> list:
    """The v3 safetensors file of ``groups`` as a list of buffers to write one after the other.

    Written by hand (8-byte header length, JSON header, raw data) because ``safetensors.numpy.save``
    costs ~2 ms per MiB here (it builds the file in a growing Rust buffer, then copies it to bytes);
    a received group goes out as the slice of the message it came in, without a copy.
    """
    wires, lengths = [], []
    for g, _ in groups:
        parts, n = framing.group_parts(iteration, g)
        wires += parts
        lengths.append(n)
    small = {
        "group_bytes": np.array(lengths, dtype="<i8"),
        "prompt_ids": _prompt_ids([p for _, p in groups]),
        "prompt_lengths": np.array([len(p) for _, p in groups], dtype="<i4"),
    }
    tensors = [("groups", "U8", wires)] + [(k, _DTYPES[v.dtype.str], [v.tobytes()]) for k, v in small.items()]
    meta = [{"task_id": g.task_id, "node": g.node} for g, _ in groups]
    header: dict = {"__metadata__": {"format": FORMAT, "run_id": run_id, "iteration": str(iteration), "groups": json.dumps(meta)}}
    data, offset = [], 0
    for name, dtype, buffers in tensors:
        size = sum(len(b) for b in buffers)
        header[name] = {"dtype": dtype, "shape": [size // _ITEMSIZE[dtype]], "data_offsets": [offset, offset + size]}
        data += buffers
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [len(head).to_bytes(8, "little"), head, *data]


def _prompt_ids(prompts: list) -> np.ndarray:
    """The prompts' ids back to back, int32: the coordinator keeps a submitted task's prompt as an
    ``array("i")`` (``convert.task_from_pb``), copied here as a whole, not an id at a time."""
    joined = array.array("i")
    for p in prompts:
        joined.extend(p)  # an array("i") as one copy
    return np.frombuffer(joined, dtype=np.intc).astype("<i4", copy=False)


def encode_shard(run_id: str, iteration: int, groups: list[tuple[Group, Sequence[int]]]) -> bytes:
    return b"".join(shard_chunks(run_id, iteration, groups))


def decode_shard(data: bytes) -> list[tuple[Group, Sequence[int]]]:
    """The ``(group, prompt ids)`` pairs of a shard file of any format this store ever wrote.

    Raises:
        ValueError (or a safetensors/JSON/InvalidRequestError error): the file is damaged.
    """
    header, base = _header(data)
    fmt = header.get("__metadata__", {}).get("format", "")
    if fmt in LEGACY_FORMATS:
        return _decode_legacy(data)
    if fmt != FORMAT:
        raise ValueError(f"shard format {fmt!r} is not one this coordinator reads ({FORMAT}, {', '.join(LEGACY_FORMATS)})")
    meta = json.loads(header["__metadata__"]["groups"])
    lengths = _tensor(data, header, base, "group_bytes", "<i8").tolist()
    prompts = _tensor(data, header, base, "prompt_ids", "<i4").tolist()
    prompt_lengths = _tensor(data, header, base, "prompt_lengths", "<i4").tolist()
    if not len(meta) == len(lengths) == len(prompt_lengths):
        raise ValueError(f"shard header lists {len(meta)} groups, {len(lengths)} lengths, {len(prompt_lengths)} prompts")
    at, end = (base + x for x in header["groups"]["data_offsets"])
    if sum(lengths) != end - at:
        raise ValueError("shard groups tensor does not hold the lengths it lists")
    out, pr = [], 0
    for k, (m, n, p_len) in enumerate(zip(meta, lengths, prompt_lengths)):
        _, group = framing.read_group(f"shard group {k}", data, at, at + n, node=m["node"])
        if group.task_id != m["task_id"]:
            raise ValueError(f"shard group {k} is task {group.task_id!r}, its header says {m['task_id']!r}")
        out.append((group, prompts[pr:pr + p_len]))
        at += n
        pr += p_len
    return out


def _header(data: bytes) -> tuple[dict, int]:
    """A safetensors buffer's JSON header and where its data starts, checked against its length."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + n > len(data):
        raise ValueError(f"shard of {len(data)} bytes is shorter than its header says ({n} bytes of header)")
    header = json.loads(data[8:8 + n])
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    if max(ends, default=0) > len(data) - 8 - n:
        raise ValueError(f"shard is truncated: {len(data)} bytes, its header needs {8 + n + max(ends)}")
    return header, 8 + n


def _tensor(data: bytes, header: dict, base: int, name: str, dtype: str) -> np.ndarray:
    a, b = header[name]["data_offsets"]
    return np.frombuffer(data, dtype=dtype, count=(b - a) // np.dtype(dtype).itemsize, offset=base + a)


def _decode_legacy(data: bytes) -> list[tuple[GroupRecord, list[int]]]:
    """Formats v1 and v2: per-sample tensors, the groups' fields in the JSON header."""
    tensors = st_load(data)
    header = json.loads(_metadata(data)["groups"])
    ids = tensors["completion_ids"].astype("<i4", copy=False)
    lps = tensors["logprobs"].astype("<f4", copy=False)
    sample_tokens = tensors["sample_tokens"].tolist()
    rewards = tensors["rewards"].tolist()
    prompts = tensors["prompt_ids"].tolist()
    n_samples_all = len(sample_tokens)
    # v1 shards: single-turn completions, every token trained.
    mask = tensors["loss_mask"] if "loss_mask" in tensors else None
    turns = tensors["turns"].tolist() if "turns" in tensors else [1] * n_samples_all
    env_s = tensors["env_s"].tolist() if "env_s" in tensors else [0.0] * n_samples_all
    truncated = tensors["truncated"].tolist() if "truncated" in tensors else [0] * n_samples_all
    out, tok, smp, pr = [], 0, 0, 0
    for meta, n_samples, p_len in zip(header, tensors["group_samples"].tolist(), tensors["prompt_lengths"].tolist()):
        samples = []
        for j in range(n_samples):
            n = sample_tokens[smp]
            sample_mask = b"" if mask is None else mask[tok:tok + n].tobytes()
            samples.append(SampleRecord(
                completion_ids=ids[tok:tok + n].tobytes(),
                logprobs=lps[tok:tok + n].tobytes(),
                reward=rewards[smp],
                finish_reason=meta["finish_reasons"][j],
                text=meta["texts"][j],
                loss_mask=b"" if sample_mask.count(1) == n else sample_mask,
                turns=turns[smp],
                env_s=env_s[smp],
                truncated=bool(truncated[smp]),
            ))
            tok += n
            smp += 1
        group = GroupRecord(
            task_id=meta["task_id"],
            node=meta["node"],
            policy_version=int(meta["policy_version"]),
            gen_seconds=float(meta["gen_seconds"]),
            reward_seconds=float(meta["reward_seconds"]),
            samples=samples,
        )
        out.append((group, prompts[pr:pr + p_len]))
        pr += p_len
    return out


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (8-byte little-endian header length, JSON)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__", {})
