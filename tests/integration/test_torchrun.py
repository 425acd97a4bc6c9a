"""Stock ``torchrun --rdzv-backend=elasticrl`` agents against a real coordinator: forming a world,
surviving the death of the rank-0 node, admitting a late node, restarting after a worker dies, and
fencing a paused node that then rejoins.

Three agents on localhost, gloo, one worker each (``allreduce_worker.py``, which all-reduces in a
loop and reports its world size as JSON lines). A node's death is SIGKILL of its agent and its
workers. Every wait has a hard timeout; every process is killed by pid at teardown.
"""

from __future__ import annotations

import datetime
import signal
import time

import pytest

from tests.conftest import wait_until
from tests.integration.torchrun_cluster import TorchrunCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

LEASE_TTL_S = 1.0
FORM_TIMEOUT_S = 60.0  # three torchruns importing torch on a busy 2-core machine
RECOVERY_SLACK_S = 5.0


@pytest.fixture
def cluster(coordinator_factory, tmp_path):
    coord = coordinator_factory(lease_ttl_s=LEASE_TTL_S, durable=False)
    made = TorchrunCluster(
        tmp_path / "cluster",
        backend="elasticrl",
        endpoint=coord.address,
        run_id="torchrun-test",
        nnodes="2:4",
        rdzv_conf={"last_call_timeout": 2, "lease_ttl": LEASE_TTL_S, "join_timeout": 60, "connect_timeout": 10},
        max_restarts=3,
    )
    made.coordinator = coord
    try:
        yield made
    finally:
        made.close()


def _form(cluster: TorchrunCluster, names=("a", "b", "c")) -> float:
    t0 = time.time()
    for name in names:
        cluster.start_node(name)
    return cluster.wait_world(names, len(names), since=t0, timeout_s=FORM_TIMEOUT_S)


def test_three_agents_form_one_world_and_finish_cleanly(cluster):
    _form(cluster)
    ready = {n: cluster.latest(n, "ready") for n in "abc"}
    assert sorted(r["rank"] for r in ready.values()) == [0, 1, 2]
    masters = {cluster.latest(n, "start")["master"] for n in "abc"}
    assert len(masters) == 1, f"workers of one round must bootstrap from one rank-0 store: {masters}"

    # A collective stop: workers exit 0, agents pass the exit barrier (on the coordinator-backed
    # store), shut down (= Leave) and exit 0; the run itself stays open.
    cluster.stop_file.touch()
    deadline = time.monotonic() + 30
    while any(node.alive() for node in cluster.nodes.values()):
        assert time.monotonic() < deadline, f"agents did not exit after a clean stop\n{cluster.logs()}"
        time.sleep(0.1)
    assert {n: node.proc.returncode for n, node in cluster.nodes.items()} == {"a": 0, "b": 0, "c": 0}, cluster.logs()
    assert all(cluster.latest(n, "done") for n in "abc")

    from elasticrl.coordinator.client import CoordinatorClient

    with CoordinatorClient(cluster.coordinator.address, call_timeout_s=5) as client:
        run = client.status("torchrun-test", include_departed=True)["runs"][0]
    assert run["snapshot"]["members"] == [] and not run["snapshot"]["closed"]
    assert {m["state"] for m in run["departed"]} == {"MEMBER_STATE_LEFT"}


def test_sigkill_of_rank0_node_survivors_reform_within_lease_ttl(cluster):
    _form(cluster)
    victim = cluster.rank0("abc")
    survivors = [n for n in "abc" if n != victim]
    before = {n: cluster.latest(n, "start")["pid"] for n in survivors}

    t_kill = time.time()
    cluster.nodes[victim].kill()
    t_back = cluster.wait_world(survivors, 2, since=t_kill, timeout_s=LEASE_TTL_S + 30)
    elapsed = t_back - t_kill
    print(f"survivors all-reduce in a world of 2 {elapsed:.2f}s after the SIGKILL of rank-0 node {victim}")
    assert elapsed < LEASE_TTL_S + RECOVERY_SLACK_S, (
        f"survivors all-reduced again {elapsed:.2f}s after the kill (limit {LEASE_TTL_S + RECOVERY_SLACK_S}s)\n{cluster.logs()}"
    )
    # New worker processes, bootstrapped from a survivor (the dead node's store is gone), and the
    # restart was membership-driven: it did not spend torchrun's --max-restarts budget.
    starts = {n: cluster.latest(n, "start") for n in survivors}
    assert all(starts[n]["pid"] != before[n] for n in survivors)
    # The agents restarted their workers about a second after the coordinator evicted the node.
    restart_lag = max(starts[n]["t"] for n in survivors) - _eviction_time(cluster.coordinator.log())
    print(f"new workers started {restart_lag:.2f}s after the eviction")
    assert restart_lag < 1.5, (restart_lag, starts)
    assert {starts[n]["restart"] for n in survivors} == {0}, starts
    assert sorted(cluster.latest(n, "ready")["rank"] for n in survivors) == [0, 1]
    # ...and they keep all-reducing.
    steps = {n: cluster.latest(n)["step"] for n in survivors}
    cluster.wait_world(survivors, 2, since=time.time() + 0.3, timeout_s=10)
    assert all(cluster.latest(n)["step"] > steps[n] for n in survivors)


def test_fourth_agent_is_admitted_at_the_next_round(cluster):
    _form(cluster)
    t_join = time.time()
    cluster.start_node("d")
    cluster.wait_world("abcd", 4, since=t_join, timeout_s=FORM_TIMEOUT_S)
    ranks = {n: cluster.latest(n, "ready")["rank"] for n in "abcd"}
    assert sorted(ranks.values()) == [0, 1, 2, 3]
    assert ranks["d"] == 3, f"the newcomer takes the free rank; the others keep theirs: {ranks}"
    assert {cluster.latest(n, "start")["restart"] for n in "abcd"} == {0}


def test_sigkill_of_one_worker_restarts_the_group(cluster):
    _form(cluster)
    victim = next(n for n in "abc" if cluster.latest(n, "ready")["rank"] != 0)
    before = {n: cluster.latest(n, "start")["pid"] for n in "abc"}
    killed = cluster.nodes[victim].kill_worker()
    # Old workers may report a step or two before their collective fails: count only new ones.
    wait_until(lambda: all(cluster.latest(n, "start")["pid"] != before[n] for n in "abc"), FORM_TIMEOUT_S,
               message="every agent to start a new worker")
    restarted = max(cluster.latest(n, "start")["t"] for n in "abc")
    cluster.wait_world("abc", 3, since=restarted, timeout_s=FORM_TIMEOUT_S)
    new = cluster.latest(victim, "start")
    assert new["pid"] != killed
    # The victim's agent saw a failed worker (one restart spent); the others were restarted
    # because a participant of their round was waiting again (no restart spent).
    assert new["restart"] == 1
    assert {cluster.latest(n, "start")["restart"] for n in "abc" if n != victim} == {0}
    assert all(node.alive() for node in cluster.nodes.values())


def test_a_worker_failing_for_good_stops_its_agent_and_the_others_go_on_without_it(cluster):
    """A failure restarts do not fix (the worker calls ``request_stop``, as ``elasticrl.node`` does
    for an env or reward function that raises): its agent restarts the worker once more, and when
    it fails the same way again leaves the run, with the worker's reason, instead of restarting
    it --max-restarts times; the other nodes re-form without it."""
    from elasticrl.coordinator.client import CoordinatorClient

    _form(cluster)
    victim = next(n for n in "abc" if cluster.latest(n, "ready")["rank"] != 0)
    t0 = time.time()
    cluster.fatal_file.write_text(victim)
    wait_until(lambda: not cluster.nodes[victim].alive(), 30, message=f"{victim}'s agent to exit")
    assert cluster.nodes[victim].proc.returncode != 0
    assert cluster.latest(victim, "fatal")["asked"], cluster.summary()
    assert [r["restart"] for r in cluster.nodes[victim].records("start")] == [0, 1], "one more try, not three"
    assert len(cluster.nodes[victim].records("fatal")) == 2
    assert f"{victim}: ValueError: a user's bug" in cluster.nodes[victim].log_tail(60)
    survivors = [n for n in "abc" if n != victim]
    cluster.wait_world(survivors, 2, since=t0, timeout_s=FORM_TIMEOUT_S)
    assert all(cluster.nodes[n].alive() for n in survivors)
    with CoordinatorClient(cluster.coordinator.address, call_timeout_s=5) as client:
        run = client.status("torchrun-test", include_departed=True)["runs"][0]
    assert not run["snapshot"]["closed"]  # the run goes on; only the node left
    assert len(run["snapshot"]["members"]) == 2
    assert [m["state"] for m in run["departed"]] == ["MEMBER_STATE_LEFT"], run["departed"]


def test_paused_node_is_fenced_and_rejoins_as_a_new_incarnation(cluster):
    """SIGSTOP a node past its lease: the others stop waiting on its (silent, not closed) sockets
    and re-form; after SIGCONT its agent finds itself fenced and rejoins as a new incarnation."""
    t0 = time.time()
    for name in "abc":
        cluster.start_node(name, node_id=f"node-{name}")
    cluster.wait_world("abc", 3, since=t0, timeout_s=FORM_TIMEOUT_S)
    victim = next(n for n in "abc" if cluster.latest(n, "ready")["rank"] != 0)
    others = [n for n in "abc" if n != victim]
    paused = cluster.nodes[victim]

    before = _incarnations(cluster)
    t_stop = time.time()
    paused.signal_all(signal.SIGSTOP)
    try:
        t_back = cluster.wait_world(others, 2, since=t_stop, timeout_s=LEASE_TTL_S + 30)
        assert t_back - t_stop < LEASE_TTL_S + RECOVERY_SLACK_S, cluster.logs()
    finally:
        paused.signal_all(signal.SIGCONT)
    t_cont = time.time()
    cluster.wait_world("abc", 3, since=t_cont, timeout_s=FORM_TIMEOUT_S)
    after = _incarnations(cluster)
    assert set(after) == {"node-a", "node-b", "node-c"}
    assert after[f"node-{victim}"] > before[f"node-{victim}"], (before, after)
    assert all(after[f"node-{n}"] == before[f"node-{n}"] for n in others)


def _incarnations(cluster: TorchrunCluster) -> dict[str, int]:
    from elasticrl.coordinator.client import CoordinatorClient

    with CoordinatorClient(cluster.coordinator.address, call_timeout_s=5) as client:
        run = client.status("torchrun-test")["runs"][0]
    return {m["member_id"]: int(m["incarnation"]) for m in run["snapshot"]["members"]}


def _eviction_time(coordinator_log: str) -> float:
    """Wall-clock time of the (single) eviction of a dead node in the coordinator's log: by its
    broken stream (the usual case, within the stream grace) or by its lease."""
    lines = [ln for ln in coordinator_log.splitlines() if "evicted: lease expired" in ln or "evicted: its stream broke" in ln]
    assert len(lines) == 1, lines
    stamp = " ".join(lines[0].split()[:2])  # "2026-11-22 01:37:56,234", local time
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
