"""Which failed calls the clients retry: transport-level refusals (UNAVAILABLE while the
coordinator restarts, CANCELLED when its transport drops calls under a storm of new streams), never
an answer of the coordinator's own (a bad request, a fence) nor the caller's own deadline; and how
often the retries of an outage are logged."""

from __future__ import annotations

import grpc
import pytest

from elasticrl.coordinator import codes


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


@pytest.mark.parametrize("code, retried", [
    (grpc.StatusCode.UNAVAILABLE, True),
    (grpc.StatusCode.CANCELLED, True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, False),
    (grpc.StatusCode.INVALID_ARGUMENT, False),
    (grpc.StatusCode.FAILED_PRECONDITION, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (grpc.StatusCode.INTERNAL, False),
])
def test_only_transport_refusals_are_retried(code, retried):
    assert codes.is_retryable(Failed(code)) is retried


def test_other_exceptions_are_not_retried():
    assert not codes.is_retryable(RuntimeError("UNAVAILABLE"))

