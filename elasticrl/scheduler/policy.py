"""Pure scheduling decisions: static shares, what a worker takes next, expired task leases,
when an iteration seals, and how a sealed batch is split across trainer ranks.

Every function reads state and a time and returns a decision (most with a reason string); none
mutates anything, so ``core`` can apply, persist and log them, and tests can drive them with a
made-up clock.
"""

from __future__ import annotations

import heapq
import math

from elasticrl.scheduler.state import Iteration, Policy, TaskStatus, Worker


def static_shares(task_ids: list[str], weights: dict[str, float]) -> dict[str, list[str]]:
    """Split ``task_ids`` into contiguous shares proportional to ``weights`` (largest remainder).

    Deterministic: members in sorted order, ties in remainder go to the earlier member. This is the
    old ``--rank-weights "2,1,1"`` split, kept as a baseline.
    """
    members = sorted(weights)
    if not members:
        return {}
    total = sum(weights[m] for m in members)
    if total <= 0:
        raise ValueError(f"weights: {weights} must have a positive sum")
    n = len(task_ids)
    exact = [n * weights[m] / total for m in members]
    counts = [math.floor(x) for x in exact]
    short = n - sum(counts)
    by_remainder = sorted(range(len(members)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:short]:
        counts[i] += 1
    shares, start = {}, 0
    for m, c in zip(members, counts):
        shares[m] = task_ids[start:start + c]
        start += c
    return shares


def pick_tasks(it: Iteration, worker: Worker, free: int, *, retry_anywhere: bool = False) -> list[tuple[str, bool]]:
    """Up to ``free`` tasks of ``it`` for ``worker``: [(task id, is_backup)], without mutating.

    Static: the worker's own share first, then requeued tasks anyone may take. Dynamic: the shared
    queue in order; once it is empty, up to ``backup_tasks`` backup copies of the longest-running
    tasks that only one other worker holds (the first copy to finish wins), never of one this
    worker still runs (its lease expired) or whose env failed on it. A task whose env
    failed on this worker is retried elsewhere: it is skipped here unless ``retry_anywhere`` (it
    waited in the queue for another worker long enough).
    """
    if it.sealed or free <= 0:
        return []
    picked: list[tuple[str, bool]] = []
    sources = []
    if it.config.policy is Policy.STATIC:
        sources.append(it.shares.get(worker.member_id, ()))
    sources.append(it.queue)
    for source in sources:
        for task_id in source:
            if len(picked) >= free:
                return picked
            task = it.tasks[task_id]
            # Still in ``holding``: its task lease expired, but the worker still runs that copy.
            # ``storing``: queued after its lease expired, then a copy's result came; that result
            # decides (done, or queued again if it cannot be stored). Handed out meanwhile, it went
            # back to the worker whose result it was, which the commit does not cancel.
            if (task.status is TaskStatus.QUEUED and not task.storing and worker.member_id not in task.holders
                    and (it.iteration, task_id) not in worker.holding
                    and (retry_anywhere or worker.member_id not in task.failed_on)):
                picked.append((task_id, False))
    budget = it.config.backup_tasks - it.counters.backups_issued
    if it.config.policy is Policy.DYNAMIC and budget > 0 and len(picked) < free and not _queued_left(it, picked):
        stragglers = sorted(
            (t for t in it.tasks.values()
             if t.status is TaskStatus.RUNNING and len(t.holders) == 1 and worker.member_id not in t.holders
             and not t.storing and (it.iteration, t.spec.task_id) not in worker.holding
             and worker.member_id not in t.failed_on),
            key=lambda t: (min(h.assigned_at for h in t.holders.values()), t.seq),
        )
        for task in stragglers[: min(budget, free - len(picked))]:
            picked.append((task.spec.task_id, True))
    return picked


def sort_results(
    iterations: dict[int, Iteration], groups: list, fenced: bool,
) -> tuple[dict[int, list], list[tuple[int, str, str]]]:
    """Which results of one batch (``(iteration, group)`` pairs) are stored and which are refused,
    with the reason: "unknown" (no such task), "fenced" (the worker's incarnation is not live),
    "duplicate" (the task is done, its result is being stored, or it is in this batch twice),
    "sealed" (the iteration sealed first). Returns ({iteration: [group, ...]}, [(iteration,
    task id, reason), ...])."""
    fresh: dict[int, list] = {}
    refused: list[tuple[int, str, str]] = []
    seen: set[tuple[int, str]] = set()
    for iteration, group in groups:
        it = iterations.get(iteration)
        task = it.tasks.get(group.task_id) if it is not None else None
        if task is None:
            refused.append((iteration, group.task_id, "unknown"))
            continue
        if fenced:
            reason = "fenced"
        elif task.status is TaskStatus.DONE or task.storing or (iteration, group.task_id) in seen:
            reason = "duplicate"
        elif it.sealed:
            reason = "sealed"
        else:
            seen.add((iteration, group.task_id))
            fresh.setdefault(iteration, []).append(group)
            continue
        refused.append((iteration, group.task_id, reason))
    return fresh, refused


def _queued_left(it: Iteration, picked: list[tuple[str, bool]]) -> bool:
    if not it.count(TaskStatus.QUEUED):
        return False
    taken = {task_id for task_id, _ in picked}
    return any(t.status is TaskStatus.QUEUED and t.spec.task_id not in taken for t in it.tasks.values())


def expired_holders(it: Iteration, now: float) -> list[tuple[str, str]]:
    """(task id, member id) of every running copy whose task lease has passed."""
    return lease_scan(it, now)[0]


def lease_scan(it: Iteration, now: float) -> tuple[list[tuple[str, str]], float]:
    """``expired_holders``, and the earliest deadline of the copies not expired yet (inf if
    none): until then no lease can expire, so ``core`` need not look again (a pass over every
    task, each tick, cost ~2% of the event loop with 400 tasks and grows with the iteration)."""
    if not it.count(TaskStatus.RUNNING):
        return [], math.inf
    expired, earliest = [], math.inf
    for task in it.tasks.values():
        if task.status is TaskStatus.RUNNING:
            for member_id, holder in task.holders.items():
                if now >= holder.deadline:
                    expired.append((task.spec.task_id, member_id))
                elif holder.deadline < earliest:
                    earliest = holder.deadline
    return expired, earliest


def decide_seal(it: Iteration, now: float) -> tuple[bool, str]:
    """Seal when every task is done or given up (FAILED), or once the deadline passed with
    ``min_fraction`` done. Whether too many failed is the trainer's call (it sees the manifest)."""
    if it.sealed:
        return False, "already sealed"
    total = len(it.tasks)
    # This runs after every result batch: counts kept as statuses change, not a pass over the tasks.
    done = it.count(TaskStatus.DONE)
    if done >= total:
        return True, f"all {total} tasks done"
    failed = it.count(TaskStatus.FAILED)
    if done + failed >= total:  # nothing more can come: every task is done or given up
        return True, f"all tasks finished: {done}/{total} done, {failed} failed"
    deadline = it.deadline
    if deadline is None:
        return False, f"{done}/{total} done, no deadline"
    if now < deadline:
        return False, f"{done}/{total} done, {deadline - now:.3f}s to the deadline"
    need = math.ceil(it.config.min_fraction * total - 1e-9)
    if done >= need:
        return True, f"deadline passed with {done}/{total} groups (min_fraction {it.config.min_fraction:g})"
    return False, f"deadline passed but only {done}/{total} groups; waiting for {need}"


def balance_shards(groups: list[tuple[str, int, int]], world_size: int) -> list[list[str]]:
    """Split groups across ``world_size`` ranks with near-equal token counts.

    ``groups``: (task id, seq, tokens). Longest-processing-time greedy: largest groups first, each
    to the rank with the fewest tokens so far (ties: fewer groups, then lower rank). Deterministic
    for a given input and world size; each rank's list comes back in submission (seq) order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    heap = [(0, 0, rank) for rank in range(world_size)]
    out: list[list[tuple[int, str]]] = [[] for _ in range(world_size)]
    for task_id, seq, tokens in sorted(groups, key=lambda g: (-g[2], g[1])):
        load, count, rank = heapq.heappop(heap)
        out[rank].append((seq, task_id))
        heapq.heappush(heap, (load + tokens, count + 1, rank))
    return [[task_id for _, task_id in sorted(shard)] for shard in out]


def oldest_open(iterations: list[Iteration]) -> list[Iteration]:
    """Open iterations in the order their tasks should be handed out: the lowest iteration number
    first (then the earlier submit). The trainer waits for the lowest one: with iterations submitted
    ahead (``rollout.max_staleness``), or one submitted again by a trainer resumed from an older
    checkpoint after the scheduler let it go, the newest submit may well be the one needed first."""
    return sorted((it for it in iterations if not it.sealed), key=lambda it: (it.iteration, it.submitted_at))
