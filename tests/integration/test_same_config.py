"""A node started with another config than the run's stops at once, naming the settings that differ,
and the run goes on without it (found by an operator: a node with another learning rate and
iteration count joined, and the run stalled at a barrier it never reached, again after every
restart). Two stock torchrun agents on a real coordinator; the second one's config differs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time

import pytest

from tests.conftest import REPO, wait_until
from tests.integration.test_readme_commands import free_port, installed, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_node_with_another_config_stops_naming_it_and_the_run_goes_on(tmp_path):
    port = free_port()
    config = tmp_path / "run.toml"
    demo = (REPO / "elasticrl" / "configs" / "demo.toml").read_text()
    config.write_text(demo.replace("iterations = 40", "iterations = 3").replace("eval_interval = 10", "eval_interval = 0")
                      .replace("warmup_steps = 10", "warmup_steps = 2"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []

    def start(args: list[str], name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")
        p = subprocess.Popen(installed(args), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    node = ["torchrun", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=elasticrl",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=same", "-m", "elasticrl.node", "--config", str(config)]
    try:
        start(["elasticrl", "coordinator", "--port", str(port), "--state-dir", str(tmp_path / "state")], "coordinator")

        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
            return False

        wait_until(listening, 30, message="the coordinator listening")
        nodes = [start(node, "node-a"), start([*node, "--trainer.lr=0.01", "--run.iterations=2"], "node-b")]
        deadline = time.monotonic() + 200
        for p in nodes:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a torchrun agent did not finish:\n{logs()}")
    finally:
        stop_all(procs)
    # Two ranks, one config each: a tie, which the lowest rank's config wins. Either node may be it.
    codes = [p.returncode for p in nodes]
    assert sorted(codes) == [0, 1], (codes, logs())
    stopped = "node-a" if codes[0] else "node-b"
    text = (tmp_path / f"{stopped}.log").read_text()
    assert "this node's config differs from the run's (rank 0's, which 1 of 2 ranks share)" in text, logs()
    assert ("trainer.lr = 0.01 here, 0.003 there" if stopped == "node-b" else "trainer.lr = 0.003 here, 0.01 there") in text
    assert "run.iterations = " in text and "stops instead of restarting its workers" in text, text[-3000:]
    assert text.count("ConfigError: this node's config differs") <= 2, "it stopped at once, not after restarts"
    records = [json.loads(line) for line in (tmp_path / "runs" / "same" / "metrics.jsonl").read_text().splitlines()]
    want = 2 if stopped == "node-a" else 3  # the survivor's own run.iterations
    assert [r["iteration"] for r in records][-1] == want and records[-1]["world_size"] == 1, records
