"""Prometheus metrics of one coordinator process, on ``prometheus_client``, and their HTTP endpoint.

``Metrics`` owns a ``CollectorRegistry`` of its own (not the library's global one, so several
coordinators in one test process never collide). The cores count into it where a decision is
applied (a member evicted, a barrier decided, a result accepted, an iteration sealed) through thin
adapters that keep the call sites short: ``metrics.joins.inc(run=run_id)``,
``metrics.barrier_wait.observe(seconds, run=run_id)``. The gauges that merely mirror state (members
by state, epochs, open barriers, queued tasks, connected workers) are not counted at all: at every
scrape they are read through the callables handed to ``watch`` (``RunGauges``,
``SchedulerGauges``), so they can never drift from what the cores hold. This module knows neither
core; ``coordinator.server`` wires them together.

``MetricsEndpoint`` serves ``GET /metrics`` (``prometheus_client``'s WSGI app: text format 0.0.4,
or OpenMetrics when the scraper asks for it) and ``GET /healthz`` from a small threaded WSGI
server. A scrape therefore runs on a thread of its own, not on the coordinator's event loop: the
counters are thread-safe (``prometheus_client`` locks each value), and the readers given to
``watch`` must be too (``read_on_loop`` runs one on the loop and waits for its answer). It does
NOT check the gRPC token: bind it to an internal interface (the default is the coordinator's
``--host``).

Counters count since this process started (a restarted coordinator starts them at zero, as
Prometheus expects of counters); what survives a restart is in the cores' state, not here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
"""What ``/metrics`` answers a scraper that asks for no particular format."""

# Barriers are released in milliseconds when everyone is there and wait up to their timeout
# (600 s by default) when someone is not; iterations seal in seconds to an hour.
BARRIER_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800)
SEAL_BUCKETS_S = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

MEMBER_STATES = ("live", "left", "evicted")
TASK_STATES = ("queued", "running", "done", "dropped", "failed")


# -- what the state-derived gauges read ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunGauges:
    """One run's membership as the gauges show it at a scrape."""

    run_id: str
    epoch: int
    """Membership epoch (bumped by every change)."""
    barriers_open: int
    """Barriers opened and not yet decided."""
    members: Mapping[str, int]
    """Members by state (``MEMBER_STATES``; a missing state counts 0)."""


@dataclasses.dataclass(frozen=True)
class SchedulerGauges:
    """One run's rollout scheduling as the gauges show it at a scrape."""

    run_id: str
    workers: int
    """Rollout workers with an open Work stream that are not fenced."""
    iteration: int | None = None
    """Newest submitted iteration; None when the run has none (then no task samples either)."""
    tasks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Tasks of the newest iteration by state (``TASK_STATES``; a missing state counts 0)."""


MembershipReader = Callable[[], Iterable[RunGauges]]
SchedulerReader = Callable[[], Iterable[SchedulerGauges]]


def read_on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], object], timeout_s: float = 5.0) -> Callable[[], object]:
    """``read`` wrapped to run on ``loop`` (between two of its steps, so it needs no locks) when
    called from another thread, such as a scrape's; ``TimeoutError`` if the loop does not get to it
    within ``timeout_s``."""

    def hop():
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                answer.set_result(read())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                answer.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return answer.result(timeout_s)

    return hop


# -- thin adapters over prometheus_client ---------------------------------------------------------


class _Labelled:
    """One labelled ``prometheus_client`` metric behind the ``name(value, **labels)`` call style of
    the cores. Children are cached by the labels as passed: ``labels()`` validates and locks on
    every call (measured 2.4-3.2 us an increment, against 0.7-1.1 us through the cache, about what
    the hand-written registry this replaced cost). Use it from one thread (the coordinator's event
    loop); scrapes on other threads only read the metric underneath."""

    def __init__(self, metric: prometheus_client.Counter | prometheus_client.Histogram, labelnames: tuple[str, ...], sample: str):
        self.metric = metric
        self.labelnames = labelnames
        self._sample = sample  # the name of the sample value() reads: <name>_total, <name>_count
        self._children: dict[tuple, object] = {}

    def _child(self, labels: dict[str, str]):
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            if sorted(labels) != sorted(self.labelnames):
                raise ValueError(f"{self._sample} takes labels {self.labelnames}, got {tuple(labels)}")
            child = self._children[key] = self.metric.labels(**labels)
        return child

    def forget(self, **labels: str) -> None:
        """Drop every child whose labels include ``labels`` (it vanishes from the next scrape)."""
        self.metric.remove_by_labels({k: str(v) for k, v in labels.items()})
        want = {(k, str(v)) for k, v in labels.items()}
        for key in [k for k in self._children if want <= {(n, str(v)) for n, v in k}]:
            del self._children[key]

    def _read(self, suffix: str, labels: dict[str, str]) -> float:
        """One sample's current value (0 if that child does not exist); for tests and reading back."""
        if sorted(labels) != sorted(self.labelnames):
            raise ValueError(f"{self._sample} takes labels {self.labelnames}, got {tuple(labels)}")
        want = {k: str(v) for k, v in labels.items()}
        for family in self.metric.collect():
            for s in family.samples:
                if s.name == family.name + suffix and s.labels == want:
                    return s.value
        return 0.0


class Counter(_Labelled):
    """Only goes up. The name ends in ``_total`` (``prometheus_client`` insists)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, name: str, help_text: str, labelnames: tuple[str, ...]):
        super().__init__(prometheus_client.Counter(name, help_text, labelnames, registry=registry), labelnames, name)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def value(self, **labels: str) -> float:
        return self._read("_total", labels)


class Histogram(_Labelled):
    """Observations counted into fixed upper-bound buckets (``le``), with ``_sum`` and ``_count``."""

    def __init__(
        self, registry: prometheus_client.CollectorRegistry, name: str, help_text: str, labelnames: tuple[str, ...],
        *, buckets: Iterable[float],
    ):
        metric = prometheus_client.Histogram(name, help_text, labelnames, registry=registry, buckets=sorted(buckets))
        super().__init__(metric, labelnames, f"{name}_count")

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._read("_count", labels))

    def sum(self, **labels: str) -> float:
        return self._read("_sum", labels)


class _StateGauges(Collector):
    """The gauges that mirror the cores' state, built afresh from the readers at every collect
    (a run that is gone from the cores is gone from the next scrape)."""

    def __init__(self) -> None:
        self.membership: MembershipReader | None = None
        self.scheduler: SchedulerReader | None = None

    def _read(self, reader: Callable[[], Iterable], what: str) -> list:
        try:
            return list(reader())
        except Exception:  # noqa: BLE001 - a reader's bug or a stuck loop must not take the scrape down
            log.exception("metrics: reading the %s gauges failed; they are left out of this scrape", what)
            return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.membership is not None:
            runs = self._read(self.membership, "membership")
            members = GaugeMetricFamily(
                "elasticrl_members", "Members of each run by state (live, left, evicted).", labels=("run", "state")
            )
            epoch = GaugeMetricFamily(
                "elasticrl_run_epoch", "Membership epoch of each run (bumped by every change).", labels=("run",)
            )
            barriers = GaugeMetricFamily("elasticrl_barriers_open", "Barriers opened and not yet decided.", labels=("run",))
            for run in runs:
                epoch.add_metric((run.run_id,), run.epoch)
                barriers.add_metric((run.run_id,), run.barriers_open)
                for state in MEMBER_STATES:
                    members.add_metric((run.run_id, state), run.members.get(state, 0))
            yield from (members, epoch, barriers)
        if self.scheduler is not None:
            runs = self._read(self.scheduler, "scheduler")
            iteration = GaugeMetricFamily(
                "elasticrl_scheduler_iteration", "Newest submitted iteration of each run.", labels=("run",)
            )
            tasks = GaugeMetricFamily(
                "elasticrl_scheduler_tasks",
                "Tasks of each run's newest iteration by state: queued, running, done, dropped, failed.",
                labels=("run", "state"),
            )
            workers = GaugeMetricFamily(
                "elasticrl_scheduler_workers", "Rollout workers with an open Work stream that are not fenced.", labels=("run",)
            )
            for run in runs:
                workers.add_metric((run.run_id,), run.workers)
                if run.iteration is None:
                    continue
                iteration.add_metric((run.run_id,), run.iteration)
                for state in TASK_STATES:
                    tasks.add_metric((run.run_id, state), run.tasks.get(state, 0))
            yield from (iteration, tasks, workers)


class Metrics:
    """Every metric of one coordinator process, in its own ``registry``. The cores hold it as
    ``.metrics`` and count into it; ``watch`` hands over the readers of the state-derived gauges."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.clock = clock
        self.started_at = clock()
        r = self.registry
        uptime = prometheus_client.Gauge(
            "elasticrl_coordinator_uptime_seconds", "Seconds since this coordinator process started.", registry=r
        )
        uptime.set_function(lambda: self.clock() - self.started_at)
        self.rpcs = Counter(
            r, "elasticrl_rpcs_received_total",
            "gRPC calls received, by service and method, including calls refused for a wrong token "
            "(counted only while the metrics endpoint is on; a method this server lacks counts as unknown).",
            ("service", "method"),
        )
        # -- membership
        self.joins = Counter(r, "elasticrl_member_joins_total", "Members admitted (new incarnations).", ("run",))
        self.leaves = Counter(r, "elasticrl_member_leaves_total", "Members that left on their own.", ("run",))
        self.evictions = Counter(
            r, "elasticrl_member_evictions_total",
            "Members evicted, by reason: lease_expired, stream_lost (its stream broke and did not reopen in time), missed_barrier or replaced (a newer incarnation joined).",
            ("run", "reason"),
        )
        # -- barriers and rendezvous rounds
        self.barriers_decided = Counter(
            r, "elasticrl_barriers_decided_total", "Barriers decided, by outcome: completed or timed_out.", ("run", "outcome")
        )
        self.barrier_wait = Histogram(
            r, "elasticrl_barrier_wait_seconds", "Seconds from a barrier's first arrival (its opening) to its decision.",
            ("run",), buckets=BARRIER_WAIT_BUCKETS_S,
        )
        self.rounds = Counter(
            r, "elasticrl_rendezvous_rounds_total", "Rendezvous rounds decided, by outcome: complete or timeout.",
            ("run", "outcome"),
        )
        # -- scheduler
        self.requeued = Counter(
            r, "elasticrl_scheduler_tasks_requeued_total",
            "Tasks queued again (their worker was evicted, disconnected, released them or let the task lease lapse).",
            ("run",),
        )
        self.accepted = Counter(
            r, "elasticrl_scheduler_results_accepted_total", "Task results (groups) accepted and stored.", ("run",)
        )
        self.refused = Counter(
            r, "elasticrl_scheduler_results_refused_total",
            "Task results refused, by reason: duplicate, fenced, sealed or unknown (no such task).",
            ("run", "reason"),
        )
        self.env_errors = Counter(
            r, "elasticrl_scheduler_env_errors_total",
            "Episodes whose environment raised or passed its step deadline (their group is retried or given up).",
            ("run",),
        )
        self.trajectory_bytes = Counter(
            r, "elasticrl_scheduler_trajectory_bytes_total",
            "Bytes of accepted results (completion ids, logprobs and texts of every sample).",
            ("run",),
        )
        self.sealed = Counter(r, "elasticrl_scheduler_iterations_sealed_total", "Iterations sealed.", ("run",))
        self.seal_time = Histogram(
            r, "elasticrl_scheduler_seal_seconds", "Seconds from an iteration's submit to its seal.",
            ("run",), buckets=SEAL_BUCKETS_S,
        )
        self._state = _StateGauges()
        r.register(self._state)

    def watch(self, membership: MembershipReader, scheduler: SchedulerReader | None = None) -> None:
        """Fill the state-derived gauges from ``membership()`` (and ``scheduler()``) at every scrape.
        Scrapes call them on the endpoint's thread: hand over thread-safe readers (``read_on_loop``)."""
        self._state.membership = membership
        self._state.scheduler = scheduler

    def forget_run(self, run_id: str) -> None:
        """Drop every counter and histogram child labelled ``run=run_id`` (call it when the run is
        pruned: ``prometheus_client`` keeps a child until told). The state gauges need nothing:
        they show what the readers return."""
        for family in vars(self).values():
            if isinstance(family, _Labelled) and "run" in family.labelnames:
                family.forget(run=run_id)

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every metric, as ``/metrics`` serves it by default."""
        return prometheus_client.generate_latest(self.registry).decode()


# -- HTTP endpoint --------------------------------------------------------------------------------


class _Handler(WSGIRequestHandler):
    """One connection; its socket timeout bounds every read and write of a slow or silent client."""

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s
        super().setup()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("metrics endpoint %s: " + format, self.address_string(), *args)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection (daemon threads: a stuck scrape never holds the process up)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, read_timeout_s: float):
        self.address_family = family  # before TCPServer.__init__ makes the socket
        self.read_timeout_s = read_timeout_s
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup); the WSGI environ's
        # SERVER_NAME does not need it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics endpoint: connection from %s failed", client_address, exc_info=True)


class MetricsEndpoint:
    """``GET /metrics`` (the registry, by ``prometheus_client.make_wsgi_app``) and ``GET /healthz``
    on one port, served from a daemon thread. ``start`` binds (OSError names the address and the
    fix), ``stop`` closes the socket and waits for the serving thread.

    ``/healthz`` answers 200 "ok", or 503 with the reason ``unhealthy()`` gives (called on the
    endpoint's thread; None means healthy): the server's says "starting" until gRPC serves and
    "stalled" when its event loop has not ticked for a while, so a liveness probe on it restarts a
    hung coordinator, not only a dead one."""

    READ_TIMEOUT_S = 5.0
    POLL_S = 0.1  # how often the serving thread checks for stop

    def __init__(self, registry: prometheus_client.CollectorRegistry, host: str, port: int, *,
                 unhealthy: Callable[[], str | None] = lambda: None):
        self.registry = registry
        self.unhealthy = unhealthy
        self.host = host
        self.requested_port = port
        self.port = 0
        self._metrics_app = prometheus_client.make_wsgi_app(registry)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        try:
            family, *_ = socket.getaddrinfo(self.host, self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            self._server = _Server((self.host, self.requested_port), family, self.READ_TIMEOUT_S)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise OSError(
                f"metrics_port: could not bind {self.host}:{self.requested_port} for the metrics endpoint ({why}): "
                "the port is in use or the host is not an address of this machine (--metrics-port 0 picks a free port)"
            ) from None
        self._server.set_app(self.app)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": self.POLL_S}, name=f"metrics-{self.port}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Blocks for up to ``POLL_S`` plus the thread's exit: from a coroutine, run it in a thread."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("metrics endpoint on %s did not stop within %.1fs", self.address, timeout_s)
        self._server = None

    def app(self, environ: dict, start_response: Callable) -> list[bytes]:
        """The WSGI app: routing and methods here, the exposition by ``prometheus_client``."""
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path not in ("/metrics", "/healthz"):
            return _reply(start_response, "404 Not Found", b"not found: try /metrics or /healthz\n")
        if method != "GET":
            return _reply(start_response, "405 Method Not Allowed", b"only GET is allowed\n", [("Allow", "GET")])
        if path == "/healthz":
            why = self.unhealthy()
            if why is not None:
                return _reply(start_response, "503 Service Unavailable", f"unhealthy: {why}\n".encode())
            return _reply(start_response, "200 OK", b"ok\n")
        try:
            return self._metrics_app(environ, start_response)  # builds the body before start_response
        except Exception:  # noqa: BLE001 - one bad scrape must not stop the endpoint
            log.exception("metrics endpoint: building the answer failed")
            return _reply(start_response, "500 Internal Server Error", b"see the coordinator log\n")


def _reply(start_response: Callable, status: str, body: bytes, headers: list[tuple[str, str]] = ()) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))), *headers])
    return [body]
