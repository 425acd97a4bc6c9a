"""Start-up check of the trajectory shards behind each stored iteration.

SQLite says which tasks are done and which shard holds each one's group; a shard file is written
before that commit, so after a crash a shard can be missing (its rename never reached the disk
without ``--fsync``, or someone deleted it), damaged (torn, overwritten) or orphaned (written, never
committed). ``restore_groups`` runs once per stored iteration when the scheduler starts. It reads
an open iteration's groups back into memory and, where a shard is missing or unreadable, marks the
groups it held lost instead of refusing to start: they are counted (``Counters.groups_lost``, the
manifest's ``groups_lost``), logged, and their tasks queued again while the iteration is open (so
it can still complete) or dropped once it has sealed (its batch is what it is). Then the orphans
and temp files are deleted.

A sealed iteration's shards are only checked for existence here: reading every shard of every past
iteration would make start-up as slow as the run is long. They are read when a trainer fetches them.
"""

from __future__ import annotations

import collections
import logging

from elasticrl.scheduler.persist import SchedulerDB
from elasticrl.scheduler.state import Iteration, TaskStatus
from elasticrl.scheduler.store import TrajectoryStore

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 200


def restore_groups(it: Iteration, store: TrajectoryStore, db: SchedulerDB) -> int:
    """Load the stored groups of ``it`` (open iterations), mark those that cannot be read lost and
    persist that, remove files no commit refers to. Returns the number of groups lost."""
    if store.root is None:
        return 0  # an in-memory store: nothing of it survived, nothing was stored about it either
    on_disk = store.shard_names(it.run_id, it.iteration)
    tasks_of: dict[str, list[str]] = collections.defaultdict(list)
    for task_id, shard in it.shard_of.items():
        tasks_of[shard].append(task_id)
    lost: list[str] = []
    why: dict[str, str] = {}  # shard -> what is wrong with it
    for shard, task_ids in sorted(tasks_of.items()):
        if shard not in on_disk:
            why[shard] = "missing"
            lost += task_ids
            continue
        if it.sealed:
            continue
        try:
            records = store.read_shard(it.run_id, it.iteration, shard)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, its groups are lost
            why[shard] = f"unreadable: {type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
            lost += task_ids
            continue
        for group, _ in records:
            if it.shard_of.get(group.task_id) == shard:
                it.groups[group.task_id] = group
        absent = [t for t in task_ids if t not in it.groups]
        if absent:
            why[shard] = f"has no group for {len(absent)} of its {len(task_ids)} task(s)"
            lost += absent
    if lost:
        _mark_lost(it, lost, db)
        log.error(
            "run %s iteration %d: %d group(s) lost from %d damaged shard(s) (%s); %s",
            it.run_id, it.iteration, len(lost), len(why), "; ".join(f"{s} {w}" for s, w in sorted(why.items())),
            "the iteration is sealed: they are dropped from its batch" if it.sealed else "their tasks are queued again",
        )
    removed = store.remove_unreferenced(it.run_id, it.iteration, keep=set(it.shard_of.values()))
    if removed:
        log.warning(
            "run %s iteration %d: removed %d file(s) no commit refers to (a crash's leftovers or a damaged shard): %s",
            it.run_id, it.iteration, len(removed), ", ".join(removed),
        )
    return len(lost)


def _mark_lost(it: Iteration, task_ids: list[str], db: SchedulerDB) -> None:
    tasks = sorted((it.tasks[t] for t in task_ids), key=lambda t: t.seq)
    for task in tasks:
        task_id = task.spec.task_id
        stats = it.nodes.get(task.done_by)
        if stats is not None and stats.done > 0:
            stats.done -= 1  # its tokens stay counted: a missing shard does not say how many
        it.shard_of.pop(task_id, None)
        it.groups.pop(task_id, None)
        task.done_by = ""
        if it.sealed:
            task.status = TaskStatus.DROPPED
        else:
            task.status = TaskStatus.QUEUED
            task.requeues += 1
            it.counters.requeued += 1
    if not it.sealed:  # at the front, in submission order: they were among the first done
        it.queue.extendleft(reversed([t.spec.task_id for t in tasks]))
    it.counters.groups_lost += len(tasks)
    with db.tx():
        db.put_lost(it, tasks)
        db.put_counters(it)
