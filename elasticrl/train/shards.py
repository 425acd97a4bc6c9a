"""One rank's shard of the training state on disk, through ``torch.distributed.checkpoint`` (DCP).

A shard is a flat dict of named ``Chunk``s: pieces of whole tensors, each with its offset in the
whole tensor (a DTensor's local shard, a slice of a ZeRO partition, or a whole replicated tensor).
``write_shard`` saves one as a single safetensors file in the layout of DCP's safetensors storage
(streamed by ``elasticrl.tensorfile``, not through ``dcp.save``); ``read_shards`` loads any set of
chunks (another world's cut) from the shards of a whole world with ``dcp.load``, which reads the
overlapping parts of the saved chunks: that is the resharding.

Three choices keep DCP within the project's rules:

* **No pickle on disk.** DCP's default ``FileSystemWriter`` pickles its ``.metadata`` and
  ``torch.save``s non-tensor values. The shards use DCP's safetensors layout instead (what its
  ``HuggingFaceStorageWriter`` writes with ``save_distributed``, read by its Reader): every file
  records its chunks' offsets in its JSON header (``DCP_SHARDING_INFO``), and the reader rebuilds
  DCP's ``Metadata`` from the headers of the files in the directory, so there is no metadata file
  at all. Shards hold tensors only; everything else goes into a JSON file beside them
  (``snapshot.py``).
* **No pickle over the wire.** ``dcp.save``/``dcp.load`` plan collectively with
  ``gather_object``/``scatter_object``, which pickle; every call here is ``no_dist=True`` (each
  rank saves and loads by itself) and the ranks agree through JSON collectives instead (who owns a
  replicated tensor: ``owners``, a pure function of names and sizes, like DCP's own dedup).
* **Any cut.** DCP's planners know whole tensors, DTensors and ShardedTensors; a ZeRO-1/2
  partition slices each parameter *flattened*, which neither describes. The writer records each
  chunk's offset itself, and ``ChunkLoadPlanner`` extends DCP's default load planner (its
  documented extension point) with the one thing it lacks, a chunk at a given offset, and leaves
  the read planning to DCP's ``create_read_items_for_chunk_list``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import warnings
from collections.abc import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    SAVED_OFFSETS_KEY,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from elasticrl import tensorfile
from elasticrl.errors import ElasticRLError

# Every call is no_dist on purpose (see above): DCP's warning that it assumes a single process is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

SUFFIX = ".safetensors"


class ShardError(ElasticRLError):
    """A set of shards that cannot give what was asked (a missing piece, a shape that differs)."""


@dataclasses.dataclass
class Chunk:
    """``tensor`` is the part of a whole tensor of shape ``size`` that starts at ``offsets``."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    replicated: bool = False
    """Every rank holds the same whole tensor: one rank (``owners``) saves it for all."""

    @staticmethod
    def whole(tensor: torch.Tensor, *, replicated: bool = False) -> Chunk:
        return Chunk(tensor, (0,) * tensor.dim(), tuple(tensor.shape), replicated)

    @staticmethod
    def flat(part: torch.Tensor, offset: int, numel: int) -> Chunk:
        """Elements ``[offset, offset + part.numel())`` of a tensor of ``numel`` elements, flattened:
        how ZeRO-1/2 cut parameters and their optimizer state into partitions."""
        return Chunk(part.reshape(-1), (offset,), (numel,))

    @staticmethod
    def of_dtensor(t) -> Chunk:
        """The local shard of a DTensor (FSDP2), at the offset its placements give it."""
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return Chunk(t.to_local(), tuple(offsets), tuple(t.shape))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Which rank saves each replicated tensor (name -> bytes): the biggest first, each to the rank
    with the fewest bytes so far, as DCP's dedup balances them. Pure: every rank computes the same."""
    load = [0] * world_size
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def own_part(chunks: Mapping[str, Chunk], rank: int, world_size: int) -> dict[str, Chunk]:
    """What ``rank`` saves of the state it holds: its sharded chunks and the replicated tensors it owns."""
    replicated = {name: c.nbytes for name, c in chunks.items() if c.replicated}
    owner = owners(replicated, world_size)
    return {name: c for name, c in chunks.items() if not c.replicated or owner[name] == rank}


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner into a flat dict of ``Chunk``s: DCP finds the saved chunks each
    destination overlaps and reads those parts into ``Chunk.tensor`` in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata  # names and shapes checked by read_shards
        items = []
        for fqn, c in self.state_dict.items():
            md = saved[fqn]
            want = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.size())
            items += create_read_items_for_chunk_list(fqn, md, [want])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        target = self.state_dict[read_item.dest_index.fqn].tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # the reader copied into the destination's own storage


def write_shard(chunks: Mapping[str, Chunk], path: str) -> int:
    """Save ``chunks`` as the safetensors file ``path`` (written aside, then renamed into place, so
    a file under its final name is complete); returns its size in bytes.

    The file is what DCP's ``HuggingFaceStorageWriter`` writes (each chunk under its name, its
    offset in ``DCP_SHARDING_INFO``), but streamed by ``tensorfile.write``: DCP's writer serializes
    the whole shard in memory first, holding the GIL (see ``elasticrl.tensorfile``).

    Raises:
        TensorFileError: a chunk's dtype has no safetensors name."""
    # An empty piece of a tensor that is not empty holds nothing, and DCP's reader indexes pieces
    # by (name, offset): at another rank's piece's offset it would hide that piece.
    chunks = {k: c for k, c in chunks.items() if c.tensor.numel() or not math.prod(c.size)}
    sharding = {name: {SAVED_OFFSETS_KEY: list(c.offsets)} for name, c in chunks.items()}
    metadata = {CUSTOM_METADATA_KEY: json.dumps(sharding), DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        tensorfile.write(tmp, {name: c.tensor for name, c in chunks.items()}, metadata)
        os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.getsize(path)


def saved_tensors(directory: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (whole shape, dtype) of every tensor in the shards of ``directory``.

    Raises:
        ShardError: a shard's header cannot be read (a truncated file, say)."""
    md = _read_metadata(directory)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()}


def _read_metadata(directory: str) -> Metadata:
    try:
        return HuggingFaceStorageReader(directory).read_metadata()  # the files' headers only
    except Exception as exc:  # noqa: BLE001 - safetensors' and json's errors name no file
        raise ShardError(f"{directory}: a shard's header cannot be read: {type(exc).__name__}: {exc}") from exc


def check_complete(metadata: Metadata) -> None:
    """Every saved tensor is covered by its chunks exactly once (a lost shard would otherwise leave
    part of a destination unread, silently)."""
    for fqn, md in metadata.state_dict_metadata.items():
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if covered != math.prod(md.size):
            raise ShardError(f"{fqn}: the shards hold {covered} of its {math.prod(md.size)} elements (a shard is missing)")


def read_shards(directory: str, chunks: Mapping[str, Chunk]) -> None:
    """Fill every destination chunk from the shards (``*.safetensors``) in ``directory``, whatever
    cut they were saved with."""
    if not chunks:
        return
    if not glob.glob(os.path.join(directory, "*" + SUFFIX)):
        raise ShardError(f"{directory}: no shards")
    metadata = _read_metadata(directory)
    check_complete(metadata)
    for fqn, c in chunks.items():  # here, not in the planner: DCP would wrap the error in its own
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise ShardError(f"the snapshot in {directory} has no tensor {fqn!r}")
        if tuple(md.size) != tuple(c.size):
            raise ShardError(f"{fqn}: the snapshot in {directory} has shape {tuple(md.size)}, this model {tuple(c.size)}")
    try:
        dcp.load(dict(chunks), storage_reader=HuggingFaceStorageReader(directory), planner=ChunkLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise ShardError(f"{directory}: reading the shards failed: {type(exc).__name__}: {str(exc)[:500]}") from exc
