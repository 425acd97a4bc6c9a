"""Shards through torch.distributed.checkpoint in one process: chunks saved with one cut load into
another (rows of a matrix, slices of a flattened tensor as ZeRO cuts them), a missing shard or a
changed shape is an error rather than garbage, a shard file is streamed in the layout DCP's reader
reads, the wire format round-trips, and a node's ``Snapshots`` (no buddies) writes, keeps, prunes
and reuses its staging memory as it should."""

from __future__ import annotations

import json
import os

import pytest
import torch

from elasticrl.tensorfile import TensorFileError
from elasticrl.train.shard_wire import pack, unpack
from elasticrl.train.shards import Chunk, ShardError, own_part, owners, read_shards, saved_tensors, write_shard
from elasticrl.train.snapshot import Snapshots
from elasticrl.train.snapshot_plan import SnapshotId, inventory

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

W = torch.arange(35, dtype=torch.float32).reshape(7, 5)
V = torch.arange(13, dtype=torch.float32) / 3


def save_world_of_three(directory) -> None:
    """Rows [0:3] [3:5] [5:7] of W, elements [0:4] [4:9] [9:13] of V, a replicated step count."""
    for rank, (a, b, c, e) in enumerate([(0, 3, 0, 4), (3, 5, 4, 9), (5, 7, 9, 13)]):
        chunks = {"w": Chunk(W[a:b].clone(), (a, 0), (7, 5)), "v": Chunk.flat(V[c:e].clone(), c, 13),
                  "step": Chunk.whole(torch.tensor(3.0), replicated=True)}
        write_shard(own_part(chunks, rank, 3), os.path.join(directory, f"shard-{rank:05d}.safetensors"))


def test_shards_of_one_cut_load_into_another(tmp_path):
    save_world_of_three(tmp_path)
    assert saved_tensors(str(tmp_path)) == {"w": ((7, 5), torch.float32), "v": ((13,), torch.float32), "step": ((), torch.float32)}
    for a, b, c, e in [(0, 4, 0, 6), (4, 7, 6, 13)]:  # a world of 2
        dest = {"w": Chunk(torch.empty(b - a, 5), (a, 0), (7, 5)), "v": Chunk.flat(torch.empty(e - c), c, 13),
                "step": Chunk.whole(torch.empty(()))}
        read_shards(str(tmp_path), dest)
        assert torch.equal(dest["w"].tensor, W[a:b]) and torch.equal(dest["v"].tensor, V[c:e])
        assert dest["step"].tensor.item() == 3.0
    whole = {"w": Chunk.whole(torch.empty(7, 5))}
    read_shards(str(tmp_path), whole)
    assert torch.equal(whole["w"].tensor, W)


def test_a_missing_shard_or_another_shape_is_an_error_not_garbage(tmp_path):
    save_world_of_three(tmp_path)
    with pytest.raises(ShardError, match="shape"):
        read_shards(str(tmp_path), {"w": Chunk.whole(torch.empty(5, 7))})
    with pytest.raises(ShardError, match="no tensor 'u'"):
        read_shards(str(tmp_path), {"u": Chunk.whole(torch.empty(1))})
    os.remove(tmp_path / "shard-00001.safetensors")
    with pytest.raises(ShardError, match="a shard is missing"):
        read_shards(str(tmp_path), {"w": Chunk.whole(torch.empty(7, 5))})


def test_replicated_tensors_are_spread_over_the_ranks_by_size():
    sizes = {"a": 400, "b": 300, "c": 200, "d": 100, "e": 100}
    assert owners(sizes, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert owners(sizes, 2) == owners(dict(reversed(sizes.items())), 2)  # the same on every rank
    chunks = {n: Chunk.whole(torch.zeros(s // 4), replicated=True) for n, s in sizes.items()}
    assert sorted(own_part(chunks, 1, 2)) == ["b", "c"]
    assert own_part(chunks, 5, 6) == {}  # owns nothing: its shard is empty, and still a readable file


def test_an_empty_shard_is_a_readable_file(tmp_path):
    write_shard({}, str(tmp_path / "shard-00000.safetensors"))
    write_shard({"x": Chunk.whole(torch.ones(2))}, str(tmp_path / "shard-00001.safetensors"))
    dest = {"x": Chunk.whole(torch.empty(2))}
    read_shards(str(tmp_path), dest)
    assert dest["x"].tensor.tolist() == [1.0, 1.0]


def test_the_wire_format_round_trips_dtypes_shapes_and_offsets():
    chunks = {"bf": Chunk(torch.randn(3, 3).to(torch.bfloat16), (3, 0), (9, 3)), "s": Chunk.whole(torch.tensor(2.5)),
              "i": Chunk.flat(torch.arange(5), 10, 40), "empty": Chunk.whole(torch.empty(0, 4))}
    header, payload = pack(chunks)
    json.dumps(header)  # JSON, not pickle
    assert all(e["start"] % 8 == 0 for e in header["chunks"])
    back = unpack(json.loads(json.dumps(header)), payload)
    for name, c in chunks.items():
        assert back[name].tensor.dtype == c.tensor.dtype and torch.equal(back[name].tensor, c.tensor)
        assert (back[name].offsets, back[name].size) == (c.offsets, c.size)


def test_a_shard_is_streamed_in_the_layout_dcp_reads_without_serializing_it_in_memory(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import safe_open

    def no_serialize(*args, **kwargs):  # DCP's writer: the whole file as one bytes object, GIL held
        raise AssertionError("a shard must not be serialized in memory")

    monkeypatch.setattr(safetensors.torch, "save", no_serialize)
    chunks = {"bf": Chunk(torch.randn(3, 4).to(torch.bfloat16), (3, 0), (9, 4)), "s": Chunk.whole(torch.tensor(2.5)),
              "i": Chunk.flat(torch.arange(5), 10, 40), "b": Chunk.whole(torch.tensor([True, False, True])),
              "h": Chunk.whole(torch.randn(2, 3)[:, 1:].to(torch.float16)),  # not contiguous
              "none": Chunk.whole(torch.empty(0, 4))}
    path = tmp_path / "shard-00000.safetensors"
    assert write_shard(chunks, str(path)) == path.stat().st_size
    assert os.listdir(tmp_path) == [path.name]  # nothing left aside
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # the data starts aligned, as safetensors itself writes
    with safe_open(str(path), framework="pt") as f:  # safetensors' own reader checks the layout
        sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert sharding == {n: {"saved_offsets": list(c.offsets)} for n, c in chunks.items()}
        for name, c in chunks.items():
            assert f.get_tensor(name).dtype == c.tensor.dtype and torch.equal(f.get_tensor(name), c.tensor)
    # One shard alone tells a tensor's size only up to its own chunk's end (DCP's layout too).
    ends = {n: (tuple(o + k for o, k in zip(c.offsets, c.tensor.shape)), c.tensor.dtype) for n, c in chunks.items()}
    assert saved_tensors(str(tmp_path)) == ends
    # (DCP's reader and its resharding over such files: every other test here reads them.)
    with pytest.raises(TensorFileError, match="tensor 'c': dtype torch.complex128"):
        write_shard({"c": Chunk.whole(torch.zeros(2, dtype=torch.complex128))}, str(tmp_path / "shard-00001.safetensors"))
    assert os.listdir(tmp_path) == [path.name]


def test_a_snapshot_stages_into_the_last_ones_buffer_once_that_one_is_written(tmp_path):
    snaps = Snapshots(str(tmp_path), rank=0, world_size=1, generation=1, nodes=["a"])
    state = {"w": Chunk.whole(W.clone(), replicated=True)}

    def on_disk(iteration: int) -> torch.Tensor:
        dest = {"w": Chunk.whole(torch.empty(7, 5))}
        read_shards(str(tmp_path / SnapshotId(iteration, 1, 1).name), dest)
        return dest["w"].tensor

    snaps.take(1, state, {}, {"iteration": 1})
    first = snaps._taken.own["w"].tensor.data_ptr()
    state["w"].tensor.add_(100)
    snaps.take(2, state, {}, {"iteration": 2})  # writes 1 first, then stages 2 into the same memory
    assert snaps._taken.own["w"].tensor.data_ptr() == first
    assert torch.equal(on_disk(1), W)  # written whole before its memory was taken again
    snaps.flush()
    assert torch.equal(on_disk(2), W + 100)


def test_a_write_that_outlived_a_wait_keeps_its_buffer_until_it_is_done(tmp_path, monkeypatch):
    import time

    from elasticrl.errors import ElasticRLError
    from elasticrl.train import snapshot

    def slow_write(chunks, path):  # a write still running when flush (the SIGTERM watchdog's) gives up
        time.sleep(0.5)
        return write_shard(chunks, path)

    monkeypatch.setattr(snapshot, "write_shard", slow_write)
    snaps = Snapshots(str(tmp_path), rank=0, world_size=1, generation=1, nodes=["a"])
    state = {"w": Chunk.whole(torch.zeros(7, 5), replicated=True)}
    snaps.take(1, state, {}, {"iteration": 1})
    with pytest.raises(ElasticRLError, match="did not finish"):
        snaps.flush(0.05)
    state["w"].tensor.fill_(2.0)
    snaps.take(2, state, {}, {"iteration": 2})  # waits for 1's write before it stages into that memory
    dest = {"w": Chunk.whole(torch.empty(7, 5))}
    read_shards(str(tmp_path / SnapshotId(1, 1, 1).name), dest)
    assert torch.equal(dest["w"].tensor, torch.zeros(7, 5))


def test_a_node_without_buddies_keeps_the_previous_snapshot_until_the_next_is_written(tmp_path):
    snaps = Snapshots(str(tmp_path), rank=0, world_size=1, generation=2, nodes=["a"])
    state = {"w": Chunk.whole(W.clone(), replicated=True)}
    record = {"iteration": 1, "r": 0.5}
    assert snaps.take(1, state, {"k": 1}, record) == 0.0  # no buddies: nothing to exchange
    record["t_extra"] = 1.0  # the caller may add to its record: the snapshot keeps it as taken
    state["w"].tensor.add_(1000)  # the training goes on: the snapshot holds the copy taken
    assert inventory(str(tmp_path)) == {}  # written only when the main thread is about to wait
    snaps.write_pending()
    snaps.wait()
    first = SnapshotId(1, 2, 1).name
    assert list(inventory(str(tmp_path))) == [first]
    doc = json.loads((tmp_path / first / "shard-00000.json").read_text())
    assert doc["metrics"] == {"iteration": 1, "r": 0.5} and doc["meta"] == {"k": 1} and doc["node"] == "a"
    dest = {"w": Chunk.whole(torch.empty(7, 5))}
    read_shards(str(tmp_path / first), dest)
    assert torch.equal(dest["w"].tensor, W)

    snaps.take(2, state, {"k": 2}, {"iteration": 2})  # taken, not written yet: iteration 1 stays
    assert list(inventory(str(tmp_path))) == [first]
    snaps.flush()  # the way out writes it; then the previous one goes
    assert list(inventory(str(tmp_path))) == [SnapshotId(2, 2, 1).name]
