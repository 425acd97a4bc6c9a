"""Asynchronous RL with bounded staleness: iteration throughput at rollout.max_staleness = 0, 1, 2.

    python bench/async.py [--ks 0,1,2] [--iterations 12] [--rollout-s 0.4] [--update-s 0.4] [--json-out FILE]

A real coordinator (``elasticrl coordinator`` on a free port) schedules every task; the engines and
the trainer are SIMULATED, and labelled so in the output:

* engines: ``--workers`` real ``RolloutWorker``s (one slot each, in this process) whose generation
  is a sleep, sized so that one iteration's ``--tasks`` groups take ``--rollout-s`` with every worker
  busy. Each waits at a ``VersionGate`` (the trainer nodes' gate) until it holds the version a task
  names, and stamps its groups with the version it holds; their idle share is measured with the
  engine worker's ``IdleMeter``.
* trainer: the RL node's order of work with the RL node's own pieces: ``SubmissionWindow`` decides
  which iterations are submitted when and with which minimum version (the presubmit during the
  update included), ``wait_sealed`` and ``fetch_shard`` against the coordinator, ``keep_fresh``
  enforces the staleness bound, then an "update" that sleeps ``--update-s`` and a push that
  advances the gate (weights arrive instantly: this measures the overlap, not the transfer).

Equal rollout and update times are where overlap gains most: ideally an iteration takes
``rollout + update`` on-policy and ``max(rollout, update)`` with k >= 1, i.e. 2x. The first
iteration (the pipeline filling) is not timed. Goal (issue 17): >= 1.8x at k = 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.benchmain import BenchError, run_main  # noqa: E402

GOAL_K1 = 1.8


class SimulatedEngines:
    """``workers`` one-slot RolloutWorkers on one event loop in a daemon thread; generation sleeps."""

    def __init__(self, address: str, run_id: str, workers: int, task_s: float, timeout_s: float):
        from elasticrl.scheduler.worker import RolloutWorker
        from elasticrl.train.rollout_link import VersionGate
        from elasticrl.train.staleness import IdleMeter

        self.gate = VersionGate(0)  # the version the engines hold: the trainer's last push
        self.task_s = task_s
        self.timeout_s = timeout_s
        self.meters = [IdleMeter() for _ in range(workers)]
        self.workers = [
            RolloutWorker(address, run_id, f"sim-engine-{n}", None, generate_batch=self._engine(n), slots=1, linger_s=0.0)
            for n in range(workers)
        ]
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim-engines", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise BenchError("the simulated engines did not start within 30 s")

    def _engine(self, n: int):
        from elasticrl.scheduler.state import GroupRecord, SampleRecord

        def generate_batch(assignments):
            metas = [json.loads(a.task.metadata_json) for a in assignments]
            self.gate.wait(max(m["policy_version"] for m in metas), max(m["weights_version"] for m in metas), self.timeout_s)
            version = self.gate.version  # what this engine holds as it draws
            with self.meters[n].busy():
                time.sleep(self.task_s * len(assignments))  # SIMULATED generation
            return [GroupRecord(a.task.task_id, "", version, self.task_s, 0.0,
                                [SampleRecord.pack([1, 2, 3], [-0.5] * 3, 1.0) for _ in range(a.task.num_samples)])
                    for a in assignments]

        return generate_batch

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            self._ready.set()
            await asyncio.gather(*(w.run(self._stop) for w in self.workers))

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc
        finally:
            self._ready.set()

    def check(self) -> None:
        if self.error is not None:
            raise BenchError(f"a simulated engine stopped: {type(self.error).__name__}: {self.error}")

    def idle_fraction(self) -> float:
        """Mean idle share of the engines since the last call."""
        return statistics.mean(m.take() for m in self.meters)

    def stop(self) -> None:
        self.gate.close()
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


def simulate(args, address: str, k: int) -> dict:
    """One simulated run at max_staleness = k; the RL node's loop with sleeps for rollout and update."""
    from elasticrl.scheduler.client import SchedulerClient
    from elasticrl.train.names import weights_version
    from elasticrl.train.rollout_link import iteration_tasks
    from elasticrl.train.staleness import SubmissionWindow, keep_fresh, lag_summary, merge_lags

    run_id = f"bench-async-k{k}-{time.monotonic_ns()}.rollout"
    engines = SimulatedEngines(address, run_id, args.workers, args.rollout_s * args.workers / args.tasks, args.timeout_s)
    window = SubmissionWindow(k, args.iterations)
    version, done_at, waited, lags, dropped = 0, [], [], [], 0
    rows = [{"prompt": f"{n}=", "target": str(n)} for n in range(args.tasks)]
    try:
        with SchedulerClient(address, call_timeout_s=args.timeout_s) as client:
            def submit(j: int) -> None:
                v = window.task_version(j)
                tasks = iteration_tasks(rows, iteration=j, seed=1, group_size=args.group_size, max_new_tokens=3,
                                        temperature=1.0, policy_version=v, weights_version=weights_version(1, v))
                client.submit_iteration(run_id, j, tasks, task_lease_s=args.timeout_s)
                window.mark(j)

            for i in range(1, args.iterations + 1):
                if i == 2:
                    engines.idle_fraction()  # the timed part starts once iteration 1 is done
                started = time.monotonic()
                for j in window.due(i):
                    submit(j)
                client.wait_sealed(run_id, i, args.timeout_s, check=engines.check, check_every_s=0.5)
                waited.append(time.monotonic() - started)
                groups = client.fetch_shard(run_id, i, rank=0, world_size=1)
                _, stale, histogram = keep_fresh(groups, version, k)
                dropped += stale
                lags.append(histogram)
                ahead = window.ahead(i)  # the RL node submits it in the background during the update
                if ahead is not None:
                    submit(ahead)
                time.sleep(args.update_s)  # SIMULATED policy update
                version = i
                engines.gate.advance(i)  # SIMULATED push: the engines hold the new version at once
                done_at.append(time.monotonic())
            client.close_run(run_id, "bench finished")
        engine_idle = engines.idle_fraction()
    finally:
        engines.stop()
    timed = args.iterations - 1
    seconds = done_at[-1] - done_at[0]
    lag = lag_summary(merge_lags(lags[1:]))
    return {
        "max_staleness": k,
        "iterations_per_s": round(timed / seconds, 3),
        "iteration_s": round(seconds / timed, 4),
        "policy_lag": lag["policy_lag"],
        "policy_lag_mean": round(lag["policy_lag_mean"], 3),
        "stale_dropped": dropped,
        "engine_idle_fraction": round(engine_idle, 3),
        "trainer_idle_fraction": round(sum(waited[1:]) / seconds, 3),
        "simulated": "engines' generation and the trainer's update are sleeps",
    }


def run(args, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    from bench.scheduler_procs import Coordinator

    coordinator = Coordinator(tmp, "coordinator", None, cleanup)
    rows = [simulate(args, coordinator.address, k) for k in args.ks]
    base = next((r for r in rows if r["max_staleness"] == 0), None)
    for r in rows:
        r["speedup"] = round(r["iterations_per_s"] / base["iterations_per_s"], 2) if base else None
    k1 = next((r["speedup"] for r in rows if r["max_staleness"] == 1), None)
    return {
        "async": rows,
        "config": {"iterations": args.iterations, "rollout_s_simulated": args.rollout_s, "update_s_simulated": args.update_s,
                   "workers": args.workers, "tasks": args.tasks, "group_size": args.group_size},
        "goal": {"speedup_at_k1": GOAL_K1, "met": None if k1 is None else k1 >= GOAL_K1},
    }


def render(doc: dict) -> str:
    c = doc["config"]
    lines = [f"SIMULATED engines and trainer (sleeps): rollout {c['rollout_s_simulated']:g} s and update "
             f"{c['update_s_simulated']:g} s per iteration, {c['workers']} engines, {c['tasks']} groups, "
             f"{c['iterations']} iterations (the first not timed); a real coordinator schedules them",
             "k  iterations/s  s/iteration  speedup  lag mean  stale  engine idle  trainer idle"]
    for r in doc["async"]:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"{r['max_staleness']:<2} {r['iterations_per_s']:>12.3f}  {r['iteration_s']:>11.3f}  {speedup:>7}  "
                     f"{r['policy_lag_mean']:>8.2f}  {r['stale_dropped']:>5}  {r['engine_idle_fraction']:>11.0%}  "
                     f"{r['trainer_idle_fraction']:>12.0%}")
    g = doc["goal"]
    if g["met"] is not None:
        lines.append(f"goal: >= {g['speedup_at_k1']}x at k = 1: {'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/async.py", description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="0,1,2", help="comma-separated rollout.max_staleness values (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=12, help="iterations per value, the first one not timed (default: %(default)s)")
    p.add_argument("--rollout-s", type=float, default=0.4, help="simulated rollout time of one iteration, all engines busy, seconds (default: %(default)s)")
    p.add_argument("--update-s", type=float, default=0.4, help="simulated update time per iteration, seconds (default: %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="simulated engines, one slot each (default: %(default)s)")
    p.add_argument("--tasks", type=int, default=16, help="groups (tasks) per iteration (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=4, help="samples per group (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="give up on any one wait after this long, seconds (default: %(default)s)")
    p.add_argument("--json-out", metavar="FILE", help="write the JSON here (the table goes to stdout); default: JSON on stdout, table on stderr")
    args = p.parse_args(argv)
    try:
        args.ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ks: {args.ks!r} must be comma-separated integers, e.g. 0,1,2")
    if not args.ks or min(args.ks) < 0:
        p.error(f"--ks: {args.ks} needs at least one value, all >= 0")
    if args.iterations < 2 or args.workers < 1 or args.tasks < 1 or args.group_size < 1:
        p.error("--iterations must be >= 2 (the first is not timed); --workers, --tasks and --group-size >= 1")
    if args.rollout_s <= 0 or args.update_s < 0 or args.timeout_s <= 0:
        p.error("--rollout-s and --timeout-s must be > 0, --update-s >= 0")
    return run_main("bench/async.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render, prefix="bench-async-")


if __name__ == "__main__":
    sys.exit(main())
