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


def test_a_late_node_with_another_config_stops_naming_it_and_the_run_goes_on(tmp_path):
    port = free_port()
    config = tmp_path / "run.toml"
    demo = (REPO / "elasticrl" / "configs" / "demo.toml").read_text()
    config.write_text(demo.replace("iterations = 40", "iterations = 1000").replace("eval_interval = 10", "eval_interval = 0")
                      .replace("warmup_steps = 10", "warmup_steps = 2").replace("every_iterations = 10", "every_iterations = 1000"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []
    metrics = tmp_path / "runs" / "same" / "metrics.jsonl"

    def start(args: list[str], name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")
        p = subprocess.Popen(installed(args), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    def records() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    node = ["torchrun", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=elasticrl",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=same", "-m", "elasticrl.node", "--config", str(config)]
    try:
        start(["elasticrl", "coordinator", "--port", str(port), "--state-dir", str(tmp_path / "state")], "coordinator")

        def listening() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
            return False

        wait_until(listening, 30, message="the coordinator listening")
        first = start(node, "node-a")
        wait_until(lambda: records() or first.poll() is not None, 120, message="node-a training")
        # A node that joins later with another learning rate and model width: whichever rank it
        # draws in the world they form, the settings the run trained with are the run's.
        late = start([*node, "--trainer.lr=0.01", "--model.d_model=32"], "node-b")
        try:
            late.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the late node did not stop:\n{logs()}")
        stopped_at = len(records())
        wait_until(lambda: len(records()) >= stopped_at + 3 or first.poll() is not None, 120, message="node-a going on")
        assert first.poll() is None, logs()
    finally:
        stop_all(procs)
    text = (tmp_path / "node-b.log").read_text()
    assert late.returncode == 1 and "this node's config differs from the run's (rank " in text, logs()
    assert "those it ran with so far): model.d_model = 32 here, 64 there; trainer.lr = 0.01 here, 0.003 there" in text, text[-3000:]
    assert "stops instead of restarting its workers" in text and text.count("ConfigError: this node's config differs") <= 2
    assert records()[-1]["world_size"] == 1
