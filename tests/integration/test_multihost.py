"""Two nodes and a coordinator on three "hosts" (network namespaces), launched with the docs' own commands.

The test runs the shell blocks of deploy/README.md's "Launching by hand" as they are written: the
coordinator block (a fresh token, ``--host 0.0.0.0``, ``--token-file``) in one namespace, and the
node block (``ELASTICRL_TOKEN`` / ``ELASTICRL_COORDINATOR`` / ``ELASTICRL_NODE_NAME`` and stock
``torchrun --rdzv-backend=elasticrl --local-addr=... -m elasticrl.node --config
elasticrl/configs/demo.toml``) in a namespace per node, changing only the addresses, the node
name, ``exec`` in front of the long-running command, and a few appended flags (a port file and the
documented ``--metrics-port`` for the coordinator; fewer iterations for the nodes). If the README
changes so that a block no longer has what the test edits, the test fails and says which.

The three reach each other only over a bridge (``tests/integration/netns.py``): every gRPC call,
the workers' TCPStore and gloo's collectives cross a real network between distinct addresses,
which localhost runs never test. Nothing is shared between the nodes but the filesystem, and the
run does not use it: each node runs in a directory of its own with its own copy of the token, run
directory and checkpoints (``--checkpoint.every_node=true``).

The test checks that both nodes reached the coordinator from their own addresses (the
coordinator's TCP connections, and the ``local_addr`` each agent registered), scrapes the
coordinator's Prometheus endpoint with ``curl`` from a node's host, then SIGKILLs every process of
node 2 a few iterations in; node 1 must re-form alone, resume from its own checkpoint and finish
every iteration, leaving a final checkpoint that loads, and a second scrape must show the
eviction, and more barriers, sealed iterations and trajectory bytes than the first. Skips where
the machine cannot make network namespaces (not root, no iproute2, a container without the
privilege).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.integration.netns import NetnsUnavailable, VirtualLan, established_peers
from tests.integration.prometheus import Samples, parse_exposition, value

pytestmark = [pytest.mark.integration]

COORDINATOR_PORT = 50051  # the documented port; the namespace is ours alone, so it is free
METRICS_PORT = 9464  # the documented --metrics-port
RUN_ID = "my-run"  # the documented --rdzv-id: the coordinator is this test's own
ITERATIONS = 12
CHECKPOINT_EVERY = 3
KILL_AFTER = 3
"""Node 2 dies once an iteration >= this one is reported in a world of two (a checkpoint exists)."""
START_TIMEOUT_S = 120  # both nodes import torch, warm up and meet on 2 busy cores
FINISH_TIMEOUT_S = 120  # the 5 s lease of the docs, a re-formed world, the remaining iterations
STATUS_TIMEOUT_S = 20
COORDINATOR_START_S = 20
DEPLOY_README = REPO / "deploy" / "README.md"


def readme_block(heading: str) -> str:
    """The first ``sh`` block after the line of deploy/README.md that contains ``heading``."""
    text = DEPLOY_README.read_text()
    at = text.find(heading)
    assert at >= 0, f"deploy/README.md no longer has {heading!r}; update this test with the docs"
    m = re.compile(r"^```sh\n(.*?)^```", re.S | re.M).search(text, at)
    assert m, f"deploy/README.md: no ```sh block after {heading!r}"
    return m.group(1)


def edit(block: str, replacements: dict[str, str]) -> str:
    """``block`` with each key replaced by its value; every key must occur exactly once."""
    for old, new in replacements.items():
        assert block.count(old) == 1, f"deploy/README.md changed: expected {old!r} once in this block:\n{block}"
        block = block.replace(old, new)
    return block


def coordinator_script() -> str:
    """The documented coordinator block, plus a port file (to know it listens) and metrics."""
    return edit(readme_block("**Host A, the coordinator.**"), {
        "elasticrl coordinator ": "exec elasticrl coordinator ",
        "--lease-ttl 5": f"--lease-ttl 5 --port-file coordinator.port --metrics-port {METRICS_PORT}",
    })


def node_script(coordinator_addr: str, node_addr: str, node_name: str) -> str:
    """The documented node block for one host, running fewer iterations."""
    return edit(readme_block("**Each node host**"), {
        "COORD_ADDR=10.0.0.1": f"COORD_ADDR={coordinator_addr}",
        "NODE_ADDR=10.0.0.2": f"NODE_ADDR={node_addr}",
        "ELASTICRL_NODE_NAME=node-1": f"ELASTICRL_NODE_NAME={node_name}",
        "torchrun ": "exec torchrun ",
        "--checkpoint.every_node=true": (
            f"--checkpoint.every_node=true --run.iterations={ITERATIONS} --checkpoint.every_iterations={CHECKPOINT_EVERY}"
        ),
    })


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


def child_env() -> dict[str, str]:
    """This machine's environment minus what the documented blocks set themselves, with the
    virtualenv's scripts (``elasticrl``, ``torchrun``) first on PATH, as ``. .venv/bin/activate`` does."""
    # A proxy of the machine's own network is unreachable from the namespaces (and gRPC honours it).
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    for key in ("ELASTICRL_TOKEN", "ELASTICRL_COORDINATOR", "ELASTICRL_NODE_NAME", "GLOO_SOCKET_IFNAME"):
        # No GLOO_SOCKET_IFNAME: the hostname resolves to a loopback address here, so this also
        # checks that a node picks the interface that routes to MASTER_ADDR by itself.
        env.pop(key, None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}")
    env["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy"
    return env


def host_dir(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A host's working directory: what a checkout of the repository offers the documented
    commands (``elasticrl/configs/demo.toml``), and nothing the other hosts write."""
    d = tmp_path / name
    d.mkdir()
    (d / "elasticrl").symlink_to(REPO / "elasticrl", target_is_directory=True)
    return d


class StartedProcesses:
    """What the test started, by name: killed by process group at the end, logs shown on failure."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, name: str):
        return self.tmp / f"{name}.log"

    def start(self, name: str, host, argv: list[str], env: dict[str, str], cwd) -> subprocess.Popen:
        self.procs[name] = host.start(argv, self.log_path(name), env=env, cwd=cwd)
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


def coordinator_status(lan: VirtualLan, token: str) -> dict:
    """``elasticrl status --all --json`` asked from the coordinator's host."""
    argv = [
        sys.executable, "-m", "elasticrl.cli", "status", "--coordinator", f"127.0.0.1:{COORDINATOR_PORT}",
        "--run", RUN_ID, "--all", "--json",
    ]
    done = subprocess.run(
        lan.hosts["coordinator"].command(argv), capture_output=True, text=True, timeout=STATUS_TIMEOUT_S,
        cwd=REPO, env={**child_env(), "ELASTICRL_TOKEN": token},
    )
    assert done.returncode == 0, f"elasticrl status failed ({done.returncode}): {done.stderr}"
    return json.loads(done.stdout)


def curl_metrics(host, coordinator_addr: str) -> Samples:
    """``curl`` the coordinator's metrics from ``host``, across the bridge."""
    argv = ["curl", "--silent", "--show-error", "--fail", "--max-time", "10", f"http://{coordinator_addr}:{METRICS_PORT}/metrics"]
    done = subprocess.run(host.command(argv), capture_output=True, text=True, timeout=STATUS_TIMEOUT_S)
    assert done.returncode == 0, f"curl of the metrics failed ({done.returncode}): {done.stderr}"
    return parse_exposition(done.stdout)


@pytest.mark.timeout(360)
def test_two_hosts_train_and_the_survivor_finishes_when_one_dies(lan, tmp_path):
    from elasticrl.coordinator.launch import wait_for_port
    from elasticrl.train.checkpoint import load_checkpoint

    for tool in ("openssl", "curl"):  # the documented coordinator block makes its token with openssl
        if shutil.which(tool) is None:
            pytest.skip(f"the documented commands need {tool}, which this machine lacks")
    coord, node1, node2 = lan.hosts["coordinator"], lan.hosts["node1"], lan.hosts["node2"]
    dirs = {name: host_dir(tmp_path, name) for name in ("coordinator", "node1", "node2")}
    run_dirs = {name: dirs[name] / "runs" / RUN_ID for name in ("node1", "node2")}  # the block's --run.run_dir
    procs = StartedProcesses(tmp_path)
    try:
        coordinator = procs.start("coordinator", coord, ["bash", "-euc", coordinator_script()], child_env(), dirs["coordinator"])
        port = wait_for_port(
            coordinator, dirs["coordinator"] / "coordinator.port", timeout_s=COORDINATOR_START_S,
            log_path=procs.log_path("coordinator"),
        )
        assert port == COORDINATOR_PORT
        token = (dirs["coordinator"] / "coordinator.token").read_text().strip()
        assert len(token) == 64, "the documented block writes a 32-byte hex token"
        for name, host in (("node1", node1), ("node2", node2)):
            shutil.copy(dirs["coordinator"] / "coordinator.token", dirs[name])  # "copy coordinator.token to every node host"
            procs.start(name, host, ["bash", "-euc", node_script(coord.addr, host.addr, name)], child_env(), dirs[name])

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
        before = curl_metrics(node1, coord.addr)
        assert value(before, "elasticrl_members", run=RUN_ID, state="live") == 2, "two torchrun agents"
        evictions = ("lease_expired", "stream_lost")
        assert sum(value(before, "elasticrl_member_evictions_total", run=RUN_ID, reason=r) for r in evictions) == 0

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
        assert last["checkpoint"] == str(pathlib.Path("runs") / RUN_ID / "checkpoints" / f"iter-{ITERATIONS:06d}")

        # The counters moved: node 2's agent was evicted (by its keep-alive stream, broken with the
        # killed process, or by its lease, whichever came first), and training went on after it.
        after = curl_metrics(node1, coord.addr)
        assert sum(value(after, "elasticrl_member_evictions_total", run=RUN_ID, reason=r) for r in evictions) >= 1
        assert value(after, "elasticrl_members", run=RUN_ID, state="evicted") >= 1
        for name, run in (
            ("elasticrl_barrier_wait_seconds_count", f"{RUN_ID}.workers"),
            ("elasticrl_scheduler_iterations_sealed_total", f"{RUN_ID}.rollout"),
            ("elasticrl_scheduler_trajectory_bytes_total", f"{RUN_ID}.rollout"),
        ):
            assert 0 < value(before, name, run=run) < value(after, name, run=run), (name, run)
        assert value(after, "elasticrl_scheduler_iterations_sealed_total", run=f"{RUN_ID}.rollout") == ITERATIONS

        # Each agent registered the address it advertises to the others' workers (--local-addr).
        runs = coordinator_status(lan, token)["runs"]
        assert len(runs) == 1, runs
        members = runs[0]["snapshot"]["members"] + runs[0]["departed"]
        agents = [m for m in members if m["capabilities"].get("role") == "torchrun-agent"]
        assert {m["capabilities"]["local_addr"] for m in agents} == {node1.addr, node2.addr}, agents
        # Node 2's agent could not say goodbye: the coordinator evicted it when its lease lapsed.
        (dead,) = [m for m in agents if m["capabilities"]["local_addr"] == node2.addr]
        assert dead["state"] == "MEMBER_STATE_EVICTED", dead
    except BaseException:
        print(f"\n===== logs of every process (host dirs under {tmp_path}) =====\n{procs.logs()}", file=sys.stderr)
        raise
    finally:
        procs.kill_groups()
