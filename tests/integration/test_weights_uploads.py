"""Weight uploads against a real coordinator process: a declared size costs no memory (chunks are
spooled to a temp file), concurrent uploads are capped, a torn upload leaves no temp file behind,
and a normal publish still round-trips."""

from __future__ import annotations

import pathlib
import queue
import re
import time

import grpc
import pytest
import torch

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.errors import FencedError
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.weights import pack_state_dict
from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.waits]
RUN = "spool-run"
DECLARED = 3 << 30  # what a hostile or broken client claims it will send
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid``, from /proc/<pid>/status (VmRSS is in kB)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def peak_rss_bytes(pid: int, seconds: float) -> int:
    """The largest RSS of ``pid`` seen over ``seconds`` (an allocation takes a while to touch)."""
    peak, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.05)
    return peak


def temp_files(coordinator) -> list[pathlib.Path]:
    """Every temp file under the coordinator's weights directory."""
    root = coordinator.state_dir / "weights"
    return sorted(root.rglob("*.tmp")) if root.exists() else []


class OpenUpload:
    """A PublishWeights stream whose chunks the test sends one by one; ``cancel`` tears it."""

    def __init__(self, stub, version: int, total_bytes: int = DECLARED):
        self.version = version
        self.total_bytes = total_bytes
        self.sent = 0
        self._chunks: queue.Queue = queue.Queue()
        self.future = stub.PublishWeights.future(iter(self._chunks.get, None), timeout=120)

    def send(self, data: bytes) -> None:
        self._chunks.put(spb.WeightChunk(
            run_id=RUN, version=self.version, total_bytes=self.total_bytes, offset=self.sent, data=data,
            sha256="0" * 64, format="safetensors",
        ))
        self.sent += len(data)

    def cancel(self) -> None:
        self.future.cancel()
        self._chunks.put(None)


@pytest.fixture
def stub(coordinator):
    with grpc.insecure_channel(coordinator.address) as channel:
        yield spb_grpc.SchedulerStub(channel)


def blob(seed: int) -> bytes:
    return pack_state_dict({"w": torch.full((1000,), float(seed)), "b": torch.arange(seed + 3, dtype=torch.float32)})


@pytest.mark.timeout(60)
def test_an_upload_declaring_3_gib_costs_no_memory_for_the_declared_size(coordinator, stub):
    base = rss_bytes(coordinator.pid)
    upload = OpenUpload(stub, version=1)
    try:
        upload.send(b"0123456789")
        # The coordinator has taken the chunk once it spooled it to a temp file (or, before the
        # fix, once it allocated the declared size).
        wait_until(lambda: temp_files(coordinator) or rss_bytes(coordinator.pid) - base > 200 * MiB, 20,
                   message="the coordinator taking the first chunk")
        grown = peak_rss_bytes(coordinator.pid, seconds=1.0) - base
        assert grown < 200 * MiB, f"the coordinator's RSS grew by {grown / MiB:.0f} MiB for a 10-byte chunk"
        [spool] = temp_files(coordinator)
        assert spool.stat().st_size == 10  # what arrived, not what was declared
    finally:
        upload.cancel()
    wait_until(lambda: not temp_files(coordinator), 20, message="the torn upload's temp file being removed")


@pytest.mark.timeout(60)
def test_the_weights_limit_is_the_coordinators_max_weights_gb(coordinator_factory):
    from elasticrl.errors import ResourceLimitError

    coordinator = coordinator_factory(extra_args=["--max-weights-gb", str(2 / 1024)])  # 2 MiB
    small, big = blob(1), pack_state_dict({"w": torch.zeros(1 << 20)})  # 4 MiB of fp32
    with SchedulerClient(coordinator.address, call_timeout_s=10) as client:
        with pytest.raises(ResourceLimitError, match=r"weights limit of 2097152 bytes .*--max-weights-gb"):
            client.publish_weights(RUN, 1, bytes(big))
        client.publish_weights(RUN, 2, bytes(small))
        assert client.fetch_weights(RUN) == (2, bytes(small))


@pytest.mark.timeout(120)
def test_concurrent_uploads_are_capped_and_a_torn_one_frees_its_slot_and_file(coordinator_factory):
    coordinator = coordinator_factory(extra_args=["--max-weight-uploads", "2"])
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        held = [OpenUpload(stub, version=v) for v in (1, 2)]
        try:
            for up in held:
                up.send(b"x" * 100)
            wait_until(lambda: len(temp_files(coordinator)) == 2, 20, message="two uploads spooling")
            third = OpenUpload(stub, version=3, total_bytes=1000)
            third.send(b"y" * 10)
            with pytest.raises(grpc.RpcError) as err:
                third.future.result(timeout=30)
            third.cancel()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert "--max-weight-uploads" in err.value.details() and "2 weight uploads" in err.value.details()
            assert len(temp_files(coordinator)) == 2  # the refused upload took nothing

            held[0].cancel()  # a torn stream: its temp file goes, its slot is free again
            wait_until(lambda: len(temp_files(coordinator)) == 1, 20, message="the torn upload's temp file being removed")
            data = blob(4)
            with SchedulerClient(coordinator.address, call_timeout_s=10) as client:
                client.publish_weights(RUN, 4, data)
                assert client.fetch_weights(RUN) == (4, data)
        finally:
            for up in held:
                up.cancel()
        wait_until(lambda: not temp_files(coordinator), 20, message="every temp file being removed")
    published = sorted(p.name for p in (coordinator.state_dir / "weights" / RUN).iterdir())
    assert published == ["current.json", f"v{4:020d}.safetensors"], published


@pytest.mark.timeout(120)
@pytest.mark.parametrize("durable", [True, False])
def test_publish_and_fetch_round_trip_with_and_without_a_state_dir(coordinator_factory, durable):
    """Plain publish/fetch through the spooled path; a retried publish of the same version and a
    stale one are answered as before and leave no temp file."""
    coordinator = coordinator_factory(durable=durable)
    first, second = blob(1), pack_state_dict({"w": torch.randn(3 * MiB // 4)})  # 3 MiB: several chunks
    with SchedulerClient(coordinator.address, call_timeout_s=10) as client:
        client.publish_weights(RUN, 1, first)
        assert client.fetch_weights(RUN) == (1, first)
        client.publish_weights(RUN, 2, second, chunk_bytes=MiB // 2)
        client.publish_weights(RUN, 2, second)  # a retry: idempotent
        with pytest.raises(FencedError, match="version 1 is older than the stored version 2"):
            client.publish_weights(RUN, 1, first)
        assert client.fetch_weights(RUN) == (2, second)
        assert client.fetch_weights(RUN, have_version=2) is None
    if durable:
        assert not temp_files(coordinator)
        assert sorted(p.name for p in (coordinator.state_dir / "weights" / RUN).iterdir()) == [
            "current.json", f"v{2:020d}.safetensors"]
