"""torchrun rendezvous: time to the first round and recovery after a node's SIGKILL, c10d vs elasticrl.

Both backends run the same setup in one invocation: ``--nodes`` stock torchrun agents on this
host (``--nnodes=MIN:NODES``, gloo, ``--nproc-per-node=1``), each running
``tests/integration/allreduce_worker.py`` (all-reduces in a loop and reports its world size).

* first round: from starting the agents until every worker all-reduces in a world of NODES;
* kill other: SIGKILL a node that neither hosts the store (c10d: the agent that serves the
  TCPStore, started with ``is_host=1``) nor holds rank 0, then the time until every survivor
  all-reduces again in a world of NODES-1;
* kill rank 0: on a fresh cluster, SIGKILL the store node (c10d) / the rank-0 node (elasticrl),
  same measure.

A node's death is SIGKILL of its agent and its workers. A recovery that does not happen within
``--cap`` seconds is "never"; one where every survivor's agent exits is "crashed" (the agent's
last error is shown). Both backends use the same last-call window; everything else is each
backend's default (c10d: 5 s keep-alive, 3 missed beats; elasticrl: ``--lease-ttl``). c10d workers
exit at once on a failed collective (its best case); elasticrl workers use ``restart_grace``
unless ``--elasticrl-grace 0``.

    python bench/rendezvous.py                     # both backends, ~4-6 min on 2 cores
    python bench/rendezvous.py --last-call 2 --lease-ttl 2 --json-out /tmp/rdzv.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shutil
import socket
import sys
import tempfile
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

from bench.benchmain import unwind_on_sigterm  # noqa: E402
from tests.integration.torchrun_cluster import TorchrunCluster  # noqa: E402

GOAL_SPEEDUP = 3.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/rendezvous.py", description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="c10d,elasticrl", help="comma-separated rendezvous backends (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=3, help="torchrun agents, one worker each (default: %(default)s)")
    p.add_argument("--min-nodes", type=int, default=2, help="MIN of --nnodes=MIN:NODES (default: %(default)s)")
    p.add_argument("--last-call", type=float, default=30.0, help="last-call window of both backends, seconds (default: %(default)s, torch's c10d default)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="elasticrl lease TTL, seconds (default: %(default)s, the coordinator's default)")
    p.add_argument("--elasticrl-grace", type=float, default=-1.0, help="elasticrl workers' restart_grace on a failed collective, seconds; <0: its default (1.5 x TTL + 2), 0: exit at once (default: %(default)s)")
    p.add_argument("--cap", type=float, default=120.0, help="give up on a recovery after this long, seconds (default: %(default)s)")
    p.add_argument("--form-timeout", type=float, default=120.0, help="give up on forming the first round after this long, seconds (default: %(default)s)")
    p.add_argument("--json-out", help="also write the JSON results to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (agent logs, worker reports)")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Coordinator:
    """An ``elasticrl coordinator`` subprocess on a free port, durable state in ``workdir``."""

    def __init__(self, workdir: pathlib.Path, lease_ttl_s: float):
        from elasticrl.coordinator.launch import start_coordinator

        self.proc, port = start_coordinator(
            workdir / "coordinator.port", workdir / "coordinator.log",
            cwd=REPO, lease_ttl_s=lease_ttl_s, state_dir=workdir / "state",
        )
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def _last_error(log_tail: str) -> str:
    lines = [ln for ln in log_tail.splitlines() if "Error" in ln or "error" in ln]
    if not lines:
        return "exited"
    return lines[-1].strip().removeprefix("torch.distributed.elastic.rendezvous.api.")[:160]


class Backend:
    """Builds clusters of one backend; knows which node is the store / rank-0 node."""

    def __init__(self, name: str, args, workdir: pathlib.Path):
        self.name, self.args, self.workdir = name, args, workdir / name
        self.workdir.mkdir(parents=True)
        self.coordinator = Coordinator(self.workdir, args.lease_ttl) if name == "elasticrl" else None
        self._n = 0

    def cluster(self) -> TorchrunCluster:
        self._n += 1
        a = self.args
        if self.name == "elasticrl":
            endpoint = self.coordinator.address
            conf = {"last_call_timeout": a.last_call, "lease_ttl": a.lease_ttl}
            worker_args = [] if a.elasticrl_grace < 0 else ["--grace", str(a.elasticrl_grace)]
        else:
            endpoint = f"127.0.0.1:{_free_port()}"
            conf = {"last_call_timeout": max(1, round(a.last_call))}  # c10d takes whole seconds
            worker_args = ["--grace", "0"]
        return TorchrunCluster(
            self.workdir / f"cluster{self._n}", backend=self.name, endpoint=endpoint, run_id=f"bench-{self._n}",
            nnodes=f"{a.min_nodes}:{a.nodes}", rdzv_conf=conf, max_restarts=100, worker_args=worker_args,
        )

    def start(self, cluster: TorchrunCluster, names: list[str]) -> None:
        for i, name in enumerate(names):
            extra = {"is_host": int(i == 0)} if self.name == "c10d" else {}
            cluster.start_node(name, **extra)

    def store_node(self, cluster: TorchrunCluster, names: list[str]) -> str:
        return names[0] if self.name == "c10d" else cluster.rank0(names)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()


def _form(backend: Backend, cluster: TorchrunCluster, names: list[str], timeout_s: float) -> float:
    t0 = time.time()
    backend.start(cluster, names)
    exited = lambda: any(not cluster.nodes[n].alive() for n in names)  # noqa: E731
    formed = cluster.wait_world(names, len(names), since=t0, timeout_s=timeout_s, give_up=exited)
    if formed is None:
        raise RuntimeError(f"[{backend.name}] an agent exited before the first round:\n{cluster.logs()}")
    return formed - t0


def _recover(cluster: TorchrunCluster, victim: str, names: list[str], cap_s: float) -> dict:
    survivors = [n for n in names if n != victim]
    t_kill = time.time()
    cluster.nodes[victim].kill()
    crashed = lambda: not any(cluster.nodes[n].alive() for n in survivors)  # noqa: E731
    try:
        t_back = cluster.wait_world(survivors, len(survivors), since=t_kill, timeout_s=cap_s, give_up=crashed)
    except AssertionError:
        return {"status": "never", "seconds": None, "detail": f"no recovery within {cap_s:.0f}s"}
    if t_back is None:
        detail = _last_error(cluster.nodes[survivors[0]].log_tail(40))
        return {"status": "crashed", "seconds": round(time.time() - t_kill, 2), "detail": detail}
    restarts = sorted({cluster.latest(n, "start")["restart"] for n in survivors})
    return {"status": "ok", "seconds": round(t_back - t_kill, 2), "restarts_spent": restarts}


def run_backend(name: str, args, workdir: pathlib.Path) -> dict:
    names = [chr(ord("a") + i) for i in range(args.nodes)]
    backend = Backend(name, args, workdir)
    result: dict = {"backend": name}
    try:
        for scenario in ("kill_other", "kill_rank0"):
            cluster = backend.cluster()
            try:
                formed = _form(backend, cluster, names, args.form_timeout)
                result.setdefault("first_round_s", []).append(round(formed, 2))
                store = backend.store_node(cluster, names)
                if scenario == "kill_other":
                    victim = next(n for n in reversed(names) if n != store and n != cluster.rank0(names))
                else:
                    victim = store
                print(f"[{name}] formed in {formed:.1f}s; {scenario}: SIGKILL node {victim}", file=sys.stderr)
                result[scenario] = _recover(cluster, victim, names, args.cap) | {"victim": victim}
                print(f"[{name}] {scenario}: {result[scenario]}", file=sys.stderr)
            finally:
                cluster.close()
    finally:
        backend.close()
    return result


def _cell(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['seconds']:.1f}"
    if r["status"] == "crashed":
        return f"crashed after {r['seconds']:.1f}s ({r['detail'].split(':')[0]})"
    return f"never (>{r['detail'].split()[-1]})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unwind_on_sigterm()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="elasticrl-bench-rdzv-"))
    results = []
    try:
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            results.append(run_backend(name, args, workdir))
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    by = {r["backend"]: r for r in results}
    speedup = {}
    if "c10d" in by and "elasticrl" in by:
        for s in ("kill_other", "kill_rank0"):
            base, ours = by["c10d"][s], by["elasticrl"][s]
            if ours["status"] == "ok":
                speedup[s] = f"c10d {base['status']}" if base["status"] != "ok" else round(base["seconds"] / ours["seconds"], 1)
    report = {
        "host": platform.node(), "python": platform.python_version(), "cpus": __import__("os").cpu_count(),
        "torch": __import__("torch").__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json_out", "keep")},
        "results": results, "speedup": speedup, "goal_speedup": GOAL_SPEEDUP,
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(f"\n{'backend':<10} {'first round (s)':<16} {'kill non-store node -> running (s)':<36} kill rank-0/store node -> running (s)")
    for r in results:
        first = "/".join(f"{x:.1f}" for x in r["first_round_s"])
        print(f"{r['backend']:<10} {first:<16} {_cell(r['kill_other']):<36} {_cell(r['kill_rank0'])}")
    if speedup:
        cells = [f"{v}x" if isinstance(v, float) else str(v) for v in (speedup.get("kill_other", "-"), speedup.get("kill_rank0", "-"))]
        print(f"{'speedup':<10} {'':<16} {cells[0]:<36} {cells[1]}   (goal >= {GOAL_SPEEDUP:g}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
