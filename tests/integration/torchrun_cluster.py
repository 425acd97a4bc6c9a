"""Several real ``torchrun`` agents on this machine, each running ``allreduce_worker.py``.

Used by ``test_torchrun.py`` and ``bench/rendezvous.py``. A node is one torchrun agent and its
workers; ``TorchrunNode.kill()`` is a node's death: SIGKILL of the agent and of every worker
(torchrun starts workers in their own sessions, so killing the agent alone would orphan them).
Worker pids come from the workers' own reports and from ``/proc/<pid>/task/*/children``; a pid is
only signalled after its command line shows it is ours. Nothing here uses ``pkill``.
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

WORKER = pathlib.Path(__file__).resolve().with_name("allreduce_worker.py")
REPO = WORKER.parent.parent.parent


def _children(pid: int) -> list[int]:
    """Descendants of ``pid`` (recursively), from /proc; [] where /proc cannot tell."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_children(kid)]
    return found


def _is_ours(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


def _sigkill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


class TorchrunNode:
    """One torchrun agent (a "node") and the workers it starts."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], workdir: pathlib.Path):
        self.name = name
        self.log_path = workdir / f"{name}.torchrun.log"
        self.report_path = workdir / "out" / f"{name}.jsonl"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.started_at = time.time()
        self._pids: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def records(self, event: str | None = None) -> list[dict]:
        try:
            lines = self.report_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        recs = []
        for line in lines:
            with contextlib.suppress(ValueError):
                recs.append(json.loads(line))
        return [r for r in recs if event is None or r["event"] == event]

    def worker_pids(self) -> list[int]:
        """Our worker processes that are still running."""
        pids = {r["pid"] for r in self.records("start")} | self._pids
        if self.alive():
            pids |= set(_children(self.pid))
        self._pids = {p for p in pids if _is_ours(p, WORKER.name)}
        return sorted(self._pids)

    def kill_worker(self) -> int:
        """SIGKILL the newest live worker (not the agent); returns its pid."""
        live = set(self.worker_pids())
        newest = [r["pid"] for r in self.records("start") if r["pid"] in live]
        if not newest:
            raise AssertionError(f"node {self.name} has no live worker to kill")
        _sigkill(newest[-1])
        return newest[-1]

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the agent and every worker (SIGSTOP/SIGCONT: a paused node)."""
        for pid in [self.pid, *self.worker_pids()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """The node dies: SIGKILL the agent first (so it cannot react), then every worker."""
        workers = self.worker_pids()
        _sigkill(self.pid)
        for pid in workers + [p for p in self.worker_pids() if p not in workers]:
            _sigkill(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        keep = [t for t in text if "NumPy" not in t and "_conversion_method_template" not in t]
        return "\n".join(keep[-lines:])


class TorchrunCluster:
    """Agents of one rendezvous (``backend`` c10d or elasticrl) on localhost, gloo, one worker each."""

    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        nnodes: str = "2:4",
        rdzv_conf: dict[str, object] | None = None,
        max_restarts: int = 3,
        worker_args: list[str] | None = None,
        monitor_interval_s: float = 0.1,
    ):
        self.workdir = workdir
        (workdir / "out").mkdir(parents=True, exist_ok=True)
        self.stop_file = workdir / "stop"
        self.fatal_file = workdir / "fatal"  # a node's name written here fails its worker for good
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.nnodes = nnodes
        self.rdzv_conf = dict(rdzv_conf or {})
        self.max_restarts = max_restarts
        self.worker_args = list(worker_args or [])
        self.monitor_interval_s = monitor_interval_s
        self.nodes: dict[str, TorchrunNode] = {}

    def start_node(self, name: str, **extra_conf) -> TorchrunNode:
        conf = {**self.rdzv_conf, **extra_conf}
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", "--nproc-per-node=1", f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}",
            f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            "--local-addr=127.0.0.1",
        ]
        if conf:
            cmd.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
        cmd += [str(WORKER), "--out", str(self.workdir / "out"), "--stop-file", str(self.stop_file),
                "--fatal-file", str(self.fatal_file), *self.worker_args]
        env = {
            **os.environ,
            "ELASTICRL_TEST_NODE": name,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
        }
        node = TorchrunNode(name, cmd, env, self.workdir)
        self.nodes[name] = node
        return node

    def first_ok(self, name: str, world: int, since: float) -> float | None:
        """When node ``name`` first reported all-reducing in a world of ``world`` after ``since``."""
        for r in self.nodes[name].records("ok"):
            if r["world"] == world and r["t"] > since:
                return r["t"]
        return None

    def wait_world(self, names, world: int, *, since: float, timeout_s: float, give_up=None) -> float | None:
        """Wait until every node in ``names`` all-reduces in a world of ``world`` (reported after
        ``since``); returns the moment the last of them did. None when ``give_up()`` says so
        (e.g. every agent exited); AssertionError with the agents' logs after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            times = [self.first_ok(n, world, since) for n in names]
            if all(t is not None for t in times):
                return max(times)
            if give_up is not None and give_up():
                return None
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nodes {list(names)} did not all-reduce in a world of {world} within {timeout_s:.0f}s; "
                    f"last reports: {self.summary()}\n{self.logs()}"
                )
            time.sleep(0.05)

    def latest(self, name: str, event: str = "ok") -> dict | None:
        recs = self.nodes[name].records(event)
        return recs[-1] if recs else None

    def rank0(self, names) -> str:
        """The node whose worker holds global rank 0 in the newest world."""
        latest = {n: self.latest(n, "ready") for n in names}
        zero = [n for n, r in latest.items() if r is not None and r["rank"] == 0]
        assert len(zero) == 1, f"expected exactly one rank-0 node, got {latest}"
        return zero[0]

    def summary(self) -> dict:
        return {n: (self.latest(n, "start") or {}) | {"last": (node.records() or [{}])[-1].get("event"), "agent_alive": node.alive()}
                for n, node in self.nodes.items()}

    def logs(self, lines: int = 15) -> str:
        return "\n".join(f"--- {n} (agent pid {node.pid}) ---\n{node.log_tail(lines)}" for n, node in self.nodes.items())

    def close(self) -> None:
        """Kill every agent and worker this cluster started."""
        for node in self.nodes.values():
            node.kill()
