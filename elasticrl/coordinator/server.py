"""The ``elasticrl coordinator`` process: a grpc.aio server around ``CoordinatorCore``, and the
one composition root of the coordinator process.

Here, and only here, the coordinator core, the scheduler core and the metrics meet: the server
builds ``Metrics`` and hands it to the core (the scheduler core counts into the same one), and
hands the metrics the readers of the state-derived gauges (``membership_gauges``,
``scheduler_gauges``). No other module of ``elasticrl.coordinator`` imports ``elasticrl.scheduler``.

It binds to 127.0.0.1 unless told otherwise, serves the standard gRPC health service, checks a
shared token when ``--token-file`` is given, uses TLS when ``--tls-cert/--tls-key`` are, ticks the
core (lease expiry, barrier and round deadlines) every ``tick_s``, and shuts down cleanly on
SIGTERM/SIGINT. With ``--metrics-port`` it also serves Prometheus metrics over HTTP
(``coordinator.metrics``); the gauges are read on the event loop the cores live on.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hmac
import logging
import os
import pathlib
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from elasticrl.coordinator import policy, validate, wire
from elasticrl.coordinator.core import DEFAULT_STREAM_GRACE_S, CoordinatorCore, Limits
from elasticrl.coordinator.metrics import Metrics, MetricsEndpoint, RunGauges, SchedulerGauges, read_on_loop
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.replies import DEFAULT_KEEP as DEFAULT_KEEP_REQUEST_IDS
from elasticrl.coordinator.service import CoordinatorServicer, add_to_server, quiet_unsent_replies
from elasticrl.scheduler import service as scheduler_service
from elasticrl.scheduler.core import DEFAULT_KEEP_ITERATIONS, KEEP_SEALED_GROUPS, SchedulerCore
from elasticrl.scheduler.store import TrajectoryStore
from elasticrl.scheduler.weights import DEFAULT_MAX_BLOB_BYTES, DEFAULT_MAX_UPLOADS, DIR_NAME as WEIGHTS_DIR, WeightStore

log = logging.getLogger(__name__)

SERVICE_NAME = "elasticrl.v1.Coordinator"
MAX_MESSAGE_BYTES = 64 << 20
# The longest default member lease (and stream grace) a coordinator takes, seconds: the longest a
# member may ask for in its Join (an hour).
MAX_LEASE_TTL_S = validate.MAX_LEASE_TTL_MS / 1000
TRAJECTORY_DIR = "trajectories"
STATE_FILE = "coordinator.sqlite"
# GET /healthz fails once the event loop has not ticked for this long: a loop that busy answers
# nobody (a tick runs every --tick; a join storm of thousands delays it by a second or two).
HEALTH_STALL_S = 15.0


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ] + SERVER_OPTIONS


SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclasses.dataclass(kw_only=True)
class CoordinatorConfig:
    """Settings of one coordinator process (each maps to an ``elasticrl coordinator`` flag)."""

    host: str = "127.0.0.1"
    """Interface to bind. 0.0.0.0 exposes the coordinator to the network: use a token and TLS."""
    port: int = 50051
    """TCP port; 0 picks a free one (written to ``port_file``)."""
    state_dir: str | None = None
    """Directory for the SQLite state; None keeps state in memory only (lost on restart)."""
    lease_ttl_s: float = 5.0
    """Default member lease, seconds: a member silent this long is evicted."""
    tick_s: float = 0.05
    stream_grace_s: float = DEFAULT_STREAM_GRACE_S
    """A member whose stream (Session, Work) broke, rather than being closed, is evicted unless it
    reopens one within this many seconds: a killed process is noticed at once, not a lease later."""
    """How often leases and deadlines are checked, seconds (eviction lags the TTL by at most this)."""
    token_file: str | None = None
    """File whose first line is the shared token every call must carry."""
    tls_cert: str | None = None
    """PEM certificate chain; with ``tls_key``, serve TLS only."""
    tls_key: str | None = None
    """PEM private key for ``tls_cert``."""
    fsync: bool = False
    """SQLite synchronous=FULL: survive power loss, at a cost per write."""
    port_file: str | None = None
    """Write the bound port here once serving (atomically), for scripts that bind port 0."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest gRPC message accepted or sent, bytes (trajectory batches are the big ones);
    workers must batch below it (``RolloutWorker(max_message_bytes=...)``)."""
    max_kv_value_bytes: int = validate.MAX_VALUE_BYTES
    """Largest KV value accepted by set and compare-and-set, bytes; the KV store (and the
    ``CoordinatorStore`` over it) is for control data, so larger values are refused."""
    metrics_port: int | None = None
    """TCP port of the Prometheus endpoint (``GET /metrics``, ``GET /healthz``); None: no endpoint,
    0: a free one (written to ``metrics_port_file``). It does not check the token: keep it internal."""
    metrics_host: str | None = None
    """Interface of the metrics endpoint; None: the same as ``host``."""
    metrics_port_file: str | None = None
    """Write the bound metrics port here once it serves (atomically, before ``port_file``)."""
    max_weight_uploads: int = DEFAULT_MAX_UPLOADS
    """Weight uploads (PublishWeights streams) received at once; one more is refused with
    RESOURCE_EXHAUSTED. Each spools to a temp file under the state dir (or a temp dir), not memory."""
    max_weights_bytes: int = DEFAULT_MAX_BLOB_BYTES
    """Largest policy-weights blob a trainer may publish through this coordinator
    (``rollout.weights_transfer = "coordinator"``), bytes; a larger one is refused with
    RESOURCE_EXHAUSTED. The relay transfer does not pass through the coordinator."""
    keep_iterations: int = DEFAULT_KEEP_ITERATIONS
    """Sealed iterations kept per run; older ones leave memory and SQLite, their shards are deleted
    (manifests stay; up to 2 GiB of their files are kept to be overwritten by new shards, recycle.py)."""
    keep_barriers: int = 1000
    """Decided barriers kept per run; older ones are forgotten."""
    keep_request_ids: int = DEFAULT_KEEP_REQUEST_IDS
    """Request ids whose results are kept to answer retries (exactly-once); the oldest go first."""
    max_runs: int = 1000
    """Runs held at once; at the limit a new run replaces the oldest closed run with no live
    member, or is refused."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port (0-65535)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is not a TCP port (0-65535; 0 picks a free one)")
        for name in ("metrics_port_file", "metrics_host"):
            if getattr(self, name) is not None and self.metrics_port is None:
                raise ValueError(f"{name}: needs metrics_port (pass --metrics-port, 0 for a free one)")
        if not 0.1 <= self.lease_ttl_s <= MAX_LEASE_TTL_S:  # nan fails too
            raise ValueError(f"lease_ttl_s: {self.lease_ttl_s}s must be between 0.1 s and {MAX_LEASE_TTL_S:g} s (an hour)")
        if not 0 <= self.stream_grace_s <= MAX_LEASE_TTL_S:
            raise ValueError(f"stream_grace_s: {self.stream_grace_s}s must be between 0 (evict at the next tick) and "
                             f"{MAX_LEASE_TTL_S:g} s")
        if not 0.001 <= self.tick_s <= self.lease_ttl_s:
            raise ValueError(f"tick_s: {self.tick_s}s must be between 1 ms and the lease TTL ({self.lease_ttl_s}s)")
        if not 1 << 20 <= self.max_message_bytes <= 2**31 - 1:
            raise ValueError(f"max_message_bytes: {self.max_message_bytes} must be between 1 MiB and 2 GiB - 1")
        if not 1 <= self.max_kv_value_bytes < self.max_message_bytes:
            raise ValueError(
                f"max_kv_value_bytes: {self.max_kv_value_bytes} must be between 1 and the largest gRPC message "
                f"({self.max_message_bytes} bytes) - 1; raise --max-message-mb too for larger values"
            )
        for name in ("keep_barriers", "keep_request_ids", "max_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.keep_iterations < KEEP_SEALED_GROUPS:
            raise ValueError(f"keep_iterations: {self.keep_iterations} must be >= {KEEP_SEALED_GROUPS} (trainers fetch the newest two)")
        if self.max_weights_bytes < 1 << 20:
            raise ValueError(f"max_weights_bytes: {self.max_weights_bytes} must be at least 1 MiB")
        if self.max_weight_uploads < 1:
            raise ValueError(f"max_weight_uploads: {self.max_weight_uploads} must be >= 1 (uploads received at once)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: pass both or neither")
        for name in ("port_file", "metrics_port_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{name}: the directory of {path} does not exist")

    def read_token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            token = wire.read_token_file(self.token_file)
        except OSError as exc:
            raise ValueError(f"token_file: cannot read {self.token_file!r}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"token_file: {self.token_file} has no token on its first line")
        return token


def read_tls(cert: str, key: str) -> grpc.ServerCredentials:
    """Server credentials from PEM files, checked first: gRPC reports a certificate it cannot use
    only as a failed bind (which read as "the port is in use").

    Raises:
        ValueError: a file cannot be read, or they are not a PEM certificate chain and its key.
    """
    import ssl

    data = {}
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            data[name] = pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        # An empty password: an encrypted key fails here (gRPC cannot use one) instead of OpenSSL
        # prompting on the terminal for a passphrase.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls_cert/tls_key: {cert} and {key} are not a PEM certificate chain and its private key ({exc})") from None
    return grpc.ssl_server_credentials([(data["tls_key"], data["tls_cert"])])


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls whose ``authorization`` metadata is not ``Bearer <token>`` (health is exempt)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        message = "missing or wrong token (send 'authorization: Bearer <token>')"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        if handler is not None and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


class RpcCountInterceptor(grpc.aio.ServerInterceptor):
    """Count received calls per method into ``Metrics.rpcs``. It must be the innermost interceptor:
    then its continuation is the server's own handler lookup, which finds nothing for a method the
    server does not serve, and such calls count as ``unknown``. So the label set stays the served
    methods whatever names a caller (with or without the token) sends."""

    def __init__(self, metrics: Metrics):
        self._rpcs = metrics.rpcs

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").partition("/")
        if handler is None or not method:
            service = method = "unknown"
        self._rpcs.inc(service=service, method=method)
        return handler


def membership_gauges(core: CoordinatorCore) -> list[RunGauges]:
    """What the membership gauges show of ``core`` now (call it on the core's event loop)."""
    return [
        RunGauges(
            run_id=run_id,
            epoch=run.epoch,
            barriers_open=len(run.open_barriers),
            members=collections.Counter(m.status.value for m in run.members.values()),
        )
        for run_id, run in core.runs.items()
    ]


def scheduler_gauges(scheduler: SchedulerCore) -> list[SchedulerGauges]:
    """What the scheduler gauges show of ``scheduler`` now (call it on the core's event loop)."""
    rows = []
    for run_id in scheduler.conns.keys() | scheduler.iterations.keys():
        conns = scheduler.conns.get(run_id, {})
        workers = sum(1 for c in conns.values() if not c.closed and not c.worker.fenced)
        it = scheduler.latest(run_id)
        if it is None:
            rows.append(SchedulerGauges(run_id=run_id, workers=workers))
        else:
            tasks = collections.Counter(t.status.value for t in it.tasks.values())
            rows.append(SchedulerGauges(run_id=run_id, workers=workers, iteration=it.iteration, tasks=tasks))
    return rows


class CoordinatorServer:
    """Owns the gRPC server, the core and the tick task. ``start`` then ``wait_closed`` or ``stop``."""

    def __init__(self, config: CoordinatorConfig, *, limits: Limits | None = None):
        self.config = config
        state_path = None
        if config.state_dir is not None:
            try:
                os.makedirs(config.state_dir, exist_ok=True)
            except OSError as exc:
                raise OSError(f"state_dir: cannot create the directory {config.state_dir}: {exc.strerror or exc}") from None
            state_path = os.path.join(config.state_dir, STATE_FILE)
        self.db = StateDB(state_path, fsync=config.fsync)
        # Counted into whether or not an endpoint serves it; the scheduler core shares the core's.
        self.metrics = Metrics()
        limits = limits or Limits(keep_decided_barriers=config.keep_barriers, max_runs=config.max_runs)
        self.core = CoordinatorCore(
            self.db, lease_ttl_s=config.lease_ttl_s, limits=limits, metrics=self.metrics,
            keep_request_ids=config.keep_request_ids, stream_grace_s=config.stream_grace_s,
        )
        token = config.read_token()
        interceptors = [TokenInterceptor(token)] if token else []
        self.metrics_endpoint: MetricsEndpoint | None = None
        if config.metrics_port is not None:
            # Last, so innermost: it sees the real handler lookup (see RpcCountInterceptor).
            interceptors.append(RpcCountInterceptor(self.metrics))
        quiet_unsent_replies()
        self.server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
        add_to_server(CoordinatorServicer(self.core, max_kv_value_bytes=config.max_kv_value_bytes), self.server)
        trajectories = None if config.state_dir is None else os.path.join(config.state_dir, TRAJECTORY_DIR)
        self.scheduler = SchedulerCore(
            self.core, TrajectoryStore(trajectories, fsync=config.fsync), keep_iterations=config.keep_iterations
        )
        weights_dir = None if config.state_dir is None else os.path.join(config.state_dir, WEIGHTS_DIR)
        self.weights = WeightStore(weights_dir, fsync=config.fsync, max_uploads=config.max_weight_uploads,
                                   max_blob_bytes=config.max_weights_bytes)
        self.core.run_dropped_listeners.append(self.weights.drop_run)
        scheduler_service.add_to_server(scheduler_service.SchedulerServicer(
            self.scheduler, weights=self.weights, max_message_bytes=config.max_message_bytes), self.server)
        if config.metrics_port is not None:
            self.metrics_endpoint = MetricsEndpoint(
                self.metrics.registry, config.metrics_host or config.host, config.metrics_port, unhealthy=self.unhealthy
            )
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{config.host}:{config.port}"
        credentials = read_tls(config.tls_cert, config.tls_key) if config.tls_cert else None
        try:
            if credentials is not None:
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc reports a failed bind this way
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind {address}: the port is in use or the host is not an address of this machine")
        self._tick_task: asyncio.Task | None = None
        self._ticked: float | None = None  # time.monotonic() of the last tick; None until gRPC serves
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def unhealthy(self) -> str | None:
        """Why ``/healthz`` should fail, None if it should not (any thread): not serving yet, stopping,
        or an event loop that has not ticked for ``HEALTH_STALL_S``."""
        ticked = self._ticked
        if self._stopped.is_set():
            return "stopping"
        if ticked is None:
            return "starting"
        silent = time.monotonic() - ticked
        if silent > max(HEALTH_STALL_S, 3 * self.config.tick_s):  # a --tick that long is allowed
            return f"stalled: the event loop has not ticked for {silent:.0f}s (tick every {self.config.tick_s:g}s)"
        return None

    async def start(self) -> None:
        if self.metrics_endpoint is not None:  # first: a port clash fails before gRPC serves
            # Scrapes run on the endpoint's threads; the cores are read on their own loop.
            loop = asyncio.get_running_loop()
            self.metrics.watch(
                read_on_loop(loop, functools.partial(membership_gauges, self.core)),
                read_on_loop(loop, functools.partial(scheduler_gauges, self.scheduler)),
            )
            self.metrics_endpoint.start()
            if self.config.metrics_port_file:
                write_port_file(self.config.metrics_port_file, self.metrics_endpoint.port, "metrics_port_file")
            log.info("metrics on http://%s/metrics (no token check)", self.metrics_endpoint.address)
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._tick_task = asyncio.create_task(self._tick_loop(), name="coordinator-tick")
        if self.config.port_file:
            write_port_file(self.config.port_file, self.port)
        log.info(
            "elasticrl coordinator serving on %s (%s, lease ttl %.3fs, state %s%s)",
            self.address,
            "tls" if self.config.tls_cert else "plaintext",
            self.config.lease_ttl_s,
            self.db.path or "in memory (not durable)",
            ", token required" if self.config.token_file else "",
        )

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            late = loop.time() - due
            credit = policy.stall_credit(late, tick_s=self.config.tick_s)
            if credit:
                (log.warning if credit >= 1.0 else log.debug)(
                    "the coordinator was too busy to read for %.2fs (its tick ran late); every live lease is extended by "
                    "that much, so no member is evicted for keep-alives still waiting in its queues", credit)
            self._ticked = time.monotonic()
            try:
                self.core.tick(stalled_s=credit)
                self.scheduler.tick()
            except Exception:  # noqa: BLE001 - one bad tick must not stop eviction for good
                log.exception("coordinator tick failed; retrying next tick")
            due = loop.time() + self.config.tick_s
            await asyncio.sleep(self.config.tick_s)

    async def stop(self, grace_s: float = 2.0, *, announce: bool = True) -> None:
        """Stop serving (``announce``: log it; not for a start that failed, whose error says why)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        # The tick first: while the server refuses new calls for its grace, keep-alives cannot
        # arrive, and leases running out then evicted live members (persisted for the restart).
        if self._tick_task is not None:
            self._tick_task.cancel()
            try:
                await self._tick_task
            except asyncio.CancelledError:
                pass
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.metrics_endpoint is not None:
            await asyncio.to_thread(self.metrics_endpoint.stop)
        self.scheduler.save_counters()  # what the last tick had not written yet (it logs a failure)
        self.db.close()
        if announce:
            log.info("elasticrl coordinator on %s stopped", self.address)

    async def wait_closed(self) -> None:
        await self._stopped.wait()


def write_port_file(path: str, port: int, name: str = "port_file") -> None:
    """Write ``port`` to ``path`` atomically: a reader sees no file or the whole number.

    Raises:
        OSError: it could not be written; the message names ``name`` and the path.
    """
    tmp = f"{path}.tmp"
    try:
        pathlib.Path(tmp).write_text(f"{port}\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise OSError(f"{name}: cannot write {path}: {exc.strerror or exc}") from None


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one: every member's connection is a socket,
    and a cluster of 512 nodes x 8 GPUs opens thousands (the usual soft limit is 1024)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("open files limit stays %d (could not raise it to %d: %s)", soft, target, exc)
    return soft


async def serve(config: CoordinatorConfig) -> None:
    """Run a coordinator until SIGTERM or SIGINT."""
    limit = raise_open_files_limit()
    if 0 <= limit < 4096:
        log.warning("open files limit is %d: fewer than that many members can connect (ulimit -n)", limit)
    server = CoordinatorServer(config)
    try:
        await server.start()
    except BaseException:  # a port file that cannot be written, say: stop what started
        await server.stop(0, announce=False)
        raise
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received, shutting down")
    await server.stop()
