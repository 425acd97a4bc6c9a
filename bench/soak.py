"""Coordinator memory over a long run: is what it keeps bounded?

One real coordinator subprocess (``--mode durable``: with a state dir, as in production; or
``memory``), one real rollout worker process (``bench/scheduler_worker.py``) and this driver:

* ``--iterations`` iterations, one after the other, each ``--tasks`` tasks of ``--prompt-tokens``
  prompt tokens (the task specs are what a sealed iteration used to keep forever), submitted,
  run by the worker, sealed, and one rank's shard fetched, as a trainer would;
* meanwhile two members of another run arrive at ``--barriers`` barriers in turn (each a new name:
  decided barriers used to stay forever), with a KV add per barrier (request ids are stored).

The coordinator's resident memory (VmRSS) is sampled after every ``--sample-every`` iterations.
Goal (issue 15): RSS at 1000 iterations within 10% of RSS at 100. Also reported: the SQLite file's
size and row counts at the end, so growth on disk shows too.

    python bench/soak.py                               # 1000 iterations, 10,000 barriers, ~1-2 min
    python bench/soak.py --iterations 200 --barriers 1000 --json-out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sqlite3
import sys
import threading
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

from bench.benchmain import run_main  # noqa: E402
from elasticrl.coordinator.server import STATE_FILE  # noqa: E402
from bench.scheduler_procs import BenchError, Coordinator, WorkerSet, log, process_rss_mb, run_iteration  # noqa: E402

RUN = "soak"
BARRIER_RUN = "soak-barriers"


class Pace:
    """How many barriers the members may pass so far: the driver raises it with each iteration,
    so barriers and iterations advance together and every RSS sample sees both."""

    def __init__(self) -> None:
        self.allowed = 0
        self.passed: dict[str, int] = {}
        self.cond = threading.Condition()

    def allow(self, n: int) -> None:
        with self.cond:
            self.allowed = n
            self.cond.notify_all()

    def wait_allowed(self, n: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.allowed > n, timeout=600):
                raise TimeoutError(f"barrier {n} not allowed within 600 s")

    def record(self, name: str, n: int) -> None:
        with self.cond:
            self.passed[name] = n
            self.cond.notify_all()

    def wait_passed(self, n: int, timeout_s: float = 120) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.passed) == 2 and min(self.passed.values()) >= n, timeout=timeout_s):
                raise BenchError(f"the barrier members passed {self.passed} of {n} barriers within {timeout_s:.0f}s")


def _barrier_member(address: str, name: str, count: int, pace: Pace, errors: list[str]) -> None:
    from elasticrl.coordinator.client import CoordinatorClient

    with CoordinatorClient(address, call_timeout_s=30) as c:
        me = c.join(BARRIER_RUN, name, lease_ttl_s=3600)
        try:
            for i in range(count):
                pace.wait_allowed(i)
                c.arrive(BARRIER_RUN, name, me.incarnation, f"b{i}", timeout_s=60)
                c.kv_add(BARRIER_RUN, f"count-{name}".encode(), 1)
                pace.record(name, i + 1)
        except Exception as exc:  # noqa: BLE001 - reported by the bench
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            pace.record(name, count)  # let the driver go on and report it


def _db_stats(state_dir: pathlib.Path | None) -> dict:
    if state_dir is None:
        return {}
    path = state_dir / STATE_FILE
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in sorted(tables)}
    finally:
        conn.close()
    size = sum(p.stat().st_size for p in state_dir.glob(STATE_FILE + "*"))
    shards = sum(1 for _ in (state_dir / "trajectories").rglob("shard-*"))
    return {"db_mb": round(size / 2**20, 2), "rows": counts, "shard_files": shards}


def run(args, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    from bench.scheduler_procs import tasks
    from elasticrl.scheduler.client import SchedulerClient

    per_iteration = args.barriers / args.iterations

    state_dir = tmp / "state" if args.mode == "durable" else None
    coord = Coordinator(tmp, "coordinator", state_dir, cleanup, extra_args=args.coordinator_args.split())
    pid = coord.proc.pid
    client = cleanup.enter_context(SchedulerClient(coord.address, call_timeout_s=30))
    errors: list[str] = []
    pace = Pace()
    members = [
        threading.Thread(target=_barrier_member, args=(coord.address, f"m{i}", args.barriers, pace, errors), daemon=True)
        for i in range(2)
    ]
    samples: list[dict] = []
    started = time.monotonic()
    with WorkerSet(tmp / "workers", client, coord.address, RUN, [{"member": "w0", "slots": 8, "tokens": 16}], 60):
        for t in members:
            t.start()
        for i in range(1, args.iterations + 1):
            specs = tasks(f"i{i}-", args.tasks, 2)
            for s in specs:
                s.prompt_ids = list(range(1, args.prompt_tokens + 1))
            pace.allow(round(i * per_iteration))
            run_iteration(client, RUN, i, specs, 60)
            pace.wait_passed(round(i * per_iteration))
            if not client.fetch_shard(RUN, i, rank=0, world_size=2):
                raise BenchError(f"iteration {i}: rank 0 of 2 fetched no groups")
            if i % args.sample_every == 0:
                rss, peak = process_rss_mb(pid)
                barriers = min(pace.passed.values())
                samples.append({"iteration": i, "barriers": barriers, "rss_mb": rss, "peak_mb": peak,
                                "elapsed_s": round(time.monotonic() - started, 1)})
                log(f"  iteration {i}: {barriers} barriers, coordinator RSS {rss:.1f} MB (peak {peak:.1f})")
        for t in members:
            t.join(timeout=600)
    if errors:
        raise BenchError("; ".join(errors))
    done = int(client.kv_get(BARRIER_RUN, [b"count-m0"])[0] or 0)
    rss, peak = process_rss_mb(pid)
    client.close()
    coord.stop()  # it holds its database's lock while it runs (persist.py): read the file after
    by_iteration = {s["iteration"]: s["rss_mb"] for s in samples}
    early = by_iteration.get(min(100, args.iterations), samples[0]["rss_mb"])
    return {
        "soak": {
            "mode": args.mode, "coordinator_args": args.coordinator_args, "iterations": args.iterations, "tasks_per_iteration": args.tasks,
            "prompt_tokens": args.prompt_tokens, "barriers": done, "samples": samples,
            "rss_mb_end": rss, "peak_mb": peak, "rss_ratio_end_vs_100": round(rss / early, 3),
            **_db_stats(state_dir),
        }
    }


def render(doc: dict) -> str:
    s = doc["soak"]
    lines = [
        f"soak ({s['mode']}): {s['iterations']} iterations x {s['tasks_per_iteration']} tasks "
        f"({s['prompt_tokens']} prompt tokens), {s['barriers']} barriers",
        f"{'iteration':>10} {'barriers':>9} {'RSS MB':>8} {'peak MB':>8} {'elapsed s':>10}",
    ]
    lines += [
        f"{x['iteration']:>10} {x['barriers']:>9} {x['rss_mb']:>8.1f} {x['peak_mb']:>8.1f} {x['elapsed_s']:>10.1f}"
        for x in s["samples"]
    ]
    lines.append(f"RSS at the end / at iteration 100: {s['rss_ratio_end_vs_100']:.3f} (goal: within 1.10)")
    if "db_mb" in s:
        lines.append(f"SQLite {s['db_mb']} MB, {s['shard_files']} shard files; rows: "
                     + ", ".join(f"{k} {v}" for k, v in s["rows"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--tasks", type=int, default=16, help="tasks per iteration (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per task (default: %(default)s)")
    p.add_argument("--barriers", type=int, default=10_000, help="barriers two members pass meanwhile (default: %(default)s)")
    p.add_argument("--sample-every", type=int, default=100, help="iterations between RSS samples (default: %(default)s)")
    p.add_argument("--mode", choices=("durable", "memory"), default="durable")
    p.add_argument("--coordinator-args", default="", metavar="'ARGS'", help="extra flags for elasticrl coordinator, e.g. '--keep-request-ids 5000'")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON here (the table then goes to stdout)")
    args = p.parse_args(argv)
    if args.iterations < args.sample_every:
        p.error("--iterations must be at least --sample-every")
    return run_main("bench/soak.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render, prefix="elasticrl-soak-")


if __name__ == "__main__":
    raise SystemExit(main())
