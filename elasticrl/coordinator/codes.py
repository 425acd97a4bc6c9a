"""The one place where elasticrl errors and gRPC status codes are translated, both directions.

The server aborts with ``status_for(exc)``; the client raises ``error_from_rpc(err)``. A trailing
metadata entry ``elasticrl-error`` names the exact class, so codes that several classes share
(FAILED_PRECONDITION: fenced, stale epoch, run closed) come back as the class that was raised.
On a Session stream a failed operation is an ``Error`` message carrying the same two things (code
value and class name); ``error_from_status`` reads both forms.
"""

from __future__ import annotations

import grpc

from elasticrl import errors

ERROR_KEY = "elasticrl-error"

_CODES: dict[type[errors.ElasticRLError], grpc.StatusCode] = {
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.FencedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RunClosedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotReadyError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceLimitError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.AuthError: grpc.StatusCode.UNAUTHENTICATED,
    errors.CoordinatorTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.CoordinatorUnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.InternalError: grpc.StatusCode.INTERNAL,
}
_BY_NAME = {cls.__name__: cls for cls in _CODES}
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FencedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceLimitError,
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthError,
    grpc.StatusCode.PERMISSION_DENIED: errors.AuthError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.CoordinatorTimeoutError,
    grpc.StatusCode.CANCELLED: errors.CoordinatorTimeoutError,
    grpc.StatusCode.UNAVAILABLE: errors.CoordinatorUnavailableError,
}
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_for(exc: errors.ElasticRLError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status code and trailing metadata the server sends for ``exc``."""
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls], ((ERROR_KEY, cls.__name__),)
    return grpc.StatusCode.INTERNAL, ((ERROR_KEY, errors.InternalError.__name__),)


def error_from_rpc(err: grpc.RpcError, address: str) -> errors.ElasticRLError:
    """Turn a failed call into the matching elasticrl exception (message keeps the server's words)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = (err.details() if hasattr(err, "details") else None) or str(code)
    name = None
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_KEY:
            name = value
    return error_from_status(code, name, detail, address)


def error_from_status(
    code: grpc.StatusCode | int, class_name: str | None, message: str, address: str
) -> errors.ElasticRLError:
    """The elasticrl exception for a status ``code`` (enum or its integer value, as a Session
    ``Error`` carries it) and the class name the server sent, if any; the class name wins."""
    if isinstance(code, int):
        code = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    cls = _BY_NAME.get(class_name or "") or _BY_CODE.get(code, errors.InternalError)
    if cls is errors.CoordinatorUnavailableError:
        return cls(f"coordinator at {address} is unreachable: {message}")
    if cls is errors.AuthError:
        return cls(f"coordinator at {address} refused the call: {message} (check the token sent: a file named by --token-file, "
                   "--rdzv-conf token_file=, [coordinator] token_file or $ELASTICRL_TOKEN_FILE, else $ELASTICRL_TOKEN itself)")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and not class_name:  # the client's own deadline, not an answer
        return cls(f"coordinator at {address} did not answer within the call's deadline: {message}")
    return cls(message)


def error_from_session(error, address: str) -> errors.ElasticRLError:
    """``error_from_status`` for a Session stream's ``Error`` message (an operation's failure)."""
    return error_from_status(error.code, error.error_class, error.message, address)


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def is_retryable(err: BaseException) -> bool:
    """Transport failures worth retrying with backoff: the coordinator may be restarting
    (UNAVAILABLE), or its transport dropped the call under a storm of new streams (CANCELLED,
    which our clients never cause on a call they still wait for: they time out, as
    DEADLINE_EXCEEDED). Safe for every call: each that changes state carries a request id, and
    the rest are idempotent."""
    return isinstance(err, grpc.RpcError) and hasattr(err, "code") and err.code() in RETRYABLE
