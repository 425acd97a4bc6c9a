"""Snapshots, buddies and resharding at random: world layouts of 1..16 ranks on 1..8 nodes, node
losses (one, several at once, beyond what buddies can cover), single-rank crashes, joins.

Two layers, each seeded (``SNAPSHOT_RANDOM_SEEDS=a:b`` runs seeds a..b-1 instead of the defaults):

* **The pure decisions** (``snapshot_plan``), against an oracle written from their docstrings:
  ``buddies`` -- "the rank at the same position on the next node in ring order (nodes ordered by
  their lowest rank; position modulo that node's size) ... None for every rank when there is one
  node": never a rank of its own node, copies spread over the next node's ranks within one of each
  other, and any set of lost nodes no two of which are neighbours in the ring leaves every shard a
  holder. ``choose`` -- "the newest snapshot every shard of which some rank's node holds (own or
  buddy copy), and why", naming the shards the newest lacks when it is not the one. ``fetch_plan``
  -- "every node gets every shard of ``sid`` it lacks ... into its lowest rank; each from the
  holder that has sent the fewest so far (ties: the lowest rank)". ``stale``.
* **The whole path in one process**: real ``Recovery``/``Snapshots``/``shards`` (DCP safetensors
  files in one directory per node under ``tmp_path``), each rank a thread, torch.distributed
  replaced by fakes (``swap``/``all_ok`` for the buddy exchange, ``all_gather_json``/
  ``all_reduce_int``/``move`` for the resume). Fake strategies cut a random model (params of
  float32/bfloat16/float16, int64 buffers, AdamW state) as DDP (every tensor replicated:
  ``strategy_base.replicated_state``), ZeRO-1/2 (slices of each flattened parameter, as
  ``strategy_deepspeed``) and FSDP2 (dim-0 shards with torch's uneven/empty cut, as
  ``Chunk.of_dtensor``). Every iteration's full state depends on (iteration, generation), so two
  generations' shards of one iteration can never pass for each other. Checked after every
  re-formed or regrown world's ``Recovery.resume``:
    - within the promise ("no iteration is on record before every shard of it is in the memory of
      two nodes"; survivors ``flush`` on the way out) the resumed iteration is at least the latest
      finished one (``take`` returned everywhere) and at most the latest taken;
    - whatever was resumed is bit-identical (every tensor's bytes, dtype, shape; the optimizer's
      step and hyper-parameters; meta and record) to the full state of exactly one (iteration,
      generation), resharded into the new world's cut; every rank resumed the same;
    - beyond the promise (two neighbouring nodes lost) nothing is loaded (the strategies keep their
      state), every rank returns None and rank 0 warns which shard(s) the newest snapshot lacks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import random
import shutil
import threading

import pytest
import torch

from elasticrl.config import load_config
from elasticrl.train import recovery as recovery_mod
from elasticrl.train import snapshot as snapshot_mod
from elasticrl.train.dist import WorldInfo
from elasticrl.train.recovery import Recovery
from elasticrl.train.shard_wire import WireError
from elasticrl.train.shards import Chunk
from elasticrl.train.snapshot_plan import (
    Held,
    SnapshotId,
    buddies,
    choose,
    fetch_plan,
    inventory,
    stale,
)
from elasticrl.train.strategy_base import (
    load_replicated_state,
    optimizer_from_parts,
    optimizer_views,
    replicated_state,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _seeds(default: range) -> list[int]:
    spec = os.environ.get("SNAPSHOT_RANDOM_SEEDS")
    if not spec:
        return list(default)
    a, _, b = spec.partition(":")
    return list(range(int(a), int(b)))


# -- layouts -------------------------------------------------------------------------------------------


def random_layout(rng: random.Random, *, interleave: bool = True, max_ranks: int = 16) -> list[str]:
    """``nodes[r]``: rank r's node. 1..8 nodes of 1..4 ranks (at most ``max_ranks`` in all), in a
    random node order, as blocks (torchrun) or, sometimes, interleaved."""
    names = rng.sample([f"{c}{i}" for c in "pqrstuvwxyz" for i in range(3)], rng.randint(1, 8))
    sizes = [rng.randint(1, 4) for _ in names]
    while sum(sizes) > max_ranks:
        i = rng.randrange(len(sizes))
        if sizes[i] > 1:
            sizes[i] -= 1
        elif len(sizes) > 1:
            del sizes[i], names[i]
    nodes = [n for n, s in zip(names, sizes) for _ in range(s)]
    if interleave and rng.random() < 0.3:
        rng.shuffle(nodes)
    return nodes


def ring_of(nodes: list[str]) -> list[str]:
    """The nodes in ring order: by their lowest rank."""
    return list(dict.fromkeys(nodes))


def oracle_buddies(nodes: list[str]) -> dict[int, int | None]:
    order = ring_of(nodes)
    if len(order) < 2:
        return {r: None for r in range(len(nodes))}
    ranks_of = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out = {}
    for i, n in enumerate(order):
        nxt = ranks_of[order[(i + 1) % len(order)]]
        for pos, r in enumerate(ranks_of[n]):
            out[r] = nxt[pos % len(nxt)]
    return out


def survivable(nodes: list[str], lost: set[str]) -> bool:
    """The promise, in ring terms: no two lost nodes are neighbours (and one node is left)."""
    order = ring_of(nodes)
    if set(order) <= lost:
        return False
    if len(order) == 1:
        return not lost
    return not any(order[i] in lost and order[(i + 1) % len(order)] in lost for i in range(len(order)))


# -- layer 1: the pure decisions -------------------------------------------------------------------------


PURE_SEEDS = _seeds(range(300))


@pytest.mark.parametrize("chunk", range(3))
def test_buddies_are_on_the_next_node_spread_evenly_and_cover_any_non_adjacent_loss(chunk):
    for seed in PURE_SEEDS[chunk::3]:
        rng = random.Random(seed)
        nodes = random_layout(rng)
        got = buddies(nodes)
        assert got == oracle_buddies(nodes), (seed, nodes)
        order = ring_of(nodes)
        if len(order) == 1:
            assert all(b is None for b in got.values()), (seed, nodes)
            continue
        receives = collections.Counter(got.values())
        for r, b in got.items():
            i = order.index(nodes[r])
            assert nodes[b] != nodes[r] and nodes[b] == order[(i + 1) % len(order)], (seed, nodes, r, b)
        for i, n in enumerate(order):  # the previous node's copies over this node's ranks, evenly
            counts = [receives[r] for r, m in enumerate(nodes) if m == n]
            prev = order[i - 1]
            assert sum(counts) == nodes.count(prev), (seed, nodes, n)
            assert max(counts) - min(counts) <= 1, (seed, nodes, n, counts)
            assert max(counts) == math.ceil(nodes.count(prev) / nodes.count(n)), (seed, nodes, n, counts)
        # Every shard lives on its owner's node and its buddy's: which losses leave every shard a holder.
        for _ in range(6):
            lost = set(rng.sample(order, rng.randint(1, len(order))))
            covered = all(nodes[r] not in lost or nodes[b] not in lost for r, b in got.items())
            assert covered == survivable(nodes, lost), (seed, nodes, lost)
            if len(lost) == 1 and len(order) > 1:
                assert covered, (seed, nodes, lost)  # any one node


def node_dirs_after(rng: random.Random, nodes: list[str], sid: SnapshotId) -> tuple[dict[str, dict], SnapshotId | None, SnapshotId | None]:
    """What the nodes' directories hold once ``sid`` was confirmed and written everywhere, as
    ``Snapshots`` writes them (own shard and buddy copies), plus at random: an older snapshot not
    yet pruned on some nodes, a newer one taken but not confirmed (some own shards, some buddy
    copies), and an earlier generation's attempt at ``sid``'s iteration. Returns the directories
    ({node: {name: {shard: sizes}}}), the older and the newer snapshot (or None)."""
    bud = buddies(nodes)
    dirs: dict[str, dict] = {n: {} for n in nodes}

    def put(node, s: SnapshotId, shard):
        dirs[node].setdefault(s.name, {})[shard] = [1000 * s.iteration + 10 * s.generation + shard, 7]

    for r in range(len(nodes)):
        put(nodes[r], sid, r)
        if bud[r] is not None:
            put(nodes[bud[r]], sid, r)
    older = newer = None
    if sid.iteration > 1 and rng.random() < 0.3:  # pruned only where that node's ranks wrote sid
        older = SnapshotId(sid.iteration - 1, sid.generation, sid.world_size)
        for n in rng.sample(ring_of(nodes), rng.randint(1, len(ring_of(nodes)))):
            for r in range(len(nodes)):
                if nodes[r] == n or (bud[r] is not None and nodes[bud[r]] == n):
                    put(n, older, r)
    if rng.random() < 0.5:  # the next iteration, its exchange cut short
        newer = SnapshotId(sid.iteration + 1, sid.generation, sid.world_size)
        for r in range(len(nodes)):
            if rng.random() < 0.7:
                put(nodes[r], newer, r)
            if bud[r] is not None and rng.random() < 0.5:
                put(nodes[bud[r]], newer, r)
    if sid.generation > 1 and rng.random() < 0.3:  # a world of an earlier generation, same iteration
        w = rng.randint(1, 5)
        early = SnapshotId(sid.iteration, sid.generation - 1, w)
        for n in rng.sample(ring_of(nodes), rng.randint(1, len(ring_of(nodes)))):
            for r in rng.sample(range(w), rng.randint(1, w)):
                put(n, early, r)
    return dirs, older, newer


@pytest.mark.parametrize("chunk", range(3))
def test_choose_and_fetch_plan_after_random_losses_and_joins(chunk):
    for seed in PURE_SEEDS[chunk::3]:
        rng = random.Random(10_000 + seed)
        nodes = random_layout(rng)
        sid = SnapshotId(rng.randint(1, 50), rng.randint(1, 4), len(nodes))
        dirs, _older, newer = node_dirs_after(rng, nodes, sid)
        order = ring_of(nodes)
        lost = set(rng.sample(order, rng.randint(0, len(order))))
        survivors = [n for n in nodes if n not in lost]  # ranks keep their order
        joined = [f"j{i}" for i in range(rng.randint(0, 2)) for _ in range(rng.randint(1, 3))]
        world = survivors + joined
        if rng.random() < 0.3:  # a restart may number the nodes otherwise
            blocks = [[n] * world.count(n) for n in dict.fromkeys(world)]
            rng.shuffle(blocks)
            world = [n for b in blocks for n in b]
        if not world:
            continue
        held = [Held(n, {k: dict(v) for k, v in dirs.get(n, {}).items()}) for n in world]
        got, reason = choose(held)

        # Oracle: which shards of which snapshot the surviving directories hold.
        found: dict[SnapshotId, set[int]] = collections.defaultdict(set)
        for n in set(world):
            for name, shards in dirs.get(n, {}).items():
                found[SnapshotId.parse(name)] |= set(shards)
        complete = [s for s, have in found.items() if have >= set(range(s.world_size))]
        assert got == (max(complete) if complete else None), (seed, reason)
        if survivable(nodes, lost) and len(order) > 1 or not lost:
            assert got is not None and got >= sid, (seed, nodes, lost, reason)  # the latest finished one, or newer
        if got is not None and newer is not None and got < newer:
            assert f"{newer.name} lacks shard(s) {sorted(set(range(newer.world_size)) - found[newer])}" in reason, (seed, reason)
        if got is None:
            if not found:
                assert reason == "no node holds a snapshot", (seed, reason)
                continue
            newest = max(found)
            missing = sorted(set(range(newest.world_size)) - found[newest])
            assert f"the newest, {newest.name}, lacks shard(s) {missing}" in reason, (seed, reason)
            if newest == sid:  # exactly the shards both of whose holders were lost
                bud = buddies(nodes)
                assert missing == [r for r in range(len(nodes)) if nodes[r] in lost and (bud[r] is None or nodes[bud[r]] in lost)]
            with pytest.raises(ValueError, match=rf"no rank holds shard {missing[0]}"):
                fetch_plan(newest, held)
            continue

        plan = fetch_plan(got, held)
        lowest = {n: world.index(n) for n in set(world)}
        has = {n: set(dirs.get(n, {}).get(got.name, {})) for n in set(world)}
        sent = [0] * len(world)
        for t in plan:
            holders = [r for r, h in enumerate(held) if t.shard in h.snapshots.get(got.name, {})]
            assert t.src in holders, (seed, t)
            assert world[t.src] != world[t.dst] and t.dst == lowest[world[t.dst]], (seed, t)
            assert t.shard not in has[world[t.dst]], (seed, t)  # a node gets what it lacks, once
            assert (sent[t.src], t.src) == min((sent[r], r) for r in holders), (seed, t, sent)
            assert t.sizes == tuple(held[t.src].snapshots[got.name][t.shard]), (seed, t)
            sent[t.src] += 1
            has[world[t.dst]].add(t.shard)
        assert all(h == set(range(got.world_size)) for h in has.values()), (seed, has)
        assert fetch_plan(got, held) == plan  # the same list on every rank

        names = [s.name for s in found] + ["notes", got.name + ".tmp"]
        assert sorted(stale(names, got)) == sorted(s.name for s in found if s < got), seed


# -- layer 2: the whole path, each rank a thread ----------------------------------------------------------


class Died(BaseException):
    """A rank's process ends here (its thread stops; nothing of its memory survives)."""


_me = threading.local()
_WAIT_S = 5.0  # a fake collective waiting this long means the ranks disagree: a hang, not a timeout


class Fabric:
    """torch.distributed for one world of threads: collectives by call order, point-to-point by
    (src, dst, tag). ``dying`` ranks die in the buddy exchange, after posting their copy if they are
    in ``posting``; a collective with a dying rank in it fails on every rank (it never arrives)."""

    def __init__(self, world_size: int, dying=(), posting=(), wait_s: float = _WAIT_S):
        self.n, self.wait_s = world_size, wait_s
        self.cond = threading.Condition()
        self.calls: collections.Counter = collections.Counter()
        self.rounds: dict[int, dict[int, object]] = collections.defaultdict(dict)
        self.mail: dict[tuple, list] = {}
        self.dying, self.posting = set(dying), set(posting)

    def gather(self, value) -> list:
        rank = _me.rank
        with self.cond:
            i = self.calls[rank]
            self.calls[rank] += 1
            self.rounds[i][rank] = value
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(self.rounds[i]) == self.n, self.wait_s):
                raise AssertionError(f"rank {rank}: collective {i} never completed (got {sorted(self.rounds[i])} of {self.n})")
            return [self.rounds[i][r] for r in range(self.n)]

    def post(self, key, blobs) -> None:
        with self.cond:
            assert key not in self.mail, key
            self.mail[key] = [b.clone() for b in blobs]  # over the wire: a copy
            self.cond.notify_all()

    def take(self, key) -> list:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.mail, self.wait_s):
                raise AssertionError(f"rank {_me.rank}: {key} never arrived")
            return self.mail.pop(key)


def fake_swap(blobs, to, senders, group, timeout_s, what):
    f, rank = _me.fabric, _me.rank
    if rank in f.dying:
        if rank in f.posting and to is not None:
            f.post((rank, to, "swap"), blobs)
        raise Died()
    if to is not None:
        f.post((rank, to, "swap"), blobs)
    gone = [s for s in senders if s in f.dying and s not in f.posting]
    if gone:
        raise WireError(f"{what}: rank(s) {gone} gone")
    return {s: f.take((s, rank, "swap")) for s in senders}


def fake_all_ok(ok, group, timeout_s, what):
    f = _me.fabric
    if f.dying:
        raise WireError(f"{what}: rank(s) {sorted(f.dying)} never arrived")
    return all(f.gather(bool(ok)))


def fake_all_gather_json(obj):
    return _me.fabric.gather(obj)


def fake_all_reduce_int(value, op):
    values = _me.fabric.gather(int(value))
    return min(values) if op == torch.distributed.ReduceOp.MIN else max(values)


def fake_move(outgoing, incoming, group, timeout_s, what):
    f, rank = _me.fabric, _me.rank
    for dst, tag, blob in outgoing:
        f.post((rank, dst, tag), [blob])
    for src, tag, buf in incoming:
        (blob,) = f.take((src, rank, tag))
        buf.copy_(blob)


def run_ranks(fabric: Fabric, fns: dict[int, object]) -> dict[int, object]:
    """Run ``fns[rank]()`` for every rank on a thread of its own; {rank: result or exception}."""
    out: dict[int, object] = {}

    def body(rank, fn):
        _me.rank, _me.fabric = rank, fabric
        try:
            out[rank] = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r, fn), name=f"rank-{r}", daemon=True) for r, fn in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * _WAIT_S)
        assert not t.is_alive(), f"{t.name} hung"
    return out


def ok(results: dict[int, object]) -> dict[int, object]:
    for rank, value in results.items():
        if isinstance(value, BaseException):
            pytest.fail(f"rank {rank} failed: {value!r}")
    return results


# -- a random model and the three ways of cutting it ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "param" (trained), "frozen" (a parameter not trained), "buffer"


def random_model(rng: random.Random, *, big: bool = False) -> list[Tensor]:
    """1..5 random tensors; ``big``: one trained parameter of 256+ elements besides, so that every
    ZeRO partition of a world of up to 16 holds a slice of some parameter (real ones always do;
    see the focused test at the end for one that does not)."""
    out = []
    for i in range(rng.randint(1, 5)):
        kind = rng.choice(["param", "param", "param", "frozen", "buffer"])
        dims = rng.choice([0, 1, 1, 2, 2, 3]) if kind != "param" or i else rng.choice([1, 2])
        shape = tuple(rng.randint(1, 6) for _ in range(dims))
        if kind == "buffer":
            dtype = rng.choice([torch.float32, torch.int64])
        else:
            dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
        out.append(Tensor(f"layer{i}.{kind}", shape, dtype, kind))
    if not any(t.kind == "param" and t.shape for t in out):  # something to shard
        out.append(Tensor("head.weight", (rng.randint(1, 9), 3), torch.float32, "param"))
    if big:
        out.insert(rng.randint(0, len(out)), Tensor("embed.weight", (rng.randint(64, 80), 4), rng.choice([torch.float32, torch.bfloat16]), "param"))
    return out


def full_state(seed: int, model: list[Tensor], iteration: int, generation: int) -> tuple[dict, dict]:
    """(model state dict, AdamW state dict) after ``iteration`` in ``generation``'s world."""
    g = torch.Generator().manual_seed(hash((seed, iteration, generation)) % 2**62)
    sd = {}
    for t in model:
        if t.dtype == torch.int64:
            sd[t.name] = torch.randint(-1000, 1000, t.shape, generator=g)
        else:
            sd[t.name] = torch.randn(t.shape, generator=g).to(t.dtype)
    trained = [t for t in model if t.kind == "param"]
    state = {i: {"step": torch.tensor(float(iteration)), "exp_avg": torch.randn(t.shape, generator=g),
                 "exp_avg_sq": torch.rand(t.shape, generator=g)} for i, t in enumerate(trained)}
    groups = [{"lr": 0.01 * generation, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "params": list(range(len(trained)))}]
    return sd, {"state": state, "param_groups": groups}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and every byte."""
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def dim0_cut(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """Rows [a, b) of a dim-0 shard as torch cuts it (``torch.chunk``: empty shards at the end,
    placed at the tensor's end, as ``compute_local_shape_and_global_offset`` gives them)."""
    per = -(-shape[0] // world)
    a = min(rank * per, shape[0])
    return a, min(a + per, shape[0])


class FakeStrategy:
    """One rank's cut of the model; ``full()`` gives back what this rank can tell of the full state."""

    def __init__(self, model: list[Tensor], rank: int, world: int):
        self.model, self.rank, self.world = model, rank, world
        self.loaded = 0

    def garbage(self) -> None:
        """Other weights than any iteration's (as a resumed world's model starts out)."""
        self.set(*full_state(-1, self.model, 0, 0))


class DDP(FakeStrategy):
    def set(self, sd, opt) -> None:
        self.sd = {k: v.clone() for k, v in sd.items()}
        self.opt = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt["state"].items()},
                    "param_groups": [dict(g) for g in opt["param_groups"]]}

    def sharded_state(self):
        return replicated_state(self.sd, self.opt)

    def load_sharded_state(self, read, saved, rest) -> None:
        self.loaded += 1
        load_replicated_state(self, read, saved, rest)

    def load_full_model_state_dict(self, sd) -> None:
        self.sd = dict(sd)

    def load_full_optimizer_state_dict(self, opt) -> None:
        self.opt = opt

    @staticmethod
    def assemble(strategies: list[DDP]) -> tuple[dict, dict]:
        for s in strategies[1:]:  # every rank holds all of it
            assert states_equal((s.sd, s.opt), (strategies[0].sd, strategies[0].opt)) is None
        return strategies[0].sd, strategies[0].opt


class Zero(FakeStrategy):
    """ZeRO-1/2: the trained parameters flattened into one buffer cut in ``world`` equal
    partitions; a rank keeps its slice of each (fp32 master and AdamW state), the rest whole."""

    def frags(self) -> dict[int, tuple[int, int]]:
        trained = [t for t in self.model if t.kind == "param"]
        total = sum(math.prod(t.shape) for t in trained)
        per = -(-total // self.world)
        lo, hi = self.rank * per, (self.rank + 1) * per
        out, offset = {}, 0
        for i, t in enumerate(trained):
            numel = math.prod(t.shape)
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                out[i] = (a - offset, b - a)
            offset += numel
        return out

    def set(self, sd, opt) -> None:
        trained = [t for t in self.model if t.kind == "param"]
        self.master = {i: sd[t.name].float().reshape(-1)[a:a + n].clone() for i, t in enumerate(trained)
                       for i2, (a, n) in self.frags().items() if i2 == i}
        self.slices = {(i, key): opt["state"][i][key].reshape(-1)[a:a + n].clone()
                       for i, (a, n) in self.frags().items() for key in ("exp_avg", "exp_avg_sq")}
        self.other = {t.name: sd[t.name].clone() for t in self.model if t.kind != "param"}
        self.whole = {}
        self.step = float(opt["state"][0]["step"]) if opt["state"] else None
        self.groups = opt["param_groups"]

    def sharded_state(self):
        trained = [t for t in self.model if t.kind == "param"]
        chunks = {}
        for i, (a, n) in self.frags().items():
            numel = math.prod(trained[i].shape)
            chunks[f"zero.param.{i}"] = Chunk.flat(self.master[i], a, numel)
            for key in ("exp_avg", "exp_avg_sq"):
                chunks[f"zero.optim.{i}.{key}"] = Chunk.flat(self.slices[(i, key)], a, numel)
        chunks.update({f"model.{name}": Chunk.whole(t, replicated=True) for name, t in self.other.items()})
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"} for g in self.groups]
        return chunks, {"zero": {"step": self.step, "param_groups": groups}}

    def load_sharded_state(self, read, saved, rest) -> None:  # as DeepSpeedStrategy.load_sharded_state
        self.loaded += 1
        trained = [t for t in self.model if t.kind == "param"]
        keys = sorted({name.split(".")[3] for name in saved if name.startswith("zero.optim.")})
        dest = {}
        for i, t in enumerate(trained):
            dest[f"zero.param.{i}"] = Chunk.whole(torch.empty(saved[f"zero.param.{i}"][0], dtype=saved[f"zero.param.{i}"][1]))
        for t in self.model:
            if t.kind != "param":
                dest[f"model.{t.name}"] = Chunk.whole(torch.empty(*[saved[f"model.{t.name}"][0]], dtype=saved[f"model.{t.name}"][1]))
        for i, (a, n) in self.frags().items():
            for key in keys:
                dest[f"zero.optim.{i}.{key}"] = Chunk.flat(torch.empty(n), a, math.prod(trained[i].shape))
        read(dest)
        self.whole = {t.name: dest[f"zero.param.{i}"].tensor.reshape(t.shape) for i, t in enumerate(trained)}
        self.other = {t.name: dest[f"model.{t.name}"].tensor for t in self.model if t.kind != "param"}
        self.slices = {(i, key): dest[f"zero.optim.{i}.{key}"].tensor for i in self.frags() for key in keys}
        self.step = rest["zero"]["step"]
        self.groups = rest["zero"]["param_groups"]

    @staticmethod
    def assemble(strategies: list[Zero]) -> tuple[dict, dict]:
        s0 = strategies[0]
        trained = [t for t in s0.model if t.kind == "param"]
        sd = {**s0.whole, **s0.other}
        flat = {(i, key): torch.full((math.prod(t.shape),), float("nan")) for i, t in enumerate(trained) for key in ("exp_avg", "exp_avg_sq")}
        covered = collections.Counter()
        for s in strategies:
            assert states_equal(({**s.whole, **s.other}, None), (sd, None)) is None
            for (i, key), part in s.slices.items():
                a, n = s.frags()[i]
                flat[(i, key)][a:a + n] = part
                covered[(i, key)] += n
        state = {i: {"step": torch.tensor(s0.step), **{key: flat[(i, key)].reshape(t.shape) for key in ("exp_avg", "exp_avg_sq")}}
                 for i, t in enumerate(trained)}
        assert all(covered[k] == v.numel() for k, v in flat.items()), covered
        groups = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}, "params": list(range(len(trained)))} for g in s0.groups]
        return sd, {"state": state, "param_groups": groups}

    def compare_model(self, sd: dict) -> dict:
        """ZeRO keeps fp32 masters of the trained parameters: compare those as fp32."""
        return {t.name: sd[t.name].float() if t.kind == "param" else sd[t.name] for t in self.model}


class FSDP(FakeStrategy):
    """FSDP2: every parameter (trained or frozen) of one or more dims a DTensor sharded on dim 0,
    and its AdamW moments alike; 0-dim parameters, buffers and step counts whole and replicated."""

    def sharded(self, t: Tensor) -> bool:
        return t.kind != "buffer" and len(t.shape) > 0

    def cut(self, tensor: torch.Tensor) -> Chunk:
        a, b = dim0_cut(tuple(tensor.shape), self.rank, self.world)
        return Chunk(tensor[a:b].clone(), (a,) + (0,) * (tensor.dim() - 1), tuple(tensor.shape))

    def set(self, sd, opt) -> None:
        self.sd = {t.name: self.cut(sd[t.name]) if self.sharded(t) else Chunk.whole(sd[t.name].clone(), replicated=True) for t in self.model}
        trained = [t for t in self.model if t.kind == "param"]
        self.opt = {"state": {i: {k: (self.cut(v) if k != "step" and self.sharded(trained[i]) else Chunk.whole(v.clone(), replicated=True))
                                  for k, v in s.items()} for i, s in opt["state"].items()},
                    "param_groups": [dict(g) for g in opt["param_groups"]]}

    def sharded_state(self):
        chunks = {f"model.{name}": c for name, c in self.sd.items()}
        views, rest = optimizer_views({"state": {i: {k: c.tensor for k, c in s.items()} for i, s in self.opt["state"].items()},
                                       "param_groups": self.opt["param_groups"]})
        chunks.update({f"optim.{key}": self.opt["state"][int(key.split(".")[0])][key.split(".", 1)[1]] for key in views})
        return chunks, {"optimizer": rest}

    def load_sharded_state(self, read, saved, rest) -> None:  # as FSDP2Strategy.load_sharded_state
        self.loaded += 1
        trained = [t for t in self.model if t.kind == "param"]

        def like(t: Tensor, shape, dtype) -> Chunk:
            if self.sharded(t) and tuple(shape) == t.shape:
                return self.cut(torch.empty(shape, dtype=dtype))
            return Chunk.whole(torch.empty(shape, dtype=dtype))

        dest = {f"model.{t.name}": like(t, *saved[f"model.{t.name}"]) for t in self.model}
        for key, (shape, dtype) in saved.items():
            if key.startswith("optim."):
                dest[key] = like(trained[int(key.split(".")[1])], shape, dtype)
        read(dest)
        self.sd = {t.name: dest[f"model.{t.name}"] for t in self.model}
        opt = optimizer_from_parts({k.removeprefix("optim."): c for k, c in dest.items() if k.startswith("optim.")}, rest["optimizer"])
        self.opt = {"state": opt["state"], "param_groups": opt["param_groups"]}

    @staticmethod
    def assemble(strategies: list[FSDP]) -> tuple[dict, dict]:
        def join(parts: list[Chunk]) -> torch.Tensor:
            if all(tuple(p.tensor.shape) == tuple(p.size) for p in parts):  # whole on every rank
                for p in parts[1:]:
                    assert same(p.tensor, parts[0].tensor)
                return parts[0].tensor
            parts = sorted(parts, key=lambda p: p.offsets[0])
            out = torch.cat([p.tensor for p in parts])
            assert tuple(out.shape) == tuple(parts[0].size), (out.shape, parts[0].size)
            return out

        s0 = strategies[0]
        sd = {name: join([s.sd[name] for s in strategies]) for name in s0.sd}
        state = {i: {k: join([s.opt["state"][i][k] for s in strategies]) for k in slots} for i, slots in s0.opt["state"].items()}
        return sd, {"state": state, "param_groups": s0.opt["param_groups"]}


STRATEGIES = {"ddp": DDP, "zero2": Zero, "fsdp2": FSDP}


def states_equal(got: tuple[dict, dict | None], want: tuple[dict, dict | None]) -> str | None:
    """None if bit-identical, else what differs."""
    (gsd, gopt), (wsd, wopt) = got, want
    if sorted(gsd) != sorted(wsd):
        return f"model keys {sorted(gsd)} != {sorted(wsd)}"
    for k in wsd:
        if not same(gsd[k], wsd[k]):
            return f"model tensor {k}: {gsd[k].dtype}{tuple(gsd[k].shape)} {gsd[k].flatten()[:4]} != {wsd[k].dtype}{tuple(wsd[k].shape)} {wsd[k].flatten()[:4]}"
    if wopt is None:
        return None
    if sorted(gopt["state"]) != sorted(wopt["state"]):
        return f"optimizer params {sorted(gopt['state'])} != {sorted(wopt['state'])}"
    for i, slots in wopt["state"].items():
        if sorted(gopt["state"][i]) != sorted(slots):
            return f"optimizer param {i}: slots {sorted(gopt['state'][i])} != {sorted(slots)}"
        for k, v in slots.items():
            if not same(gopt["state"][i][k], v):
                return f"optimizer {i}.{k} differs"
    norm = lambda groups: [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]
    if norm(gopt["param_groups"]) != norm(wopt["param_groups"]):
        return f"param_groups {gopt['param_groups']} != {wopt['param_groups']}"
    return None


# -- the run: iterations, losses, joins, resumes ------------------------------------------------------------


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fake_dist(monkeypatch):
    monkeypatch.setattr(snapshot_mod, "swap", fake_swap)
    monkeypatch.setattr(snapshot_mod, "all_ok", fake_all_ok)
    monkeypatch.setattr(recovery_mod, "all_gather_json", fake_all_gather_json)
    monkeypatch.setattr(recovery_mod, "all_reduce_int", fake_all_reduce_int)
    monkeypatch.setattr(recovery_mod, "move", fake_move)
    monkeypatch.setattr(recovery_mod.dist, "new_group", lambda **kw: "gloo-group")
    handler = ListHandler()
    logger = logging.getLogger("elasticrl.train.recovery")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    dcp = logging.getLogger("c10d-NullHandler-dcp_logger")  # DCP's per-call DEBUG records: slow to capture
    dcp_level = dcp.level
    dcp.setLevel(logging.WARNING)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
    dcp.setLevel(dcp_level)


@dataclasses.dataclass
class Finished:
    """The latest finished iteration's snapshot and where the design keeps its shards."""

    iteration: int
    generation: int
    everywhere: bool
    """Resumed from: every node of the world that resumed it holds every shard (fetched)."""


class Run:
    def __init__(self, seed: int, root, strategy: str, log: ListHandler):
        self.seed, self.root, self.log = seed, root, log
        self.rng = random.Random(seed)
        self.cls = STRATEGIES[strategy]
        self.model = random_model(self.rng, big=self.cls is Zero)
        self.history: dict[tuple[int, int], tuple[dict, dict]] = {}
        self.generation = 0
        self.iteration = 0  # of the state the world holds
        self.taken = 0  # the newest iteration any rank took a snapshot of
        self.finished: Finished | None = None
        self.partitioned: set[str] = set()  # lost nodes whose host memory outlived them
        self.joins = 0
        self.trace: list[str] = []
        self.nodes: list[str] = []
        self.ranks: list[tuple[Recovery, FakeStrategy]] = []

    def where(self) -> str:
        return f"seed {self.seed}, {self.cls.__name__}: " + " | ".join(self.trace[-8:])

    def node_dir(self, node: str) -> str:
        return os.path.join(self.root, "nodes", node)

    def config(self, node: str):
        return load_config(None, [("run.run_id", "random"), ("run.run_dir", str(self.root / "run")),
                                  ("checkpoint.dir", str(self.root / "no-checkpoints")),
                                  ("checkpoint.snapshot_dir", self.node_dir(node)), ("checkpoint.snapshot_timeout_s", "20")])

    # -- a world -------------------------------------------------------------------------------------

    def form(self, nodes: list[str], *, lost: set[str] = frozenset(), crashed: set[int] = frozenset(), phase: str = "",
             clean: bool = False, old_nodes: list[str] | None = None) -> None:
        """A new generation on ``nodes``: every rank sets up and resumes; checks what it resumed."""
        self.generation += 1
        self.nodes = list(nodes)
        self.trace.append(f"g{self.generation} {','.join(nodes)}")
        world = len(nodes)
        configs = {n: self.config(n) for n in set(nodes)}
        order = ring_of(nodes)

        def rank_main(r: int):
            node = nodes[r]
            info = WorldInfo(rank=r, world_size=world, local_rank=nodes[:r].count(node), node_rank=order.index(node))
            rec = Recovery(configs[node], info, node)
            rec.setup(self.generation)
            strategy = self.cls(self.model, r, world)
            strategy.garbage()
            return rec, strategy, rec.resume(strategy)

        inventories = {n: inventory(self.node_dir(n)) for n in set(nodes)}
        self.log.lines.clear()
        results = ok(run_ranks(Fabric(world), {r: (lambda r=r: rank_main(r)) for r in range(world)}))
        self.ranks = [(results[r][0], results[r][1]) for r in range(world)]
        resumed = [results[r][2] for r in range(world)]
        self.check_resume(resumed, inventories, nodes, lost, crashed, phase, clean, old_nodes)

    def check_resume(self, resumed, inventories, nodes, lost, crashed, phase, clean, old_nodes) -> None:
        where = self.where()
        f = self.finished
        promised = f is None or self.promised(lost, crashed, old_nodes)
        first = resumed[0]
        for res in resumed[1:]:  # every rank the same decision
            assert (res is None) == (first is None), where
            if first is not None:
                assert (res.iteration, res.meta) == (first.iteration, first.meta), where
                assert {**res.metrics, "rank": 0} == {**first.metrics, "rank": 0}, where
        held = [Held(n, inventories[n]) for n in nodes]
        sid, reason = choose(held)
        if first is None:
            assert f is None or not promised, f"{where}: nothing resumed ({reason}) though {f} should have survived"
            assert all(s.loaded == 0 for _, s in self.ranks), where  # nothing partial applied
            if f is not None:
                warned = [line for line in self.log.lines if line.startswith("snapshots: ") and "starting over" in line]
                assert warned == [f"snapshots: {reason}; no checkpoint either: starting over"], (where, self.log.lines)
                assert "lacks shard(s)" in reason or reason == "no node holds a snapshot", (where, reason)
            if clean and f is not None and not f.everywhere:  # exactly the shards both of whose holders were lost
                bud = buddies(old_nodes)
                missing = [r for r in range(len(old_nodes)) if old_nodes[r] in lost and (bud[r] is None or old_nodes[bud[r]] in lost)]
                name = SnapshotId(f.iteration, f.generation, len(old_nodes)).name
                newest = max(SnapshotId.parse(n) for h in held for n in h.snapshots)
                if newest.generation < f.generation and newest.iteration > f.iteration:
                    # Nothing is complete, so no later generation supersedes it: a leftover of an
                    # earlier world's timeline (on a node the later world wrote nothing to) is the
                    # newest found, and the reason names it.
                    assert f"the newest, {newest.name}, lacks" in reason, (where, reason)
                else:
                    assert reason == f"no snapshot is complete (the newest, {name}, lacks shard(s) {missing})", (where, reason)
            self.trace.append("started over")
            self.iteration, self.finished = 0, None
            return
        it, gen = first.iteration, first.meta["generation"]
        assert sid is not None and (sid.iteration, sid.generation) == (it, gen), (where, sid, it, gen)
        assert it <= self.taken, where
        if f is not None and promised:
            assert (it, gen) >= (f.iteration, f.generation), f"{where}: resumed {(it, gen)}, the latest finished is {f}"
        assert first.meta["data_position"] == {"next_iteration": it + 1}, where
        assert {k: v for k, v in first.metrics.items() if k != "rank"} == {"iteration": it, "generation": gen}, where
        want = self.history[(it, gen)]
        got = self.cls.assemble([s for _, s in self.ranks])
        if self.cls is Zero:
            want = (self.ranks[0][1].compare_model(want[0]), want[1])
        diff = states_equal(got, want)
        assert diff is None, f"{where}: resumed {(it, gen)} into a world of {len(nodes)}: {diff}"
        assert all(s.loaded == 1 for _, s in self.ranks), where
        for n in set(nodes):  # every node now holds every shard of it
            assert set(inventory(self.node_dir(n)).get(sid.name, {})) == set(range(sid.world_size)), (where, n)
        self.trace.append(f"resumed {it}/g{gen}")
        self.iteration, self.finished = it, Finished(it, gen, everywhere=True)

    def promised(self, lost: set[str], crashed: set[int], old_nodes: list[str]) -> bool:
        """Whether the design promises the latest finished snapshot survives these losses: some node
        of the world that resumed it is left (it holds every shard), or, for one the world took,
        each shard's owner or buddy (a rank of another node) is still alive to write its copy."""
        f = self.finished
        alive = [r for r in range(len(old_nodes)) if old_nodes[r] not in lost and r not in crashed]
        if f.everywhere:
            return any(old_nodes[r] not in lost for r in alive)
        bud = oracle_buddies(old_nodes)
        return all(r in alive or (bud[r] is not None and bud[r] in alive) for r in range(len(old_nodes)))

    # -- an iteration --------------------------------------------------------------------------------

    def iterate(self, *, dying: set[int] = frozenset(), posting: set[int] = frozenset()) -> dict[int, object]:
        """Iteration ``self.iteration + 1``: every rank updates and takes its snapshot (``dying``
        ranks die in the exchange)."""
        k, g = self.iteration + 1, self.generation
        full = self.history[(k, g)] = full_state(self.seed, self.model, k, g)
        self.trace.append(f"it {k}" + (f" dying {sorted(dying)}" if dying else ""))

        def rank_main(r: int):
            rec, strategy = self.ranks[r]
            rec.write_pending()  # the last iteration's, at the rollout
            strategy.set(*full)
            meta = {"data_position": {"next_iteration": k + 1}, "generation": g}
            return rec.snapshot(strategy, k, meta, None, {"iteration": k, "generation": g, "rank": r})

        results = run_ranks(Fabric(len(self.nodes), dying, posting), {r: (lambda r=r: rank_main(r)) for r in range(len(self.nodes))})
        self.taken = max(self.taken, k)
        self.iteration = k
        for r, res in results.items():
            if r in dying:
                assert isinstance(res, (Died, float)), (self.where(), r, res)
            else:
                assert isinstance(res, (WireError, float)), (self.where(), r, res)
        if all(isinstance(results[r], float) for r in results if r not in dying):
            self.finished = Finished(k, g, everywhere=False)  # take returned on every rank left: on record
        return results

    def write_some(self) -> None:
        """Some ranks' background writes of the last snapshot start (and end) early."""
        for rec, _ in self.ranks:
            if self.rng.random() < 0.4:
                rec.write_pending()
                rec.snapshots.wait()

    # -- events --------------------------------------------------------------------------------------

    def end(self, ranks: set[int], lost_nodes: set[str]) -> None:
        """``ranks`` end without a word (SIGKILL, a host gone): nothing of their memory is written;
        every other rank writes its last snapshot on the way out (``Recovery.close``). Then the
        lost nodes' host memory goes, unless the node was only cut off."""
        for r, (rec, _) in enumerate(self.ranks):
            if r in ranks:
                rec.snapshots.wait()  # a write already under way finishes first
                rec._forget_flush()
            else:
                rec.close()
        for n in lost_nodes:
            if self.rng.random() < 0.25:
                self.partitioned.add(n)
            else:
                shutil.rmtree(self.node_dir(n), ignore_errors=True)
                self.partitioned.discard(n)

    def pick_losses(self) -> tuple[set[str], set[int]]:
        order = ring_of(self.nodes)
        roll = self.rng.random()
        if roll < 0.55 or len(order) < 3:
            lost = {self.rng.choice(order)} if len(order) > 1 else set()
        elif roll < 0.8:  # several at once, no two neighbours
            lost = set()
            for i in self.rng.sample(range(len(order)), len(order)):
                if order[(i - 1) % len(order)] not in lost and order[(i + 1) % len(order)] not in lost and self.rng.random() < 0.6:
                    lost.add(order[i])
        else:  # anything, neighbours too
            lost = set(self.rng.sample(order, self.rng.randint(2, len(order))))
        crashed = set()
        if self.rng.random() < (0.25 if lost else 0.7):
            crashed.add(self.rng.randrange(len(self.nodes)))
        if all(n in lost or r in crashed for r, n in enumerate(self.nodes)):
            keep = self.rng.randrange(len(self.nodes))
            lost.discard(self.nodes[keep])
            crashed.discard(keep)
        return lost, {r for r in crashed if self.nodes[r] not in lost}

    def joiners(self, room: int) -> list[str]:
        out = []
        back = sorted(self.partitioned - set(self.nodes))
        for _ in range(self.rng.randint(1, 2)):
            if back and self.rng.random() < 0.5:  # a cut-off node is back, its host memory with it
                name = back.pop(self.rng.randrange(len(back)))
                self.partitioned.discard(name)
            else:
                self.joins += 1
                name = f"new{self.joins}"
            n = self.rng.randint(1, 3)
            if n > room:
                break
            room -= n
            out += [name] * n
        return out

    def loss(self) -> None:
        old = list(self.nodes)
        lost, crashed = self.pick_losses()
        gone = {r for r, n in enumerate(old) if n in lost} | crashed
        phase = self.rng.choice(["before", "during", "after"])
        self.trace.append(f"loss {phase} nodes {sorted(lost)} ranks {sorted(crashed)}")
        if phase == "during":
            self.iterate(dying=gone, posting={r for r in gone if self.rng.random() < 0.5})
        elif phase == "after":
            self.iterate()
            self.write_some()
        finished = self.finished
        self.end(gone, lost)
        survivors = [n for r, n in enumerate(old) if r not in gone]
        if self.rng.random() < 0.2:  # a node joins as the world re-forms (torchrun restarts everyone)
            survivors += self.joiners(16 - len(survivors))
        clean = phase == "after" and not crashed and finished is not None and not finished.everywhere
        self.form(survivors, lost=lost, crashed=crashed, phase=phase, clean=clean, old_nodes=old)

    def join(self) -> None:
        """Nodes join: every worker restarts (writing its last snapshot) into a larger world,
        numbered anew."""
        new = self.joiners(16 - len(self.nodes))
        if not new:
            return
        old = list(self.nodes)
        self.trace.append(f"join {','.join(dict.fromkeys(new))}")
        self.end(set(), set())
        blocks = [[n] * (old + new).count(n) for n in dict.fromkeys(old + new)]
        if self.rng.random() < 0.5:
            self.rng.shuffle(blocks)
        self.form([n for b in blocks for n in b], old_nodes=old)

    def close(self) -> None:
        for rec, _ in self.ranks:
            rec.close()


def play(seed: int, root, strategy: str, log: ListHandler, steps: int = 10) -> Run:
    run = Run(seed, root, strategy, log)
    nodes = random_layout(run.rng, interleave=False)
    while len(set(nodes)) < 2 and run.rng.random() < 0.8:
        nodes = random_layout(run.rng, interleave=False)
    run.form(nodes)
    try:
        for _ in range(steps):
            roll = run.rng.random()
            if len(set(run.nodes)) < 3 and run.rng.random() < 0.3:
                run.join()
            elif roll < 0.5:
                run.iterate()
            elif roll < 0.85:
                run.loss()
            else:
                run.join()
    finally:
        run.close()
    return run


E2E_SEEDS = _seeds(range(7))


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("seed", E2E_SEEDS)
def test_snapshots_survive_random_losses_and_reshard_exactly(seed, strategy, tmp_path, fake_dist):
    play(seed, tmp_path, strategy, fake_dist)


# -- what the random runs found, minimized ------------------------------------------------------------------


def test_a_zero_rank_whose_partition_holds_no_trained_slice_still_exchanges_with_its_buddy(tmp_path, fake_dist):
    """ZeRO-1/2 over 2 nodes, a trained parameter of one element: rank 0's partition holds it, rank
    1's only padding, so rank 1's state is replicated tensors only. Both must take the same path:
    rank 0 sends its slice to rank 1 and waits for rank 1's shard; rank 1 (``all(c.replicated)``)
    instead cuts "rank 0's shard" from its own state (without the slice) and sends nothing."""
    states = {0: {"zero.param.0": Chunk.flat(torch.tensor([1.5]), 0, 1), "model.buf": Chunk.whole(torch.ones(2), replicated=True)},
              1: {"model.buf": Chunk.whole(torch.ones(2), replicated=True)}}
    snaps = {r: snapshot_mod.Snapshots(str(tmp_path / n), rank=r, world_size=2, generation=1, nodes=["a", "b"], group="gloo")
             for r, n in enumerate("ab")}
    results = run_ranks(Fabric(2, wait_s=0.5), {r: (lambda r=r: snaps[r].take(1, states[r], {}, {})) for r in (0, 1)})
    assert all(isinstance(v, float) for v in results.values()), results  # rank 0: "(1, 0, 'swap') never arrived"
    assert "zero.param.0" in snaps[1]._taken.received[0][0]  # rank 1's copy of shard 0 holds the slice


def test_on_one_node_the_previous_snapshot_stays_until_every_rank_wrote_the_new_one(tmp_path):
    """"the previous snapshot stays until the new one is complete": one node, two ranks (no
    buddies). Iteration 1 written by both; iteration 2 taken by both, written by rank 1 (which
    prunes iteration 1 from the node's directory); rank 0 dies before its write (SIGKILL, OOM: no
    flush). Its shard of 2 is nowhere, and 1 is gone: the node resumes from nothing."""
    snaps = [snapshot_mod.Snapshots(str(tmp_path), rank=r, world_size=2, generation=1, nodes=["a", "a"]) for r in (0, 1)]
    state = {"w": Chunk.whole(torch.arange(4.0), replicated=True)}
    for s in snaps:
        s.take(1, state, {}, {})
        s.flush()
    assert choose([Held("a", inventory(str(tmp_path)))])[0] == SnapshotId(1, 1, 2)
    for s in snaps:
        s.take(2, state, {}, {})
    snaps[1].flush()  # rank 0 never writes its part of 2
    sid, reason = choose([Held("a", inventory(str(tmp_path)))])
    assert sid == SnapshotId(1, 1, 2), reason  # got None: "the newest, iter-000002-g1-w2, lacks shard(s) [0]"


def test_a_stale_snapshot_of_an_abandoned_timeline_is_pruned_once_a_later_world_writes_its_own(tmp_path):
    """World g1 (nodes a, b) finished iteration 4; b is cut off. Nothing complete on a: world g2
    ([a]) falls back to a checkpoint of iteration 2 and finishes iteration 3 (written, confirmed).
    Its directory still holds g1's half of iteration 4: when b comes back, g3 resumes g1's iteration
    4 and g2's finished iteration 3 is lost; if instead a is lost too, the reason names g1's."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    g1 = [snapshot_mod.Snapshots(d, rank=r, world_size=2, generation=1, nodes=["a", "b"]) for r, d in enumerate((a, b))]
    for s in g1:  # as with buddies: each node its own shard and the other's copy
        s.take(4, {"w": Chunk.whole(torch.full((2,), 4.0), replicated=True)}, {}, {})
        s._taken.received[1 - s.rank] = (s._taken.own, {**s._taken.doc, "shard": 1 - s.rank})
        s.flush()
    os.remove(os.path.join(a, SnapshotId(4, 1, 2).name, "shard-00001.json"))  # a's copy of b's shard was not written yet
    assert choose([Held("a", inventory(a))])[0] is None  # b cut off: g2 falls back to its checkpoint
    g2 = snapshot_mod.Snapshots(a, rank=0, world_size=1, generation=2, nodes=["a"])
    g2.take(3, {"w": Chunk.whole(torch.full((2,), 3.0), replicated=True)}, {}, {})
    g2.flush()  # confirmed and written: what is older goes
    assert sorted(inventory(a)) == [SnapshotId(3, 2, 1).name]  # g1's half of iteration 4 went too (an earlier generation)
    assert choose([Held("a", inventory(a)), Held("b", inventory(b))])[0] == SnapshotId(3, 2, 1)
