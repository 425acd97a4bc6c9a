"""A rollout worker process for ``bench/scheduler.py``: a real ``RolloutWorker`` whose engine
takes the tasks of each assignment message together (``generate_batch``, as a node's engine does),
sleeps ``--task-s`` and returns one cached payload per task, and which times every task.

    python bench/scheduler_worker.py --coordinator HOST:PORT --run RUN --member w0 \
        --task-s 0 --slots 8 --tokens 16 --ready FILE --report FILE

Unlike ``fake_rollout_worker.py`` (deterministic tokens per task, for the tests), the samples
are built once per group size and reused, so the bench measures the scheduler's path and not the
fake engine's list building. ``--ready`` is written once the Work stream is up (the coordinator
then counts this worker in a static split); ``--report`` is written on a clean stop (SIGTERM):
per task (iteration, task id, engine start, batch sent, batch acked) as CLOCK_MONOTONIC seconds,
comparable across processes on one host, plus the worker's counters and CPU time.

The timings hook two internals of ``RolloutWorker`` (``_flush``, which turns pending groups into
one batch, and ``_acked``, the event set once per acknowledged batch; acks come in batch order);
if those change, the report says ``timed: false`` and the bench leaves the latencies out.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import json
import logging
import os
import pathlib
import resource
import signal
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from elasticrl.coordinator import malloc  # noqa: E402
from elasticrl.errors import CoordinatorUnavailableError, FencedError  # noqa: E402
from elasticrl.scheduler.state import GroupRecord, SampleRecord  # noqa: E402
from elasticrl.scheduler.worker import Assignment, RolloutWorker  # noqa: E402


class _AckClock(asyncio.Event):
    """``RolloutWorker._acked`` that also stamps the oldest unacknowledged batch's tasks."""

    def __init__(self, worker: "TimedWorker"):
        super().__init__()
        self._worker = worker

    def set(self) -> None:
        self._worker.on_ack(time.monotonic())
        super().set()


class TimedWorker(RolloutWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timed = hasattr(self, "_pending") and isinstance(getattr(self, "_acked", None), asyncio.Event)
        self.started: dict[tuple[int, str], float] = {}  # written by engine threads
        self.started_lock = threading.Lock()
        self.in_flight: collections.deque = collections.deque()  # (sent at, [(iteration, task id)])
        self.records: list[tuple[int, str, float, float, float]] = []
        self.batch_groups: list[int] = []
        self.first_send: float | None = None
        self.last_ack: float | None = None
        if self.timed:
            self._acked = _AckClock(self)

    def _flush(self) -> None:
        keys = [(iteration, g.task_id) for iteration, g in getattr(self, "_pending", ())]
        super()._flush()
        if keys and self.timed:
            now = time.monotonic()
            if self.first_send is None:
                self.first_send = now
            self.in_flight.append((now, keys))
            self.batch_groups.append(len(keys))

    def on_ack(self, now: float) -> None:
        self.last_ack = now
        if not self.in_flight:
            return
        sent, keys = self.in_flight.popleft()
        with self.started_lock:
            starts = [self.started.pop(k, sent) for k in keys]
        self.records.extend((it, tid, start, sent, now) for (it, tid), start in zip(keys, starts))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/scheduler_worker.py", description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--run", required=True, help="run id to join")
    p.add_argument("--member", required=True, help="member id")
    p.add_argument("--task-s", type=float, default=0.0, help="engine time per task, seconds (default: %(default)s)")
    p.add_argument("--slots", type=int, default=1, help="tasks run at once (default: %(default)s)")
    p.add_argument("--weight", type=float, default=1.0, help="static-policy share weight (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per sample; a group has the task's num_samples samples (default: %(default)s)")
    p.add_argument("--batch-bytes", type=int, default=1 << 20, help="result batch size, bytes of sample payload (default: %(default)s)")
    p.add_argument("--linger-s", type=float, default=0.01, help="result batching delay, seconds (default: %(default)s, RolloutWorker's)")
    p.add_argument("--ready", help="write this file once the Work stream is up")
    p.add_argument("--report", help="write the JSON report here on a clean stop")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    malloc.tune_sender(args.batch_bytes)  # as a node's EngineWorker does
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.member} %(levelname)s %(name)s: %(message)s")
    cache: dict[int, list[SampleRecord]] = {}

    def samples(n: int) -> list[SampleRecord]:
        if n not in cache:  # one payload per group size; bytes are immutable, so sharing is safe
            ids = array.array("i", range(1000, 1000 + args.tokens)).tobytes()
            lps = array.array("f", [-0.5] * args.tokens).tobytes()
            cache[n] = [SampleRecord(ids, lps, reward=float(j % 2), finish_reason="length") for j in range(n)]
        return cache[n]

    def generate_batch(batch: list[Assignment]) -> list[GroupRecord]:
        # The tasks of one assignment message at once, as a node's engine takes them
        # (train/rollout_link.py): one hand-off to the engine thread per message, not per task.
        started = time.monotonic()
        with worker.started_lock:
            for a in batch:
                worker.started[(a.iteration, a.task.task_id)] = started
        if args.task_s > 0:
            end = started + args.task_s
            while (left := end - time.monotonic()) > 0 and not all(a.cancelled.is_set() for a in batch):
                time.sleep(min(0.01, left))
        return [GroupRecord(a.task.task_id, args.member, 0, args.task_s, 0.0, samples(a.task.num_samples)) for a in batch]

    worker = TimedWorker(
        args.coordinator, args.run, args.member, None, generate_batch=generate_batch, slots=args.slots, weight=args.weight,
        batch_bytes=args.batch_bytes, linger_s=args.linger_s, reconnect_timeout_s=30.0,
    )

    async def announce_ready() -> None:
        while getattr(worker, "_outbox", None) is None:  # set while a Work stream is up
            await asyncio.sleep(0.01)
        tmp = f"{args.ready}.tmp"
        pathlib.Path(tmp).write_text(f"{time.monotonic()}\n")
        os.replace(tmp, args.ready)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready = asyncio.create_task(announce_ready()) if args.ready else None
        try:
            await worker.run(stop)
        except FencedError as exc:
            logging.error("fenced: %s", exc)
            return 3
        except CoordinatorUnavailableError as exc:
            logging.error("%s", exc)
            return 4
        finally:
            if ready is not None:
                ready.cancel()
        return 0

    rc = asyncio.run(run())
    if args.report:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        s = worker.stats
        report = {
            "member": args.member, "rc": rc, "timed": worker.timed, "cpu_s": usage.ru_utime + usage.ru_stime,
            "completed": s.completed, "accepted": s.accepted, "refused": dict(s.refused), "cancelled": s.cancelled,
            "batches_sent": s.batches_sent, "bytes_sent": s.bytes_sent, "reconnects": s.reconnects,
            "first_send": worker.first_send, "last_ack": worker.last_ack, "batch_groups": worker.batch_groups,
            "records": worker.records,
        }
        tmp = f"{args.report}.tmp"
        pathlib.Path(tmp).write_text(json.dumps(report))
        os.replace(tmp, args.report)
    return rc


if __name__ == "__main__":
    sys.exit(main())
