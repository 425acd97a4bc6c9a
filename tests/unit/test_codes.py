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



def test_a_token_file_is_read_by_its_first_line_everywhere(tmp_path, monkeypatch):
    # Found by an operator: the docs said "first line", the code read the whole file, so a second
    # line (a comment, the next token) made every call's token differ from the coordinator's.
    from elasticrl.coordinator.client import resolve_token
    from elasticrl.coordinator.server import CoordinatorConfig

    path = tmp_path / "token"
    path.write_text("s3cret \n# rotated on 2026-11-27\n")
    assert resolve_token(None, str(path)) == CoordinatorConfig(token_file=str(path)).read_token() == "s3cret"
    path.write_text("\ns3cret\n")
    with pytest.raises(ValueError, match="has no token on its first line"):
        CoordinatorConfig(token_file=str(path)).read_token()
    monkeypatch.delenv("ELASTICRL_TOKEN", raising=False)
    assert resolve_token(None, str(path)) is None
