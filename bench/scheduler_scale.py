"""The scheduler's cost per result batch as workers are added: the core alone, in this process.

    python bench/scheduler_scale.py [--workers 64,512,4096] [--modes memory,durable] [--json-out FILE]

A coordinator of 512 nodes x 8 GPUs streams results from thousands of engines into one iteration:
what the scheduler does per result batch (decide, write, commit, hand out the freed slots) must not
grow with the number of workers, or the coordinator becomes the bottleneck as the cluster grows.
This drives ``SchedulerCore`` directly (no gRPC, no other process; ``bench/scheduler.py`` measures
the whole path): ``--workers`` single-slot workers, ``--tasks-per-worker`` tasks each per iteration,
every worker sends one small group per batch, ``--iterations`` measured iterations after ``--warmup``
unmeasured ones (3: from then on each seal drops an old iteration, whose shard files new shards
overwrite, as in a long run; before that every shard is a new file, whose creation on ext4 costs
more than the rest and varies with the inodes freed lately).
Reported: microseconds of this process per result batch (``accept`` plus the tick that saves the
assignment counts, in CPU time), for each worker count; the goal is the largest count within 1.5x
of the smallest, the baseline of the same run.

And (``--gc-iterations``, ``--gc-tasks``): with that many iterations of that many tasks submitted
and held, how long a full pass of the cyclic garbage collector takes (it runs on the event loop),
and the objects it tracks and the Python heap per task.

Also (``--submit-tasks``): what submitting an iteration costs the coordinator's event loop, in CPU
milliseconds, for iterations of those many tasks with ``--prompt-tokens``-token prompts: the
request parsed and checked as ``SubmitIteration`` does, then stored and dispatched (``submit``)
to 64 connected 8-slot workers. Nothing else runs on the loop meanwhile: a big submit stalls every
stream and barrier for that long.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.benchmain import run_main  # noqa: E402

RUN = "scale"
GOAL = 1.5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(mode: str, state: pathlib.Path):
    """A coordinator core and a scheduler core on a made-up clock: (clock, database, coordinator,
    scheduler). ``state`` (a new directory) holds the durable mode's SQLite and shards."""
    from elasticrl.coordinator.core import CoordinatorCore
    from elasticrl.coordinator.persist import StateDB
    from elasticrl.scheduler.core import SchedulerCore
    from elasticrl.scheduler.store import TrajectoryStore

    durable = mode == "durable"
    if durable:
        state.mkdir()
    clock = Clock()
    db = StateDB(state / "state.db" if durable else None)
    coord = CoordinatorCore(db, lease_ttl_s=3600.0, clock=clock)
    sched = SchedulerCore(coord, TrajectoryStore(state / "trajectories" if durable else None),
                          keep_iterations=2, wall_clock=lambda: clock.now + 1.7e9)
    return clock, db, coord, sched


def measure(workers: int, mode: str, a, tmp: pathlib.Path) -> dict:
    from elasticrl.scheduler.state import GroupRecord, IterationConfig, SampleRecord, TaskSpec
    from elasticrl.scheduler.stream import Assign

    clock, db, coord, sched = scheduler(mode, tmp / f"{mode}-{workers}")
    conns = []
    for i in range(workers):
        member, _ = coord.join(RUN, f"w{i:05d}")
        conns.append(sched.connect(RUN, member.member_id, member.incarnation, slots=1, weight=1.0))
    sample = SampleRecord.pack(list(range(a.tokens)), [-0.5] * a.tokens, reward=1.0)
    cpu, batches = 0.0, 0
    try:
        for it in range(1, a.warmup + a.iterations + 1):
            specs = [TaskSpec(task_id=f"t{k}", prompt_ids=[1, 2, 3]) for k in range(workers * a.tasks_per_worker)]
            sched.submit(RUN, it, specs, IterationConfig(task_lease_s=3600.0))
            measured = it > a.warmup
            for _ in range(a.tasks_per_worker):
                for conn in conns:
                    held = []
                    while not conn.outbox.empty():
                        m = conn.outbox.get_nowait()
                        if isinstance(m, Assign):
                            held += [(i, spec.task_id) for i, spec, _, _ in m.items]
                    if not held:
                        continue
                    i, task_id = held[0]
                    group = GroupRecord(task_id=task_id, node="", policy_version=0, gen_seconds=0.1, reward_seconds=0.0, samples=[sample])
                    t0 = time.process_time()
                    sched.accept(conn, [(i, group)], f"{it}-{task_id}")
                    cpu += (time.process_time() - t0) if measured else 0.0
                    batches += measured
                clock.now += 0.05
                t0 = time.process_time()
                sched.tick()  # saves the assignment counts, as the coordinator's tick does
                cpu += (time.process_time() - t0) if measured else 0.0
            if not sched.iterations[RUN][it].sealed:
                raise RuntimeError(f"{workers} workers: iteration {it} did not seal")
    finally:
        sched.store.settle(30.0)
        db.close()
    return {"workers": workers, "state": mode, "batches": batches, "us_per_batch": round(cpu / batches * 1e6, 1)}


def submit_request(tasks: int, prompt_tokens: int):
    """A ``SubmitIterationRequest`` of ``tasks`` tasks with ``prompt_tokens``-token prompts."""
    from elasticrl._proto import scheduler_pb2 as spb

    request = spb.SubmitIterationRequest(run_id=RUN)
    for k in range(tasks):
        t = request.tasks.add(task_id=f"task-{k:07d}", num_samples=8, metadata_json='{"row": %d}' % k)
        t.prompt_ids.extend(range(1000, 1000 + prompt_tokens))
    return request


def submit(sched, data: bytes) -> None:
    """A serialized ``SubmitIterationRequest`` parsed, checked and converted as ``SubmitIteration``
    does, then submitted (what the coordinator's event loop spends on a submit)."""
    from elasticrl._proto import scheduler_pb2 as spb
    from elasticrl.scheduler.convert import task_from_pb
    from elasticrl.scheduler.state import IterationConfig

    parsed = spb.SubmitIterationRequest.FromString(data)
    sched.submit(RUN, parsed.iteration, [task_from_pb(f"tasks[{i}]", t, keep_wire=True) for i, t in enumerate(parsed.tasks)],
                 IterationConfig())


def measure_submit(tasks: int, mode: str, a, tmp: pathlib.Path) -> dict:
    _, db, coord, sched = scheduler(mode, tmp / f"submit-{mode}-{tasks}")
    for i in range(64):
        member, _ = coord.join(RUN, f"w{i:03d}")
        sched.connect(RUN, member.member_id, member.incarnation, slots=8, weight=1.0)
    request = submit_request(tasks, a.prompt_tokens)
    times = []
    try:
        for it in range(1, 4):
            request.iteration = it
            data = request.SerializeToString()
            t0 = time.process_time()
            submit(sched, data)
            times.append(time.process_time() - t0)
    finally:
        db.close()
    return {"tasks": tasks, "state": mode, "ms": round(min(times) * 1e3, 2), "us_per_task": round(min(times) / tasks * 1e6, 2)}


def measure_gc(mode: str, a, tmp: pathlib.Path) -> dict:
    """What the tasks a coordinator keeps cost its process: ``--gc-iterations`` iterations of
    ``--gc-tasks`` tasks submitted as ``SubmitIteration`` does (nothing run yet), then a full
    collection of the cyclic garbage collector, timed (best of 3; it runs on the event loop when
    it comes, stalling every stream and barrier), the objects it tracks per task and the Python
    heap per task (tracemalloc)."""
    import gc
    import tracemalloc

    _, db, coord, sched = scheduler(mode, tmp / f"gc-{mode}")
    request = submit_request(a.gc_tasks, a.prompt_tokens)
    try:
        gc.collect()
        tracked0 = len(gc.get_objects())
        tracemalloc.start()
        for it in range(1, a.gc_iterations + 1):
            request.iteration = it
            submit(sched, request.SerializeToString())
        gc.collect()
        heap = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        tracked = len(gc.get_objects()) - tracked0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - t0)
    finally:
        db.close()
        del coord, sched  # the cores hold reference cycles: collect them here, not in a later measurement
        gc.collect()
    tasks = a.gc_tasks * a.gc_iterations
    return {"state": mode, "tasks": tasks, "full_gc_ms": round(min(times) * 1e3, 1),
            "tracked_per_task": round(tracked / tasks, 2), "heap_bytes_per_task": round(heap / tasks)}


def run(a, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    held = []
    for mode in a.modes if a.gc_iterations else ():
        print(f"[bench] {mode}: {a.gc_iterations} x {a.gc_tasks} tasks held", file=sys.stderr, flush=True)
        held.append(measure_gc(mode, a, tmp))
    submits = []
    for mode in a.modes:
        for n in a.submit_tasks:
            print(f"[bench] {mode}: submit of {n} tasks", file=sys.stderr, flush=True)
            submits.append(measure_submit(n, mode, a, tmp))
    rows = []
    for mode in a.modes:
        for n in a.workers:
            print(f"[bench] {mode}: {n} workers", file=sys.stderr, flush=True)
            rows.append(measure(n, mode, a, tmp))
        base = rows[-len(a.workers)]["us_per_batch"]
        for r in rows[-len(a.workers):]:
            r["x_of_smallest"] = round(r["us_per_batch"] / base, 2)
    return {"bench": "scheduler_scale", "config": vars(a), "scale": rows, "submit": submits, "held": held}


def render(doc: dict) -> str:
    a = doc["config"]
    lines = [f"Scheduler core per result batch (one group of {a['tokens']} tokens), in-process, "
             f"{a['tasks_per_worker']} tasks per single-slot worker per iteration, {a['iterations']} measured iteration(s) after {a['warmup']}.",
             f"{'state':<8} {'workers':>8} {'batches':>8} {'us/batch':>9} {'x smallest':>10} {'goal':>14}"]
    for r in doc["scale"]:
        largest = r["workers"] == max(a["workers"])
        goal = f"<= {GOAL:g}x {'PASS' if r['x_of_smallest'] <= GOAL else 'MISS'}" if largest else "-"
        lines.append(f"{r['state']:<8} {r['workers']:>8} {r['batches']:>8} {r['us_per_batch']:>9.1f} {r['x_of_smallest']:>10.2f} {goal:>14}")
    if doc["submit"]:
        lines += ["", f"Submitting an iteration ({a['prompt_tokens']}-token prompts; CPU ms on the event loop, best of 3):",
                  f"{'state':<8} {'tasks':>8} {'ms':>9} {'us/task':>9}"]
        lines += [f"{r['state']:<8} {r['tasks']:>8} {r['ms']:>9.1f} {r['us_per_task']:>9.1f}" for r in doc["submit"]]
    if doc.get("held"):
        lines += ["", f"Tasks held ({a['gc_iterations']} submitted iterations of {a['gc_tasks']} tasks, {a['prompt_tokens']}-token prompts): "
                  "a full cyclic-GC pass (best of 3), objects it tracks and Python heap, per task:",
                  f"{'state':<8} {'tasks':>8} {'full gc ms':>10} {'tracked/task':>12} {'heap B/task':>11}"]
        lines += [f"{r['state']:<8} {r['tasks']:>8} {r['full_gc_ms']:>10.1f} {r['tracked_per_task']:>12.2f} {r['heap_bytes_per_task']:>11}"
                  for r in doc["held"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="64,512,4096", help="comma-separated worker counts (default: %(default)s)")
    p.add_argument("--modes", default="memory,durable", help="memory, durable (SQLite + shard files) (default: %(default)s)")
    p.add_argument("--tasks-per-worker", type=int, default=4, help="tasks per worker per iteration (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=2, help="measured iterations (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured iterations first (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=64, help="tokens of each result's one sample (default: %(default)s)")
    p.add_argument("--submit-tasks", default="400,10000", help="comma-separated iteration sizes, tasks, to time a submit of; empty: none (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="prompt tokens of each submitted task (default: %(default)s)")
    p.add_argument("--gc-iterations", type=int, default=8, help="submitted iterations held while a full garbage collection "
                   "is timed (8: the coordinator's default --keep-iterations); 0: skip (default: %(default)s)")
    p.add_argument("--gc-tasks", type=int, default=10000, help="tasks per held iteration (default: %(default)s)")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON here (the table then goes to stdout)")
    a = p.parse_args(argv)
    try:
        a.workers = [int(x) for x in a.workers.split(",")]
        a.submit_tasks = [int(x) for x in a.submit_tasks.split(",") if x]
        a.modes = [m for m in a.modes.split(",") if m]
    except ValueError:
        p.error(f"--workers ({a.workers!r}) and --submit-tasks ({a.submit_tasks!r}) must be comma-separated integers, e.g. 16,512")
    if any(n < 1 for n in a.workers) or any(m not in ("memory", "durable") for m in a.modes):
        p.error("--workers must be >= 1 and --modes memory and/or durable")
    if a.iterations < 1 or a.warmup < 0 or a.tasks_per_worker < 1 or a.prompt_tokens < 1 or any(n < 1 for n in a.submit_tasks):
        p.error("--iterations, --tasks-per-worker, --prompt-tokens and --submit-tasks must be >= 1, --warmup >= 0")
    if a.gc_iterations < 0 or a.gc_tasks < 1:
        p.error("--gc-iterations must be >= 0 and --gc-tasks >= 1")
    return run_main("bench/scheduler_scale.py", a.json_out, lambda tmp, cleanup: run(a, tmp, cleanup), render,
                    prefix="elasticrl-bench-scale-")


if __name__ == "__main__":
    sys.exit(main())
