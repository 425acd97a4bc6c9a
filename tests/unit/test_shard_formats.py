"""Shard files: format v3 (each group's received bytes as they came) round-trips through the store
for received and decoded groups alike and is a plain safetensors file; v2 and v1 shards (per-sample
tensors) still read; a damaged v3 file is refused rather than misread; short writes are resumed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from elasticrl.scheduler import framing, store
from elasticrl.scheduler.state import GroupRecord, SampleRecord
from elasticrl.scheduler.store import TrajectoryStore, decode_shard, encode_shard

pytestmark = pytest.mark.timeout(30)

RUN = "r"


def samples() -> list[SampleRecord]:
    return [
        SampleRecord.pack([5, 6, 7, 8], [0, -0.5, -1.0, 0], 1.0, "stop", "a|b", loss_mask=[0, 1, 1, 0], turns=2, env_s=0.25),
        SampleRecord.pack([3], [-0.125], 0.0, "length", "", truncated=True),
    ]


def received(task_id: str, node: str = "w0") -> framing.WireGroup:
    """A group as the coordinator keeps one from a worker's batch."""
    data = framing.result_batch_request([(4, GroupRecord(task_id, "", 9, 1.5, 0.5, samples()))], "b")
    _, [(start, end)] = framing.result_batch_spans(data)
    _, group = framing.read_group("g", data, start, end, node=node)
    return group


def test_v3_round_trips_received_and_decoded_groups_through_the_store(tmp_path):
    s = TrajectoryStore(tmp_path)
    decoded = GroupRecord("t01", "w1", -2, 0.0, 3.0, samples())
    name = s.write_shard(RUN, 4, [(received("t00"), [1, 2, 3]), (decoded, [])])
    back = s.read_shard(RUN, 4, name)
    assert [(g.task_id, g.node, p) for g, p in back] == [("t00", "w0", [1, 2, 3]), ("t01", "w1", [])]
    assert back[0][0].samples == samples() and back[1][0].samples == samples()
    assert (back[0][0].policy_version, back[0][0].gen_seconds, back[1][0].policy_version, back[1][0].reward_seconds) == (9, 1.5, -2, 3.0)
    assert back[0][0].num_tokens == 5 and back[0][0].num_bytes == received("t00").num_bytes
    # a plain safetensors file: anyone can open it
    data = (s.iteration_dir(RUN, 4) / name).read_bytes()
    tensors = st_load(data)
    assert tensors["group_bytes"].tolist() == [len(received("t00").wire), framing.group_parts(4, decoded)[1]]
    assert tensors["prompt_lengths"].tolist() == [3, 0] and tensors["groups"].dtype == np.uint8
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    assert meta["format"] == store.FORMAT == "elasticrl.trajectories.v3"


def _v2_shard(groups: list[tuple[GroupRecord, list[int]]]) -> bytes:
    """A shard as the store wrote it before v3 (per-sample tensors, every field in the header)."""
    ss = [s for g, _ in groups for s in g.samples]
    cat = lambda dtype, parts: np.frombuffer(b"".join(parts), dtype=dtype)  # noqa: E731
    tensors = {
        "completion_ids": cat("<i4", [s.completion_ids for s in ss]),
        "logprobs": cat("<f4", [s.logprobs for s in ss]),
        "loss_mask": cat("u1", [s.loss_mask or b"\x01" * s.num_tokens for s in ss]),
        "sample_tokens": np.array([s.num_tokens for s in ss], dtype="<i4"),
        "rewards": np.array([s.reward for s in ss], dtype="<f4"),
        "turns": np.array([s.turns for s in ss], dtype="<i4"),
        "env_s": np.array([s.env_s for s in ss], dtype="<f4"),
        "truncated": np.array([s.truncated for s in ss], dtype="u1"),
        "group_samples": np.array([len(g.samples) for g, _ in groups], dtype="<i4"),
        "prompt_ids": np.array([t for _, p in groups for t in p], dtype="<i4"),
        "prompt_lengths": np.array([len(p) for _, p in groups], dtype="<i4"),
    }
    header = [{"task_id": g.task_id, "node": g.node, "policy_version": g.policy_version, "gen_seconds": g.gen_seconds,
               "reward_seconds": g.reward_seconds, "finish_reasons": [s.finish_reason for s in g.samples],
               "texts": [s.text for s in g.samples]} for g, _ in groups]
    return st_save(tensors, metadata={"format": "elasticrl.trajectories.v2", "run_id": RUN, "iteration": "4", "groups": json.dumps(header)})


def test_a_v2_shard_still_reads_and_its_groups_are_served_like_new_ones(tmp_path):
    g = GroupRecord("t00", "w0", 9, 1.5, 0.5, samples())
    [(back, prompt)] = decode_shard(_v2_shard([(g, [1, 2])]))
    assert prompt == [1, 2] and back.samples == g.samples and back.node == "w0"
    # a shard directory holding both formats (a coordinator upgraded mid-iteration) reads whole
    s = TrajectoryStore(tmp_path)
    directory = s.iteration_dir(RUN, 4)
    directory.mkdir(parents=True)
    (directory / "shard-000000.safetensors").write_bytes(_v2_shard([(g, [1, 2])]))
    name = s.write_shard(RUN, 4, [(received("t01"), [3])])
    assert name == "shard-000001.safetensors"  # numbering goes on after the old file
    assert [g.task_id for n in sorted(s.shard_names(RUN, 4)) for g, _ in s.read_shard(RUN, 4, n)] == ["t00", "t01"]


@pytest.mark.parametrize("damage", ["torn", "header cut", "task swapped", "lengths"])
def test_a_damaged_v3_shard_is_refused_not_misread(damage):
    data = encode_shard(RUN, 4, [(received("t00"), [1]), (received("t01"), [2])])
    n = int.from_bytes(data[:8], "little")
    if damage == "torn":
        data = data[: len(data) - 100]
    elif damage == "header cut":
        data = data[: 8 + n // 2]
    elif damage == "task swapped":
        data = data.replace(b'\\"task_id\\": \\"t01\\"', b'\\"task_id\\": \\"t02\\"')
    else:
        header = json.loads(data[8:8 + n])
        a, _ = header["group_bytes"]["data_offsets"]
        at = 8 + n + a
        data = data[:at] + (10).to_bytes(8, "little") + data[at + 8:]
    with pytest.raises(Exception) as exc:
        decode_shard(data)
    assert isinstance(exc.value, (ValueError, framing.FramingError, json.JSONDecodeError)), exc.value


def test_short_writes_are_resumed_where_they_stopped(tmp_path, monkeypatch):
    real = os.writev
    calls = []

    def short_writev(fd, buffers):  # at most 100 bytes a call, as a kernel may do
        n = real(fd, [bytes(b"".join(bytes(x) for x in buffers))[:100]])
        calls.append(n)
        return n

    monkeypatch.setattr(os, "writev", short_writev)
    groups = [(received("t00"), [1, 2]), (received("t01"), [])]
    s = TrajectoryStore(tmp_path)
    name = s.write_shard(RUN, 1, groups)
    monkeypatch.undo()
    assert len(calls) > 2
    assert (s.iteration_dir(RUN, 1) / name).read_bytes() == encode_shard(RUN, 1, groups)


def test_discard_removes_a_shard_no_commit_will_refer_to(tmp_path):
    s = TrajectoryStore(tmp_path)
    name = s.write_shard(RUN, 1, [(received("t00"), [])])
    s.discard(RUN, 1, name)
    s.discard(RUN, 1, name)  # gone already: fine
    assert s.shard_names(RUN, 1) == set()
    memory = TrajectoryStore(None)
    name = memory.write_shard(RUN, 1, [(received("t00"), [])])
    memory.discard(RUN, 1, name)
    assert memory.shard_names(RUN, 1) == set()


def test_shards_of_iterations_dropped_before_a_stop_are_removed_at_the_next_start(tmp_path, monkeypatch):
    from elasticrl.scheduler.state import IterationConfig, Split

    from tests.unit.scheduler_harness import Harness, assigned, drain, group, specs

    h = Harness(state_dir=tmp_path)
    h.sched.keep_iterations = 2
    monkeypatch.setattr(h.store, "_reap", lambda paths: None)  # the process ends before its deletions ran
    w = h.worker("a", slots=2)
    for i in range(1, 5):
        h.sched.submit(RUN, i, specs(2), IterationConfig())
        h.sched.accept(w, [(i, group(t)) for t in assigned(drain(w))])
        h.sched.tick()  # drops the iterations the seal made too old
    assert sorted(h.sched.iterations[RUN]) == [3, 4]
    assert all(h.store.shard_names(RUN, i) for i in (1, 2))  # dropped from SQLite, files still there
    (tmp_path / "trajectories" / RUN / "notes").mkdir()  # not an iteration: left alone
    h.coord.db.close()
    h2 = Harness(state_dir=tmp_path, clock=h.clock)
    assert [bool(h2.store.shard_names(RUN, i)) for i in (1, 2, 3, 4)] == [False, False, True, True]
    assert all((h2.store.iteration_dir(RUN, i) / "manifest.json").exists() for i in (1, 2))
    assert len(h2.sched.shard(RUN, 4, 0, 1, Split.TRAIN)) == 2
