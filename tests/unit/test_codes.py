"""Which failed calls the clients retry: transport-level refusals (UNAVAILABLE while the
coordinator restarts, CANCELLED when its transport drops calls under a storm of new streams), never
an answer of the coordinator's own (a bad request, a fence) nor the caller's own deadline; and how
often the retries of an outage are logged."""

from __future__ import annotations

import grpc
import pytest

from elasticrl.coordinator import codes, wire


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


def test_an_outage_is_warned_about_once_a_while_not_at_every_retry():
    # Found by an operator: a coordinator down for a minute wrote ~3 warnings a second per worker.
    now = [0.0]
    notes = wire.OutageNotes(10.0, clock=lambda: now[0])
    said = []
    for _ in range(25):  # a retry every 0.5 s for 12 s
        said.append(notes.failed())
        now[0] += 0.5
    assert said[0] == "" and said[20] == " (failing for 10s, 21 attempts)"
    assert [i for i, s in enumerate(said) if s is not None] == [0, 20]
    notes.ok()  # back: the next failure is a new outage, warned about at once
    assert notes.failed() == "" and notes.failed() is None
