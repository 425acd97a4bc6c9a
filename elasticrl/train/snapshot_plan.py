"""Pure decisions about snapshots: where they live, whose buddy a rank is, which snapshot a
re-formed world resumes from, and which shard files must move where first.

No torch and no I/O beyond naming paths (the demo imports it to find a node's directory). Every
rank computes the same answers from the same all-gathered inventory, so no rank decides for the
others and nothing has to be broadcast.

Layout, one directory per node (``node_dir``), one subdirectory per snapshot::

    <run root>/<node>/iter-000005-g3-w3/shard-00002.safetensors   rank 2's shard (a DCP file)
                                        shard-00002.json          its JSON part, written last
                                        shard-00001.safetensors   ... a buddy copy of rank 1's

A snapshot is named by (iteration, worker-group generation, world size): the generation keeps a
world that redid an iteration from mixing its files with an earlier attempt's. A shard counts
once its ``.json`` exists (both files are renamed into place, the JSON last).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

SHM = "/dev/shm"
_NAME_RE = re.compile(r"iter-(\d+)-g(\d+)-w(\d+)")
_SHARD_RE = re.compile(r"shard-(\d+)\.json")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def run_root(run_dir: str, run_id: str) -> str:
    """Where a run's snapshots live on this host: host memory (``/dev/shm``) where there is one,
    else ``<run_dir>/snapshots``. Freed when the run finishes."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK):
        # The run dir in the name too: two runs that share an id (two tests in one second) must
        # never resume from each other's snapshots; a resumed run has the same run dir.
        return os.path.join(SHM, "elasticrl", f"{_safe(run_id)}-{run_dir_tag(run_dir)}")
    return os.path.join(run_dir, "snapshots")


def run_dir_tag(run_dir: str) -> str:
    """The run dir's part of ``run_root``'s name: its absolute path, hashed."""
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:10]


def default_dir(run_dir: str, run_id: str, node: str) -> str:
    """One directory per node under ``run_root``, so nodes sharing a host keep their own."""
    return os.path.join(run_root(run_dir, run_id), _safe(node))


@dataclasses.dataclass(frozen=True, order=True)
class SnapshotId:
    """One world's snapshot of one iteration; ordered newest last."""

    iteration: int
    generation: int
    world_size: int

    @property
    def name(self) -> str:
        return f"iter-{self.iteration:06d}-g{self.generation}-w{self.world_size}"

    @staticmethod
    def parse(name: str) -> SnapshotId | None:
        m = _NAME_RE.fullmatch(name)
        return SnapshotId(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def shard_file(rank: int, suffix: str) -> str:
    """``shard-00002.safetensors`` / ``shard-00002.json``: rank 2's shard of its world."""
    return f"shard-{rank:05d}{suffix}"


def shards_in(directory: str) -> dict[int, list[int]]:
    """{shard rank: [bytes of its .safetensors, bytes of its .json]} for the complete shards in a
    snapshot directory."""
    out = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    for name in names:
        m = _SHARD_RE.fullmatch(name)
        tensors = os.path.join(directory, shard_file(int(m.group(1)), ".safetensors")) if m else ""
        if m and os.path.isfile(tensors):
            try:
                out[int(m.group(1))] = [os.path.getsize(tensors), os.path.getsize(os.path.join(directory, name))]
            except OSError:  # pruned meanwhile
                continue
    return out


def inventory(node_dir: str) -> dict[str, dict[int, list[int]]]:
    """{snapshot name: shards_in(...)} of every snapshot in a node's directory that has a shard."""
    out = {}
    try:
        names = os.listdir(node_dir)
    except OSError:
        return {}
    for name in names:
        if SnapshotId.parse(name) is not None:
            held = shards_in(os.path.join(node_dir, name))
            if held:
                out[name] = held
    return out


def buddies(nodes: list[str]) -> dict[int, int | None]:
    """rank -> the rank that keeps a copy of its shard: the rank at the same position on the next
    node in ring order (nodes ordered by their lowest rank; position modulo that node's size).
    ``nodes[r]`` names rank r's node. None for every rank when there is one node."""
    ranks_of: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(rank)
    order = list(ranks_of)  # first appearance = lowest rank first
    if len(order) < 2:
        return {rank: None for rank in range(len(nodes))}
    out = {}
    for i, node in enumerate(order):
        nxt = ranks_of[order[(i + 1) % len(order)]]
        for position, rank in enumerate(ranks_of[node]):
            out[rank] = nxt[position % len(nxt)]
    return out


@dataclasses.dataclass(frozen=True)
class Held:
    """What one rank of the new world reports: its node, and the shards in its node's directory."""

    node: str
    snapshots: dict[str, dict[int, list[int]]]

    @staticmethod
    def from_json(obj: dict) -> Held:
        return Held(obj["node"], {name: {int(r): sizes for r, sizes in shards.items()} for name, shards in obj["snapshots"].items()})

    def to_json(self) -> dict:
        return {"node": self.node, "snapshots": {n: {str(r): s for r, s in shards.items()} for n, shards in self.snapshots.items()}}


def choose(held: list[Held], generation: int | None = None) -> tuple[SnapshotId | None, str]:
    """The newest snapshot every shard of which some rank's node holds (own or buddy copy), and why.

    A complete snapshot of a later generation supersedes every snapshot of an earlier one: that
    world went on from an older state (none was complete when it formed, so it fell back to a
    checkpoint), and an earlier world's later iteration, completed by a cut-off node that came
    back, belongs to the timeline it abandoned. Generations only grow (a run's counter in the
    coordinator's KV); when this world's ``generation`` does not exceed one found, the counter
    started over (a memory-only coordinator restarted), and the iteration alone orders."""
    found: dict[SnapshotId, set[int]] = {}
    for h in held:
        for name, shards in h.snapshots.items():
            sid = SnapshotId.parse(name)
            if sid is not None:
                found.setdefault(sid, set()).update(shards)
    if not found:
        return None, "no node holds a snapshot"
    complete = [sid for sid, shards in found.items() if shards >= set(range(sid.world_size))]
    if complete and (generation is None or generation > max(sid.generation for sid in found)):
        latest = max(sid.generation for sid in complete)
        found = {sid: shards for sid, shards in found.items() if sid.generation >= latest}
        complete = [sid for sid in complete if sid.generation >= latest]
    newest = max(found)
    if not complete:
        missing = sorted(set(range(newest.world_size)) - found[newest])
        return None, f"no snapshot is complete (the newest, {newest.name}, lacks shard(s) {missing})"
    best = max(complete)
    if best == newest:
        return best, f"{best.name}: every shard held"
    missing = sorted(set(range(newest.world_size)) - found[newest])
    return best, f"{best.name}: the newest complete one ({newest.name} lacks shard(s) {missing})"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Shard ``shard`` of the chosen snapshot goes from rank ``src`` to rank ``dst`` (another node's)."""

    src: int
    dst: int
    shard: int
    sizes: tuple[int, int]
    """Bytes of its .safetensors and .json files."""


def fetch_plan(sid: SnapshotId, held: list[Held]) -> list[Transfer]:
    """Every node gets every shard of ``sid`` it lacks (every rank reads the whole state, or the
    parts of all shards its new cut overlaps), into its lowest rank; each from the holder that has
    sent the fewest so far (ties: the lowest rank), so a lost node's shards come from every buddy
    that holds one, not all from one. Deterministic: the same list on every rank."""
    by_node: dict[str, list[int]] = {}
    for rank, h in enumerate(held):
        by_node.setdefault(h.node, []).append(rank)
    has: dict[str, dict[int, tuple[int, int]]] = {}
    for node, ranks in by_node.items():
        has[node] = {}
        for rank in ranks:
            for shard, sizes in held[rank].snapshots.get(sid.name, {}).items():
                has[node].setdefault(shard, (sizes[0], sizes[1]))
    sent = [0] * len(held)
    plan = []
    for node, ranks in by_node.items():
        for shard in range(sid.world_size):
            if shard in has[node]:
                continue
            holders = [r for r, h in enumerate(held) if shard in h.snapshots.get(sid.name, {})]
            if not holders:
                raise ValueError(f"{sid.name}: no rank holds shard {shard}; choose() should not have picked it")
            src = min(holders, key=lambda r: (sent[r], r))
            sent[src] += 1
            sizes = held[src].snapshots[sid.name][shard]
            plan.append(Transfer(src=src, dst=ranks[0], shard=shard, sizes=(sizes[0], sizes[1])))
    return plan


def stale(names: list[str], newest: SnapshotId) -> list[str]:
    """The snapshot directories older than ``newest`` (pruned once ``newest`` is written): of an
    earlier iteration, or of an earlier generation whatever its iteration. A world that fell back
    to an older checkpoint (no snapshot was complete) goes on from there: an earlier world's
    snapshot of a later iteration is of an abandoned timeline, and would otherwise outrank every
    snapshot of this one (a cut-off node that comes back could complete it)."""
    return [n for n in names if (sid := SnapshotId.parse(n)) is not None and sid != newest
            and (sid < newest or sid.generation < newest.generation)]
