"""Where one RL iteration's time goes, on the demo config: rollout / seal / fetch / update / weight
push / barriers / checkpoint, and the share the coordination takes.

    python bench/iteration.py [--nodes 2] [--iterations 20] [--skip 3] [--json-out FILE]

It runs the real demo (a local coordinator plus ``--nodes`` torchrun agents on this machine) and
reads rank 0's per-iteration timings from metrics.jsonl (every phase is timed inside the node):

* ``barrier``: the leased barrier after the seal, where a dead trainer node is noticed,
* ``submit``: rank 0 submitting the iteration's tasks to the scheduler (0 when ``rollout.presubmit``
  sent them during the previous update, off the critical path),
* ``rollout``: from then until the seal is known (the engines generate meanwhile),
* ``seal``: the part of ``rollout`` after the coordinator decided the seal: persisting it, writing
  the manifest, waking rank 0's ``WaitSealed`` and building its reply (the manifest's
  ``sealed_ago_s``; the reply's transit back is not in it),
* ``fetch``: streaming this rank's shard of the sealed batch from the coordinator, and the
  all-reduce of the batch's counts that waits for every rank's fetch,
* ``eval``: on evaluation iterations, rank 0 fetching the held-out groups from the coordinator,
* ``update``: the policy update (the configured strategy), ``push``: handing the new weights to
  the local engine (``publish``, part of push: waiting for the previous iteration's background
  upload of the weights to the coordinator, for rollout-only workers),
* ``checkpoint``: the save after the previous iteration, when it saved one (a record is written
  before its iteration's checkpoint, so the save shows up in the next record).

Coordination = barriers + seal + fetch (the issue's definition; goal < 5% of an iteration), and
the broader sum that adds submit and eval (every phase that talks to the coordinator or waits
for the other ranks). The first ``--skip``
iterations (process start-up, first rendezvous) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("barrier", "submit", "seal", "fetch", "eval", "update", "push", "publish", "rollout_work", "checkpoint")


def summarize(records: list[dict], skip: int) -> dict:
    by_iteration = {r["iteration"]: r for r in records}
    rows = [by_iteration[i] for i in sorted(by_iteration) if i > skip]
    if not rows:
        raise SystemExit(f"no iterations after --skip {skip}: run more --iterations")
    per = []
    for r in rows:
        seal = r["t_seal"]
        per.append({
            "iteration": r["iteration"],
            "total": r["seconds"] + r.get("t_checkpoint", 0.0),
            "barrier": r["t_barrier"],
            "submit": r["t_submit"],
            "seal": seal,
            "rollout_work": r["t_rollout"] - seal,
            "fetch": r["t_fetch"],
            "eval": r.get("t_eval", 0.0),
            "update": r["t_update"],
            "push": r["t_push"],
            "publish": r.get("t_publish", 0.0),
            "checkpoint": r.get("t_checkpoint", 0.0),
        })
    mean = {k: statistics.fmean(p[k] for p in per) for k in ("total", *PHASES)}
    coordination = mean["barrier"] + mean["seal"] + mean["fetch"]
    broad = coordination + mean["submit"] + mean["eval"]
    return {
        "iterations": len(per),
        "mean_s": mean,
        "coordination_s": coordination,
        "coordination_share": coordination / mean["total"],
        "coordination_with_submit_eval_s": broad,
        "coordination_with_submit_eval_share": broad / mean["total"],
        "per_iteration": per,
    }


def table(summary: dict) -> str:
    mean, total = summary["mean_s"], summary["mean_s"]["total"]
    lines = [f"{'phase':<14} {'mean ms':>9} {'share':>7}", "-" * 32]
    labels = {"rollout_work": "rollout (gen)", "barrier": "barriers", "publish": "  upload wait"}
    for k in ("rollout_work", "update", "push", "publish", "eval", "checkpoint", "barrier", "submit", "seal", "fetch"):
        lines.append(f"{labels.get(k, k):<14} {1000 * mean[k]:>9.1f} {mean[k] / total:>7.1%}")
    lines.append("-" * 32)
    lines.append(f"{'iteration':<14} {1000 * total:>9.1f} {1:>7.0%}")
    lines.append(
        f"coordination (barriers + seal + fetch): {1000 * summary['coordination_s']:.1f} ms = "
        f"{summary['coordination_share']:.1%} of an iteration (goal < 5%)"
    )
    lines.append(
        f"  with submit and eval: {1000 * summary['coordination_with_submit_eval_s']:.1f} ms = "
        f"{summary['coordination_with_submit_eval_share']:.1%}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, help="local torchrun agents (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=20, help="RL iterations to run (default: %(default)s)")
    p.add_argument("--skip", type=int, default=3, help="first iterations left out as warm-up (default: %(default)s)")
    p.add_argument("--out", help="run directory (default: a temporary one)")
    p.add_argument("--metrics", help="summarize this metrics.jsonl instead of running the demo")
    p.add_argument("--json-out", help="also write the JSON summary here")
    p.add_argument("node_args", nargs=argparse.REMAINDER, help="extra --section.key=value for the nodes, after --")
    args = p.parse_args(argv)
    metrics = args.metrics
    if metrics is None:
        out = args.out or tempfile.mkdtemp(prefix="elasticrl-iteration-bench-")
        cmd = [sys.executable, "-m", "elasticrl.demo", "--nodes", str(args.nodes), "--iterations", str(args.iterations),
               "--checkpoint-every", "5", "--out", out, *args.node_args]
        print("running:", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], file=sys.stderr)
            raise SystemExit(f"the demo failed with status {proc.returncode}")
        print(f"demo finished in {time.monotonic() - t0:.0f}s; run dir {out}")
        metrics = os.path.join(out, "metrics.jsonl")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    summary = summarize(records, args.skip)
    summary.update(nodes=args.nodes, metrics=metrics)
    print(table(summary))
    text = json.dumps(summary, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "per_iteration"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
