"""Two nodes and a coordinator on three "hosts" (network namespaces), launched as the docs say.

The coordinator runs in one namespace bound to ``0.0.0.0``; each node runs the documented stock
``torchrun --rdzv-backend=elasticrl --local-addr=<its address> -m elasticrl.node`` in a namespace
of its own, and the three reach each other only over a bridge (``tests/integration/netns.py``):
every gRPC call, the workers' TCPStore and gloo's collectives cross a real network between
distinct addresses, which localhost runs never test. Nothing is shared between the nodes but the
filesystem, and the run does not use it: each node has its own run and checkpoint directory
(``[checkpoint] every_node``).

The test checks that both nodes reached the coordinator from their own addresses (the
coordinator's TCP connections, and the ``local_addr`` each agent registered), then SIGKILLs every
process of node 2 a few iterations in; node 1 must re-form alone, resume from its own checkpoint
and finish every iteration, leaving a final checkpoint that loads. Skips where the machine cannot
make network namespaces (not root, no iproute2, a container without the privilege).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.integration.netns import NetnsUnavailable, VirtualLan, established_peers

pytestmark = [pytest.mark.integration]

COORDINATOR_PORT = 50051  # the documented default; the namespace is ours alone, so it is free
LEASE_TTL_S = 2
ITERATIONS = 12
CHECKPOINT_EVERY = 3
KILL_AFTER = 3
"""Node 2 dies once an iteration >= this one is reported in a world of two (a checkpoint exists)."""
START_TIMEOUT_S = 90  # both nodes import torch and meet on 2 busy cores
FINISH_TIMEOUT_S = 90
STATUS_TIMEOUT_S = 20
COORDINATOR_START_S = 20

# Every setting the nodes get, with the config's current section names; ``{...}`` is filled per
# node. The demo's defaults otherwise (a tiny policy learning to reverse digits, gloo on CPU).
NODE_OVERRIDES = [
    "--coordinator.address={coordinator}",
    "--run.run_id={run_id}",
    "--run.run_dir={run_dir}",
    f"--run.iterations={ITERATIONS}",
    "--task.name=reverse",
    f"--checkpoint.every_iterations={CHECKPOINT_EVERY}",
    "--checkpoint.every_node=true",  # no shared filesystem: each node keeps its own copy
]


@pytest.fixture
def lan():
    """A coordinator host and two node hosts on 10.77.0.0/24; removed with everything on them."""
    net = VirtualLan(["coordinator", "node1", "node2"])
    try:
        net.up()
    except NetnsUnavailable as exc:
        pytest.skip(f"this machine cannot make network namespaces: {exc}")
    try:
        yield net
    finally:
        net.down()


def child_env(node_name: str | None = None) -> dict[str, str]:
    # A proxy of the machine's own network is unreachable from the namespaces (and gRPC honours it).
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy"
    if node_name is not None:
        env["ELASTICRL_NODE_NAME"] = node_name  # every namespace shares this machine's hostname
        # No GLOO_SOCKET_IFNAME: the hostname resolves to a loopback address here, so this also
        # checks that the node picks the interface that routes to MASTER_ADDR by itself.
        env.pop("GLOO_SOCKET_IFNAME", None)
    return env


class StartedProcesses:
    """What the test started, by name: killed by process group at the end, logs shown on failure."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, name: str):
        return self.tmp / f"{name}.log"

    def start(self, name: str, host, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.procs[name] = host.start(argv, self.log_path(name), env=env, cwd=REPO)
        return self.procs[name]

    def kill_groups(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def logs(self, lines: int = 60) -> str:
        out = []
        for name, proc in self.procs.items():
            try:
                text = self.log_path(name).read_text(errors="replace").splitlines()
            except FileNotFoundError:
                text = ["(no log)"]
            out.append(f"----- {name} (pid {proc.pid}, exit {proc.poll()}) -----\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


def node_command(coordinator: str, run_id: str, local_addr: str, run_dir) -> list[str]:
    """The documented launch (deploy/README.md), one worker per node."""
    fields = {"coordinator": coordinator, "run_id": run_id, "run_dir": run_dir}
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
        "--rdzv-backend=elasticrl", f"--rdzv-endpoint={coordinator}", f"--rdzv-id={run_id}",
        f"--local-addr={local_addr}",
        "-m", "elasticrl.node", *(arg.format(**fields) for arg in NODE_OVERRIDES),
    ]


def metrics(run_dir) -> list[dict]:
    """Records of metrics.jsonl (rank 0 writes it in its own node's run dir); a torn last line is skipped."""
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def wait_for(what: str, predicate, timeout_s: float, procs: StartedProcesses, must_live: list[str]):
    """Poll ``predicate`` until truthy; fail at ``timeout_s`` or as soon as a process in ``must_live`` exits."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        for name in must_live:
            if procs.procs[name].poll() is not None:
                pytest.fail(f"{name} exited ({procs.procs[name].returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
    return value


def environment_values(pids: list[int], key: str) -> set[str]:
    """The values of ``key`` in the environment each of ``pids`` started with (where set)."""
    values = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for item in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                name, _, value = item.decode(errors="replace").partition("=")
                if name == key:
                    values.add(value)
    return values


def coordinator_status(lan: VirtualLan, run_id: str) -> dict:
    """``elasticrl status --all --json`` asked from the coordinator's host."""
    argv = [
        sys.executable, "-m", "elasticrl.cli", "status", "--coordinator", f"127.0.0.1:{COORDINATOR_PORT}",
        "--run", run_id, "--all", "--json",
    ]
    done = subprocess.run(
        lan.hosts["coordinator"].command(argv), capture_output=True, text=True, timeout=STATUS_TIMEOUT_S,
        cwd=REPO, env=child_env(),
    )
    assert done.returncode == 0, f"elasticrl status failed ({done.returncode}): {done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.timeout(240)
def test_two_hosts_train_and_the_survivor_finishes_when_one_dies(lan, tmp_path):
    from elasticrl.coordinator.launch import wait_for_port
    from elasticrl.train.checkpoint import load_checkpoint

    coord, node1, node2 = lan.hosts["coordinator"], lan.hosts["node1"], lan.hosts["node2"]
    endpoint = f"{coord.addr}:{COORDINATOR_PORT}"
    run_id = f"multihost-{os.getpid()}"
    run_dirs = {name: tmp_path / name for name in ("node1", "node2")}
    procs = StartedProcesses(tmp_path)
    try:
        port_file = tmp_path / "coordinator.port"
        coordinator = procs.start("coordinator", coord, [
            sys.executable, "-m", "elasticrl.cli", "coordinator", "--host", "0.0.0.0",
            "--port", str(COORDINATOR_PORT), "--port-file", str(port_file),
            "--state-dir", str(tmp_path / "coordinator-state"), "--lease-ttl", str(LEASE_TTL_S),
        ], child_env())
        port = wait_for_port(coordinator, port_file, timeout_s=COORDINATOR_START_S, log_path=procs.log_path("coordinator"))
        assert port == COORDINATOR_PORT
        for name, host in (("node1", node1), ("node2", node2)):
            procs.start(name, host, node_command(endpoint, run_id, host.addr, run_dirs[name]), child_env(name))

        # A few iterations in a world of two: both nodes met through the coordinator and each other.
        def two_node_progress():
            done = [r for d in run_dirs.values() for r in metrics(d) if r["world_size"] == 2 and r["iteration"] >= KILL_AFTER]
            return done and (max(r["iteration"] for r in done), established_peers(coordinator.pid, COORDINATOR_PORT))

        reached, peers = wait_for(
            f"iteration {KILL_AFTER} in a world of 2", two_node_progress, START_TIMEOUT_S, procs,
            ["coordinator", "node1", "node2"],
        )
        assert {node1.addr, node2.addr} <= peers, f"the coordinator's TCP peers {peers} miss a node's own address"
        # The workers' store lives on the round's rank-0 node, at the address its agent was given
        # (--local-addr); the shared hostname would resolve to 127.0.0.1 on every host.
        master = environment_values(node1.pids() + node2.pids(), "MASTER_ADDR")
        assert len(master) == 1 and master <= {node1.addr, node2.addr}, f"workers' MASTER_ADDR: {master}"
        assert reached < ITERATIONS, f"the run reached iteration {reached} of {ITERATIONS} before node 2 could be killed"

        # Node 2 dies: its agent and its worker (in a session of its own) at once.
        killed = node2.kill_all()
        assert procs.procs["node2"].pid in killed and len(killed) >= 2, f"killed {killed}: expected the agent and a worker"
        assert procs.procs["node2"].wait(timeout=10) == -signal.SIGKILL

        try:
            status = procs.procs["node1"].wait(timeout=FINISH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 did not finish within {FINISH_TIMEOUT_S}s after node 2 died")
        assert status == 0, f"node 1 exited with status {status}"

        last = metrics(run_dirs["node1"])[-1]
        assert last["iteration"] == ITERATIONS and last["world_size"] == 1, last
        assert "resumed from iteration" in procs.log_path("node1").read_text(errors="replace")
        checkpoint = load_checkpoint(str(run_dirs["node1"] / "checkpoints" / f"iter-{ITERATIONS:06d}"))
        assert checkpoint.iteration == ITERATIONS and checkpoint.model, checkpoint.meta
        assert last["checkpoint"] == str(run_dirs["node1"] / "checkpoints" / f"iter-{ITERATIONS:06d}")

        # Each agent registered the address it advertises to the others' workers (--local-addr).
        runs = coordinator_status(lan, run_id)["runs"]
        assert len(runs) == 1, runs
        members = runs[0]["snapshot"]["members"] + runs[0]["departed"]
        agents = [m for m in members if m["capabilities"].get("role") == "torchrun-agent"]
        assert {m["capabilities"]["local_addr"] for m in agents} == {node1.addr, node2.addr}, agents
        # Node 2's agent could not say goodbye: the coordinator evicted it when its lease lapsed.
        (dead,) = [m for m in agents if m["capabilities"]["local_addr"] == node2.addr]
        assert dead["state"] == "MEMBER_STATE_EVICTED", dead
    except BaseException:
        print(f"\n===== logs of every process (run dirs under {tmp_path}) =====\n{procs.logs()}", file=sys.stderr)
        raise
    finally:
        procs.kill_groups()
