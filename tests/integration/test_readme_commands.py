"""The README's "Using it" commands, run as written: ``elasticrl coordinator`` and two stock
``torchrun --rdzv-backend=elasticrl ... -m elasticrl.node --config my_run.toml`` agents. Only what
must differ on a test machine is edited (the port, the state directory, the coordinator's host, one
process per node, the config file's path), and each edit must still apply: if the README drifts,
this test says which edit no longer does. The workers get no coordinator address of their own:
the plugin hands it to them."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def using_it_block() -> list[str]:
    """The commands of the first ```bash block under "## Using it", continuations joined, comments cut."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Using it"):]
    block = section[section.index("```bash\n") + len("```bash\n"):section.index("```\n", section.index("```bash"))]
    lines = block.replace("\\\n", " ").splitlines()
    return [" ".join(line.split("#", 1)[0].split()) for line in lines if line.strip()]


def edit(line: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert old in line, f"the README's command no longer contains {old!r} (edit it here too): {line}"
        line = line.replace(old, new)
    return line


def installed(command: list[str]) -> list[str]:
    """The command with its program taken from this interpreter's environment (its bin/)."""
    return [os.path.join(os.path.dirname(sys.executable), command[0]), *command[1:]]


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group, then SIGKILL what is left after 15 s."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_the_readme_coordinator_and_torchrun_commands_run_as_written(tmp_path):
    lines = using_it_block()
    coordinator_line = next(line for line in lines if line.startswith("elasticrl coordinator "))
    torchrun_line = next(line for line in lines if line.startswith("torchrun "))
    port = free_port()
    demo = (REPO / "elasticrl" / "configs" / "demo.toml").read_text()
    config = tmp_path / "my_run.toml"
    config.write_text(edit(demo, [("iterations = 40", "iterations = 2"), ("eval_interval = 10", "eval_interval = 0"),
                                  ("warmup_steps = 10", "warmup_steps = 2")]))
    coordinator_cmd = edit(coordinator_line, [("50051", str(port)), ("/var/lib/elasticrl", str(tmp_path / "state"))])
    torchrun_cmd = edit(torchrun_line, [("COORD_HOST:50051", f"127.0.0.1:{port}"), ("--nproc-per-node=8", "--nproc-per-node=1"),
                                        ("my_run.toml", str(config))])
    assert "--coordinator.address" not in torchrun_cmd and "--rdzv-backend=elasticrl" in torchrun_cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRL_")}  # nothing but what the README says
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []

    def start(cmd: str, name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")
        p = subprocess.Popen(installed(shlex.split(cmd)), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        return p

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    try:
        coordinator = start(coordinator_cmd, "coordinator")

        def listening() -> bool:
            assert coordinator.poll() is None, logs()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
            return False

        wait_until(listening, 30, message="the coordinator listening")
        nodes = [start(torchrun_cmd, f"node-{k}") for k in range(2)]
        deadline = time.monotonic() + 180
        for node in nodes:
            try:
                node.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"torchrun did not finish:\n{logs()}")
        assert [n.returncode for n in nodes] == [0, 0], logs()
        records = (tmp_path / "runs" / "my-run" / "metrics.jsonl").read_text().splitlines()
        assert len(records) == 2 and '"world_size": 2' in records[-1], records
    finally:
        stop_all(procs)
