"""deploy/slurm/elasticrl.sbatch run end to end on this machine, with stand-ins for Slurm's tools.

``srun`` starts its command once per "node" of the allocation on this machine (output to the
``--output`` file with ``%N`` filled in), and ``scontrol show hostnames`` names this host. The
script itself runs unchanged: it makes the token, starts the coordinator, waits for it, launches
one torchrun agent per node through ``srun``, and cleans up at exit. Two CPU nodes train the demo
config (fewer iterations) and every iteration must be logged in a world of two.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ITERATIONS = 4

SRUN = r"""#!/bin/bash
# stand-in for srun: drop its options, run the command once per node of the job, here
set -u
out=/dev/null
while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in --output=*) out=${1#--output=} ;; esac
    shift
done
pids=()
for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do
    "$@" > "${out//%N/node$i}" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

SCONTROL = """#!/bin/bash
# stand-in for `scontrol show hostnames`: every node of the job is this host
hostname
hostname
"""


def test_the_sbatch_script_trains_the_demo_on_two_nodes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    config = tmp_path / "demo.toml"
    demo = (REPO / "elasticrl" / "configs" / "demo.toml").read_text()
    assert "iterations = 40" in demo, "the demo config changed; update this test"
    config.write_text(demo.replace("iterations = 40", f"iterations = {ITERATIONS}"))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTICRL_"))}
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '')}", TMPDIR=str(tmp_path), OMP_NUM_THREADS="1",
        SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="cpu[1-2]",
        PYTHON=sys.executable, CONFIG=str(config),
        RUN_DIR=str(run_dir), PORT=str(free_port()), GPUS_PER_NODE="1", LEASE_TTL="5",
        MIN_NODES="2",  # both agents meet before the first round, however slowly torch imports
    )
    done = subprocess.run(
        ["bash", str(REPO / "deploy" / "slurm" / "elasticrl.sbatch")], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=200,
    )
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert done.returncode == 0, f"sbatch script failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n{logs}"
    assert "coordinator: " in done.stdout and "nodes: 2 (min 2, max 2)" in done.stdout, done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    assert {r["world_size"] for r in records} == {2}
    assert {p.name for p in (run_dir / "logs").glob("*.log")} == {"coordinator.log", "node1.log", "node2.log"}
    # The script's exit trap stopped the coordinator and removed the token and the node-local state.
    assert not list(tmp_path.glob("elasticrl-token-*")) and not (tmp_path / "elasticrl-4242").exists()
