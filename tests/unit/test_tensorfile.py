"""safetensors files and blobs built from the tensors' own memory (``elasticrl.tensorfile``): what
safetensors' own reader reads back, for every kind of tensor a state dict holds, without the
whole-file serialization in memory that holds the GIL."""

from __future__ import annotations

import json
import random

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from elasticrl import tensorfile
from elasticrl.scheduler.weights import pack_state_dict, unpack_state_dict

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


@pytest.fixture(autouse=True)
def no_serialization_in_memory(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("safetensors.torch.save holds the GIL while it builds the whole file")

    monkeypatch.setattr(safetensors.torch, "save", refuse)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(rng.randint(1, 12)):
        dtype = rng.choice(DTYPES)
        shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
        t = (torch.rand(shape, generator=gen) * 100).to(dtype)
        if t.dim() >= 2 and rng.random() < 0.3:
            t = t.transpose(0, 1)  # not contiguous
        state[f"layer.{i}.{dtype}".replace("torch.", "")] = t
    if rng.random() < 0.5:  # tied: two names, one storage
        first = next(iter(state))
        state["tied"] = state[first]
    return state


@pytest.mark.parametrize("seed", range(20))
def test_a_blob_reads_back_every_tensor_exactly(seed):
    state = random_state(seed)
    blob = pack_state_dict(state, {"run": "r", "version": "7"})
    back = unpack_state_dict(blob)
    assert all(torch.equal(unpack_state_dict(bytes(blob))[n], t) for n, t in state.items())  # a read-only buffer too
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    header_len = int.from_bytes(blob[:8], "little")
    assert header_len % 8 == 0  # the data starts 8-byte aligned, as safetensors writes
    header = json.loads(bytes(blob[8:8 + header_len]))  # every tensor aligned to its element size
    starts = {n: e["data_offsets"][0] for n, e in header.items() if n != "__metadata__"}
    assert all((8 + header_len + starts[n]) % state[n].element_size() == 0 for n in starts), starts
    with pytest.raises(TypeError):
        blob[0] = 0  # read-only: nobody changes a published blob
    assert pack_state_dict(state, {"run": "r", "version": "7"}) == blob  # the same state, the same bytes


@pytest.mark.parametrize("seed", range(10))
def test_a_file_reads_back_with_its_metadata(tmp_path, seed):
    state = random_state(seed)
    path = tmp_path / "f.safetensors"
    tensorfile.write(path, state, {"k": "v"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert set(f.keys()) == set(state)
        for name, t in state.items():
            assert torch.equal(f.get_tensor(name), t), name
    assert path.read_bytes() == bytes(tensorfile.to_buffer(state, {"k": "v"}))  # one layout, two ways


def test_what_a_safetensors_file_cannot_hold_is_refused_by_name():
    with pytest.raises(tensorfile.TensorFileError, match="tensor 'z': dtype torch.complex128"):
        tensorfile.to_buffer({"a": torch.ones(2), "z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(TypeError, match=r"state\['x'\]: list is not a tensor"):
        pack_state_dict({"x": [1, 2]})
    with pytest.raises(tensorfile.TensorFileError, match="metadata: .* must be strings"):
        pack_state_dict({"a": torch.ones(1)}, {"version": 7})
    with pytest.raises(tensorfile.TensorFileError, match="tensor name '__metadata__'"):
        pack_state_dict({"__metadata__": torch.ones(1)})
    assert unpack_state_dict(pack_state_dict({})) == {}


def test_a_blob_that_does_not_add_up_is_refused_naming_what():
    good = bytes(tensorfile.to_buffer({"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int8)}))
    header_len = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + header_len])

    def blob(h: dict, data: bytes = good[8 + header_len:]) -> bytes:
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + data

    cases = [
        (b"\x01", "8-byte header length"),
        (b"\xff" * 8 + b"{}", "past the blob's end"),
        (blob([1, 2]), "not a JSON object"),
        (len(b"{nope").to_bytes(8, "little") + b"{nope", "not JSON"),
        (blob({**header, "a": {**header["a"], "dtype": "F7"}}), "tensor 'a': not a dtype"),
        (blob({**header, "a": {**header["a"], "shape": [-2]}}), r"tensor 'a': shape \[-2\] .* must be sizes"),
        (blob({**header, "a": {**header["a"], "shape": [1.9]}}), "tensor 'a': shape .* must be sizes"),
        (blob({**header, "a": {**header["a"], "shape": [True, True]}}), "tensor 'a': shape .* must be sizes"),
        (blob({**header, "a": {**header["a"], "shape": "2"}}), "tensor 'a': shape .* must be sizes"),
        (blob({**header, "a": {**header["a"], "data_offsets": ["0", "8"]}}), "tensor 'a': shape .* must be sizes"),
        (blob({**header, "a": {**header["a"], "data_offsets": [0, 8, 9]}}), "two offsets"),
        (blob({**header, "a": {**header["a"], "shape": [2**40, 2**40, 0]}}), "more elements than 64 bits"),
        (blob({"a": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, b""), r"tensor 'a': shape \[0, 9223372036854775808\]: "),
        (blob({**header, "__metadata__": [1]}), "__metadata__: .* not an object of strings"),
        (blob({**header, "__metadata__": {"k": 1}}), "__metadata__: .* not an object of strings"),
        (b"\x10" + b"\0" * 7 + b"[" * 10 + b" " * 6, "not JSON"),
        (len(b"[" * 100000).to_bytes(8, "little") + b"[" * 100000, "not JSON|not a JSON object"),
        (blob({**header, "a": {**header["a"], "shape": [10**12]}}), "tensor 'a': data_offsets"),  # refused before allocating
        (blob({**header, "b": {**header["b"], "data_offsets": [9, 12]}}), "tensor 'b': data_offsets"),
        (blob(header, good[8 + header_len:] + b"\0"), "end at byte 11 of the data, which has 12"),
    ]
    for data, match in cases:
        with pytest.raises(tensorfile.TensorFileError, match=match):
            unpack_state_dict(data)
    back, metadata = tensorfile.from_buffer(good)
    assert metadata == {} and back["a"].tolist() == [1.0, 1.0] and back["b"].tolist() == [0, 0, 0]
