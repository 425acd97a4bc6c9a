"""The elasticrl exception family.

The coordinator raises these inside its core; the gRPC layer turns each into one status code
(``elasticrl.coordinator.codes``) and the client turns the code back into the same class, so
callers on both sides of the wire catch the same exceptions. Nothing else in the package maps
gRPC errors.
"""

from __future__ import annotations


class ElasticRLError(Exception):
    """Base of every error elasticrl raises on purpose."""


class InvalidRequestError(ElasticRLError, ValueError):
    """A request field is malformed or out of range; the message names the field and the fix."""


class NotFoundError(ElasticRLError, LookupError):
    """The run, member or key named by a request does not exist."""


class FencedError(ElasticRLError):
    """The caller's incarnation is no longer live (evicted, left, or replaced by a newer process).

    A fenced process must stop touching shared state and join again as a new incarnation.
    """


class StaleEpochError(FencedError):
    """The caller's epoch predates its own membership: its view of the run is out of date."""


class RunClosedError(ElasticRLError):
    """The run was closed; nothing more can join it or rendezvous in it."""


class NotReadyError(ElasticRLError):
    """The thing asked for exists but is not ready yet (e.g. fetching an iteration before it seals)."""


class ResourceLimitError(ElasticRLError):
    """A per-run limit (members, KV bytes) would be exceeded."""


class AuthError(ElasticRLError, PermissionError):
    """The coordinator refused the call's token (or no token was sent)."""


class CoordinatorUnavailableError(ElasticRLError, ConnectionError):
    """The coordinator could not be reached within the client's reconnect budget."""


class CoordinatorTimeoutError(ElasticRLError, TimeoutError):
    """A call ran past its deadline, or was cancelled, before the coordinator answered."""


class BarrierTimeoutError(ElasticRLError, TimeoutError):
    """A barrier with the REPORT timeout policy passed its deadline; ``missing`` lists who was late."""

    def __init__(self, message: str, *, name: str, missing: list[str], arrived: list[str]):
        super().__init__(message)
        self.name = name
        self.missing = missing
        self.arrived = arrived


class RoundTimeoutError(ElasticRLError, TimeoutError):
    """A rendezvous round did not gather ``min_nodes`` before its join timeout."""


class InternalError(ElasticRLError):
    """The coordinator hit an unexpected error (a bug: the message carries its description)."""
