"""``bench/collectives.py`` under a real ``torchrun --standalone`` with gloo on CPU ranks: every op
on 2 and 3 ranks prints its nccl-tests table and writes JSON with no wrong elements; the send/recv
emulations pass the same check; a deliberately broken collective is caught by the check (non-zero
exit, exact wrong counts); and a plain ``python bench/collectives.py`` runs as a world of one with
JSON on stdout. Each launch has a hard subprocess timeout; tiny sizes keep the whole file ~20 s on
two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bench import collectives_lib as lib
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SCRIPT = REPO / "bench" / "collectives.py"
LAUNCH_TIMEOUT_S = 120
SMALL = ["-b", "8", "-e", "64K", "-f", "4", "-n", "3", "-w", "1"]
SIZES = lib.size_sweep(8, 64 * 1024, 4)


def _env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(nproc: int, script, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _table_rows(stdout: str, op: str) -> list[list[str]]:
    """The data rows under ``# <op>  impl: ...`` up to its average line."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"# {op}  impl:"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("# Avg bus bandwidth"))
    return [ln.split() for ln in lines[start:end] if ln and not ln.startswith("#")]


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_op_under_torchrun_with_gloo(nproc, tmp_path):
    out = tmp_path / "coll.json"
    proc = _torchrun(nproc, SCRIPT, ["--backend", "gloo", "--op", "all", *SMALL, "--report", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    assert f"ranks: {nproc}" in proc.stdout and "# Using devices" in proc.stdout
    assert "# Environment" in proc.stdout and "# Wrong elements total : 0 OK" in proc.stdout
    report = json.loads(out.read_text())
    assert report["wrong_total"] == 0 and report["env"]["world_size"] == nproc
    assert [r["op"] for r in report["results"]] == list(lib.OPS)
    for res in report["results"]:
        op = res["op"]
        plan = lib.plan_rows(op, SIZES, 4, nproc)
        # JSON rows: nccl-tests' size/count columns, all checked, busbw = algbw * factor.
        assert [(r["size"], r["count"]) for r in res["rows"]] == [(p.size, p.count) for p in plan], op
        for r in res["rows"]:
            assert r["wrong"] == 0 and r["time_us"] > 0, (op, r)
            assert r["busbw"] == pytest.approx(r["algbw"] * lib.bus_factor(op, nproc)), op
        # The printed table has the same rows, #wrong 0, the redop and root columns.
        rows = _table_rows(proc.stdout, op)
        assert [int(r[0]) for r in rows] == [p.size for p in plan], op
        assert {r[-1] for r in rows} == {"0"}, op
        assert {r[3] for r in rows} == {"sum" if op in lib.REDUCING_OPS else "none"}
        assert {r[4] for r in rows} == {"0" if op == "broadcast" else "-1"}
    impls = {r["op"]: r["impl"] for r in report["results"]}
    assert impls["reduce_scatter"] == "p2p" and impls["all_reduce"] == "native"


def test_send_recv_emulations_pass_the_check_in_bfloat16(tmp_path):
    out = tmp_path / "p2p.json"
    args = ["--backend", "gloo", "--impl", "p2p", "--op", "all_gather,reduce_scatter,all_to_all", "-d", "bf16", "-o", "max",
            *SMALL, "--json", str(out)]
    proc = _torchrun(3, SCRIPT, args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert {r["op"]: r["impl"] for r in report["results"]} == {"all_gather": "p2p", "reduce_scatter": "p2p", "all_to_all": "p2p"}
    assert all(row["wrong"] == 0 and row["type"] == "bfloat16" for r in report["results"] for row in r["rows"])


BROKEN_WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from bench import collectives

    def backwards_ring(self):  # sends to r-1 and receives from r+1: the wrong neighbour's data
        b = self.b
        b.p2p([("send", self.inp, (b.rank - 1) % b.n), ("recv", self.out, (b.rank + 1) % b.n)])

    collectives.OpRun._native_sendrecv = backwards_ring
    sys.exit(collectives.main(sys.argv[1:]))
""")


def test_the_check_catches_a_broken_collective(tmp_path):
    worker = tmp_path / "broken_worker.py"
    worker.write_text(BROKEN_WORKER.format(repo=str(REPO)))
    out = tmp_path / "broken.json"
    proc = _torchrun(3, worker, ["--backend", "gloo", "--op", "all_reduce,sendrecv", *SMALL, "--json", str(out)])
    assert proc.returncode != 0, "a wrong result must fail the run"
    assert "FAILED" in proc.stdout
    by_op = {r["op"]: r for r in json.loads(out.read_text())["results"]}
    assert all(row["wrong"] == 0 for row in by_op["all_reduce"]["rows"])
    # Data from r+1 instead of r-1 differs in every element, on each of the 3 ranks.
    assert [row["wrong"] for row in by_op["sendrecv"]["rows"]] == [3 * row["count"] for row in by_op["sendrecv"]["rows"]]


def test_single_process_run_writes_json_to_stdout():
    cmd = [sys.executable, str(SCRIPT), "--backend", "gloo", "--op", "all", "-b", "8", "-e", "1K", "-f", "8", "-n", "2", "-w", "1", "--json", "-"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)  # the tables went to stderr
    assert report["env"]["world_size"] == 1 and report["wrong_total"] == 0
    assert len(report["results"]) == len(lib.OPS) and "# all_reduce  impl: native" in proc.stderr


def test_under_the_elasticrl_rendezvous_two_agents_report_two_nodes(coordinator_factory, tmp_path):
    coord = coordinator_factory(lease_ttl_s=1.0, durable=False)
    out = tmp_path / "rdzv.json"
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=elasticrl", f"--rdzv-endpoint={coord.address}", "--rdzv-id=collectives",
               "--rdzv-conf=last_call_timeout=1,lease_ttl=1,join_timeout=60", "--local-addr=127.0.0.1", "--max-restarts=0",
               str(SCRIPT), "--backend", "gloo", "--op", "all_reduce,sendrecv", *SMALL, "--report", "--json", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    report = json.loads(out.read_text())
    assert report["wrong_total"] == 0 and report["env"]["world_size"] == 2
    assert report["env"]["layout"]["nnodes"] == 2 and report["env"]["layout"]["ranks_per_node"] == 1
    assert sorted(r["node_rank"] for r in report["env"]["ranks"]) == [0, 1]
    assert "torchrun nodes: 2, ranks per node: 1" in "".join(logs)
