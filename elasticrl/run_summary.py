"""What the launcher (``elasticrl run`` / ``make demo``) says when a run ends: the summary of what
it did, from its ``metrics.jsonl``, why each failed node stopped (one line, not its traceback), and
the snapshots a run that did not finish leaves in host memory."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Protocol


class Finished(Protocol):
    """A process the launcher started, once it has ended."""

    name: str
    proc: subprocess.Popen
    log_path: str


def leftover_snapshots(run_dir: str, run_id: str, *, kept: bool) -> None:
    """The nodes of a run that did not finish leave their snapshots in host memory, for a world
    started again with the same run id and run dir to resume from. A run id this launcher made
    (from the time) is never given again, so they are freed; one the user set (``run.run_id``) keeps
    them, and the user is told where they are."""
    import shutil

    from elasticrl.train.snapshot_plan import run_root  # pure Python, like this module

    root = run_root(run_dir, run_id)
    if not os.path.isdir(root):
        return  # the run finished (its nodes freed them) or wrote none
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
        return
    print(f"snapshots: {root} (host memory) is kept: started again with run.run_id = {run_id!r} and the same run "
          "dir, the run resumes from it; rm -r it to free the memory")


def last_records(run_dir: str) -> list[dict]:
    """The last record of every iteration (an iteration redone after a restart appears twice).
    A line that is not a JSON object with an integer ``iteration`` (torn by a crash, written by
    something else) is skipped."""
    by_iteration: dict[int, dict] = {}
    with contextlib.suppress(OSError):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and type(record.get("iteration")) is int:
                        by_iteration[record["iteration"]] = record
    return [by_iteration[i] for i in sorted(by_iteration)]


def _tail(path: str, lines: int = 25) -> str:
    with contextlib.suppress(OSError):
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    return ""


# The last line of a traceback: "pkg.mod.SomeError: what happened".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")
# How the elasticrl rendezvous says why a node stopped (rendezvous/handler.py), before the worker's own error.
_STOP_REASON = "restarts do not fix: "


def stopped_by(log_path: str) -> str:
    """Why a node stopped, in one line: its last exception's class and message (the worker's own
    error where the node's torchrun agent stopped for it), or "" when its log ends otherwise."""
    with contextlib.suppress(OSError):
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()[-200:]
        for line in reversed(lines):
            m = _EXCEPTION_LINE.match(line)
            if m:
                name, message = m.groups()
                return message.split(_STOP_REASON, 1)[1] if _STOP_REASON in message else f"{name}: {message}"
    return ""


def summarize(run_dir: str, nodes: Sequence[Finished], iterations: int, wall_s: float, *, killed: bool, checkpointed: bool = True,
               no_plot: bool = False, label: str = "elasticrl demo") -> int:
    """Print the outcome; 0 when the run reached its last iteration and saved a checkpoint of it
    (a rollout-only phase saves none), and some node finished cleanly (a node killed by --kill-at
    is expected to die)."""
    records = last_records(run_dir)
    checkpoint = records[-1].get("checkpoint") if records else None
    saved = bool(checkpoint) and os.path.isdir(checkpoint) if checkpointed else True
    complete = bool(records) and records[-1]["iteration"] == iterations and saved
    clean = [n for n in nodes if n.proc.returncode == 0]
    for n in nodes:
        if n.proc.returncode != 0 and not (killed and n is nodes[-1]):
            reason = stopped_by(n.log_path)
            if reason:
                print(f"\n{n.name} exited with status {n.proc.returncode}: {reason}\n  (its log: {n.log_path})", file=sys.stderr)
            else:
                print(f"\n{n.name} exited with status {n.proc.returncode}; the end of {n.log_path}:\n{_tail(n.log_path)}",
                      file=sys.stderr)
    if not complete or not clean:
        last = records[-1]["iteration"] if records else 0
        print(f"{label}: training failed after {last}/{iterations} iterations ({wall_s:.0f}s)", file=sys.stderr)
        return 1
    k = 5 if len(records) >= 20 else min(3, len(records))
    head, tail = records[:k], records[-k:]

    def mean(rs, key, default=0.0):
        return sum(r.get(key, default) for r in rs) / len(rs)

    worlds = " -> ".join(str(w) for w in dict.fromkeys(r["world_size"] for r in records))
    print()
    print(f"done in {wall_s:.0f}s: {iterations} iterations, world size {worlds}")
    print(
        f"  reward       {mean(head, 'reward_mean'):.3f} -> {mean(tail, 'reward_mean'):.3f}"
        f"  (mean of the first / last {len(tail)} iterations)"
    )
    if not any(r.get("turns_mean", 1.0) > 1 for r in records):
        print(f"  exact match  {mean(head, 'exact_fraction'):.0%} -> {mean(tail, 'exact_fraction'):.0%} of samples (reward 1)")
    else:
        print(f"  ended        {1 - mean(head, 'truncated_fraction'):.0%} -> {1 - mean(tail, 'truncated_fraction'):.0%} of episodes"
              " by the env (terminated; the rest ran out of turns or context)")
        print(f"  turns        {mean(head, 'turns_mean', 1.0):.2f} -> {mean(tail, 'turns_mean', 1.0):.2f} per episode")
    errors, failed = (sum(r.get(key, 0) for r in records) for key in ("env_errors", "groups_failed"))
    if errors or failed:
        print(f"  env errors   {errors} episode(s); {failed} training group(s) dropped after rollout.max_task_failures attempts")
    if checkpoint:
        print(f"  checkpoint   {checkpoint}  (model.safetensors, optimizer.safetensors, meta.json)")
    else:
        print("  checkpoint   none (run.rl_phase = rollout trains nothing; its iterations wait for an update phase)")
    print(f"  metrics      {os.path.join(run_dir, 'metrics.jsonl')}")
    if no_plot:
        return 0
    from elasticrl.plot import plot_rewards

    png = os.path.join(run_dir, "reward.png")
    problem = plot_rewards(os.path.join(run_dir, "metrics.jsonl"), png)
    print(f"  plot         {png}" if problem is None else f"  plot         not drawn: {problem}")
    return 0
