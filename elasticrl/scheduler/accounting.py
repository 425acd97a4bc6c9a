"""An iteration's books, as pure functions: the counters a result batch leaves behind (computed
before its commit, applied after) and the manifest (what ``WaitSealed``, ``elasticrl status`` and
``manifest.json`` show)."""

from __future__ import annotations

import collections
import dataclasses

from elasticrl.scheduler.state import Counters, GroupRecord, Iteration, NodeStats, Split, TaskStatus


def staged_counters(
    it: Iteration, member_id: str, refused: list[tuple[int, str, str]], fresh: list[GroupRecord], now: float,
) -> tuple[Counters, NodeStats]:
    """``it``'s counters and ``member_id``'s stats as they are once this batch is stored, as
    copies: they replace the live ones only after the commit."""
    c = dataclasses.replace(it.counters, errors=list(it.counters.errors))
    node = dataclasses.replace(it.nodes.get(member_id) or NodeStats())
    for iteration, _, reason in refused:
        if iteration == it.iteration and reason != "unknown":
            setattr(c, f"refused_{reason}", getattr(c, f"refused_{reason}") + 1)
            node.refused += 1
    if fresh:
        node.done += len(fresh)
        node.tokens += sum(g.num_tokens for g in fresh)
        node.last_result_at = now
    return c, node


def manifest(it: Iteration, slots: dict[str, int], now: float, elapsed_s: float, *, per_node: bool = True) -> dict:
    """``it``'s manifest; ``slots``: the connected workers' slots, by member id. ``per_node``
    False: the counts only, at a cost that does not grow with the tasks (no ``nodes``, ``tokens``
    0): what a trainer rank polling for the seal needs (512 ranks polling an iteration of 10k
    tasks every second spent ~2 s of the event loop per second on the full one)."""
    running: dict[str, int] = collections.Counter(
        m for t in it.tasks.values() if t.status is TaskStatus.RUNNING for m in t.holders
    ) if per_node else {}
    nodes = []
    for member_id in sorted(set(it.nodes) | set(running)) if per_node else ():
        s = it.node(member_id)
        # Unknown after a restart (not persisted): then no rate, not done / a monotonic reading.
        span = (s.last_result_at - s.first_assigned_at) if s.last_result_at is not None and s.first_assigned_at is not None else 0.0
        nodes.append({
            "node": member_id, "assigned": s.assigned, "done": s.done, "running": running.get(member_id, 0),
            "refused": s.refused, "tokens": s.tokens, "evicted": s.evicted,
            "tasks_per_s": s.done / span if s.done and span > 0 else 0.0,
            "slots": slots.get(member_id, 0),
        })
    c = it.counters
    return {
        "run_id": it.run_id, "iteration": it.iteration, "sealed": it.sealed, "seal_reason": it.seal_reason,
        "policy": it.config.policy.value,
        "tasks_total": len(it.tasks), "tasks_done": it.count(TaskStatus.DONE),
        "tasks_queued": it.count(TaskStatus.QUEUED), "tasks_running": it.count(TaskStatus.RUNNING),
        "requeued": c.requeued, "refused_duplicate": c.refused_duplicate, "refused_fenced": c.refused_fenced,
        "refused_sealed": c.refused_sealed, "backups_issued": c.backups_issued,
        "tasks_failed": it.count(TaskStatus.FAILED), "env_errors": c.env_errors, "errors": list(c.errors),
        "groups_lost": c.groups_lost,
        "eval_total": sum(it.count(status, Split.EVAL) for status in TaskStatus),
        "eval_done": it.count(TaskStatus.DONE, Split.EVAL), "eval_failed": it.count(TaskStatus.FAILED, Split.EVAL),
        "nodes": nodes, "evicted": list(it.evicted), "elapsed_s": elapsed_s,
        "tokens": sum(n["tokens"] for n in nodes),
        "sealed_ago_s": now - it.sealed_at if it.sealed else 0.0,
    }
