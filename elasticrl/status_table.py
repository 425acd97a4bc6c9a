"""Render ``elasticrl status`` data (the JSON form of StatusResponse) as readable tables."""

from __future__ import annotations


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _caps(m: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((m.get("capabilities") or {}).items())) or "-"


def render(data: dict) -> str:
    parts = [
        f"coordinator {data.get('version', '?')}  up {float(data.get('uptime_s', 0)):.1f}s  "
        f"default lease {int(data.get('lease_ttl_ms', 0)) / 1000:.1f}s"
    ]
    runs = data.get("runs") or []
    if not runs:
        parts.append("no runs")
    for run in runs:
        snap = run["snapshot"]
        rnd = snap.get("round") or {}
        state = "closed" if snap.get("closed") else "open"
        parts.append(
            f"\nrun {snap['run_id']}  epoch {snap['epoch']}  {state}  members {len(snap.get('members') or [])}  "
            f"kv keys {run.get('kv_keys', 0)}  round {rnd.get('round', 0)} "
            f"({len(rnd.get('participants') or [])} nodes, {len(rnd.get('waiting') or [])} waiting, "
            f"{len(rnd.get('lost') or [])} lost)"
        )
        members = (snap.get("members") or []) + (run.get("departed") or [])
        rows = [
            [
                m["member_id"],
                str(m["incarnation"]),
                m["state"].removeprefix("MEMBER_STATE_").lower(),
                f"{int(m['lease_left_ms']) / 1000:.1f}s",
                f"{float(m['weight']):g}",
                m.get("host") or "-",
                _caps(m),
                m.get("reason") or "",
            ]
            for m in members
        ]
        parts.append(_table(["MEMBER", "INCARNATION", "STATE", "LEASE LEFT", "WEIGHT", "HOST", "CAPABILITIES", "REASON"], rows))
        barriers = run.get("open_barriers") or []
        if barriers:
            rows = [
                [
                    b["name"],
                    str(len(b.get("arrived") or [])),
                    ",".join(b.get("waiting_for") or []) or "-",
                    f"{int(b['age_ms']) / 1000:.1f}s",
                    f"{int(b['timeout_ms']) / 1000:.1f}s",
                ]
                for b in barriers
            ]
            parts.append("open barriers:\n" + _table(["BARRIER", "ARRIVED", "WAITING FOR", "AGE", "TIMEOUT"], rows))
        it = run.get("iteration")
        if it:
            parts.append(render_iteration(it))
    return "\n".join(parts)


def render_iteration(m: dict) -> str:
    """The scheduler's view of one iteration (a manifest): totals, then tasks per node."""
    refused = m["refused_duplicate"] + m["refused_fenced"] + m["refused_sealed"]
    state = f"sealed ({m['seal_reason']})" if m["sealed"] else "open"
    head = (
        f"iteration {m['iteration']}  {m['policy']}  {state}  {m['elapsed_s']:.1f}s  tasks {m['tasks_done']}/"
        f"{m['tasks_total']} done, {m['tasks_running']} running, {m['tasks_queued']} queued  requeued "
        f"{m['requeued']}  refused {refused} (duplicate {m['refused_duplicate']}, fenced {m['refused_fenced']}, "
        f"sealed {m['refused_sealed']})  tokens {m['tokens']}"
    )
    if m.get("tasks_failed") or m.get("env_errors"):
        last = m["errors"][-1] if m.get("errors") else ""
        head += f"\n  env errors {m['env_errors']}, {m['tasks_failed']} task(s) given up" + (f"; last: {last}" if last else "")
    if m.get("groups_lost"):
        head += f"\n  {m['groups_lost']} group(s) lost with their shard files at a restart (their tasks ran again unless sealed)"
    rows = [
        [
            n["node"], str(n["slots"] or "-"), str(n["running"]), str(n["done"]), str(n["assigned"]),
            str(n["refused"]), f"{n['tasks_per_s']:.2f}", str(n["tokens"]), "evicted" if n["evicted"] else "",
        ]
        for n in m["nodes"]
    ]
    return head + "\n" + _table(["NODE", "SLOTS", "RUNNING", "DONE", "ASSIGNED", "REFUSED", "TASKS/S", "TOKENS", ""], rows)
