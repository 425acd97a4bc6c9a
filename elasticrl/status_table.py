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
    return "\n".join(parts)
