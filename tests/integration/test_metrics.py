"""``elasticrl coordinator --metrics-port``: a real coordinator subprocess scraped over HTTP while
real member and rollout-worker processes join, meet at a barrier, die (SIGKILL) and finish an
iteration; the counters must move by exactly what happened. Plus the endpoint's HTTP edges
(paths, methods, a silent client, a failing scrape) and the flags' error exits."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.coordinator.metrics import Metrics, MetricsEndpoint
from elasticrl.errors import AuthError
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.state import TaskSpec
from tests.conftest import REPO, wait_until
from tests.integration.prometheus import Samples, parse_exposition, value

pytestmark = pytest.mark.integration
MEMBER = pathlib.Path(__file__).with_name("member_proc.py")
WORKER = REPO / "bench" / "fake_rollout_worker.py"
TOKENS = 8
SAMPLES = 2
HTTP_TIMEOUT_S = 5

def with_metrics(coordinator_factory, tmp_path: pathlib.Path, *extra: str, **kwargs):
    """A coordinator serving metrics on a free port; returns (process, metrics port)."""
    port_file = tmp_path / f"metrics-port-{len(list(tmp_path.glob('metrics-port-*')))}"
    coord = coordinator_factory(extra_args=["--metrics-port", "0", "--metrics-port-file", str(port_file), *extra], **kwargs)
    # Written before the gRPC port file, which the factory has already waited for.
    port = wait_until(lambda: port_file.exists() and int(port_file.read_text()), 10, message="the metrics port file")
    return coord, port


def get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, dict, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method != "GET" else None)
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def scrape(port: int) -> Samples:
    status, headers, text = get(port)
    assert status == 200 and headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8", (status, headers)
    return parse_exposition(text)


class Proc:
    """A subprocess whose JSON lines go to a file (a test reads what it did before it died)."""

    def __init__(self, tmp: pathlib.Path, name: str, cmd: list[str]):
        self.out = tmp / f"{name}.jsonl"
        self.log = tmp / f"{name}.log"
        with open(self.out, "ab") as out, open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=log, env=dict(os.environ, PYTHONPATH=str(REPO)))

    def events(self, kind: str) -> list[dict]:
        lines = self.out.read_text().splitlines() if self.out.exists() else []
        return [e for e in map(json.loads, lines) if e.get("event") == kind]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def procs(tmp_path):
    made: list[Proc] = []

    def spawn(name: str, *cmd: str) -> Proc:
        p = Proc(tmp_path, name, [sys.executable, *cmd])
        made.append(p)
        return p

    yield spawn
    for p in made:
        p.stop()


def member_state(client: CoordinatorClient, run: str, member: str) -> str | None:
    for r in client.status(run, include_departed=True)["runs"]:
        for m in r["snapshot"].get("members", []) + r.get("departed", []):
            if m["member_id"] == member:
                return m["state"]
    return None


@pytest.mark.timeout(180)
def test_counters_move_with_joins_barrier_eviction_and_a_sealed_iteration(coordinator_factory, tmp_path, procs):
    coord, port = with_metrics(coordinator_factory, tmp_path)
    before = scrape(port)
    assert value(before, "elasticrl_member_evictions_total", run="m", reason="lease_expired") == 0
    assert value(before, "elasticrl_member_evictions_total", run="m", reason="stream_lost") == 0
    assert value(before, "elasticrl_coordinator_uptime_seconds") > 0
    assert ("elasticrl_barrier_wait_seconds_count", frozenset({("run", "m")})) not in before

    # Membership and a barrier: c joins first (so the barrier expects it), a and b arrive, c is
    # SIGKILLed; it is evicted and the barrier completes without it.
    c = procs("c", str(MEMBER), coord.address, "m", "c")
    wait_until(lambda: c.events("joined"), 20, message="c joining")
    a = procs("a", str(MEMBER), coord.address, "m", "a", "--barrier", "sync-1")
    b = procs("b", str(MEMBER), coord.address, "m", "b", "--barrier", "sync-1")
    wait_until(lambda: a.events("joined") and b.events("joined"), 20, message="a and b joining")
    wait_until(lambda: value(scrape(port), "elasticrl_barriers_open", run="m") == 1, 20, message="the barrier opening")
    mid = scrape(port)
    assert value(mid, "elasticrl_member_joins_total", run="m") == 3
    assert value(mid, "elasticrl_members", run="m", state="live") == 3
    assert value(mid, "elasticrl_run_epoch", run="m") == 3
    c.stop()
    for m in (a, b):
        wait_until(lambda: m.events("released"), 20, message="the barrier releasing a and b")
        assert m.events("released")[0]["evicted"] == ["c"]
    with CoordinatorClient(coord.address, call_timeout_s=5) as client:
        assert member_state(client, "m", "c") == "MEMBER_STATE_EVICTED"

    # A scheduler iteration on two fake rollout workers.
    run, n = "rollout", 6
    for w in ("w0", "w1"):
        procs(w, str(WORKER), "--coordinator", coord.address, "--run", run, "--member", w,
              "--task-s", "0.5", "--tokens", str(TOKENS))
    wait_until(lambda: value(scrape(port), "elasticrl_scheduler_workers", run=run) == 2, 30, message="two workers connected")
    with SchedulerClient(coord.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1, i], num_samples=SAMPLES) for i in range(n)])
        # One slot per worker and 0.5 s per task: for about 1.5 s tasks wait and run.
        during = scrape(port)
        manifest = client.wait_sealed(run, 1, timeout_s=60)
    tasks = {s: value(during, "elasticrl_scheduler_tasks", run=run, state=s) for s in ("queued", "running", "done")}
    assert tasks["queued"] + tasks["running"] > 0 and sum(tasks.values()) == n, tasks
    assert manifest["tasks_done"] == n, manifest

    after = scrape(port)
    # c is evicted once: by its broken keep-alive stream (0.5 s) or its 1 s lease, whichever is first.
    assert sum(value(after, "elasticrl_member_evictions_total", run="m", reason=r) for r in ("lease_expired", "stream_lost")) == 1
    assert value(after, "elasticrl_members", run="m", state="evicted") == 1
    assert value(after, "elasticrl_members", run="m", state="live") == 2
    assert value(after, "elasticrl_run_epoch", run="m") == 4
    assert value(after, "elasticrl_barriers_decided_total", run="m", outcome="completed") == 1
    assert value(after, "elasticrl_barriers_open", run="m") == 0
    assert value(after, "elasticrl_barrier_wait_seconds_count", run="m") == 1
    assert value(after, "elasticrl_barrier_wait_seconds_bucket", run="m", le="+Inf") == 1
    assert value(after, "elasticrl_scheduler_iteration", run=run) == 1
    assert value(after, "elasticrl_scheduler_tasks", run=run, state="done") == n
    assert value(after, "elasticrl_scheduler_tasks", run=run, state="queued") == 0
    assert value(after, "elasticrl_scheduler_results_accepted_total", run=run) == n
    # Each sample carries TOKENS int32 ids and TOKENS float32 logprobs, and no text.
    assert value(after, "elasticrl_scheduler_trajectory_bytes_total", run=run) == n * SAMPLES * TOKENS * 8
    assert value(after, "elasticrl_scheduler_iterations_sealed_total", run=run) == 1
    assert value(after, "elasticrl_scheduler_seal_seconds_count", run=run) == 1
    assert value(after, "elasticrl_scheduler_seal_seconds_bucket", run=run, le="+Inf") == 1
    assert value(after, "elasticrl_scheduler_seal_seconds_sum", run=run) > 0
    assert value(after, "elasticrl_rpcs_received_total", service="elasticrl.v1.Scheduler", method="SubmitIteration") >= 1
    assert value(after, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Join") >= 5

    # A clean SIGTERM closes the endpoint with the gRPC server.
    assert coord.stop() == 0
    with pytest.raises(urllib.error.URLError):
        get(port, "/healthz")


@pytest.mark.timeout(60)
def test_env_errors_and_given_up_tasks_are_counted(coordinator_factory, tmp_path, procs):
    """A worker whose first 3 attempts fail in their env (2 episodes each): one of 2 tasks is
    given up after max_task_failures = 2, the other is retried and done."""
    coord, port = with_metrics(coordinator_factory, tmp_path)
    run = "f"
    procs("w", str(WORKER), "--coordinator", coord.address, "--run", run, "--member", "w", "--task-s", "0.01",
          "--fail-first", "3")
    wait_until(lambda: value(scrape(port), "elasticrl_scheduler_workers", run=run) == 1, 30, message="the worker connected")
    with SchedulerClient(coord.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1, i], num_samples=SAMPLES) for i in range(2)],
                                max_task_failures=2)
        manifest = client.wait_sealed(run, 1, timeout_s=30)
    assert (manifest["tasks_done"], manifest["tasks_failed"], manifest["env_errors"]) == (1, 1, 6), manifest
    assert manifest["errors"] == [f"env fake.step() raised RuntimeError: attempt {k}" for k in (1, 2, 3)]
    after = scrape(port)
    assert value(after, "elasticrl_scheduler_env_errors_total", run=run) == 6
    assert value(after, "elasticrl_scheduler_tasks", run=run, state="failed") == 1
    assert value(after, "elasticrl_scheduler_tasks", run=run, state="done") == 1


@pytest.mark.timeout(60)
def test_other_paths_and_methods_and_the_token(coordinator_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    coord, port = with_metrics(coordinator_factory, tmp_path, "--token-file", str(token_file))
    assert get(port, "/healthz")[::2] == (200, "ok\n")
    assert get(port, "/nope")[0] == 404
    status, headers, _ = get(port, "/metrics", method="POST")
    assert status == 405 and headers["Allow"] == "GET"
    # The endpoint needs no token. A call with a wrong token is counted under its method, but a
    # method the server does not serve is counted as "unknown", never under the name sent.
    with CoordinatorClient(coord.address, token="wrong", reconnect_timeout_s=2) as wrong:
        with pytest.raises(AuthError):
            wrong.join("t", "x")
    with grpc.insecure_channel(coord.address) as channel:
        for token in ("wrong", "s3cret"):
            with pytest.raises(grpc.RpcError):
                channel.unary_unary("/elasticrl.v1.Coordinator/NoSuchMethod")(
                    b"", timeout=HTTP_TIMEOUT_S, metadata=[("authorization", f"Bearer {token}")]
                )
    samples = scrape(port)
    assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Join") == 1
    assert value(samples, "elasticrl_rpcs_received_total", service="unknown", method="unknown") == 2
    assert not [k for k in samples if ("method", "NoSuchMethod") in k[1]], samples
    assert value(samples, "elasticrl_member_joins_total", run="t") == 0
    with CoordinatorClient(coord.address, token="s3cret") as good:
        good.join("t", "x")
    samples = scrape(port)
    assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Join") == 2
    assert value(samples, "elasticrl_member_joins_total", run="t") == 1


@pytest.mark.timeout(60)
def test_bad_metrics_flags_fail_with_one_line_and_status_2(coordinator_factory, tmp_path):
    coord, taken = with_metrics(coordinator_factory, tmp_path)
    base = [sys.executable, "-m", "elasticrl", "coordinator", "--port", "0"]
    cases = [
        (["--metrics-port", "70000"], "metrics_port: 70000 is not a TCP port"),
        (["--metrics-port", "-1"], "metrics_port: -1 is not a TCP port"),
        (["--metrics-port-file", str(tmp_path / "f")], "metrics_port_file: needs metrics_port"),
        (["--metrics-port", str(taken)], f"metrics_port: could not bind 127.0.0.1:{taken}"),
    ]
    for args, message in cases:
        out = subprocess.run(base + args, capture_output=True, text=True, timeout=30, cwd=REPO)
        assert out.returncode == 2, (args, out.stderr)
        # Log lines of the start-up may come first (the sweep of a killed coordinator's weights).
        lines = [line for line in out.stderr.strip().splitlines() if " INFO " not in line]
        assert len(lines) == 1 and lines[0].startswith("elasticrl coordinator: ") and message in lines[0], out.stderr
    out = subprocess.run(base[:4] + ["--help"], capture_output=True, text=True, timeout=30, cwd=REPO)
    help_text = " ".join(out.stdout.split())
    assert "--metrics-port PORT" in help_text and "No token check" in help_text


@pytest.mark.timeout(30)
def test_a_silent_client_is_dropped_after_its_read_deadline_and_blocks_no_one():
    metrics = Metrics()
    ep = MetricsEndpoint(metrics.registry, "127.0.0.1", 0)
    ep.READ_TIMEOUT_S = 0.5
    ep.start()
    try:
        with socket.create_connection(("127.0.0.1", ep.port), timeout=10) as silent:
            # Another scrape is answered while the silent client holds its connection.
            assert get(ep.port, "/healthz")[::2] == (200, "ok\n")
            started = time.monotonic()
            assert silent.recv(1024) == b""  # the server closes: EOF
            assert 0.3 < time.monotonic() - started < 5
        assert get(ep.port, "/metrics")[0] == 200
    finally:
        ep.stop()
    with pytest.raises(urllib.error.URLError):
        get(ep.port, "/healthz")


@pytest.mark.timeout(30)
def test_a_failing_scrape_answers_500_and_the_endpoint_keeps_serving():
    metrics = Metrics()

    class Broken:
        def collect(self):
            raise RuntimeError("bug")

    metrics.registry.register(Broken())
    ep = MetricsEndpoint(metrics.registry, "127.0.0.1", 0)
    ep.start()
    try:
        assert get(ep.port, "/metrics")[0] == 500
        assert get(ep.port, "/healthz")[::2] == (200, "ok\n")
    finally:
        ep.stop()



@pytest.mark.timeout(60)
def test_a_membership_arrives_over_its_session_stream_not_in_unary_calls(coordinator_factory, tmp_path):
    import concurrent.futures

    coord, port = with_metrics(coordinator_factory, tmp_path)
    with CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=10) as client:
        members = [Membership(client, "s", name) for name in ("a", "b", "c")]
        wait_until(lambda: all(m.streaming.is_set() for m in members), 10, message="the members' streams")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for i in range(3):
                results = list(pool.map(lambda m: m.arrive(f"step-{i}", timeout_s=20), members))
                assert all(r.arrived == ["a", "b", "c"] and not r.evicted for r in results), results
        samples = scrape(port)
        assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Arrive") == 0
        assert value(samples, "elasticrl_rpcs_received_total", service="elasticrl.v1.Coordinator", method="Session") == 3
        for m in members:
            m.leave()


@pytest.mark.timeout(60)
def test_healthz_fails_while_the_coordinator_starts_stalls_or_stops(monkeypatch):
    # Found by an operator: /healthz answered "ok" from its own thread whatever the event loop did,
    # so a liveness probe on it (what TLS needs on Kubernetes) never restarted a hung coordinator.
    import asyncio
    import threading

    from elasticrl.coordinator import server as server_module
    from elasticrl.coordinator.server import CoordinatorConfig, CoordinatorServer

    monkeypatch.setattr(server_module, "HEALTH_STALL_S", 0.5)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(20)

    async def make():
        return CoordinatorServer(CoordinatorConfig(port=0, metrics_port=0))

    server = on_loop(make())
    try:
        assert server.unhealthy() == "starting"  # before gRPC serves: not ready
        on_loop(server.start())
        port = server.metrics_endpoint.port
        assert get(port, "/healthz")[::2] == (200, "ok\n")
        loop.call_soon_threadsafe(time.sleep, 1.5)  # a hung loop: no tick, no gRPC answer
        time.sleep(1.0)
        status, _, body = get(port, "/healthz")
        assert status == 503 and body.startswith("unhealthy: stalled: the event loop has not ticked for"), (status, body)
        wait_until(lambda: get(port, "/healthz")[0] == 200, timeout_s=10)  # it ticks again
    finally:
        on_loop(server.stop(0.2))
        assert server.unhealthy() == "stopping"
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
