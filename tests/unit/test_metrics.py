"""The metrics registry and its text exposition (format 0.0.4), the HTTP endpoint's routing, and
the counters the cores move when they apply a decision (injected clock, no sockets)."""

from __future__ import annotations

import asyncio
import math

import pytest

from elasticrl.coordinator.metrics import (
    CONTENT_TYPE,
    MetricsEndpoint,
    Registry,
    escape_help,
    escape_label_value,
    format_value,
)
from elasticrl.coordinator.state import TimeoutPolicy
from elasticrl.scheduler.state import IterationConfig
from tests.unit.scheduler_harness import RUN, Harness, drain, group, specs


def test_format_value_integers_fractions_and_specials():
    assert [format_value(v) for v in (0, 3, 3.0, -2.0, 0.25, 1e20)] == ["0", "3", "3", "-2", "0.25", "1e+20"]
    assert (format_value(math.inf), format_value(-math.inf), format_value(math.nan)) == ("+Inf", "-Inf", "NaN")


def test_label_values_escape_backslash_quote_and_newline():
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert escape_help('say "hi"\\\nbye') == 'say "hi"\\\\\\nbye'  # HELP keeps quotes as they are
    reg = Registry()
    c = reg.counter("x_total", "help with\nnewline", ("run",))
    c.inc(run='we"ird\\run\n')
    text = reg.render()
    assert "# HELP x_total help with\\nnewline\n# TYPE x_total counter\n" in text
    assert 'x_total{run="we\\"ird\\\\run\\n"} 1\n' in text


def test_counter_and_gauge_render_sorted_and_unlabelled_starts_at_zero():
    reg = Registry()
    reg.counter("plain_total", "an unlabelled counter")
    runs = reg.counter("runs_total", "per run", ("run", "reason"))
    g = reg.gauge("g", "a gauge", ("run",))
    runs.inc(run="b", reason="x")
    runs.inc(2, run="a", reason="y")
    runs.inc(0.5, run="a", reason="y")
    g.set(5, run="r")
    g.inc(-7, run="r")
    text = reg.render()
    assert text.endswith("\n") and "\n\n" not in text
    assert "plain_total 0\n" in text
    assert text.index('runs_total{run="a",reason="y"} 2.5') < text.index('runs_total{run="b",reason="x"} 1')
    assert 'g{run="r"} -2\n' in text
    assert runs.value(run="a", reason="y") == 2.5 and runs.value(run="z", reason="y") == 0
    # Families come out in registration order, each with HELP and TYPE before its samples.
    order = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert order == ["plain_total", "runs_total", "g"]
    g.clear()
    assert 'g{run="r"}' not in reg.render()


def test_counter_refuses_to_go_down_and_labels_must_match():
    reg = Registry()
    c = reg.counter("c_total", "h", ("run",))
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, run="r")
    with pytest.raises(ValueError, match=r"takes labels \('run',\), got \('node',\)"):
        c.inc(node="n")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc()
    with pytest.raises(ValueError, match="registered twice"):
        reg.counter("c_total", "again")
    with pytest.raises(ValueError, match="not a Prometheus metric name"):
        reg.gauge("bad-name", "h")
    with pytest.raises(ValueError, match="not a label name"):
        reg.gauge("g", "h", ("bad label",))
    with pytest.raises(ValueError, match="'le'"):
        reg.histogram("h", "h", ("le",), buckets=(1,))
    with pytest.raises(ValueError, match="distinct"):
        reg.histogram("h2", "h", buckets=(1, 1))
    with pytest.raises(ValueError, match="arguments of inc/set"):
        reg.counter("amounts_total", "h", ("amount",))


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    reg = Registry()
    h = reg.histogram("wait_seconds", "waits", ("run",), buckets=(1, 0.1, 10))  # sorted on creation
    for v in (0.05, 0.1, 0.5, 2, 20, 30):
        h.observe(v, run="r")
    lines = [line for line in reg.render().splitlines() if not line.startswith("#")]
    assert lines == [
        'wait_seconds_bucket{run="r",le="0.1"} 2',  # 0.1 itself falls in le=0.1 (upper bound inclusive)
        'wait_seconds_bucket{run="r",le="1"} 3',
        'wait_seconds_bucket{run="r",le="10"} 4',
        'wait_seconds_bucket{run="r",le="+Inf"} 6',
        'wait_seconds_sum{run="r"} 52.65',
        'wait_seconds_count{run="r"} 6',
    ]
    assert h.count(run="r") == 6 and h.sum(run="r") == pytest.approx(52.65) and h.count(run="none") == 0
    # An unlabelled histogram shows its zero buckets before the first observation.
    reg.histogram("empty_seconds", "none yet", buckets=(1,))
    empty = [line for line in reg.render().splitlines() if line.startswith("empty_seconds")]
    assert empty == ['empty_seconds_bucket{le="1"} 0', 'empty_seconds_bucket{le="+Inf"} 0', "empty_seconds_sum 0", "empty_seconds_count 0"]


def test_a_failing_collector_does_not_break_the_scrape():
    reg = Registry()
    g = reg.gauge("g", "h")

    def broken():
        raise RuntimeError("bug")

    reg.collectors += [broken, lambda: g.set(4)]
    assert "g 4\n" in reg.render()


def test_endpoint_routes_paths_and_methods():
    reg = Registry()
    reg.gauge("up", "h").set(1)
    ep = MetricsEndpoint(reg, "127.0.0.1", 0)
    status, _, body, headers = ep.route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE and b"up 1\n" in body
    assert ep.route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")[0] == 200
    assert ep.route(b"GET /healthz HTTP/1.1\r\n\r\n")[:3] == (200, "OK", b"ok\n")
    assert ep.route(b"GET /other HTTP/1.1\r\n\r\n")[0] == 404
    status, _, _, headers = ep.route(b"POST /metrics HTTP/1.1\r\n\r\n")
    assert status == 405 and headers == {"Allow": "GET"}
    assert ep.route(b"garbage\r\n\r\n")[0] == 400


# -- the cores count into their registry ------------------------------------------------------


def test_coordinator_core_counts_joins_leaves_evictions_barriers_and_refreshes_gauges():
    h = Harness(lease_ttl_s=1.0)
    m = h.coord.metrics
    m.watch(h.coord, h.sched)
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
    text = m.render()
    assert f'elasticrl_members{{run="{RUN}",state="live"}} 1\n' in text
    assert f'elasticrl_members{{run="{RUN}",state="evicted"}} 1\n' in text  # c: one entry per member id
    assert f'elasticrl_members{{run="{RUN}",state="left"}} 1\n' in text
    assert f'elasticrl_run_epoch{{run="{RUN}"}} {h.coord.runs[RUN].epoch}\n' in text


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
    m = h.coord.metrics
    m.watch(h.coord, h.sched)
    w1 = h.worker("w1")
    w2 = h.worker("w2")
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    drain(w1), drain(w2)
    held1 = [tid for _, tid in w1.worker.holding]
    held2 = [tid for _, tid in w2.worker.holding]
    text = m.render()
    assert f'elasticrl_scheduler_tasks{{run="{RUN}",state="running"}} 2\n' in text
    assert f'elasticrl_scheduler_tasks{{run="{RUN}",state="queued"}} 1\n' in text
    assert f'elasticrl_scheduler_workers{{run="{RUN}"}} 2\n' in text
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
    assert f'elasticrl_scheduler_tasks{{run="{RUN}",state="done"}} 3\n' in m.render()
