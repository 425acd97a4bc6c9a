"""The pure snapshot decisions: buddies in ring order, the newest complete snapshot, which shard
files move where, what is stale, and what a node's directory holds."""

from __future__ import annotations

import pytest

from elasticrl.train.snapshot_plan import (
    Held,
    SnapshotId,
    Transfer,
    buddies,
    choose,
    fetch_plan,
    inventory,
    shard_file,
    stale,
)

pytestmark = pytest.mark.timeout(10)

S3 = SnapshotId(3, 1, 3)
S4 = SnapshotId(4, 1, 3)


def test_snapshot_names_round_trip_and_order_by_iteration_then_generation():
    assert S3.name == "iter-000003-g1-w3"
    assert SnapshotId.parse(S3.name) == S3
    assert SnapshotId.parse("iter-000003") is None and SnapshotId.parse(".tmp-iter-000003-g1-w3") is None
    assert SnapshotId(4, 1, 3) < SnapshotId(4, 2, 2) < SnapshotId(5, 1, 3)


def test_buddies_are_the_same_position_on_the_next_node_in_ring_order():
    assert buddies(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    # Two ranks per node: rank 0 (a, position 0) -> rank 2 (b, position 0), and so on around.
    assert buddies(["a", "a", "b", "b"]) == {0: 2, 1: 3, 2: 0, 3: 1}
    # Unequal nodes: a position the next node lacks wraps around its ranks.
    assert buddies(["a", "a", "a", "b"]) == {0: 3, 1: 3, 2: 3, 3: 0}
    assert buddies(["a", "a"]) == {0: None, 1: None}  # one node: nobody to keep a copy


def held(node: str, **snapshots: list[int]) -> Held:
    return Held(node, {name.replace("_", "-"): {r: [100 + r, 10] for r in ranks} for name, ranks in snapshots.items()})


def test_the_newest_snapshot_every_shard_of_which_survives_wins():
    # Node c is gone; a kept its own shard 0 and c's shard 2 (buddy), b its own shard 1.
    survivors = [held("a", **{S3.name: [0, 2], S4.name: [0]}), held("b", **{S3.name: [1, 0], S4.name: [1, 0]})]
    sid, reason = choose(survivors)
    assert sid == S3, reason
    assert "lacks shard(s) [2]" in reason and S4.name in reason
    survivors[0].snapshots[S4.name][2] = [1, 1]  # c's shard of 4 had reached a as well
    assert choose(survivors)[0] == S4


def test_no_complete_snapshot_and_no_snapshot_say_why():
    assert choose([held("a"), held("b")]) == (None, "no node holds a snapshot")
    sid, reason = choose([held("a", **{S3.name: [0]})])
    assert sid is None and "lacks shard(s) [1, 2]" in reason


def test_an_earlier_attempt_at_an_iteration_never_mixes_with_a_later_one():
    redo = SnapshotId(3, 2, 2)  # generation 2 redid iteration 3 in a world of 2
    survivors = [held("a", **{S3.name: [0], redo.name: [0, 1]}), held("b", **{S3.name: [1]})]
    assert choose(survivors)[0] == redo


def test_a_later_generation_that_went_on_from_an_older_state_supersedes_an_earlier_timeline():
    old, new = SnapshotId(4, 1, 2), SnapshotId(3, 2, 1)  # g2 fell back to a checkpoint of 2, then did 3
    back = [held("a", **{new.name: [0]}), held("b", **{old.name: [0, 1]})]  # b, cut off, comes back
    assert choose(back, generation=3)[0] == new
    # A generation counter that started over (a memory-only coordinator restarted): iteration orders.
    restarted = [held("a", **{SnapshotId(10, 5, 1).name: [0], SnapshotId(11, 1, 1).name: [0]})]
    assert choose(restarted, generation=2)[0] == SnapshotId(11, 1, 1)
    assert stale([SnapshotId(10, 5, 1).name, old.name], SnapshotId(11, 1, 1)) == [SnapshotId(10, 5, 1).name, old.name]
    assert stale([old.name, SnapshotId(5, 2, 1).name], new) == [old.name]  # earlier generation, later iteration


def test_every_node_gets_the_shards_it_lacks_from_the_least_busy_holder():
    survivors = [held("a", **{S3.name: [0, 2]}), held("a", **{S3.name: [0, 2]}), held("b", **{S3.name: [1, 0]})]
    plan = fetch_plan(S3, survivors)
    # Node a (ranks 0, 1) lacks shard 1: from rank 2 into rank 0. Node b lacks shard 2: from rank 0
    # (rank 1 on the same node holds it too; rank 0 has sent nothing yet, the tie goes to it).
    assert plan == [Transfer(src=2, dst=0, shard=1, sizes=(101, 10)), Transfer(src=0, dst=2, shard=2, sizes=(102, 10))]
    assert fetch_plan(S3, [held("a", **{S3.name: [0, 1, 2]})]) == []


def test_a_lost_node_s_shards_come_from_every_buddy_that_holds_one():
    survivors = [held("a", **{S4.name: [0, 1, 2]}), held("b", **{S4.name: [0, 1, 2]}), held("c", **{S4.name: [3]}), held("d", **{S4.name: []})]
    sid = SnapshotId(4, 1, 4)
    survivors = [Held(h.node, {sid.name: h.snapshots[S4.name]}) for h in survivors]
    plan = fetch_plan(sid, survivors)
    assert sorted((t.dst, t.shard) for t in plan) == [(0, 3), (1, 3), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (3, 3)]
    senders = [t.src for t in plan]
    assert {r: senders.count(r) for r in set(senders)} == {0: 3, 1: 3, 2: 3}, plan  # spread over the holders


def test_stale_snapshots_are_the_older_ones():
    names = [S3.name, S4.name, SnapshotId(4, 0, 3).name, "iter-000009-g1-w3.tmp", "notes"]
    assert stale(names, S4) == [S3.name, SnapshotId(4, 0, 3).name]


def test_inventory_counts_a_shard_once_its_json_is_in_place(tmp_path):
    d = tmp_path / S3.name
    d.mkdir()
    (d / shard_file(0, ".safetensors")).write_bytes(b"x" * 7)
    (d / shard_file(0, ".json")).write_text("{}")
    (d / shard_file(1, ".safetensors")).write_bytes(b"x" * 7)  # its JSON not yet renamed into place
    (d / "shard-00002.json.tmp-1-2").write_text("{")
    (tmp_path / "iter-000004-g1-w3").mkdir()  # empty: not listed
    assert inventory(str(tmp_path)) == {S3.name: {0: [7, 2]}}
    assert inventory(str(tmp_path / "missing")) == {}
    assert Held.from_json(Held("a", inventory(str(tmp_path))).to_json()) == Held("a", {S3.name: {0: [7, 2]}})
