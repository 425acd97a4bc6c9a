"""Sharded snapshots (torch.distributed.checkpoint) saved by a world of 3 and loaded by a world of
2, on CPU with gloo, for DDP, FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3, with the third node's own directory
deleted first: its shard must come from its buddy's copy.

Two ``torchrun --standalone`` launches of ``snapshot_worker.py`` per strategy (each under a hard
timeout, killed by process group on expiry): ``--phase save`` with ranks playing nodes a, b, c,
then ``--phase load`` with a, b and a model that starts from other weights. The loaded state must
equal the saved world's full state exactly (DCP copies bytes; nothing is recomputed), and no file
in a snapshot directory may be a pickle.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration]

WORKER = REPO / "tests" / "integration" / "snapshot_worker.py"
LAUNCH_TIMEOUT_S = 150


def launch(tmp: pathlib.Path, phase: str, strategy: str, nodes: list[str], log_name: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(nodes)}", str(WORKER),
        "--phase", phase, "--strategy", strategy, "--nodes", ",".join(nodes), "--root", str(tmp / "snap"),
        "--expect", str(tmp / "expect"), "--out", str(tmp / "result.json"),
    ]
    log_path = tmp / log_name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            pytest.fail(f"torchrun {phase} {strategy} ran past {LAUNCH_TIMEOUT_S}s\n{log_path.read_text()[-6000:]}")
    text = log_path.read_text()
    assert rc == 0, f"torchrun {phase} {strategy} exited {rc}\n{text[-6000:]}"
    return text


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_a_world_of_three_saves_shards_a_world_of_two_loads_them_with_a_lost_nodes_from_its_buddy(tmp_path, strategy):
    if strategy.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (the [deepspeed] extra)")
    launch(tmp_path, "save", strategy, ["a", "b", "c"], "save.log")
    snap = tmp_path / "snap"
    (sid,) = os.listdir(snap / "c")
    assert sid == "iter-000002-g1-w3", sid
    # Ring a -> b -> c -> a: each node holds its own shard and its predecessor's.
    held = {n: sorted(os.listdir(snap / n / sid)) for n in "abc"}
    assert held["a"] == ["shard-00000.json", "shard-00000.safetensors", "shard-00002.json", "shard-00002.safetensors"], held
    assert {f for fs in held.values() for f in fs} == {f"shard-0000{r}.{x}" for r in range(3) for x in ("json", "safetensors")}
    for path in snap.rglob("*"):  # no pickle: safetensors (a JSON header, then bytes) and JSON only
        if path.is_file():
            assert path.suffix in (".json", ".safetensors"), path
            data = path.read_bytes()
            if path.suffix == ".json":
                json.loads(data)
            else:
                n = int.from_bytes(data[:8], "little")
                header = json.loads(data[8:8 + n])
                assert "DCP_SHARDING_INFO" in header["__metadata__"], header  # DCP's chunk offsets

    shutil.rmtree(snap / "c")  # node c's host is gone with its memory: its shard survives on a only
    text = launch(tmp_path, "load", strategy, ["a", "b"], "load.log")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["iteration"] == 2 and result["record"] == {"iteration": 2, "loss": 0.5}, result
    assert result["model_keys"] and result["optimizer_keys"], result
    assert result["model_diff"] == 0.0 and result["optimizer_diff"] == 0.0, result
    assert result["steps"] == [2.0], result
    assert "resumed from iteration 2 (snapshot of rank 0, node a)" in text, text[-4000:]
    assert "from buddy copies only: shard(s) [2] of 3" in text, text[-4000:]
    assert "2 shard(s) fetched from other nodes" in text, text[-4000:]  # a lacks b's shard 1, b lacks c's shard 2
