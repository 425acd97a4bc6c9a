"""Prometheus metrics of the coordinator: a tiny registry, the text exposition, an HTTP endpoint.

The coordinator is watched by operators who already run Prometheus, so it speaks the text
exposition format 0.0.4, written here by hand (no client library: the format is a few lines and
one more dependency is not worth it). ``Metrics`` is the one registry of a coordinator process:
``CoordinatorCore`` and ``SchedulerCore`` increment its counters and histograms where a decision
is applied (a member evicted, a barrier decided, a result accepted, an iteration sealed), and the
gauges that merely mirror state (members by state, epochs, queued tasks, connected workers) are
refilled from the cores at scrape time, so they can never drift from what the cores hold.

``MetricsEndpoint`` serves ``GET /metrics`` and ``GET /healthz`` from the coordinator's own asyncio
loop (``asyncio.start_server``), which is the loop the cores live on: a scrape reads their state
between two of their steps and needs no locks. It is minimal HTTP/1.1 (one request per connection,
``Connection: close``) with a deadline on every read and write. It does NOT check the gRPC token:
bind it to an internal interface (the default is the coordinator's own ``--host``).

Counters count since this process started (a restarted coordinator starts them at zero, as
Prometheus expects of counters); what survives a restart is in the cores' state, not here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cores import this module; it reads them only at scrape time
    from elasticrl.coordinator.core import CoordinatorCore
    from elasticrl.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_RESERVED_LABELS = frozenset({"amount", "value"})

# Barriers are released in milliseconds when everyone is there and wait up to their timeout
# (600 s by default) when someone is not; iterations seal in seconds to an hour.
BARRIER_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800)
SEAL_BUCKETS_S = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


# -- exposition format ----------------------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value as Prometheus parses it: integers without a fraction, ``+Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    """Backslash, double quote and line feed are the three characters a label value escapes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text escapes backslash and line feed (a double quote stays as it is)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


# -- metric families ------------------------------------------------------------------------------


class _Family:
    """One metric name with its HELP text and label names; samples keyed by label values."""

    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()):
        if not _METRIC_NAME.match(name):
            raise ValueError(f"name: {name!r} is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"labelnames: {label!r} of {name} is not a label name ([a-zA-Z_][a-zA-Z0-9_]*, no '__' prefix)")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"labelnames: {name} repeats a label name: {list(labelnames)}")
        if set(labelnames) & _RESERVED_LABELS:
            raise ValueError(f"labelnames: {name} may not use {sorted(_RESERVED_LABELS)} (they name the arguments of inc/set)")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        try:
            return tuple(str(labels[n]) for n in self.labelnames)
        except KeyError:
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}") from None

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class _Scalar(_Family):
    """A family whose samples are single numbers (counters and gauges)."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help_text, labelnames)
        self.values: dict[tuple[str, ...], float] = {}

    def value(self, **labels: str) -> float:
        """The current value (0 if never touched); for tests and for reading back."""
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        lines = self.header()
        if not self.labelnames and not self.values:
            lines.append(f"{self.name} 0")  # an unlabelled metric exists from the start
        for key in sorted(self.values):
            lines.append(f"{self.name}{_labels(self.labelnames, key)} {format_value(self.values[key])}")
        return lines


class Counter(_Scalar):
    """Only goes up. Prometheus convention: the name ends in ``_total``."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up (inc by {amount})")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(_Scalar):
    """Goes up and down; the coordinator's gauges are mostly refilled from state at scrape time."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def clear(self) -> None:
        """Forget every label set (before a refill, so vanished ones disappear)."""
        self.values.clear()


class Histogram(_Family):
    """Observations counted into fixed upper-bound buckets; rendered cumulative with ``+Inf``,
    ``_sum`` and ``_count``, as Prometheus' ``histogram_quantile`` expects."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (), *, buckets: Iterable[float]):
        if "le" in labelnames:
            raise ValueError(f"labelnames: {name} may not use 'le' (it is the bucket label)")
        super().__init__(name, help_text, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or len(set(bounds)) != len(bounds) or any(math.isnan(b) for b in bounds):
            raise ValueError(f"buckets: {name} needs distinct, non-NaN bucket bounds, got {list(buckets)}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # label values -> (per-bucket counts, not cumulative; sum of observations)
        self.samples: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        sample = self.samples.get(key)
        if sample is None:
            sample = self.samples[key] = ([0] * len(self.bounds), [0.0])
        counts, total = sample
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                counts[i] += 1
                break
        else:  # NaN: counted in +Inf only, like the official clients
            counts[-1] += 1
        total[0] += value

    def count(self, **labels: str) -> int:
        sample = self.samples.get(self._key(labels))
        return 0 if sample is None else sum(sample[0])

    def sum(self, **labels: str) -> float:
        sample = self.samples.get(self._key(labels))
        return 0.0 if sample is None else sample[1][0]

    def lines(self) -> list[str]:
        lines = self.header()
        keys = sorted(self.samples)
        if not self.labelnames and not keys:
            keys = [()]
        for key in keys:
            counts, total = self.samples.get(key, ([0] * len(self.bounds), [0.0]))
            cumulative = 0
            for bound, n in zip(self.bounds, counts):
                cumulative += n
                le = f'le="{format_value(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {format_value(total[0])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {cumulative}")
        return lines


class Registry:
    """Metric families in registration order, plus collectors run before each render (they refill
    gauges from live state)."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}
        self.collectors: list[Callable[[], None]] = []

    def _add(self, family):
        if family.name in self.families:
            raise ValueError(f"name: {family.name} is registered twice")
        self.families[family.name] = family
        return family

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labelnames))

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help_text, labelnames))

    def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (), *, buckets: Iterable[float]) -> Histogram:
        return self._add(Histogram(name, help_text, labelnames, buckets=buckets))

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every family, after running the collectors."""
        for collect in self.collectors:
            try:
                collect()
            except Exception:  # noqa: BLE001 - a collector's bug must not take the scrape down
                log.exception("metrics collector %r failed; its gauges may be stale", collect)
        lines: list[str] = []
        for family in self.families.values():
            lines += family.lines()
        return "\n".join(lines) + "\n"


class Metrics(Registry):
    """Every metric of one coordinator process. The cores hold it as ``.metrics`` and count into
    it; ``watch`` makes the state-derived gauges refill from them at scrape time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.started_at = clock()
        self.uptime = self.gauge("elasticrl_coordinator_uptime_seconds", "Seconds since this coordinator process started.")
        self.rpcs = self.counter(
            "elasticrl_rpcs_received_total",
            "gRPC calls received, by service and method, including calls refused for a wrong token "
            "(counted only while the metrics endpoint is on; a method this server lacks counts as unknown).",
            ("service", "method"),
        )
        # -- membership
        self.members = self.gauge("elasticrl_members", "Members of each run by state (live, left, evicted).", ("run", "state"))
        self.joins = self.counter("elasticrl_member_joins_total", "Members admitted (new incarnations).", ("run",))
        self.leaves = self.counter("elasticrl_member_leaves_total", "Members that left on their own.", ("run",))
        self.evictions = self.counter(
            "elasticrl_member_evictions_total",
            "Members evicted, by reason: lease_expired, missed_barrier or replaced (a newer incarnation joined).",
            ("run", "reason"),
        )
        self.epoch = self.gauge("elasticrl_run_epoch", "Membership epoch of each run (bumped by every change).", ("run",))
        # -- barriers and rendezvous rounds
        self.barriers_open = self.gauge("elasticrl_barriers_open", "Barriers opened and not yet decided.", ("run",))
        self.barriers_decided = self.counter(
            "elasticrl_barriers_decided_total", "Barriers decided, by outcome: completed or timed_out.", ("run", "outcome")
        )
        self.barrier_wait = self.histogram(
            "elasticrl_barrier_wait_seconds",
            "Seconds from a barrier's first arrival (its opening) to its decision.",
            ("run",),
            buckets=BARRIER_WAIT_BUCKETS_S,
        )
        self.rounds = self.counter(
            "elasticrl_rendezvous_rounds_total", "Rendezvous rounds decided, by outcome: complete or timeout.", ("run", "outcome")
        )
        # -- scheduler
        self.iteration = self.gauge("elasticrl_scheduler_iteration", "Newest submitted iteration of each run.", ("run",))
        self.tasks = self.gauge(
            "elasticrl_scheduler_tasks",
            "Tasks of each run's newest iteration by state: queued, running, done, dropped, failed.",
            ("run", "state"),
        )
        self.workers = self.gauge(
            "elasticrl_scheduler_workers", "Rollout workers with an open Work stream that are not fenced.", ("run",)
        )
        self.requeued = self.counter(
            "elasticrl_scheduler_tasks_requeued_total",
            "Tasks queued again (their worker was evicted, disconnected, released them or let the task lease lapse).",
            ("run",),
        )
        self.accepted = self.counter(
            "elasticrl_scheduler_results_accepted_total", "Task results (groups) accepted and stored.", ("run",)
        )
        self.refused = self.counter(
            "elasticrl_scheduler_results_refused_total",
            "Task results refused, by reason: duplicate, fenced, sealed or unknown (no such task).",
            ("run", "reason"),
        )
        self.env_errors = self.counter(
            "elasticrl_scheduler_env_errors_total",
            "Episodes whose environment raised or passed its step deadline (their group is retried or given up).",
            ("run",),
        )
        self.trajectory_bytes = self.counter(
            "elasticrl_scheduler_trajectory_bytes_total",
            "Bytes of accepted results (completion ids, logprobs and texts of every sample).",
            ("run",),
        )
        self.sealed = self.counter("elasticrl_scheduler_iterations_sealed_total", "Iterations sealed.", ("run",))
        self.seal_time = self.histogram(
            "elasticrl_scheduler_seal_seconds",
            "Seconds from an iteration's submit to its seal.",
            ("run",),
            buckets=SEAL_BUCKETS_S,
        )
        self.collectors.append(self._collect_uptime)

    def _collect_uptime(self) -> None:
        self.uptime.set(self.clock() - self.started_at)

    def watch(self, coord: CoordinatorCore, scheduler: SchedulerCore | None = None) -> None:
        """Refill the state-derived gauges from ``coord`` (and ``scheduler``) at every scrape."""

        def collect() -> None:
            for gauge in (self.members, self.epoch, self.barriers_open):
                gauge.clear()
            for run_id, run in coord.runs.items():
                self.epoch.set(run.epoch, run=run_id)
                self.barriers_open.set(len(run.open_barriers), run=run_id)
                states = collections.Counter(m.status.value for m in run.members.values())
                for state in ("live", "left", "evicted"):
                    self.members.set(states.get(state, 0), run=run_id, state=state)

        self.collectors.append(collect)
        if scheduler is not None:
            self.collectors.append(lambda: self._collect_scheduler(scheduler))

    def _collect_scheduler(self, scheduler: SchedulerCore) -> None:
        for gauge in (self.iteration, self.tasks, self.workers):
            gauge.clear()
        for run_id, conns in scheduler.conns.items():
            self.workers.set(sum(1 for c in conns.values() if not c.closed and not c.worker.fenced), run=run_id)
        for run_id in list(scheduler.iterations):
            it = scheduler.latest(run_id)
            if it is None:
                continue
            self.iteration.set(it.iteration, run=run_id)
            states = collections.Counter(t.status.value for t in it.tasks.values())
            for state in ("queued", "running", "done", "dropped", "failed"):
                self.tasks.set(states.get(state, 0), run=run_id, state=state)


# -- HTTP endpoint --------------------------------------------------------------------------------


class MetricsEndpoint:
    """``GET /metrics`` (the exposition) and ``GET /healthz`` ("ok") over minimal HTTP/1.1 on the
    running asyncio loop. ``start`` binds (OSError names the address), ``stop`` closes."""

    READ_TIMEOUT_S = 5.0
    WRITE_TIMEOUT_S = 10.0
    MAX_HEAD_BYTES = 16 << 10
    MAX_CONNECTIONS = 64

    def __init__(self, registry: Registry, host: str, port: int):
        self.registry = registry
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._connections = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._handle, self.host, self.requested_port, limit=self.MAX_HEAD_BYTES, reuse_address=True
            )
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise OSError(
                f"metrics_port: could not bind {self.host}:{self.requested_port} for the metrics endpoint ({why}): "
                "the port is in use or the host is not an address of this machine (--metrics-port 0 picks a free port)"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, timeout_s: float = 2.0) -> None:
        if self._server is None:
            return
        self._server.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("metrics endpoint on %s did not close within %.1fs", self.address, timeout_s)
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        try:
            if self._connections > self.MAX_CONNECTIONS:
                await self._respond(writer, 503, "Service Unavailable", b"too many scrapes at once\n")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self._respond(writer, 408, "Request Timeout", b"no request within the read deadline\n")
                return
            except asyncio.LimitOverrunError:
                await self._respond(writer, 431, "Request Header Fields Too Large", b"request head too large\n")
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client went away
            try:
                status, reason, body, headers = self.route(head)
            except Exception:  # noqa: BLE001 - one bad scrape must not stop the endpoint
                log.exception("metrics endpoint: building the answer failed")
                status, reason, body, headers = 500, "Internal Server Error", b"see the coordinator log\n", {}
            await self._respond(writer, status, reason, body, headers)
        except (ConnectionError, asyncio.TimeoutError):
            writer.transport.abort()  # a client that stops reading loses its answer, nothing else
        finally:
            self._connections -= 1
            writer.close()

    def route(self, head: bytes) -> tuple[int, str, bytes, dict[str, str]]:
        """(status, reason, body, extra headers) for one request head."""
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "Bad Request", b"malformed request line\n", {}
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz"):
            return 404, "Not Found", b"not found: try /metrics or /healthz\n", {}
        if method != "GET":
            return 405, "Method Not Allowed", b"only GET is allowed\n", {"Allow": "GET"}
        if path == "/healthz":
            return 200, "OK", b"ok\n", {}
        return 200, "OK", self.registry.render().encode(), {"Content-Type": CONTENT_TYPE}

    async def _respond(
        self, writer: asyncio.StreamWriter, status: int, reason: str, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        fields = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body)), "Connection": "close"}
        fields.update(headers or {})
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        writer.write(head.encode("latin-1") + body)
        await asyncio.wait_for(writer.drain(), self.WRITE_TIMEOUT_S)
