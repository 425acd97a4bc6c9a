"""Server TLS the way deploy/README.md sets it up: a self-signed CA made in the test signs the
coordinator's certificate (SAN = the address clients dial); clients trust the CA, not the
certificate. Every client surface (coordinator calls, scheduler calls, the weight stream, the
``elasticrl status`` CLI) works over it with the token, and fails clearly without either."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from elasticrl.errors import AuthError, CoordinatorUnavailableError
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make the test's certificates")
    d = tmp_path / "pki"
    d.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=elasticrl test CA", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "coordinator.key", "-out", "coordinator.csr",
            "-subj", "/CN=coordinator", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "coordinator.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "coordinator.crt", "-days", "1", "-extfile", "san.ext", cwd=d)
    # A second, unrelated CA: a client trusting it must not connect.
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt", "-days", "1",
            "-subj", "/CN=someone else", cwd=d)
    (d / "token").write_text("tls-test-token\n")
    return d


def test_every_client_surface_over_tls_with_a_token(coordinator_factory, pki):
    import torch

    from elasticrl.scheduler.client import SchedulerClient
    from elasticrl.scheduler.state import Sampling, TaskSpec
    from elasticrl.scheduler.weights import pack_state_dict, unpack_state_dict

    coord = coordinator_factory(extra_args=[
        "--tls-cert", str(pki / "coordinator.crt"), "--tls-key", str(pki / "coordinator.key"),
        "--token-file", str(pki / "token"),
    ])
    ca, token = str(pki / "ca.crt"), "tls-test-token"
    with SchedulerClient(coord.address, tls_ca=ca, token=token, call_timeout_s=5, reconnect_timeout_s=5) as client:
        assert client.join("r.workers", "a").epoch == 1
        client.kv_set("r.workers", {b"k": b"v"})
        client.submit_iteration("r.rollout", 1, [TaskSpec(task_id="t0", prompt_ids=[1, 2], num_samples=2, sampling=Sampling())])
        assert client.iteration_status("r.rollout", 1)["tasks_total"] == 1
        weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
        client.publish_weights("r.rollout", 1, pack_state_dict(weights))
        version, blob = client.fetch_weights("r.rollout", have_version=0)
        assert version == 1 and torch.equal(unpack_state_dict(blob)["w"], weights["w"])

    status = subprocess.run(
        [sys.executable, "-m", "elasticrl.cli", "status", "--coordinator", coord.address, "--tls-ca", ca,
         "--token-file", str(pki / "token"), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert {r["snapshot"]["run_id"] for r in json.loads(status.stdout)["runs"]} >= {"r.workers"}
    # The token file and CA the workers read ($ELASTICRL_TOKEN_FILE, $ELASTICRL_TLS_CA, set by the
    # torchrun plugin) serve the CLI too: the deploy scripts' wait loops run `status` bare.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRL_")}
    (pki / "wrong").write_text("not-the-token\n")
    for token_file, rc in ((pki / "token", 0), (pki / "wrong", 1)):
        status = subprocess.run(
            [sys.executable, "-m", "elasticrl.cli", "status", "--coordinator", coord.address, "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**env, "ELASTICRL_TOKEN_FILE": str(token_file), "ELASTICRL_TLS_CA": ca},
        )
        assert status.returncode == rc and "Traceback" not in status.stderr, status.stderr
    assert "refused the call" in status.stderr and "$ELASTICRL_TOKEN_FILE" in status.stderr, status.stderr

    with SchedulerClient(coord.address, tls_ca=ca, call_timeout_s=2, reconnect_timeout_s=2) as no_token:
        with pytest.raises(AuthError):
            no_token.join("r.workers", "b")
    with SchedulerClient(coord.address, tls_ca=str(pki / "other.crt"), token=token, call_timeout_s=2,
                         reconnect_timeout_s=2) as wrong_ca:
        with pytest.raises(CoordinatorUnavailableError):
            wrong_ca.join("r.workers", "c")
    with SchedulerClient(coord.address, token=token, call_timeout_s=2, reconnect_timeout_s=2) as plaintext:
        with pytest.raises(CoordinatorUnavailableError):
            plaintext.join("r.workers", "d")


@pytest.mark.timeout(180)
def test_a_torchrun_node_trains_over_tls(coordinator_factory, pki, tmp_path):
    """The documented client settings of deploy/README.md's TLS table: the agent trusts the CA
    through ``--rdzv-conf=tls_ca=``, the worker through ``--coordinator.tls_ca=``; the token
    reaches both through ``ELASTICRL_TOKEN``."""
    import os

    from elasticrl.train.checkpoint import load_checkpoint

    coord = coordinator_factory(extra_args=[
        "--tls-cert", str(pki / "coordinator.crt"), "--tls-key", str(pki / "coordinator.key"),
        "--token-file", str(pki / "token"),
    ])
    ca, run_dir = str(pki / "ca.crt"), tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(ELASTICRL_TOKEN="tls-test-token", ELASTICRL_COORDINATOR=coord.address, OMP_NUM_THREADS="1")
    node = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
         "--rdzv-backend=elasticrl", f"--rdzv-endpoint={coord.address}", "--rdzv-id=tls-run", f"--rdzv-conf=tls_ca={ca}",
         "-m", "elasticrl.node", "--config", "elasticrl/configs/demo.toml", f"--coordinator.tls_ca={ca}",
         f"--run.run_dir={run_dir}", "--run.iterations=2", "--run.eval_interval=0", "--trainer.warmup_steps=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
    )
    assert node.returncode == 0, node.stdout[-3000:] + node.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert load_checkpoint(records[-1]["checkpoint"]).iteration == 2


def test_a_session_relay_carries_member_sessions_over_tls_with_its_own_token(coordinator_factory, pki):
    from elasticrl.coordinator.client import CoordinatorClient, Membership
    from elasticrl.coordinator.session_relay import RelayThread

    coord = coordinator_factory(extra_args=[
        "--tls-cert", str(pki / "coordinator.crt"), "--tls-key", str(pki / "coordinator.key"),
        "--token-file", str(pki / "token"),
    ])
    ca, token = str(pki / "ca.crt"), "tls-test-token"
    relay = RelayThread(coord.address, token=token, tls_ca=ca)
    try:
        with CoordinatorClient(coord.address, tls_ca=ca, token=token, call_timeout_s=5) as client:
            m = Membership(client, "relayed", "a", relay=relay.path)
            assert m.streaming.wait(10) and relay.streams_opened == 1
            assert m.arrive("b", timeout_s=10).arrived == ["a"]
            m.leave()
    finally:
        relay.stop()
