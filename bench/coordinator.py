"""Barrier latency and failure-to-release of the elasticrl coordinator, against three baselines.

Everything is measured in one run on this host. The same barrier is built four ways:

* ``coordinator``: the leased barrier of a real ``elasticrl coordinator`` subprocess (in-memory
  state, and durable SQLite/WAL state, the default deployment), members using
  ``AsyncCoordinatorClient`` with one gRPC channel each and a keep-alive loop each, over one of
  three transports (``--transports``): ``unary``, one Arrive/KeepAlive call per operation,
  ``session``, one long-lived Session stream per member carrying both as messages, and
  ``batched``, one Session stream per client process carrying all of its members' operations,
  those queued together as one batch message (and their answers likewise); and ``membership``,
  each member a ``client.Membership`` as a trainer worker uses (blocking calls, a thread and a
  Session stream per member, arrivals on it); and ``relay``, the same ``Membership`` through a
  node relay (``coordinator/session_relay.py``) per ``--relay-members`` members, as a node agent runs
  one: a Unix socket per member to it, one batched stream from it (the relays are threads of the
  client processes here; on a cluster each is its node's agent);
* ``tcpstore``: ``torch.distributed.elastic.utils.store.barrier`` (add + wait on a key) on a
  ``torch.distributed.TCPStore`` served by this process;
* ``rawgrpc``: the floor of a stream per member over grpc.aio (``bench/barrier_rawgrpc.py``, a
  process of its own): each member writes its arrival on its stream and reads its release, and
  the server only counts (no lease, no protobuf, no state); the coordinator's rows get their p50
  as a multiple of its (``x_rawgrpc``);
* ``flagfile``: flag files in a directory polled every ``--poll-s`` (the shared-filesystem design).

Members are spread over ``--workers`` client processes (rank i lives in process i mod W), as
asyncio tasks (threads for TCPStore, whose calls block). Barrier latency of one member in one
round is its release time minus the time the round's LAST arrival was sent (CLOCK_MONOTONIC,
comparable across processes on one host): the delay the barrier itself adds once everyone is
there. p50/p99 are over members x rounds. The driver starts each round, with the system idle in
between, in one of two patterns: ``burst``, every member arrives at once (so the latency also
holds the server's backlog of arrivals), and ``last``, every member but one arrives, the driver
waits until the barrier's own store counts them, then the last one arrives (pure release: one
arrival plus the fan-out of N releases).

Failure-to-release: ``--failure-members`` members, one OS process each; all but one arrive, then
the straggler (joined, renewing its lease) is SIGKILLed, and we time kill -> release of the
survivors. The baselines have no liveness, so they never release; that is reported as such
(the raw-gRPC floor is left out of it).

Goals: a coordinator row's p50 below ``P50_GOALS_MS`` at 64 and 512 members, and, where the run
also measured TCPStore at the same size and pattern, within ``TCPSTORE_GOAL_X`` (1.5x) of its p50
(``x_tcpstore``, ``tcpstore_goal`` in the JSON).

    python bench/coordinator.py                      # everything, ~4-5 min on 2 shared cores
    python bench/coordinator.py --members 8,64 --skip-baselines --json-out /tmp/b.json
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
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench.benchmain import BenchError, run_main  # noqa: E402

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKER = BENCH_DIR / "barrier_members.py"
# Goals from the issue: barrier p50 by member count (ms), and release within TTL + this (s).
P50_GOALS_MS = {64: 5.0, 512: 50.0}
# And barrier p50 within this multiple of torch's TCPStore (what torchrun uses), same size and
# pattern, same run.
TCPSTORE_GOAL_X = 1.5
BASELINES = {"tcpstore": "memory", "rawgrpc": "memory", "flagfile": "files"}  # baseline -> its state column
RAWGRPC = BENCH_DIR / "barrier_rawgrpc.py"
FAILURE_SLACK_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/coordinator.py", description=__doc__.split("\n")[0])
    p.add_argument("--members", default="8,64,512", help="comma-separated barrier sizes, members (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="measured barrier rounds per size for coordinator and TCPStore (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds before those, per size (default: %(default)s)")
    p.add_argument("--flag-rounds", type=int, default=3, help="measured rounds per size for the flag-file baseline; each takes about --poll-s (default: %(default)s)")
    p.add_argument("--poll-s", type=float, default=2.0, help="flag-file poll period, seconds (default: %(default)s, as the shared-filesystem scripts)")
    p.add_argument("--patterns", default="burst,last", help="arrival patterns: burst (all members at once) and last (the last member arrives after the others are parked) (default: %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="client processes that host the members (default: %(default)s)")
    p.add_argument("--transports", default="unary,session,batched", help="coordinator member transports: unary (a call per arrival/keep-alive), session (one bidi stream per member), batched (one bidi stream per process, batch messages), membership (client.Membership, a trainer worker's: blocking calls, a thread and a stream per member), relay (client.Membership through a node relay per --relay-members members: one batched stream per relay) (default: %(default)s)")
    p.add_argument("--relay-members", type=int, default=8, help="transport relay: members per node relay, as trainer ranks per node (default: %(default)s)")
    p.add_argument("--modes", default="memory,durable", help="coordinator state modes to measure: memory, durable (SQLite WAL) (default: %(default)s)")
    p.add_argument("--state-dir", help="parent directory for durable state, to bench a given filesystem (default: a temporary directory)")
    p.add_argument("--latency-ttl", type=float, default=5.0, help="member lease TTL during latency rounds, seconds; members renew every TTL/3 (default: %(default)s)")
    p.add_argument("--ttl", type=float, default=1.0, help="lease TTL in the failure-to-release scenario, seconds (default: %(default)s)")
    p.add_argument("--failure-members", type=int, default=8, help="members (one process each) in the failure scenario (default: %(default)s)")
    p.add_argument("--failure-trials", type=int, default=3, help="failure trials per coordinator mode (default: %(default)s)")
    p.add_argument("--hang-cap-s", type=float, default=5.0, help="give up waiting for a release after a kill after this long, seconds (default: %(default)s)")
    p.add_argument("--barrier-timeout-s", type=float, default=60.0, help="barrier timeout passed to every implementation, seconds (default: %(default)s)")
    p.add_argument("--shared-channel", action="store_true", help="one gRPC channel per worker process instead of one per member")
    p.add_argument("--baselines", default="tcpstore,rawgrpc,flagfile", help="baselines to measure: tcpstore, rawgrpc (the floor of a grpc.aio stream per member), flagfile (default: %(default)s)")
    p.add_argument("--skip-baselines", action="store_true", help="measure only the coordinator (same as --baselines '')")
    p.add_argument("--skip-failure", action="store_true", help="skip the failure-to-release scenario")
    p.add_argument("--profile", metavar="DIR", help="py-spy the coordinator during each latency measurement: "
                   "DIR/<case>.collapsed.txt (speedscope opens it), DIR/<case>.top.txt, and the top functions in the JSON (profile{})")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON document here (the table then goes to stdout); default: JSON on stdout, table on stderr")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.members = [int(x) for x in args.members.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--members: {args.members!r} must be comma-separated integers, e.g. 8,64,512")
    if not args.members or min(args.members) < 2:
        parser.error(f"--members: {args.members} needs sizes of at least 2")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.patterns = [m.strip() for m in args.patterns.split(",") if m.strip()]
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    args.baselines = [] if args.skip_baselines else [b.strip() for b in args.baselines.split(",") if b.strip()]
    if not set(args.baselines) <= set(BASELINES):
        parser.error(f"--baselines: {args.baselines} may only name {', '.join(BASELINES)}")
    if not args.transports or not set(args.transports) <= {"unary", "session", "batched", "membership", "relay"}:
        parser.error(f"--transports: {args.transports} may only name unary, session, batched, membership and relay")
    if args.relay_members < 1:
        parser.error(f"--relay-members: {args.relay_members} must be at least 1")
    if not args.patterns or not set(args.patterns) <= {"burst", "last"}:
        parser.error(f"--patterns: {args.patterns} may only name burst and last")
    if not set(args.modes) <= {"memory", "durable"}:
        parser.error(f"--modes: {args.modes} may only name memory and durable")
    if args.rounds < 1 or args.flag_rounds < 1 or args.warmup < 0 or args.workers < 1:
        parser.error("--rounds and --flag-rounds must be >= 1, --warmup >= 0, --workers >= 1")
    if args.failure_members < 2:
        parser.error(f"--failure-members: {args.failure_members} must be at least 2 (one straggler, one survivor)")
    if args.hang_cap_s <= args.ttl + FAILURE_SLACK_S:
        parser.error(f"--hang-cap-s: {args.hang_cap_s}s must exceed --ttl + {FAILURE_SLACK_S}s = {args.ttl + FAILURE_SLACK_S}s")
    return args


_STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _STARTED:6.1f}s] {msg}", file=sys.stderr, flush=True)


# -- processes -------------------------------------------------------------------------------


# TCPStore names both ends of each connection (reverse DNS of ::ffff:127.0.0.1); where DNS is
# unreachable some lookups hang for the resolver's default 5 s, in the store's accept loop too.
# Set in this process (before any lookup) and inherited by every process the bench starts.
RESOLVER_OPTIONS = "timeout:1 attempts:1"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class CoordinatorProc:
    """``python -m elasticrl coordinator`` on a free port; SIGTERM on stop, SIGKILL if it lingers."""

    def __init__(self, tmp: pathlib.Path, *, lease_ttl_s: float, state_dir: pathlib.Path | None):
        tmp.mkdir(parents=True, exist_ok=True)
        from elasticrl.coordinator.launch import CoordinatorStartError, start_coordinator

        self.log_path = tmp / "coordinator.log"
        try:
            self.proc, port = start_coordinator(
                tmp / "port", self.log_path, cwd=REPO, env=_env(), lease_ttl_s=lease_ttl_s, state_dir=state_dir
            )
        except CoordinatorStartError as exc:
            raise BenchError(str(exc)) from None
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        from elasticrl.coordinator.launch import stop_coordinator

        stop_coordinator(self.proc)


class RawGrpcProc:
    """``bench/barrier_rawgrpc.py serve`` on a free port; SIGTERM on stop, SIGKILL if it lingers."""

    def __init__(self, tmp: pathlib.Path):
        from elasticrl.coordinator.launch import CoordinatorStartError, stop_coordinator, wait_for_port

        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "rawgrpc.log"
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, str(RAWGRPC), "serve", "--port-file", str(tmp / "port")],
                                         stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=_env())
        try:
            port = wait_for_port(self.proc, tmp / "port", timeout_s=60, log_path=self.log_path)
        except CoordinatorStartError as exc:
            stop_coordinator(self.proc)
            raise BenchError(f"raw gRPC barrier server: {exc}") from None
        self.address = f"127.0.0.1:{port}"
        self._channel = None

    def arrived(self, name: str) -> int:
        from bench.barrier_rawgrpc import COUNT
        from elasticrl.coordinator import wire

        if self._channel is None:
            self._channel = wire.open_channel(self.address, None, aio=False)
        count = self._channel.unary_unary(COUNT, request_serializer=None, response_deserializer=None)
        return int(count(name.encode(), timeout=10))

    def stop(self) -> None:
        from elasticrl.coordinator.launch import stop_coordinator

        if self._channel is not None:
            self._channel.close()
        stop_coordinator(self.proc)


class Worker:
    """One ``barrier_members.py`` process; replies are read by a thread so waits can time out."""

    def __init__(self, log_path: pathlib.Path):
        with open(log_path, "a") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, cwd=REPO, env=_env(), text=True
            )
        self.log_path = log_path
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"worker {self.pid} exited:\n{self.log_path.read_text()[-2000:]}") from None

    def reply(self, timeout_s: float) -> dict | None:
        """The next reply; None if none came within ``timeout_s``. Raises BenchError on a failure."""
        try:
            msg = self._replies.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None
        if msg is None or not msg.get("ok"):
            detail = "exited" if msg is None else msg.get("error")
            raise BenchError(f"worker {self.pid} failed: {detail}\n{self.log_path.read_text()[-2000:]}")
        return msg

    def call(self, cmd: dict, timeout_s: float = 120.0) -> dict:
        self.send(cmd)
        msg = self.reply(timeout_s)
        if msg is None:
            raise BenchError(f"worker {self.pid}: no reply to {cmd['op']} within {timeout_s:.0f}s")
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class WorkerPool:
    """``n`` long-lived workers; member (rank) i of a barrier lives in worker i mod n."""

    def __init__(self, n: int, log_path: pathlib.Path):
        self.workers: list[Worker] = []
        try:
            for _ in range(n):
                self.workers.append(Worker(log_path))
        except BaseException:  # those started so far are nobody's to stop otherwise
            self.kill()
            raise

    def setup(self, impl: str, world: int, **cfg) -> list[Worker]:
        used = []
        for w, worker in enumerate(self.workers[:world]):
            ranks = list(range(w, world, len(self.workers)))
            worker.send({"op": "setup", "impl": impl, "world": world, "ranks": ranks, "members": [f"m{r:04d}" for r in ranks], **cfg})
            used.append(worker)
        for worker in used:
            if worker.reply(120) is None:
                raise BenchError(f"worker {worker.pid}: setup of {impl} with {world} members took over 120 s")
        return used

    def round(self, used: list[Worker], name: str, timeout_s: float, *, hold: int | None = None, parked=None) -> tuple[list[list[float]], float]:
        """One barrier round: ([sent, released] per member, client CPU seconds of all workers).

        With ``hold``, that rank arrives only once ``parked()`` returned (every other member has
        arrived, as the barrier's own store reports it)."""
        for worker in used:
            worker.send({"op": "round", "name": name, "hold": hold})
        if hold is not None:
            parked()
            self.workers[hold % len(self.workers)].call({"op": "go"})
        times: list[list[float]] = []
        cpu_s = 0.0
        for worker in used:
            msg = worker.reply(timeout_s)
            if msg is None:
                raise BenchError(f"barrier {name} not released in worker {worker.pid} within {timeout_s:.0f}s")
            times += msg["times"]
            cpu_s += msg["cpu_s"]
        return times, cpu_s

    @staticmethod
    def teardown(used: list[Worker]) -> None:
        for worker in used:
            worker.call({"op": "teardown"})

    def kill(self) -> None:
        for worker in self.workers:
            worker.kill()


def wait_for_count(count, target: int, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``count()`` until it reaches ``target``, less often for big barriers (a coordinator
    Status reply lists every member, so polling it costs the server O(N))."""
    deadline = time.monotonic() + timeout_s
    while (seen := count()) < target:
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: {seen} of {target} arrivals after {timeout_s:.0f}s")
        time.sleep(0.003 + target * 5e-5)


# -- statistics ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_stats(rounds: list[list[list[float]]]) -> dict:
    """``rounds``: per round, [sent, released] per member. Latency = released - last sent."""
    lat, whole, spread = [], [], []
    for times in rounds:
        first = min(s for s, _ in times)
        last = max(s for s, _ in times)
        lat += [r - last for _, r in times]
        whole.append(max(r for _, r in times) - first)
        spread.append(last - first)
    ms = lambda x: round(x * 1000, 3)  # noqa: E731
    return {
        "samples": len(lat),
        "p50_ms": ms(percentile(lat, 0.5)),
        "p99_ms": ms(percentile(lat, 0.99)),
        "max_ms": ms(max(lat)),
        "round_p50_ms": ms(percentile(whole, 0.5)),
        "round_max_ms": ms(max(whole)),
        "send_spread_p50_ms": ms(percentile(spread, 0.5)),
    }


def p50_goal(members: int, p50_ms: float) -> dict | None:
    goal = P50_GOALS_MS.get(members)
    if goal is None:
        return None
    return {"metric": "p50_ms", "below": goal, "status": "PASS" if p50_ms < goal else "MISS"}


def compare_baselines(rows: list[dict]) -> None:
    """Give each coordinator row with a TCPStore row of the same size and pattern its p50 as a
    multiple of TCPStore's (``x_tcpstore``) and that goal (``tcpstore_goal``), and with a raw-gRPC
    row, as a multiple of that floor's (``x_rawgrpc``); the raw-gRPC row gets its ``x_tcpstore``."""
    def base(impl: str) -> dict:
        return {(r["members"], r["pattern"]): r["p50_ms"] for r in rows if r["impl"] == impl}

    tcpstore, rawgrpc = base("tcpstore"), base("rawgrpc")
    for r in rows:
        key = (r["members"], r["pattern"])
        if r["impl"] in ("coordinator", "rawgrpc") and tcpstore.get(key):
            r["x_tcpstore"] = round(r["p50_ms"] / tcpstore[key], 2)
            if r["impl"] == "coordinator":
                r["tcpstore_goal"] = {"metric": "p50_ms / tcpstore p50_ms", "at_most": TCPSTORE_GOAL_X,
                                      "status": "PASS" if r["x_tcpstore"] <= TCPSTORE_GOAL_X else "MISS"}
        if r["impl"] == "coordinator" and rawgrpc.get(key):
            r["x_rawgrpc"] = round(r["p50_ms"] / rawgrpc[key], 2)


# -- scenarios -------------------------------------------------------------------------------


def measure_latency(
    pool: WorkerPool, impl: str, world: int, pattern: str, rounds: int, warmup: int, round_timeout_s: float, arrived,
    server_cpu=None, **cfg,
) -> dict:
    """``pattern`` "burst": all members arrive at once; "last": all but the last rank arrive, and
    the last one arrives once ``arrived(name)`` says the others are in (pure release latency).
    ``server_cpu()``, if given, returns the CPU seconds the barrier's server has used so far."""
    started = time.monotonic()
    used = pool.setup(impl, world, **cfg)
    set_up = time.monotonic()
    try:
        measured, client_cpu_s, server_cpu_s = [], 0.0, 0.0
        for r in range(warmup + rounds):
            if r == warmup and server_cpu is not None:
                server_cpu_s = -server_cpu()
            name = f"n{world}-{pattern}-b{r:05d}"  # unique per store, size and pattern
            if pattern == "last":
                parked = lambda: wait_for_count(lambda: arrived(name), world - 1, f"{impl} barrier {name}")  # noqa: E731
                times, cpu_s = pool.round(used, name, round_timeout_s, hold=world - 1, parked=parked)
            else:
                times, cpu_s = pool.round(used, name, round_timeout_s)
            if r >= warmup:
                measured.append(times)
                client_cpu_s += cpu_s
            if impl == "flagfile":  # keep the listing at one round's flags, as a cleaning script would
                for entry in os.listdir(cfg["flag_dir"]):
                    os.unlink(os.path.join(cfg["flag_dir"], entry))
            time.sleep(0.02)  # let keep-alives and log writes settle between rounds
        if server_cpu is not None:
            server_cpu_s += server_cpu()
        ran = time.monotonic()
    finally:
        pool.teardown(used)
    log(f"  set up {set_up - started:.1f}s, rounds {ran - set_up:.1f}s, teardown {time.monotonic() - ran:.1f}s")
    cpu = {
        "client_cpu_ms_per_round": round(client_cpu_s / rounds * 1000, 2),
        "server_cpu_ms_per_round": None if server_cpu is None else round(server_cpu_s / rounds * 1000, 2),
    }
    return {"members": world, "pattern": pattern, "processes": len(used), "rounds": rounds, **latency_stats(measured), **cpu}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used; Linux /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def failure_trial(tmp: pathlib.Path, impl: str, n: int, hang_cap_s: float, arrived, **cfg) -> dict:
    """Kill the one member that did not arrive; time kill -> release of the n-1 survivors."""
    workers = [Worker(tmp / "failure-workers.log") for _ in range(n)]
    try:
        for r, worker in enumerate(workers):
            worker.send({"op": "setup", "impl": impl, "world": n, "ranks": [r], "members": [f"f{r:03d}"], **cfg})
        for worker in workers:
            if worker.reply(120) is None:
                raise BenchError(f"failure member {worker.pid} did not set up within 120 s")
        survivors, straggler = workers[:-1], workers[-1]
        for worker in survivors:
            worker.send({"op": "round", "name": "fail", "hold": None})
        wait_for_count(lambda: arrived("fail"), n - 1, f"{impl} failure barrier", timeout_s=30)
        time.sleep(0.05)  # the straggler is only renewing its lease now
        killed_at = time.monotonic()
        os.kill(straggler.pid, signal.SIGKILL)
        released, evicted = [], []
        for worker in survivors:
            msg = worker.reply(killed_at + hang_cap_s - time.monotonic())
            if msg is None:
                return {"kill_to_release_s": None, "note": f"no release within {hang_cap_s:.1f}s of the kill"}
            released += [rel - killed_at for _, rel in msg["times"]]
            evicted = msg["evicted"]
        return {"kill_to_release_s": round(max(released), 4), "evicted": evicted}
    finally:
        for worker in workers:
            worker.kill()


def coordinator_arrived(client, run_id: str, name: str) -> int:
    """How many members have arrived at open barrier ``name``, as the coordinator reports it."""
    for run in client.status(run_id).get("runs", []):
        for barrier in run.get("open_barriers", []):
            if barrier["name"] == name:
                return len(barrier.get("arrived", []))
    return 0


def flags_arrived(flag_dir: pathlib.Path, name: str) -> int:
    return sum(1 for entry in os.listdir(flag_dir) if entry.startswith(f"{name}_rank_"))


# -- report ----------------------------------------------------------------------------------


def render_table(doc: dict) -> str:
    host = doc["host"]
    load = "/".join(f"{x:.1f}" for x in host["loadavg_start"][:1] + host.get("loadavg_end", [float("nan")])[:1])
    lines = [
        f"Host: {host['cpus']} CPUs, load average {load} at start/end (goals are the coordinator's; baselines are shown against them too).",
        f"Barrier latency = release - last arrival sent; p50/p99 over members x rounds. {doc['layout']['summary']}",
        "Times in ms; round = first arrival sent -> last release; srv/cli cpu = CPU ms per round of the barrier server / all client processes.",
        f"{'impl':<12} {'transport':<9} {'state':<8} {'pattern':<7} {'members':>7} {'procs':>5} {'rounds':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'round p50':>10} {'srv cpu':>8} {'cli cpu':>8} {'goal':>12} {'':>4} {'x tcpstore':>10} {'<= ' + format(TCPSTORE_GOAL_X, 'g') + 'x':>6} {'x rawgrpc':>9}",
    ]
    for row in doc["latency"]:
        goal = row.get("goal")
        goal_txt = f"p50 < {goal['below']:g} ms" if goal else "-"
        srv = "-" if row["server_cpu_ms_per_round"] is None else f"{row['server_cpu_ms_per_round']:.1f}"
        lines.append(
            f"{row['impl']:<12} {row.get('transport', '-'):<9} {row['state']:<8} {row['pattern']:<7} {row['members']:>7} {row['processes']:>5} {row['rounds']:>6} "
            f"{row['p50_ms']:>9.2f} {row['p99_ms']:>9.2f} {row['max_ms']:>9.2f} {row['round_p50_ms']:>10.2f} "
            f"{srv:>8} {row['client_cpu_ms_per_round']:>8.1f} {goal_txt:>12} {goal['status'] if goal else '':>4} "
            f"{row['x_tcpstore'] if 'x_tcpstore' in row else '-':>10} {row['tcpstore_goal']['status'] if 'tcpstore_goal' in row else '':>6} "
            f"{row.get('x_rawgrpc', '-'):>9}"
        )
    if doc["failure"]:
        lines += ["", "Failure to release: SIGKILL of a member that joined but never arrived -> survivors released (one process per member)."]
        lines.append(f"{'impl':<12} {'transport':<9} {'state':<8} {'members':>7} {'ttl s':>6} {'trials':>6} {'kill->release s (per trial)':<34} {'goal':>14} {'':>4}")
        for row in doc["failure"]:
            per = ", ".join("never (hangs)" if t["kill_to_release_s"] is None else f"{t['kill_to_release_s']:.3f}" for t in row["trials"])
            lines.append(
                f"{row['impl']:<12} {row.get('transport', '-'):<9} {row['state']:<8} {row['members']:>7} {row['ttl_s']:>6.2f} {len(row['trials']):>6} {per:<34} "
                f"{'< ' + format(row['goal']['below'], 'g') + ' s':>14} {row['goal']['status']:>4}"
            )
    lines += ["", "Notes:"] + [f"- {note}" for note in doc["notes"]]
    if doc.get("profile"):
        for label, top in doc["profile"]["top"].items():
            first = ", ".join(f"{r['function']} {r['share'] * 100:.0f}%" for r in top["self"][:3])
            lines.append(f"profile {label}: {first} (self; {doc['profile']['dir']}/{label}.top.txt)")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------


class Bench:
    """The processes and stores of one bench run; everything started is stopped by ``cleanup``."""

    def __init__(self, args: argparse.Namespace, tmp: pathlib.Path, cleanup: contextlib.ExitStack):
        self.args, self.tmp, self.cleanup = args, tmp, cleanup
        self.round_timeout_s = args.barrier_timeout_s + 30
        self.state_root = pathlib.Path(args.state_dir) if args.state_dir else tmp
        self.pool: WorkerPool | None = None
        self._store = None
        self.profiler = None
        if args.profile:
            from bench.profiling import Profiler

            self.profiler = Profiler(args.profile)

    def coordinator(self, mode: str, label: str, ttl: float) -> CoordinatorProc:
        state = None
        if mode == "durable":
            state = pathlib.Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.state_root))
            self.cleanup.callback(shutil.rmtree, state, True)
        coord = CoordinatorProc(self.tmp / label, lease_ttl_s=ttl, state_dir=state)
        self.cleanup.callback(coord.stop)
        return coord

    @property
    def store(self):
        """The TCPStore every TCPStore member connects to, served from this process."""
        if self._store is None:
            import datetime

            from torch.distributed import TCPStore  # late: torch is only needed for this baseline

            timeout = datetime.timedelta(seconds=self.round_timeout_s)
            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return self._store

    def store_arrived(self, name: str) -> int:
        from torch.distributed.elastic.utils.store import _NUM_MEMBERS  # the counter store_util.barrier adds to

        return int(self.store.add(name + _NUM_MEMBERS, 0))

    def latency(self, impl: str, mode: str, n: int, pattern: str, transport: str = "-") -> dict:
        a = self.args
        if self.pool is None:
            self.cleanup.callback(lambda: self.pool is not None and self.pool.kill())
            self.pool = WorkerPool(a.workers, self.tmp / "workers.log")
        common = dict(round_timeout_s=self.round_timeout_s, barrier_timeout_s=a.barrier_timeout_s, relay_members=a.relay_members)
        if impl == "coordinator":
            from elasticrl.coordinator.client import CoordinatorClient

            label = f"lat-{mode}-{transport}-{n}-{pattern}"
            coord = self.coordinator(mode, label, a.latency_ttl)
            profiling = self.profiler.attach(coord.proc.pid, label) if self.profiler else contextlib.nullcontext()
            try:
                with CoordinatorClient(coord.address, call_timeout_s=10, reconnect_timeout_s=5) as client, profiling:
                    row = measure_latency(
                        self.pool, impl, n, pattern, a.rounds, a.warmup, arrived=lambda name: coordinator_arrived(client, "bench", name),
                        server_cpu=lambda: process_cpu_s(coord.proc.pid), address=coord.address, run_id="bench", lease_ttl_s=a.latency_ttl, shared_channel=a.shared_channel, transport=transport, **common,
                    )
            finally:
                coord.stop()
        elif impl == "tcpstore":
            row = measure_latency(
                self.pool, impl, n, pattern, a.rounds, a.warmup, arrived=self.store_arrived, server_cpu=time.process_time,
                address=f"127.0.0.1:{self.store.port}", **common,
            )
        elif impl == "rawgrpc":
            server = RawGrpcProc(self.tmp / f"rawgrpc-{n}-{pattern}")
            try:
                row = measure_latency(
                    self.pool, impl, n, pattern, a.rounds, a.warmup, arrived=server.arrived,
                    server_cpu=lambda: process_cpu_s(server.proc.pid), address=server.address, shared_channel=a.shared_channel, **common,
                )
            finally:
                server.stop()
        else:
            flag_dir = self.tmp / f"flags-{n}-{pattern}"
            flag_dir.mkdir()
            row = measure_latency(
                self.pool, impl, n, pattern, a.flag_rounds, 0, arrived=lambda name: flags_arrived(flag_dir, name),
                flag_dir=str(flag_dir), poll_s=a.poll_s, **common,
            )
        return {"impl": impl, "transport": transport, "state": mode, **row, "goal": p50_goal(n, row["p50_ms"])}

    def failure(self, impl: str, mode: str, trials: int, transport: str = "-") -> dict:
        a = self.args
        n, goal = a.failure_members, a.ttl + FAILURE_SLACK_S
        if self.pool is not None:
            self.pool.kill()  # free the cores for the one-process-per-member scenario
            self.pool = None
        rows = []
        for t in range(trials):
            if impl == "coordinator":
                from elasticrl.coordinator.client import CoordinatorClient

                coord = self.coordinator(mode, f"fail-{mode}-{transport}-{t}", a.ttl)
                try:
                    with CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=5) as client:
                        rows.append(failure_trial(
                            self.tmp, impl, n, a.hang_cap_s, lambda name: coordinator_arrived(client, "fail", name),
                            address=coord.address, run_id="fail", lease_ttl_s=a.ttl, barrier_timeout_s=a.barrier_timeout_s,
                            transport=transport, relay_members=a.relay_members,
                        ))
                finally:
                    coord.stop()
            elif impl == "tcpstore":
                rows.append(failure_trial(
                    self.tmp, impl, n, a.hang_cap_s, self.store_arrived,
                    address=f"127.0.0.1:{self.store.port}", barrier_timeout_s=a.barrier_timeout_s,
                ))
            else:
                flag_dir = self.tmp / f"flags-fail-{t}"
                flag_dir.mkdir()
                rows.append(failure_trial(
                    self.tmp, impl, n, a.hang_cap_s, lambda name: flags_arrived(flag_dir, name), flag_dir=str(flag_dir), poll_s=a.poll_s,
                ))
        worst = [r["kill_to_release_s"] for r in rows]
        ok = all(w is not None and w < goal for w in worst)
        return {
            "impl": impl, "transport": transport, "state": mode, "members": n, "ttl_s": a.ttl, "trials": rows,
            "max_kill_to_release_s": None if None in worst else max(worst),
            "goal": {"metric": "kill_to_release_s", "below": round(goal, 3), "status": "PASS" if ok else "MISS"},
        }


def run(args: argparse.Namespace, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    doc: dict = {
        "bench": "coordinator",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_start": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "json_out"},
        "latency_definition": (
            "per member and round: release time minus the time the round's last arrival was sent "
            "(time.monotonic in each member's process, CLOCK_MONOTONIC); p50/p99/max over members x measured "
            "rounds; round = first arrival sent -> last release. Pattern burst: every member arrives at once. "
            "Pattern last: every member but the last arrives, the bench waits until the barrier's own store "
            "counts them, then the last one arrives"
        ),
        "layout": {
            "summary": f"Members over {args.workers} client processes (rank i -> process i mod {args.workers}).",
            "coordinator": "asyncio tasks; " + ("one gRPC channel per process" if args.shared_channel else "one gRPC channel per member")
            + f"; each member renews its lease every {args.latency_ttl / 3:.2f}s; transport unary: a gRPC call per "
            "arrival and keep-alive, session: one Session stream per member carrying both, batched: one Session "
            "stream per process carrying all its members' operations in batch messages, membership: client.Membership, "
            f"a stream per member; relay: client.Membership through a node relay per {args.relay_members} members",
            "tcpstore": "threads, one TCPStore client per member; the store is served by the bench driver process",
            "flagfile": f"asyncio tasks; flags in one local directory, listed every {args.poll_s}s",
            "failure": "one OS process per member",
        },
        "notes": [
            "Every member and the barrier server share this host's cores, so client-side cost (hundreds of "
            "members per process) adds to the latency; on a real cluster each member's client runs on its own node.",
            "Pattern last: the bench polls the barrier's own store (coordinator Status, TCPStore counter, directory "
            "listing) until the others are parked; that polling is included in srv cpu but happens before the "
            "measured window.",
            "Flag files: members that arrive together poll in phase, so latency is about one poll period; with "
            "arrivals spread over more than a poll period it averages half of one.",
            "TCPStore: the store runs in the bench driver process, so its srv cpu also holds the driver's own work.",
        ],
        "latency": [],
        "failure": [],
    }
    bench = Bench(args, tmp, cleanup)
    impls = [("coordinator", mode) for mode in args.modes]
    impls += [(b, state) for b, state in BASELINES.items() if b in args.baselines]
    for impl, mode in impls:
        for pattern in args.patterns:
            for n in args.members:
                # transports back to back at each size, so they are compared under the same conditions
                for transport in args.transports if impl == "coordinator" else ["-"]:
                    rounds = args.flag_rounds if impl == "flagfile" else args.rounds
                    log(f"latency: {impl} ({mode}, {transport}), {n} members, pattern {pattern}, {rounds} rounds")
                    doc["latency"].append(bench.latency(impl, mode, n, pattern, transport))
    compare_baselines(doc["latency"])
    if not args.skip_failure:
        scenarios = [("coordinator", mode, args.failure_trials, t) for mode in args.modes for t in args.transports]
        # (the raw-gRPC floor has no liveness and no failure scenario)
        scenarios += [(b, BASELINES[b], 1, "-") for b in ("tcpstore", "flagfile") if b in args.baselines]
        for impl, mode, trials, transport in scenarios:
            log(f"failure: {impl} ({mode}, {transport}), {trials} trial(s) of {args.failure_members} members, ttl {args.ttl}s")
            doc["failure"].append(bench.failure(impl, mode, trials, transport))
    doc["host"]["loadavg_end"] = os.getloadavg()
    if bench.profiler is not None:
        doc["profile"] = {"dir": str(args.profile), "top": bench.profiler.tops}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RES_OPTIONS", RESOLVER_OPTIONS)
    return run_main("bench/coordinator.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render_table, prefix="elasticrl-bench-")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
