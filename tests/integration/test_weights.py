"""Policy weights through a real coordinator: publish and fetch ~10 MB of tensors, a fetch that
waits for the next version, stale and corrupted publishes refused, SIGKILL and restart, token auth."""

from __future__ import annotations

import hashlib
import random
import threading

import grpc
import pytest
import torch

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.errors import AuthError, FencedError, InvalidRequestError
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.weights import pack_state_dict, unpack_state_dict

pytestmark = pytest.mark.integration
RUN = "policy-run"


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    """About 10 MB: two float32 matrices, a bf16 vector and a step counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(1024, 1024, generator=g),
        "layers.1.weight": torch.randn(1024, 1440, generator=g),
        "norm.weight": torch.randn(4096, generator=g).to(torch.bfloat16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def small_blob(seed: int) -> bytes:
    return pack_state_dict({"w": torch.full((8,), float(seed))})


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.fixture
def sched(coordinator):
    with SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=20) as c:
        yield c


def raw_chunks(data: bytes, *, version: int, sha256: str | None = None, total: int | None = None, step: int = 1 << 20):
    digest = sha256 or hashlib.sha256(data).hexdigest()
    for offset in range(0, len(data), step):
        yield spb.WeightChunk(run_id=RUN, version=version, total_bytes=len(data) if total is None else total,
                              offset=offset, data=data[offset:offset + step], sha256=digest, format="safetensors")


@pytest.mark.timeout(120)
def test_publish_10mb_and_fetch_it_back_equal(sched):
    assert sched.fetch_weights(RUN) is None  # nothing published yet: an empty answer, not an error
    state = state_dict(1)
    blob = pack_state_dict(state)
    assert len(blob) > 10_000_000  # several 4 MiB chunks each way
    sched.publish_weights(RUN, 1, blob)
    version, got = sched.fetch_weights(RUN)
    assert version == 1 and got == blob
    assert_same_state(unpack_state_dict(got), state)
    assert sched.fetch_weights(RUN, have_version=1) is None  # nothing newer than what the caller holds
    assert sched.fetch_weights("other-run") is None


@pytest.mark.timeout(60)
def test_a_waiting_fetch_returns_the_version_another_thread_publishes(sched, coordinator):
    sched.publish_weights(RUN, 1, small_blob(1))
    result: list = []
    fetcher = threading.Thread(target=lambda: result.append(sched.fetch_weights(RUN, have_version=1, wait_s=5)))
    fetcher.start()
    fetcher.join(timeout=0.3)
    assert fetcher.is_alive(), f"the fetch did not wait for a newer version: {result}"
    with SchedulerClient(coordinator.address, call_timeout_s=5) as publisher:
        publisher.publish_weights(RUN, 2, small_blob(2))
    fetcher.join(timeout=30)
    assert not fetcher.is_alive()
    assert result == [(2, small_blob(2))]


@pytest.mark.timeout(60)
def test_stale_publish_is_refused_naming_both_versions_and_a_retry_is_fine(sched):
    sched.publish_weights(RUN, 3, small_blob(3))
    with pytest.raises(FencedError, match=r"version 2 is older than the stored version 3"):
        sched.publish_weights(RUN, 2, small_blob(2))
    with pytest.raises(FencedError, match=r"version 3 is already stored"):
        sched.publish_weights(RUN, 3, small_blob(4))
    sched.publish_weights(RUN, 3, small_blob(3))  # the same version and bytes again: a retry, accepted
    assert sched.fetch_weights(RUN) == (3, small_blob(3))


@pytest.mark.timeout(60)
def test_torn_or_corrupted_uploads_are_refused_and_the_previous_version_is_served(sched, coordinator):
    sched.publish_weights(RUN, 1, small_blob(1))
    data = bytes(pack_state_dict(state_dict(2)))  # a memoryview: protobuf wants bytes
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    cases = [
        (raw_chunks(bytes(flipped), version=2, sha256=hashlib.sha256(data).hexdigest()), "sha256: the"),
        (raw_chunks(data[: len(data) // 2], version=2, total=len(data)), "total_bytes: the stream ended after"),
        (raw_chunks(data, version=2, sha256="not-a-digest"), "sha256: 'not-a-digest'"),
        (iter([]), "chunks: the stream ended before its first WeightChunk"),
    ]
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        for chunks, match in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.PublishWeights(chunks, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert match in err.value.details()
    assert sched.fetch_weights(RUN) == (1, small_blob(1))
    with pytest.raises(InvalidRequestError, match="total_bytes: 0 must be >= 1"):
        sched.publish_weights(RUN, 2, b"")
    with pytest.raises(InvalidRequestError, match="safetensors"):
        sched.publish_weights(RUN, 2, b"\x80\x04\x95" * 100)  # a pickle is no safetensors file
    assert "internal error" not in coordinator.log()


@pytest.mark.timeout(120)
def test_newest_weights_survive_a_coordinator_sigkill(sched, coordinator):
    sched.publish_weights(RUN, 1, small_blob(1))
    state = state_dict(2)
    blob = pack_state_dict(state)
    sched.publish_weights(RUN, 2, blob)
    coordinator.kill()
    coordinator.start()
    version, got = sched.fetch_weights(RUN)  # the same client reconnects to the restarted coordinator
    assert version == 2 and got == blob
    assert_same_state(unpack_state_dict(got), state)
    with pytest.raises(FencedError, match="version 1 is older than the stored version 2"):
        sched.publish_weights(RUN, 1, small_blob(1))
    sched.publish_weights(RUN, 3, small_blob(3))
    assert sched.fetch_weights(RUN, have_version=2) == (3, small_blob(3))


@pytest.mark.timeout(60)
def test_weights_calls_need_the_token(coordinator_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("weights-token\n")
    coord = coordinator_factory(extra_args=["--token-file", str(token_file)])
    with SchedulerClient(coord.address, reconnect_timeout_s=2) as anon:
        with pytest.raises(AuthError, match="token"):
            anon.publish_weights(RUN, 1, small_blob(1))
        with pytest.raises(AuthError, match="token"):
            anon.fetch_weights(RUN)
    with SchedulerClient(coord.address, token="wrong", reconnect_timeout_s=2) as wrong:
        with pytest.raises(AuthError):
            wrong.fetch_weights(RUN, wait_s=1)
    with SchedulerClient(coord.address, token="weights-token") as good:
        good.publish_weights(RUN, 1, small_blob(1))
        assert good.fetch_weights(RUN) == (1, small_blob(1))


@pytest.mark.timeout(120)
def test_garbage_bytes_to_the_weights_calls_are_refused_cleanly(coordinator, sched):
    sched.publish_weights(RUN, 1, small_blob(1))
    rng = random.Random(7)
    publish = spb.WeightChunk(run_id=RUN, version=2, total_bytes=8, offset=0, data=b"12345678",
                              sha256="0" * 64, format="safetensors").SerializeToString()
    fetch = spb.FetchWeightsRequest(run_id=RUN, have_version=0, wait_s=0.01).SerializeToString()
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
    seen = set()
    with grpc.insecure_channel(coordinator.address) as channel:
        up = channel.stream_unary("/elasticrl.v1.Scheduler/PublishWeights")
        down = channel.unary_stream("/elasticrl.v1.Scheduler/FetchWeights")
        for seed, call in ((publish, lambda p: up(iter([p]), timeout=5)), (fetch, lambda p: list(down(p, timeout=5)))):
            for _ in range(60):
                data = bytearray(seed)
                for _ in range(rng.randint(1, 4)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                try:
                    call(bytes(data))
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                    assert code in allowed, f"{code}: {err.details()}"
                    assert not (err.details() or "").startswith("internal error"), err.details()
                seen.add(code)
    assert grpc.StatusCode.INVALID_ARGUMENT in seen, seen
    assert "internal error" not in coordinator.log()
    assert sched.fetch_weights(RUN) == (1, small_blob(1))
