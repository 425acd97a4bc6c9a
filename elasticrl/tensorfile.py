"""safetensors files and blobs written from the tensors' own memory, without holding the GIL.

``safetensors.torch.save`` (and DCP's safetensors writer, which calls it) builds the whole file as
one bytes object inside the Rust extension, holding the GIL throughout: 3-3.6 s per GiB on these
machines. In a training process that is long enough to starve its lease keep-alive thread, and a
node on a 240M-parameter model lost its 3 s lease that way. Here the header is built in Python
and each tensor's bytes are moved by torch (``copy_``, which releases the GIL) or by the file's
``write`` (a system call, GIL released), one tensor at a time, with no second copy of the whole.

The layout is the format's (https://huggingface.co/docs/safetensors): an 8-byte little-endian
header length, a JSON header (``__metadata__`` of strings, then each tensor's dtype, shape and
``data_offsets``), padded with spaces so the data starts 8-byte aligned, then the tensors' bytes
back to back. Any safetensors reader reads it. torch is imported inside the functions: the
coordinator imports this module's users without it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elasticrl.errors import ElasticRLError

if TYPE_CHECKING:
    import torch


class TensorFileError(ElasticRLError, ValueError):
    """What a safetensors file cannot hold (a dtype, a name, metadata that is not strings), or a
    blob that is not a well-formed one."""


def _dtype_names() -> dict:
    from safetensors.torch import _TYPES  # the names safetensors' own reader maps back

    return {dtype: name for name, dtype in _TYPES.items()}


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, int, list[str]]:
    """The length prefix and padded header, the data's size in bytes, and the tensors' names in
    the order of their bytes: by element size, largest first, then by name, as safetensors writes
    them, so that every tensor starts aligned to its element size."""
    names = _dtype_names()
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TensorFileError(f"metadata: {dict(metadata)!r}: keys and values must be strings")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise TensorFileError(f"tensor name {name!r}: must be a string other than '__metadata__'")
        if t.dtype not in names:
            raise TensorFileError(f"tensor {name!r}: dtype {t.dtype} cannot be saved in a safetensors file")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    start = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [start, start + nbytes]}
        start += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, start, order


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its own device (a contiguous copy if it is not)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def write(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """``tensors`` (any device) as the safetensors file ``path``, fsynced."""
    prefix, _, order = _layout(tensors, metadata)
    with open(path, "wb") as f:
        f.write(prefix)
        for name in order:
            if tensors[name].numel():
                f.write(memoryview(flat_bytes(tensors[name]).cpu().numpy()))
        f.flush()
        os.fsync(f.fileno())


def to_buffer(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> memoryview:
    """``tensors`` (any device) as one safetensors blob (what any safetensors reader reads; the
    layout ``write`` writes), in an anonymous mapping (its pages are zeroed by the kernel as the
    bytes land; ``bytearray(n)`` would write n zeros first, holding the GIL), as a read-only view.
    Tensors that share memory (tied embeddings) are each stored whole."""
    import torch

    prefix, size, order = _layout(tensors, metadata)
    out = mmap.mmap(-1, len(prefix) + size)
    out[:len(prefix)] = prefix
    if size:
        data = torch.frombuffer(out, dtype=torch.uint8, offset=len(prefix), count=size)
        start = 0
        for name in order:
            if tensors[name].numel():
                raw = flat_bytes(tensors[name])
                data[start:start + raw.numel()].copy_(raw)
                start += raw.numel()
        del data
    return memoryview(out).toreadonly()


def _is_size(x) -> bool:
    return type(x) is int and x >= 0  # not a bool, a float or a string


def from_buffer(blob) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (CPU copies, in the order of their bytes) and metadata of a safetensors blob (any
    buffer: bytes, a memoryview, a mapping), copied out by torch without holding the GIL, which
    ``safetensors.torch.load`` holds for seconds per GiB. The header is checked as safetensors'
    own reader checks it.

    Raises:
        TensorFileError: not a safetensors blob, or a tensor whose dtype, shape or offsets do not
            add up (named)."""
    import torch

    view = memoryview(blob).cast("B")
    if view.nbytes < 8:
        raise TensorFileError(f"a safetensors blob starts with an 8-byte header length; got {view.nbytes} bytes")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > view.nbytes - 8:
        raise TensorFileError(f"header length {header_len} is past the blob's end ({view.nbytes} bytes)")
    try:
        header = json.loads(bytes(view[8:8 + header_len]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TensorFileError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorFileError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"__metadata__: {metadata!r} is not an object of strings")
    data = view[8 + header_len:]
    names = {name: dtype for dtype, name in _dtype_names().items()}
    entries = []
    for name, entry in header.items():
        try:
            dtype, shape, offsets = names[entry["dtype"]], list(entry["shape"]), list(entry["data_offsets"])
        except (KeyError, TypeError) as exc:
            raise TensorFileError(f"tensor {name!r}: not a dtype, shape and data_offsets entry ({exc!r})") from None
        if not all(_is_size(n) for n in shape + offsets) or len(offsets) != 2:
            raise TensorFileError(f"tensor {name!r}: shape {shape} and data_offsets {offsets} must be sizes (integers >= 0), "
                                  "two offsets")
        numel = 1
        for n in shape:  # as safetensors' checked multiplication: no product past 64 bits
            numel *= n
            if numel >= 1 << 64:
                raise TensorFileError(f"tensor {name!r}: shape {shape} holds more elements than 64 bits count")
        entries.append((offsets[0], offsets[1], name, dtype, shape, numel * dtype.itemsize))
    out, end = {}, 0
    for start, stop, name, dtype, shape, nbytes in sorted(entries):
        if start != end or stop - start != nbytes or stop > data.nbytes:
            raise TensorFileError(f"tensor {name!r}: data_offsets [{start}, {stop}] are not the {nbytes} bytes after the "
                                  f"previous tensor's end {end} within the {data.nbytes} bytes of data")
        try:
            t = torch.empty(shape, dtype=dtype)
        except (RuntimeError, TypeError, OverflowError) as exc:  # an empty tensor with a dimension torch cannot hold
            raise TensorFileError(f"tensor {name!r}: shape {shape}: {exc}") from None
        if nbytes:
            with warnings.catch_warnings():  # a read-only buffer (bytes): only read here
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                src = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=stop - start)
            t.reshape(-1).view(torch.uint8).copy_(src)
            del src
        out[name], end = t, stop
    if end != data.nbytes:
        raise TensorFileError(f"the tensors end at byte {end} of the data, which has {data.nbytes}")
    return out, metadata
