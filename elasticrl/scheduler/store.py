"""Where accepted trajectories live: safetensors shards under the coordinator's state dir.

Each accepted result batch becomes one shard file, written (temp file + rename, and with fsync on
the file and then its directory) before the acceptance is committed to SQLite and acknowledged, so
a coordinator killed at any moment loses no group a worker was told is stored; a shard whose commit
never happened is never referenced, and is removed at the next start (``remove_unreferenced``).
A sealed iteration also gets ``manifest.json``. Layout::

    <state-dir>/trajectories/<run id>/<iteration, 8 digits>/shard-<n>.safetensors
                                                           /manifest.json

A shard is self-describing (no pickle): flat tensors plus a JSON header.

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

Format v1 shards (before multi-turn episodes) have no loss_mask/turns/env_s/truncated and read as
single-turn completions trained on every token.

Without a state dir (``root=None``) the records themselves are kept in memory (no encoding): same
interface, not durable, and ``forget`` drops an old iteration's.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
from safetensors.numpy import load as st_load

from elasticrl.scheduler.state import GroupRecord, SampleRecord

FORMAT = "elasticrl.trajectories.v2"
MANIFEST = "manifest.json"
SHARD_GLOB = "shard-[0-9][0-9][0-9][0-9][0-9][0-9].safetensors"


class TrajectoryStore:
    def __init__(self, root: str | os.PathLike | None, *, fsync: bool = False):
        self.root = None if root is None else pathlib.Path(root)
        self.fsync = fsync
        self._memory: dict[tuple[str, int, str], bytes] = {}
        self._next: dict[tuple[str, int], int] = {}

    def iteration_dir(self, run_id: str, iteration: int) -> pathlib.Path:
        assert self.root is not None, "in-memory store has no directories"
        return self.root / run_id / f"{iteration:08d}"

    def write_shard(self, run_id: str, iteration: int, groups: list[tuple[GroupRecord, list[int]]]) -> str:
        """Store ``(group, prompt ids)`` pairs as one new shard; returns its name."""
        key = (run_id, iteration)
        n = self._next.get(key)
        if n is None:
            n = self._first_free(run_id, iteration)
        self._next[key] = n + 1
        name = f"shard-{n:06d}.safetensors"
        if self.root is None:
            # Nothing has to survive a restart: keep the records, skip the encoding.
            self._memory[(run_id, iteration, name)] = list(groups)
            return name
        directory = self.iteration_dir(run_id, iteration)
        _make_dirs(directory, fsync=self.fsync)
        atomic_write(directory / name, shard_chunks(run_id, iteration, groups), fsync=self.fsync)
        return name

    def _first_free(self, run_id: str, iteration: int) -> int:
        """After a restart, continue numbering after every shard on disk (committed or not)."""
        if self.root is None:
            return sum(1 for k in self._memory if k[:2] == (run_id, iteration))
        directory = self.iteration_dir(run_id, iteration)
        names = [p.name for p in directory.glob("shard-*.safetensors")] if directory.exists() else []
        return 1 + max((int(n[6:12]) for n in names), default=-1)

    def drop(self, run_id: str, iteration: int) -> None:
        """Delete an iteration's shards (retention); its manifest stays, for the record."""
        self._next.pop((run_id, iteration), None)
        if self.root is None:
            self.forget(run_id, iteration)
            return
        directory = self.iteration_dir(run_id, iteration)
        if directory.exists():
            for path in [*directory.glob(SHARD_GLOB), *directory.glob("*.tmp")]:
                path.unlink(missing_ok=True)

    def forget(self, run_id: str, iteration: int) -> bool:
        """In-memory store: drop an iteration's shards (nothing else holds them). Durable: no-op."""
        if self.root is not None:
            return False
        for key in [k for k in self._memory if k[:2] == (run_id, iteration)]:
            del self._memory[key]
        return True

    def read_shard(self, run_id: str, iteration: int, name: str) -> list[tuple[GroupRecord, list[int]]]:
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


def atomic_write(path: pathlib.Path, data: bytes | memoryview | list, *, fsync: bool) -> None:
    """Write ``data`` (bytes, or a list of chunks) to ``path`` under a temporary name, then rename
    it (the weight store uses it too)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, list):
            f.writelines(data)
        else:
            f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:  # make the rename itself durable: without it a crash can lose a committed shard
        fsync_dir(path.parent)


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


_DTYPES = {"<i4": "I32", "<f4": "F32", "|u1": "U8"}
_ITEMSIZE = {"I32": 4, "F32": 4, "U8": 1}


def shard_chunks(run_id: str, iteration: int, groups: list[tuple[GroupRecord, list[int]]]) -> list:
    """The safetensors file of ``groups`` as a list of buffers to write one after the other.

    Written by hand (8-byte header length, JSON header, raw data) because ``safetensors.numpy.save``
    costs ~2 ms per MiB here (it builds the file in a growing Rust buffer, then copies it to bytes),
    more than everything else the coordinator does with a result batch; the sample bytes go out
    as they came in, without a copy.
    """
    samples = [s for g, _ in groups for s in g.samples]
    small = {
        "sample_tokens": np.array([s.num_tokens for s in samples], dtype="<i4"),
        "rewards": np.array([s.reward for s in samples], dtype="<f4"),
        "turns": np.array([s.turns for s in samples], dtype="<i4"),
        "env_s": np.array([s.env_s for s in samples], dtype="<f4"),
        "truncated": np.array([s.truncated for s in samples], dtype="u1"),
        "group_samples": np.array([len(g.samples) for g, _ in groups], dtype="<i4"),
        "prompt_ids": np.array([t for _, p in groups for t in p], dtype="<i4"),
        "prompt_lengths": np.array([len(p) for _, p in groups], dtype="<i4"),
    }
    tensors = [
        ("completion_ids", "I32", [s.completion_ids for s in samples]),
        ("logprobs", "F32", [s.logprobs for s in samples]),
        ("loss_mask", "U8", [s.loss_mask or b"\x01" * s.num_tokens for s in samples]),
    ] + [(k, _DTYPES[v.dtype.str], [v.tobytes()]) for k, v in small.items()]
    header: dict = {"__metadata__": {
        "format": FORMAT, "run_id": run_id, "iteration": str(iteration), "groups": json.dumps(_group_header(groups)),
    }}
    data, offset = [], 0
    for name, dtype, buffers in tensors:
        size = sum(len(b) for b in buffers)
        header[name] = {"dtype": dtype, "shape": [size // _ITEMSIZE[dtype]], "data_offsets": [offset, offset + size]}
        data += buffers
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [len(head).to_bytes(8, "little"), head, *data]


def encode_shard(run_id: str, iteration: int, groups: list[tuple[GroupRecord, list[int]]]) -> bytes:
    return b"".join(shard_chunks(run_id, iteration, groups))


def _group_header(groups: list[tuple[GroupRecord, list[int]]]) -> list[dict]:
    return [
        {
            "task_id": g.task_id,
            "node": g.node,
            "policy_version": g.policy_version,
            "gen_seconds": g.gen_seconds,
            "reward_seconds": g.reward_seconds,
            "finish_reasons": [s.finish_reason for s in g.samples],
            "texts": [s.text for s in g.samples],
        }
        for g, _ in groups
    ]


def decode_shard(data: bytes) -> list[tuple[GroupRecord, list[int]]]:
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
