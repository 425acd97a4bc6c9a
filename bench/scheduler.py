"""Rollout scheduler throughput, trajectory streaming and makespan, each against a baseline.

Three sections, all in one run on this host, every process a real subprocess (coordinator,
rollout workers, the raw-gRPC baseline):

* ``roundtrip``: task round trips through one coordinator. ``--rt-workers`` worker processes
  (``bench/scheduler_worker.py``: a real ``RolloutWorker``) with ``--rt-slots`` slots each run
  ``--rt-tasks`` tasks whose engine takes no time and returns a tiny group. Tasks per second =
  tasks / (submit call -> WaitSealed returns, at the driver). Per-task latency = engine start at
  the worker (the assignment has arrived) -> the worker receives the ack of the batch holding
  its result (stored by the coordinator); it includes the worker's result linger
  (``--linger-s``). No baseline process here: the coordinator's CPU per task is reported
  instead, as it bounds the rate.
* ``stream``: trajectory bytes per second. One worker streams ``--stream-groups`` big groups
  (``--stream-samples`` x ``--stream-tokens`` tokens: int32 ids + float32 logprobs) through its
  Work stream into a coordinator (in memory and with ``--state-dir``), measured from the first
  result batch sent to the seal seen by the driver, after ``--stream-warmup`` unmeasured
  iterations (until the coordinator recycles an old iteration's memory and, with
  ``--stream-keep-iterations 2``, its shard files at every seal, as for the rest of a long run).
  After each iteration the bench waits 0.2 s, so that what the coordinator's ticks do after the
  seal (drop the iteration it made too old) counts in its CPU and shares no core with the next
  path's round.
  Baseline, measured in the same run: the same serialized WorkRequest messages (same size,
  batch id included, same groups per message) over one grpc.aio bidi stream to a generic handler
  with identity (de)serializers in another process (``bench/scheduler_raw.py``): received as
  bytes like the coordinator's Work stream, nothing parsed, nothing stored, one small ack per
  message, no slots bounding what is in flight; first send -> last ack. Same server and channel
  options (the coordinator's) on both.
* ``submit``: how long a big submit holds the coordinator's event loop. A thread renews a lease
  (``KeepAlive``, a unary call) every 2 ms while the driver submits ``--submit-repeats`` iterations
  of ``--submit-tasks`` tasks with ``--submit-prompt-tokens``-token prompts (no worker takes them);
  reported: the submit call's time and the keep-alives' latency (p50, max) while it runs, against
  the same keep-alives just before it (the baseline: the loop idle). No goal: a call that waits
  behind a submit waits for all of the loop's work on it.
* ``makespan``: one iteration of ``--ms-tasks`` tasks on 3 single-slot workers of speed 1x,
  2x, 4x (task time ``--ms-base-s`` / speed), under static with equal weights, static with the
  right weights, dynamic (no weights) and dynamic with ``--ms-backup-tasks`` backups; makespan is
  the coordinator's submit -> seal time (manifest ``elapsed_s``), against the ideal = tasks x
  base / sum(speeds). Median of ``--ms-repeats`` iterations per configuration.

    python bench/scheduler.py                                   # everything, ~1-2 min on 2 cores
    python bench/scheduler.py --sections stream --modes memory --json-out /tmp/sched.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RAW = BENCH_DIR / "scheduler_raw.py"
sys.path.insert(0, str(REPO))

from bench.benchmain import run_main  # noqa: E402
from bench.scheduler_procs import (  # noqa: E402
    BenchError,
    Coordinator,
    WorkerSet,
    child_env,
    log,
    process_cpu_s,
    process_rss_mb,
    run_iteration,
    stop_process,
    tail,
    tasks,
)

SECTIONS = ("roundtrip", "stream", "submit", "makespan")
MS_CONFIGS = ("static-equal", "static-weighted", "dynamic", "dynamic-backup")
# Goals from the issue: streaming at least this fraction of raw gRPC; dynamic makespan within
# this factor of the ideal with no weights given.
STREAM_GOAL = 0.5
# After each coordinator iteration: several of the coordinator's ticks (--tick, 50 ms by default).
SETTLE_S = 0.2
MAKESPAN_GOAL = 1.15
MB = 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/scheduler.py", description=__doc__.split("\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections to run (default: %(default)s)")
    p.add_argument("--modes", default="memory,durable", help="coordinator state for roundtrip and stream: memory, durable (SQLite + shard files under --state-dir) (default: %(default)s)")
    p.add_argument("--state-dir", help="parent directory for durable state, to bench a given filesystem (default: a temporary directory)")
    p.add_argument("--linger-s", type=float, default=0.01, help="workers' result batching delay, seconds (default: %(default)s, RolloutWorker's default)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up on any one iteration, process start or stop after this long, seconds (default: %(default)s)")
    g = p.add_argument_group("roundtrip")
    g.add_argument("--rt-tasks", type=int, default=2000, help="tasks in the measured iteration (default: %(default)s)")
    g.add_argument("--rt-warmup-tasks", type=int, default=200, help="tasks in an unmeasured iteration first (default: %(default)s)")
    g.add_argument("--rt-workers", type=int, default=4, help="worker processes (default: %(default)s)")
    g.add_argument("--rt-slots", type=int, default=8, help="slots (tasks at once) per worker (default: %(default)s)")
    g.add_argument("--rt-tokens", type=int, default=16, help="completion tokens of each task's single sample (default: %(default)s)")
    g = p.add_argument_group("stream")
    g.add_argument("--stream-groups", type=int, default=400, help="groups (tasks) per measured iteration (default: %(default)s)")
    g.add_argument("--stream-samples", type=int, default=8, help="samples per group (default: %(default)s)")
    g.add_argument("--stream-tokens", type=int, default=4096, help="completion tokens per sample; 8 bytes each on the wire (default: %(default)s)")
    g.add_argument("--stream-slots", type=int, default=8, help="slots of the streaming worker (default: %(default)s)")
    g.add_argument("--stream-batch-bytes", type=int, default=1 << 20, help="worker result batch size, bytes of sample payload; the baseline sends the same groups per message (default: %(default)s)")
    g.add_argument("--stream-keep-iterations", type=int, default=2, help="the stream coordinators' --keep-iterations: with 2 "
                   "(the least allowed) every seal from the third iteration on deletes an old iteration's shards, as in a long "
                   "run, so the measured iterations write into recycled page cache; the coordinator's default, 8, never drops "
                   "one within a bench run (default: %(default)s)")
    g.add_argument("--raw-malloc", choices=("tuned", "default"), default="tuned", help="the raw sink's allocator: tuned as the "
                   "coordinator's process tunes it (coordinator/malloc.py), or glibc's defaults (the baseline before that tuning) (default: %(default)s)")
    g.add_argument("--stream-pin", action="store_true", help="pin every receiving server (raw sink, coordinator) to CPU 0 and its "
                   "sender (raw sender, worker) to CPU 1, all their threads: what a receiver sustains on one core of its own, as on "
                   "separate hosts, instead of two processes sharing the host's cores (needs 2 CPUs)")
    g.add_argument("--stream-repeats", type=int, default=5, help="measured iterations (and raw streams) per mode, after the warm-up; the median is reported (default: %(default)s)")
    g.add_argument("--stream-warmup", type=int, default=3, help="unmeasured iterations (and raw streams) per mode first: 3 is until a "
                   "coordinator frees an old iteration's trajectories at each seal (it keeps the newest 2), as it does for the rest of a "
                   "run; before that its memory and page cache only grow, which costs a fresh VM first-touch page faults (default: %(default)s)")
    g = p.add_argument_group("submit")
    g.add_argument("--submit-tasks", type=int, default=10000, help="tasks per submitted iteration (default: %(default)s)")
    g.add_argument("--submit-prompt-tokens", type=int, default=200, help="prompt tokens of each task (default: %(default)s)")
    g.add_argument("--submit-repeats", type=int, default=3, help="iterations submitted per mode (default: %(default)s)")
    g = p.add_argument_group("makespan")
    g.add_argument("--ms-tasks", type=int, default=70, help="tasks per iteration (default: %(default)s)")
    g.add_argument("--ms-base-s", type=float, default=0.2, help="task time on the 1x worker, seconds (default: %(default)s)")
    g.add_argument("--ms-speeds", default="1,2,4", help="comma-separated worker speeds, one single-slot worker each (default: %(default)s)")
    g.add_argument("--ms-configs", default=",".join(MS_CONFIGS), help="comma-separated configurations (default: %(default)s)")
    g.add_argument("--ms-backup-tasks", type=int, default=2, help="backup copies in dynamic-backup (default: %(default)s)")
    g.add_argument("--ms-repeats", type=int, default=3, help="iterations per configuration; the median is reported (default: %(default)s)")
    p.add_argument("--profile", metavar="DIR", help="py-spy each coordinator over the measured stream repeats: "
                   "DIR/stream-<mode>.collapsed.txt (speedscope opens it), DIR/stream-<mode>.top.txt, and the top functions in the JSON (profile{})")
    p.add_argument("--profile-worker", action="store_true", help="with --profile: py-spy the streaming worker too "
                   "(DIR/stream-<mode>-worker.*); a second sampler on the same cores slows every path a little")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON document here (the tables then go to stdout); default: JSON on stdout, tables on stderr")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.ms_configs = [c.strip() for c in a.ms_configs.split(",") if c.strip()]
    if not a.sections or not set(a.sections) <= set(SECTIONS):
        parser.error(f"--sections: {a.sections} may only name {', '.join(SECTIONS)}")
    if not a.modes or not set(a.modes) <= {"memory", "durable"}:
        parser.error(f"--modes: {a.modes} may only name memory and durable")
    if not set(a.ms_configs) <= set(MS_CONFIGS):
        parser.error(f"--ms-configs: {a.ms_configs} may only name {', '.join(MS_CONFIGS)}")
    try:
        a.ms_speeds = [float(x) for x in a.ms_speeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--ms-speeds: {a.ms_speeds!r} must be comma-separated numbers, e.g. 1,2,4")
    if not a.ms_speeds or min(a.ms_speeds) <= 0:
        parser.error(f"--ms-speeds: {a.ms_speeds} needs at least one speed, all > 0")
    for name in ("rt_tasks", "rt_workers", "rt_slots", "rt_tokens", "stream_groups", "stream_samples", "stream_tokens",
                 "stream_slots", "stream_repeats", "ms_tasks", "ms_repeats", "submit_tasks", "submit_prompt_tokens", "submit_repeats"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: {getattr(a, name)} must be >= 1")
    group_bytes = a.stream_samples * a.stream_tokens * 8
    if not group_bytes <= a.stream_batch_bytes < (64 << 20):
        parser.error(f"--stream-batch-bytes: {a.stream_batch_bytes} must hold one group ({group_bytes} B) and stay below the 64 MiB message limit")
    if a.stream_pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("--stream-pin: needs 2 CPUs, this process may use " + str(len(os.sched_getaffinity(0))))
    if a.stream_warmup < 0:
        parser.error(f"--stream-warmup: {a.stream_warmup} must be >= 0")
    if a.stream_keep_iterations < 2:
        parser.error(f"--stream-keep-iterations: {a.stream_keep_iterations} must be >= 2 (trainers fetch the newest two)")
    if a.profile_worker and not a.profile:
        parser.error("--profile-worker needs --profile DIR (where the profiles go)")
    if a.rt_warmup_tasks < 0 or a.ms_backup_tasks < 0 or a.ms_base_s <= 0 or a.linger_s < 0:
        parser.error("--rt-warmup-tasks and --ms-backup-tasks must be >= 0, --ms-base-s > 0, --linger-s >= 0")
    return a


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


RECEIVER_CPU, SENDER_CPU = 0, 1


def pin(pid: int, cpu: int) -> None:
    """``--stream-pin``: every thread of ``pid`` on ``cpu`` (threads it starts later inherit it)."""
    target = {sorted(os.sched_getaffinity(0))[cpu]}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), target)


class RawStream:
    """The streaming baseline: a ``scheduler_raw.py`` sink and a sender driven over stdin, so its
    streams can be interleaved with the coordinator's iterations."""

    def __init__(self, bench: "Bench", d: pathlib.Path):
        from elasticrl.coordinator.launch import CoordinatorStartError, wait_for_port

        a = self.a = bench.a
        d.mkdir(parents=True)
        self.log_path = d / "raw.log"
        group_bytes = a.stream_samples * a.stream_tokens * 8
        self.batch_groups = max(1, -(-a.stream_batch_bytes // group_bytes))  # the worker flushes at >= batch_bytes
        self.rows: list[dict] = []
        self.sender: subprocess.Popen | None = None
        with open(self.log_path, "ab") as f:
            env = {**child_env(), "ELASTICRL_MALLOC_TUNE": "1" if a.raw_malloc == "tuned" else "0"}
            self.sink = subprocess.Popen([sys.executable, str(RAW), "serve", "--port-file", str(d / "port")],
                                         stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            port = wait_for_port(self.sink, d / "port", timeout_s=a.timeout_s, log_path=self.log_path)
            cmd = [sys.executable, str(RAW), "send", "--address", f"127.0.0.1:{port}", "--groups", str(a.stream_groups),
                   "--samples", str(a.stream_samples), "--tokens", str(a.stream_tokens), "--batch-groups", str(self.batch_groups),
                   "--on-stdin", "--timeout-s", str(a.timeout_s)]
            with open(self.log_path, "ab") as f:
                self.sender = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, cwd=REPO, env=child_env(), text=True)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, CoordinatorStartError):
                raise BenchError(f"raw sink: {exc}") from None
            raise
        if a.stream_pin:
            pin(self.sink.pid, RECEIVER_CPU)
            pin(self.sender.pid, SENDER_CPU)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.sender.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def round(self, rep: int) -> None:
        cpu0, sender_cpu0 = process_cpu_s(self.sink.pid), process_cpu_s(self.sender.pid)
        try:
            self.sender.stdin.write("go\n")
            self.sender.stdin.flush()
            line = self._lines.get(timeout=self.a.timeout_s)
        except (BrokenPipeError, queue.Empty):
            line = None
        if line is None:
            raise BenchError(f"raw sender: no result for stream {rep}:\n{tail(self.log_path)}")
        msg = json.loads(line)
        if rep >= self.a.stream_warmup:
            self.rows.append({**msg, "seconds": msg["last_ack"] - msg["first_send"], "sink_cpu_s": process_cpu_s(self.sink.pid) - cpu0,
                              "sender_cpu_s": process_cpu_s(self.sender.pid) - sender_cpu0})

    def result(self) -> dict:
        payload = self.rows[0]["payload_bytes"]
        med = statistics.median(r["seconds"] for r in self.rows)
        rss, peak = process_rss_mb(self.sink.pid)
        return {
            "path": "raw grpc.aio", "state": "-", "server_rss_mb": rss, "server_peak_rss_mb": peak, "payload_bytes": payload, "wire_bytes": self.rows[0]["wire_bytes"],
            "repeats": len(self.rows), "first_send_to_seal_s": round(med, 4), "submit_to_seal_s": None,
            "mb_per_s": round(payload / med / MB, 1), "mb_per_s_submit_to_seal": None,
            "server_cpu_s_per_gb": round(statistics.median(r["sink_cpu_s"] for r in self.rows) / (payload / 1e9), 2),
            "client_cpu_s_per_gb": round(statistics.median(r["sender_cpu_s"] for r in self.rows) / (payload / 1e9), 2),
            "groups_per_batch_mean": self.batch_groups,
            "per_repeat_mb_per_s": [round(payload / r["seconds"] / MB, 1) for r in self.rows],
        }

    def stop(self) -> None:
        if self.sender is not None:
            with contextlib.suppress(OSError):
                self.sender.stdin.close()  # EOF: the sender exits
            stop_process(self.sender, timeout_s=5.0)
        stop_process(self.sink)


class CoordinatorStream:
    """One coordinator (in memory or durable) and one streaming worker; an iteration per ``round``."""

    def __init__(self, bench: "Bench", mode: str):
        a = self.a = bench.a
        self.mode, self.run, self.rounds = mode, f"stream-{mode}", []
        self.bench_profiler = bench.profiler
        self.coord = bench.coordinator(self.run, mode, ["--keep-iterations", str(a.stream_keep_iterations)])
        self.client = bench.client(self.coord.address)
        spec = dict(member="s0", task_s=0, slots=a.stream_slots, tokens=a.stream_tokens, batch_bytes=a.stream_batch_bytes, linger_s=a.linger_s)
        try:
            self.workers = WorkerSet(bench.tmp / self.run, self.client, self.coord.address, self.run, [spec], a.timeout_s).__enter__()
        except BaseException:
            self.coord.stop()
            raise
        self.worker_pid = self.workers.workers[0].proc.pid
        if a.stream_pin:
            pin(self.coord.proc.pid, RECEIVER_CPU)
            pin(self.worker_pid, SENDER_CPU)
        self.profiling: list = []

    def round(self, rep: int) -> None:
        a, it = self.a, rep + 1
        if rep == a.stream_warmup and self.bench_profiler is not None:  # the measured repeats, not the warm-up
            self.profiling.append(self.bench_profiler.attach(self.coord.proc.pid, f"stream-{self.mode}").__enter__())
            if a.profile_worker:
                self.profiling.append(self.bench_profiler.attach(self.worker_pid, f"stream-{self.mode}-worker").__enter__())
        cpu0, worker_cpu0 = self.coord.cpu_s(), process_cpu_s(self.worker_pid)
        manifest, t0, t1 = run_iteration(self.client, self.run, it, tasks(f"i{it}-", a.stream_groups, a.stream_samples), a.timeout_s)
        if manifest["tasks_done"] != a.stream_groups:
            raise BenchError(f"stream {self.mode}: {manifest['tasks_done']}/{a.stream_groups} groups done: {manifest['seal_reason']}")
        # What the coordinator's next ticks do for this seal (dropping the iteration it made too
        # old) is the iteration's cost too: let them run before reading its CPU, and before the
        # next path's round starts, which would share the cores with them.
        time.sleep(SETTLE_S)
        if rep >= a.stream_warmup:
            self.rounds.append({"iteration": it, "submit": t0, "seal": t1, "coordinator_cpu_s": self.coord.cpu_s() - cpu0,
                                "worker_cpu_s": process_cpu_s(self.worker_pid) - worker_cpu0})

    def result(self) -> dict:
        a = self.a
        for recording in self.profiling:
            recording.__exit__(None, None, None)
        self.profiling = []
        rss, peak = process_rss_mb(self.coord.proc.pid)
        (report,) = self.workers.stop()
        if not report or not report["timed"]:
            raise BenchError(f"stream {self.mode}: the worker's report has no timings")
        payload = a.stream_groups * a.stream_samples * a.stream_tokens * 8
        rows = []
        for r in self.rounds:
            first = min(x[3] for x in report["records"] if x[0] == r["iteration"])
            rows.append({"first_send_to_seal_s": r["seal"] - first, "submit_to_seal_s": r["seal"] - r["submit"],
                         "coordinator_cpu_s": r["coordinator_cpu_s"], "worker_cpu_s": r["worker_cpu_s"]})
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        batches = report["batch_groups"]
        return {
            "path": "coordinator", "state": self.mode, "payload_bytes": payload, "repeats": len(rows),
            "first_send_to_seal_s": round(med["first_send_to_seal_s"], 4), "submit_to_seal_s": round(med["submit_to_seal_s"], 4),
            "mb_per_s": round(payload / med["first_send_to_seal_s"] / MB, 1),
            "mb_per_s_submit_to_seal": round(payload / med["submit_to_seal_s"] / MB, 1),
            "server_cpu_s_per_gb": round(med["coordinator_cpu_s"] / (payload / 1e9), 2),
            "groups_per_batch_mean": round(sum(batches) / len(batches), 2) if batches else None,
            "client_cpu_s_per_gb": round(med["worker_cpu_s"] / (payload / 1e9), 2),
            "per_repeat_mb_per_s": [round(payload / row["first_send_to_seal_s"] / MB, 1) for row in rows],
            "server_rss_mb": rss, "server_peak_rss_mb": peak,
        }

    def stop(self) -> None:
        self.workers.stop()
        self.coord.stop()


# -- sections --------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: pathlib.Path, cleanup: contextlib.ExitStack):
        self.a, self.tmp, self.cleanup = args, tmp, cleanup
        self.state_root = pathlib.Path(args.state_dir) if args.state_dir else tmp
        self.profiler = None
        if args.profile:
            from bench.profiling import Profiler

            self.profiler = Profiler(args.profile)

    def coordinator(self, label: str, mode: str, extra_args: list[str] | None = None) -> Coordinator:
        state = None
        if mode == "durable":
            state = pathlib.Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.state_root))
            self.cleanup.callback(shutil.rmtree, state, True)
        return Coordinator(self.tmp, label, state, self.cleanup, extra_args=extra_args)

    def client(self, address: str):
        from elasticrl.scheduler.client import SchedulerClient

        client = SchedulerClient(address, call_timeout_s=30.0, reconnect_timeout_s=10.0)
        self.cleanup.callback(client.close)
        return client

    def roundtrip(self, mode: str) -> dict:
        a = self.a
        coord = self.coordinator(f"rt-{mode}", mode)
        client, run = self.client(coord.address), f"rt-{mode}"
        specs = [dict(member=f"w{i}", task_s=0, slots=a.rt_slots, tokens=a.rt_tokens, linger_s=a.linger_s) for i in range(a.rt_workers)]
        try:
            with WorkerSet(self.tmp / run, client, coord.address, run, specs, a.timeout_s) as ws:
                if a.rt_warmup_tasks:
                    run_iteration(client, run, 1, tasks("w", a.rt_warmup_tasks, 1), a.timeout_s)
                cpu0 = coord.cpu_s()
                manifest, t0, t1 = run_iteration(client, run, 2, tasks("t", a.rt_tasks, 1), a.timeout_s)
                cpu = coord.cpu_s() - cpu0
                reports = ws.stop()
        finally:
            coord.stop()
        if manifest["tasks_done"] != a.rt_tasks:
            raise BenchError(f"roundtrip {mode}: {manifest['tasks_done']}/{a.rt_tasks} tasks done: {manifest['seal_reason']}")
        records = [r for rep in reports if rep and rep["timed"] for r in rep["records"] if r[0] == 2]
        lat = [r[4] - r[2] for r in records]
        wire_lat = [r[4] - r[3] for r in records]
        ms = lambda x: round(x * 1000, 2)  # noqa: E731
        return {
            "state": mode, "tasks": a.rt_tasks, "workers": a.rt_workers, "slots": a.rt_slots,
            "submit_to_seal_s": round(t1 - t0, 3), "server_elapsed_s": round(manifest["elapsed_s"], 3),
            "tasks_per_s": round(a.rt_tasks / (t1 - t0), 1),
            "latency_samples": len(lat),
            "latency_p50_ms": ms(percentile(lat, 0.5)) if lat else None,
            "latency_p99_ms": ms(percentile(lat, 0.99)) if lat else None,
            "sent_to_ack_p50_ms": ms(percentile(wire_lat, 0.5)) if wire_lat else None,
            "coordinator_cpu_ms_per_task": round(cpu / a.rt_tasks * 1000, 3),
            "coordinator_cpu_s": round(cpu, 2),
            "done_per_node": {n["node"]: n["done"] for n in manifest["nodes"]},
        }

    def stream(self) -> list[dict]:
        """Raw baseline and one coordinator per mode, all up at once; every repeat runs each path
        once, back to back, so all of them see the same load on this (shared) host."""
        a = self.a
        paths: list = []
        try:
            paths.append(RawStream(self, self.tmp / "raw"))
            for mode in a.modes:
                paths.append(CoordinatorStream(self, mode))
            for rep in range(a.stream_warmup + a.stream_repeats):  # the first ones warm up
                for path in paths:
                    path.round(rep)
            return [path.result() for path in paths]
        finally:
            for path in reversed(paths):
                path.stop()

    def submit(self, mode: str) -> dict:
        from elasticrl.scheduler.state import TaskSpec

        a = self.a
        run = f"submit-{mode}"
        coord = self.coordinator(run, mode)
        client, probe = self.client(coord.address), self.client(coord.address)
        prompt = list(range(1000, 1000 + a.submit_prompt_tokens))
        specs = [TaskSpec(task_id=f"t{k:07d}", prompt_ids=prompt, num_samples=8) for k in range(a.submit_tasks)]
        lat: list[tuple[float, float]] = []  # (sent, latency), monotonic seconds
        stop = threading.Event()
        incarnation = probe.join(run, "probe").incarnation

        def keep_alive() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                probe.keep_alive(run, "probe", incarnation)
                lat.append((sent, time.monotonic() - sent))
                stop.wait(0.002)

        thread = threading.Thread(target=keep_alive, name="submit-probe", daemon=True)
        rows = []
        try:
            thread.start()
            for it in range(1, a.submit_repeats + 1):
                time.sleep(0.3)
                t0 = time.monotonic()
                client.submit_iteration(run, it, specs)
                t1 = time.monotonic()
                time.sleep(0.1)  # a keep-alive sent just before the end may still wait
                idle = [x for sent, x in lat if t0 - 0.3 <= sent and sent + x < t0]
                busy = [x for sent, x in lat if sent < t1 and sent + x > t0]  # in flight during the submit
                rows.append({"submit_ms": (t1 - t0) * 1000, "busy": busy, "idle": idle})
        finally:
            stop.set()
            thread.join(10)
            coord.stop()
        ms = lambda xs, q: round(percentile(xs, q) * 1000, 2) if xs else None  # noqa: E731
        mid = sorted(rows, key=lambda r: r["submit_ms"])[(len(rows) - 1) // 2]
        return {
            "state": mode, "tasks": a.submit_tasks, "prompt_tokens": a.submit_prompt_tokens, "repeats": len(rows),
            "submit_ms": round(mid["submit_ms"], 1), "per_repeat_submit_ms": [round(r["submit_ms"], 1) for r in rows],
            "keep_alive_p50_ms": ms([x for r in rows for x in r["busy"]], 0.5),
            "keep_alive_max_ms": ms([x for r in rows for x in r["busy"]], 1.0),
            "per_repeat_keep_alive_max_ms": [ms(r["busy"], 1.0) for r in rows],
            "idle_keep_alive_p50_ms": ms([x for r in rows for x in r["idle"]], 0.5),
            "idle_keep_alive_max_ms": ms([x for r in rows for x in r["idle"]], 1.0),
        }

    def makespan(self, coord: Coordinator, client, config: str) -> dict:
        a = self.a
        run = f"ms-{config}"
        weighted = config == "static-weighted"
        policy = "static" if config.startswith("static") else "dynamic"
        backup = a.ms_backup_tasks if config == "dynamic-backup" else 0
        names = [f"x{s:g}" for s in a.ms_speeds]
        specs = [dict(member=n, task_s=a.ms_base_s / s, slots=1, weight=s if weighted else 1.0, tokens=16, linger_s=a.linger_s)
                 for n, s in zip(names, a.ms_speeds)]
        ideal = a.ms_tasks * a.ms_base_s / sum(a.ms_speeds)
        reps = []
        with WorkerSet(self.tmp / run, client, coord.address, run, specs, a.timeout_s):
            for it in range(1, a.ms_repeats + 1):
                manifest, t0, t1 = run_iteration(client, run, it, tasks(f"i{it}-", a.ms_tasks, 1), a.timeout_s,
                                                 policy=policy, backup_tasks=backup)
                done = {n["node"]: n["done"] for n in manifest["nodes"]}
                assigned = {n["node"]: n["assigned"] for n in manifest["nodes"]}
                if policy == "static" and sum(1 for n in names if assigned.get(n, 0) > 0) < len(names):
                    raise BenchError(f"{config}: the static split left a worker out (assigned {assigned}); were all streams up?")
                reps.append({"makespan_s": manifest["elapsed_s"], "driver_s": t1 - t0, "done": [done.get(n, 0) for n in names],
                             "backups_issued": manifest["backups_issued"], "refused_duplicate": manifest["refused_duplicate"]})
        mid = sorted(reps, key=lambda r: r["makespan_s"])[(len(reps) - 1) // 2]  # median (lower middle)
        goal = None
        if policy == "dynamic":
            ratio = mid["makespan_s"] / ideal
            goal = {"metric": "makespan / ideal", "at_most": MAKESPAN_GOAL, "status": "PASS" if ratio <= MAKESPAN_GOAL else "MISS"}
        return {
            "config": config, "policy": policy, "weights": [s if weighted else 1.0 for s in a.ms_speeds], "backup_tasks": backup,
            "ideal_s": round(ideal, 3), "makespan_s": round(mid["makespan_s"], 3), "ratio": round(mid["makespan_s"] / ideal, 3),
            "driver_submit_to_seal_s": round(mid["driver_s"], 3), "done_per_node": dict(zip(names, mid["done"])),
            "backups_issued": mid["backups_issued"], "refused_duplicate": mid["refused_duplicate"],
            "per_repeat_makespan_s": [round(r["makespan_s"], 3) for r in reps], "goal": goal,
        }


# -- report ----------------------------------------------------------------------------------


def render(doc: dict) -> str:
    a, host = doc["config"], doc["host"]
    load = f"{host['loadavg_start'][0]:.1f}/{host.get('loadavg_end', [float('nan')])[0]:.1f}"
    out = [f"Host: {host['cpus']} CPUs, load average {load} at start/end, Python {host['python']}, grpcio {host['grpcio']}. "
           f"Worker result linger {a['linger_s'] * 1000:g} ms."]
    if doc.get("roundtrip"):
        out += ["", f"Task round trips: {a['rt_tasks']} tasks (1 sample x {a['rt_tokens']} tokens, engine time 0), "
                    f"{a['rt_workers']} worker processes x {a['rt_slots']} slots, one coordinator.",
                "latency = engine start at the worker -> ack of its result batch back at the worker (includes the linger).",
                f"{'state':<8} {'tasks':>6} {'submit->seal s':>14} {'tasks/s':>9} {'lat p50 ms':>10} {'lat p99 ms':>10} "
                f"{'sent->ack p50':>13} {'coord cpu ms/task':>17}"]
        for r in doc["roundtrip"]:
            f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            out.append(f"{r['state']:<8} {r['tasks']:>6} {r['submit_to_seal_s']:>14.3f} {r['tasks_per_s']:>9.1f} "
                       f"{f(r['latency_p50_ms']):>10} {f(r['latency_p99_ms']):>10} {f(r['sent_to_ack_p50_ms']):>13} "
                       f"{r['coordinator_cpu_ms_per_task']:>17.3f}")
    if doc.get("stream"):
        s = doc["stream"]
        raw = next((r for r in s if r["path"].startswith("raw")), None)
        gb = a["stream_samples"] * a["stream_tokens"] * 8
        out += ["", f"Trajectory streaming: {a['stream_groups']} groups of {a['stream_samples']} samples x {a['stream_tokens']} tokens "
                    f"({gb / 1024:g} KiB/group, {a['stream_groups'] * gb / MB:.1f} MB), one worker, {a['stream_slots']} slots, "
                    f"batches of {a['stream_batch_bytes'] / 1024:g} KiB; median of {a['stream_repeats']} after {a['stream_warmup']} unmeasured.",
                "MB/s = sample payload (1e6 B) / (first batch sent -> seal seen by the driver); raw: first send -> last ack.",
                "raw = the same serialized WorkRequest messages to a generic grpc.aio handler with identity (de)serializers: "
                "nothing parsed, nothing stored, no slots bounding what is in flight (an upper bound); its allocator "
                + ("tuned as the coordinator's (coordinator/malloc.py)." if a.get("raw_malloc", "tuned") == "tuned"
                   else "at glibc's defaults (--raw-malloc default), the coordinator's tuned."),
                *(["--stream-pin: each server (raw sink, coordinator) on a core of its own, its sender on the other."]
                  if a.get("stream_pin") else []),
                f"coordinators keep {a['stream_keep_iterations']} sealed iterations (--keep-iterations), so each seal frees an old one's "
                "memory and shard files once warm.",
                "cpu s/GB: CPU seconds per GB streamed of the receiving server (coordinator / raw sink) and of the sender (worker / raw sender); "
                f"srv RSS: the server's resident memory after all {a['stream_warmup'] + a['stream_repeats']} iterations.",
                f"{'path':<14} {'state':<8} {'MB/s':>8} {'% of raw':>8} {'submit->seal MB/s':>17} {'groups/batch':>12} "
                f"{'srv cpu s/GB':>12} {'snd cpu s/GB':>12} {'srv RSS MB':>10} {'goal':>10} {'':>4}"]
        for r in s:
            pct = r["mb_per_s"] / raw["mb_per_s"] * 100 if raw else None
            goal = "-" if r is raw or pct is None else f">= {STREAM_GOAL * 100:.0f}%"
            status = "" if goal == "-" else ("PASS" if pct >= STREAM_GOAL * 100 else "MISS")
            sub = "-" if r["mb_per_s_submit_to_seal"] is None else f"{r['mb_per_s_submit_to_seal']:.1f}"
            out.append(f"{r['path']:<14} {r['state']:<8} {r['mb_per_s']:>8.1f} {'-' if pct is None else f'{pct:.0f}%':>8} {sub:>17} "
                       f"{r['groups_per_batch_mean']:>12} {r['server_cpu_s_per_gb']:>12.2f} {r['client_cpu_s_per_gb']:>12.2f} {r['server_rss_mb']:>10.0f} {goal:>10} {status:>4}")
    if doc.get("submit"):
        out += ["", f"Submit: iterations of {a['submit_tasks']} tasks ({a['submit_prompt_tokens']}-token prompts), {a['submit_repeats']} per mode; "
                    "a lease keep-alive every 2 ms meanwhile (its latency: how long the loop was held), against the same just before.",
                f"{'state':<8} {'submit ms':>10} {'keep-alive p50 ms':>17} {'max ms':>8} {'max per submit':>20} {'idle p50':>9} {'idle max':>9}"]
        for r in doc["submit"]:
            per = "/".join("-" if x is None else f"{x:.0f}" for x in r["per_repeat_keep_alive_max_ms"])
            f = lambda x: "-" if x is None else x  # noqa: E731 - no keep-alive in that window
            out.append(f"{r['state']:<8} {r['submit_ms']:>10.1f} {f(r['keep_alive_p50_ms']):>17} {f(r['keep_alive_max_ms']):>8} {per:>20} "
                       f"{f(r['idle_keep_alive_p50_ms']):>9} {f(r['idle_keep_alive_max_ms']):>9}")
    if doc.get("makespan"):
        m = doc["makespan"]
        speeds = "/".join(f"{s:g}x" for s in a["ms_speeds"])
        out += ["", f"Makespan: {a['ms_tasks']} tasks, {a['ms_base_s']:g} s at 1x, single-slot workers {speeds}; "
                    f"ideal = tasks x base / sum(speeds) = {m[0]['ideal_s']:.3f} s; median of {a['ms_repeats']} iterations.",
                "makespan = the coordinator's submit -> seal (manifest elapsed_s).",
                f"{'config':<16} {'policy':<8} {'weights':<10} {'backup':>6} {'makespan s':>10} {'x ideal':>8} "
                f"{'done per node (' + speeds + ')':<26} {'goal':>10} {'':>4}"]
        for r in m:
            w = "/".join(f"{x:g}" for x in r["weights"])
            done = "/".join(str(v) for v in r["done_per_node"].values())
            goal = r["goal"]
            out.append(f"{r['config']:<16} {r['policy']:<8} {w:<10} {r['backup_tasks']:>6} {r['makespan_s']:>10.3f} {r['ratio']:>8.3f} "
                       f"{done:<26} {('<= ' + format(goal['at_most'], 'g') + 'x') if goal else '-':>10} {goal['status'] if goal else '':>4}")
    if doc.get("profile"):
        for label, top in doc["profile"]["top"].items():
            first = ", ".join(f"{r['function']} {r['share'] * 100:.0f}%" for r in top["self"][:3])
            out.append(f"profile {label}: {first} (self; {doc['profile']['dir']}/{label}.top.txt)")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    import grpc

    doc: dict = {
        "bench": "scheduler",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
                 "loadavg_start": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "json_out"},
        "units": {"time": "seconds unless the key says ms", "mb_per_s": "1e6 bytes of sample payload per second"},
        "notes": [
            "Coordinator, workers, raw baseline and driver share this host's cores; on a cluster each worker has its own node.",
            "Stream baseline: identical serialized messages, generic grpc.aio handler with identity (de)serializers, "
            "so no parsing and no storage: an upper bound for any protobuf service on this host. The coordinator's Work "
            "stream receives bytes the same way and reads result batches in place (elasticrl/scheduler/framing.py).",
            "Round-trip latency is taken at the worker (engine start -> ack received), so it leaves out the assignment's "
            "one-way trip from the coordinator.",
        ],
    }
    bench = Bench(args, tmp, cleanup)
    if "roundtrip" in args.sections:
        doc["roundtrip"] = []
        for mode in args.modes:
            log(f"roundtrip ({mode}): {args.rt_workers} workers x {args.rt_slots} slots, {args.rt_tasks} tasks")
            doc["roundtrip"].append(bench.roundtrip(mode))
    if "stream" in args.sections:
        log(f"stream: raw grpc.aio and coordinator ({', '.join(args.modes)}) interleaved, "
            f"{args.stream_warmup + args.stream_repeats} x {args.stream_groups} groups each")
        doc["stream"] = bench.stream()
        if bench.profiler is not None:
            doc["profile"] = {"dir": str(args.profile), "top": bench.profiler.tops}
    if "submit" in args.sections:
        doc["submit"] = []
        for mode in args.modes:
            log(f"submit ({mode}): {args.submit_repeats} x {args.submit_tasks} tasks, keep-alives meanwhile")
            doc["submit"].append(bench.submit(mode))
    if "makespan" in args.sections:
        doc["makespan"] = []
        coord = bench.coordinator("makespan", "memory")
        client = bench.client(coord.address)
        try:
            for config in args.ms_configs:
                log(f"makespan: {config}, {args.ms_repeats} iteration(s) of {args.ms_tasks} tasks")
                doc["makespan"].append(bench.makespan(coord, client, config))
        finally:
            coord.stop()
    doc["host"]["loadavg_end"] = os.getloadavg()
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main("bench/scheduler.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render, prefix="elasticrl-bench-sched-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
