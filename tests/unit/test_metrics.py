"""The coordinator's metrics on prometheus_client: the adapters the cores call, per-coordinator
registries, forgetting a run, the state-derived gauges read through the server's readers, the HTTP
endpoint's routing, and the counters the cores move when they apply a decision (injected clock,
no sockets)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from elasticrl.coordinator.metrics import CONTENT_TYPE, Metrics, MetricsEndpoint, RunGauges, SchedulerGauges, read_on_loop
from elasticrl.coordinator.server import membership_gauges, scheduler_gauges
from elasticrl.coordinator.state import TimeoutPolicy
from elasticrl.scheduler.state import IterationConfig
from tests.integration.prometheus import parse_exposition, value
from tests.unit.scheduler_harness import RUN, Harness, drain, group, specs


def watch(h: Harness) -> Metrics:
    """The harness's metrics, with the gauges read straight from its cores (as the server wires them)."""
    m = h.coord.metrics
    m.watch(lambda: membership_gauges(h.coord), lambda: scheduler_gauges(h.sched))
    return m


def call(app, path: str, method: str = "GET") -> tuple[str, dict, bytes]:
    """One WSGI request to ``app``: (status, headers, body)."""
    answer = {}

    def start_response(status, headers):
        answer.update(status=status, headers=dict(headers))

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": method, "QUERY_STRING": ""}, start_response))
    return answer["status"], answer["headers"], body


def test_counters_and_histograms_keep_the_call_style_of_the_cores():
    m = Metrics(clock=lambda: 50.0)
    m.joins.inc(run="a")
    m.joins.inc(run="a")
    m.accepted.inc(3, run="a")
    m.evictions.inc(run="a", reason="replaced")
    m.evictions.inc(reason="replaced", run="a")  # keyword order does not matter
    m.barrier_wait.observe(0.05, run="a")
    m.barrier_wait.observe(20, run="a")
    assert m.joins.value(run="a") == 2 and m.joins.value(run="none") == 0
    assert m.accepted.value(run="a") == 3
    assert m.evictions.value(run="a", reason="replaced") == 2
    assert m.barrier_wait.count(run="a") == 2 and m.barrier_wait.sum(run="a") == pytest.approx(20.05)
    samples = parse_exposition(m.render())
    assert value(samples, "elasticrl_member_joins_total", run="a") == 2
    assert value(samples, "elasticrl_barrier_wait_seconds_bucket", run="a", le="0.05") == 1
    assert value(samples, "elasticrl_barrier_wait_seconds_bucket", run="a", le="30.0") == 2
    assert value(samples, "elasticrl_barrier_wait_seconds_bucket", run="a", le="+Inf") == 2
    assert value(samples, "elasticrl_coordinator_uptime_seconds") == 0  # the injected clock stood still
    with pytest.raises(ValueError, match=r"takes labels \('run',\), got \('node',\)"):
        m.joins.inc(node="n")
    with pytest.raises(ValueError, match="takes labels"):
        m.evictions.inc(run="a")
    with pytest.raises(ValueError):
        m.joins.inc(-1, run="a")  # a counter only goes up


def test_each_coordinator_has_its_own_registry():
    one, two = Metrics(), Metrics()  # the same names twice: no "Duplicated timeseries"
    one.joins.inc(run="r")
    assert one.joins.value(run="r") == 1 and two.joins.value(run="r") == 0
    assert 'elasticrl_member_joins_total{run="r"}' not in two.render()


def test_forget_run_drops_the_runs_children_only():
    m = Metrics()
    for run in ("old", "new"):
        m.joins.inc(run=run)
        m.evictions.inc(run=run, reason="lease_expired")
        m.seal_time.observe(3.0, run=run)
    m.rpcs.inc(service="s", method="Join")
    m.forget_run("old")
    samples = parse_exposition(m.render())
    assert not [k for k in samples if ("run", "old") in k[1]], samples
    assert value(samples, "elasticrl_member_joins_total", run="new") == 1
    assert value(samples, "elasticrl_member_evictions_total", run="new", reason="lease_expired") == 1
    assert value(samples, "elasticrl_scheduler_seal_seconds_count", run="new") == 1
    assert value(samples, "elasticrl_rpcs_received_total", service="s", method="Join") == 1
    m.joins.inc(run="old")  # a run of the same name later starts from zero
    assert m.joins.value(run="old") == 1
    m.forget_run("never-seen")


def test_state_gauges_show_what_the_readers_return_and_survive_a_broken_reader():
    m = Metrics()
    runs = [RunGauges(run_id="r", epoch=4, barriers_open=1, members={"live": 2, "evicted": 1})]
    sched = [SchedulerGauges(run_id="r", workers=2, iteration=7, tasks={"queued": 1, "done": 3}),
             SchedulerGauges(run_id="idle", workers=0)]
    m.watch(lambda: runs, lambda: sched)
    samples = parse_exposition(m.render())
    assert value(samples, "elasticrl_members", run="r", state="live") == 2
    assert ("elasticrl_members", frozenset({("run", "r"), ("state", "left")})) in samples  # 0, but present
    assert value(samples, "elasticrl_run_epoch", run="r") == 4
    assert value(samples, "elasticrl_barriers_open", run="r") == 1
    assert value(samples, "elasticrl_scheduler_iteration", run="r") == 7
    assert value(samples, "elasticrl_scheduler_tasks", run="r", state="done") == 3
    assert value(samples, "elasticrl_scheduler_workers", run="r") == 2
    assert ("elasticrl_scheduler_workers", frozenset({("run", "idle")})) in samples
    assert not [k for k in samples if k[0] == "elasticrl_scheduler_tasks" and ("run", "idle") in k[1]]
    runs.clear()  # a run gone from the cores is gone from the next scrape
    assert 'elasticrl_run_epoch{run="r"}' not in m.render()

    def broken():
        raise RuntimeError("bug")

    m.watch(broken, lambda: sched)
    text = m.render()
    assert 'elasticrl_scheduler_workers{run="r"} 2.0' in text and "elasticrl_members{" not in text


def test_read_on_loop_runs_the_reader_on_the_loop_thread():
    async def main():
        loop = asyncio.get_running_loop()
        read = read_on_loop(loop, lambda: threading.current_thread().name, timeout_s=5)
        return threading.current_thread().name, await asyncio.to_thread(read)

    loop_thread, read_thread = asyncio.run(main())
    assert read_thread == loop_thread


def test_endpoint_routes_paths_and_methods():
    m = Metrics()
    m.joins.inc(run="r")
    ep = MetricsEndpoint(m.registry, "127.0.0.1", 0)
    status, headers, body = call(ep.app, "/metrics")
    assert status == "200 OK" and headers["Content-Type"] == CONTENT_TYPE
    assert b'elasticrl_member_joins_total{run="r"} 1.0\n' in body
    assert call(ep.app, "/healthz") == ("200 OK", {"Content-Type": "text/plain; charset=utf-8", "Content-Length": "3"}, b"ok\n")
    assert call(ep.app, "/other")[0].startswith("404")
    assert call(ep.app, "/")[0].startswith("404")
    status, headers, _ = call(ep.app, "/metrics", "POST")
    assert status.startswith("405") and headers["Allow"] == "GET"


def test_a_failing_collector_answers_500():
    m = Metrics()

    class Broken:
        def collect(self):
            raise RuntimeError("bug")

    m.registry.register(Broken())
    ep = MetricsEndpoint(m.registry, "127.0.0.1", 0)
    assert call(ep.app, "/metrics")[0].startswith("500")
    assert call(ep.app, "/healthz")[0] == "200 OK"


# -- the cores count into their registry ------------------------------------------------------


def test_coordinator_core_counts_joins_leaves_evictions_barriers_and_refreshes_gauges():
    h = Harness(lease_ttl_s=1.0)
    m = watch(h)
    h.join("a")
    h.join("b")
    h.join("c")
    h.join("c")  # a restart of c: the old incarnation is evicted as replaced
    assert m.joins.value(run=RUN) == 4
    assert m.evictions.value(run=RUN, reason="replaced") == 1

    async def barrier():
        for mid in ("a", "b", "c"):
            task = asyncio.ensure_future(
                h.coord.arrive(RUN, mid, h.incarnations[mid], "b1", timeout_s=5, policy_=TimeoutPolicy.EVICT_MISSING)
            )
            await asyncio.sleep(0)
        return await asyncio.wait_for(task, 5)

    result = asyncio.run(barrier())
    assert result.arrived == ["a", "b", "c"]
    assert m.barriers_decided.value(run=RUN, outcome="completed") == 1
    assert m.barrier_wait.count(run=RUN) == 1

    h.coord.leave(RUN, "b", h.incarnations["b"])
    assert m.leaves.value(run=RUN) == 1
    h.advance(2.0, alive=("a",), step=0.25)  # c's lease lapses
    assert m.evictions.value(run=RUN, reason="lease_expired") == 1
    samples = parse_exposition(m.render())
    assert value(samples, "elasticrl_members", run=RUN, state="live") == 1
    assert value(samples, "elasticrl_members", run=RUN, state="evicted") == 1  # c: one entry per member id
    assert value(samples, "elasticrl_members", run=RUN, state="left") == 1
    assert value(samples, "elasticrl_run_epoch", run=RUN) == h.coord.runs[RUN].epoch > 0


def test_barrier_timeout_counts_missed_barrier_eviction_and_wait_time():
    h = Harness(lease_ttl_s=30.0)
    m = h.coord.metrics
    h.join("a")
    h.join("b")

    async def arrive_alone():
        waiter = asyncio.ensure_future(h.coord.arrive(RUN, "a", h.incarnations["a"], "late", timeout_s=2.0))
        await asyncio.sleep(0)
        h.clock.now += 3.0
        h.coord.tick()
        return await asyncio.wait_for(waiter, 5)

    result = asyncio.run(arrive_alone())
    assert result.evicted == ["b"]
    assert m.evictions.value(run=RUN, reason="missed_barrier") == 1
    assert m.barrier_wait.count(run=RUN) == 1 and m.barrier_wait.sum(run=RUN) == pytest.approx(3.0)


def test_scheduler_core_counts_results_requeues_refusals_bytes_and_seal_time():
    h = Harness()
    m = watch(h)
    w1 = h.worker("w1")
    w2 = h.worker("w2")
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    drain(w1), drain(w2)
    held1 = [tid for _, tid in w1.worker.holding]
    held2 = [tid for _, tid in w2.worker.holding]
    samples = parse_exposition(m.render())
    assert value(samples, "elasticrl_scheduler_tasks", run=RUN, state="running") == 2
    assert value(samples, "elasticrl_scheduler_tasks", run=RUN, state="queued") == 1
    assert value(samples, "elasticrl_scheduler_workers", run=RUN) == 2
    assert value(samples, "elasticrl_scheduler_iteration", run=RUN) == 1
    h.sched.release(w2, 1, held2, "engine busy")  # back to the queue, then to w1 later
    assert m.requeued.value(run=RUN) == 1
    h.clock.now += 4.0
    g = group(held1[0])
    ack, _ = h.sched.accept(w1, [(1, g), (1, group(held1[0])), (7, group("t99"))])
    assert ack.accepted == 1
    assert m.accepted.value(run=RUN) == 1
    assert m.trajectory_bytes.value(run=RUN) == g.num_bytes > 0
    assert m.refused.value(run=RUN, reason="duplicate") == 1 and m.refused.value(run=RUN, reason="unknown") == 1
    for _ in range(5):  # the workers finish whatever is left (at most 2 tasks, one per round)
        for w in (w1, w2):
            drain(w)
            h.sched.accept(w, [(1, group(tid)) for _, tid in list(w.worker.holding)])
        if h.it().sealed:
            break
    assert h.it().sealed
    assert m.accepted.value(run=RUN) == 3
    assert m.sealed.value(run=RUN) == 1
    assert m.seal_time.count(run=RUN) == 1 and m.seal_time.sum(run=RUN) == pytest.approx(4.0)
    assert value(parse_exposition(m.render()), "elasticrl_scheduler_tasks", run=RUN, state="done") == 3
