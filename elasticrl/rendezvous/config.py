"""``RendezvousConfig``: the plugin's settings, built from torchrun's ``RendezvousParameters``.

torchrun passes ``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id`` and ``--local-addr`` as fields and
every ``--rdzv-conf`` pair as a string; this module turns them into one typed, validated value and
says how to fix a bad one. The keys are listed in the ``elasticrl.rendezvous`` docstring.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket

from elasticrl.coordinator import validate
from elasticrl.coordinator.state import DEFAULT_REJOIN_TIMEOUT_S

log = logging.getLogger(__name__)

BACKEND = "elasticrl"
"""The name torchrun's --rdzv-backend gives this plugin."""
DEFAULT_PORT = 50051
# Keys torchrun itself adds to every handler's parameters; accepted and ignored.
TORCHRUN_KEYS = frozenset({"timeout", "rank", "is_host", "local_addr"})


@dataclasses.dataclass(kw_only=True, frozen=True)
class RendezvousConfig:
    endpoint: str
    """HOST:PORT of the coordinator (``--rdzv-endpoint``; the port defaults to 50051)."""
    run_id: str
    """The run (``--rdzv-id``): members, rounds and store keys are scoped by it."""
    min_nodes: int
    """Fewest agents a round may have (``--nnodes=MIN:MAX``)."""
    max_nodes: int
    """Most agents a round may have; more wait for a later round."""
    node_id: str
    """This agent's member id, unique per agent; default ``<hostname>-<pid>``."""
    local_addr: str | None = None
    """Address other nodes' workers reach this host at (``--local-addr``); default its FQDN."""
    last_call_s: float = 2.0
    """After ``min_nodes`` joined a round, wait this long for more before completing it, seconds."""
    join_timeout_s: float = 600.0
    """A round that has not reached ``min_nodes`` this long after it opened fails, seconds."""
    rejoin_timeout_s: float = DEFAULT_REJOIN_TIMEOUT_S
    """After a failure, hold the new round this long (past the last call) for the previous round's
    agents that are alive but still stopping their workers, seconds; 0 does not hold. The default
    matches torchrun's wait between SIGTERM and SIGKILL of a worker."""
    lease_ttl_s: float = 0.0
    """This agent's lease TTL, seconds; 0 takes the coordinator's ``--lease-ttl``."""
    read_timeout_s: float = 60.0
    """Default timeout of the agent store's blocking get/wait, seconds."""
    token_file: str | None = None
    """File holding the coordinator's shared token; None: the token itself from $ELASTICRL_TOKEN."""
    tls_ca: str | None = None
    """PEM CA bundle to verify a TLS coordinator; None talks plaintext."""
    call_timeout_s: float = 10.0
    """Deadline of one coordinator call, seconds."""
    connect_timeout_s: float = 30.0
    """How long an unreachable coordinator is retried before giving up, seconds."""
    in_place: bool = False
    """A lost node does not restart the survivors' workers once they watch their world (rank 0
    sets ``rendezvous.worker.armed_key``): ``-m elasticrl.node`` workers re-form it in place
    (``train/reform.py``), or exit at once where they cannot, so torchrun restarts them. A node
    that joins still restarts everyone into the larger world. Only for ``elasticrl.node``
    workers: other scripts never say they watch, so their agents restart them as without it."""
    session_relay: bool = True
    """The agent runs a node relay (``coordinator/session_relay.py``) and its workers' ``Membership``
    streams go through it: one Session stream per node to the coordinator instead of one per
    worker. A worker that cannot reach it streams to the coordinator directly."""

    def __post_init__(self) -> None:
        if ":" not in self.endpoint or not self.endpoint.rsplit(":", 1)[1].isdigit():
            raise ValueError(f"--rdzv-endpoint: {self.endpoint!r} is not HOST:PORT of the elasticrl coordinator")
        for name, value in (("--rdzv-id", self.run_id), ("node_id", self.node_id)):
            try:
                validate.ident(name, value)
            except ValueError as exc:
                raise ValueError(str(exc)) from None
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes: {self.min_nodes}:{self.max_nodes} must satisfy 1 <= MIN <= MAX")
        for name in ("last_call_s", "join_timeout_s", "read_timeout_s", "call_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_KEY_OF[name]}: {getattr(self, name)!r} must be a positive number of seconds")
        if self.rejoin_timeout_s < 0:
            raise ValueError(f"rejoin_timeout: {self.rejoin_timeout_s!r} must be >= 0 seconds (0: do not hold)")
        if self.lease_ttl_s < 0 or 0 < self.lease_ttl_s < 0.1:
            raise ValueError(f"lease_ttl: {self.lease_ttl_s!r} must be >= 0.1 seconds (or 0 for the coordinator's default)")

    @classmethod
    def from_params(cls, params) -> "RendezvousConfig":
        """Build from torch's ``RendezvousParameters``; unknown ``--rdzv-conf`` keys are logged."""
        conf = dict(params.config)
        unknown = sorted(set(conf) - set(_CONF_KEYS) - TORCHRUN_KEYS)
        if unknown:
            log.warning(
                "ignoring unknown --rdzv-conf key(s) %s; the elasticrl backend knows: %s",
                ", ".join(unknown), ", ".join(sorted(_CONF_KEYS)),
            )
        kwargs = {}
        for key, field in _CONF_KEYS.items():
            value = conf.get(key)
            if value is None or value == "":
                continue
            if field.endswith("_s"):
                kwargs[field] = _seconds_value(key, value)
            elif field in ("in_place", "session_relay"):
                kwargs[field] = _bool_value(key, value)
            else:
                kwargs[field] = str(value)
        endpoint = (params.endpoint or "").strip()
        if not endpoint:
            raise ValueError("--rdzv-endpoint: the elasticrl backend needs HOST:PORT of an `elasticrl coordinator`")
        if ":" not in endpoint:
            endpoint = f"{endpoint}:{DEFAULT_PORT}"
        kwargs.setdefault("node_id", default_node_id())
        return cls(
            endpoint=endpoint,
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=params.local_addr,
            **kwargs,
        )


_CONF_KEYS = {
    "last_call_timeout": "last_call_s",
    "join_timeout": "join_timeout_s",
    "rejoin_timeout": "rejoin_timeout_s",
    "lease_ttl": "lease_ttl_s",
    "read_timeout": "read_timeout_s",
    "token_file": "token_file",
    "tls_ca": "tls_ca",
    "node_id": "node_id",
    "call_timeout": "call_timeout_s",
    "connect_timeout": "connect_timeout_s",
    "in_place": "in_place",
    "session_relay": "session_relay",
}
_KEY_OF = {field: key for key, field in _CONF_KEYS.items()}


def _seconds_value(key: str, value) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"--rdzv-conf {key}={value!r}: expected a (finite) number of seconds, e.g. {key}=5")
    return seconds


def _bool_value(key: str, value) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"--rdzv-conf {key}={value!r}: expected true or false")


def default_node_id() -> str:
    """``<hostname>-<pid>``: unique per agent process, readable in ``elasticrl status``."""
    host = re.sub(r"[^A-Za-z0-9._:@=+-]", "-", socket.gethostname()).lstrip("._:@=+-") or "node"
    suffix = f"-{os.getpid()}"
    return host[: validate.MAX_ID_LEN - len(suffix)] + suffix
