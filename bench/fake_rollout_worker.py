"""A rollout worker process for the scheduler tests and benchmark: a real ``RolloutWorker`` whose
"engine" sleeps a per-node time per task and returns deterministic fake tokens.

    python bench/fake_rollout_worker.py --coordinator HOST:PORT --run RUN --member w1 \
        --task-s 0.1 [--slots 1] [--weight 1] [--tokens 16] [--events FILE] [--fail-first N]

``--events`` appends one JSON line per started and finished task (flushed at once), so a test
can tell what a worker did before it was killed. ``--fail-first N`` reports its first N tasks as
failed attempts (as if their environment raised in 2 episodes each). Exit status: 0 after SIGTERM/SIGINT (clean
stop), 3 when fenced, 4 when the coordinator stayed unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import signal
import sys
import time
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from elasticrl.errors import CoordinatorUnavailableError, FencedError  # noqa: E402
from elasticrl.scheduler.state import GroupRecord, SampleRecord, TaskFailure  # noqa: E402
from elasticrl.scheduler.worker import Assignment, RolloutWorker  # noqa: E402


def fake_tokens(task_id: str, sample: int, n: int) -> list[int]:
    """What every test expects for (task, sample): a pure function of the task id."""
    base = zlib.crc32(task_id.encode()) % 10_000
    return [base + sample * 7 + k for k in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--run", required=True)
    p.add_argument("--member", required=True)
    p.add_argument("--task-s", type=float, default=0.1, help="engine time per task, seconds")
    p.add_argument("--slots", type=int, default=1, help="tasks run at once")
    p.add_argument("--weight", type=float, default=1.0, help="static-policy share weight")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per sample")
    p.add_argument("--lease-ttl", type=float, default=0.0, help="member lease, seconds (0: coordinator default)")
    p.add_argument("--batch-bytes", type=int, default=1 << 20)
    p.add_argument("--linger", type=float, default=0.01, help="result batching delay, seconds")
    p.add_argument("--events", help="append JSON lines of task events to this file")
    p.add_argument("--fail-first", type=int, default=0, metavar="N", help="report the first N tasks as failed attempts")
    p.add_argument("--progress-every", type=float, default=0.0, metavar="S",
                   help="report progress on a running task every S seconds, as a multi-turn episode does per turn (0: never)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.member} %(levelname)s %(name)s: %(message)s")
    events = open(args.events, "a", buffering=1) if args.events else None

    def note(kind: str, a: Assignment) -> None:
        if events:
            events.write(json.dumps({"event": kind, "member": args.member, "pid": os.getpid(),
                                     "iteration": a.iteration, "task_id": a.task.task_id, "t": time.time()}) + "\n")

    failures = [0]

    def generate(a: Assignment) -> GroupRecord | TaskFailure:
        note("start", a)
        if failures[0] < args.fail_first:
            failures[0] += 1
            note("failed", a)
            return TaskFailure(a.task.task_id, f"env fake.step() raised RuntimeError: attempt {failures[0]}", env_errors=2)
        end = time.monotonic() + args.task_s
        turn = time.monotonic() + args.progress_every
        while time.monotonic() < end and not a.cancelled.is_set():
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))
            if args.progress_every and time.monotonic() >= turn:
                a.progress()
                turn += args.progress_every
        samples = [
            SampleRecord.pack(fake_tokens(a.task.task_id, j, args.tokens), [-0.5] * args.tokens,
                              reward=float(j % 2), finish_reason="length")
            for j in range(a.task.num_samples)
        ]
        note("done", a)
        return GroupRecord(a.task.task_id, args.member, 0, 0.0, 0.0, samples)

    worker = RolloutWorker(
        args.coordinator, args.run, args.member, generate, slots=args.slots, weight=args.weight,
        lease_ttl_s=args.lease_ttl, batch_bytes=args.batch_bytes, linger_s=args.linger, reconnect_timeout_s=60.0,
    )

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await worker.run(stop)
        except FencedError as exc:
            logging.error("fenced: %s (refused: %s)", exc, dict(worker.stats.refused))
            return 3
        except CoordinatorUnavailableError as exc:
            logging.error("%s", exc)
            return 4
        logging.info("stopped: %s", worker.stats)
        return 0

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
